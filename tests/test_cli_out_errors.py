"""Found by fuzzing: output paths and list flags of the other subcommands.  An unwritable --out of
`golden --from-msprobe` / `ttk-plugin` names --out; the main job refuses an output file that is a
directory before the work; `bench --from-profile DIR` says it is a directory; `bench` refuses
empty items in --ops / --threads / --backend (an empty --ops ran every case)."""

import os

import pytest
from cli_helpers import fastgrad_inprocess, one_line

fastgrad = fastgrad_inprocess
HERE = os.path.dirname(os.path.abspath(__file__))
DUMP = os.path.join(HERE, "data", "msprobe_dump", "rank0")
UNWRITABLE = "/proc/fastgrad-no-such-dir"


def test_msprobe_out_unwritable_names_out():
    one_line(fastgrad("golden", "--from-msprobe", DUMP, "--out", UNWRITABLE), "--out", UNWRITABLE)


def test_ttk_plugin_out_unwritable_names_out():
    one_line(fastgrad("ttk-plugin", "--out", UNWRITABLE), "--out", UNWRITABLE)


def test_main_job_refuses_a_results_file_that_is_a_directory(tmp_path):
    (tmp_path / "results.safetensors").mkdir()
    p = fastgrad("--bt", 16, "--hidden", 8, "--vocab", 300, "--no-progress", "--out", tmp_path,
                 "--out-format", "safetensors")
    line = one_line(p, "--out", "results.safetensors")
    assert "could not write" not in line
    assert "grad" not in p.stdout.lower()  # refused before the job's report


def test_bench_from_profile_directory(tmp_path):
    one_line(fastgrad("bench", "--from-profile", tmp_path), "--from-profile", "a directory")


@pytest.mark.parametrize("flag, value", [("--ops", ""), ("--ops", ",,"), ("--ops", "ce,"),
                                         ("--threads", "1,,2"), ("--backend", "")])
def test_bench_refuses_empty_list_items(flag, value):
    one_line(fastgrad("bench", "--quick", "--ops", "ce", flag, value), flag, repr(value))


@pytest.mark.parametrize("existing", [False, True, "nested"])
def test_msprobe_golden_that_fails_mid_write_leaves_nothing_behind(tmp_path, monkeypatch, existing):
    """Found by fuzzing: a full disk while ``golden --from-msprobe`` wrote its results left the
    files written so far (only an empty folder it had made was removed).  Now what it wrote is
    removed, the user's own files stay, and the answer is one line naming --out."""
    import errno
    import importlib

    compare = importlib.import_module("fastgrad.compare")  # the module (fastgrad.compare is its function)

    out = tmp_path / "a" / "b" / "out" if existing == "nested" else tmp_path / "out"
    if existing is True:
        out.mkdir()
        (out / "mine.txt").write_text("the user's")
    real, calls = compare.save_array, []

    def save_array(path, a, *args, **kwargs):
        calls.append(path)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, a, *args, **kwargs)

    monkeypatch.setattr(compare, "save_array", save_array)
    one_line(fastgrad("golden", "--from-msprobe", DUMP, "--out", out, "-q"), "--out", "No space left on device")
    assert len(calls) == 4
    if existing is True:
        assert sorted(p.name for p in out.rglob("*")) == ["mine.txt"]
        assert (out / "mine.txt").read_text() == "the user's"
    else:  # found by fuzzing: a/ and a/b/, made for --out a/b/out, were left behind
        assert sorted(tmp_path.iterdir()) == []
