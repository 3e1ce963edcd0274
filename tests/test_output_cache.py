"""The ops' large fresh outputs on recycled memory (fastgrad/_outcache.py).

Safety first: a block is handed out again only when no array, view or tensor of an earlier
output refers to it; values of what the caller keeps never change.  Then: reuse happens (the
same memory, no fresh pages), the cap holds, ``empty_cache`` releases only free blocks, and
outputs are the same numbers with the cache on or off.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from common import two_threads_overlapping

import fastgrad as fg
from fastgrad import _outcache


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Cache outputs from 64 KiB (the default 16 MiB would make every test slow); a clean cache."""
    monkeypatch.setattr(_outcache, "MIN_BYTES", 64 * 2**10)
    monkeypatch.setattr(_outcache, "GRANULE", 4096)
    fg.empty_cache()
    yield
    fg.set_output_cache_limit(None)
    fg.empty_cache()


N = 100_003  # a prime: 400 KB fp32 outputs, not a multiple of the granule


def _grad(seed, n=N):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    return g, x, y


def _sl1(args):
    g, x, y = args
    return fg.smooth_l1_loss_backward(g, x, y, reduction="none", beta=1.0)


def _oracle(args):
    """The op's values computed with the cache off (fresh memory, never recycled): what every
    recycled output must hold.  (The op's own formula is tested in
    tests/test_smooth_l1_loss_backward.py; here only the memory is under test.)"""
    with fg.output_cache(0):
        return _sl1(args)


def _span(a):
    lo = a.__array_interface__["data"][0]
    return lo, lo + a.nbytes


def _overlap(a, b):
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def test_reuses_memory_once_nothing_refers_to_it():
    a = _sl1(_grad(0))
    ptr = _span(a)[0]
    del a
    b = _sl1(_grad(1))
    assert _span(b)[0] == ptr, "the free block was not reused"
    np.testing.assert_array_equal(b, _oracle(_grad(1)))
    info = fg.output_cache_info()
    assert info["hits"] >= 1 and info["blocks"] == 1 and info["free_blocks"] == 0


@pytest.mark.parametrize("keep", ["view", "slice", "reshape", "torch", "astype-none"])
def test_never_reuses_memory_something_still_refers_to(keep):
    a = _sl1(_grad(0))
    want = _oracle(_grad(0))
    if keep == "view":
        kept = a.view(np.int32)
    elif keep == "slice":
        kept = a[17:-3:2]
    elif keep == "reshape":
        kept = a[:100_000].reshape(100, 1000).T
    elif keep == "torch":
        torch = pytest.importorskip("torch")
        kept = torch.from_numpy(a)
    else:
        kept = a.astype(np.float32, copy=False)
    del a  # only the derived object is left
    outs = [_sl1(_grad(s)) for s in range(2, 6)]
    for o in outs:
        assert not _overlap(o, np.asarray(kept)), keep
    back = np.asarray(kept)
    if keep == "view":
        np.testing.assert_array_equal(back.view(np.float32), want)
    elif keep == "slice":
        np.testing.assert_array_equal(back, want[17:-3:2])
    elif keep == "reshape":
        np.testing.assert_array_equal(back, want[:100_000].reshape(100, 1000).T)
    else:
        np.testing.assert_array_equal(back, want)


def test_torch_outputs_are_recycled_only_after_the_tensor_dies():
    torch = pytest.importorskip("torch")
    g, x, y = (torch.from_numpy(a) for a in _grad(3))
    t1 = fg.smooth_l1_loss_backward(g, x, y, reduction="none", beta=1.0)
    keep = t1.clone()
    t2 = fg.smooth_l1_loss_backward(g, x, y, reduction="none", beta=1.0)
    assert t1.data_ptr() != t2.data_ptr() and torch.equal(t1, keep)
    p1 = t1.data_ptr()
    del t1
    t3 = fg.smooth_l1_loss_backward(g, x, y, reduction="none", beta=1.0)
    assert t3.data_ptr() == p1 and torch.equal(t3, keep) and torch.equal(t2, keep)


