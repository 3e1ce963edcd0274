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
