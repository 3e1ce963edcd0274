"""The companion forward ops: fused_linear_online_max_sum and fused_cross_entropy_loss_with_max_sum."""

import numpy as np
import pytest
from flce_helpers import BF16, DTYPES, F16, F32, make_problem

import fastgrad as fg
from fastgrad import tiling

torch = pytest.importorskip("torch")


def golden(x, w, t, start, end):
    """Independent oracle: logits rounded to the input dtype, then float64 statistics."""
    L = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32).astype(x.dtype).astype(np.float64)
    m = L.max(axis=1)
    s = np.exp(L - m[:, None]).sum(axis=1)
    masked = (t < start) | (t >= end)
    local = np.where(masked, 0, t - start)
    pred = np.where(masked, 0.0, L[np.arange(len(t)), np.clip(local, 0, L.shape[1] - 1)] - m)
    return m, s, pred, masked, local, L


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1), (9, 7, 300), (130, 17, 1031)], ids=str)
def test_matches_golden(rng, dtype, shape):
    BT, H, V = shape
    x, w, _, _, _ = make_problem(rng, BT, H, V, dtype)
    start = 5
    t = rng.integers(0, V + 10, BT).astype(np.int32)
    r = fg.fused_linear_online_max_sum(x, w, t, start, start + V, return_logits=True)
    m, s, pred, masked, local, L = golden(x, w, t, start, start + V)
    u = {BF16: 2.0 ** -8, F16: 2.0 ** -11, F32: 2.0 ** -23}[np.dtype(dtype)]
    np.testing.assert_allclose(r.logits_max_local, m, rtol=2 * u, atol=1e-6)   # at most one rounding apart
    np.testing.assert_allclose(r.sum_exp_logits_local, s, rtol=1e-5)
    np.testing.assert_allclose(r.predicted_logits_local, pred, rtol=1e-5, atol=1e-6)
    assert r.masked_target.dtype == np.int32
    np.testing.assert_array_equal(r.masked_target, local)
    bits = np.unpackbits(r.target_mask, bitorder="little")
    np.testing.assert_array_equal(bits[:BT].astype(bool), masked)
    assert bits[BT:].all(), "padding bits must be 1 (device)"
    assert r.target_mask.shape == ((BT + 7) // 8,)
    assert r.vocab_parallel_logits.dtype == dtype
    got = r.vocab_parallel_logits.astype(np.float64)
    np.testing.assert_allclose(got, L, rtol=2 * u, atol=1e-6)   # fp32 GEMM vs float64: one rounding at most
    if dtype != F32:
        assert np.mean(got != L) < 0.01


def test_online_tiles_match_single_tile_and_threads_are_bitwise_equal(rng):
    BT, H, V = 300, 16, 2100
    x, w, t, _, _ = make_problem(rng, BT, H, V, BF16)
    ref = fg.fused_linear_online_max_sum(x, w, t, 0, V)
    tiling.set_workspace_budget(150_000)
    try:
        assert tiling.plan_linear_cross_entropy(BT, V, H, mode="forward").n_tiles > 4
        res = []
        for n in (1, 2):
            with fg.num_threads(n):
                res.append(fg.fused_linear_online_max_sum(x, w, t, 0, V))
    finally:
        tiling.set_workspace_budget(None)
    for a, b in zip(res[0][:5], res[1][:5]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(res[0].logits_max_local, ref.logits_max_local)
    np.testing.assert_allclose(res[0].sum_exp_logits_local, ref.sum_exp_logits_local, rtol=1e-5)


def test_loss_and_softmax_match_torch(rng):
    BT, H, V = 23, 11, 97
    x, w, t, _, _ = make_problem(rng, BT, H, V, F32)
    r = fg.fused_linear_online_max_sum(x, w, t, 0, V, return_logits=True)
    loss, sm = fg.fused_cross_entropy_loss_with_max_sum(r.logits_max_local, r.sum_exp_logits_local,
                                                        r.predicted_logits_local,
                                                        vocab_parallel_logits=r.vocab_parallel_logits)
    logits = torch.tensor(x, dtype=torch.float64) @ torch.tensor(w, dtype=torch.float64).T
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor(t), reduction="none").numpy()
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sm, torch.softmax(logits, -1).numpy(), rtol=1e-5, atol=1e-7)
    l2, none = fg.fused_cross_entropy_loss_with_max_sum(r.logits_max_local, r.sum_exp_logits_local,
                                                        r.predicted_logits_local)
    assert none is None
    np.testing.assert_array_equal(l2, loss)
    with fg.use_backend("reference"):
        l3, s3 = fg.fused_cross_entropy_loss_with_max_sum(r.logits_max_local, r.sum_exp_logits_local,
                                                          r.predicted_logits_local,
                                                          vocab_parallel_logits=r.vocab_parallel_logits)
    np.testing.assert_allclose(l3, loss, rtol=1e-6)
    np.testing.assert_allclose(s3, sm, rtol=1e-6, atol=1e-9)


