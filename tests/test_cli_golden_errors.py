"""`fastgrad golden`, found by fuzzing: a malformed sidecar, attrs.json or input file, an oversized
--shape, a --dtype at odds with a sidecar, an unknown --backend -> one line on stderr naming the
flag or the file, exit status 2, checked before any work, and no --out folder left behind; a
write that fails (a full disk) removes what this run wrote and names --out and the file."""

import importlib
import json
import os
import shutil

import numpy as np
import pytest
from cli_helpers import fastgrad_inprocess, one_line

fastgrad = fastgrad_inprocess


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    d = tmp_path_factory.mktemp("gcase") / "c"
    p = fastgrad("case", "ce", "--shape", "8,50", "--dtype", "bf16", "--out", d)
    assert p.returncode == 0, p.stderr
    return d


@pytest.fixture
def inputs(case, tmp_path):
    d = tmp_path / "in"
    shutil.copytree(case / "inputs", d)
    for f in d.glob("*.npy"):
        f.unlink()
    return d


def golden(inputs, out, *extra):
    return fastgrad("golden", "ce", "--inputs", inputs, "--out", out, *extra)


@pytest.mark.parametrize("sidecar, words", [
    ("{bad", ("malformed JSON",)),
    ('{"dtype": "bfloat16", "shape": [1e30, 0]}', ("1e+30",)),
    ('{"dtype": "bfloat16", "shape": null}', ("None",)),
    ('{"dtype": "bfloat16", "shape": [[8], 50]}', ("[[8], 50]",)),
    ('{"dtype": "bfloat16", "shape": [-8, -50]}', ("[-8, -50]",)),
    ('{"dtype": "bfloat16", "shape": "8,50"}', ("'8,50'",)),
    ('{"dtype": "object", "shape": [8, 50]}', ("'object'",)),
])
def test_a_bad_sidecar_names_it(inputs, tmp_path, sidecar, words):
    (inputs / "log_prob.json").write_text(sidecar)
    line = one_line(golden(inputs, tmp_path / "out"), "--inputs", "log_prob.json", *words)
    assert "without log_prob.json" not in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, words", [("{bad", ("attrs.json",)), ("[1, 2]", ("attrs.json", "list")),
                                         ('{"bogus": 1}', ("attrs.json", "'bogus'"))])
def test_a_bad_attrs_json_names_it(inputs, tmp_path, text, words):
    (inputs / "attrs.json").write_text(text)
    one_line(golden(inputs, tmp_path / "out"), "--inputs", *words)
    assert not (tmp_path / "out").exists()


def test_an_input_that_is_a_directory(inputs, tmp_path):
    (inputs / "log_prob.bin").unlink()
    (inputs / "log_prob.bin").mkdir()
    one_line(golden(inputs, tmp_path / "out"), "--inputs", "log_prob.bin")
    assert not (tmp_path / "out").exists()


def test_an_empty_npy_input(inputs, tmp_path):
    (inputs / "target.bin").unlink()
    (inputs / "target.json").unlink()
    (inputs / "target.npy").write_bytes(b"")
    one_line(golden(inputs, tmp_path / "out"), "--inputs", "target.npy")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape", ["log_prob=99999999999999999999999,1", "log_prob=8,,50", "log_prob=,8,50"])
def test_a_bad_shape_flag(inputs, tmp_path, shape):
    (inputs / "log_prob.json").unlink()
    one_line(golden(inputs, tmp_path / "out", "--dtype", "log_prob=bf16", "--shape", shape), "--shape", shape)
    assert not (tmp_path / "out").exists()


def test_dtype_against_an_existing_sidecar_is_refused(inputs, tmp_path):
    one_line(golden(inputs, tmp_path / "out", "--dtype", "log_prob=fp16"), "--dtype", "bfloat16", "log_prob")
    assert not (tmp_path / "out").exists()
    p = golden(inputs, tmp_path / "out", "--dtype", "log_prob=bf16")  # the same dtype: fine
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("extra, flag", [
    (("--backend", "bogus"), "--backend"),
    (("--attr", "bogus=2"), "--attr"),
    (("--attr", "label_smoothing=2"), "label_smoothing"),
])
def test_refusals_leave_no_out_folder(inputs, tmp_path, extra, flag):
    one_line(golden(inputs, tmp_path / "out", *extra), flag)
    assert not (tmp_path / "out").exists()


def test_a_failed_write_removes_what_it_wrote(inputs, tmp_path, monkeypatch):
    C = importlib.import_module("fastgrad.compare")  # the module: fg.compare, once read, is its function

    real = C.save_array

    def full_disk(path, a):
        real(path, a)
        with open(path, "r+b") as f:
            f.truncate(1)  # a partial file ...
        raise OSError(28, "No space left on device")  # ... and the error, as np.tofile raises it

    monkeypatch.setattr(C, "save_array", full_disk)
    line = one_line(golden(inputs, tmp_path / "out", "--format", "bin"), "--out", "x_grad.bin", "No space left")
    assert "cannot use" not in line
    assert not (tmp_path / "out").exists()
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "mine.txt").write_text("x")
    one_line(golden(inputs, tmp_path / "keep", "--format", "bin"), "--out")
    assert sorted(os.listdir(tmp_path / "keep")) == ["mine.txt"]


def test_a_good_run_still_writes(inputs, tmp_path):
    p = golden(inputs, tmp_path / "out", "--format", "bin")
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "out" / "x_grad.json").read_text())["shape"] == [8, 50]
    assert np.fromfile(tmp_path / "out" / "x_grad.bin", np.uint16).size == 400
