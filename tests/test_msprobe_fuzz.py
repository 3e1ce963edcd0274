"""msprobe dumps as msprobe 26.2 writes them under other configs than the committed dump's: a
``data_mode`` without inputs, task ``statistics``, empty tensors (no file: msprobe skips a null
storage pointer), ``softmax(x, dtype=torch.float32)`` (the Hugging Face attention pattern), a
dump.json in another encoding, a record that is not an object.  The records below copy the
layout msprobe itself wrote for these cases (checked against ``msprobe.pytorch.PrecisionDebugger``
on CPU torch; the last test makes them with msprobe when it is installed); the expected gradients
are float64 PyTorch's."""

import csv
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from cli_helpers import fastgrad_inprocess  # noqa: E402

from fastgrad.ascend import msprobe as M  # noqa: E402


def _rec(t, name=None):
    r = {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "requires_grad": False}
    if name:
        r["data_name"] = name
    return r


def _write(tmp_path, data, tensors, task="tensor"):
    d = tmp_path / "rank0"
    (d / "dump_tensor_data").mkdir(parents=True)
    for name, t in tensors.items():
        torch.save(t, d / "dump_tensor_data" / name)
    with open(d / "dump.json", "w") as f:
        json.dump({"task": task, "level": "L1", "framework": "pytorch", "dump_data_dir": None, "data": data}, f)
    return d


def _unmapped(out):
    with open(os.path.join(out, "unmapped.csv")) as f:
        return {r["entry"]: (r["family"], r["reason"]) for r in csv.DictReader(f)}


def test_a_dump_whose_data_mode_leaves_out_inputs_is_reported_per_entry(tmp_path):
    """data_mode ["output"]: forward records hold only "output", backward records only "output"
    (msprobe 26.2).  It was an internal error (AttributeError, exit 3) on Functional.embedding."""
    w = torch.randn(6, 3)
    y = torch.softmax(torch.randn(2, 5), -1)
    T = {"e.o": torch.zeros(4, 3), "w.g": w, "s.y": y, "s.g": torch.zeros(2, 5), "f.o": torch.zeros(4)}
    data = {
        "Functional.embedding.0.forward": {"output": [_rec(torch.zeros(4, 3), "e.o")]},
        "Functional.embedding.0.backward": {"output": [_rec(w, "w.g")]},
        "Functional.softmax.0.forward": {"output": [_rec(y, "s.y")]},
        "Functional.softmax.0.backward": {"output": [_rec(y, "s.g")]},
        "NPU.npu_fused_linear_online_max_sum.0.forward": {"output": [_rec(torch.zeros(4), "f.o")]},
    }
    d = _write(tmp_path, data, T)
    r = fastgrad_inprocess("golden", "--from-msprobe", d, "--out", tmp_path / "out")
    assert r.returncode == 1, r.stdout + r.stderr  # nothing judged: a verdict, not a crash
    reasons = _unmapped(tmp_path / "out")
    for entry in ("Functional.embedding.0.backward", "Functional.softmax.0.backward"):
        fwd = entry.replace("backward", "forward")
        assert reasons[entry] == ("yes", f"{fwd} records no inputs (a dump whose data_mode leaves out 'input')")
    fused = reasons["NPU.npu_fused_linear_online_max_sum.0.forward"]
    assert fused[0] == "yes" and "records no inputs" in fused[1]
    # the forward's inputs recorded, the incoming gradient not (a backward record without "input")
    data["Functional.softmax.0.forward"]["input_args"] = [_rec(y, "s.y")]
    data["Functional.softmax.0.forward"]["input_kwargs"] = {"dim": {"type": "int", "value": -1}}
    mapped, unmapped = M.map_dump(M.read_dump(str(_write(tmp_path / "b", data, T))))
    assert not mapped
    assert {u.entry: u.reason for u in unmapped}["Functional.softmax.0.backward"] == (
        "records no incoming gradient (a dump whose data_mode leaves out 'input')"
    )