def test_loss_label_smoothing_extension_is_megatrons(rng):
    BT, H, V = 13, 6, 40
    x, w, t, _, _ = make_problem(rng, BT, H, V, F32)
    r = fg.fused_linear_online_max_sum(x, w, t, 0, V, return_logits=True)
    a = 0.2
    loss, _ = fg.fused_cross_entropy_loss_with_max_sum(r.logits_max_local, r.sum_exp_logits_local,
                                                       r.predicted_logits_local, a, r.vocab_parallel_logits)
    logits = torch.tensor(x, dtype=torch.float64) @ torch.tensor(w, dtype=torch.float64).T
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor(t), reduction="none",
                                            label_smoothing=a * V / (V - 1)).numpy()
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-5)
    for kw in ({}, ):
        with pytest.raises(fg.AclnnError) as e:   # needs the logits
            fg.fused_cross_entropy_loss_with_max_sum(r.logits_max_local, r.sum_exp_logits_local,
                                                     r.predicted_logits_local, a, **kw)
        assert e.value.status == 161002


def test_torch_in_torch_out(rng):
    BT, H, V = 8, 4, 32
    x, w, t, _, _ = make_problem(rng, BT, H, V, BF16)
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    wt = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    r = fg.fused_linear_online_max_sum(xt, wt, torch.from_numpy(t), 0, V, return_logits=True)
    assert all(isinstance(a, torch.Tensor) for a in r)
    assert r.vocab_parallel_logits.dtype == torch.bfloat16 and r.target_mask.dtype == torch.uint8
    n = fg.fused_linear_online_max_sum(x, w, t, 0, V)
    np.testing.assert_array_equal(r.sum_exp_logits_local.numpy(), n.sum_exp_logits_local)


@pytest.mark.parametrize("kw,status,param", [
    (dict(input=None), 161001, "input"),
    (dict(weight=None), 161001, "weight"),
    (dict(target=None), 161001, "target"),
    (dict(vocab_start_index=-1), 161002, "vocab_start_index"),
    (dict(vocab_end_index=2), 161002, "vocab_end_index"),
    (dict(target=np.zeros(6, np.float32)), 161002, "target"),
    (dict(target=np.zeros(5, np.int64)), 161002, "target"),
    (dict(weight=np.zeros((8, 3), BF16)), 161002, "weight"),
    (dict(weight=np.zeros((8, 4), F16)), 161002, "weight"),
    (dict(input=np.zeros((6, 4), np.float64)), 161002, "input"),
    (dict(return_logits=1), 161002, "return_logits"),
])
def test_forward_errors(kw, status, param):
    args = dict(input=np.zeros((6, 4), BF16), weight=np.zeros((8, 4), BF16), target=np.zeros(6, np.int64),
                vocab_start_index=3, vocab_end_index=11)
    args.update(kw)
    with pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_online_max_sum(**args)
    assert e.value.status == status and param in str(e.value)


@pytest.mark.parametrize("kw,status", [
    (dict(logits_max=None), 161001),
    (dict(sum_exp_logits=np.zeros(5, np.float64)), 161002),
    (dict(predicted_logits=np.zeros(4, np.float32)), 161002),
    (dict(vocab_parallel_logits=np.zeros((4, 3), np.float32)), 161002),
    (dict(label_smoothing=0.1), 161002),
])
def test_loss_errors(kw, status):
    args = dict(logits_max=np.zeros(5, np.float32), sum_exp_logits=np.ones(5, np.float32),
                predicted_logits=np.zeros(5, np.float32))
    args.update(kw)
    with pytest.raises(fg.AclnnError) as e:
        fg.fused_cross_entropy_loss_with_max_sum(**args)
    assert e.value.status == status


