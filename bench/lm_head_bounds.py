"""The LM-head loss and the FLCE grad against both GEMM bounds and PyTorch's paths, in one process.

Interleaved rounds (each row once per round, the order reversed every other round), best and
median of each row; ratios against the three fp32 sgemms (NumPy's BLAS), the three bf16 GEMMs
(PyTorch's oneDNN ``torch.mm`` of bf16 tensors, output rounded to bf16: the bf16 units' rate),
and PyTorch's eager paths — all measured in the same run.  Issue 43's table::

    python bench/lm_head_bounds.py --rounds 5                 # the Qwen2.5-0.5B head + the FLCE grad
    python bench/lm_head_bounds.py --rounds 3 --threads 1     # one core

The CPU is named from ``lscpu``'s model and flags (``fastgrad.benchmarks.machine``).  Peak memory
is not measured here (``fastgrad bench`` rows have it).  Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _cpu() -> str:
    try:
        from fastgrad.benchmarks.machine import machine_info

        m = machine_info()
        return f"{m.get('cpu', '?')}, {m.get('cpus_logical', '?')} cpus, {'/'.join(m.get('simd', []))}"
    except Exception:  # noqa: BLE001 - informational
        import platform

        return platform.processor() or "unknown CPU"


def _bounds(h, w) -> dict:
    """The step's three GEMMs on bf16 ``h`` [BT, H] and ``w`` [V, H] (torch tensors) and a random
    ``g`` [BT, V]: as fp32 sgemms (NumPy's BLAS, preallocated outputs) and as bf16 oneDNN GEMMs."""
    import torch

    BT, H = h.shape
    V = w.shape[0]
    gt = torch.randn(BT, V, generator=torch.Generator().manual_seed(1)).bfloat16()
    h32, w32, g32 = h.float().numpy(), w.float().numpy(), gt.float().numpy()
    L = np.empty((BT, V), np.float32)
    A = np.empty((BT, H), np.float32)
    B = np.empty((V, H), np.float32)

    def sgemm3():
        np.matmul(h32, w32.T, out=L)
        np.matmul(g32, w32, out=A)
        np.matmul(g32.T, h32, out=B)

    def bf16x3():
        h @ w.T
        gt @ w
        gt.T @ h

    return {"3 fp32 sgemm": sgemm3, "3 bf16 GEMMs (oneDNN)": bf16x3}


def _train_rows(BT: int, H: int, V: int) -> dict:
    import torch
    import torch.nn.functional as F

    from fastgrad.torch import linear_cross_entropy as lce

    g = torch.Generator().manual_seed(0)
    h = torch.randn(BT, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    t = torch.randint(0, V, (BT,), generator=g)

    def step(**kw):
        def run():
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
            loss = lce(hh, ww, t, **kw)
            loss.backward()

        return run

    def eager(dt):
        def run():
            hh = h.detach().to(dt).requires_grad_()
            ww = w.detach().to(dt).requires_grad_()
            F.cross_entropy(hh @ ww.T, t).backward()

        return run

    return {
        "fastgrad (default)": step(),
        "fastgrad fast": step(precision="fast"),
        "torch bf16 eager": eager(torch.bfloat16),
        "torch fp32 eager": eager(torch.float32),
        **_bounds(h, w),
    }


def _flce_rows(BT: int, H: int, V: int) -> dict:
    import ml_dtypes
    import torch

    import fastgrad as fg

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BT, H)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((V, H)) / H**0.5).astype(ml_dtypes.bfloat16)
    t = rng.integers(0, V, BT)
    mask = np.zeros((BT + 7) // 8, np.uint8)
    grad = np.full(BT, 1.0 / BT, np.float32)
    s = fg.fused_linear_online_max_sum(x, w, t, 0, V)
    m, e = np.asarray(s[0], np.float32), np.asarray(s[1], np.float32)
    gi = np.empty((BT, H), x.dtype)
    gw = np.empty((V, H), x.dtype)

    def flce():
        fg.fused_linear_cross_entropy_loss_grad(grad, x, w, mask, t, logits_max=m, sum_exp_logits=e, out=(gi, gw))

    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    wt = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    return {"fastgrad FLCE grad": flce, **_bounds(xt, wt)}


def interleaved(rows: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each row: a warm-up call each, then ``rounds`` interleaved rounds."""
    for f in rows.values():
        f()
    names = list(rows)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            rows[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def report(title: str, times: dict[str, list[float]], first: str) -> dict:
    best = {n: min(v) for n, v in times.items()}
    med = {n: statistics.median(v) for n, v in times.items()}
    print(f"\n{title}")
    print(f"{'row':26s} {'best s':>8s} {'median s':>9s} {'÷ sgemm':>8s} {'÷ bf16x3':>9s} {first + ' ÷ row':>14s}")
    for n in times:
        print(
            f"{n:26s} {best[n]:8.3f} {med[n]:9.3f} {best[n] / best['3 fp32 sgemm']:8.2f} "
            f"{best[n] / best['3 bf16 GEMMs (oneDNN)']:9.2f} {best[first] / best[n]:14.2f}"
        )
    return {"best_s": best, "median_s": med, "samples_s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: all cores")
    ap.add_argument("--shape", default="2048,896,151936", help="the train step's BT,H,V")
    ap.add_argument("--flce-shape", default="1024,896,32000", help="the FLCE grad's BT,H,V")
    ap.add_argument("--json", default="", help="write the figures here")
    a = ap.parse_args()
    import torch

    import fastgrad as fg

    if a.threads:
        torch.set_num_threads(a.threads)
        fg.set_num_threads(a.threads)
    from threadpoolctl import threadpool_limits

    out = {"cpu": _cpu(), "threads": a.threads or fg.get_num_threads(), "torch": torch.__version__}
    print(f"CPU: {out['cpu']}; threads {out['threads']}; torch {torch.__version__}")
    with threadpool_limits(a.threads or None):
        BT, H, V = (int(v) for v in a.flce_shape.split(","))
        out["flce_grad"] = report(
            f"FLCE grad bf16 ({BT}, {H}, {V})", interleaved(_flce_rows(BT, H, V), a.rounds), "fastgrad FLCE grad"
        )
        BT, H, V = (int(v) for v in a.shape.split(","))
        out["train_step"] = report(
            f"train step bf16 (BT {BT}, H {H}, V {V}), mean loss fwd+bwd",
            interleaved(_train_rows(BT, H, V), a.rounds),
            "fastgrad (default)",
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
