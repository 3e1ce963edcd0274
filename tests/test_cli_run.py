"""The `fastgrad` main job on a small shape: it runs end to end and its report holds up."""

import json
import subprocess
import sys

import numpy as np
import pytest
from cli_helpers import fastgrad_inprocess, fastgrad_subprocess

from fastgrad.cli import run as cli_run


def _run_subprocess(*args):
    """``python -m fastgrad``: for what only a process of its own shows (its peak RSS)."""
    p = fastgrad_subprocess(*args)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _run(*args):
    p = fastgrad_inprocess(*args)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_main_job_json_small_shape():
    out = _run("--bt", "96", "--hidden", "32", "--vocab", "1500", "--json", "--threads", "2")
    r = json.loads(out)
    assert r["shape"] == {"BT": 96, "H": 32, "V": 1500} and r["mode"] == "memory-saving"
    assert set(r["phases_s"]) >= {"forward", "backward", "golden_check"}
    assert r["gflops"]["blas_fp32_measured"] > 0
    assert r["memory"]["logits_fp32_bytes_avoided"] == 4 * 96 * 1500
    e = r["max_error_vs_golden"]
    assert e["grad_input_rel_to_max"] < 2 ** -7 and e["grad_weight_rel_to_max"] < 2 ** -7
    assert e["loss_abs"] < 1e-4
    assert abs(r["loss_mean"] - np.log(1500)) < 1.0       # random LM head: loss near log V


@pytest.mark.parametrize("extra", [["--shards", "3"], ["--mode", "high-performance", "--dtype", "float16"]])
def test_main_job_sharded_and_high_performance(extra):
    r = json.loads(_run("--bt", "40", "--hidden", "16", "--vocab", "700", "--json", *extra))
    e = r["max_error_vs_golden"]
    assert e["grad_input_rel_to_max"] < 2 ** -7 and e["grad_weight_rel_to_max"] < 2 ** -7


def test_main_job_loads_npy_and_safetensors(tmp_path):
    import ml_dtypes

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((300, 24)) * 0.2).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((20, 24)).astype(ml_dtypes.bfloat16)
    t = rng.integers(0, 300, 20)
    np.save(tmp_path / "w.npy", w)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "t.npy", t)
    r = json.loads(_run("--weight", str(tmp_path / "w.npy"), "--input", str(tmp_path / "x.npy"),
                        "--target", str(tmp_path / "t.npy"), "--json"))
    assert r["shape"] == {"BT": 20, "H": 24, "V": 300}
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    safetensors_numpy.save_file({"lm_head.weight": w}, str(tmp_path / "m.safetensors"))
    r2 = json.loads(_run("--safetensors", str(tmp_path / "m.safetensors"), "--bt", "20", "--json"))
    assert r2["shape"]["V"] == 300 and r2["sources"]["weight"].endswith("lm_head.weight")


def test_human_report_mentions_every_metric(capsys):
    assert cli_run.main(["--bt", "16", "--hidden", "8", "--vocab", "300", "--no-progress"]) == 0
    text = capsys.readouterr().out
    for word in ("phase", "GFLOP/s", "of BLAS", "peak RSS", "VmHWM", "never held", "golden",
                 "estimated from the plan", "Ascend single benchmark"):
        assert word in text
    assert "mean loss" in text and len(text.split("mean loss")[1].split()[0].split(".")[1]) >= 6


def test_memory_report_is_the_process_peak():
    args = ("--bt", "64", "--hidden", "32", "--vocab", "2000", "--json")
    _run_subprocess(*args)  # a cold Numba cache compiles in the job (LLVM's memory is not the job's)
    r = json.loads(_run_subprocess(*args))
    m = r["memory"]
    phases = set(r["phases_s"])
    assert set(m["phase_peak_rss_bytes"]) == phases == set(m["process_peak_rss_bytes_after_phase"])
    after = [m["process_peak_rss_bytes_after_phase"][k] for k in r["phases_s"]]
    assert after == sorted(after)                        # the high-water mark never goes down: it is never reset
    assert m["process_peak_rss_bytes"] >= max(m["phase_peak_rss_bytes"].values()) * 0.95
    assert m["estimate"]["total_bytes"] >= m["process_peak_rss_bytes"] * 0.9, (r["phases_s"], m)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and exec-inherited ru_maxrss are Linux's")
def test_process_peak_is_the_jobs_own_not_its_parents():
    """Linux carries ru_maxrss across execve: a job started from a 700 MB process must still
    report its own peak (the tiny job peaks near 160 MB)."""
    parent = (
        "import subprocess, sys, numpy as np\n"
        "ballast = np.ones(700 * 2**20 // 8)\n"
        "p = subprocess.run([sys.executable, '-m', 'fastgrad', '--bt', '16', '--hidden', '8', '--vocab', '300',"
        " '--json'], capture_output=True, text=True)\n"
        "assert p.returncode == 0, p.stderr\n"
        "print(p.stdout)\n")
    p = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout)["memory"]
    assert m["process_peak_rss_bytes"] < 500 * 2**20, m["process_peak_rss_bytes"]


def test_high_performance_wording():
    out = _run("--bt", "16", "--hidden", "8", "--vocab", "300", "--mode", "high-performance", "--no-progress")
    assert "never held" not in out and "held a shard's [BT, V] logits" in out