def test_empty_shard_outside_strict_mode_and_rejected_inside():
    x = np.ones((3, 4), BF16)
    w = np.zeros((0, 4), BF16)
    t = np.array([0, 1, 2])
    r = fg.fused_linear_online_max_sum(x, w, t, 5, 5)
    assert np.all(r.logits_max_local == -np.inf) and np.all(r.sum_exp_logits_local == 0)
    assert np.all(r.predicted_logits_local == 0)
    assert np.all(np.unpackbits(r.target_mask, bitorder="little")[:3] == 1)
    with fg.strict(), pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_online_max_sum(x, w, t, 5, 5)
    assert e.value.status == 161002 and "weight" in str(e.value)


# --- the shard range as the device takes it (issue 25: the end - start == V check undone) -----


def _kernel_oracle(x, w, t, start, end):
    """Independent oracle of the kernel (fused_linear_online_max_sum.h:846-878, 948-953,
    1061-1076): the picked logit is summed over the vocabulary tiles that hold its column (0 when
    none does, masked_target >= V), and every unmasked row then subtracts the row max."""
    L = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32).astype(x.dtype).astype(np.float64)
    m = L.max(axis=1)
    masked = (t < start) | (t >= end)
    local = np.where(masked, 0, t - start)
    picked = np.array([L[i, local[i]] if local[i] < L.shape[1] else 0.0 for i in range(len(t))])
    return m, np.where(masked, 0.0, picked - m), masked, local


@pytest.mark.parametrize("strict", [False, True])
def test_official_example_runs_v5_with_range_0_2(strict):
    # examples/test_aclnn_fused_linear_online_max_sum.cpp:84-125: ones [3,4] fp16, weight ones
    # [5,4], targets 1 (int32), vocab [0, 2)
    x = np.ones((3, 4), np.float16)
    w = np.ones((5, 4), np.float16)
    t = np.ones(3, np.int32)
    with fg.strict(strict):
        r = fg.fused_linear_online_max_sum(x, w, t, 0, 2, return_logits=True)
    np.testing.assert_array_equal(r.logits_max_local, np.full(3, 4.0, np.float32))
    np.testing.assert_array_equal(r.sum_exp_logits_local, np.full(3, 5.0, np.float32))
    np.testing.assert_array_equal(r.predicted_logits_local, np.zeros(3, np.float32))
    np.testing.assert_array_equal(r.target_mask, np.zeros(1, np.uint8))
    np.testing.assert_array_equal(r.masked_target, t)
    assert r.masked_target.dtype == np.int32
    np.testing.assert_array_equal(r.vocab_parallel_logits, np.full((3, 5), 4.0, np.float16))


