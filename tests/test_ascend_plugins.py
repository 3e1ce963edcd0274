"""fastgrad's TTK golden plugin and ATK helper, run on the ops' own case files through stand-in
runners (tests/ttk_standin.py).

Per case file, every case goes through the plugin the way the runner calls it and must

1. return exactly what fastgrad's public op returns for the same case (the plugin binds inputs
   in op-definition order, attributes by their names, the SoC from the context, output dtypes),
2. agree with the op's own golden (tests/cann_helpers.py, the standard of the case file).

A failure lists the cases by id.  Cases are shrunk harder than in tests/test_cann_cases.py
(batch dimensions above 2**14 elements) to keep this file quick: it tests the plumbing.
"""

from __future__ import annotations

import subprocess
import sys

import cann_helpers as ch
import numpy as np
import pytest
import ttk_standin as st

SHRINK = 1 << 14


@pytest.fixture(scope="module")
def plugin():
    import fastgrad.ascend.ttk as ttk

    return st.Plugin(ttk, ttk.__golden__)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f" or a.dtype == ch.BF16:
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        return bool(np.array_equal(a64, b64, equal_nan=True))
    return bool(np.array_equal(a, b))


def _check(outs, p, file_kind) -> tuple[str | None, list]:
    """(plumbing failure or None, golden failures) for one case."""
    gold = ch.golden(p)
    if p.op == "fused_cross_entropy_loss_with_max_sum" and file_kind == "kernel" and gold[1] is None:
        outs = outs[:1]  # the kernel entry returns a placeholder for the unwritten softmax
    n = sum(g is not None for g in gold)
    if len(outs) < n:
        return f"{len(outs)} outputs, expected {n}", []
    if p.op == "fused_cross_entropy_loss_with_max_sum" and p.kwargs["label_smoothing"] != 0.0:
        pass  # the kernel entry passes label_smoothing 0 (the kernel never reads it): no direct twin
    else:
        direct = ch.run_fastgrad(p)
        for i, (o, d) in enumerate(zip(outs, direct)):
            if d is not None and not _same(o, d):
                return f"output {i} differs from fastgrad's direct call", []
    ref = ch.third_party(p) if p.standard["kind"] == "double" else None
    return None, ch.judge(p, outs, gold, ref)


def _report(stem, plumbing, disagree, total):
    lines = [f"{stem}: {total - len(disagree) - len(plumbing)}/{total} cases agree with the golden"]
    lines += [f"  plumbing {k}: {v}" for k, v in plumbing[:10]]
    lines += [f"  golden {k}: {v}" for k, v in disagree[:10]]
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("stem", ch.TTK_FILES)
def test_ttk_plugin_on_the_ttk_case_files(plugin, stem):
    plumbing, disagree = [], []
    n = len(ch.load(stem)["cases"])
    for i in range(n):
        outs, p = st.run_ttk_case(plugin, stem, i, SHRINK)
        bad, fails = _check(outs, p, "aclnn" if "api_name" in ch.load(stem)["cases"][i] else "kernel")
        if bad:
            plumbing.append((p.key, bad))
        elif fails:
            disagree.append((p.key, fails[0]))
    assert not plumbing and not disagree, _report(stem, plumbing, disagree, n)


@pytest.mark.slow
@pytest.mark.parametrize("stem", ch.ATK_FILES)
def test_atk_golden_on_the_atk_case_files(stem):
    plumbing, disagree = [], []
    n = len(ch.load(stem)["cases"])
    for i in range(n):
        outs, p = st.run_atk_case(stem, i, SHRINK)
        bad, fails = _check(outs, p, "atk")
        if bad:
            plumbing.append((p.key, bad))
        elif fails:
            disagree.append((p.key, fails[0]))
    assert not plumbing and not disagree, _report(stem, plumbing, disagree, n)


