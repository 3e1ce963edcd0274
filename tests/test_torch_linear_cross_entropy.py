"""fastgrad.torch.linear_cross_entropy / LinearCrossEntropyLoss (single process).

Oracles:
* PyTorch autograd of ``F.cross_entropy(hidden @ weight.T, ...)`` in float64 (the truth);
* a float64 golden of the *device semantics* written here (``_device_golden``): logits rounded to
  the input dtype for the forward statistics, fp32-exact logits in the backward, ``g`` rounded once
  to the input dtype, ``grad_input``/``grad_weight`` rounded once;
* the reference backend.

Tolerance reasoning (bf16/fp16).  The device (and so fastgrad) computes the row max / sum-exp from
logits rounded to the input dtype, but the backward's softmax from unrounded fp32 logits divided by
that sum: ``Σ_v p_v`` differs from 1 by about one rounding of a logit (``|l|·2^-9`` in bf16).  That
is the same order as PyTorch's bf16 error (which rounds logits and ``g`` too) but not smaller: we
measured fastgrad's max gradient error at 0.7–3.1× PyTorch bf16 autograd's, both against float64.
So (1) against the device golden the kernels must agree to one rounding of the output (≤ 1 ulp
elementwise) — a tight test; (2) against the float64 truth the max error must stay within 4× that
of PyTorch's own bf16/fp16 autograd — any real bug (a wrong scale, a missing term, a dropped row)
is orders of magnitude above both.  fp32 must match float64 autograd to ~1e-5 relative.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tracemalloc

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402
from fastgrad import tiling  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOWP = {torch.bfloat16: 7, torch.float16: 10}   # explicit mantissa bits
IGN = -100


def _inputs(BT, H, V, dtype, seed=0, ignore_every=0, lead=None, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(BT, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * (scale / H ** 0.5)
    t = torch.randint(0, V, (BT,), generator=g)
    if ignore_every:
        t[::ignore_every] = IGN
    if lead is not None:
        h, t = h.reshape(*lead, H), t.reshape(*lead)
    return h.to(dtype), w.to(dtype), t


def _upstream(reduction, shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    if reduction == "none":
        return torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
    return torch.tensor(0.75, dtype=torch.float64)


def _run(h, w, t, go, fn=None, **kw):
    """fastgrad loss and (grad_hidden, grad_weight) for upstream grad ``go``."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    fn = fn or ft.linear_cross_entropy
    loss = fn(h, w, t, **kw)
    loss.backward(go.to(loss.dtype))
    return loss.detach(), h.grad, w.grad


def _torch_ref(h, w, t, go, dtype=torch.float64, **kw):
    """PyTorch autograd of F.cross_entropy(h @ w.T) in ``dtype``."""
    h = h.detach().to(dtype).requires_grad_()
    w = w.detach().to(dtype).requires_grad_()
    loss = F.cross_entropy((h @ w.T).reshape(-1, w.shape[0]), t.reshape(-1), **kw)
    if kw.get("reduction") == "none":
        loss = loss.reshape(t.shape)
    loss.backward(go.to(loss.dtype))
    return loss.detach(), h.grad, w.grad


def _device_golden(h, w, t, go, ignore_index=IGN, reduction="mean", label_smoothing=0.0):
    """float64 golden of the device semantics (see module docstring), independent of the kernels."""
    dt = h.dtype
    H, V = h.shape[-1], w.shape[0]
    x = h.reshape(-1, H).double()
    W = w.double()
    tt = t.reshape(-1)
    L = x @ W.T
    Lr = L.to(dt).double()                                   # forward: logits rounded to dtype
    m = Lr.max(1).values
    s = torch.exp(Lr - m[:, None]).sum(1)
    valid = tt != ignore_index
    tc = torch.where(valid, tt, 0)
    nll = torch.log(s) + m - Lr.gather(1, tc[:, None]).squeeze(1)
    eps = label_smoothing
    rows_loss = (1 - eps) * nll + eps * (torch.log(s) + m - L.mean(1))
    rows_loss = torch.where(valid, rows_loss, 0.0)
    n = int(valid.sum())
    if reduction == "mean":
        loss, rows = rows_loss.sum() / n, torch.where(valid, go / n, 0.0)
    elif reduction == "sum":
        loss, rows = rows_loss.sum(), torch.where(valid, go, 0.0)
    else:
        loss, rows = rows_loss.reshape(t.shape), torch.where(valid, go.reshape(-1), 0.0)
    p = torch.exp(L - m[:, None]) / s[:, None]              # backward: unrounded logits
    oh = F.one_hot(tc, V).double()
    G = ((p - (1 - eps) * oh - eps / V) * rows[:, None]).to(dt).double()
    gi = (G @ W).to(dt).double().reshape(h.shape)
    gw = (G.T @ x).to(dt).double()
    # what one ulp of slack in each rounded g (fp32 vs fp64 softmax may round g the other way)
    # can move each output element
    slack = 2.0 ** -LOWP.get(dt, 23)
    gi.slack = (slack * (G.abs() @ W.abs())).reshape(h.shape)
    gw.slack = slack * (G.abs().T @ x.abs())
    return loss, gi, gw


