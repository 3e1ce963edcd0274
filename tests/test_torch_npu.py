"""fastgrad.torch_npu: torch_npu's signatures (op-plugin op_plugin_functions.yaml) against float64 PyTorch
oracles written here from the torch_npu docs and op-plugin's own CPU goldens."""

import inspect

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import fastgrad as fg
from fastgrad import torch_npu

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
ULP = {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def assert_rounded(out, ref64, dtype, ulps=1.0, atol=0.0):
    """``out`` is ``ref64`` rounded to ``dtype`` within ``ulps`` units in the last place (+ atol)."""
    assert out.dtype == dtype and out.shape == ref64.shape
    err = (out.double() - ref64).abs()
    lim = ulps * ULP[dtype] * ref64.abs() + atol
    assert torch.all(err <= lim), f"max excess {(err - lim).max().item()}"


# ----------------------------------------------------------------------------- signatures ----

#: op-plugin op_plugin_functions.yaml (Ascend/op-plugin 517f2e7): parameter names and defaults.
SIGNATURES = {
    "npu_fused_linear_online_max_sum": "(input, weight, target, vocab_start_index, vocab_end_index, return_logits=False)",
    "npu_fused_cross_entropy_loss_with_max_sum": "(logits_max, sum_exp_logits, predicted_logits, *, label_smoothing=0.0, input=None, weight=None, vocab_parallel_logits=None)",
    "npu_fused_linear_cross_entropy_loss_with_max_sum_backward": "(grad, input, weight, target_mask, masked_target, label_smoothing=0.0, logits_max=None, sum_exp_logits=None, softmax=None)",
    "npu_cross_entropy_loss": "(input, target, weight=None, reduction='mean', ignore_index=-100, label_smoothing=0.0, lse_square_scale_for_zloss=0.0, return_zloss=False)",
    "npu_cross_entropy_loss_backward": "(grad_loss, log_prob, target, weight=None, grad_zloss=None, lse_for_zloss=None, reduction='mean', ignore_index=-100, label_smoothing=0.0, lse_square_scale_for_zloss=0.0)",
    "npu_scaled_masked_softmax": "(x, mask, scale=1, fixed_triu_mask=False)",
    "npu_scaled_masked_softmax_backward": "(y_grad, y, mask, scale, fixed_triu_mask)",
    "smooth_l1_loss_backward": "(grad_output, self, target, reduction, beta)",
    "embedding_dense_backward": "(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)",
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_is_op_plugins(name):
    sig = inspect.signature(getattr(torch_npu, name))
    plain = sig.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    assert str(plain) == SIGNATURES[name]
    assert name in torch_npu.__all__ and "Raises" in getattr(torch_npu, name).__doc__


# ------------------------------------------------------------------- fused linear family ----


def _shard_case(dtype, BT=37, H=24, V=150, start=100, seed=1):
    g = gen(seed)
    x = torch.randn(BT, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    t = torch.randint(0, 2 * V, (BT,), generator=g)
    return x, w, t, start, start + V


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("return_logits", [False, True])
def test_fused_linear_online_max_sum(dtype, return_logits):
    x, w, t, s, e = _shard_case(dtype)
    m, se, p, tm, mt, vpl = torch_npu.npu_fused_linear_online_max_sum(x, w, t, s, e, return_logits)
    # oracle: the kernel's matmul writes the logits in the input dtype (float64 product, one rounding)
    lg = (x.double() @ w.double().T).to(dtype).double()
    mx = lg.max(1).values
    own = (t >= s) & (t < e)
    mt_ref = torch.where(own, t - s, torch.zeros_like(t))
    # fp32 accumulation before the one rounding may land a logit one 16-bit ulp off near a tie
    u = ULP[dtype] * lg.abs().max()
    torch.testing.assert_close(m.double(), mx, rtol=0, atol=u.item())
    assert_rounded(se, torch.exp(lg - mx[:, None]).sum(1), F32, ulps=8, atol=2 * u * len(lg[0]))
    pred = torch.where(own, lg.gather(1, mt_ref[:, None])[:, 0] - mx, torch.zeros_like(mx))
    assert_rounded(p, pred, F32, ulps=1, atol=2 * u)
    assert torch.all(p[~own] == 0)
    assert torch.equal(mt, mt_ref) and mt.dtype == t.dtype
    bits = torch.tensor([(int(tm[i // 8]) >> (i % 8)) & 1 for i in range(len(t))], dtype=torch.bool)
    assert torch.equal(bits, ~own) and tm.dtype == torch.uint8 and tm.shape == ((len(t) + 7) // 8,)
    if return_logits:
        assert_rounded(vpl, lg, dtype, ulps=2, atol=1e-30)  # one 16-bit ulp: 2^-11..2^-10 relative
    else:  # the device returns an empty tensor, not None
        assert vpl.shape == (0,) and vpl.dtype == dtype


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("with_logits", [False, True])
def test_fused_cross_entropy_loss_with_max_sum(dtype, with_logits):
    g = gen(2)
    lg = torch.randn(9, 131, generator=g).to(dtype)
    m = lg.float().max(1).values
    se = torch.exp(lg.float() - m[:, None]).sum(1)
    p = lg.float()[torch.arange(9), torch.arange(9) * 7] - m
    loss, sm = torch_npu.npu_fused_cross_entropy_loss_with_max_sum(
        m, se, p, label_smoothing=None, vocab_parallel_logits=lg if with_logits else None
    )
    assert_rounded(loss, torch.log(se.double()) - p.double(), F32, ulps=2)
    if with_logits:  # exp of an fp32 difference: relative error grows with |l - max|
        z = lg.double() - m.double()[:, None]
        ref = torch.exp(z) / se.double()[:, None]
        assert sm.dtype == F32 and torch.all((sm.double() - ref).abs() <= (4 + z.abs()) * ULP[F32] * ref)
    else:
        assert sm.shape == (0,) and sm.dtype == F32
    for kw in ("input", "weight"):
        with pytest.raises(fg.AclnnParamError, match=kw) as e:
            torch_npu.npu_fused_cross_entropy_loss_with_max_sum(m, se, p, **{kw: lg})
        assert e.value.status == 161002


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("mode", ["memory-saving", "high-performance"])
def test_fused_linear_cross_entropy_loss_with_max_sum_backward(dtype, mode):
    x, w, t, s, e = _shard_case(dtype, V=160)
    m, se, _, tm, mt, _ = torch_npu.npu_fused_linear_online_max_sum(x, w, t, s, e)
    lg = x.double() @ w.double().T
    sm = torch.exp(lg - m.double()[:, None]) / se.double()[:, None]
    grad = torch.rand(len(t), generator=gen(3))
    kw = {"softmax": sm.float()} if mode == "high-performance" else {"logits_max": m, "sum_exp_logits": se}
    gi, gw = torch_npu.npu_fused_linear_cross_entropy_loss_with_max_sum_backward(grad, x, w, tm, mt, 0.0, **kw)
    # oracle (the torch_npu doc's formula): (softmax - onehot of owned targets)·grad, rounded to the
    # input dtype before the two products (the device feeds the cube unit in 16 bits)
    own = (t >= s) & (t < e)
    if mode == "high-performance":
        sm = sm.float().double()
    gl = sm.clone()
    gl[torch.nonzero(own)[:, 0], mt[own]] -= 1.0
    gl = (gl * grad.double()[:, None]).to(dtype).double()
    gi_ref, gw_ref = gl @ w.double(), gl.T @ x.double()
    assert gi.dtype == dtype and gw.dtype == dtype
    for out, ref in ((gi, gi_ref), (gw, gw_ref)):  # fp32 accumulation + a 1-ulp rounding of g near a tie
        err = (out.double() - ref).abs().max()
        assert err <= 2 * ULP[dtype] * ref.abs().max(), (err, ref.abs().max())


# ---------------------------------------------------------------------------- cross entropy ----


def _ce_oracle(x, t, weight, reduction, ignore_index, ls):
    """float64 torch: loss and d loss / d x by autograd of F.cross_entropy (PyTorch's semantics equal
    the device's for targets in range; a negative ignore_index ignores nothing on the device)."""
    xx = x.double().requires_grad_()
    ii = ignore_index if ignore_index >= 0 else -(10**9)
    loss = F.cross_entropy(
        xx,
        t,
        weight=None if weight is None else weight.double(),
        reduction=reduction,
        ignore_index=ii,
        label_smoothing=ls,
    )
    return xx, loss


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "weighted,ignore_index,ls", [(False, -100, 0.0), (True, 3, 0.0), (True, 2, 0.2), (False, -1, 0.1)]
)
def test_cross_entropy_loss_and_its_backward(dtype, reduction, weighted, ignore_index, ls):
    g = gen(4)
    N, C = 11, 7
    x = (torch.randn(N, C, generator=g) * 2).to(dtype).requires_grad_()
    t = torch.randint(0, C, (N,), generator=g)
    t[:2] = 3
    weight = torch.rand(C, generator=g) + 0.5 if weighted else None
    loss, lp, zl, lse = torch_npu.npu_cross_entropy_loss(x, t, weight, reduction, ignore_index, ls)
    xx, ref = _ce_oracle(x.detach(), t, weight, reduction, ignore_index, ls)
    assert loss.dtype == dtype and lp.dtype == dtype and zl.numel() == 0 and lse.numel() == 0
    assert loss.shape == ((N,) if reduction == "none" else (1,))
    tol = 8 * ULP[dtype]
    torch.testing.assert_close(loss.double().reshape(ref.shape), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(lp.double(), torch.log_softmax(x.detach().double(), 1), rtol=0, atol=tol * 8)
    gl = torch.rand(loss.shape, generator=g).to(dtype)
    loss.backward(gl)
    ref.backward(gl.double().reshape(ref.shape))
    # the backward works from the rounded log_prob (exp(log_prob) is not renormalised): tolerance of
    # the 16-bit log_prob, relative to the row scale
    scale = xx.grad.abs().max()
    assert (x.grad.double() - xx.grad).abs().max() <= 16 * ULP[dtype] * scale + 1e-12
    assert not lp.requires_grad  # only loss carries a gradient (torch_npu doc)


def test_cross_entropy_backward_direct_and_zloss_rejected():
    g = gen(5)
    x = torch.randn(6, 5, generator=g)
    t = torch.randint(0, 5, (6,), generator=g)
    lp = torch.log_softmax(x, 1)
    out = torch_npu.npu_cross_entropy_loss_backward(torch.tensor([0.5]), lp, t)
    xx, ref = _ce_oracle(x, t, None, "mean", -100, 0.0)
    ref.backward(torch.tensor(0.5, dtype=torch.float64))
    assert_rounded(out, xx.grad, F32, ulps=64, atol=1e-7)
    with pytest.raises(fg.AclnnParamError, match="return_zloss"):
        torch_npu.npu_cross_entropy_loss(x, t, return_zloss=True)
    with pytest.raises(fg.AclnnParamError, match="lse_square_scale_for_zloss"):
        torch_npu.npu_cross_entropy_loss(x, t, lse_square_scale_for_zloss=0.1)
    with pytest.raises(fg.AclnnParamError, match="reduction"):
        torch_npu.npu_cross_entropy_loss(x, t, reduction="avg")
    with pytest.raises(fg.AclnnParamError, match="target"):
        torch_npu.npu_cross_entropy_loss(x, t + 5)
    with pytest.raises(fg.AclnnNullptrError):
        torch_npu.npu_cross_entropy_loss(None, t)
    # found by fuzzing: no class and every row ignored reached a gather (a plain RuntimeError)
    with pytest.raises(fg.AclnnParamError, match="C >= 1"):
        torch_npu.npu_cross_entropy_loss(torch.randn(3, 0), torch.zeros(3, dtype=torch.long), ignore_index=0)


# --------------------------------------------------------------------------- masked softmax ----


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("mask_shape", [(2, 3, 5, 40), (2, 1, 5, 40), (5, 40)])
def test_scaled_masked_softmax_forward_and_backward(dtype, mask_shape):
    g = gen(6)
    x = (torch.randn(2, 3, 5, 40, generator=g) * 3).to(dtype).requires_grad_()
    mask = torch.rand(mask_shape, generator=g) < 0.3
    scale = 0.37
    y = torch_npu.npu_scaled_masked_softmax(x, mask, scale)
    # op-plugin's CPU golden (test/test_base_ops/test_scaled_masked_softmax.py), in float64
    x64 = x.detach().double().requires_grad_()
    y64 = torch.softmax((x64 * scale).masked_fill(mask, -10000.0), -1)
    if dtype == F32:  # fp32 exp/sum: a few ulps, growing with |x·scale - max|
        torch.testing.assert_close(y.double(), y64.detach(), rtol=2e-6, atol=1e-9)
    else:  # computed in fp32, rounded once: within one 16-bit ulp
        assert_rounded(y, y64.detach(), dtype, ulps=1, atol=2.0**-24 if dtype == F16 else 1e-38)
    gy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(gy)
    # device backward (aclnnScaledMaskedSoftmaxBackward) on the rounded y: (gy·y - Σ gy·y · y)·scale, 0 where masked
    yr = y.detach().double()
    ref = ((gy.double() * yr - (gy.double() * yr).sum(-1, keepdim=True) * yr) * scale).masked_fill(mask, 0.0)
    if dtype == F32:  # the row sum's fp32 rounding, relative to the row's scale
        assert torch.all((x.grad.double() - ref).abs() <= 64 * ULP[F32] * ref.abs().amax(-1, keepdim=True))
    else:
        assert_rounded(x.grad, ref, dtype, ulps=1, atol=2.0**-24 if dtype == F16 else 1e-38)  # fp16 subnormals
    direct = torch_npu.npu_scaled_masked_softmax_backward(gy, y.detach(), mask, scale, False)
    assert torch.equal(direct, x.grad)


def test_scaled_masked_softmax_errors():
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(fg.AclnnParamError, match="mask"):
        torch_npu.npu_scaled_masked_softmax(x, torch.zeros(3, 8, dtype=torch.bool))
    with pytest.raises(fg.AclnnParamError, match="mask"):
        torch_npu.npu_scaled_masked_softmax(x, torch.zeros(4, 8))
    # found by fuzzing: a mask that broadcasts with x but not *to* x grew the result
    for big in ((2, 1, 4, 8), (1, 1, 2, 4, 8)):
        with pytest.raises(fg.AclnnParamError, match="broadcastable to"):
            torch_npu.npu_scaled_masked_softmax(x, torch.zeros(big, dtype=torch.bool))
    with pytest.raises(fg.AclnnNullptrError):
        torch_npu.npu_scaled_masked_softmax(x, None)
    with pytest.raises(fg.AclnnParamError, match="CPU torch.Tensor"):
        torch_npu.npu_scaled_masked_softmax(x.numpy(), torch.zeros(4, 8, dtype=torch.bool))


# ------------------------------------------------------------------------------- ATen ops ----


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_smooth_l1_loss_backward(dtype, reduction):
    g = gen(7)
    x = torch.randn(6, 9, generator=g).to(dtype)
    y = torch.randn(6, 9, generator=g).to(dtype)
    go = torch.randn(6, 9, generator=g).to(dtype) if reduction == 0 else torch.tensor(0.75).to(dtype)
    beta = 0.8
    out = torch_npu.smooth_l1_loss_backward(go, x, y, reduction, beta)
    d = (x.float() - y.float()).double()  # the device's fp32 subtraction
    b = torch.tensor(beta + 1e-6, dtype=torch.float32).double()  # 910B: d / fp32(beta + 1e-6) (docs/device_parity.md)
    s = torch.where(d.abs() < beta, d / b, torch.sign(d))
    ref = s * go.double() / (d.numel() if reduction == 1 else 1)
    assert_rounded(out, ref, dtype, ulps=2, atol=1e-12)
    # against PyTorch's own aten op in float64: the 1e-6 is the only difference
    aten = torch.ops.aten.smooth_l1_loss_backward(go.double(), x.double(), y.double(), reduction, beta)
    torch.testing.assert_close(out.double(), aten, rtol=max(4e-6, 2 * ULP[dtype]), atol=1e-9)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("padding_idx,scale", [(-1, False), (2, False), (-1, True)])
def test_embedding_dense_backward(dtype, padding_idx, scale):
    g = gen(8)
    idx = torch.randint(0, 9, (4, 33), generator=g)
    idx[0, :20] = 4  # a hot row: PyTorch's CPU kernel accumulates 16-bit grads in 16 bits
    grad = torch.randn(4, 33, 6, generator=g).to(dtype)
    out = torch_npu.embedding_dense_backward(grad, idx, 9, padding_idx, scale)
    w = torch.zeros(9, 6, dtype=torch.float64, requires_grad=True)
    F.embedding(idx, w, padding_idx=None if padding_idx < 0 else padding_idx, scale_grad_by_freq=scale).backward(
        grad.double()
    )
    # fp32 accumulation in index order, one rounding: for fp32 outputs each add may round
    acc = torch.zeros(9, 6, dtype=torch.float64).index_add_(0, idx.flatten(), grad.double().abs().reshape(-1, 6))
    atol = (idx.numel() * ULP[F32] * acc) if dtype == F32 else 1e-30
    assert_rounded(out, w.grad, dtype, ulps=1, atol=atol)
    if padding_idx >= 0:
        assert torch.all(out[padding_idx] == 0)
    with pytest.raises(fg.AclnnParamError, match="indices"):
        torch_npu.embedding_dense_backward(grad, idx + 9, 9, -1, False)


def test_one_import_swap():
    """An NPU test body runs unchanged against `from fastgrad import torch_npu` (CPU tensors in and out)."""

    def npu_test(torch_npu):  # as it would be written for the NPU (minus .npu())
        x = torch.randn(4, 1, 8, 16).requires_grad_()
        mask = torch.zeros(4, 1, 8, 16, dtype=torch.bool)
        y = torch_npu.npu_scaled_masked_softmax(x, mask, 1.0, False)
        y.sum().backward()
        loss, log_prob, _, _ = torch_npu.npu_cross_entropy_loss(torch.randn(8, 32), torch.arange(8))
        return y, x.grad, loss, log_prob

    y, gx, loss, lp = npu_test(torch_npu)
    assert y.device.type == "cpu" and isinstance(loss, torch.Tensor)
    assert gx.abs().max() < 1e-6  # softmax rows sum to 1: their gradient w.r.t. x is 0
