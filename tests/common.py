"""The dtype names the op test files share, their torch twins, and a small LM-head problem."""

import contextlib
import threading

import ml_dtypes
import numpy as np
import pytest

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = [F32, F16, BF16]


def torch_dt(dtype):
    """The torch dtype of a NumPy dtype (torch is optional: skips the test without it)."""
    torch = pytest.importorskip("torch")
    return {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}[np.dtype(dtype)]


def mean_ce_oracle64(x, w, t, ignore_index=-100):
    """float64 from the contract: the mean cross-entropy of ``x·wᵀ`` over the rows whose target is
    not ``ignore_index``, its gradients ``grad_input``, ``grad_weight``, and the same products of
    ``|G|`` and the operands' magnitudes (error scales): ``(loss, gi, gw, |G|·|W|, |G|ᵀ·|X|)``."""
    X, W = np.asarray(x, np.float64), np.asarray(w, np.float64)
    z = X @ W.T
    m = z.max(1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(1, keepdims=True)))[:, 0]
    valid = t != ignore_index
    n = valid.sum()
    rows = np.flatnonzero(valid)
    loss = (lse[rows] - z[rows, t[rows]]).sum() / n
    G = np.exp(z - lse[:, None])
    G[rows, t[rows]] -= 1
    G = np.where(valid[:, None], G, 0) / n
    return loss, G @ W, G.T @ X, np.abs(G) @ np.abs(W), np.abs(G).T @ np.abs(X)


def lm_head_problem(BT, H, V, seed, dtype=np.float32, ignore_index=-100):
    """``(hidden [BT, H], weight [V, H], bias [V], class weights [V] (float64), target [BT])``:
    logits of a few units, every fourth target (from the second) ignored; 16-bit ``dtype``
    rounds hidden, weight and bias."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((BT, H)) * 1.5).astype(np.float32)
    w = (rng.standard_normal((V, H)) / np.sqrt(H) * 2).astype(np.float32)
    b = (rng.standard_normal(V) * 0.5).astype(np.float32)
    cw = rng.random(V) + 0.5
    t = rng.integers(0, V, BT)
    t[1::4] = ignore_index
    if np.dtype(dtype) != F32:
        x, w, b = x.astype(dtype), w.astype(dtype), b.astype(dtype)
    return x, w, b, cw, t


def sharp_problem(rng, BT, H, V, dtype, sharpness, vocab_used=None):
    """``(hidden [BT, H], weight [V, H], target [BT])`` for gradient filtering: hidden states near
    their target's embedding — ``sharpness`` 0 gives a near-uniform softmax, larger values sharper
    ones (the LLM-like regime the filter is for); targets among the first ``vocab_used`` tokens
    (frequent tokens), so whole column blocks can be negligible."""
    w = rng.standard_normal((V, H)).astype(np.float32) / np.sqrt(H)
    t = rng.integers(0, vocab_used or V, BT)
    x = (w[t] * sharpness * np.sqrt(H) + rng.standard_normal((BT, H)) * 0.3).astype(np.float32)
    return x.astype(dtype), w.astype(dtype), t


def bf16_lm_inputs(BT, H, V, gen, seed=0):
    """bf16 ``(hidden [BT, H], weight [V, H], target [BT])`` for the accuracy targets of the
    training loss: ``"rand"`` (all positive, |logits| ~ H/4: sharply peaked, cancelling row
    sums), ``"rand-small"``, ``"randn"`` (logits of a few units), ``"randn-big"`` (|logits| ~ 30),
    ``"offset"`` (hidden states and weights with a non-zero mean)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    if gen == "rand":
        h, w = torch.rand(BT, H, generator=g), torch.rand(V, H, generator=g)
    elif gen == "rand-small":
        h, w = torch.rand(BT, H, generator=g) * 0.2, torch.rand(V, H, generator=g) * 0.2
    elif gen == "randn":
        h, w = torch.randn(BT, H, generator=g), torch.randn(V, H, generator=g) * (3 / H**0.5)
    elif gen == "randn-big":
        h, w = torch.randn(BT, H, generator=g), torch.randn(V, H, generator=g) * (30 / H**0.5)
    else:
        h = torch.randn(BT, H, generator=g) + 1.0
        w = torch.randn(V, H, generator=g) / H**0.5 + 0.05
    t = torch.randint(0, V, (BT,), generator=g)
    return h.to(torch.bfloat16), w.to(torch.bfloat16), t


