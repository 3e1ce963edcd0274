"""Thread scaling of the FLCE grad and the train step against the sgemm bound and PyTorch, one run per table.

For each thread count (fastgrad's pool, PyTorch's intra-op threads and NumPy's BLAS all set to it),
the rows of ``bench/lm_head_bounds.py`` are timed in interleaved rounds (best of each); every ratio
in a column comes from the same thread count of the same run.  Issue 43's "every core" table::

    python bench/thread_scaling.py --threads 1,2,4,8,16 --json bench/results/scaling.json

The FLCE grad table adds PyTorch's fp32 eager of the same three GEMMs and softmax grad (no loss
reduction); the train step table the step rows of ``lm_head_bounds`` (at ``--step-shape``, smaller
than the Qwen2.5 head by default, so that one thread fits a run).  Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lm_head_bounds as lb  # noqa: E402


def _flce_torch_fp32(BT: int, H: int, V: int):
    """PyTorch fp32 eager of the FLCE grad's work: logits, softmax grad, ``G·W`` and ``Gᵀ·X``."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(BT, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    t = torch.randint(0, V, (BT,), generator=g)

    def run():
        xf, wf = x.float(), w.float()
        p = torch.softmax(xf @ wf.T, dim=1)
        p[torch.arange(BT), t] -= 1.0
        p.mul_(1.0 / BT)
        (p @ wf).bfloat16()
        (p.T @ xf).bfloat16()

    return run


def _grid_sgemm3(BT: int, H: int, V: int):
    """The three fp32 GEMMs on fastgrad's fixed tile grid (``kernels/_gemm``: single-threaded BLAS
    tiles of ≤ 512 × 512 on the pool) — what the grid alone costs against one multi-threaded sgemm."""
    import numpy as np

    from fastgrad.kernels import _gemm

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BT, H), np.float32)
    w = rng.standard_normal((V, H), np.float32)
    g = rng.standard_normal((BT, V), np.float32)
    L, A, B = np.empty((BT, V), np.float32), np.empty((BT, H), np.float32), np.empty((V, H), np.float32)

    def run():
        with _gemm.single_threaded_blas():
            _gemm.matmul_nt(x, w, L)
            _gemm.matmul_nn(g, w, A)
            _gemm.matmul_tn(g, x, B)

    return run


def _old_grid(fn):
    """``fn`` with the plans' ``grad_input`` grid as it was before ``tiling.grad_input_tile``
    (1024 x 512 for the training loss, 512 x 512 for the FLCE grad): the same bits, fewer tasks."""
    from dataclasses import replace

    from fastgrad import tiling

    def run():
        pt, pl = tiling.plan_training_loss, tiling.plan_linear_cross_entropy
        tiling.plan_training_loss = lambda *a, **k: replace(pt(*a, **k), grad_input_tile=(1024, 512))
        tiling.plan_linear_cross_entropy = lambda *a, **k: replace(pl(*a, **k), grad_input_tile=(512, 512))
        try:
            fn()
        finally:
            tiling.plan_training_loss, tiling.plan_linear_cross_entropy = pt, pl

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flce-shape", default="1024,896,32000")
    ap.add_argument("--step-shape", default="2048,896,32000", help="'' to skip the step table")
    ap.add_argument("--step-threads", default="", help="the step table's thread counts (default: --threads)")
    ap.add_argument("--old-grid", action="store_true", help="add the rows on the old grad_input grid")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    import torch
    from threadpoolctl import threadpool_limits

    import fastgrad as fg

    counts = [int(t) for t in a.threads.split(",")]
    out: dict = {"cpu": lb._cpu(), "torch": torch.__version__, "numpy_blas": _blas(), "flce_grad": {}, "train_step": {}}
    print(f"CPU: {out['cpu']}; torch {out['torch']}; BLAS {out['numpy_blas']}", flush=True)
    fshape = tuple(int(v) for v in a.flce_shape.split(","))
    frows = {
        **lb._flce_rows(*fshape),
        "torch fp32 eager": _flce_torch_fp32(*fshape),
        "3 sgemm, fastgrad grid": _grid_sgemm3(*fshape),
    }
    srows = lb._train_rows(*(int(v) for v in a.step_shape.split(","))) if a.step_shape else {}
    if a.old_grid:
        frows["fastgrad FLCE grad, old grid"] = _old_grid(frows["fastgrad FLCE grad"])
        if srows:
            srows["fastgrad (default), old grid"] = _old_grid(srows["fastgrad (default)"])
    for n in counts:
        torch.set_num_threads(n)
        fg.set_num_threads(n)
        with threadpool_limits(n):
            out["flce_grad"][n] = lb.report(
                f"FLCE grad bf16 {fshape}, {n} threads", lb.interleaved(frows, a.rounds), "fastgrad FLCE grad"
            )
            if srows and (not a.step_threads or str(n) in a.step_threads.split(",")):
                out["train_step"][n] = lb.report(
                    f"train step bf16 {a.step_shape}, {n} threads",
                    lb.interleaved(srows, a.rounds),
                    "fastgrad (default)",
                )
        sys.stdout.flush()
    for table, first in (("flce_grad", "fastgrad FLCE grad"), ("train_step", "fastgrad (default)")):
        if out[table]:
            print(f"\n{table}: fastgrad ÷ 3 fp32 sgemm by threads")
            for n, r in out[table].items():
                b = r["best_s"]
                print(f"  {n:3d}  {b[first]:.3f} s  ÷ bound {b[first] / b['3 fp32 sgemm']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


def _blas() -> str:
    try:
        from threadpoolctl import threadpool_info

        info = threadpool_info()
        return "; ".join(f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')}" for i in info)
    except Exception:  # noqa: BLE001 - informational
        return "?"


if __name__ == "__main__":
    main()
