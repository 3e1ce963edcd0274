"""The training loss's staged row-block loop gives the bits of the chunk-by-chunk loop.

``ops/linear_cross_entropy.STAGED`` (read into the plan: ``TrainingPlan.staged_statistics`` /
``staged_gradient``) runs one chunk's GEMM tiles beside the next chunk's widening and element-wise
pass (one barrier per stage, ``kernels/_lm_head.sweep``); with ``STAGED = False`` the same calls run
chunk by chunk.  The grid crosses several vocabulary chunks (``V_CHUNK`` made small), several row
blocks (a small workspace budget), every output (grad_input, grad_weight, grad_bias), the features
that change the passes (softcap, smoothing, class weights, z-loss, entropy), the three input
dtypes on BLAS and vocabulary shards.  The results are also checked against float64 PyTorch
autograd so that equality of two wrong loops cannot pass.
"""

import numpy as np
import pytest
from common import BF16, workspace_budget

import fastgrad as fg
from fastgrad.ops import linear_cross_entropy as op

torch = pytest.importorskip("torch")

FEATURES = {
    "plain": {},
    "bias": {"bias": True},
    "features": {"softcap": 20.0, "label_smoothing": 0.1, "lse_square_scale": 1e-3, "ce_weight": True},
    "entropy": {"return_entropy": True, "grad_entropy": 0.3},
}


def _inputs(dtype, BT=53, H=72, V=1300, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((BT, H)) * 0.7).astype(dtype)
    w = (rng.standard_normal((V, H)) * 0.2).astype(dtype)
    t = rng.integers(0, V, BT)
    t[::7] = -100
    return x, w, t, rng


def _call(dtype, feats, budget, vchunk, monkeypatch, staged):
    x, w, t, rng = _inputs(dtype)
    kw = {k: v for k, v in feats.items() if k not in ("bias", "ce_weight")}
    if feats.get("bias"):
        kw["bias"] = (rng.standard_normal(w.shape[0]) * 0.1).astype(dtype)
    if feats.get("ce_weight"):
        kw["ce_weight"] = rng.uniform(0.5, 1.5, w.shape[0])
    monkeypatch.setattr(op, "V_CHUNK", vchunk)
    monkeypatch.setattr(op, "STAGED", staged)
    with workspace_budget(budget):
        r = fg.linear_cross_entropy(x, w, t, return_grad=(True, True, "bias" in kw), **kw)
    return (x, w, t, kw), r


@pytest.mark.parametrize("feat", list(FEATURES))
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("budget,vchunk", [(40_000, 256), (1 << 20, 333), (1 << 28, 1300)])
def test_staged_equals_chunk_by_chunk(dtype, feat, budget, vchunk, monkeypatch):
    (x, w, t, kw), a = _call(dtype, FEATURES[feat], budget, vchunk, monkeypatch, True)
    _, b = _call(dtype, FEATURES[feat], budget, vchunk, monkeypatch, False)
    # the two runs took the two schedules (the bf16 logits kernel runs its statistics unstaged,
    # its gradient staged as the fp32 engines')
    assert a.plan.staged_statistics == (not a.plan.logits16) and a.plan.staged_gradient
    assert not b.plan.staged_statistics and not b.plan.staged_gradient
    names = ["loss", "lse", "grad_input", "grad_weight", "grad_bias", "entropy"]
    for n in names:
        u, v = getattr(a, n, None), getattr(b, n, None)
        if u is None and v is None:
            continue
        assert np.array_equal(np.asarray(u), np.asarray(v), equal_nan=True), n
    # and right: float64 autograd of the same loss (tolerance of the compute dtype)
    xt = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
    wt = torch.tensor(np.asarray(w, np.float64), requires_grad=True)
    z = xt @ wt.T
    if "bias" in kw:
        z = z + torch.tensor(np.asarray(kw["bias"], np.float64))
    if "softcap" in kw:
        z = kw["softcap"] * torch.tanh(z / kw["softcap"])
    tt = torch.tensor(t)
    cw = torch.tensor(kw["ce_weight"]) if "ce_weight" in kw else None
    loss = torch.nn.functional.cross_entropy(z, tt, weight=cw, label_smoothing=kw.get("label_smoothing", 0.0))
    if kw.get("lse_square_scale"):
        keep = tt != -100
        loss = loss + kw["lse_square_scale"] * (torch.logsumexp(z, 1)[keep] ** 2).mean()
    total = loss
    if kw.get("return_entropy"):  # the entropy is an output; grad_entropy its upstream gradient
        p = torch.softmax(z, 1)
        ent = -(p * torch.log_softmax(z, 1)).sum(1)
        total = loss + kw["grad_entropy"] * ent[tt != -100].mean()  # reduced like the loss
    total.backward()
    tol = 1e-8 if dtype == np.float64 else 2e-4  # fp64 entropy term: ~2e-9 of the max seen
    gi = np.asarray(a.grad_input, np.float64)
    gw = np.asarray(a.grad_weight, np.float64)
    assert abs(float(a.loss) - loss.item()) <= tol * max(1.0, abs(loss.item()))
    np.testing.assert_allclose(gi, xt.grad.numpy(), atol=tol * np.abs(xt.grad.numpy()).max())
    np.testing.assert_allclose(gw, wt.grad.numpy(), atol=tol * np.abs(wt.grad.numpy()).max())


def test_staged_shard_equals_chunk_by_chunk(monkeypatch):
    # a vocabulary shard (the second half of a 2-way split), several chunks and row blocks
    x, w, t, _ = _inputs(np.float32)
    V = w.shape[0]
    lo = V // 2
    monkeypatch.setattr(op, "V_CHUNK", 200)
    out = []
    for staged in (True, False):
        monkeypatch.setattr(op, "STAGED", staged)
        with workspace_budget(60_000):
            r = fg.linear_cross_entropy(x, w[lo:], t, vocab_start_index=lo, vocab_size=V, return_grad=True)
        out.append(r)
    for n in ("lse", "grad_input", "grad_weight"):
        assert np.array_equal(getattr(out[0], n), getattr(out[1], n)), n