def grads_in(h, w, fn, dtype):
    """``(hidden.grad, weight.grad)`` of ``fn(hidden, weight).backward()`` computed in ``dtype``."""
    hh = h.detach().to(dtype).requires_grad_()
    ww = w.detach().to(dtype).requires_grad_()
    fn(hh, ww).backward()
    return hh.grad, ww.grad


def bf16_grad_errors(h, w, t, losses):
    """Mean abs error against float64 autograd on the same bf16 inputs of grad_input /
    grad_weight, for each loss of ``losses`` (``{name: fn(hidden, weight)}`` run in bf16), for
    PyTorch computing in fp32 on the bf16 parameters (rounded once at the end, ``"torch-fp32"``)
    and for pure-bf16 autograd (``"torch-bf16"``)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    ce = lambda a, b: F.cross_entropy(a @ b.T, t)  # noqa: E731
    ref = grads_in(h, w, ce, torch.float64)
    res = {k: grads_in(h, w, fn, torch.bfloat16) for k, fn in losses.items()}
    res["torch-fp32"] = tuple(g.to(torch.bfloat16) for g in grads_in(h, w, ce, torch.float32))
    res["torch-bf16"] = grads_in(h, w, ce, torch.bfloat16)
    return {k: [(g.double() - r).abs().mean().item() for g, r in zip(v, ref)] for k, v in res.items()}


def assert_gemm_kernel_invariant(run, xp, bp):
    """An exact-product kernel's GEMM (``fastgrad/kernels/_bf16dot.py``): ``run()`` (the output
    [M ≥ 300, N ≥ 1088] over the GEMM pool) equals the same operands ``xp``, ``bp`` computed tile
    by tile over an irregular grid, and ``run()`` at one thread, bitwise.  Returns the output."""
    import numba

    from fastgrad.kernels import _bf16dot

    full = run()
    m, n = full.shape
    part = np.empty_like(full)
    for r0, r1 in ((0, 7), (7, 300), (300, m)):
        for c0, c1 in ((0, 64), (64, 1088), (1088, n)):
            _bf16dot.gemm_tile(
                xp[r0:r1], bp, c0, c1, part[r0:r1, c0:c1], spec=kspec("bf16" if bp.dtype == np.uint32 else "f32")
            )
    assert np.array_equal(full.view(np.uint32), part.view(np.uint32))
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run()
    finally:
        numba.set_num_threads(old)
    assert np.array_equal(full.view(np.uint32), one.view(np.uint32))
    return full


def count_kernel_calls(monkeypatch) -> list:
    """A list that receives the ``A`` operand's dtype of every tile the exact-product kernels
    (``fastgrad/kernels/_bf16dot.py``: ``gemm_tile``) compute from now on (uint32: bf16, float32: fp32)."""
    from fastgrad.kernels import _bf16dot

    calls = []
    real = _bf16dot.gemm_tile
    monkeypatch.setattr(_bf16dot, "gemm_tile", lambda *a, **k: (calls.append(a[0].dtype), real(*a, **k))[1])
    return calls


@contextlib.contextmanager
def workspace_budget(nbytes):
    """The process's workspace budget set to ``nbytes`` for the block, and the setting it had
    (an override or none) restored afterwards, also when the block fails."""
    from fastgrad import _config

    old = _config.workspace_budget_override()
    _config.set_workspace_budget(nbytes)
    try:
        yield
    finally:
        _config.set_workspace_budget(old)


def record_calls(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name`` (monkeypatched) so that each call appends ``(args, kwargs, result)`` to
    the returned list, then returns the result."""
    real = getattr(owner, name)
    seen: list = []

    def spy(*a, **kw):
        r = real(*a, **kw)
        seen.append((a, kw, r))
        return r

    monkeypatch.setattr(owner, name, spy)
    return seen


