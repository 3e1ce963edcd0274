"""The staged sweeps as dependency graphs (``kernels/_gemm.run_graph``, ``_lm_head.Sweep.uses``)
and the accumulating tiles summed in the BLAS call (``_gemm.accumulate``, ``IN_BLAS``).

* ``run_graph``: a group's tasks start only after every task of its predecessors ended, on any
  thread count; one thread runs the groups in their order; the first exception is raised and no
  later group starts; bad predecessors are refused.
* ``_lm_head.sweep`` with ``uses``: the edges are the conflicts of the chunk-by-chunk order; a
  stage order that would reverse one is refused before anything runs.
* The training loss's declared resources are complete: the staged row-block loop run under
  *random* schedules the graph allows (a sequential executor picking a random ready group and
  running its tasks in random order) gives the chunk-by-chunk loop's bits, bit for bit, for
  every output and the features that change the passes — a missing declaration lets some seed
  run a step before what it reads, and fails.
* ``accumulate``: ``out += A·B`` for every operand layout the tiles take (and the others, through
  the fallback), fp32 and fp64, against float64 NumPy.
"""

import random
import threading
import time

import numpy as np
import pytest
from common import BF16, workspace_budget

import fastgrad as fg
from fastgrad.kernels import _gemm
from fastgrad.lm_head import loop as _lm_head

torch = pytest.importorskip("torch")
from fastgrad.ops import linear_cross_entropy as op

# -- run_graph


def _timed_groups(shape, log, lock, sleep=0.002):
    def task(g, i):
        def f():
            t0 = time.perf_counter()
            time.sleep(sleep)
            with lock:
                log.append((g, i, t0, time.perf_counter(), threading.get_ident()))

        return f

    return [[task(g, i) for i in range(n)] for g, n in enumerate(shape)]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_group_starts_after_its_predecessors_end(threads):
    shape = [3, 2, 0, 4, 1, 3, 0, 2]
    preds = [set(), {0}, {1}, {0}, {2, 3}, set(), {5}, {6, 4}]
    from fastgrad._config import max_threads

    if threads > max_threads():
        pytest.skip(f"{threads} threads need {threads} CPUs")
    log, lock = [], threading.Lock()
    before = fg.get_num_threads()
    fg.set_num_threads(threads)
    try:
        _gemm.run_graph(_timed_groups(shape, log, lock), preds)
    finally:
        fg.set_num_threads(before)
    assert sorted((g, i) for g, i, *_ in log) == [(g, i) for g, n in enumerate(shape) for i in range(n)]
    start = {g: min(t0 for h, _, t0, _, _ in log if h == g) for g in range(len(shape)) if shape[g]}
    end = {g: max(t1 for h, _, _, t1, _ in log if h == g) for g in range(len(shape)) if shape[g]}

    def ends_of(g):  # an empty group ends when its predecessors have
        return [end[q] for q in preds[g] if q in end] + [x for q in preds[g] if q not in end for x in ends_of(q)]

    for g in start:
        assert all(e <= start[g] for e in ends_of(g)), g
    if threads == 1:  # one thread: the groups in their order
        assert [g for g, *_ in log] == sorted(g for g, *_ in log)
    else:  # independent groups overlapped (0 and 5 have no predecessors)
        assert len({tid for *_, tid in log}) > 1


def test_the_first_error_is_raised_and_nothing_after_it_starts():
    ran = []
    lock = threading.Lock()

    def ok(name):
        return lambda: (time.sleep(0.003), lock.acquire(), ran.append(name), lock.release())

    def bad():
        raise RuntimeError("tile failed")

    groups = [[ok("a0"), ok("a1")], [bad], [ok("after")], [ok("after2")]]
    with pytest.raises(RuntimeError, match="tile failed"):
        _gemm.run_graph(groups, [set(), {0}, {1}, {2}])
    assert "after" not in ran and "after2" not in ran and {"a0", "a1"} <= set(ran)


@pytest.mark.parametrize("preds", [[set(), {1}], [{0}, set()], [set(), {-1}], [set(), {5}]])
def test_a_predecessor_must_be_an_earlier_group(preds):
    with pytest.raises(ValueError, match="earlier groups"):
        _gemm.run_graph([[lambda: None], [lambda: None]], preds)


def test_only_empty_groups_finish():
    _gemm.run_graph([[], [], []], [set(), {0}, {1}])
    _gemm.run_graph([], [])


# -- Sweep.uses


def _sweep(n, uses, log, n_steps=3, lead=1):
    def step(k):
        return lambda c: [lambda: log.append((k, c))]

    return _lm_head.Sweep(n, tuple(step(k) for k in range(n_steps)), staged=True, lead=lead, uses=uses)


