"""The float64 golden of ``fastgrad.linear_cross_entropy`` (``fastgrad/reference/linear_cross_entropy.py``).

(a) through ``fg.use_backend("reference")`` against PyTorch float64 autograd of the materialized
formula (an oracle written here from the op's docstring), to ~1e-12; (b) against the cpu kernel
for fp32 and bf16 inputs, vocabulary shards with ``combine``, the recompute (``lse=``) and the
entropy; (c) the reference backend really runs the golden; (d) the acl backend (no such device
op) runs the cpu kernel with a RuntimeWarning, once.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import fastgrad as fg  # noqa: E402
from fastgrad import dtypes as D  # noqa: E402
from fastgrad import tiling  # noqa: E402
from fastgrad.backends import _BACKENDS, dispatch  # noqa: E402
from fastgrad.ops import _opdef  # noqa: E402
from fastgrad.reference import linear_cross_entropy as golden  # noqa: E402

BT, H, V = 13, 7, 29


def _data(seed, dtype=np.float64, ignore_index=-100):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H))
    w = rng.standard_normal((V, H)) * (2.0 / H**0.5)
    b = rng.standard_normal(V) * 0.5
    cw = rng.random(V) + 0.5
    t = rng.integers(0, V, BT)
    t[::4] = ignore_index
    return x.astype(dtype), w.astype(dtype), b.astype(dtype), cw, t


def _rel_close(a, r, rtol, what=""):
    """|a - r| <= rtol·max|r| elementwise (NaN where r is NaN)."""
    a = np.asarray(a, np.float64)
    r = np.asarray(r, np.float64)
    assert a.shape == r.shape, (what, a.shape, r.shape)
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    err = float(np.max(np.abs(a - r))) if r.size else 0.0
    assert err <= rtol * max(scale, 1e-300) + 1e-300, (what, err, scale)


# --------------------------------------------------------------------------------- (a) autograd
def _torch_oracle(x, w, t, *, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, temperature,
                  lse_square_scale, grad_output, grad_entropy):
    X = torch.tensor(x, requires_grad=True)
    W = torch.tensor(w, requires_grad=True)
    B = None if bias is None else torch.tensor(bias, requires_grad=True)
    T = torch.tensor(t)
    lg = X @ W.T + (B if B is not None else 0.0)
    if softcap is not None:
        lg = softcap * torch.tanh(lg / softcap)
    z = lg / temperature
    cw = None if ce_weight is None else torch.tensor(ce_weight)
    ce = F.cross_entropy(z, T, weight=cw, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing)
    valid = T != ignore_index
    lse = torch.logsumexp(z, 1)
    zero = torch.zeros_like(lse)
    zl = torch.where(valid, lse_square_scale * lse * lse, zero)
    logp = torch.log_softmax(z, 1)
    ent = torch.where(valid, -(logp.exp() * logp).sum(1), zero)
    n = valid.sum()
    red = {"mean": lambda v: v.sum() / n, "sum": lambda v: v.sum(), "none": lambda v: v}[reduction]
    zl_r, ent_r = red(zl), red(ent)
    loss = ce + zl_r
    go = torch.tensor(np.float64(1.0) if grad_output is None else grad_output)
    total = (loss * go).sum()
    if grad_entropy is not None:
        total = total + (ent_r * torch.tensor(grad_entropy)).sum()
    total.backward()
    acc = ((z.argmax(1) == T) & valid).double()
    acc = acc if reduction == "none" else acc.sum() / n
    return {
        "loss": loss.detach().numpy(), "z_loss": zl_r.detach().numpy(), "lse": lse.detach().numpy(),
        "predicted": z.argmax(1).numpy(), "token_accuracy": acc.numpy(), "entropy": ent_r.detach().numpy(),
        "z_mean": (logp.exp() * z).sum(1).detach().numpy(), "grad_input": X.grad.numpy(),
        "grad_weight": W.grad.numpy(), "grad_bias": None if B is None else B.grad.numpy(),
    }


GRID = [
    {},
    {"bias": True},
    {"ce_weight": True},
    {"label_smoothing": 0.1},
    {"label_smoothing": 0.2, "ce_weight": True, "bias": True},
    {"softcap": 2.5},
    {"temperature": 0.7},
    {"lse_square_scale": 1e-2},
    {"ignore_index": 5},
    {"entropy": True},
    {"softcap": 3.0, "temperature": 1.3, "lse_square_scale": 1e-2, "bias": True, "ce_weight": True,
     "label_smoothing": 0.15, "entropy": True},
]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feat", GRID, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "plain")
def test_golden_matches_float64_autograd(feat, reduction):
    ign = feat.get("ignore_index", -100)
    x, w, b, cw, t = _data(len(str(feat)), ignore_index=ign)
    rng = np.random.default_rng(7)
    shp = (BT,) if reduction == "none" else ()
    go = rng.random(shp) + 0.5
    ge = (rng.random(shp) + 0.5) if feat.get("entropy") else None
    kw = dict(bias=b if feat.get("bias") else None, ce_weight=cw if feat.get("ce_weight") else None,
              ignore_index=ign, reduction=reduction, label_smoothing=feat.get("label_smoothing", 0.0),
              softcap=feat.get("softcap"), temperature=feat.get("temperature", 1.0),
              lse_square_scale=feat.get("lse_square_scale", 0.0))
    with fg.use_backend("reference"):
        r = fg.linear_cross_entropy(x, w, t, **kw, return_grad=True, grad_output=go,
                                    return_entropy=bool(feat.get("entropy")), grad_entropy=ge)
    ref = _torch_oracle(x, w, t, **kw, grad_output=go, grad_entropy=ge)
    valid = t != ign
    assert r.n_valid == int(valid.sum())
    np.testing.assert_array_equal(r.predicted, ref["predicted"])
    np.testing.assert_allclose(r.token_accuracy, ref["token_accuracy"], rtol=1e-15)
    for k in ("loss", "z_loss", "lse", "grad_input", "grad_weight"):
        _rel_close(getattr(r, k), ref[k], 1e-12, k)
    if kw["bias"] is not None:
        _rel_close(r.grad_bias, ref["grad_bias"], 1e-12, "grad_bias")
    else:
        assert r.grad_bias is None
    if feat.get("entropy"):
        _rel_close(r.entropy, ref["entropy"], 1e-12, "entropy")
        _rel_close(r.z_mean, ref["z_mean"], 1e-12, "z_mean")


# ------------------------------------------------------------------------------ (b) the cpu kernel
def _run(backend, x, w, t, **kw):
    with fg.use_backend(backend):
        return fg.linear_cross_entropy(x, w, t, **kw)


FIELDS = ("loss", "z_loss", "lse", "entropy", "z_mean", "grad_input", "grad_weight", "grad_bias")


def _compare(a, r, rtol, fields=FIELDS):
    for k in fields:
        va, vr = getattr(a, k), getattr(r, k)
        assert (va is None) == (vr is None), k
        if va is not None:
            _rel_close(va, vr, rtol, k)


CPU_CASES = [
    dict(),
    dict(bias=True, ce_weight=True, label_smoothing=0.1, reduction="sum"),
    dict(softcap=3.0, temperature=0.8, lse_square_scale=1e-2, bias=True, return_entropy=True, grad_entropy=0.3),
    dict(ce_weight=True, label_smoothing=0.2, reduction="none", return_entropy=True, grad_entropy="rows"),
]


def _kwargs(case, b, cw, rng):
    kw = dict(case)
    kw["bias"] = b if case.get("bias") else None
    kw["ce_weight"] = cw if case.get("ce_weight") else None
    rows = kw.get("reduction") == "none"
    kw["grad_output"] = (rng.random(BT) + 0.5) if rows else 0.75
    if kw.get("grad_entropy") == "rows":
        kw["grad_entropy"] = rng.random(BT) - 0.5
    return kw


@pytest.mark.parametrize("dtype", [np.float32, D.BFLOAT16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_golden_matches_cpu_kernel(case, dtype):
    x, w, b, cw, t = _data(100 + case, dtype)
    kw = _kwargs(CPU_CASES[case], b, cw, np.random.default_rng(case))
    a = _run("cpu", x, w, t, **kw, return_grad=True)
    r = _run("reference", x, w, t, **kw, return_grad=True)
    _compare(a, r, 1e-4)
    np.testing.assert_array_equal(a.predicted, r.predicted)
    np.testing.assert_array_equal(a.token_accuracy, r.token_accuracy)
    assert a.grad_input.dtype == r.grad_input.dtype == np.float32
    # the recompute: the gradient alone from the saved lse (and z_mean with grad_entropy)
    rc = dict(kw, lse=r.lse, z_mean=r.z_mean if kw.get("grad_entropy") is not None else None)
    rc.pop("return_entropy", None)
    ac, rr = _run("cpu", x, w, t, **rc, return_grad=True), _run("reference", x, w, t, **rc, return_grad=True)
    assert rr.loss is None and rr.lse is None
    _compare(ac, rr, 1e-4, ("grad_input", "grad_weight", "grad_bias"))
    _compare(rr, r, 1e-5, ("grad_input", "grad_weight", "grad_bias"))  # the same gradient (fp32 lse)


@pytest.mark.parametrize("dtype", [np.float32, D.BFLOAT16], ids=["fp32", "bf16"])
def test_golden_16bit_accum_and_approximations(dtype):
    """accum_dtype: the golden rounds its float64 grad_weight once; filter_eps and precision="fast"
    are approximations the golden does not make (dense exact gradient, no block skipped)."""
    x, w, b, cw, t = _data(5, dtype)
    kw = dict(bias=b, label_smoothing=0.1, return_grad=True)
    dense = _run("reference", x, w, t, **kw)
    if dtype == D.BFLOAT16:
        r = _run("reference", x, w, t, **kw, accum_dtype="bfloat16")
        a = _run("cpu", x, w, t, **kw, accum_dtype="bfloat16")
        assert r.grad_weight.dtype == a.grad_weight.dtype == D.BFLOAT16
        np.testing.assert_array_equal(r.grad_weight, dense.grad_weight.astype(np.float64).astype(D.BFLOAT16))
        _rel_close(a.grad_weight, r.grad_weight, 2.0**-7, "grad_weight bf16")
    f = _run("reference", x, w, t, **kw, filter_eps=0.5)
    assert f.filter_stats == {"filter_eps": 0.5, "blocks_total": 0, "blocks_skipped": 0}
    fast = _run("reference", x, w, t, **kw, lse=dense.lse, precision="fast")
    for k in ("grad_input", "grad_weight", "grad_bias"):
        np.testing.assert_array_equal(getattr(f, k), getattr(dense, k))
        _rel_close(getattr(fast, k), getattr(dense, k), 1e-5, k)


def _combine_all(stats):
    """The caller's all-reduce over the shards' per-row statistics (the op's ``combine`` protocol)."""
    m = np.stack([np.asarray(s[0], np.float64) for s in stats])
    se = np.stack([np.asarray(s[1], np.float64) for s in stats])
    gmax = m.max(0)
    empty = se == 0
    d = np.where(empty, 0.0, m - gmax)
    f = np.where(empty, 0.0, np.exp(d))
    out = [gmax, (se * f).sum(0)] + [np.stack([np.asarray(s[i], np.float64) for s in stats]).sum(0) for i in (2, 3)]
    am = np.stack([np.asarray(s[4]) for s in stats])
    cand = np.where((m == gmax) & (am >= 0), am, np.iinfo(np.int64).max).min(0)
    out.append(np.where(cand == np.iinfo(np.int64).max, -1, cand))
    if len(stats[0]) == 6:
        out.append((f * (np.stack([np.asarray(s[5], np.float64) for s in stats]) + d * se)).sum(0))
    return out


def _sharded(backend, x, w, t, b, splits, **kw):
    """Each shard's result with ``combine``: a first pass records every shard's per-block statistics,
    a second returns their global combination for the same rows."""
    shards = list(zip(splits[:-1], splits[1:]))

    def call(s0, s1, comb):
        sb = None if b is None else b[s0:s1]
        return _run(backend, x, w[s0:s1], t, bias=sb, vocab_start_index=s0, vocab_size=w.shape[0], combine=comb,
                    **kw)

    recs = []
    for s0, s1 in shards:
        rec: list = []
        call(s0, s1, lambda *a, rec=rec: rec.append([np.array(v) for v in a]) or a)
        recs.append(rec)
    glob = _combine_all([[np.concatenate(c) for c in zip(*rec)] for rec in recs])
    results = []
    for s0, s1 in shards:
        pos = [0]

        def comb(*a):
            n = len(a[0])
            res = tuple(g[pos[0] : pos[0] + n] for g in glob)
            pos[0] += n
            return res

        results.append(call(s0, s1, comb))
        assert pos[0] == BT
    return results, [len(r) for r in recs]


@pytest.fixture
def small_budget():
    """Row blocks of 3 rows (V = 29, fp32 plan): combine is called per block."""
    tiling.set_workspace_budget(3 * V * 4)
    try:
        yield
    finally:
        tiling.set_workspace_budget(None)


@pytest.mark.parametrize("blocks", ["one", "several"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, D.BFLOAT16], ids=["fp64", "fp32", "bf16"])
def test_vocabulary_shards_with_combine(dtype, blocks, request):
    x, w, b, cw, t = _data(11, dtype)
    kw = dict(ce_weight=cw, label_smoothing=0.1, softcap=4.0, lse_square_scale=1e-2, return_grad=True,
              return_entropy=True, grad_entropy=0.2, reduction="sum")
    splits = [0, 10, 10, 21, V]  # an empty shard included
    full = _run("reference", x, w, t, bias=b, **kw)  # unsharded, one row block
    if blocks == "several":
        request.getfixturevalue("small_budget")
    gold, ncalls = _sharded("reference", x, w, t, b, splits, **kw)
    cpu, ncalls_cpu = _sharded("cpu", x, w, t, b, splits, **kw)
    nb = tiling.training_budget_rows(V, 8 if dtype == np.float64 else 4, tiling.workspace_budget())
    assert ncalls == ncalls_cpu == [-(-BT // nb)] * 4  # combine per row block (the plan's), on every shard
    assert (ncalls[0] > 1) == (blocks == "several")
    tight = 1e-12 if dtype == np.float64 else 1e-6  # fp32/bf16 results are rounded to fp32
    for g, c, (s0, s1) in zip(gold, cpu, zip(splits[:-1], splits[1:])):
        _compare(g, full, tight, ("loss", "z_loss", "lse", "entropy", "z_mean"))
        np.testing.assert_array_equal(g.predicted, full.predicted)
        _rel_close(g.grad_weight, full.grad_weight[s0:s1], tight, "grad_weight shard")
        _rel_close(g.grad_bias, full.grad_bias[s0:s1], tight, "grad_bias shard")
        _compare(c, g, 1e-4)
        np.testing.assert_array_equal(c.predicted, g.predicted)
    gi = np.sum([np.asarray(g.grad_input, np.float64) for g in gold], axis=0)
    _rel_close(gi, full.grad_input, tight, "grad_input partial sums")


# --------------------------------------------------------------------- (c) the backend runs it
def test_reference_backend_runs_the_golden(monkeypatch):
    assert dispatch("linear_cross_entropy", "reference") is golden.linear_cross_entropy
    x, w, b, cw, t = _data(3, np.float32)
    seen = []

    def comb(*a):
        seen.append(a[0].dtype)
        return a

    _run("cpu", x, w, t, combine=comb)
    # the cpu kernel would fail here: the reference backend must not reach it
    monkeypatch.setitem(_BACKENDS["cpu"].impls, "linear_cross_entropy", lambda **k: pytest.fail("cpu kernel ran"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = _run("reference", x, w, t, combine=comb, return_grad=True)
    assert seen == [np.float32, np.float64]  # the kernel's statistics in fp32, the golden's in float64
    assert r.grad_input.dtype == np.float32


# ---------------------------------------------------------------------------- (d) acl fallback
def test_acl_backend_falls_back_to_cpu_with_one_warning(monkeypatch):
    """The device has no such op: the acl backend runs the cpu kernel and says so once."""
    monkeypatch.setattr(_BACKENDS["acl"], "probe", lambda: None)  # "available", without a device
    monkeypatch.setattr(_opdef, "_FALLBACK_WARNED", set())
    x, w, b, cw, t = _data(4, np.float32)
    ref = _run("cpu", x, w, t, return_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r1 = _run("acl", x, w, t, return_grad=True)
        r2 = _run("acl", x, w, t, return_grad=True)
    msgs = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    assert msgs == ["linear_cross_entropy has no 'acl' implementation (not an aclnn op): ran the 'cpu' kernel"]
    for r in (r1, r2):
        np.testing.assert_array_equal(r.loss, ref.loss)
        np.testing.assert_array_equal(r.grad_weight, ref.grad_weight)