def flce_grad_on_and_off_kernel(monkeypatch, x, w, t, masked, grad, budget=None):
    """The NumPy-level FLCE grad of 16-bit operands on "auto" (its GEMMs on an exact-product
    kernel: asserted), at one thread (bitwise the same: asserted), and on "blas" (the kernel
    not called: asserted); the first checked against the float64 oracle of tests/naive.py.
    Returns (on the kernel, on BLAS)."""
    from flce_helpers import stats64
    from naive import check_fused_linear_cross_entropy_loss_grad

    import fastgrad as fg

    mask = np.packbits(masked, bitorder="little")
    m, s = stats64(x, w)

    def flce():
        return fg.fused_linear_cross_entropy_loss_grad(grad, x, w, mask, t, logits_max=m, sum_exp_logits=s)

    calls = count_kernel_calls(monkeypatch)
    with workspace_budget(budget):
        got = flce()
        assert calls, "the kernel did not run"
        with fg.num_threads(1):
            one = flce()
        calls.clear()
        with fg.gemm("blas"):
            ref = flce()
        assert not calls
    check_fused_linear_cross_entropy_loss_grad(got, grad, x, w, mask, t, logits_max=m, sum_exp_logits=s)
    for a, b in zip(got, one):
        assert a.dtype == x.dtype
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))  # any thread count
    return got, ref


def native_isas() -> list[str]:
    """The native GEMM kernel's ISA settings (``fastgrad.set_native_isa``) that run on this
    machine: ``"avx512"`` with AVX-512F, ``"avx2"`` with AVX2 + FMA (``["auto"]`` where neither:
    the kernel tests then skip).  The kernel tests run once per entry."""
    from fastgrad import _cpu

    isas = (["avx512"] if _cpu.has("avx512f") else []) + (["avx2"] if _cpu.has("avx2", "fma") else [])
    return isas or ["auto"]


def set_isa(name):
    """The native ISA setting ``name`` (None: back to the default) for the ops (the settings); a
    test calling the kernel module itself passes :func:`kspec` (the kernels keep no setting)."""
    from fastgrad import _config

    _config.set_native_isa(name)


def kspec(kind="bf16"):
    """The native variant for operand ``kind`` under the ISA setting in force (what the op layer's
    plan would name: ``_bf16dot.variant``), for tests calling ``_bf16dot``'s GEMMs directly."""
    from fastgrad import _config
    from fastgrad.kernels import _bf16dot

    return _bf16dot.variant(kind, _config.native_isa())


def kform(kind="bf16"):
    """The ``A`` form :func:`kspec`'s variant prefers (``"pairs"`` / ``"f32"``), or None."""
    spec = kspec(kind)
    return None if spec is None else spec.a_forms[0]


@pytest.fixture(params=native_isas())
def native_isa(request):
    """Run the test under each ISA setting of :func:`native_isas` (restored afterwards)."""
    set_isa(request.param)
    try:
        yield request.param
    finally:
        set_isa(None)


def least_peak(call, n: int = 3) -> int:
    """The least, over ``n`` calls, of the memory ``call()`` allocated at its peak (``tracemalloc``:
    NumPy reports its data buffers); the least, since another thread's allocations only add."""
    import tracemalloc

    peaks = []
    for _ in range(n):
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            call()
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
        finally:
            tracemalloc.stop()
    return min(peaks)


def warm_calls() -> int:
    """Untimed calls before a measured one: enough for every pool thread to have taken a task
    (each pool thread's kept scratch, ``_bf16dot._local``, is made the first time it takes one)."""
    import numba

    return 2 + 2 * numba.get_num_threads()


def native_transients() -> int:
    """The native GEMM kernel's own buffers of the tasks in flight (not a loop's, not listed in a
    plan): its column-edge tile of ≤ 512 rows × 64 fp32 (and an odd K's last column), per pool
    thread."""
    import numba

    return numba.get_num_threads() * 2 * 512 * 64 * 4


def training_logits(h, w, bias, softcap, temperature):
    """The training loss's logits from its contract, on torch tensors (an oracle's, float64):
    ``softcap·tanh((h·wᵀ + bias)/softcap) / temperature`` (no softcap: ``(h·wᵀ + bias)/T``)."""
    import torch

    z = h @ w.T
    if bias is not None:
        z = z + bias
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def two_threads_overlapping(block_a, block_b, read):
    """Thread A enters ``block_a``, thread B enters ``block_b``, A leaves while B is inside, then
    B leaves; ``read()`` is sampled after each step (the blocks' order of leaving is not their
    order of entering: the case two training threads give)."""
    seen = {}
    a_in, b_in, a_out, b_out = (threading.Event() for _ in range(4))

    def a():
        with block_a:
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with block_b:
            b_in.set()
            a_out.wait(10)
            seen["B inside, A left"] = read()
        b_out.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert a_out.is_set() and b_out.is_set()
    seen["both left"] = read()
    return seen
