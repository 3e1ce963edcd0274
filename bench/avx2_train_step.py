"""Train step at the Qwen2.5 head, the rows an AVX2-only user compares (one process, one call each
after a warm-up, interleaved over 2 rounds; peak RSS not measured here)."""
import time, resource, numpy as np
from fastgrad.benchmarks import cases as C
case = C.find_case("linear_cross_entropy[train-step]/bf16/BT=2048,H=896,V=151936", False)
inp = case.build()
want = ["fastgrad", "fastgrad-fused", "fastgrad-recompute", "torch-fp32", "torch-lce-bcs2048"]
rs = {r.name: r for r in case.runners}
fns = {n: rs[n].make(inp) for n in want if n in rs}
x = np.asarray(inp.get("hidden", None)) if False else None
import torch
h = inp["hidden"].float().numpy() if hasattr(inp["hidden"], "float") else np.asarray(inp["hidden"], np.float32)
w = inp["weight"].float().numpy() if hasattr(inp["weight"], "float") else np.asarray(inp["weight"], np.float32)
BT, H = h.shape; V = w.shape[0]
g = np.empty((BT, V), np.float32); gi = np.empty((BT, H), np.float32); gw = np.empty((V, H), np.float32)
def bound():
    np.matmul(h, w.T, out=g); np.matmul(g, w, out=gi); np.matmul(g.T, h, out=gw)
fns["bound(3 fp32 sgemms)"] = lambda: bound
res = {}
for n, f in fns.items():
    (bound if n.startswith("bound") else f)()
for rnd in range(2):
    for n, f in fns.items():
        t = time.perf_counter(); (bound if n.startswith("bound") else f)(); dt = time.perf_counter() - t
        res[n] = min(res.get(n, 1e9), dt)
for n, v in res.items():
    print(f"{n:24s} {v:7.2f} s")
