"""What the LM-head schedule allows on many cores, measured on one: a trace and a list-scheduling model.

The call runs once on **one thread**, every pool task timed where it runs (``kernels/_gemm._run``'s
task lists and ``run_graph``'s dependency graphs, with their edges); the time between them on the
calling thread is serial.  The model then schedules the same tasks on ``T`` workers exactly as the
pool hands them out (a task list: first come, first served, one barrier; a graph: the lowest ready
group first, no barrier) and prints, per ``T``, the modelled wall time, the schedule's efficiency
``work / (T · wall)`` and the phases (by call site) that lose the most thread-time.  What it leaves
out — memory bandwidth shared by the cores, the pool's wake-up latency beyond ``--overhead-us`` per
task, a task's own nested parallel calls (counted as serial inside it), Numba ``parallel=True``
kernels on the calling thread (counted as serial) — only makes the real machine slower, so the
figure is an upper bound on what this schedule can reach, and a phase it flags is a real limit::

    python bench/schedule_model.py --what step-fast,step,flce --threads 2,4,8,16

Not a benchmark (one thread, one run): a diagnostic of the schedule's parallelism.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Trace:
    """Records the calling thread's serial time and each pool phase's task durations."""

    def __init__(self) -> None:
        self.events: list[tuple] = []  # ("serial", s) | ("tasks", site, [s]) | ("graph", site, [[s]], preds)
        self.depth = 0
        self.mark = time.perf_counter()

    def _close_serial(self) -> None:
        now = time.perf_counter()
        self.events.append(("serial", now - self.mark))

    @staticmethod
    def _site() -> str:
        """The nearest two callers outside the pool module: where the phase was made."""
        f = sys._getframe(2)
        names: list[str] = []
        while f is not None and len(names) < 2:
            fn = f.f_code.co_filename
            if "_gemm.py" not in fn and "schedule_model" not in fn:
                names.append(f"{os.path.basename(fn)[:-3]}.{f.f_code.co_name}")
            f = f.f_back
        return " < ".join(names)

    def _timed(self, tasks) -> list[float]:
        out = []
        self.depth += 1
        try:
            for t in tasks:
                t0 = time.perf_counter()
                t()
                out.append(time.perf_counter() - t0)
        finally:
            self.depth -= 1
        return out

    def run(self, tasks, engine="blas"):
        tasks = list(tasks)
        if self.depth or len(tasks) <= 1:  # inline: inside a task, or a single task (serial as on the pool)
            for t in tasks:
                t()
            return
        site = self._site()
        self._close_serial()
        self.events.append(("tasks", site, self._timed(tasks)))
        self.mark = time.perf_counter()

    def graph(self, groups, preds, engine="blas"):
        if self.depth or sum(len(g) for g in groups) <= 1:
            for g in groups:
                for t in g:
                    t()
            return
        site = self._site()
        self._close_serial()
        self.events.append(("graph", site, [self._timed(g) for g in groups], [set(p) for p in preds]))
        self.mark = time.perf_counter()

    def end(self) -> None:
        self._close_serial()
        self.mark = time.perf_counter()


def _fifo(durs: list[float], T: int, o: float) -> float:
    """Makespan of a task list handed out first come, first served to ``T`` workers."""
    if T <= 1 or len(durs) <= 1:
        return sum(durs)
    free = [0.0] * T
    for d in durs:
        t = heapq.heappop(free)
        heapq.heappush(free, t + d + o)
    return max(free)


def _graph(groups: list[list[float]], preds: list[set[int]], T: int, o: float) -> float:
    """Makespan of ``run_graph``'s rule on ``T`` workers: a free worker takes the next task of the
    lowest-numbered ready group; a group is ready once its predecessors have finished."""
    if T <= 1:
        return sum(sum(g) for g in groups)
    G = len(groups)
    succ: list[list[int]] = [[] for _ in range(G)]
    npred = [len(p) for p in preds]
    for g, p in enumerate(preds):
        for q in p:
            succ[q].append(g)
    left = [len(g) for g in groups]
    nxt = [0] * G
    ready: list[int] = []
    done_at = 0.0

    def finish(g: int, t: float) -> None:
        nonlocal done_at
        stack = [g]
        while stack:
            h = stack.pop()
            done_at = max(done_at, t)
            for s in succ[h]:
                npred[s] -= 1
                if npred[s] == 0:
                    (heapq.heappush(ready, s) if groups[s] else stack.append(s))

    for g in [g for g in range(G) if npred[g] == 0]:  # the roots first (an empty one releases others)
        if groups[g]:
            heapq.heappush(ready, g)
        else:
            finish(g, 0.0)
    now = 0.0
    idle = T
    running: list[tuple[float, int]] = []  # (end time, group)
    while ready or running:
        while idle and ready:
            g = ready[0]
            i = nxt[g]
            nxt[g] += 1
            if nxt[g] == len(groups[g]):
                heapq.heappop(ready)
            heapq.heappush(running, (now + groups[g][i] + o, g))
            idle -= 1
        if not running:
            break
        now, g = heapq.heappop(running)
        idle += 1
        left[g] -= 1
        if left[g] == 0:
            finish(g, now)
    return max(now, done_at)


def model(events: list[tuple], T: int, o: float) -> tuple[float, float, dict[str, list[float]]]:
    """(modelled wall, total work, per site [work, T·time]) of a trace on ``T`` workers."""
    wall = work = 0.0
    sites: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for ev in events:
        if ev[0] == "serial":
            wall += ev[1]
            work += ev[1]
            s = sites["(calling thread, serial)"]
            s[0] += ev[1]
            s[1] += ev[1] * T
            continue
        if ev[0] == "tasks":
            w, m = sum(ev[2]), _fifo(ev[2], T, o)
        else:
            w, m = sum(sum(g) for g in ev[2]), _graph(ev[2], ev[3], T, o)
        wall += m
        work += w
        s = sites[ev[1]]
        s[0] += w
        s[1] += m * T
        s[2] += 1
    return wall, work, sites


def _case(what: str, shape: tuple[int, int, int]):
    import numpy as np
    import torch

    import fastgrad as fg
    from fastgrad.torch import linear_cross_entropy as lce

    BT, H, V = shape
    g = torch.Generator().manual_seed(0)
    h = torch.randn(BT, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    t = torch.randint(0, V, (BT,), generator=g)
    if what in ("step", "step-fast"):
        prec = "fast" if what == "step-fast" else "accurate"

        def run():
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
            lce(hh, ww, t, precision=prec).backward()

        return run
    xn, wn, tn = h.view(torch.int16).numpy(), w.view(torch.int16).numpy(), t.numpy()
    import ml_dtypes

    xb, wb = xn.view(ml_dtypes.bfloat16), wn.view(ml_dtypes.bfloat16)
    s = fg.fused_linear_online_max_sum(xb, wb, tn, 0, V)
    m, e = np.asarray(s[0], np.float32), np.asarray(s[1], np.float32)
    mask = np.zeros((BT + 7) // 8, np.uint8)
    gl = np.full(BT, 1.0 / BT, np.float32)

    def run():
        fg.fused_linear_cross_entropy_loss_grad(gl, xb, wb, mask, tn, logits_max=m, sum_exp_logits=e)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", default="step-fast,step,flce", help="step-fast, step (the Qwen2.5 head), flce")
    ap.add_argument("--step-shape", default="2048,896,151936", help="BT,H,V of the train step")
    ap.add_argument("--flce-shape", default="1024,896,32000", help="BT,H,V of the FLCE grad")
    ap.add_argument("--threads", default="2,4,8,16")
    ap.add_argument("--overhead-us", type=float, default=20.0, help="the pool's cost per task handed out")
    ap.add_argument("--top", type=int, default=5, help="sites listed per thread count")
    ap.add_argument("--traces", type=int, default=2, help="traces per thread count (the quietest is modelled)")
    a = ap.parse_args()
    Ts = [int(x) for x in a.threads.split(",")]
    # the pool's width decides how finely a native GEMM is cut (kernels/_gemm.pool_grid): each
    # T is traced with fastgrad's threads set to T (the tasks still run one by one, on this thread)
    # (more threads than CPUs: OpenMP's idle workers must sleep, not spin beside the traced tasks)
    os.environ["NUMBA_NUM_THREADS"] = str(max(Ts + [int(os.environ.get("NUMBA_NUM_THREADS", "1"))]))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.path.insert(0, _ROOT)
    import fastgrad as fg
    import fastgrad.lm_head.loop as loop
    from fastgrad.kernels import _gemm

    print(f"CPU: {_cpu()}; fastgrad GEMM choice (bf16): {fg.gemm_choice('bfloat16')}")
    o = a.overhead_us * 1e-6
    for what in a.what.split(","):
        shape = tuple(int(v) for v in (a.flce_shape if what == "flce" else a.step_shape).split(","))
        run = _case(what, shape)
        fg.set_num_threads(1)
        run()  # compile, first pages
        print(f"\n{what} (BT, H, V) = {shape}")
        for T in Ts:
            fg.set_num_threads(T)
            real = (_gemm._run, _gemm.run_graph, loop.run_graph)
            tr, wall1 = None, float("inf")
            try:
                for i in range(a.traces + 1):  # the first pays a thread count's one-time costs
                    t = Trace()
                    _gemm._run, _gemm.run_graph, loop.run_graph = t.run, t.graph, t.graph
                    t0 = time.perf_counter()
                    t.mark = t0
                    run()
                    t.end()
                    w1 = time.perf_counter() - t0
                    if i and w1 < wall1:  # the quietest trace
                        tr, wall1 = t, w1
            finally:
                _gemm._run, _gemm.run_graph, loop.run_graph = real
                fg.set_num_threads(1)
            n = sum(len(e[2]) if e[0] == "tasks" else sum(map(len, e[2])) for e in tr.events if e[0] != "serial")
            wall, work, sites = model(tr.events, T, o)
            print(
                f"  T={T:2d}: {n} pool tasks, {wall1:.3f} s run one by one; modelled {wall:.3f} s, "
                f"schedule efficiency {work / (T * wall):.0%}"
            )
            lost = sorted(sites.items(), key=lambda kv: kv[1][0] - kv[1][1], reverse=False)
            for site, (w, tt, calls) in lost[: a.top]:
                if tt - w > 0.005 * T * wall:
                    print(f"       {(tt - w) / T:7.3f} s lost  work {w:7.3f} s  {calls:4d} phases  {site}")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f", {os.cpu_count()} CPUs"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
