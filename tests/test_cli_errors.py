"""Issue 12's repros: every bad flag, file, shape or value -> one line on stderr naming the flag,
exit status 2, no traceback (``--debug`` adds one).  Most cases call the entry point in this
process (fast); ``test_entry_point_*`` run ``python -m fastgrad`` as a user would."""

import re

import numpy as np
import pytest
from cli_helpers import fastgrad_inprocess, fastgrad_subprocess

fastgrad = fastgrad_inprocess


def assert_usage_error(p, *words):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import ml_dtypes

    d = tmp_path_factory.mktemp("cli_err")
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((300, 24)) * 0.2).astype(ml_dtypes.bfloat16)
    np.save(d / "w.npy", w)
    np.save(d / "x.npy", rng.standard_normal((20, 24)).astype(ml_dtypes.bfloat16))
    np.save(d / "x16.npy", rng.standard_normal((20, 16)).astype(ml_dtypes.bfloat16))
    np.save(d / "t.npy", rng.integers(0, 300, 20))
    np.save(d / "t19.npy", rng.integers(0, 300, 19))
    np.save(d / "tneg.npy", np.r_[rng.integers(0, 300, 19), -3])
    np.save(d / "tbig.npy", np.r_[rng.integers(0, 300, 19), 300])
    np.save(d / "tfloat.npy", np.zeros(20))
    np.save(d / "w1d.npy", np.zeros(300, np.float32))
    np.save(d / "w3d.npy", np.zeros((2, 300, 24), np.float32))
    np.save(d / "wint.npy", np.ones((300, 24), np.int32))
    np.save(d / "wcplx.npy", np.ones((300, 24), np.complex64))
    wnan = np.ones((300, 24), np.float32)
    wnan[7, 3] = np.nan
    np.save(d / "wnan.npy", wnan)
    (d / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"x" * 64)
    (d / "garbage.npy").write_bytes(b"this is not an npy file")
    from fastgrad.cli.checkpoint import save_safetensors

    save_safetensors(str(d / "m.safetensors"), {"lm_head.weight": w, "norm.weight": np.ones(24, np.float32)})
    save_safetensors(str(d / "noh.safetensors"), {"foo.weight": w})
    return d


SMALL = ("--bt", 16, "--hidden", 8, "--vocab", 300, "--no-progress")


@pytest.mark.parametrize("args, words", [
    (("--bt", -5), ("--bt", ">= 1", "-5")),
    (("--vocab", 0), ("--vocab", ">= 1", "0")),
    (("--hidden", 0), ("--hidden", ">= 1")),
    (("--threads", 0), ("--threads", ">= 1")),
    (("--samples", -1), ("--samples", ">= 0")),
    (("--bt", "abc"), ("--bt", "integer", "abc")),
    (("--dtype", "int8"), ("--dtype", "bfloat16", "int8")),
    (("--mode", "fast"), ("--mode", "fast")),
    (("--workspace-mb", 0), ("--workspace-mb", "> 0")),
    (("--nonsense",), ("--nonsense",)),
    (("--shards", 2000, "--vocab", 1000), ("--shards", "1..1000", "2000")),
    (("--tensor", "lm_head.weight"), ("--tensor", "--safetensors")),
    (("--check", "--samples", 0), ("--check", "--samples")),
])
def test_bad_flag_values(args, words):
    assert_usage_error(fastgrad(*args), *words)


def test_safetensors_missing_file():
    assert_usage_error(fastgrad("--safetensors", "/nonexistent"), "--safetensors", "/nonexistent", "no such file")


def test_safetensors_garbage(files):
    assert_usage_error(fastgrad("--safetensors", files / "garbage.safetensors"), "--safetensors", "safetensors")


def test_npy_garbage(files):
    assert_usage_error(fastgrad("--weight", files / "garbage.npy"), "--weight", ".npy")


def test_safetensors_without_tensor_and_no_head(files):
    assert_usage_error(fastgrad("--safetensors", files / "noh.safetensors"), "--tensor", "foo.weight")


def test_safetensors_wrong_tensor_name(files):
    assert_usage_error(fastgrad("--safetensors", files / "m.safetensors", "--tensor", "nope"),
                       "--tensor", "lm_head.weight", "'nope'")


def test_hidden_mismatch(files):
    assert_usage_error(fastgrad("--weight", files / "w.npy", "--input", files / "x16.npy"),
                       "--input", "24", "[20, 16]")


def test_hidden_flag_mismatch(files):
    assert_usage_error(fastgrad("--weight", files / "w.npy", "--hidden", 32), "--hidden", "24", "32")


def test_target_length_mismatch(files):
    assert_usage_error(fastgrad("--weight", files / "w.npy", "--input", files / "x.npy", "--target", files / "t19.npy"),
                       "--target", "20", "19")


@pytest.mark.parametrize("name, words", [("tneg.npy", ("[0, V=300)", "-3")), ("tbig.npy", ("[0, V=300)", "300")),
                                         ("tfloat.npy", ("integer", "float64"))])
def test_bad_targets(files, name, words):
    assert_usage_error(fastgrad("--weight", files / "w.npy", "--input", files / "x.npy", "--target", files / name),
                       "--target", *words)


@pytest.mark.parametrize("name, words", [("w1d.npy", ("2-D", "[300]")), ("w3d.npy", ("2-D", "[2, 300, 24]")),
                                         ("wint.npy", ("floating-point", "int32")),
                                         ("wcplx.npy", ("floating-point", "complex64")),
                                         ("wnan.npy", ("finite", "[7, 3]"))])
