"""Vocabulary-parallel linear_cross_entropy over torch.distributed (gloo on loopback).

Worker processes are started with the ``spawn`` method (GNU OpenMP is not fork-safe), rendezvous
through a ``file://`` store in ``tmp_path``, run every configuration of ``CONFIGS`` on their weight
shard and save (loss, grad_hidden, grad_weight shard) with ``torch.save``; the parent compares them
with the single-process run of the same inputs.  World sizes 2 (even and uneven shards) and 3
(``V = 101`` split 34/34/33, plus layouts with a 1-row and an empty shard).

Tolerances: float64 runs the same decomposition in exact-ish arithmetic, so the shard combination
must agree with the single process to ~1e-12.  fp32: the statistics are combined in a different
order (``Σ_k s_k·exp(m_k - gmax)`` vs one online sum) — 1e-5 relative.  bf16: ``grad_input`` is a
sum of per-shard partials each already rounded to bf16 (the op's output), summed in fp32 and
rounded again, so up to ~world_size+1 roundings of the partials' size instead of one; we bound the
difference to the single-process result by (world+1) ulps of the largest partial magnitude
(``|G|·|W|`` of the device golden), and ``grad_weight`` rows (computed entirely on one shard) must
be within 1 ulp + the g-rounding slack of the single-process rows.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402
from fastgrad.torch.distributed import split_vocab  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

IGN = -100
TIMEOUT_S = 150

# (name, dtype, reduction, label_smoothing, shard sizes or None for split_vocab, api)
#   api: "fn" (layout all-gathered), "fn_explicit" (vocab_start_index/vocab_size given),
#        "module" (LinearCrossEntropyLoss, layout cached), "3d" (hidden [2, BT/2, H]),
#        "entropy" (loss - 0.5·entropy at temperature 0.8, softcap 6: the entropy's statistic
#        combined across shards and its gradient)
CONFIGS = {
    2: [
        ("f64_mean", torch.float64, "mean", 0.0, None, "fn"),
        ("f64_ls_sum", torch.float64, "sum", 0.2, [60, 41], "fn"),
        ("f32_mean_ls", torch.float32, "mean", 0.1, None, "module"),
        ("f32_none", torch.float32, "none", 0.0, [10, 91], "3d"),
        ("bf16_mean", torch.bfloat16, "mean", 0.0, None, "fn"),
        ("bf16_sum_ls", torch.bfloat16, "sum", 0.1, None, "fn_explicit"),
        ("f32_none_entropy", torch.float32, "none", 0.0, [10, 91], "entropy"),
        ("f64_mean_entropy", torch.float64, "mean", 0.1, None, "entropy"),
    ],
    3: [
        ("f64_none_ls", torch.float64, "none", 0.1, None, "fn"),
        ("f64_tiny_shards", torch.float64, "mean", 0.3, [1, 0, 100], "fn"),
        ("f32_sum", torch.float32, "sum", 0.0, None, "module"),
        ("f32_ls_tiny", torch.float32, "mean", 0.2, [1, 0, 100], "fn"),
        ("bf16_mean_ls", torch.bfloat16, "mean", 0.1, None, "fn"),
        ("fp16_none", torch.float16, "none", 0.0, None, "3d"),
        ("f64_entropy_tiny", torch.float64, "none", 0.0, [1, 0, 100], "entropy"),
    ],
}
BT, H, V = 24, 16, 101


def _inputs(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(BT, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * (3.0 / H ** 0.5)
    t = torch.randint(0, V, (BT,), generator=g)
    t[::5] = IGN
    # targets in every shard, including the edges of the [34, 34, 33] split
    t[1], t[2], t[3], t[4] = 0, 33, 34, V - 1
    go = torch.rand(BT, generator=g, dtype=torch.float64) + 0.5
    return h.to(dtype), w.to(dtype), t, go


def _shards(world, sizes):
    sizes = sizes or split_vocab(V, world)
    starts = [sum(sizes[:k]) for k in range(world)]
    return sizes, starts


def _loss(h, w, t, reduction, ls, api, group=None, start=None, module=None):
    if api == "3d":
        h, t = h.reshape(2, BT // 2, H), t.reshape(2, BT // 2)
    if api == "module":
        return module(h, w, t)
    if api == "entropy":
        out = ft.linear_cross_entropy(h, w, t, reduction=reduction, label_smoothing=ls, process_group=group,
                                      temperature=0.8, softcap=6.0, return_entropy=True)
        return out.loss - 0.5 * out.entropy
    kw = {}
    if api == "fn_explicit" and group is not None:
        kw = dict(vocab_start_index=start, vocab_size=V)
    return ft.linear_cross_entropy(h, w, t, reduction=reduction, label_smoothing=ls,
                                   process_group=group, **kw)


def _step(h, w, t, go, reduction, ls, api, **kw):
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    loss = _loss(h, w, t, reduction, ls, api, **kw)
    up = go.reshape(loss.shape) if reduction == "none" else go[0]
    loss.backward(up.to(loss.dtype))
    return loss.detach().reshape(-1), h.grad.reshape(BT, H), w.grad


def _worker(rank, world, rdv, outdir):
    torch.set_num_threads(1)
    fg.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        group = dist.group.WORLD
        for i, (name, dtype, red, ls, sizes, api) in enumerate(CONFIGS[world]):
            h, w, t, go = _inputs(dtype, seed=100 + i)
            sizes, starts = _shards(world, sizes)
            shard = w[starts[rank]:starts[rank] + sizes[rank]]
            module = None
            if api == "module":
                module = ft.LinearCrossEntropyLoss(reduction=red, label_smoothing=ls,
                                                   process_group=group)
            res = _step(h, shard, t, go, red, ls, api, group=group, start=starts[rank],
                        module=module)
            if module is not None:   # second call reuses the cached layout (no collective)
                res2 = _step(h, shard, t, go, red, ls, api, group=group, module=module)
                assert all(torch.equal(a, b) for a, b in zip(res, res2))
                assert module._layout == (sizes[rank], starts[rank], V)
            torch.save(res, os.path.join(outdir, f"{name}_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _warm_numba_cache():
    """Compile (and cache on disk) the kernels here so the spawned workers only load them."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        h, w, t, go = _inputs(dtype, 0)
        _step(h, w, t, go, "mean", 0.1, "fn")


