"""The train step at the Qwen2.5-0.5B head as an AVX2-only user runs it, on any x86-64 machine.

Run with the settings that give the code an AVX2-only CPU runs (fastgrad's GEMMs on BLAS, OpenBLAS's
Haswell kernel, PyTorch's AVX2 kernels, oneDNN and MKL capped at AVX2):

    FASTGRAD_GEMM=blas OPENBLAS_CORETYPE=Haswell ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/avx2_train_step.py

One process, a warm-up call each, then two interleaved rounds (best of 2); no peak RSS (the
``fastgrad bench`` rows have it).  PyTorch's bf16 eager and F.linear_cross_entropy's default
options are left out: on AVX2 their bf16 GEMMs are emulated (minutes per step).
"""

import time

import numpy as np

from fastgrad.benchmarks import cases as C

CASE = "linear_cross_entropy[train-step]/bf16/BT=2048,H=896,V=151936"
ROWS = ["fastgrad", "fastgrad-fused", "fastgrad-recompute", "torch-fp32", "torch-lce-bcs2048"]


def main(case_id: str = CASE, quick: bool = False, rounds: int = 2) -> dict[str, float]:
    """Best of ``rounds`` seconds per row (printed, and returned by name)."""
    case = C.find_case(case_id, quick)
    inp = case.build()
    by_name = {r.name: r for r in case.runners}
    fns = {n: by_name[n].make(inp) for n in ROWS if n in by_name}
    h = np.asarray(inp["hidden"]).astype(np.float32)  # the case's bf16 operands, widened exactly
    w = np.asarray(inp["weight"]).astype(np.float32)
    BT, H = h.shape
    V = w.shape[0]
    g = np.empty((BT, V), np.float32)
    gi = np.empty((BT, H), np.float32)
    gw = np.empty((V, H), np.float32)

    def bound():
        np.matmul(h, w.T, out=g)
        np.matmul(g, w, out=gi)
        np.matmul(g.T, h, out=gw)

    fns["bound (3 fp32 sgemms)"] = bound
    for f in fns.values():
        f()
    best: dict[str, float] = {}
    for _ in range(rounds):
        for n, f in fns.items():
            t = time.perf_counter()
            f()
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - t)
    for n, v in best.items():
        print(f"{n:24s} {v:7.2f} s")
    return best


if __name__ == "__main__":
    main()
