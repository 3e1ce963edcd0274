"""Issue 46: every TTK/ATK case file reproduced >= 98 % through the plugins, against the op's OWN golden.

tests/test_ascend_plugins.py checks the plumbing against tests/cann_helpers.py's goldens, which follow
the kernel of the case's SoC where the op's golden and the kernel differ.  This file asks the issue's
question instead: run every case of every case file the way the runner does —

* TTK files through the plugin that ``fastgrad ttk-plugin --out DIR`` writes (loaded as TTK loads it:
  the literal ``__golden__`` table, tests/ttk_standin.py), with the case file's data ranges;
* ATK files through the ATK entry :func:`fastgrad.ascend.atk_golden`, with the executor's input rules;

— and judge each output against **the op's own golden as the case file describes it** (ops-nn
``tests/assets/golden.py`` for TTK, the ``executor_*.py`` CPU path for ATK; re-written below from
hicann/ops-nn e5c3fa9, no code copied) with the file's standard (tests/cann_helpers.judge).  Per file
at least 98 % must reproduce, and every case that does not is listed in :data:`EXPLAINED` with the
reason (the kernel fastgrad follows differs from that golden; docs/device_parity.md names the row).
An explained case that starts to reproduce fails too, so the list stays exact.

Shrinking as tests/test_ascend_plugins.py (batch dimensions above 2**14 elements; reduced
dimensions, dtypes, attributes and ranges never change).
"""

from __future__ import annotations

import subprocess
import sys

import cann_helpers as ch
import numpy as np
import pytest
import ttk_standin as st

SHRINK = 1 << 14
MIN_RATE = 0.98

#: every case whose plugin output misses the op's own golden, with the reason (stem -> key -> why);
#: empty at ops-nn e5c3fa9: every case of every file reproduces (the kernel points where fastgrad
#: and these goldens differ — rows 4l, 5, 7a, 9 — stay within each file's standard on these data)
EXPLAINED: dict[str, dict[str, str]] = {}


# --- the ops' own goldens (hicann/ops-nn e5c3fa9), where tests/cann_helpers follows the kernel ----


def _t(x):
    """NumPy (bf16 included) -> torch float32."""
    import torch

    a = np.asarray(x)
    return torch.from_numpy(a.astype(np.float32))


def own_cross_entropy_loss_grad(k: dict) -> list:
    """tests/assets/golden.py (TTK) = executor_aclnnCrossEntropyLossGrad.py (ATK; it passes label
    smoothing 0, and every ATK case has 0): PyTorch in fp32, in the golden's order — ignore mask
    only for ignore_index >= 0, mean divides by Σ weight[t]·mask, p = exp(log_prob), the one-hot
    subtraction, the label-smoothing term e·Σ(sm·w) − sm·w added last."""
    import torch

    red = {0: "none", 1: "mean", 2: "sum"}.get(k["reduction"], k["reduction"])
    g = _t(k["grad_loss"])
    lp = _t(k["log_prob"])
    n, c = lp.shape
    tg = torch.from_numpy(np.asarray(k["target"]).astype(np.int64))
    w = torch.ones(c, dtype=torch.float32) if k["weight"] is None else _t(k["weight"])
    ls = float(k["label_smoothing"])
    ii = int(k["ignore_index"])
    w_yn = torch.gather(w, 0, tg)
    mask = (tg - ii).bool().float() if ii >= 0 else torch.ones(n)
    if red == "mean":
        wsum = torch.sum(w_yn * mask, -1)
        smooth = g / wsum * (ls / c)
        loss_g = (g * (1 - ls)).unsqueeze(-1) / wsum
    elif red == "sum":
        smooth = g.unsqueeze(-1) * (ls / c)
        loss_g = (g * (1 - ls)).unsqueeze(-1)
    else:
        smooth = g * (ls / c)
        loss_g = g * (1 - ls)
    nll = (loss_g * mask * w_yn).squeeze(0)
    sub = torch.exp(lp) * nll.unsqueeze(-1)
    onehot = torch.zeros((n, c))
    if nll.dim() == 0:
        nll = nll.unsqueeze(0)
    for i in range(n):
        onehot[i][tg[i]] = nll[i]
    out = sub - onehot
    if ls != 0:
        sm = (smooth * mask).unsqueeze(-1) * w.unsqueeze(0)
        out = out + (torch.exp(lp) * torch.sum(sm, -1, keepdim=True) - sm)
    # with a (1,)-shaped grad_loss, "sum"/"mean" and label smoothing the golden's broadcasting
    # returns (1, N, C); the case's output is (N, C) and the runner compares its elements
    return [out.double().numpy().reshape(n, c)]