def test_the_edges_are_the_chunk_order_conflicts():
    # the training loss's shape: 0 widens into buffer c % 2, 1 reads it and writes L[c], 2 reads
    # L[c] and accumulates the row statistics
    def uses(k, c):
        return [(set(), {("w", c % 2)}), ({("w", c % 2)}, {("L", c)}), (set(), {("L", c), "stats"})][k]

    order = [kc for stage in _lm_head._stage_order(_sweep(4, uses, [])) for kc in stage]
    preds = _lm_head._conflicts(uses, 4, 3, order)
    pos = {kc: i for i, kc in enumerate(order)}
    edges = {(order[j], order[i]) for i, p in enumerate(preds) for j in p}
    assert ((1, 0), (0, 2)) in edges  # chunk 2 widens into the buffer chunk 0's logits read
    assert ((2, 0), (2, 1)) in edges  # the running statistics in chunk order
    assert ((0, 1), (1, 1)) in edges and ((1, 1), (2, 1)) in edges  # each chunk's steps in order
    assert ((1, 0), (1, 1)) not in edges  # two chunks' logits are independent
    assert all(pos[a] < pos[b] for a, b in edges)
    log = []
    _lm_head.sweep(_sweep(4, uses, log), "blas")
    assert sorted(log) == sorted(pos)


def test_a_stage_order_that_reverses_a_conflict_is_refused():
    # step 0 of chunk c + 1 overwrites what step 2 of chunk c reads: the stages would run them the
    # other way round (stage c + 1 before stage c + 2)
    def uses(k, c):
        return [(set(), {"shared"}), (set(), set()), ({"shared"}, set())][k]

    log = []
    with pytest.raises(ValueError, match="depends on"):
        _lm_head.sweep(_sweep(3, uses, log), "blas")
    assert log == []


# -- the training loss under random schedules


def _random_graph(seed):
    rng = random.Random(seed)
    seen = []

    def run_graph(groups, preds, engine="blas"):
        seen.append(len(groups))
        done, pending = set(), list(range(len(groups)))
        while pending:
            ready = [g for g in pending if preds[g] <= done]
            g = rng.choice(ready)
            tasks = list(groups[g])
            rng.shuffle(tasks)
            for t in tasks:
                t()
            done.add(g)
            pending.remove(g)

    return run_graph, seen


FEATURES = {
    "plain": {},
    "bias": {"bias": True},
    "features": {"softcap": 20.0, "label_smoothing": 0.1, "lse_square_scale": 1e-3, "ce_weight": True},
    "entropy": {"return_entropy": True, "grad_entropy": 0.3},
}


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    BT, H, V = 45, 40, 900
    x = (rng.standard_normal((BT, H)) * 0.7).astype(dtype)
    w = (rng.standard_normal((V, H)) * 0.2).astype(dtype)
    t = rng.integers(0, V, BT)
    t[::6] = -100
    return x, w, t


def _call(dtype, feats, grads, seed_inputs=0):
    x, w, t = _inputs(dtype, seed_inputs)
    V = w.shape[0]
    rng = np.random.default_rng(seed_inputs + 1)
    kw = {k: v for k, v in feats.items() if k not in ("bias", "ce_weight")}
    if feats.get("bias"):
        kw["bias"] = (rng.standard_normal(V) * 0.1).astype(dtype)
    if feats.get("ce_weight"):
        kw["ce_weight"] = rng.uniform(0.5, 1.5, V)
    g = (grads[0], grads[1], grads[2] and "bias" in kw)
    with workspace_budget(30_000):  # several row blocks
        return fg.linear_cross_entropy(x, w, t, return_grad=g, **kw)


