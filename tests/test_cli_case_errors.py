"""`fastgrad case`, found by fuzzing: a bad --seed, --shape or --attr is one line naming the flag,
exit 2, before any work (--attr values are tried on a small case of the op first); a refusal,
Ctrl-C or a failed write leaves no --out folder and no partial case; --force replaces an older
case's files; reduction="none" gives the CE grad a (N,) grad_loss."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_helpers import fastgrad_inprocess, one_line

fastgrad = fastgrad_inprocess


def case(out, op="ce", shape="4,10", *extra):
    return fastgrad("case", op, "--shape", shape, "--dtype", "fp32", "--out", out, *extra)


@pytest.mark.parametrize("extra, words", [
    (("--seed", "-1"), ("--seed", ">= 0", "-1")),
    (("--attr", "bogus=2"), ("--attr", "bogus")),
    (("--attr", "label_smoothing=2"), ("--attr", "label_smoothing=2", "[0, 1]")),
    (("--attr", "label_smoothing=abc"), ("--attr", "label_smoothing=abc")),
    (("--attr", 'reduction="bogus"'), ("--attr", "reduction")),
])
def test_refused_before_any_work_and_nothing_left(tmp_path, extra, words):
    p = case(tmp_path / "out", "ce", "4,10", *extra)
    one_line(p, *words)
    assert "generating" not in p.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape", ["99999999999999999999999,2", "16,,32", ",16,32", "16,32,", "0,3"])
def test_a_malformed_or_oversized_shape(tmp_path, shape):
    one_line(case(tmp_path / "out", "ce", shape), "--shape", repr(shape))
    assert not (tmp_path / "out").exists()


def test_a_shape_that_cannot_fit_names_shape_not_the_main_jobs_flags(tmp_path):
    line = one_line(case(tmp_path / "out", "ce", "999999999999,2"), "--shape", "memory")
    assert "--workspace-mb" not in line and "--shards" not in line
    assert not (tmp_path / "out").exists()


def test_attr_values_that_depend_on_the_shape_are_judged_at_its_sizes(tmp_path):
    # padding_idx in [-W, W), vocab_end_index <= V: the small trial case keeps W and V
    assert case(tmp_path / "e", "embedding", "4,10,8", "--attr", "padding_idx=9").returncode == 0
    assert case(tmp_path / "f", "floms", "4,8,100", "--attr", "vocab_end_index=50").returncode == 0


def test_reduction_none_gives_grad_loss_one_per_row(tmp_path):
    p = case(tmp_path / "out", "ce", "4,10", "--attr", 'reduction="none"')
    assert p.returncode == 0, p.stderr
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["inputs"]["grad_loss"]["shape"] == [4]
    assert m["outputs"]["x_grad"]["shape"] == [4, 10]


def test_force_replaces_an_older_case_of_another_op(tmp_path):
    out = tmp_path / "out"
    assert case(out, "embedding", "4,10,8").returncode == 0
    assert case(out, "flce", "4,8,32").returncode == 2  # not empty
    p = case(out, "ce", "4,10", "--force")
    assert p.returncode == 0, p.stderr
    names = {f.split(".")[0] for f in os.listdir(out / "inputs")}
    assert names == {"grad_loss", "log_prob", "target", "attrs"}
    assert not (out / "chain").exists()
    g = fastgrad("golden", "ce", "--inputs", out / "inputs", "--out", tmp_path / "g")
    assert g.returncode == 0, g.stderr


def test_force_refuses_a_folder_that_is_no_case(tmp_path):
    out = tmp_path / "out"
    (out / "inputs").mkdir(parents=True)
    (out / "inputs" / "mine.txt").write_text("x")
    one_line(case(out, "ce", "4,10", "--force"), "--out", "inputs")
    assert (out / "inputs" / "mine.txt").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")  # no case entries: --force writes beside it
    assert case(tmp_path / "other", "ce", "4,10", "--force").returncode == 0


def test_a_failed_write_leaves_no_partial_case(tmp_path, monkeypatch):
    C = importlib.import_module("fastgrad.compare")  # the module: fg.compare, once read, is its function

    real, calls = C.save_array, []

    def full_disk(path, a):
        calls.append(path)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        return real(path, a)

    monkeypatch.setattr(C, "save_array", full_disk)
    line = one_line(case(tmp_path / "out", "ce", "4,10"), "--out", "No space left", os.path.basename(calls[-1]))
    assert "cannot use" not in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_ctrl_c_leaves_no_folder(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "fastgrad", "case", "flce", "--shape", "2048,1024,32000",
                             "--dtype", "bf16", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()  # "generating ...": the folder exists, the work began
    assert "generating" in line, line
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert not out.exists()


def test_a_case_still_round_trips(tmp_path):
    p = case(tmp_path / "out", "ce", "4,10", "--attr", "label_smoothing=0.1")
    assert p.returncode == 0, p.stderr
    x = np.load(tmp_path / "out" / "golden" / "x_grad.npy")
    assert x.shape == (4, 10)