def own_smooth_l1_loss_backward(k: dict) -> list:
    """tests/assets/golden.py and the ATK executor: PyTorch's smooth_l1_loss_backward on the
    broadcast inputs in fp32 (|d| < β: d/β, else sign(d), ×grad, mean ÷ the element count)."""
    import torch

    red = {"none": 0, "mean": 1, "sum": 2}.get(k["reduction"], k["reduction"])
    arrs = [np.asarray(k[n]) for n in ("grad_out", "input", "target")]
    shape = np.broadcast_shapes(*(a.shape for a in arrs))
    go, x, t = (_t(np.broadcast_to(a, shape)) for a in arrs)
    r = torch.ops.aten.smooth_l1_loss_backward(go, x, t, int(red), float(k["beta"]))
    return [r.double().numpy()]


def own_scaled_masked_softmax_backward(k: dict) -> list:
    """executor_aclnnScaledMaskedSoftmaxBackward.py: fp32, Σ dy·y in the executor's reduce order,
    then dy·y − Σ·y for every S2, ×scale, 0 where masked."""
    dy = np.asarray(k["grad_output"]).astype(np.float32)
    y = np.asarray(k["y"]).astype(np.float32)
    s2 = dy.shape[-1]
    lines, yl = dy.reshape(-1, s2), y.reshape(-1, s2)
    with np.errstate(all="ignore"):
        prod = lines * yl
        tot = ch._sms_reduce_sum(prod)[:, None]
        xg = ((prod - tot * yl) * np.float32(k["scale"])).reshape(dy.shape)
    mask = k["mask"]
    m = np.broadcast_to(np.asarray(mask, bool), dy.shape) if mask is not None else np.zeros(dy.shape, bool)
    if k["fix_triu_mask"]:
        s1 = dy.shape[-2]
        m = m | np.triu(np.ones((s1, s2), bool), 1)
    return [np.where(m, np.float32(0), xg).astype(np.float64)]


def own_embedding_dense_backward(k: dict) -> list:
    """golden.py / the executor: PyTorch's embedding_dense_backward (sums; scale_grad_by_freq
    divides by the count), here in float64."""
    import torch

    g = torch.from_numpy(np.asarray(k["grad"]).astype(np.float64))
    idx = torch.from_numpy(np.asarray(k["indices"]).astype(np.int64))
    r = torch.ops.aten.embedding_dense_backward(
        g, idx, int(k["num_weights"]), int(k["padding_idx"]), bool(k["scale_grad_by_freq"])
    )
    return [r.numpy()]


def own_third_party(p: ch.Prepared) -> list:
    """The double benchmark's third party: the executor itself (PyTorch CPU in the case dtype)."""
    import torch

    k = p.kwargs
    g = np.asarray(k["grad"])
    tg = st.to_torch(g)
    idx = torch.from_numpy(np.asarray(k["indices"]).astype(np.int64))
    r = torch.ops.aten.embedding_dense_backward(
        tg, idx, int(k["num_weights"]), int(k["padding_idx"]), bool(k["scale_grad_by_freq"])
    )
    return [r.float().numpy()]


OWN = {
    "cross_entropy_loss_grad": own_cross_entropy_loss_grad,
    "smooth_l1_loss_backward": own_smooth_l1_loss_backward,
    "scaled_masked_softmax_backward": own_scaled_masked_softmax_backward,
    "embedding_dense_backward": own_embedding_dense_backward,
}


def own_golden(p: ch.Prepared) -> list:
    """The op's own golden; the ops not in :data:`OWN` already have it in tests/cann_helpers
    (FusedLinearOnlineMaxSum, FusedLinearCrossEntropyLossGrad, FusedCrossEntropyLossWithMaxSum —
    whose golden.py deletes label_smoothing, as the kernel never reads it)."""
    fn = OWN.get(p.op)
    return fn(p.kwargs) if fn is not None else ch.golden(p)