def test_the_cli_writes_a_plugin_ttk_can_read(tmp_path):
    out = tmp_path / "plugin"
    r = subprocess.run(
        [sys.executable, "-m", "fastgrad", "ttk-plugin", "--out", str(out)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    table = st.literal_golden_table(out / "golden.py")
    import fastgrad.ascend.ttk as ttk

    assert table == ttk.__golden__
    plug = st.load_plugin(out)
    for stem in ("ttk_kernel_cross_entropy_loss_grad_st", "ttk_aclnn_fused_cross_entropy_loss_with_max_sum"):
        outs, p = st.run_ttk_case(plug, stem, 0, SHRINK)
        assert _check(outs, p, "x") == (None, [])
    # an existing file is kept (one line, status 2) unless --force
    r = subprocess.run(
        [sys.executable, "-m", "fastgrad", "ttk-plugin", "--out", str(out)], capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--force" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "fastgrad", "ttk-plugin", "--out", str(out), "--force"], capture_output=True, text=True
    )
    assert r.returncode == 0
    r = subprocess.run(
        [sys.executable, "-m", "fastgrad", "ttk-plugin", "--out", str(out), "--name", "../x.py"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "--name" in r.stderr


def test_every_kernel_entry_follows_the_op_definition():
    """The kernel entries' positional parameters are the op definitions' inputs, in order, and the
    keyword-only ones their attributes (op_host/*_def.cpp at ops-nn e5c3fa9)."""
    import inspect

    import fastgrad.ascend.ttk as ttk

    defs = {
        "fused_linear_online_max_sum": (
            ("input", "weight", "target"),
            ("vocab_start_index", "vocab_end_index", "vocab_parallel_logits_out_flag"),
        ),
        "fused_cross_entropy_loss_with_max_sum": (
            (
                "logits_max",
                "sum_exp_logits",
                "predicted_logits",
                "input",
                "weight",
                "vocab_parallel_logits",
                "label_smoothing",
            ),
            (),
        ),
        "fused_linear_cross_entropy_loss_grad": (
            ("grad", "input", "weight", "target_mask", "masked_target", "logits_max", "sum_expLogits", "softmax"),
            ("label_smoothing",),
        ),
        "cross_entropy_loss_grad": (
            ("grad_loss", "log_prob", "target", "weight", "grad_zloss", "lse_for_zloss"),
            ("reduction", "ignore_index", "label_smoothing", "lse_square_scale_for_zloss"),
        ),
        "scaled_masked_softmax_grad_v2": (("yGrad", "y", "mask"), ("scale", "fixed_triu_mask")),
        "smooth_l1_loss_grad_v2": (("predict", "label", "dout"), ("sigma", "reduction")),
        "embedding_dense_grad_v2": (
            ("grad", "sort_indices", "pos_idx"),
            ("num_weights", "padding_idx", "scale_grad_by_freq"),
        ),
        "embedding_dense_grad": (("grad", "indices"), ("num_weights", "padding_idx", "scale_grad_by_freq")),
    }
    assert set(ttk.__golden__["kernel"]) == set(defs)
    for op, (pos, kw) in defs.items():
        sig = inspect.signature(getattr(ttk, ttk.__golden__["kernel"][op]))
        kinds = {n: p.kind for n, p in sig.parameters.items()}
        got_pos = tuple(n for n, k in kinds.items() if k == inspect.Parameter.POSITIONAL_OR_KEYWORD)
        got_kw = tuple(n for n, k in kinds.items() if k == inspect.Parameter.KEYWORD_ONLY)
        assert got_pos == pos and got_kw == kw, op
    for api, fn in ttk.__golden__["aclnn"].items():
        assert callable(getattr(ttk, fn)), api


def test_the_context_selects_the_soc_profile():
    """smooth-L1 on 910B (TBE: d/(β + 1e-6)) and on 950 (d/β) through the plugin's context."""
    import fastgrad as fg
    import fastgrad.ascend.ttk as ttk

    x = np.array([0.5, -0.25, 3.0], np.float32)
    t = np.zeros(3, np.float32)
    g = np.ones(3, np.float32)
    outs = {}
    for soc in ("Ascend910B", "Ascend950"):
        (outs[soc],) = ttk.smooth_l1_loss_grad_v2_golden(x, t, g, sigma=1.0, reduction="none", short_soc_version=soc)
        with fg.soc_version(soc):
            assert _same(outs[soc], fg.smooth_l1_loss_backward(g, x, t, "none", 1.0))
    assert not np.array_equal(outs["Ascend910B"], outs["Ascend950"])
    with pytest.raises(ValueError):
        ttk.smooth_l1_loss_grad_v2_golden(x, t, g, short_soc_version="Ascend310X")


def test_output_dtypes_from_the_context_are_applied():
    import fastgrad.ascend.ttk as ttk

    lm = np.zeros(4, np.float32)
    (loss, sm) = ttk.fused_cross_entropy_loss_with_max_sum_golden(
        lm,
        np.ones(4, np.float32),
        lm,
        None,
        None,
        None,
        output_dtypes=("float32", "float32"),
        output_ori_shapes=((4,), (1,)),
    )
    assert loss.dtype == np.float32 and sm.shape == (1,) and np.all(sm == 1)


def test_atk_golden_names_and_errors():
    import torch

    import fastgrad as fg
    from fastgrad.ascend import atk_golden

    lp = torch.full((2, 3), -0.2)
    kw = dict(gradLoss=torch.tensor(0.1), logProb=lp, target=torch.tensor([0, 0]), reductionOptional="mean")
    r = atk_golden("aclnnCrossEntropyLossGrad", **kw)
    assert isinstance(r, torch.Tensor)
    np.testing.assert_allclose(r[0].numpy(), [-0.0090635, 0.0409365, 0.0409365], rtol=1e-5)
    # the ATK files' spellings and positional aclnn order give the same
    r2 = atk_golden("CrossEntropyLossGrad", torch.tensor(0.1), lp, torch.tensor([0, 0]), None, None, None, "mean")
    r3 = atk_golden("crossentropylossgrad", gradLoss=torch.tensor(0.1), logProb=lp, targets=torch.tensor([0, 0]))
    assert torch.equal(r, r2) and torch.equal(r, r3)
    with pytest.raises(fg.AclnnError) as e:
        atk_golden("aclnnSoftmax", x=lp)
    assert e.value.status == 161002 and "aclnnCrossEntropyLossGrad" in str(e.value)
    with pytest.raises(fg.AclnnError) as e:
        atk_golden("aclnnCrossEntropyLossGrad", **kw, logits=lp)
    assert e.value.status == 161002 and "logits" in str(e.value)
    with pytest.raises(fg.AclnnError) as e:
        atk_golden("aclnnCrossEntropyLossGrad", gradLoss=torch.tensor(0.1), target=torch.tensor([0, 0]))
    assert e.value.status == 161001 and "logProb" in str(e.value)
    with pytest.raises(fg.AclnnError) as e:
        atk_golden("aclnnCrossEntropyLossGrad", torch.tensor(0.1), lp, gradLoss=torch.tensor(0.1))
    assert e.value.status == 161002
    # several outputs: a tuple in aclnn order; the flag adds vocab_parallel_logits
    x = torch.zeros(3, 4, dtype=torch.bfloat16)
    w = torch.zeros(5, 4, dtype=torch.bfloat16)
    t = torch.tensor([1, 1, 1], dtype=torch.int32)
    out = atk_golden("FusedLinearOnlineMaxSum", input=x, weight=w, target=t, vocabStartIndex=0, vocabEndIndex=2)
    assert isinstance(out, tuple) and len(out) == 5
    out6 = atk_golden(
        "FusedLinearOnlineMaxSum",
        input=x,
        weight=w,
        target=t,
        vocabStartIndex=0,
        vocabEndIndex=2,
        vocabParallelLogitsOutFlag=True,
    )
    assert len(out6) == 6 and out6[5].dtype == torch.bfloat16 and out6[5].shape == (3, 5)


def test_the_package_imports_lazily():
    code = (
        "import sys, fastgrad.ascend; print('fastgrad.ascend.ttk' in sys.modules, 'fastgrad.ascend.atk' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr
