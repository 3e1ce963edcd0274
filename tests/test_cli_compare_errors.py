"""`fastgrad compare`, found by fuzzing: a malformed file or sidecar, an oversized --shape, a dtype
flag at odds with a sidecar, options that mean nothing without another -> one line on stderr
naming the flag or the file, exit status 2 (never 3, never a page of PyTorch's text); a case's
integer outputs are compared for equality; a closed pipe keeps a failed verdict's status 1."""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from cli_helpers import fastgrad_inprocess, one_line

fastgrad = fastgrad_inprocess


@pytest.fixture
def d(tmp_path):
    a = np.arange(8, dtype=np.float32)
    a.tofile(tmp_path / "A.bin")
    a.tofile(tmp_path / "G.bin")
    (tmp_path / "G.json").write_text(json.dumps({"dtype": "float32", "shape": [8]}))
    b = np.arange(8).astype(ml_dtypes.bfloat16)
    for n in ("b16", "g16"):
        b.tofile(tmp_path / f"{n}.bin")
        (tmp_path / f"{n}.json").write_text(json.dumps({"dtype": "bfloat16", "shape": [8]}))
    return tmp_path


@pytest.mark.parametrize("sidecar, words", [
    ('{"dtype": "float32", "shape": [1e30, 0]}', ("shape", "1e+30")),
    ('{"dtype": "float32", "shape": null}', ("shape", "None")),
    ('{"dtype": "float32", "shape": [[8], 50]}', ("shape", "[[8], 50]")),
    ('{"dtype": "float32", "shape": [-8, -50]}', ("shape", "[-8, -50]")),
    ('{"dtype": "float32", "shape": "8,50"}', ("shape", "'8,50'")),
    ('{"dtype": "float32", "shape": [99999999999999999999999, 1]}', ("shape",)),
    ('{"dtype": "object", "shape": [8]}', ("dtype", "'object'")),
    ('{"dtype": null, "shape": [8]}', ("dtype", "None")),  # (np.dtype(None) would be float64)
    ('{"dtype": "float32",', ("malformed JSON",)),
    ("[1, 2]", ("holding a list",)),
])
def test_a_bad_sidecar_is_one_line_naming_it(d, sidecar, words):
    np.arange(8, dtype=np.float32).tofile(d / "s.bin")
    (d / "s.json").write_text(sidecar)
    line = one_line(fastgrad("compare", d / "s.bin", d / "G.bin"), "ACTUAL", "s.json", *words)
    assert "Expecting property name enclosed" not in line or "malformed JSON" in line


@pytest.mark.parametrize("shape", ["99999999999999999999999,1", "8,,1", ",8", "8,"])
def test_an_oversized_or_malformed_shape_is_refused(d, shape):
    one_line(fastgrad("compare", d / "A.bin", d / "G.bin", "--shape", shape), "--shape", repr(shape))


def test_an_empty_npy_names_the_file(d):
    (d / "e.npy").write_bytes(b"")
    one_line(fastgrad("compare", d / "e.npy", d / "G.bin"), "ACTUAL", "e.npy")


def test_a_garbage_pt_is_one_line(d):
    pytest.importorskip("torch")
    (d / "garbage.pt").write_bytes(b"garbage not a pickle")
    one_line(fastgrad("compare", d / "garbage.pt", d / "G.bin"), "ACTUAL", "garbage.pt", ".pt file")


@pytest.mark.parametrize("flag", ["--dtype", "--golden-dtype"])
def test_a_dtype_flag_against_the_sidecar_blames_the_flag(d, flag):
    line = one_line(fastgrad("compare", d / "b16.bin", d / "g16.bin", flag, "fp32"), flag, "bfloat16", "float32")
    assert not line.startswith("fastgrad compare: shape")


def test_dtype_is_the_goldens_default_only_where_it_has_no_sidecar(d):
    # an fp32 golden with its sidecar beside a bf16 output: --dtype bf16 names the output's dtype
    np.arange(8, dtype=np.float32).tofile(d / "raw.bin")
    p = fastgrad("compare", d / "b16.bin", d / "G.bin", "--dtype", "bf16")
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("extra, flag", [
    (("--level", "L1"), "--level"),
    (("--reference", "REF"), "--reference"),
    (("--reference-dtype", "fp32"), "--reference-dtype"),
    (("--standard", "legacy", "--level", "L2"), "--level"),
    (("--standard", "double"), "--standard"),
])
def test_an_option_without_its_partner_is_refused(d, extra, flag):
    extra = tuple(str(d / "G.bin") if e == "REF" else e for e in extra)
    one_line(fastgrad("compare", d / "A.bin", d / "G.bin", *extra), flag)


def test_integer_outputs_are_compared_for_equality(d):
    t = np.array([3, 1, 4, 1, 5], np.int64)
    np.save(d / "t.npy", t)
    t.tofile(d / "t.bin")
    (d / "t.json").write_text(json.dumps({"dtype": "int64", "shape": [5]}))
    t.tofile(d / "npu.bin")  # a raw NPU dump: dtype and shape from the golden's sidecar
    p = fastgrad("compare", d / "npu.bin", d / "t.bin")
    assert p.returncode == 0, p.stderr
    assert "exact" in p.stdout
    (t + np.array([0, 0, 1, 0, 0])).tofile(d / "bad.bin")
    p = fastgrad("compare", d / "bad.bin", d / "t.bin", "--json")
    assert p.returncode == 1, p.stderr
    assert json.loads(p.stdout)["metrics"]["mismatches"] == 1
    np.save(d / "t8.npy", np.arange(8))
    one_line(fastgrad("compare", d / "A.bin", d / "t8.npy", "--dtype", "fp32"), "GOLDEN", "int64", "float32")


@pytest.mark.slow
def test_a_closed_pipe_keeps_the_failed_verdict(tmp_path):
    np.save(tmp_path / "x.npy", np.ones(100_000, np.float32))
    np.save(tmp_path / "y.npy", np.zeros(100_000, np.float32))
    cmd = f"set -o pipefail; {sys.executable} -m fastgrad compare {tmp_path / 'x.npy'} {tmp_path / 'y.npy'} | true"
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr
