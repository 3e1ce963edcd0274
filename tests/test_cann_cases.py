"""Every CANN test case of the seven ops (ops-nn's ATK and TTK case files), run through fastgrad.

The cases are data (tests/cann_cases/*.json, extracted from hicann/ops-nn at the commit each file
records; README.md there says how).  For each case: inputs generated as the ATK/TTK generator and
the op's executor do, fastgrad under the case's SoC profile (ATK: the aclnn default Ascend910B;
TTK: the file's soc_series, else Ascend950 — the files live in tests/st/arch35), and a float64
golden written in tests/cann_helpers.py after the op's own golden (the kernel where they differ),
judged with the case's standard: ATK single benchmark (MERE < T, MARE < 10 T; the case's own T
where it names one), ATK double benchmark (against the executor's torch CPU output), TTK
tolerances (tests/cann_helpers.py: ttk_judge).  Integer outputs must be equal.

A case fails when fastgrad refuses it, returns a wrong shape, or misses the standard.  Large
cases are shrunk in their batch dimensions only (the test id says ``shrunk``; the note lists the
shapes); cases still above 2**16 elements are marked slow (they run by default).
"""

from __future__ import annotations

import cann_helpers as ch
import pytest


def _params(files):
    out = []
    for stem in files:
        data = ch.load(stem)
        op = data["op"]
        for i, case in enumerate(data["cases"]):
            key = ch.case_key(stem, case)
            marks = []
            if ch.case_elements(stem, case, op) > ch.SLOW_ELEMENTS:
                marks.append(pytest.mark.slow)
            out.append(pytest.param(stem, i, id=f"{stem}-{key}", marks=marks))
    return out


def _run(p: ch.Prepared) -> list[str]:
    import fastgrad as fg

    try:
        actual = ch.run_fastgrad(p)
    except fg.AclnnError as e:
        return [f"fastgrad refused the case: {e}"]
    gold = ch.golden(p)
    ref = ch.third_party(p) if p.standard["kind"] == "double" else None
    return ch.judge(p, actual, gold, ref)


@pytest.mark.parametrize("stem, index", _params(ch.ATK_FILES))
def test_atk_case(stem, index):
    p = ch.prepare_atk(stem, index)
    fails = _run(p)
    assert not fails, (
        f"{stem} case {p.key} ({p.op}, {p.soc}{', shrunk: ' + p.shrink_note if p.shrink_note else ''}): "
        + " | ".join(fails)
    )


@pytest.mark.parametrize("stem, index", _params(ch.TTK_FILES))
def test_ttk_case(stem, index):
    p = ch.prepare_ttk(stem, index)
    fails = _run(p)
    assert not fails, (
        f"{stem} case {p.key} ({p.op}, {p.soc}{', shrunk: ' + p.shrink_note if p.shrink_note else ''}): "
        + " | ".join(fails)
    )


def test_every_case_file_is_there_with_its_source():
    """The data files name their source and the commit, and hold every case of the source file."""
    counts = {}
    for stem in ch.ATK_FILES + ch.TTK_FILES:
        data = ch.load(stem)
        src = data["source"]
        assert src["repo"] == "hicann/ops-nn" and len(src["commit"]) == 40, stem
        assert src["path"].endswith(stem + (".json" if stem.startswith("atk_") else ".csv")), stem
        counts[stem] = len(data["cases"])
    # the counts of the files at ops-nn e5c3fa9 (issue 25: 200 FusedLinearOnlineMaxSum cases)
    assert counts["atk_aclnnFusedLinearOnlineMaxSum"] == 200
    assert counts["atk_aclnnCrossEntropyLossGrad"] == 201
    assert counts["atk_aclnnScaledMaskedSoftmaxBackward"] == 240
    assert sum(counts.values()) == 2296


def test_the_sms_golden_follows_the_kernel_form_and_order():
    """issue 25's example: fp32 dy=[.1,.1], y=[.1,.9], scale 1 -> the device's [7.45e-10, 6.71e-9]
    ((dy - Σ dy·y)·y in fp32), where dy·y - Σ·y gives [0, 0]."""
    import numpy as np

    dy = np.array([[[[0.1, 0.1]]]], np.float32)
    y = np.array([[[[0.1, 0.9]]]], np.float32)
    (g,) = ch.golden_scaled_masked_softmax_backward(dy, y, np.zeros((1, 1, 1, 2), bool), 1.0)
    np.testing.assert_allclose(g.reshape(-1), [7.45e-10, 6.71e-9], rtol=2e-3)


def test_shrinking_keeps_the_reduced_dimension_and_broadcasts():
    shapes, note = ch.shrink(
        "scaled_masked_softmax_backward",
        {"y_grad": [8, 9, 68, 1536], "y": [8, 9, 68, 1536], "mask": [8, 1, 68, 1536]},
        main="y_grad",
    )
    assert note and shapes["y_grad"][-1] == 1536 and shapes["mask"][1] == 1
    assert shapes["y_grad"] == shapes["y"] and shapes["mask"][0] == shapes["y_grad"][0]
    shapes, note = ch.shrink(
        "cross_entropy_loss_grad", {"logProb": [369, 131073], "targets": [369], "w": [131073]}, main="logProb"
    )
    assert shapes == {"logProb": [4, 131073], "targets": [4], "w": [131073]}


def test_kernel_level_label_smoothing_is_the_aclnn_refusal():
    """The kernel-level TTK cases with label_smoothing 0.1 run with 0 (the kernel never reads it);
    at the aclnn level the device refuses it (aclnn_fused_cross_entropy_loss_with_max_sum.cpp:114):
    strict mode does, and the kernel's result equals label_smoothing 0."""
    import numpy as np

    import fastgrad as fg

    rng = np.random.default_rng(0)
    m = rng.standard_normal(8).astype(np.float32)
    s = (rng.random(8) + 1).astype(np.float32)
    pl = (m - rng.random(8)).astype(np.float32)
    with fg.strict(), pytest.raises(fg.AclnnError) as e:
        fg.fused_cross_entropy_loss_with_max_sum(m, s, pl, label_smoothing=0.1)
    assert e.value.status == 161002
    assert ch.stem_is_kernel_level("FusedCrossEntropyLossWithMaxSum")
    assert not ch.stem_is_kernel_level("aclnnFusedCrossEntropyLossWithMaxSum")