def test_bad_weights(files, name, words):
    assert_usage_error(fastgrad("--weight", files / name, "--bt", 4), "--weight", *words)


def test_two_weight_sources(files):
    assert_usage_error(fastgrad("--weight", files / "w.npy", "--safetensors", files / "m.safetensors"),
                       "at most one of")


def test_huge_bt_refused_before_allocating():
    line = assert_usage_error(fastgrad("--bt", 100000000), "needs about", "GiB", "--bt")
    assert "no --workspace-mb or --shards" in line


def test_memory_limit_suggests_workspace():
    # The estimate includes this process's RSS (which depends on the machine and the Numba cache):
    # read it from a first refusal, then allow a little less than it.  The scratch of the
    # default 256 MiB plan is ~156 MiB, ~134 MiB with 128 MiB tiles.
    job = ("--bt", 4096, "--hidden", 256, "--vocab", 65536, "--samples", 0, "--no-progress")
    first = assert_usage_error(fastgrad(*job, "--memory-limit-mb", 1), "needs about")
    num, unit = re.search(r"needs about ([\d.]+) (MiB|GiB)", first).groups()
    need = int(float(num) * (1024 if unit == "GiB" else 1))
    p = fastgrad(*job, "--memory-limit-mb", need - 12)
    line = assert_usage_error(p, "needs about", "--memory-limit-mb")
    assert "--workspace-mb" in line and "would fit" in line
    assert not line.startswith("fastgrad: fastgrad:")


def test_high_performance_suggests_shards():
    # a job far above the limit (the [BT, V] fp32 softmax alone is 4 GiB), and a limit well above
    # this process (an xdist worker that ran other tests in-process can hold over 1 GiB): the advice
    # is the job's, not "this process alone is already ..."
    p = fastgrad("--bt", 16384, "--hidden", 64, "--vocab", 65536, "--mode", "high-performance",
                 "--memory-limit-mb", 4000, "--no-progress")
    line = assert_usage_error(p, "needs about")
    assert "--shards" in line or "--mode memory-saving" in line


def test_out_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert_usage_error(fastgrad(*SMALL, "--out", f), "--out", "directory")


def test_debug_shows_traceback():
    p = fastgrad("--safetensors", "/nonexistent", "--debug")
    assert p.returncode == 2 and "Traceback" in p.stderr and "--safetensors" in p.stderr.strip().splitlines()[-1]


def test_subcommands_one_line_errors(tmp_path):
    assert_usage_error(fastgrad("compare", "a.npy", "b.npy", "--standard", "x"), "--standard")
    assert_usage_error(fastgrad("bench", "--repeat", "x"), "--repeat")
    assert_usage_error(fastgrad("golden"), "golden")


def test_version_and_help():
    import fastgrad as fg

    p = fastgrad("--version")
    assert p.returncode == 0 and p.stdout.startswith(f"fastgrad {fg.__version__}")
    p = fastgrad("-h")
    assert p.returncode == 0 and "--workspace-mb" in p.stdout and "--model" in p.stdout


@pytest.mark.parametrize("args,words", [
    (("--bt", "0"), ("--bt",)),
    (("--safetensors", "/nonexistent"), ("--safetensors",)),
    (("--dtype", "float8"), ("--dtype",)),
])
def test_entry_point_subprocess_one_line_exit_2(args, words):
    assert_usage_error(fastgrad_subprocess(*args), *words)


def test_entry_point_subprocess_debug_traceback():
    p = fastgrad_subprocess("--safetensors", "/nonexistent", "--debug")
    assert p.returncode == 2 and "Traceback" in p.stderr


@pytest.mark.parametrize(
    "argv, advice",
    [
        ([], "--workspace-mb"),
        (["golden", "cross_entropy_loss_grad"], "float64"),
        (["case", "cross_entropy_loss_grad"], "--shape"),
        (["bench"], "--quick"),
    ],
)
def test_out_of_memory_advises_the_flags_of_the_command_that_ran_out(monkeypatch, argv, advice):
    """Found by fuzzing: every command's MemoryError advised ``--workspace-mb`` and ``--shards``,
    which only the main job has (``fastgrad golden`` refused them as unknown flags)."""
    import importlib

    mod = importlib.import_module("fastgrad.cli." + (argv[0] if argv else "run"))

    def no_memory(argv):
        raise MemoryError("Unable to allocate 80.0 GiB for an array")

    monkeypatch.setattr(mod, "main", no_memory)
    line = assert_usage_error(fastgrad(*argv), "out of memory: Unable to allocate 80.0 GiB", advice)
    if argv:
        assert "--shards" not in line and "--workspace-mb" not in line


def test_a_budget_below_one_byte_is_refused_by_its_flag():
    """Found by fuzzing: --workspace-mb 1e-9 (> 0, but 0 bytes) passed the flag's check and was
    refused later by set_workspace_budget, naming neither the flag nor the command's option."""
    assert_usage_error(fastgrad("--workspace-mb", "1e-9", "--bt", 8, "--samples", 0), "--workspace-mb", "1e-9")
    assert_usage_error(fastgrad("--memory-limit-mb", "1e-12", "--bt", 8, "--samples", 0), "--memory-limit-mb")


def test_a_bad_soc_variable_is_named_once(monkeypatch):
    monkeypatch.setenv("FASTGRAD_SOC_VERSION", "Ascend310P3")
    line = assert_usage_error(fastgrad("golden", "cross_entropy_loss_grad", "--inputs", ".", "--out", "x"))
    assert line.count("FASTGRAD_SOC_VERSION") == 1, line