@pytest.mark.parametrize("feat", list(FEATURES))
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grads", [(True, True, True), (False, True, False), (True, False, True)])
@pytest.mark.parametrize("sums", ["in_blas", "scratch"])
def test_any_schedule_the_graph_allows_gives_the_chunk_order_bits(feat, dtype, grads, sums, monkeypatch):
    # "scratch": a BLAS without the in-call sum (MKL, Accelerate): the tiles' scratch products,
    # shared by the chunks (declared as a resource of their steps)
    if sums == "scratch":
        monkeypatch.setattr(_gemm, "blas_accumulates", lambda dtype: False)
    elif not _gemm.blas_accumulates(np.float32):
        pytest.skip("NumPy's BLAS is not OpenBLAS: no in-call sums to schedule")
    monkeypatch.setattr(op, "V_CHUNK", 128)  # several chunks: both widening buffers reused
    monkeypatch.setattr(op, "STAGED", False)
    ref = _call(dtype, FEATURES[feat], grads)
    monkeypatch.setattr(op, "STAGED", True)
    for seed in range(3):
        rg, seen = _random_graph(seed)
        monkeypatch.setattr(_lm_head, "run_graph", rg)
        r = _call(dtype, FEATURES[feat], grads)
        assert r.plan.staged_statistics and r.plan.staged_gradient and r.plan.n_blocks > 1
        assert r.plan.accumulate_in_gemm == (sums == "in_blas")
        assert seen and max(seen) > 10  # the sweeps ran as graphs
        for n in ("loss", "lse", "grad_input", "grad_weight", "grad_bias", "entropy"):
            u, v = getattr(r, n, None), getattr(ref, n, None)
            assert (u is None) == (v is None), n
            if u is not None:
                assert np.array_equal(np.asarray(u), np.asarray(v), equal_nan=True), (n, seed)
    # and right: float64 autograd of the plain loss (the two ways of summing differ in last bits)
    if feat == "plain" and all(grads[:2]):
        x, w, t = (torch.tensor(np.asarray(a, np.float64)) for a in _inputs(dtype))
        x.requires_grad_(True)
        w.requires_grad_(True)
        torch.nn.functional.cross_entropy(x @ w.T, t.long()).backward()
        for got, want in ((r.grad_input, x.grad), (r.grad_weight, w.grad)):
            np.testing.assert_allclose(np.asarray(got, np.float64), want.numpy(), atol=2e-6 * want.abs().max().item())


@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1, "softcap": 25.0}, {"bias": True}])
@pytest.mark.parametrize("sums", ["in_blas", "scratch"])
@pytest.mark.parametrize("budget", [20 * 900 * 4, 1 << 20], ids=["row_blocks", "whole_weight"])
def test_the_bf16_logits_kernels_staged_gradient_under_random_schedules(opts, sums, budget, monkeypatch):
    """fastgrad.torch's training loss on bf16 with the logits on the exact-product bf16 kernel
    (its statistics unstaged) stages its gradient sweep: any schedule its graph allows gives the
    chunk-by-chunk bits (several chunks; several row blocks with a chunk's widened weight, or
    one with the whole weight widened), and float64 autograd's loss."""
    from fastgrad.kernels import _bf16dot

    if not _bf16dot.available():
        pytest.skip("no native bf16 kernel on this CPU: the logits run on BLAS (the cases above)")
    import fastgrad.torch  # noqa: F401

    if sums == "scratch":  # the chunks share the tiles' scratch products (declared)
        monkeypatch.setattr(_gemm, "blas_accumulates", lambda dtype: False)
    elif not _gemm.blas_accumulates(np.float32):
        pytest.skip("NumPy's BLAS is not OpenBLAS: no in-call sums to schedule")

    g = torch.Generator().manual_seed(3)
    BT, H, V = 45, 40, 900
    h = torch.randn(BT, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    t = torch.randint(0, V, (BT,), generator=g)
    b = (torch.randn(V, generator=g) * 0.1).bfloat16() if opts.get("bias") else None
    kw = {k: v for k, v in opts.items() if k != "bias"}
    calls = []
    real_nt = _bf16dot.matmul_nt
    monkeypatch.setattr(_bf16dot, "matmul_nt", lambda *a, **k: (calls.append(1), real_nt(*a, **k))[1])

    def run():
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        bb = None if b is None else b.detach().requires_grad_()
        loss = fg.torch.linear_cross_entropy(hh, ww, t, bias=bb, **kw)
        loss.backward()
        grads = [hh.grad, ww.grad] + ([] if bb is None else [bb.grad])
        return [loss.detach().float().numpy().reshape(1)] + [x.float().numpy() for x in grads]

    monkeypatch.setattr(op, "V_CHUNK", 128)
    with workspace_budget(budget):
        monkeypatch.setattr(op, "STAGED", False)
        ref = run()
        assert calls  # the logits ran on the bf16 kernel
        monkeypatch.setattr(op, "STAGED", True)
        for seed in range(3):
            rg, seen = _random_graph(seed)
            monkeypatch.setattr(_lm_head, "run_graph", rg)
            got = run()
            assert seen and max(seen) > 10  # the gradient sweeps ran as graphs
            for u, v in zip(got, ref):
                assert np.array_equal(u.view(np.uint32), v.view(np.uint32)), seed
    if not opts:
        z = h.double() @ w.double().T
        want = torch.nn.functional.cross_entropy(z, t).item()
        assert abs(float(ref[0][0]) - want) <= 1e-6 * abs(want)


def test_a_missing_declaration_is_caught_by_the_random_schedules(monkeypatch):
    """The check above can fail: with the statistics' step declared as touching nothing, some
    schedule runs a chunk's statistics before its logits, and the bits differ."""
    from fastgrad.lm_head.epilogues import train_rows as K

    real = K._RowStep._stats_uses
    monkeypatch.setattr(K._RowStep, "_stats_uses", lambda self, k, c: (set(), set()) if k == 2 else real(self, k, c))
    monkeypatch.setattr(op, "V_CHUNK", 128)
    monkeypatch.setattr(op, "STAGED", False)
    ref = _call(np.float32, {}, (True, True, False))
    monkeypatch.setattr(op, "STAGED", True)
    differs = False
    for seed in range(3):
        monkeypatch.setattr(_lm_head, "run_graph", _random_graph(seed)[0])
        r = _call(np.float32, {}, (True, True, False))
        differs |= not np.array_equal(r.lse, ref.lse, equal_nan=True)
    assert differs


# -- accumulate / IN_BLAS


def _layouts(a):
    yield a
    yield np.asfortranarray(a)
    big = np.zeros((a.shape[0] + 3, a.shape[1] + 5), a.dtype)
    big[1 : 1 + a.shape[0], 2 : 2 + a.shape[1]] = a
    yield big[1 : 1 + a.shape[0], 2 : 2 + a.shape[1]]  # a strided view (ld > columns)
    yield big.T[2 : 2 + a.shape[1], 1 : 1 + a.shape[0]].T  # the same through a transpose
    yield np.repeat(a, 2, axis=1)[:, ::2]  # a layout no cblas call takes: the fallback


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("M,K,N", [(7, 5, 3), (1, 4, 6), (5, 1, 2), (3, 6, 1), (33, 17, 40), (4, 0, 3)])
def test_accumulate_adds_the_product_for_every_layout(dtype, M, K, N):
    rng = np.random.default_rng(M * 100 + K * 10 + N)
    A = rng.standard_normal((M, K)).astype(dtype)
    B = rng.standard_normal((K, N)).astype(dtype)
    C0 = rng.standard_normal((M, N)).astype(dtype)
    want = C0.astype(np.float64) + A.astype(np.float64) @ B.astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for a in _layouts(A):
        for b in _layouts(B):
            c = C0.copy()
            a0, b0 = a.copy(), b.copy()
            _gemm.accumulate(a, b, c)
            np.testing.assert_allclose(c, want, rtol=tol, atol=tol * (1 + K))
            assert np.array_equal(a, a0) and np.array_equal(b, b0)  # inputs untouched


def test_accumulate_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="do not give"):
        _gemm.accumulate(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32), np.zeros((2, 5), np.float32))