# --- running -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_plugin(tmp_path_factory):
    """The plugin as a user gets it: ``fastgrad ttk-plugin --out DIR``, loaded as TTK does."""
    out = tmp_path_factory.mktemp("ttk") / "plugin"
    r = subprocess.run(
        [sys.executable, "-m", "fastgrad", "ttk-plugin", "--out", str(out)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return st.load_plugin(out)


def _judge(outs: list, p: ch.Prepared) -> list[str]:
    gold = own_golden(p)
    if p.op == "fused_cross_entropy_loss_with_max_sum" and gold[1] is None:
        outs = outs[:1]  # the kernel entry's placeholder for the softmax the kernel leaves unwritten
    ref = own_third_party(p) if p.standard["kind"] == "double" else None
    return ch.judge(p, outs, gold, ref)


def _tally(stem: str, run) -> None:
    n = len(ch.load(stem)["cases"])
    missed: dict[str, str] = {}
    for i in range(n):
        try:
            outs, p = run(i)
        except Exception as e:  # a refusal or a crash is a miss, with its text
            missed[ch.case_key(stem, ch.load(stem)["cases"][i])] = f"{type(e).__name__}: {e}"
            continue
        fails = _judge(outs, p)
        if fails:
            missed[p.key] = fails[0]
    explained = EXPLAINED.get(stem, {})
    rate = (n - len(missed)) / n
    report = [f"{stem}: {n - len(missed)}/{n} reproduced ({rate:.1%})"]
    report += [f"  {k}: {why}  [{'explained' if k in explained else 'NOT EXPLAINED'}]" for k, why in missed.items()]
    text = "\n".join(report)
    print(text)
    assert rate >= MIN_RATE, text
    assert set(missed) <= set(explained), "cases missing the golden without an explanation:\n" + text
    stale = sorted(set(explained) - set(missed))
    assert not stale, f"{stem}: explained cases that now reproduce (drop them from EXPLAINED): {stale}"


@pytest.mark.slow
@pytest.mark.parametrize("stem", ch.TTK_FILES)
def test_every_ttk_case_file_reproduces_through_the_cli_plugin(cli_plugin, stem):
    _tally(stem, lambda i: st.run_ttk_case(cli_plugin, stem, i, SHRINK))


@pytest.mark.slow
@pytest.mark.parametrize("stem", ch.ATK_FILES)
def test_every_atk_case_file_reproduces_through_atk_golden(stem):
    _tally(stem, lambda i: st.run_atk_case(stem, i, SHRINK))


def _arch35_ce_grad_weight_smooth(g, lp, t, w, reduction, ignore_index, ls):
    """ops-nn loss/cross_entropy_loss_grad/op_kernel/arch35 with a weight and label smoothing, in
    fp32: base.h:191-192 (smoothFactor = fl(ls/C)), :565-605 (none: c = fl(g·(1−ls)), sm = fl(g·
    smoothFactor), ×ignoreSelect when ignore_index >= 0) or :660-712 (sum: element 0 of grad_loss),
    c ×= weight[t]; weight_not_none.h:218-330 (the row's S = Σ_j fl(w_j·sm), term by term);
    base.h:487-527 (x = fl(e·c), x[t] = fl(x[t] − c)); weight_not_none.h:146-182
    (out = fl(fl(fl(e·S) − fl(w_j·sm)) + x_j))."""
    f = np.float32
    n, c = lp.shape
    smf = f(f(ls) / f(c))
    out = np.empty((n, c), f)
    with np.errstate(all="ignore"):
        for i in range(n):
            sel = f(0) if (ignore_index >= 0 and t[i] == ignore_index) else f(1)
            gi = f(np.asarray(g, f).reshape(-1)[0 if reduction == "sum" else i])
            ci = f(f(f(gi * f(f(1) - f(ls))) * sel) * w[t[i]])
            sm = f(f(gi * smf) * sel)
            terms = (w * sm).astype(f)
            s_row = f(np.sum(terms, dtype=f))
            e = np.exp(lp[i].astype(f))
            x = (e * ci).astype(f)
            x[t[i]] = f(x[t[i]] - ci)
            out[i] = (((e * s_row).astype(f) - terms).astype(f) + x).astype(f)
    return out


@pytest.mark.parametrize("name", ["celossgrad_INF_NAN_007", "celossgrad_INF_NAN_008"])
def test_ttk_ce_grad_inf_nan_007_008_through_the_ttk_flow(cli_plugin, name):
    """fp16, log_prob all +inf, grad_loss ±inf, weight U(0, 1) (the case file's [None, None]),
    ignore_index 0, label smoothing 0.3 (none / sum), Ascend950.  The arch35 kernel: ignored rows
    c = fl(g·0.7)·0 = NaN; kept rows e·S = ±inf and w_j·sm = ±inf of the same sign (every w_j > 0),
    so every element is NaN — the op's own golden (its PyTorch composite in fp32) places NaN at
    the same 32 positions, and so does the plugin (docs/device_parity.md row 4m)."""
    stem = "ttk_kernel_cross_entropy_loss_grad_st"
    index = next(i for i, c in enumerate(ch.load(stem)["cases"]) if c["name"] == name)
    outs, p = st.run_ttk_case(cli_plugin, stem, index, SHRINK)
    got = np.asarray(outs[0]).astype(np.float32)
    k = p.kwargs
    assert p.soc == "Ascend950" and got.dtype == np.float32 and np.asarray(outs[0]).dtype == np.float16
    kern = (
        _arch35_ce_grad_weight_smooth(
            k["grad_loss"],
            np.asarray(k["log_prob"]),
            np.asarray(k["target"]),
            np.asarray(k["weight"], np.float32),
            k["reduction"],
            k["ignore_index"],
            k["label_smoothing"],
        )
        .astype(np.float16)
        .astype(np.float32)
    )
    gold = own_golden(p)[0]
    for ref in (kern, gold):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    assert np.isnan(got).all()
    assert ch.judge(p, outs, own_golden(p)) == []
