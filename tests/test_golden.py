"""`fastgrad golden` round trip: golden files from the reference backend, the CPU backend's
output passes `compare` against them, a perturbed output fails; file conventions."""

import json
import os

import ml_dtypes
import numpy as np
import pytest

import fastgrad as fg
from fastgrad.cli import main as cli_main
from fastgrad.cli.golden import OUTPUT_NAMES, golden, read_inputs
from fastgrad.compare import load_array, save_array

BF16 = ml_dtypes.bfloat16


def _flce_inputs(rng, dt):
    BT, H, V = 13, 16, 37
    x = rng.standard_normal((BT, H)).astype(dt)
    w = (rng.standard_normal((V, H)) / 4).astype(dt)
    lg = x.astype(np.float64) @ w.astype(np.float64).T
    m = lg.max(1)
    s = np.exp(lg - m[:, None]).sum(1)
    bits = np.arange(BT) % 5 == 4
    t = rng.integers(0, V, BT)
    return {"grad": np.full(BT, 1 / BT, np.float32), "input": x, "weight": w,
            "target_mask": np.packbits(bits, bitorder="little"),
            "masked_target": np.where(bits, 0, t).astype(np.int64),
            "logits_max": m.astype(np.float32), "sum_exp_logits": s.astype(np.float32)}, {}


def _floms_inputs(rng, dt):
    x = rng.standard_normal((11, 8)).astype(dt)
    w = rng.standard_normal((29, 8)).astype(dt)
    return {"input": x, "weight": w, "target": rng.integers(0, 40, 11).astype(np.int64)}, \
        {"vocab_start_index": 5, "vocab_end_index": 34, "return_logits": True}


def _fce_inputs(rng, dt):
    lg = rng.standard_normal((7, 19)).astype(dt)
    lf = lg.astype(np.float32)
    m = lf.max(1)
    s = np.exp(lf - m[:, None]).sum(1).astype(np.float32)
    return {"logits_max": m, "sum_exp_logits": s, "predicted_logits": (lf[:, 3] - m).astype(np.float32),
            "vocab_parallel_logits": lg}, {}


def _ce_inputs(rng, dt):
    z = rng.standard_normal((9, 23))
    lp = z - np.log(np.exp(z).sum(1, keepdims=True))
    t = rng.integers(0, 23, 9).astype(np.int64)
    t[2] = -100
    return {"grad_loss": np.array(0.7, dt), "log_prob": lp.astype(dt), "target": t}, {"reduction": "mean"}


def _smsb_inputs(rng, dt):
    z = np.exp(rng.standard_normal((2, 3, 5, 17)))
    y = (z / z.sum(-1, keepdims=True)).astype(dt)
    return {"grad_output": rng.standard_normal((2, 3, 5, 17)).astype(dt), "y": y,
            "mask": rng.random((2, 1, 5, 17)) < 0.3}, {"scale": 0.5}


def _sl1_inputs(rng, dt):
    return {"grad_out": np.array(1.5, dt), "input": (rng.standard_normal((6, 31)) * 2).astype(dt),
            "target": rng.standard_normal((6, 31)).astype(dt)}, {"reduction": "sum", "beta": 0.5}


def _emb_inputs(rng, dt):
    return {"grad": rng.standard_normal((4, 9, 12)).astype(dt),
            "indices": rng.integers(0, 17, (4, 9)).astype(np.int64)}, {"num_weights": 17, "padding_idx": 3}


BUILDERS = {
    "fused_linear_cross_entropy_loss_grad": (_flce_inputs, BF16),
    "fused_linear_online_max_sum": (_floms_inputs, BF16),
    "fused_cross_entropy_loss_with_max_sum": (_fce_inputs, BF16),
    "cross_entropy_loss_grad": (_ce_inputs, np.float32),
    "scaled_masked_softmax_backward": (_smsb_inputs, np.float16),
    "smooth_l1_loss_backward": (_sl1_inputs, BF16),
    "embedding_dense_backward": (_emb_inputs, np.float32),
}


def _write_inputs(d, arrays, attrs, fmt="npy"):
    os.makedirs(d, exist_ok=True)
    for k, v in arrays.items():
        save_array(os.path.join(d, f"{k}.{fmt}"), v)
    if attrs:
        with open(os.path.join(d, "attrs.json"), "w") as f:
            json.dump(attrs, f)


def test_every_public_op_has_output_names():
    import inspect

    for op in OUTPUT_NAMES:
        assert callable(getattr(fg, op))
        assert "out" not in OUTPUT_NAMES[op] or op in ("scaled_masked_softmax_backward",
                                                        "embedding_dense_backward")
        assert op in BUILDERS
        inspect.signature(getattr(fg, op))


