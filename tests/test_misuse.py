"""Issue 29's misuses, one test each: every mistake answered with one line naming the flag or
parameter, what was expected and what was given, exit status 2 before any work (the command's
entry point in this process where possible); the command talks while it works (header first,
rows as phases end, flushed with stdout redirected, the partial report on SIGTERM); outputs
checked before the work, and a failed write still reports and leaves no partial file."""

import errno
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_helpers import fastgrad_inprocess

import fastgrad as fg
from fastgrad.cli import run as cli_run

fastgrad = fastgrad_inprocess
SMALL = ("--bt", 16, "--hidden", 8, "--vocab", 300, "--no-progress")


def one_line(p, *words, status=2, absent=()):
    """The mistake's answer: exit ``status``, one line on stderr holding ``words``, no traceback."""
    assert p.returncode == status, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    for w in absent:
        assert w not in lines[0], (w, lines[0])
    return lines[0]


def no_work(p):
    """Refused before any work: no header, no phase row on stdout."""
    assert "LM-head gradient" not in p.stdout and "blas_measure" not in p.stdout, p.stdout


# ------------------------------------------------------------------ the command reports as it goes


def test_header_and_estimates_come_before_the_first_phase():
    p = fastgrad(*SMALL)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    order = [out.index(s) for s in ("LM-head gradient", "inputs:", "memory estimated", "time estimated",
                                    "  phase ", "    blas_measure ", "    load_inputs ", "    forward ",
                                    "    backward ", "    golden_check ", "  GFLOP/s:", "mean loss")]
    assert order == sorted(order), out


def test_json_keeps_stdout_pure_and_streams_the_lines_on_stderr():
    p = fastgrad(*SMALL, "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["time_estimate_s"] > 0 and "blas_measure" in r["phases_s"]
    assert "LM-head gradient" in p.stderr and "load_inputs" in p.stderr


def _wait_for(path, text, proc, timeout=120.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if os.path.exists(path) and text in open(path).read():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
def test_redirected_stdout_shows_the_header_while_running_and_sigterm_prints_the_partial_report(tmp_path):
    """stdout to a file (not a terminal: Python buffers it): the header is in the file while the
    job still runs, and SIGTERM ends it with the partial report and status 143."""
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "fastgrad", "--no-progress"], stdout=f,
                                stderr=subprocess.PIPE, text=True)
        try:
            seen = _wait_for(out, "LM-head gradient", proc)
            still_running = proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = out.read_text()
    assert seen and still_running, text
    assert proc.returncode == 143, (proc.returncode, text, err)
    assert "interrupted by SIGTERM" in text and "phases done:" in text, text
    assert text.index("LM-head gradient") < text.index("interrupted by SIGTERM")
    assert err.strip().splitlines()[-1] == "fastgrad: interrupted by SIGTERM (partial report above)"


def test_long_job_without_a_terminal_is_refused_with_a_hint(monkeypatch):
    monkeypatch.setattr(cli_run, "CONFIRM_ABOVE_S", 0.0)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    p = fastgrad(*SMALL)
    one_line(p, "--yes", "estimated", "not a terminal")
    assert "load_inputs" not in p.stdout                 # no phase after the estimate ran
    p = fastgrad(*SMALL, "--yes")
    assert p.returncode == 0 and "mean loss" in p.stdout, p.stderr


