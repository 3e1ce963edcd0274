"""msprobe dumps in: `fastgrad golden --from-msprobe` on a dump msprobe itself made (committed in
tests/data/msprobe_dump/, by tests/data/make_msprobe_dump.py), judged against float64 PyTorch
oracles written here; `--bench-dump` + `msprobe compare` when mindstudio-probe is installed."""

import csv
import glob
import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from cli_helpers import fastgrad_inprocess

from fastgrad.ascend import msprobe as M

HERE = os.path.dirname(os.path.abspath(__file__))
DUMP = os.path.join(HERE, "data", "msprobe_dump", "rank0")
BF16 = np.dtype(ml_dtypes.bfloat16)

#: What the committed step calls (make_msprobe_dump.py), bf16 (index 0) then fp32 (index 1).
EXPECTED = {
    **{f"Functional.smooth_l1_loss.{i}.backward": "smooth_l1_loss_backward" for i in (0, 1)},
    **{f"Functional.embedding.{i}.backward": "embedding_dense_backward" for i in (0, 1)},
    **{f"Torch.softmax.{i}.backward": "scaled_masked_softmax_backward" for i in (0, 1)},
    **{f"NPU.npu_scaled_masked_softmax.{i}.backward": "scaled_masked_softmax_backward" for i in (0, 1)},
    **{f"NPU.npu_cross_entropy_loss.{i}.backward": "cross_entropy_loss_grad" for i in (0, 1)},
    "NPU.npu_fused_linear_online_max_sum.0.forward": "fused_linear_online_max_sum",
    "NPU.npu_fused_linear_cross_entropy_loss_with_max_sum_backward.0.forward": "fused_linear_cross_entropy_loss_grad",
}


def _rows(out):
    with open(os.path.join(out, "summary.csv")) as f:
        return list(csv.DictReader(f))


def _pt(name, dump=DUMP):
    return torch.load(os.path.join(dump, "dump_tensor_data", name), map_location="cpu", weights_only=True)


def _golden(out, entry, label):
    return np.load(glob.glob(os.path.join(out, "entries", entry, "golden", label + "_*.npy"))[0])