@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_golden_round_trip(op, tmp_path, rng):
    build, dt = BUILDERS[op]
    arrays, attrs = build(rng, dt)
    inp, out = tmp_path / "in", tmp_path / "out"
    _write_inputs(str(inp), arrays, attrs)
    before = {k: v.copy() for k, v in arrays.items()}
    rc = cli_main(["golden", op, "--inputs", str(inp), "--out", str(out)])
    assert rc == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["op"] == op and manifest["backend"] == "reference"
    assert manifest["ignored_files"] == []
    cpu = getattr(fg, op)(**arrays, **attrs)
    for k, v in arrays.items():     # inputs untouched
        assert np.asarray(v).tobytes() == before[k].tobytes()
    cpu = cpu if isinstance(cpu, tuple) else (cpu,)
    names = getattr(cpu, "_fields", None) or OUTPUT_NAMES[op]
    judged = 0
    for name, val in zip(names, cpu):
        path = out / f"{name}.npy"
        if val is None:
            assert not path.exists()
            continue
        g = load_array(str(path))
        val = np.asarray(val)
        assert g.shape == val.shape and g.dtype == val.dtype, name
        if val.dtype.kind not in "f" and val.dtype != BF16:
            assert np.array_equal(g, val), name          # integer outputs: exact
            continue
        dtype = val.dtype if val.dtype in (np.dtype(np.float16), np.dtype(BF16), np.dtype(np.float32)) else None
        res = fg.compare(val, g, dtype=dtype)
        assert res.passed, (name, res.summary())
        assert fg.compare(val, g, dtype=dtype, standard="legacy").passed, name
        if val.size >= 4 and np.abs(g.astype(np.float64)).max() > 0:
            # a uniform 10% error fails both standards; so does one grossly wrong element
            bad = (val.astype(np.float64) * 1.1 + 1e-3).astype(val.dtype)
            assert not fg.compare(bad, g, dtype=dtype).passed, name
            bad2 = val.copy()
            i = int(np.argmax(np.abs(g.astype(np.float64)).ravel()))
            bad2.reshape(-1)[i] = (g.astype(np.float64).reshape(-1)[i] * 3 + 1).astype(val.dtype)
            assert not fg.compare(bad2, g, dtype=dtype).passed, name
            # the same through the CLI: exit status 0 / 1
            np.save(tmp_path / "cpu.npy", val) if val.dtype != BF16 else save_array(str(tmp_path / "cpu.npy"), val)
            save_array(str(tmp_path / "bad.npy"), bad)
            assert cli_main(["compare", str(tmp_path / "cpu.npy"), str(path)]) == 0
            assert cli_main(["compare", str(tmp_path / "bad.npy"), str(path)]) == 1
        judged += 1
    assert judged >= 1


def test_golden_bin_inputs_and_outputs(tmp_path, rng):
    arrays, attrs = _sl1_inputs(rng, BF16)
    inp = tmp_path / "in"
    _write_inputs(str(inp), arrays, None, fmt="bin")           # .bin + .json sidecars
    rc = cli_main(["golden", "smooth_l1_loss_backward", "--inputs", str(inp), "--out",
                   str(tmp_path / "out"), "--format", "bin", "--attr", "reduction=\"sum\"",
                   "--attr", "beta=0.5"])
    assert rc == 0
    g = load_array(str(tmp_path / "out" / "grad_input.bin"))   # dtype/shape from the sidecar
    assert g.dtype == BF16 and g.shape == (6, 31)
    raw = np.fromfile(tmp_path / "out" / "grad_input.bin", dtype=np.uint16)
    assert raw.size == 6 * 31
    with fg.use_backend("reference"):
        ref = fg.smooth_l1_loss_backward(**arrays, **attrs)
    assert np.array_equal(np.asarray(ref).view(np.uint16), g.view(np.uint16))


def test_golden_usage_errors(tmp_path, rng, capsys):
    arrays, attrs = _sl1_inputs(rng, np.float32)
    inp = tmp_path / "in"
    _write_inputs(str(inp), arrays, attrs)
    out = str(tmp_path / "out")
    assert cli_main(["golden", "no_such_op", "--inputs", str(inp), "--out", out]) == 2
    assert cli_main(["golden", "smooth_l1_loss_backward", "--inputs", str(tmp_path / "nope"), "--out", out]) == 2
    assert cli_main(["golden", "smooth_l1_loss_backward", "--inputs", str(inp), "--out", out,
                     "--attr", "gamma=2"]) == 2                  # not a parameter
    assert cli_main(["golden", "smooth_l1_loss_backward", "--inputs", str(inp), "--out", out,
                     "--attr", "input=2"]) == 2                  # both file and attribute
    assert cli_main(["golden", "smooth_l1_loss_backward"]) == 2  # missing options
    # the op rejects an input: its aclnn status is reported, exit 2, nothing written
    rc = cli_main(["golden", "smooth_l1_loss_backward", "--inputs", str(inp), "--out", out,
                   "--attr", "beta=-1.0"])
    err = capsys.readouterr().err
    assert "NotImplementedError" not in err
    assert rc == 2 and "161002" in err            # a rejected input is a usage error; 1 is a verdict
    assert not os.path.exists(os.path.join(out, "grad_input.npy"))


def test_read_inputs_reports_unmatched_files(tmp_path, rng):
    arrays, attrs = _sl1_inputs(rng, np.float32)
    _write_inputs(str(tmp_path), arrays, attrs)
    np.save(tmp_path / "stray.npy", np.zeros(3))
    kwargs, unused = read_inputs("smooth_l1_loss_backward", str(tmp_path))
    assert set(kwargs) == {"grad_out", "input", "target", "reduction", "beta"}
    assert kwargs["reduction"] == "sum" and unused == ["stray.npy"]
    out = golden  # the Python API is the CLI's implementation
    assert callable(out)