@pytest.mark.parametrize("bt", [128, 256])
def test_doc_example_range_0_64_of_256_rows(bt):
    # the aclnn doc's example (docs/aclnnFusedLinearOnlineMaxSum.md: m 128, k 64, n 256, ones
    # fp16, targets 1, vocab [0, 64)) and torch_npu's 256-row variant
    x = np.ones((bt, 64), np.float16)
    w = np.ones((256, 64), np.float16)
    t = np.ones(bt, np.int32)
    r = fg.fused_linear_online_max_sum(x, w, t, 0, 64)
    np.testing.assert_array_equal(r.logits_max_local, np.full(bt, 64.0, np.float32))
    np.testing.assert_array_equal(r.sum_exp_logits_local, np.full(bt, 256.0, np.float32))
    np.testing.assert_array_equal(r.predicted_logits_local, np.zeros(bt, np.float32))
    np.testing.assert_array_equal(r.target_mask, np.zeros(bt // 8, np.uint8))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_target_in_range_beyond_the_shard_rows_gives_minus_max(rng, backend, dtype):
    # end - start > V: targets in [start + V, end) are unmasked, keep masked_target = t - start
    # and get predicted = 0 - max (no tile holds the column)
    BT, H, V, start, end = 40, 9, 7, 3, 25
    x = rng.standard_normal((BT, H)).astype(dtype)
    w = rng.standard_normal((V, H)).astype(dtype)
    t = rng.integers(0, 30, BT).astype(np.int64)
    t[:4] = [start + V, end - 1, start + V - 1, end]  # beyond V (x2), the last row, masked
    with fg.use_backend(backend):
        r = fg.fused_linear_online_max_sum(x, w, t, start, end)
    m, pred, masked, local = _kernel_oracle(x, w, t, start, end)
    np.testing.assert_array_equal(r.logits_max_local, m.astype(np.float32))
    np.testing.assert_allclose(r.predicted_logits_local, pred, rtol=0, atol=1e-6 * np.abs(m).max())
    beyond = ~masked & (local >= V)
    assert beyond[:2].all() and not beyond[2] and masked[3]
    np.testing.assert_array_equal(r.predicted_logits_local[beyond], -r.logits_max_local[beyond])
    np.testing.assert_array_equal(r.masked_target, local)
    np.testing.assert_array_equal(np.unpackbits(r.target_mask, bitorder="little")[:BT], masked)


def test_end_equal_start_masks_every_row(rng):
    x = rng.standard_normal((10, 5)).astype(BF16)
    w = rng.standard_normal((6, 5)).astype(BF16)
    t = rng.integers(0, 20, 10).astype(np.int32)
    with fg.strict():
        r = fg.fused_linear_online_max_sum(x, w, t, 4, 4)
    assert np.all(np.unpackbits(r.target_mask, bitorder="little")[:10] == 1)
    np.testing.assert_array_equal(r.predicted_logits_local, np.zeros(10, np.float32))
    np.testing.assert_array_equal(r.masked_target, np.zeros(10, np.int32))


def test_ascend950_has_no_kernel_strict_refuses_with_inner_nullptr():
    x = np.ones((3, 4), np.float16)
    w = np.ones((5, 4), np.float16)
    t = np.ones(3, np.int32)
    with fg.soc_version("Ascend950"):
        r = fg.fused_linear_online_max_sum(x, w, t, 0, 2)  # outside strict: the A2/A3 result
        np.testing.assert_array_equal(r.sum_exp_logits_local, np.full(3, 5.0, np.float32))
        with fg.strict(), pytest.raises(fg.AclnnError) as e:
            fg.fused_linear_online_max_sum(x, w, t, 0, 2)
        assert e.value.status == 561103 and "Ascend950" in str(e.value)
        with fg.strict():  # an empty input returns before the l0 op (op_api :258-263)
            fg.fused_linear_online_max_sum(x[:0], w, t[:0], 0, 2)
    for soc in ("Ascend910B", "Ascend910B3", "Ascend910_93", "Ascend910_9391"):
        with fg.soc_version(soc), fg.strict():
            fg.fused_linear_online_max_sum(x, w, t, 0, 2)


def test_loss_vocab_rows_must_match_bt_per_profile():
    # the op_api does not check vocab_parallel_logits.shape[0] (aclnn_..._with_max_sum.cpp:72-90);
    # A2/A3 tiling splits by it (loss rows unwritten / statistics read past their end):
    # refused, 161002; the arch35 tiling refuses it (tiling_arch35.cpp:123-132): 561103 in strict
    args = dict(logits_max=np.zeros(5, np.float32), sum_exp_logits=np.ones(5, np.float32),
                predicted_logits=np.zeros(5, np.float32))
    for rows in (4, 6):
        lg = np.zeros((rows, 3), np.float32)
        for soc, strict, status in (("Ascend910B", False, 161002), ("Ascend910B", True, 161002),
                                    ("Ascend950", False, 161002), ("Ascend950", True, 561103)):
            with fg.soc_version(soc), fg.strict(strict), pytest.raises(fg.AclnnError) as e:
                fg.fused_cross_entropy_loss_with_max_sum(**args, vocab_parallel_logits=lg)
            assert e.value.status == status and "vocab_parallel_logits" in str(e.value)
    loss, sm = fg.fused_cross_entropy_loss_with_max_sum(**args, vocab_parallel_logits=np.zeros((5, 3), np.float32))
    assert sm.shape == (5, 3)
