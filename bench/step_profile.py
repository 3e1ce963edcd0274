"""Where a train step's time goes on many cores: the pool's busy time by kind of task.

Runs the training loss (fastgrad.torch, bf16, forward + backward of the mean loss) and records,
per pool task, its thread and duration: the GEMM tiles (``kernels/_gemm._mm_into``) and everything
else on the pool (the element-wise passes, widening, packing).  Prints the wall time, the GEMM
tiles' and the passes' busy thread-seconds, and the utilization ``busy / (wall · threads)``.  A
diagnostic (the recording adds a few microseconds per task), not a benchmark::

    python bench/step_profile.py --threads 16 --shape 2048,896,151936 --budget-mb 256,1024
"""

from __future__ import annotations

import argparse
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--shape", default="2048,896,151936")
    ap.add_argument("--budget-mb", default="256", help="workspace budgets to run, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gi-tasks", default="", help="tiling.TRAIN_GRAD_INPUT_TASKS values to run (default: the plan's)")
    a = ap.parse_args()
    import torch

    import fastgrad as fg
    from fastgrad.kernels import _gemm
    from fastgrad.torch import linear_cross_entropy as lce

    n = a.threads or fg.get_num_threads()
    fg.set_num_threads(n)
    torch.set_num_threads(n)
    BT, H, V = (int(v) for v in a.shape.split(","))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(BT, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    t = torch.randint(0, V, (BT,), generator=g)
    lock = threading.Lock()
    busy = {"gemm": 0.0, "tasks": 0.0}
    count = {"gemm": 0, "tasks": 0}
    real_mm, real_run, real_graph = _gemm._mm_into, _gemm._run, _gemm.run_graph

    def mm_into(*args, **kw):
        t0 = time.perf_counter()
        try:
            return real_mm(*args, **kw)
        finally:
            with lock:
                busy["gemm"] += time.perf_counter() - t0
                count["gemm"] += 1

    def timed(task):
        def run():
            t0 = time.perf_counter()
            try:
                return task()
            finally:
                with lock:
                    busy["tasks"] += time.perf_counter() - t0
                    count["tasks"] += 1

        return run

    def run(tasks, engine="blas"):
        return real_run([timed(x) for x in tasks], engine)

    def graph(groups, preds, engine="blas"):
        return real_graph([[timed(x) for x in grp] for grp in groups], preds, engine)

    _gemm._mm_into, _gemm._run, _gemm.run_graph = mm_into, run, graph
    import fastgrad.lm_head.loop as loop

    loop.run_graph = graph
    loop.run_tasks = lambda tasks, engine="blas": run(tasks, engine)

    def step():
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        lce(hh, ww, t).backward()

    print(f"threads {n}, (BT, H, V) = {(BT, H, V)}")
    from fastgrad import tiling

    gis = a.gi_tasks.split(",") if a.gi_tasks else [""]
    variants = [(int(mb), gi) for mb in a.budget_mb.split(",") for gi in gis]
    for mb, gi in variants:
        if gi:
            tiling.TRAIN_GRAD_INPUT_TASKS = int(gi)
        fg.tiling.set_workspace_budget(mb << 20)
        plan = fg.plan("fused_linear_online_max_sum", BT, V, H)  # (the budget's effect, for the record)
        step()
        best = None
        for _ in range(a.rounds):
            for k in busy:
                busy[k], count[k] = 0.0, 0
            t0 = time.perf_counter()
            step()
            wall = time.perf_counter() - t0
            if best is None or wall < best[0]:
                best = (wall, dict(busy), dict(count))
        wall, b, c = best
        other = b["tasks"] - b["gemm"]  # every pool task, less the GEMM tiles inside them
        print(
            f"budget {mb} MiB, TRAIN_GRAD_INPUT_TASKS {tiling.TRAIN_GRAD_INPUT_TASKS} "
            f"(online max-sum tiles {plan.bt_tile}x{plan.v_tile}): wall {wall:.3f} s; "
            f"GEMM tiles {b['gemm']:.2f} thread-s ({c['gemm']} calls), other pool work {other:.2f} thread-s; "
            f"pool utilization {b['tasks'] / (wall * n):.0%}, GEMM share of wall x threads {b['gemm'] / (wall * n):.0%}"
        )
    fg.tiling.set_workspace_budget(None)


if __name__ == "__main__":
    main()