def _f64(a):
    a = np.asarray(a)
    return torch.from_numpy(
        (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if a.dtype.kind == "V" or a.dtype == BF16
        else a.astype(np.float64)
    )


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden")
    bench = tmp_path_factory.mktemp("bench")
    r = fastgrad_inprocess("golden", "--from-msprobe", DUMP, "--out", out, "--bench-dump", bench)
    return r, str(out), str(bench)


def test_every_mapped_entry_passes_the_single_benchmark(golden_run):
    r, out, _ = golden_run
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _rows(out)
    assert {row["entry"]: row["op"] for row in rows} == EXPECTED
    assert all(row["verdict"] == "PASS" for row in rows), [row for row in rows if row["verdict"] != "PASS"]
    floats = [row for row in rows if row["standard"] == "single"]
    assert {row["dtype"] for row in floats} == {"bfloat16", "float32"}
    ints = {row["output"] for row in rows if row["standard"] == "exact"}
    assert ints == {"output.3 target_mask", "output.4 masked_target"}
    # the table on the terminal: the columns, every entry, the verdict line
    head = r.stdout.splitlines()[0].split()
    assert head == ["entry", "op", "output", "dtype", "shape", "standard", "verdict", "errors"]
    assert all(e in r.stdout for e in EXPECTED) and "PASS: 17/17 outputs of 12 entries pass" in r.stdout


def test_cross_entropy_trap_is_reported_by_name_and_is_real(golden_run):
    r, out, _ = golden_run
    with open(os.path.join(out, "unmapped.csv")) as f:
        um = {row["entry"]: row["reason"] for row in csv.DictReader(f)}
    assert set(um) == {"Functional.cross_entropy.0.backward", "Functional.cross_entropy.1.backward"}
    assert all("Functional.cross_entropy trap" in v and "nll_loss" in v for v in um.values())
    assert "Functional.cross_entropy trap" in r.stdout
    # the trap itself, on msprobe's record: output.0 is d loss / d log_softmax (-1/N at the targets),
    # not d loss / d logits = (softmax - onehot)/N
    for i in (0, 1):
        logits = _pt(f"Functional.cross_entropy.{i}.forward.input.0.pt").double()
        t = _pt(f"Functional.cross_entropy.{i}.forward.input.1.pt")
        rec = _pt(f"Functional.cross_entropy.{i}.backward.output.0.pt").double()
        nll_grad = torch.zeros_like(logits)
        nll_grad[torch.arange(len(t)), t] = -1.0 / len(t)
        torch.testing.assert_close(rec, nll_grad, rtol=0, atol=1e-3)
        x = logits.clone().requires_grad_()
        F.cross_entropy(x, t).backward()
        assert (rec - x.grad).abs().max() > 1e-2


def test_goldens_match_float64_torch_oracles(golden_run):
    """The goldens written per entry against PyTorch autograd in float64 on the recorded inputs
    (rounded once to the output dtype): fastgrad's recomputation is not its own judge."""
    _, out, _ = golden_run

    def close(golden, ref64, dtype):
        g = _f64(golden)
        if dtype == torch.bfloat16:  # fp32 arithmetic then one bf16 rounding: within 1 bf16 ulp of the oracle
            ref = ref64.to(dtype).double()
            assert torch.all((g - ref).abs() <= 2.0**-8 * ref.abs()), (g, ref)
        else:  # fp32 inputs: the device's fp32 arithmetic (x - t rounded, ...) within 2^-20 of the scale
            assert torch.all((g - ref64).abs() <= 2.0**-20 * ref64.abs().max()), (g, ref64)

    for i, dt in ((0, torch.bfloat16), (1, torch.float32)):
        # smooth-L1 on the 910B (the default profile): d = fp32(x - t); d / fp32(beta + 1e-6) in the
        # quadratic zone (docs/device_parity.md) -- PyTorch divides by beta: 2e-6 apart in fp32
        e = f"Functional.smooth_l1_loss.{i}"
        x, y = _pt(f"{e}.forward.input.0.pt"), _pt(f"{e}.forward.input.1.pt")
        d = (x.float() - y.float()).double()
        b = torch.tensor(0.5 + 1e-6, dtype=torch.float32).double()
        s = torch.where(d.abs() < 0.5, d / b, torch.sign(d))
        ref = s * _pt(f"{e}.backward.input.0.pt").double() / d.numel()
        close(_golden(out, f"{e}.backward", "output.0"), ref, dt)
        xx = x.double().requires_grad_()
        F.smooth_l1_loss(xx, y.double(), beta=0.5).backward(_pt(f"{e}.backward.input.0.pt").double())
        assert torch.allclose(ref, xx.grad, rtol=2.0**-8 if i == 0 else 4e-6, atol=0)

        e = f"Functional.embedding.{i}"
        idx = _pt(f"{e}.forward.input.0.pt")
        w = _pt(f"{e}.forward.input.1.pt").double().requires_grad_()
        F.embedding(idx, w).backward(_pt(f"{e}.backward.input.0.pt").double())
        close(_golden(out, f"{e}.backward", "output.0"), w.grad, dt)

        for e, scale in ((f"Torch.softmax.{i}", 1.0), (f"NPU.npu_scaled_masked_softmax.{i}", 0.125)):
            y = _pt(f"{e}.forward.output.0.pt").double()
            gy = _pt(f"{e}.backward.input.0.pt").double()
            ref = (gy * y - (gy * y).sum(-1, keepdim=True) * y) * scale
            if "npu" in e:
                ref = ref.masked_fill(_pt(f"{e}.forward.input.1.pt"), 0.0)
            close(_golden(out, f"{e}.backward", "output.0"), ref, dt)

        e = f"NPU.npu_cross_entropy_loss.{i}"
        lp = _pt(f"{e}.forward.output.1.pt").double()
        t = _pt(f"{e}.forward.input.1.pt")
        g = _pt(f"{e}.backward.input.0.pt").double().reshape(())
        ref = torch.exp(lp)
        ref[torch.arange(len(t)), t] -= 1
        close(_golden(out, f"{e}.backward", "output.0"), ref * g / len(t), dt)


def test_a_wrong_output_fails(tmp_path):
    """A dump whose recorded gradient is off by 5 % (bf16 threshold MERE 2^-7): exit 1, that row FAIL."""
    dump = tmp_path / "step0" / "rank0"
    shutil.copytree(DUMP, dump)
    name = "Functional.smooth_l1_loss.1.backward.output.0.pt"
    p = dump / "dump_tensor_data" / name
    torch.save(torch.load(p, weights_only=True) * 1.05, p)
    r = fastgrad_inprocess("golden", "--from-msprobe", dump, "--out", tmp_path / "out", "-q")
    assert r.returncode == 1, r.stdout + r.stderr
    bad = [row for row in _rows(tmp_path / "out") if row["verdict"] != "PASS"]
    assert [row["entry"] for row in bad] == ["Functional.smooth_l1_loss.1.backward"]
    assert "MERE" in bad[0]["errors"] and r.stdout.startswith("\nFAIL: 16/17")


def test_bench_dump_holds_fastgrads_outputs(golden_run):
    _, out, bench = golden_run
    b = os.path.join(bench, "rank0")
    with open(os.path.join(b, "dump.json")) as f:
        d = json.load(f)["data"]
    n = 0
    for row in _rows(out):
        i = int(row["output"].split()[0].split(".")[1])
        rec = d[row["entry"]]["output"][i]
        t = torch.load(os.path.join(b, "dump_tensor_data", rec["data_name"]), weights_only=True)
        g = _golden(out, row["entry"], f"output.{i}")
        assert str(t.dtype).endswith(row["dtype"].replace("bfloat16", "bfloat16")) and list(t.shape) == rec["shape"]
        np.testing.assert_array_equal(_f64(g).numpy(), t.double().numpy())
        if t.is_floating_point() and t.numel():
            assert rec["Max"] == pytest.approx(t.double().max().item())
            assert rec["Norm"] == pytest.approx(torch.linalg.vector_norm(t.double()).item())
        n += 1
    assert n == 17
    # everything else is the user's dump, unchanged
    for name in ("Functional.cross_entropy.0.backward.output.0.pt", "Torch.softmax.0.forward.input.0.pt"):
        assert torch.equal(_pt(name), _pt(name, b))


def test_msprobe_compare_against_the_bench_dump(golden_run, tmp_path):
    pytest.importorskip("msprobe", reason="mindstudio-probe not installed (pip install 'fastgrad[msprobe]')")
    _, out, bench = golden_run
    exe = shutil.which("msprobe") or os.path.join(os.path.dirname(sys.executable), "msprobe")
    r = subprocess.run(
        [exe, "compare", "-tp", os.path.dirname(DUMP), "-gp", bench, "-o", str(tmp_path / "cmp")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (res,) = glob.glob(str(tmp_path / "cmp" / "compare_result_*.csv"))
    with open(res) as f:
        rows = {row["NPU Name"]: row for row in csv.DictReader(f)}
    judged = [f"{row['entry']}.{row['output'].split()[0]}" for row in _rows(out)]
    assert all(j in rows for j in judged)
    assert {rows[j]["Result"] for j in judged} == {"pass"}
    assert {row["Result"] for row in rows.values()} == {"pass"}
    assert all(float(rows[j]["Cosine"]) > 0.9999 for j in judged if rows[j]["Cosine"] not in ("unsupported", "N/A"))


def test_a_fresh_msprobe_dump_maps_the_same(tmp_path):
    """msprobe as installed makes a dump the committed one stands for (same entries, same verdict)."""
    pytest.importorskip("msprobe", reason="mindstudio-probe not installed (pip install 'fastgrad[msprobe]')")
    script = os.path.join(HERE, "data", "make_msprobe_dump.py")
    r = subprocess.run(
        [sys.executable, script, str(tmp_path / "dump")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(HERE),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    dump = M.read_dump(str(tmp_path / "dump"))
    mapped, unmapped = M.map_dump(dump)
    assert {m.entry: m.op for m in mapped} == EXPECTED
    rows, rejected = M.check_dump(dump, mapped)
    assert not rejected and len(rows) == 17 and all(row.verdict == "PASS" for row in rows)


# ------------------------------------------------------------- entries the step does not make ----


def _record(t, name):
    return {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "data_name": name}


def _write(tmp_path, data, tensors):
    d = tmp_path / "rank0"
    (d / "dump_tensor_data").mkdir(parents=True)
    for name, t in tensors.items():
        torch.save(t, d / "dump_tensor_data" / name)
    with open(d / "dump.json", "w") as f:
        json.dump({"task": "tensor", "level": "L1", "framework": "pytorch", "dump_data_dir": None, "data": data}, f)
    return d


def test_aten_and_direct_npu_backward_entries(tmp_path):
    """Aten.smooth_l1_loss_backward / Aten.embedding_dense_backward / NPU.npu_cross_entropy_loss_backward
    / NPU.npu_fused_cross_entropy_loss_with_max_sum forward records, outputs from float64 torch."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    go = torch.tensor(0.5)
    xx = x.double().requires_grad_()
    F.smooth_l1_loss(xx, y.double(), reduction="sum", beta=0.25).backward(go.double())
    grad = torch.randn(6, 3, generator=g)
    idx = torch.tensor([1, 1, 0, 3, 1, 2])
    w = torch.zeros(5, 3, dtype=torch.float64, requires_grad=True)
    F.embedding(idx, w, padding_idx=2).backward(grad.double())
    lp = torch.log_softmax(torch.randn(4, 9, generator=g), -1)
    t = torch.tensor([0, 8, 3, 3])
    ce = torch.exp(lp.double())
    ce[torch.arange(4), t] -= 1
    m, s, p = torch.randn(4), torch.rand(4) + 1, -torch.rand(4)
    T = {
        "a.0": go,
        "a.1": x,
        "a.2": y,
        "a.o": xx.grad.float(),
        "e.0": grad,
        "e.1": idx,
        "e.o": w.grad.float(),
        "c.0": torch.tensor([2.0]),
        "c.1": lp,
        "c.2": t,
        "c.o": (ce * 2.0 / 4).float(),
        "f.0": m,
        "f.1": s,
        "f.2": p,
        "f.o": (torch.log(s.double()) - p.double()).float(),
    }
    R = {k: _record(v, k) for k, v in T.items()}
    num = lambda v: {"type": type(v).__name__, "value": v}  # noqa: E731
    data = {
        "Aten.smooth_l1_loss_backward.default.0.forward": {
            "input_args": [R["a.0"], R["a.1"], R["a.2"], num(2), num(0.25)],
            "input_kwargs": {},
            "output": [R["a.o"]],
        },
        "Aten.embedding_dense_backward.default.0.forward": {
            "input_args": [R["e.0"], R["e.1"], num(5), num(2), num(False)],
            "input_kwargs": {},
            "output": [R["e.o"]],
        },
        "NPU.npu_cross_entropy_loss_backward.0.forward": {
            "input_args": [R["c.0"], R["c.1"], R["c.2"]],
            "input_kwargs": {"reduction": num("mean")},
            "output": [R["c.o"]],
        },
        "NPU.npu_fused_cross_entropy_loss_with_max_sum.0.forward": {
            "input_args": [R["f.0"], R["f.1"], R["f.2"]],
            "input_kwargs": {"label_smoothing": num(0.0)},
            "output": [R["f.o"], {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [0], "data_name": None}],
        },
        "NPU.npu_rms_norm.0.forward": {"input_args": [R["f.0"]], "input_kwargs": {}, "output": [R["f.0"]]},
        "Tensor.__add__.0.forward": {"input_args": [R["f.0"]], "input_kwargs": {}, "output": [R["f.0"]]},
    }
    dump = M.read_dump(str(_write(tmp_path, data, T)))
    mapped, unmapped = M.map_dump(dump)
    assert [m.op for m in mapped] == [
        "smooth_l1_loss_backward",
        "embedding_dense_backward",
        "cross_entropy_loss_grad",
        "fused_cross_entropy_loss_with_max_sum",
    ]
    rows, rejected = M.check_dump(dump, mapped)
    assert not rejected and [r.verdict for r in rows] == ["PASS"] * 4, [(r.entry, r.errors) for r in rows]
    reasons = {u.entry: (u.family, u.reason) for u in unmapped}
    assert reasons["NPU.npu_rms_norm.0.forward"] == (
        True,
        "NPU.npu_rms_norm: a torch_npu op fastgrad does not implement",
    )
    assert reasons["Tensor.__add__.0.forward"][0] is False
    # and a wrong one fails
    torch.save(T["c.o"] * 1.01, dump.tensor_dir + "/c.o")
    rows, _ = M.check_dump(dump, mapped)
    assert [r.verdict for r in rows] == ["PASS", "PASS", "FAIL", "PASS"]


def test_softmax_not_over_the_last_dim_is_not_mapped(tmp_path):
    y = torch.softmax(torch.randn(3, 4), 0)
    T = {"y": y}
    R = {"y": _record(y, "y")}
    data = {
        "Functional.softmax.0.forward": {
            "input_args": [R["y"]],
            "input_kwargs": {"dim": {"type": "int", "value": 0}},
            "output": [R["y"]],
        },
        "Functional.softmax.0.backward": {"input": [R["y"]], "output": [R["y"]]},
    }
    dump = M.read_dump(str(_write(tmp_path, data, T)))
    mapped, unmapped = M.map_dump(dump)
    assert not mapped and "over dim 0 of a 2-D tensor" in unmapped[0].reason


@pytest.mark.parametrize("case", ["missing", "two", "badjson", "file"])
def test_bad_dump_directory_is_one_line_exit_2(tmp_path, case):
    if case == "missing":
        path = tmp_path / "nope"
    elif case == "two":
        for r in ("rank0", "rank1"):
            shutil.copytree(DUMP, tmp_path / "step0" / r)
        path = tmp_path
    elif case == "badjson":
        path = tmp_path / "rank0"
        path.mkdir()
        (path / "dump.json").write_text("{not json")
    else:
        path = tmp_path / "x.txt"
        path.write_text("hello")
    r = fastgrad_inprocess("golden", "--from-msprobe", path, "--out", tmp_path / "out")
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("fastgrad golden: --from-msprobe")
    assert not (tmp_path / "out").exists()


def test_soc_version_flag(tmp_path):
    r = fastgrad_inprocess("golden", "--from-msprobe", DUMP, "--out", tmp_path / "o", "--soc-version", "NoSuchSoC")
    assert r.returncode == 2 and "--soc-version" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    import fastgrad as fg

    if hasattr(fg, "soc_version"):
        r = fastgrad_inprocess(
            "golden", "--from-msprobe", DUMP, "--out", tmp_path / "o", "--soc-version", "Ascend910_93", "-q"
        )
        assert r.returncode == 0, r.stdout + r.stderr
        with open(tmp_path / "o" / "summary.json") as f:
            assert json.load(f)["soc_version"] == "Ascend910_93"


def test_missing_or_corrupt_tensor_file_is_one_line(tmp_path):
    dump = tmp_path / "rank0"
    shutil.copytree(DUMP, dump)
    os.remove(dump / "dump_tensor_data" / "Functional.embedding.0.backward.input.0.pt")
    r = fastgrad_inprocess("golden", "--from-msprobe", dump, "--out", tmp_path / "o")
    assert r.returncode == 2 and "missing" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    shutil.copytree(DUMP, dump, dirs_exist_ok=True)
    (dump / "dump_tensor_data" / "Functional.embedding.0.backward.input.0.pt").write_bytes(b"junk")
    r = fastgrad_inprocess("golden", "--from-msprobe", dump, "--out", tmp_path / "o")
    assert r.returncode == 2 and "weights-only" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bench_dump_never_replaces_the_users_dump(tmp_path):
    dump = tmp_path / "step0" / "rank0"
    shutil.copytree(DUMP, dump)
    for target in (tmp_path / "step0", dump, dump / "inside"):
        r = fastgrad_inprocess("golden", "--from-msprobe", dump, "--out", tmp_path / "o", "--bench-dump", target)
        assert r.returncode == 2 and r.stderr.startswith("fastgrad golden: --bench-dump"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(dump / "dump_tensor_data")) == sorted(os.listdir(os.path.join(DUMP, "dump_tensor_data")))
    assert not (tmp_path / "o").exists()


def test_smooth_l1_target_gradient_and_embedding_padding_records(tmp_path):
    """d target of smooth-L1 (output.1 = -d input) and F.embedding's negative padding_idx, from float64 torch."""
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    xx, tt = x.double().requires_grad_(), t.double().requires_grad_()
    F.smooth_l1_loss(xx, tt, reduction="none", beta=0.7).backward(torch.full((4, 6), 0.5, dtype=torch.float64))
    idx = torch.tensor([[0, 4, 4, 1]])
    w = torch.randn(5, 3, generator=g)
    ww = w.double().requires_grad_()
    F.embedding(idx, ww, padding_idx=-1).backward(torch.ones(1, 4, 3, dtype=torch.float64))  # row 4 is padding
    T = {
        "x": x,
        "t": t,
        "go": torch.full((4, 6), 0.5),
        "gx": xx.grad.float(),
        "gt": tt.grad.float(),
        "idx": idx,
        "w": w,
        "ge": torch.ones(1, 4, 3),
        "gw": ww.grad.float(),
    }
    R = {k: _record(v, k) for k, v in T.items()}
    num = lambda v: {"type": type(v).__name__, "value": v}  # noqa: E731
    data = {
        "Functional.smooth_l1_loss.0.forward": {
            "input_args": [R["x"], R["t"]],
            "input_kwargs": {"reduction": num("none"), "beta": num(0.7)},
        },
        "Functional.smooth_l1_loss.0.backward": {"input": [R["go"]], "output": [R["gx"], R["gt"]]},
        "Functional.embedding.0.forward": {
            "input_args": [R["idx"], R["w"], num(-1), None, num(2.0), num(False), num(False)],
            "input_kwargs": {},
        },
        "Functional.embedding.0.backward": {"input": [R["ge"]], "output": [R["gw"]]},
    }
    dump = M.read_dump(str(_write(tmp_path, data, T)))
    mapped, unmapped = M.map_dump(dump)
    assert not unmapped and mapped[1].kwargs["padding_idx"] == 4
    rows, _ = M.check_dump(dump, mapped)
    assert [(r.output, r.verdict) for r in rows] == [
        ("output.0 grad_input", "PASS"),
        ("output.1 grad_target", "PASS"),
        ("output.0 grad_weight", "PASS"),
    ]
    np.testing.assert_array_equal(rows[1].golden, -rows[0].golden)
    assert torch.all(T["gw"][4] == 0)