def test_a_huge_job_is_refused_before_any_allocation(monkeypatch):
    # ~1e14 FLOPs, refused (no terminal) right after the estimate.  The estimate divides by the
    # BLAS rate measured on the spot: 2 quiet Zen 4 cores can measure the ~180 GFLOP/s that bring
    # it under the 10-minute threshold (the huge job then ran: flaky), so the threshold is 1 s here
    monkeypatch.setattr(cli_run, "CONFIRM_ABOVE_S", 1.0)
    p = fastgrad("--bt", 100000, "--samples", 0, "--no-progress")
    one_line(p, "--yes", "estimated at about")
    assert "load_inputs" not in p.stdout


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("answer, status", [("n\n", 130), ("y\n", 0)])
def test_long_job_asks_on_a_terminal(monkeypatch, answer, status):
    monkeypatch.setattr(cli_run, "CONFIRM_ABOVE_S", 0.0)
    monkeypatch.setattr(sys, "stdin", _Tty(answer))
    p = fastgrad(*SMALL)
    assert p.returncode == status, (p.stdout, p.stderr)
    assert "Run it? [y/N]" in p.stderr
    assert ("mean loss" in p.stdout) == (status == 0)


# ------------------------------------------------------------------ outputs checked before the work


def test_out_that_cannot_be_created_is_refused_before_work(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    p = fastgrad(*SMALL, "--out", f / "sub")
    one_line(p, "--out", "can be created", str(f / "sub"))
    no_work(p)


def test_out_without_room_is_refused_before_work(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    p = fastgrad(*SMALL, "--out", tmp_path / "o")
    one_line(p, "--out", "room for the results", "free")
    no_work(p)
    assert not (tmp_path / "o").exists()                 # the directory the check created is gone again


def test_failed_write_prints_the_report_and_removes_partial_files(tmp_path, monkeypatch):
    from fastgrad.cli import checkpoint as ck

    def full_disk(path, tensors, meta=None):
        with open(path + ".part", "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(ck, "save_safetensors", full_disk)
    out = tmp_path / "o"
    out.mkdir()
    p = fastgrad(*SMALL, "--out", out)
    one_line(p, "--out", "No space left on device", "partial files removed")
    assert "mean loss" in p.stdout and "Ascend single benchmark" in p.stdout
    assert os.listdir(out) == []


def test_failed_report_write_removes_the_npy_files_already_written(tmp_path, monkeypatch):
    real_dump = json.dump

    def dump(obj, f, **kw):
        if str(getattr(f, "name", "")).endswith("report.json.part"):
            raise OSError(errno.ENOSPC, "No space left on device", f.name)
        return real_dump(obj, f, **kw)

    monkeypatch.setattr(json, "dump", dump)
    out = tmp_path / "o"
    p = fastgrad(*SMALL, "--out", out, "--out-format", "npy")
    one_line(p, "--out", "No space left on device")
    assert "mean loss" in p.stdout
    assert not out.exists() or os.listdir(out) == []


def test_interrupt_while_writing_reports_and_removes_partial_files(tmp_path, monkeypatch):
    from fastgrad.cli import checkpoint as ck

    def interrupted(path, tensors, meta=None):
        with open(path + ".part", "wb") as f:
            f.write(b"\0" * 1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "save_safetensors", interrupted)
    out = tmp_path / "o"
    p = fastgrad(*SMALL, "--out", out)
    one_line(p, "interrupted by SIGINT", status=130)
    assert "mean loss" in p.stdout and "during write_outputs" in p.stdout and "partial files removed" in p.stdout
    assert not out.exists()                              # created by this run, removed again with its files


def test_successful_write_leaves_no_part_file(tmp_path):
    p = fastgrad(*SMALL, "--out", tmp_path / "o")
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path / "o")) == ["report.json", "results.safetensors"]


# ------------------------------------------------------------------ misleading answers, silent acceptance


def test_memory_limit_below_the_process_itself_names_the_flag_not_the_shape():
    line = one_line(fastgrad(*SMALL, "--memory-limit-mb", 1), "--memory-limit-mb", "this process alone",
                    "got 1", absent=("--bt", "smaller"))
    assert "needs about" in line


def test_samples_beyond_the_rows_blames_samples_not_the_shape():
    one_line(fastgrad("--samples", 100000), "--samples", "at most", "2048", "100000", absent=("--bt", "memory"))


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_samples_n_checks_n_rows_and_n_vocabulary_rows(n):
    p = fastgrad(*SMALL, "--samples", n, "--json")
    assert p.returncode == 0, p.stderr
    e = json.loads(p.stdout)["max_error_vs_golden"]
    assert (e["rows_sampled"], e["vocab_rows_sampled"]) == (n, n)


def test_sample_indices_are_distinct_and_start_with_the_given_ones():
    rng = np.random.default_rng(0)
    for n, k in ((10, 10), (151936, 8), (5, 1), (7, 3)):
        got = cli_run.sample_indices(rng, n, k, [0, n - 1, 0])
        assert len(got) == k and len(set(got.tolist())) == k and got.min() >= 0 and got.max() < n
        assert 0 in got and (k < 2 or n - 1 in got)


@pytest.fixture
def bad_npy(tmp_path):
    (tmp_path / "garbage.npy").write_bytes(b"this is not an npy file")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return tmp_path


def test_garbage_npy_never_advises_allow_pickle(bad_npy):
    one_line(fastgrad("--weight", bad_npy / "garbage.npy"), "--weight", "no .npy header", absent=("pickle",))
    one_line(fastgrad("--weight", bad_npy / "objects.npy"), "--weight", "does not unpickle",
             absent=("allow_pickle",))


def test_threads_beyond_the_cpus_is_refused():
    from fastgrad._config import max_threads

    one_line(fastgrad(*SMALL, "--threads", 1000), "--threads", f"1..{max_threads()}", "1000")


@pytest.mark.parametrize("n", [1000, 0, -1, 1.5, "2", True])
def test_set_num_threads_refuses_what_it_cannot_do(n):
    before = fg.get_num_threads()
    with pytest.raises(ValueError, match="set_num_threads: n: expected") as e:
        fg.set_num_threads(n)
    assert e.value.status == 161002 and fg.get_num_threads() == before
    with pytest.raises(ValueError, match="num_threads: n"):
        with fg.num_threads(n):
            pass


@pytest.mark.parametrize("var, value, words", [
    ("FASTGRAD_WORKSPACE_MB", "abc", ("FASTGRAD_WORKSPACE_MB", "number of MiB", "'abc'")),
    ("FASTGRAD_WORKSPACE_MB", "-5", ("FASTGRAD_WORKSPACE_MB", "'-5'")),
    ("FASTGRAD_GEMM", "mkl", ("FASTGRAD_GEMM", "auto, blas or onednn", "'mkl'")),
    ("FASTGRAD_STRICT", "maybe", ("FASTGRAD_STRICT", "'maybe'")),
    ("FASTGRAD_OUTPUT_CACHE_MB", "lots", ("FASTGRAD_OUTPUT_CACHE_MB", "'lots'")),
])
def test_invalid_environment_values_are_refused_before_work(monkeypatch, var, value, words):
    monkeypatch.setenv(var, value)
    p = fastgrad(*SMALL)
    one_line(p, *words)
    no_work(p)


def test_invalid_environment_values_are_refused_by_the_library(monkeypatch):
    from fastgrad import tiling

    monkeypatch.setenv("FASTGRAD_WORKSPACE_MB", "abc")
    with pytest.raises(ValueError, match="FASTGRAD_WORKSPACE_MB"):
        tiling.workspace_budget()
    monkeypatch.setenv("FASTGRAD_WORKSPACE_MB", "64")
    assert tiling.workspace_budget() == 64 * 2**20
    monkeypatch.setenv("FASTGRAD_GEMM", "mkl")
    with pytest.raises(ValueError, match="FASTGRAD_GEMM"):
        fg.gemm_engine()
    monkeypatch.setenv("FASTGRAD_GEMM", "")
    assert fg.gemm_engine() in ("blas", "onednn")


@pytest.mark.parametrize("spelling, name", [("bf16", "bfloat16"), ("fp32", "float32"), ("float32", "float32"),
                                            ("BFloat16", "bfloat16"), ("fp16", "float16")])
def test_one_dtype_vocabulary_on_the_command(spelling, name):
    p = fastgrad(*SMALL, "--dtype", spelling, "--json", "--samples", 0)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["dtype"] == name


# ------------------------------------------------------------------ compare, golden, bench


@pytest.fixture
def cmp_files(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "g.npy", a)
    a.tofile(tmp_path / "a.bin")
    return tmp_path


def test_compare_on_a_directory(cmp_files):
    one_line(fastgrad("compare", cmp_files, cmp_files / "g.npy"), "ACTUAL", "a directory", str(cmp_files))
    one_line(fastgrad("compare", cmp_files / "a.npy", cmp_files), "GOLDEN", "a directory")


def test_compare_shape_with_a_non_number(cmp_files):
    one_line(fastgrad("compare", cmp_files / "a.npy", cmp_files / "g.npy", "--shape", "2,x"), "--shape", "'2,x'")


def test_compare_wrong_dtype_blames_the_dtype_not_the_golden(cmp_files):
    line = one_line(fastgrad("compare", cmp_files / "a.bin", cmp_files / "g.npy", "--dtype", "bfloat16"),
                    "--dtype", "read as bfloat16", "24 elements", "12 elements")
    assert not line.startswith("fastgrad compare: GOLDEN")
    p = fastgrad("compare", cmp_files / "a.bin", cmp_files / "g.npy", "--dtype", "fp32", "--shape", "4,3")
    assert p.returncode == 0, p.stderr
    one_line(fastgrad("compare", cmp_files / "a.npy", cmp_files / "g.npy", "--dtype", "int8"), "--dtype", "'int8'")


def test_compare_garbage_npy(cmp_files, bad_npy):
    one_line(fastgrad("compare", bad_npy / "garbage.npy", cmp_files / "g.npy"), "ACTUAL", "no .npy header",
             absent=("pickle",))


def test_golden_missing_inputs_names_the_files(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    np.save(d / "grad_out.npy", np.ones(4, np.float32))
    p = fastgrad("golden", "smooth_l1_loss_backward", "--inputs", d, "--out", tmp_path / "out")
    one_line(p, "--inputs", "input.npy", "target.npy", "grad_out.npy", absent=("TypeError", "positional"))


def test_golden_rejected_attribute_is_exit_2_not_the_verdict_1(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for n in ("grad_out", "input", "target"):
        np.save(d / f"{n}.npy", np.ones(4, np.float32))
    p = fastgrad("golden", "smooth_l1_loss_backward", "--inputs", d, "--out", tmp_path / "out", "--attr", "beta=-1")
    one_line(p, "beta", "161002")


def test_bench_from_json_on_a_non_json_file(tmp_path):
    (tmp_path / "x.json").write_bytes(bytes(range(256)))
    one_line(fastgrad("bench", "--from-json", tmp_path / "x.json"), "--from-json", "bench report", "not text",
             absent=("codec",))
    (tmp_path / "y.json").write_text("{not json")
    one_line(fastgrad("bench", "--from-json", tmp_path / "y.json"), "--from-json", "not JSON")
    one_line(fastgrad("bench", "--from-json", tmp_path), "--from-json", "a directory")


@pytest.mark.parametrize("args, words", [
    (("--repeat", "0"), ("--repeat", "> 0", "'0'")),
    (("--repeat", "-3"), ("--repeat", "'-3'")),
    (("--budget", "0"), ("--budget", "> 0")),
    (("--threads", "1000"), ("--threads", "1000")),
])
def test_bench_bad_numbers(args, words):
    one_line(fastgrad("bench", "--ops", "smooth_l1", "--no-torch", *args), *words)


def test_bench_outputs_checked_before_the_benchmark(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for flag in ("--json", "--markdown"):
        p = fastgrad("bench", "--ops", "smooth_l1", "--no-torch", flag, f / "r.out")
        one_line(p, flag, "a path under a directory")
        assert p.stdout == ""                             # no table: nothing ran
    p = fastgrad("bench", "--ops", "smooth_l1", "--no-torch", "--plot", f)
    one_line(p, "--plot", "directory")


def test_bench_quick_says_its_figures_are_noise(tmp_path):
    from fastgrad.benchmarks import report as R

    rep = {"schema": "fastgrad-bench/1", "machine_id": "vm", "versions": {}, "bounds": {}, "notes": [], "rows": [],
           "settings": {"quick": True}}
    R.save(rep, str(tmp_path / "q.json"))
    p = fastgrad("bench", "--from-json", tmp_path / "q.json")
    assert p.returncode == 0 and "--quick" in p.stdout and "noise" in p.stdout


def test_a_fastgrad_configuration_row_is_worded_as_itself():
    from fastgrad.benchmarks import report as R

    row = {"kind": "baseline", "backend": "fastgrad-onednn", "variant": "", "fastgrad_speedup": 1.38}
    assert R.relative_words(row) == "1.38x slower"        # not "fastgrad 1.38x slower"
    assert R.relative_words(dict(row, fastgrad_speedup=0.5)) == "2.00x faster"
    assert R.relative_words(dict(row, backend="torch-fp32")) == "fastgrad 1.38x faster"


# ------------------------------------------------------------------ the Python API


def _flce_inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((20, 8)).astype(np.float32)
    t = np.array([1, 2, 3, 4])
    r = fg.fused_linear_online_max_sum(x, w, t, 0, 20)
    return x, w, r


def test_python_lists_are_read_as_torch_reads_them():
    x, w, r = _flce_inputs()
    kw = dict(logits_max=r.logits_max_local, sum_exp_logits=r.sum_exp_logits_local)
    want = fg.fused_linear_cross_entropy_loss_grad(np.full(4, 0.25, np.float32), x, w, r.target_mask,
                                                   r.masked_target, **kw)
    got = fg.fused_linear_cross_entropy_loss_grad([0.25] * 4, x, w, r.target_mask, r.masked_target, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))     # floats -> float32, not "got float64"
    with pytest.raises(ValueError, match="list") as e:
        fg.fused_linear_cross_entropy_loss_grad(["a"] * 4, x, w, r.target_mask, r.masked_target, **kw)
    assert e.value.status == 161002 and "float64" not in str(e.value)


def test_out_must_be_something_to_write_into():
    lp = np.log(np.full((4, 5), 0.2, np.float32))
    with pytest.raises(ValueError, match="out: expected a NumPy array or torch.Tensor to write into, got list"):
        fg.cross_entropy_loss_grad(np.float32(1), lp, np.array([0, 1, 2, 3]), out=[[0.0] * 5] * 4)


def test_grad_1_0_is_read_the_same_by_both_grads():
    """A Python float is float32 for both ops: the CE grad's 0-d grad_loss takes it; the FLCE
    grad's per-row grad [BT] refuses it for its shape alone (not for a float64 dtype)."""
    lp = np.log(np.full((4, 5), 0.2, np.float32))
    t = np.array([0, 1, 2, 3])
    a = fg.cross_entropy_loss_grad(1.0, lp, t)
    b = fg.cross_entropy_loss_grad(np.float32(1.0), lp, t)
    assert np.array_equal(a, b)
    x, w, r = _flce_inputs()
    with pytest.raises(ValueError) as e:
        fg.fused_linear_cross_entropy_loss_grad(1.0, x, w, r.target_mask, r.masked_target,
                                                logits_max=r.logits_max_local, sum_exp_logits=r.sum_exp_logits_local)
    assert "grad" in str(e.value) and "1-D" in str(e.value) and "dtype" not in str(e.value)


def test_tensor_requiring_grad_warns_at_the_numpy_level():
    torch = pytest.importorskip("torch")
    x, w, _ = _flce_inputs()
    xt = torch.from_numpy(x).requires_grad_()
    with pytest.warns(UserWarning, match="requires grad.*fastgrad.torch.linear_cross_entropy") as rec:
        fg.fused_linear_online_max_sum(xt, torch.from_numpy(w), torch.tensor([1, 2, 3, 4]), 0, 20)
    assert rec[0].filename == __file__                    # pointed at the caller's line
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            fg.fused_linear_online_max_sum(xt, torch.from_numpy(w), torch.tensor([1, 2, 3, 4]), 0, 20)


def test_errors_read_as_pytorch_errors_and_keep_their_status():
    torch = pytest.importorskip("torch")
    import fastgrad.torch as ft

    h = torch.randn(4, 8)
    w = torch.randn(20, 8)
    with pytest.raises(ValueError) as e:
        ft.linear_cross_entropy(h, w, torch.tensor([1, 2, 3, 4]), reduction="avg")
    text = str(e.value)
    assert text.startswith("linear_cross_entropy: reduction: expected"), text
    assert not text.startswith("[") and e.value.status == 161002


def test_process_group_of_the_wrong_type_is_a_type_error():
    torch = pytest.importorskip("torch")
    from fastgrad.torch import linear_cross_entropy

    h = torch.randn(4, 8)
    w = torch.randn(16, 8)
    t = torch.randint(0, 16, (4,))
    for kw in ({}, {"vocab_start_index": 0, "vocab_size": 16}):
        with pytest.raises(TypeError, match="process_group: expected None or a torch.distributed.ProcessGroup, got object"):
            linear_cross_entropy(h, w, t, process_group=object(), **kw)


def test_settings_resolve_every_setting_in_one_object(monkeypatch):
    """``fg.settings()``: context > process > environment > default, one frozen object; an invalid
    environment value is refused naming the variable (161002), never read as the default."""
    import dataclasses

    from fastgrad import _config

    for var in ("FASTGRAD_STRICT", "FASTGRAD_GEMM", "FASTGRAD_SOC_VERSION", "FASTGRAD_WORKSPACE_MB",
                "FASTGRAD_BACKEND", "FASTGRAD_NATIVE_ISA"):
        monkeypatch.delenv(var, raising=False)
    s = fg.settings()
    assert isinstance(s, fg.Settings) and dataclasses.is_dataclass(s)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.strict = True  # type: ignore[misc]
    assert (s.strict, s.gemm, s.backend, s.native_isa, s.workspace_bytes) == (False, "auto", "cpu", "auto", 256 * 2**20)
    assert s.soc_version == "Ascend910B" and not s.prefer_onednn and s.progress is None
    monkeypatch.setenv("FASTGRAD_WORKSPACE_MB", "64")
    monkeypatch.setenv("FASTGRAD_GEMM", "blas")
    monkeypatch.setenv("FASTGRAD_SOC_VERSION", "Ascend950")
    s = fg.settings()
    assert (s.workspace_bytes, s.gemm, s.soc_version) == (64 * 2**20, "blas", "Ascend950")
    cb = lambda done, total: None  # noqa: E731
    with fg.strict(), fg.gemm("auto"), fg.soc_version("Ascend910_93"), fg.use_backend("reference"), fg.progress(cb):
        s = fg.settings()
        assert (s.strict, s.gemm, s.soc_version, s.backend, s.progress) == (True, "auto", "Ascend910_93", "reference", cb)
    with _config.prefer_onednn():
        assert fg.settings().prefer_onednn
    monkeypatch.setenv("FASTGRAD_NATIVE_ISA", "avx-3")
    with pytest.raises(ValueError, match="FASTGRAD_NATIVE_ISA"):
        fg.settings()
    monkeypatch.setenv("FASTGRAD_NATIVE_ISA", "avx2")
    monkeypatch.setenv("FASTGRAD_ACL_DEVICE", "npu0")
    with pytest.raises(ValueError, match="FASTGRAD_ACL_DEVICE"):
        _config.acl_device_id()