def _softmax_dtype_dump(tmp_path, grad_dtype):
    """F.softmax(x_bf16, dim=-1, dtype=torch.float32) as msprobe records it: the forward's y and
    the backward's incoming gradient in float32, output.0 the softmax node's gradient (float32;
    ``grad_dtype`` bf16 stands for a kernel that takes the cast in and returns x's dtype)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 16, generator=g).to(torch.bfloat16)
    gy = torch.randn(2, 3, 16, generator=g)
    xx = x.double().requires_grad_()
    y = torch.softmax(xx, -1)
    oracle = torch.autograd.grad(y, xx, gy.double())[0]  # float64 autograd: d<gy, softmax(z)>/dz
    y = y.detach()
    T = {"x": x, "y": y.float(), "gy": gy, "gx": oracle.to(grad_dtype)}
    data = {
        "Functional.softmax.0.forward": {
            "input_args": [_rec(x, "x")],
            "input_kwargs": {
                "dim": {"type": "int", "value": -1},
                "dtype": {"type": "torch.dtype", "value": "torch.float32"},
            },
            "output": [_rec(T["y"], "y")],
        },
        "Functional.softmax.0.backward": {"input": [_rec(gy, "gy")], "output": [_rec(T["gx"], "gx")]},
    }
    return _write(tmp_path, data, T), oracle


def test_softmax_with_a_float32_dtype_is_judged(tmp_path):
    """The Hugging Face eager attention's softmax(x, dim=-1, dtype=torch.float32) on bf16 x: its
    backward record is the float32 softmax node's gradient, fastgrad's softmax backward in fp32.
    It was listed as not mapped ("input and output dtypes differ")."""
    d, oracle = _softmax_dtype_dump(tmp_path, torch.float32)
    dump = M.read_dump(str(d))
    mapped, unmapped = M.map_dump(dump)
    assert [m.op for m in mapped] == ["scaled_masked_softmax_backward"] and not unmapped
    rows, rejected = M.check_dump(dump, mapped)
    assert not rejected and [(r.output, r.dtype, r.verdict) for r in rows] == [("output.0 out", "float32", "PASS")]
    np.testing.assert_allclose(rows[0].golden.astype(np.float64), oracle.numpy(), rtol=1e-5, atol=1e-7)
    torch.save((oracle * 1.05).float(), os.path.join(dump.tensor_dir, "gx"))  # and a wrong one fails
    assert [r.verdict for r in M.check_dump(dump, mapped)[0]] == ["FAIL"]


def test_softmax_with_dtype_whose_gradient_is_in_the_input_dtype_is_not_mapped(tmp_path):
    d, _ = _softmax_dtype_dump(tmp_path, torch.bfloat16)
    mapped, unmapped = M.map_dump(M.read_dump(str(d)))
    assert not mapped and unmapped[0].reason == (
        "softmax with dtype=torch.float32: its recorded gradient is torch.bfloat16, not the softmax's"
    )


def test_tensor_records_without_data(tmp_path):
    """msprobe writes no file (and no data_name) for an empty tensor (null storage pointer): an
    embedding over zero tokens is judged (d weight = 0); a tensor kept as statistics only is the
    entry's reason.  Both were "fastgrad's ... rejected the recorded inputs: ... None was given"."""
    w = torch.randn(5, 3)
    idx = torch.zeros(0, dtype=torch.long)
    x, t = torch.randn(4, 6), torch.randn(4, 6)
    xx = x.double().requires_grad_()
    F.smooth_l1_loss(xx, t.double()).backward()
    T = {"w": w, "ge": torch.zeros(0, 3), "gw": torch.zeros(5, 3), "go": torch.tensor(1.0), "gx": xx.grad.float()}
    data = {
        "Functional.embedding.0.forward": {"input_args": [_rec(idx), _rec(w, "w")], "input_kwargs": {}},
        "Functional.embedding.0.backward": {"input": [_rec(T["ge"], "ge")], "output": [_rec(w, "gw")]},
        "Functional.smooth_l1_loss.0.forward": {"input_args": [_rec(x), _rec(t)], "input_kwargs": {}},
        "Functional.smooth_l1_loss.0.backward": {"input": [_rec(T["go"], "go")], "output": [_rec(x, "gx")]},
    }
    dump = M.read_dump(str(_write(tmp_path, data, T)))
    mapped, unmapped = M.map_dump(dump)
    assert [m.entry for m in mapped] == ["Functional.embedding.0.backward"]
    assert mapped[0].kwargs["indices"].shape == (0,) and mapped[0].kwargs["indices"].dtype == np.int64
    rows, rejected = M.check_dump(dump, mapped)
    assert not rejected and [r.verdict for r in rows] == ["PASS"]
    np.testing.assert_array_equal(rows[0].golden, np.zeros((5, 3), np.float32))
    (u,) = unmapped
    assert u.entry == "Functional.smooth_l1_loss.0.backward" and u.reason.startswith(
        "an input tensor (torch.float32 [4, 6]) has no data in the dump (no data_name: task 'statistics'"
    )