def _spawn(world, tmp_path):
    _warm_numba_cache()
    rdv = tmp_path / "rendezvous"
    outdir = tmp_path / "out"
    outdir.mkdir()
    ctx = mp.start_processes(_worker, args=(world, str(rdv), str(outdir)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"{world}-process gloo run did not finish in {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    return outdir


def _check(world, outdir):
    for i, (name, dtype, red, ls, sizes, api) in enumerate(CONFIGS[world]):
        h, w, t, go = _inputs(dtype, seed=100 + i)
        sizes, starts = _shards(world, sizes)
        module = (ft.LinearCrossEntropyLoss(reduction=red, label_smoothing=ls)
                  if api == "module" else None)
        loss1, gh1, gw1 = _step(h, w, t, go, red, ls, api, module=module)
        gw_parts = []
        gh_rank0 = None
        for rank in range(world):
            loss, gh, gw = torch.load(outdir / f"{name}_rank{rank}.pt")
            where = f"{name} rank {rank}/{world}"
            assert gh.dtype == dtype and gw.dtype == dtype, where
            assert gw.shape == (sizes[rank], H), where
            if dtype == torch.float64:
                torch.testing.assert_close(loss, loss1, rtol=1e-12, atol=1e-12, msg=where)
                torch.testing.assert_close(gh, gh1, rtol=1e-10, atol=1e-12, msg=where)
            elif dtype == torch.float32:
                torch.testing.assert_close(loss, loss1, rtol=1e-5, atol=1e-6, msg=where)
                scale = gh1.abs().max().item()
                torch.testing.assert_close(gh, gh1, rtol=1e-5, atol=1e-5 * scale, msg=where)
            else:
                torch.testing.assert_close(loss, loss1, rtol=1e-5, atol=1e-6, msg=where)
                rel = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
                G, x, W = _abs_g(h, w, t, go, red, ls)
                bound = (world + 1) * rel * (G @ W) + rel * gh1.double().abs()
                bad = (gh.double() - gh1.double()).abs() > bound
                assert not bad.any(), f"{where}: grad_hidden off by {(gh - gh1).abs().max()}"
            if gh_rank0 is None:
                gh_rank0 = gh
            else:   # every rank gets the same all-reduced grad_hidden
                assert torch.equal(gh, gh_rank0), where
            gw_parts.append(gw)
        gw = torch.cat(gw_parts)
        if dtype == torch.float64:
            torch.testing.assert_close(gw, gw1, rtol=1e-10, atol=1e-12, msg=name)
        elif dtype == torch.float32:
            scale = gw1.abs().max().item()
            torch.testing.assert_close(gw, gw1, rtol=1e-5, atol=1e-5 * scale, msg=name)
        else:
            rel = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
            G, x, W = _abs_g(h, w, t, go, red, ls)
            # label smoothing on a shard adds a sparse fp32 update after the op's rounding
            bound = 2 * rel * gw1.double().abs() + 2 * rel * (G.T @ x)
            bad = (gw.double() - gw1.double()).abs() > bound
            assert not bad.any(), f"{name}: grad_weight off by {(gw - gw1).abs().max()}"


def _abs_g(h, w, t, go, red, ls):
    """|G| (the logits' gradient magnitude, float64), |x|, |W| for error bounds."""
    x, W = h.double(), w.double()
    p = torch.softmax(x @ W.T, 1)
    valid = t != IGN
    oh = torch.nn.functional.one_hot(torch.where(valid, t, 0), V).double()
    n = int(valid.sum())
    rows = torch.where(valid, go if red == "none" else go[0] / (n if red == "mean" else 1), 0.0)
    G = ((p - (1 - ls) * oh - ls / V) * rows[:, None]).abs()
    return G, x.abs(), W.abs()


def test_split_vocab_and_shard_weight():
    assert split_vocab(101, 3) == [34, 34, 33]
    assert split_vocab(4, 3) == [2, 1, 1]
    assert split_vocab(2, 3) == [1, 1, 0]
    w = torch.arange(101 * 2).reshape(101, 2)
    parts = [ft.shard_weight(w, rank=k, world_size=3) for k in range(3)]
    assert [p.shape[0] for p in parts] == [34, 34, 33]
    assert torch.equal(torch.cat(parts), w)
    with pytest.raises(ValueError):
        split_vocab(5, 0)


def test_single_rank_group_equals_no_group(tmp_path):
    """A 1-process gloo group runs the collective code path; it must equal process_group=None."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv1'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        for dtype in (torch.float32, torch.bfloat16):
            h, w, t, go = _inputs(dtype, 7)
            a = _step(h, w, t, go, "mean", 0.1, "fn", group=dist.group.WORLD)
            b = _step(h, w, t, go, "mean", 0.1, "fn")
            torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=0)
            for x, y in zip(a[1:], b[1:]):   # fp32 all-reduce of one partial: same rounding
                assert torch.equal(x, y)
        assert ft.vocab_shard_range(37, dist.group.WORLD) == (0, 37, 37)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_matches_single_process(world, tmp_path):
    outdir = _spawn(world, tmp_path)
    _check(world, outdir)


def test_torchrun_example_matches_single_process():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(root, "examples", "train_tiny_lm_vocab_parallel.py"), "--steps", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "split [40, 40]" in r.stdout and "-> MATCH" in r.stdout, r.stdout
    assert len([ln for ln in r.stdout.splitlines() if ln.startswith("step ")]) == 3, r.stdout