def _assert_tight_fp32(a, ref, rtol=2e-5):
    a, ref = a.double(), ref.double()
    bound = rtol * max(ref.abs().max().item(), 1e-30)
    err = (a - ref).abs().max().item() if a.numel() else 0.0
    assert err <= bound, f"max err {err:.3g} > {bound:.3g}"


def _assert_within_ulp(a, ref, dtype, slack=None):
    """|a - ref| <= 1 ulp of ref (dtype) + ``slack`` (the golden's bound on the effect of the
    intermediate g rounding differently), elementwise."""
    a, ref = a.double(), ref.double()
    rel = 2.0 ** -LOWP[dtype]
    tol = rel * ref.abs() + (slack if slack is not None else 0.0) + 1e-30
    bad = (a - ref).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements beyond 1 ulp; worst {(a - ref).abs().max()}"


# ---------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------

SHAPES = [(37, 19, 53, None), (1, 1, 1, None), (2 * 3, 11, 129, (2, 3)), (5, 128, 1000, None)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_fp32_matches_float64_autograd(shape, reduction, label_smoothing):
    BT, H, V, lead = shape
    h, w, t = _inputs(BT, H, V, torch.float32, ignore_every=4 if BT > 1 else 0, lead=lead)
    go = _upstream(reduction, t.shape)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    loss, gh, gw = _run(h, w, t, go, **kw)
    rl, rgh, rgw = _torch_ref(h, w, t, go, **kw)
    assert loss.dtype == torch.float32 and loss.shape == rl.shape
    assert gh.dtype == torch.float32 and gh.shape == h.shape and gw.shape == w.shape
    _assert_tight_fp32(loss, rl)
    _assert_tight_fp32(gh, rgh)
    _assert_tight_fp32(gw, rgw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_16bit_matches_device_golden_and_pytorch(dtype, reduction, label_smoothing):
    h, w, t = _inputs(129, 48, 100, dtype, seed=3, ignore_every=7)
    go = _upstream(reduction, t.shape)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    loss, gh, gw = _run(h, w, t, go, precision="device", **kw)
    assert gh.dtype == dtype and gw.dtype == dtype and loss.dtype == torch.float32
    # (1) the device semantics, tight
    dl, dgh, dgw = _device_golden(h, w, t, go, **kw)
    _assert_tight_fp32(loss, dl, rtol=1e-5)
    _assert_within_ulp(gh, dgh, dtype, dgh.slack)
    _assert_within_ulp(gw, dgw, dtype, dgw.slack)
    # (2) the float64 truth, against PyTorch's own low-precision error
    rl, rgh, rgw = _torch_ref(h, w, t, go, **kw)
    ll, lgh, lgw = _torch_ref(h, w, t, go, dtype=dtype, **kw)
    for ours, truth, lowp in ((gh, rgh, lgh), (gw, rgw, lgw)):
        e_ours = (ours.double() - truth).abs().max().item()
        e_torch = (lowp.double() - truth).abs().max().item()
        assert e_ours <= 4 * e_torch + 1e-6 * truth.abs().max().item(), (e_ours, e_torch)
    # the loss is fp32 from rounded logits: no worse than PyTorch's bf16 loss (rounded output)
    e_loss = (loss.double() - rl).abs().max().item()
    rel = 2.0 ** -LOWP[dtype]
    assert e_loss <= 4 * max((ll.double() - rl).abs().max().item(), rel * rl.abs().max().item())


@pytest.mark.parametrize("reduction,ls,ignore_every,lead", [
    ("mean", 0.0, 3, None), ("sum", 0.2, 2, None), ("none", 0.1, 3, (2, 3)), ("mean", 0.3, 0, None),
])
def test_gradcheck_float64(reduction, ls, ignore_every, lead):
    h, w, t = _inputs(6, 4, 7, torch.float64, seed=5, ignore_every=ignore_every, lead=lead)
    h.requires_grad_()
    w.requires_grad_()
    def fn(a, b):
        return ft.linear_cross_entropy(a, b, t, reduction=reduction, label_smoothing=ls)

    assert torch.autograd.gradcheck(fn, (h, w), eps=1e-6, atol=1e-8, rtol=1e-6)
    # float64 on the device path: the aclnn decomposition in chunked float64 torch matmuls
    def dev(a, b):
        return ft.linear_cross_entropy(a, b, t, reduction=reduction, label_smoothing=ls, precision="device")

    assert torch.autograd.gradcheck(dev, (h, w), eps=1e-6, atol=1e-8, rtol=1e-6)
    assert dev(h, w).dtype == torch.float64


def test_float64_path_matches_autograd_with_large_vocab():
    # V > the fp64 path's chunk (2048): online max/sum across chunks
    h, w, t = _inputs(9, 8, 4099, torch.float64, seed=7, ignore_every=4)
    go = _upstream("none", t.shape)
    for ls in (0.0, 0.05):
        kw = dict(reduction="none", label_smoothing=ls)
        loss, gh, gw = _run(h, w, t, go, **kw)
        rl, rgh, rgw = _torch_ref(h, w, t, go, **kw)
        torch.testing.assert_close(loss, rl, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gh, rgh, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(gw, rgw, rtol=1e-10, atol=1e-13)


def test_ignore_index_in_vocabulary_and_int32_target():
    h, w, t = _inputs(20, 8, 12, torch.float32, seed=9)
    t[::3] = 2                                   # ignore_index is a real class id here
    go = _upstream("mean", ())
    loss, gh, gw = _run(h, w, t.to(torch.int32), go, ignore_index=2)
    rl, rgh, rgw = _torch_ref(h, w, t, go, ignore_index=2)
    _assert_tight_fp32(loss, rl)
    _assert_tight_fp32(gh, rgh)
    _assert_tight_fp32(gw, rgw)
    assert (gh[::3] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(reduction):
    h, w, t = _inputs(5, 4, 6, torch.bfloat16)
    t[:] = IGN
    go = _upstream(reduction, t.shape)
    loss, gh, gw = _run(h, w, t, go, reduction=reduction)
    rl, _, _ = _torch_ref(h, w, t, go, reduction=reduction)
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(rl)      # 0/0, as PyTorch
    else:
        assert (loss == 0).all() and (rl == 0).all()
    assert (gh == 0).all() and (gw == 0).all()


def test_empty_rows():
    h, w, t = _inputs(0, 5, 7, torch.float32)
    for r in ("sum", "none"):
        loss, gh, gw = _run(h, w, t, _upstream(r, t.shape), reduction=r)
        assert loss.shape == (() if r == "sum" else (0,))
        assert gh.shape == (0, 5) and (gw == 0).all()


def test_partial_requires_grad_and_no_grad():
    h, w, t = _inputs(10, 6, 9, torch.bfloat16, seed=2)
    _, gh_full, gw_full = _run(h, w, t, _upstream("mean", ()))
    hh = h.clone().requires_grad_()
    ft.linear_cross_entropy(hh, w, t).backward(torch.tensor(0.75))
    assert torch.equal(hh.grad, gh_full)
    ww = w.clone().requires_grad_()
    ft.linear_cross_entropy(h, ww, t).backward(torch.tensor(0.75))
    assert torch.equal(ww.grad, gw_full)
    with torch.no_grad():
        l0 = ft.linear_cross_entropy(h, w, t)
    assert not l0.requires_grad and torch.equal(l0, ft.linear_cross_entropy(hh, ww, t).detach())


@pytest.mark.parametrize("kw", [{}, {"fused": True}, {"fused": False}, {"reduction": "none"},
                                {"precision": "device"}])
def test_double_backward_is_refused(kw):
    """create_graph=True is refused at the first backward (AclnnError 361001, a RuntimeError) on
    every path: before, the fused path returned a gradient without a graph and a Hessian of
    zeros (PyTorch's: max 0.41) and a gradient penalty off by its second-order term."""
    h, w, t = _inputs(4, 3, 5, torch.float64)
    h.requires_grad_()
    loss = ft.linear_cross_entropy(h, w, t, **kw)
    loss = loss.sum() if loss.dim() else loss
    with pytest.raises(fg.AclnnError, match="create_graph") as e:
        torch.autograd.grad(loss, h, create_graph=True)
    assert e.value.status == 361001 and isinstance(e.value, RuntimeError)
    # the hessian of the loss w.r.t. the hidden states, and a gradient penalty: refused, not zeros
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.functional.hessian(lambda x: ft.linear_cross_entropy(x, w, t), h.detach())
    ww = w.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="create_graph"):
        (g,) = torch.autograd.grad(ft.linear_cross_entropy(h, ww, t), h, create_graph=True)
        (g.pow(2).sum()).backward()
    # a plain backward still works, also with retain_graph (twice the same gradient)
    loss = ft.linear_cross_entropy(h, w, t, **kw)
    loss = loss.sum() if loss.dim() else loss
    (g1,) = torch.autograd.grad(loss, h, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, h)
    assert torch.equal(g1, g2) and g1.abs().max() > 0


# ---------------------------------------------------------------------------------------------
# contract: module, layouts, inputs untouched, determinism, backends, strict, errors
# ---------------------------------------------------------------------------------------------

def test_module_equals_function():
    h, w, t = _inputs(17, 8, 23, torch.bfloat16, seed=4, ignore_every=5)
    go = _upstream("sum", ())
    mod = ft.LinearCrossEntropyLoss(reduction="sum", label_smoothing=0.1)
    assert "reduction='sum'" in repr(mod) and "label_smoothing=0.1" in repr(mod)
    a = _run(h, w, t, go, fn=mod)
    b = _run(h, w, t, go, reduction="sum", label_smoothing=0.1)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_noncontiguous_inputs_and_inputs_unmodified():
    h, w, t = _inputs(21, 10, 33, torch.bfloat16, seed=6, ignore_every=4)
    go = _upstream("none", t.shape)
    ref = _run(h, w, t, go, reduction="none", label_smoothing=0.1)
    hn = torch.empty(10, 21, dtype=h.dtype).T            # transposed storage
    hn.copy_(h)
    wn = torch.empty(33, 20, dtype=w.dtype)[:, ::2]      # strided columns
    wn.copy_(w)
    tn = torch.empty(42, dtype=t.dtype)[::2]
    tn.copy_(t)
    snap = (hn.clone(), wn.clone(), tn.clone())
    assert not hn.is_contiguous() and not wn.is_contiguous() and not tn.is_contiguous()
    loss = ft.linear_cross_entropy(hn, wn, tn, reduction="none", label_smoothing=0.1)
    assert torch.equal(loss, ref[0])
    got = _run(hn, wn, tn, go, reduction="none", label_smoothing=0.1)
    for x, y in zip(got, ref):
        assert torch.equal(x, y)
    for a, b in zip((hn, wn, tn), snap):
        assert torch.equal(a, b)


def test_deterministic_across_threads():
    h, w, t = _inputs(300, 64, 700, torch.bfloat16, seed=8, ignore_every=9)
    go = _upstream("mean", ())
    with fg.num_threads(1):
        a = _run(h, w, t, go, label_smoothing=0.1)
    with fg.num_threads(2):
        b = _run(h, w, t, go, label_smoothing=0.1)
        c = _run(h, w, t, go, label_smoothing=0.1)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(y, z)


def test_reference_backend_agrees():
    h, w, t = _inputs(19, 12, 41, torch.bfloat16, seed=10, ignore_every=5)
    go = _upstream("sum", ())
    a = _run(h, w, t, go, reduction="sum")
    with fg.use_backend("reference"):
        b = _run(h, w, t, go, reduction="sum")
    _assert_tight_fp32(a[0], b[0], rtol=1e-6)
    _, sgh, sgw = _device_golden(h, w, t, go, reduction="sum")
    _assert_within_ulp(a[1], b[1], torch.bfloat16, sgh.slack)
    _assert_within_ulp(a[2], b[2], torch.bfloat16, sgw.slack)


def test_strict_mode_rejects_what_the_device_rejects():
    h, w, t = _inputs(4, 3, 5, torch.bfloat16)
    with fg.strict():
        ft.linear_cross_entropy(h, w, t)                                   # fine on the device
        with pytest.raises(fg.AclnnError) as e:
            ft.linear_cross_entropy(h, w, t, label_smoothing=0.1)
        assert e.value.status == 161002 and "label_smoothing" in str(e.value)
        with pytest.raises(fg.AclnnError) as e:
            ft.linear_cross_entropy(h.float(), w.float(), t)
        assert e.value.status == 161002


@pytest.mark.parametrize("case,param,match", [
    ("weight_dtype", "weight", "hidden's dtype"),
    ("hidden_int", "hidden", "dtype bfloat16"),
    ("target_float", "target", "int64 or int32"),
    ("target_shape", "target", "hidden.shape"),
    ("H_mismatch", "hidden", "H == weight.shape"),
    ("weight_1d", "weight", "2-D"),
    ("target_oob", "target", "Target 5 is out of bounds"),
    ("target_negative", "target", "Target -3 is out of bounds"),
    ("reduction", "reduction", "reduction"),
    ("label_smoothing", "label_smoothing", "label_smoothing"),
    ("numpy_input", "hidden", "torch.Tensor"),
    ("shard_without_group", "vocab_start_index", "process_group"),
    # found by fuzzing: builtins errors, or strings taken as numbers
    ("lse_square_scale_str", "lse_square_scale", "finite float >= 0"),
    ("softcap_str", "softcap", "finite float > 0 or None"),
    ("temperature_str", "temperature", "finite float > 0"),
    ("temperature_bool", "temperature", "finite float > 0"),
    ("ignore_index_huge", "ignore_index", "int64"),
    ("process_group_object", "process_group", "ProcessGroup"),
    ("weight_sparse", "weight", "strided"),
    ("hidden_sparse", "hidden", "strided"),
])
def test_errors(case, param, match):
    """Every bad argument: AclnnError 161002 (a ValueError) naming the parameter."""
    h, w, t = _inputs(4, 3, 5, torch.float32)
    kw = {}
    if case == "weight_dtype":
        w = w.double()
    elif case == "hidden_int":
        h, w = h.int(), w.int()
    elif case == "target_float":
        t = t.float()
    elif case == "target_shape":
        t = t[:3]
    elif case == "H_mismatch":
        h = h[:, :2]
    elif case == "weight_1d":
        w = w[0]
    elif case == "target_oob":
        t[1] = 5
    elif case == "target_negative":
        t[2] = -3
    elif case == "reduction":
        kw["reduction"] = "avg"
    elif case == "label_smoothing":
        kw["label_smoothing"] = 1.5
    elif case == "numpy_input":
        h = h.numpy()
    elif case == "shard_without_group":
        kw["vocab_start_index"] = 2
    elif case == "lse_square_scale_str":
        kw["lse_square_scale"] = "a"
    elif case == "softcap_str":
        kw["softcap"] = "5"
    elif case == "temperature_str":
        kw["temperature"] = "0.5"
    elif case == "temperature_bool":
        kw["temperature"] = True
    elif case == "ignore_index_huge":
        kw["ignore_index"] = 2**70
    elif case == "process_group_object":
        kw["process_group"] = object()
    elif case == "weight_sparse":
        w = w.to_sparse()
    elif case == "hidden_sparse":
        h = h.to_sparse()
    with pytest.raises(fg.AclnnError, match=match) as e:
        ft.linear_cross_entropy(h, w, t, **kw)
    assert e.value.status == 161002 and e.value.param == param
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("fused", [True, False])
def test_never_materializes_logits(fused):
    """numpy scratch (traced by tracemalloc) stays far below one fp32 [BT, V] matrix: the row
    block's logits (the budget) plus the fp32 [V, H] grad_weight accumulator and [BT, H]."""
    BT, H, V = 1024, 32, 16384
    h, w, t = _inputs(BT, H, V, torch.bfloat16, seed=11)
    h.requires_grad_()
    w.requires_grad_()
    logits_bytes = 4 * BT * V                                   # 64 MiB
    tiling.set_workspace_budget(2 * 2**20)
    try:
        ft.linear_cross_entropy(h[:8], w[:300], t[:8].clamp(max=299), fused=fused).backward()
        tracemalloc.start()
        ft.linear_cross_entropy(h, w, t, fused=fused).backward()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        tiling.set_workspace_budget(None)
    assert peak < logits_bytes / 6, f"peak {peak / 2**20:.1f} MiB"


def test_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import fastgrad, numpy as np\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "try:\n"
            "    import fastgrad.torch\n"
            "except ImportError as e:\n"
            "    print('IMPORTERROR', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "IMPORTERROR" in r.stdout and "pip install torch" in r.stdout
    # the CPU index named (a plain `pip install torch` is the CUDA build); fastgrad is not on PyPI
    assert "download.pytorch.org/whl/cpu" in r.stdout and "fastgrad[torch]" not in r.stdout


def test_tiny_lm_example_runs():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_tiny_lm.py"),
                        "--steps", "4", "--threads", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if re.match(r"step\s+\d+\s", ln)]
    assert len(lines) == 4, r.stdout
    assert "MATCH" in r.stdout, r.stdout


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_zero_hidden_size_is_the_bias_cross_entropy(reduction):
    """H = 0 (found by fuzzing: a reshape error): the logits are the bias (or zeros), as PyTorch's
    ``cross_entropy(h @ w.T + b)`` on the empty product; the gradients of h and w are empty."""
    g = torch.Generator().manual_seed(4)
    t = torch.randint(0, 7, (5,), generator=g)
    t[2] = -100
    b0 = torch.randn(7, generator=g, dtype=torch.float64)
    got, ref = [], []
    for out, fn in ((got, ft.linear_cross_entropy), (ref, None)):
        h = torch.zeros(5, 0, dtype=torch.float64, requires_grad=True)
        w = torch.zeros(7, 0, dtype=torch.float64, requires_grad=True)
        b = b0.clone().requires_grad_()
        if fn is None:
            loss = F.cross_entropy(h @ w.T + b, t, reduction=reduction)
        else:
            loss = fn(h, w, t, bias=b, reduction=reduction)
        loss.sum().backward()
        out += [loss.detach(), b.grad, h.grad.shape, w.grad.shape]
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)
    assert got[2:] == ref[2:] == [(5, 0), (7, 0)]


@pytest.mark.parametrize("fused", [True, False])
def test_autocast_casts_the_operands_as_f_linear_does(fused):
    """Under ``torch.autocast("cpu", bfloat16)`` fp32 hidden / weight / bias are the bf16 operands
    (as ``F.linear``'s there; found by fuzzing: a dtype error), the loss fp32, the fp32 weight's
    gradient through the cast — against float64 autograd on the bf16-rounded operands."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(12, 16, generator=g)
    w = (torch.randn(40, 16, generator=g) * 0.3).requires_grad_()
    b = torch.randn(40, generator=g).requires_grad_()
    t = torch.randint(0, 40, (12,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ft.linear_cross_entropy(h, w, t, bias=b, fused=fused)
    loss.backward()
    assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    h64, w64, b64 = (x.detach().bfloat16().double() for x in (h, w, b))
    w64.requires_grad_()
    b64.requires_grad_()
    ref = F.cross_entropy(h64 @ w64.T + b64, t)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-7)
    # the bf16 gradient rounded once (half a bf16 ulp), then widened exactly
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=2**-8, atol=1e-7)
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=2**-8, atol=1e-7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False), pytest.raises(fg.AclnnError, match="weight"):
        ft.linear_cross_entropy(h.bfloat16(), w, t)  # outside autocast mixed dtypes stay an error