def test_cap_and_empty_cache():
    fg.set_output_cache_limit(1.0)  # 1 MiB: two 400 KB blocks fit, a third does not
    held = [_sl1(_grad(s)) for s in range(3)]
    info = fg.output_cache_info()
    assert info["blocks"] == 2 and info["bytes"] <= 2**20
    for i, h in enumerate(held):  # the one past the cap is a plain array, still correct
        np.testing.assert_array_equal(h, _oracle(_grad(i)))
    del held[0]
    assert fg.empty_cache() > 0  # the freed block is released, the one in use is not
    assert fg.output_cache_info()["blocks"] == 1
    np.testing.assert_array_equal(held[0], _oracle(_grad(1)))
    with fg.output_cache(0):  # off: fresh memory every time, nothing cached
        a = _sl1(_grad(4))
        assert fg.output_cache_info()["blocks"] == 1 and _span(a)[0] not in {_span(h)[0] for h in held}
    assert _outcache.output_cache_limit() == 2**20


def test_small_outputs_are_plain_arrays():
    a = _sl1(_grad(0, n=1000))
    assert a.base is None and fg.output_cache_info()["blocks"] == 0


def test_concurrent_calls_get_distinct_memory():
    results = {}

    def work(k):
        results[k] = [_sl1(_grad(k)) for _ in range(3)]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    live = [o for k in results for o in results[k]]
    for i in range(len(live)):
        for j in range(i + 1, len(live)):
            assert not _overlap(live[i], live[j])
    for k, outs in results.items():
        for o in outs:
            np.testing.assert_array_equal(o, _oracle(_grad(k)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_same_numbers_with_the_cache_on_and_off(dtype):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(7)
    logp = np.log(rng.dirichlet(np.ones(257), size=301)).astype(dt)  # 301 x 257: prime sizes
    target = rng.integers(0, 257, 301)
    gl = np.asarray(1.0, dt)
    with fg.output_cache(0):
        ref = fg.cross_entropy_loss_grad(gl, logp, target, reduction="mean")
    for _ in range(3):
        got = fg.cross_entropy_loss_grad(gl, logp, target, reduction="mean")
        assert got.dtype == dt and got.flags.c_contiguous and got.shape == logp.shape
        np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
        del got
    assert fg.output_cache_info()["hits"] >= 2


def test_training_op_gradients_and_scratch_are_recycled_safely():
    """``linear_cross_entropy``'s gradients and its logits scratch come from the cache: a kept
    gradient (array or tensor) is never overwritten by the next call, a dropped one is reused."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    w = rng.standard_normal((3001, 48)).astype(np.float32)  # grad_weight 576 KB, scratch 768 KB
    t = rng.integers(0, 3001, 64)
    first = fg.linear_cross_entropy(x, w, t, return_grad=True)
    keep = first.grad_weight.copy()
    second = fg.linear_cross_entropy(2 * x, w, t, return_grad=True)
    assert not _overlap(first.grad_weight, second.grad_weight)
    np.testing.assert_array_equal(first.grad_weight, keep)
    del second
    misses = fg.output_cache_info()["misses"]
    third = fg.linear_cross_entropy(x, w, t, return_grad=True)  # every buffer recycled
    assert fg.output_cache_info()["misses"] == misses
    assert not _overlap(first.grad_weight, third.grad_weight)
    np.testing.assert_array_equal(third.grad_weight, keep)
    torch = pytest.importorskip("torch")
    import fastgrad.torch as ft

    ww = torch.from_numpy(w).requires_grad_()
    ft.linear_cross_entropy(torch.from_numpy(x), ww, torch.from_numpy(t)).backward()
    g1 = ww.grad.clone()
    ww.grad = None
    ft.linear_cross_entropy(torch.from_numpy(x), ww, torch.from_numpy(t)).backward()
    assert torch.equal(ww.grad, g1)


def _addr(a):
    return a.__array_interface__["data"][0]


def test_best_fit_reuses_a_free_block_up_to_twice_the_size():
    """A request takes the smallest free block of at least its size and at most twice it (the
    forward's logits tile serves the backward's smaller one); a larger block stays put."""
    a = _outcache.empty(40 * 2**10, np.float32)  # 160 KiB
    first = _addr(a)
    del a
    info = fg.output_cache_info()
    b = _outcache.empty(25 * 2**10, np.float32)  # 100 KiB: fits, 160 <= 2 * 100
    assert _addr(b) == first
    assert fg.output_cache_info()["hits"] == info["hits"] + 1
    assert fg.output_cache_info()["blocks"] == info["blocks"]
    b[...] = 7
    del b
    c = _outcache.empty(70 * 2**8, np.float32)  # 70 KiB: 160 > 2 * 70, a new block
    assert _addr(c) != first
    assert fg.output_cache_info()["blocks"] == info["blocks"] + 1
    d = _outcache.empty(150 * 2**8, np.float32)  # 150 KiB: the free 160 KiB block again
    assert _addr(d) == first
    assert not np.shares_memory(c, d)


def test_ownership_is_explicit_not_a_reference_count():
    """A block is handed back by its lease's finalizer (``weakref.finalize``): the source reads
    no reference count, and an output caught in a reference cycle stays in use until the cycle
    is collected — then it is reused."""
    import gc
    import inspect

    src = inspect.getsource(_outcache)
    assert "getrefcount" not in src and "weakref.finalize" in src
    gc.disable()
    try:
        a = _sl1(_grad(0))
        ptr = _span(a)[0]
        cycle = [a]
        cycle.append(cycle)  # a list that refers to itself and to the output
        del a, cycle
        b = _sl1(_grad(1))  # the cycle is not collected yet: the block is still owned
        assert _span(b)[0] != ptr
        assert fg.output_cache_info()["free_blocks"] == 0
        gc.collect()
        c = _sl1(_grad(2))
        assert _span(c)[0] == ptr  # collected: handed back and reused
        np.testing.assert_array_equal(c, _oracle(_grad(2)))
        np.testing.assert_array_equal(b, _oracle(_grad(1)))
    finally:
        gc.enable()


def test_an_output_outlives_the_cache_forgetting_its_block():
    """Interpreter exit (or any drop of the list) while an output is alive: its lease keeps the
    memory, the values stay."""
    a = _sl1(_grad(4))
    want = _oracle(_grad(4))
    with _outcache._lock:
        _outcache._blocks.clear()
    junk = [np.full(N, 7.0, np.float32) for _ in range(4)]  # allocations that could reuse it
    np.testing.assert_array_equal(a, want)
    del junk
    kept = a[::2]
    del a
    np.testing.assert_array_equal(kept, want[::2])


def test_outputs_of_every_dtype_are_owned_arrays():
    import ml_dtypes

    for dt in (np.float32, np.float16, ml_dtypes.bfloat16, np.int64, np.bool_):
        a = _outcache.empty((300, 301), dt)
        assert a.dtype == np.dtype(dt) and a.shape == (300, 301) and a.flags.c_contiguous and a.flags.writeable
        p = _addr(a)
        v = a.T[::3]
        del a
        b = _outcache.empty((300, 301), dt)
        pb = _addr(b)
        assert pb != p  # the view still owns it
        del v, b
        assert _addr(_outcache.empty((300, 301), dt)) in (p, pb)  # both handed back


def test_overlapping_output_cache_blocks_in_two_threads_restore_the_process_cap():
    """Found by fuzzing: each block restored the cap it saw on entry, so B (entered inside A's
    block) left the cache off for good — A's 0 — once both had ended."""
    fg.set_output_cache_limit(8.0)
    seen = two_threads_overlapping(fg.output_cache(0), fg.output_cache(1.0), _outcache.output_cache_limit)
    assert seen == {"B inside, A left": 2**20, "both left": 8 * 2**20}


@pytest.mark.parametrize("mb", [-1, float("nan"), float("inf"), "512", True])
def test_a_bad_cap_is_refused_naming_mb_and_changes_nothing(mb):
    fg.set_output_cache_limit(3.0)
    for call in (fg.set_output_cache_limit, fg.output_cache):
        with pytest.raises(ValueError, match=r"mb: expected a finite number of MiB >= 0") as e:
            if call is fg.output_cache:
                with call(mb):
                    pass
            else:
                call(mb)
        assert (e.value.status, e.value.param) == (161002, "mb")
        assert _outcache.output_cache_limit() == 3 * 2**20