def test_in_blas_is_found_for_numpys_openblas_and_sums_in_the_call(monkeypatch):
    import threadpoolctl

    blas = [c for c in threadpoolctl.ThreadpoolController().lib_controllers if c.user_api == "blas"]
    openblas = [c for c in blas if c.internal_api == "openblas"]
    assert _gemm.blas_accumulates(np.float32) == _gemm.blas_accumulates(np.float64)
    assert not _gemm.blas_accumulates(np.int32)
    if not openblas:  # another BLAS: the tiles keep their scratch product
        assert not _gemm.blas_accumulates(np.float32)
        return
    assert _gemm.blas_accumulates(np.float32)
    # the tile task with IN_BLAS calls the BLAS once (no np.matmul, no scratch)
    calls = []
    monkeypatch.setattr(_gemm, "mm", lambda *a, **k: calls.append(a))
    A = np.ones((4, 3), np.float32)
    out = np.full((4, 2), 2.0, np.float32)
    for t in _gemm.nn_tasks(A, np.ones((3, 2), np.float32), out, _gemm.IN_BLAS):
        t()
    assert calls == [] and np.array_equal(out, np.full((4, 2), 5.0, np.float32))


def test_the_training_plan_sums_in_the_call_where_the_blas_can():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 24)).astype(BF16)
    w = rng.standard_normal((700, 24)).astype(BF16)
    t = rng.integers(0, 700, 40)
    with workspace_budget(20_000):
        r = fg.linear_cross_entropy(x, w, t, return_grad=True)
    assert r.plan.n_blocks > 1
    names = {b.name for b in r.plan.buffers}
    if _gemm.blas_accumulates(np.float32) and fg.gemm_engine() in ("auto", "blas"):
        assert r.plan.accumulate_in_gemm
        assert not names & {"grad_input_product", "grad_weight_product"}