def test_dump_json_not_utf8_or_records_not_objects(tmp_path):
    d = _write(tmp_path, {}, {})
    (d / "dump.json").write_bytes('{"task": "tensor", "任务": 1, "data": {}}'.encode("gbk"))
    r = fastgrad_inprocess("golden", "--from-msprobe", d, "--out", tmp_path / "o")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("fastgrad golden: --from-msprobe") and "not UTF-8" in r.stderr
    assert not (tmp_path / "o").exists()
    data = {"Functional.embedding.0.backward": None, "Torch.softmax.0.forward": "x", "Torch.softmax.0.backward": {}}
    d = _write(tmp_path / "b", data, {})
    r = fastgrad_inprocess("golden", "--from-msprobe", d, "--out", tmp_path / "o")
    assert r.returncode == 1, r.stdout + r.stderr  # was an internal error (AttributeError, exit 3)
    reasons = _unmapped(tmp_path / "o")
    assert reasons["Functional.embedding.0.backward"] == ("yes", "record not understood (not a JSON object)")
    assert reasons["Torch.softmax.0.backward"] == ("yes", "record not understood (not a JSON object)")


def test_a_backward_without_its_forward_outside_the_family_is_only_counted(tmp_path):
    """data_mode ["backward"]: every backward lacks its forward; Tensor.sum's is not a call of the
    seven ops (counted, not listed), Functional.embedding's is listed."""
    g = {"input": [_rec(torch.ones(()), "g")], "output": [_rec(torch.ones(3), "g")]}
    data = {"Tensor.sum.0.backward": g, "Functional.embedding.0.backward": g}
    mapped, unmapped = M.map_dump(M.read_dump(str(_write(tmp_path, data, {"g": torch.ones(3)}))))
    assert not mapped and [(u.entry, u.family) for u in unmapped] == [
        ("Tensor.sum.0.backward", False),
        ("Functional.embedding.0.backward", True),
    ]


_MAKE = textwrap.dedent(
    """
    import json, os, sys, torch, torch.nn.functional as F
    from msprobe.pytorch import PrecisionDebugger
    out, mode = sys.argv[1], sys.argv[2]
    cfg = {"task": "tensor", "dump_path": out, "rank": [], "step": [], "level": "L1",
           "tensor": {"scope": [], "list": ["softmax", "embedding"], "data_mode": [mode]}}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    dbg = PrecisionDebugger(config_path=os.path.join(out, "config.json"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 16, generator=g, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(20, 8, generator=g, requires_grad=True)
    dbg.start()
    y = F.softmax(x, dim=-1, dtype=torch.float32)
    e = F.embedding(torch.tensor([[1, 3, 5], [7, 1, 2]]), w)
    (y.square().sum() + e.sum()).backward()
    dbg.stop()
    dbg.step()
    """
)


@pytest.mark.parametrize("mode", ["all", "output"])
def test_msprobe_itself(tmp_path, mode):
    """The two configs made by msprobe as installed: data_mode "all" judges the dtype=float32
    softmax and the embedding; data_mode "output" lists both with the reason (no crash)."""
    pytest.importorskip("msprobe", reason="mindstudio-probe not installed (pip install 'fastgrad[msprobe]')")
    r = subprocess.run([sys.executable, "-c", _MAKE, str(tmp_path), mode], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = fastgrad_inprocess("golden", "--from-msprobe", tmp_path / "step0", "--out", tmp_path / "o")
    if mode == "all":
        assert r.returncode == 0, r.stdout + r.stderr
        with open(tmp_path / "o" / "summary.csv") as f:
            rows = [(x["entry"], x["op"], x["dtype"], x["verdict"]) for x in csv.DictReader(f)]
        assert sorted(rows) == [
            ("Functional.embedding.0.backward", "embedding_dense_backward", "float32", "PASS"),
            ("Functional.softmax.0.backward", "scaled_masked_softmax_backward", "float32", "PASS"),
        ]
    else:
        assert r.returncode == 1, r.stdout + r.stderr
        assert "not mapped (2)" in r.stdout and r.stdout.count("records no inputs") == 2
