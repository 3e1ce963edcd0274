"""``fastgrad`` — the main job: a large-vocabulary LM-head gradient on a workstation.

Runs the companion forward (:func:`fastgrad.fused_linear_online_max_sum` and
:func:`fastgrad.fused_cross_entropy_loss_with_max_sum`) and the fused linear cross-entropy
gradient (:func:`fastgrad.fused_linear_cross_entropy_loss_grad`) at a real model's LM-head shape —
by default Qwen2.5-0.5B: V = 151,936, H = 896, BT = 2048, bf16 — in memory-saving mode, with a
progress bar over tiles, and reports time per phase, achieved GFLOP/s against the BLAS rate
measured on the spot, peak resident memory against the ``[BT, V]`` fp32 matrix it avoided, and
the max error of sampled rows/columns against the float64 golden.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

DEFAULT = dict(bt=2048, hidden=896, vocab=151936, dtype="bfloat16")


# ------------------------------------------------------------------ memory: peak RSS per phase

def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    kb = _status_kb("VmHWM")
    if kb is None:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


def rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    return (kb or 0) * 1024


# ------------------------------------------------------------------ inputs

def _dtype(name: str):
    import ml_dtypes

    return {"bfloat16": np.dtype(ml_dtypes.bfloat16), "bf16": np.dtype(ml_dtypes.bfloat16),
            "float16": np.dtype(np.float16), "fp16": np.dtype(np.float16),
            "float32": np.dtype(np.float32), "fp32": np.dtype(np.float32)}[name]


def _random_matrix(rng, rows, cols, dtype, scale, chunk=8192):
    """Gaussian matrix generated chunk by chunk straight into ``dtype`` (no full fp32 temp)."""
    out = np.empty((rows, cols), dtype)
    for r0 in range(0, rows, chunk):
        r1 = min(r0 + chunk, rows)
        out[r0:r1] = (rng.standard_normal((r1 - r0, cols), dtype=np.float32) * scale).astype(dtype)
    return out


def _load_npy(path):
    """np.load, reading 2-byte void arrays (how NumPy saves ml_dtypes.bfloat16) as bfloat16."""
    import ml_dtypes

    a = np.load(path, mmap_mode="r")
    if a.dtype.kind == "V" and a.dtype.itemsize == 2:
        a = a.view(ml_dtypes.bfloat16)
    return a


def load_inputs(args):
    """Generated or loaded (x, w, target, grad) and a description of where they came from.

    The dtype is ``--dtype`` when given, else the loaded weight's (bf16 for generated data).
    """
    rng = np.random.default_rng(args.seed)
    src = {}
    w = None
    if args.weight:
        w = _load_npy(args.weight)
        src["weight"] = args.weight
    elif args.safetensors:
        from safetensors import safe_open

        with safe_open(args.safetensors, framework="np") as f:
            names = list(f.keys())
            name = args.tensor or next((n for n in ("lm_head.weight", "model.embed_tokens.weight",
                                                    "embed_tokens.weight") if n in names), None)
            if name is None or name not in names:
                raise SystemExit(f"fastgrad: tensor {args.tensor!r} not in {args.safetensors}; "
                                 f"it has {names[:8]}{'...' if len(names) > 8 else ''}")
            w = f.get_tensor(name)
        src["weight"] = f"{args.safetensors}:{name}"
    dt = _dtype(args.dtype or (str(w.dtype) if w is not None and str(w.dtype) in
                               ("bfloat16", "float16", "float32") else "bfloat16"))
    if w is None:
        w = _random_matrix(rng, args.vocab, args.hidden, dt, 1.0 / np.sqrt(args.hidden))
        src["weight"] = "generated N(0, 1/H)"
    if w.dtype != dt:
        w = w.astype(dt)
    V, H = w.shape
    if args.input:
        x = _load_npy(args.input).astype(dt)
        src["input"] = args.input
        if x.shape[1] != H:
            raise SystemExit(f"fastgrad: input has H={x.shape[1]}, weight has H={H}")
    else:
        x = _random_matrix(rng, args.bt, H, dt, 1.0)
        src["input"] = "generated N(0, 1)"
    BT = x.shape[0]
    if args.target:
        t = np.load(args.target).astype(np.int64).reshape(-1)
        src["target"] = args.target
        if t.shape[0] != BT:
            raise SystemExit(f"fastgrad: target has {t.shape[0]} rows, input has {BT}")
    else:
        t = rng.integers(0, V, BT).astype(np.int64)
        src["target"] = "generated uniform"
    grad = np.full(BT, 1.0 / BT, np.float32)     # d(mean loss)/d(loss_r)
    return np.ascontiguousarray(x), np.ascontiguousarray(w), t, grad, src


# ------------------------------------------------------------------ BLAS rate on the spot

def measure_blas_gflops(BT: int, H: int, threads: int, seconds: float = 1.0) -> float:
    """fp32 GEMM rate of NumPy's BLAS at this problem's shape ([BT,H]·[H,2048]), best of a few."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(1)
    m = max(min(BT, 2048), 64)
    n = 2048
    a = rng.standard_normal((m, H), dtype=np.float32)
    b = rng.standard_normal((n, H), dtype=np.float32)
    c = np.empty((m, n), np.float32)
    best = float("inf")
    with threadpool_limits(limits=threads, user_api="blas"):
        np.matmul(a, b.T, out=c)
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            np.matmul(a, b.T, out=c)
            best = min(best, time.perf_counter() - t0)
    return 2.0 * m * n * H / best / 1e9


# ------------------------------------------------------------------ the job

class _Bar:
    def __init__(self, total, desc, enabled):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="tile", file=sys.stderr, leave=False)

    def __call__(self, done):
        if self.bar is not None:
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run_job(args) -> dict:
    import fastgrad as fg
    from fastgrad import tiling
    from fastgrad.kernels import fused_linear_cross_entropy_loss_grad as kgrad
    from fastgrad.kernels import fused_linear_online_max_sum as kfwd
    from fastgrad.kernels._gemm import single_threaded_blas
    from fastgrad.reference import fused_linear_cross_entropy_loss_grad as rgrad

    fg.set_num_threads(args.threads)
    show = not args.no_progress and not args.json
    phases = {}

    t0 = time.perf_counter()
    x, w, t, grad, src = load_inputs(args)
    phases["load_inputs"] = time.perf_counter() - t0
    BT, H = x.shape
    V = w.shape[0]
    shards = max(1, int(args.shards))
    bounds = np.linspace(0, V, shards + 1).round().astype(int)

    # warm-up: compile the kernels on a tiny problem so timings exclude compilation
    t0 = time.perf_counter()
    _warm(fg, x.dtype)
    phases["compile_warmup"] = time.perf_counter() - t0

    blas = measure_blas_gflops(BT, H, args.threads)
    base_rss = rss_bytes()
    reset_peak_rss()

    # ---- forward: each shard's online max/sum, combined as the caller's all-reduce would
    t0 = time.perf_counter()
    fwd = []
    for k in range(shards):
        a, b = int(bounds[k]), int(bounds[k + 1])
        ws = w[a:b]
        plan = tiling.plan_linear_cross_entropy(BT, b - a, H, mode="forward", widen=x.dtype != np.float32)
        bar = _Bar(plan.n_tiles, f"forward shard {k + 1}/{shards}", show)
        out = (np.empty(BT, np.float32), np.empty(BT, np.float32), np.empty(BT, np.float32),
               np.empty((BT + 7) // 8, np.uint8), np.empty(BT, t.dtype),
               np.empty((BT, b - a), x.dtype) if args.mode == "high-performance" else None)
        with single_threaded_blas():
            kfwd.run(x, ws, t, a, b, args.mode == "high-performance", out, plan=plan, progress=bar)
        bar.close()
        fwd.append(out)
    gmax = np.max([o[0] for o in fwd], axis=0)
    gsum = np.sum([o[1] * np.exp(o[0] - gmax) for o in fwd], axis=0).astype(np.float32)
    owned = [~np.unpackbits(o[3], bitorder="little")[:BT].astype(bool) for o in fwd]
    gpred = np.sum([o[2] + (o[0] - gmax) * ow for o, ow in zip(fwd, owned)], axis=0).astype(np.float32)
    loss, _ = fg.fused_cross_entropy_loss_with_max_sum(gmax, gsum, gpred)
    phases["forward"] = time.perf_counter() - t0
    peak_fwd = peak_rss_bytes()

    # ---- backward: each shard's FLCE grad with the global statistics
    reset_peak_rss()
    t0 = time.perf_counter()
    gi = np.zeros((BT, H), np.float32)
    gw = np.empty((V, H), x.dtype)
    for k in range(shards):
        a, b = int(bounds[k]), int(bounds[k + 1])
        o = fwd[k]
        softmax = None
        if args.mode == "high-performance":
            _, softmax = fg.fused_cross_entropy_loss_with_max_sum(gmax, gsum, gpred, vocab_parallel_logits=o[5])
            o = o[:5] + (None,)
            fwd[k] = o
        plan = tiling.plan_linear_cross_entropy(BT, b - a, H, mode="memory_saving" if softmax is None
                                                else "high_performance", widen=x.dtype != np.float32)
        bar = _Bar(plan.n_tiles, f"grad shard {k + 1}/{shards}", show)
        gi_k = np.empty((BT, H), x.dtype)
        with single_threaded_blas():
            kgrad.run(grad, x, w[a:b], o[3], o[4], 0.0, gmax, gsum, softmax, (gi_k, gw[a:b]),
                      plan=plan, progress=bar)
        bar.close()
        del softmax
        gi += gi_k.astype(np.float32)     # the caller's all-reduce of grad_input
    grad_input = gi.astype(x.dtype) if shards > 1 else gi_k
    phases["backward"] = time.perf_counter() - t0
    peak_bwd = peak_rss_bytes()

    # ---- sampled check against the float64 golden
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed + 1)
    rows = np.unique(np.concatenate([[0, BT - 1], rng.integers(0, BT, args.samples)]))
    cols = np.unique(np.concatenate([[0, V - 1], t[rows[:2]], rng.integers(0, V, args.samples)]))
    errs = _sampled_errors(x, w, t, grad, gmax, gsum, loss, grad_input, gw, rows, cols, rgrad)
    phases["golden_check"] = time.perf_counter() - t0

    flop_fwd = 2.0 * BT * V * H
    flop_bwd = 6.0 * BT * V * H
    io_bytes = (x.nbytes + w.nbytes + grad_input.nbytes + gw.nbytes)
    res = {
        "shape": {"BT": BT, "H": H, "V": V}, "dtype": str(x.dtype), "mode": args.mode,
        "shards": shards, "threads": args.threads, "sources": src,
        "phases_s": {k: round(v, 4) for k, v in phases.items()},
        "gflops": {"forward": flop_fwd / phases["forward"] / 1e9, "backward": flop_bwd / phases["backward"] / 1e9,
                   "blas_fp32_measured": blas},
        "fraction_of_blas": {"forward": flop_fwd / phases["forward"] / 1e9 / blas,
                             "backward": flop_bwd / phases["backward"] / 1e9 / blas},
        "memory": {"rss_before_bytes": base_rss, "peak_rss_forward_bytes": peak_fwd,
                   "peak_rss_backward_bytes": peak_bwd, "inputs_outputs_bytes": io_bytes,
                   "logits_fp32_bytes_avoided": 4 * BT * V},
        "loss_mean": float(np.mean(loss)),
        "max_error_vs_golden": errs,
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count()},
    }
    return res


def _warm(fg, dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4)).astype(dtype)
    w = rng.standard_normal((5, 4)).astype(dtype)
    t = np.array([0, 1, 7])
    r = fg.fused_linear_online_max_sum(x, w, t, 0, 5, return_logits=True)
    _, sm = fg.fused_cross_entropy_loss_with_max_sum(r.logits_max_local, r.sum_exp_logits_local,
                                                     r.predicted_logits_local, vocab_parallel_logits=r.vocab_parallel_logits)
    fg.fused_linear_cross_entropy_loss_grad(np.ones(3, np.float32), x, w, r.target_mask, r.masked_target,
                                            logits_max=r.logits_max_local, sum_exp_logits=r.sum_exp_logits_local)
    fg.fused_linear_cross_entropy_loss_grad(np.ones(3, np.float32), x, w, r.target_mask, r.masked_target, softmax=sm)


def _sampled_errors(x, w, t, grad, gmax, gsum, loss, grad_input, gw, rows, cols, rgrad):
    """Max |fastgrad - float64 golden| on sampled rows (loss, stats, grad_input) and sampled
    vocabulary rows of grad_weight, with the golden's own inputs (the global statistics)."""
    BT = x.shape[0]
    X64 = x.astype(np.float64)
    # loss and statistics of the sampled rows, from exact logits rounded to the input dtype
    Lr = (X64[rows] @ w.astype(np.float64).T).astype(np.float32).astype(x.dtype).astype(np.float64)
    m = Lr.max(axis=1)
    s = np.exp(Lr - m[:, None]).sum(axis=1)
    loss64 = np.log(s) - (Lr[np.arange(len(rows)), t[rows]] - m)
    masked = np.zeros(BT, bool)
    g_rows = rgrad.grad_logits(grad, x, w, masked, t, 0.0, gmax, gsum, None, rows=rows)
    gi64 = g_rows @ w.astype(np.float64)
    g_cols = rgrad.grad_logits(grad, x, w, masked, t, 0.0, gmax, gsum, None, cols=cols)
    gw64 = g_cols.T @ X64
    def rel(a, b):
        a = np.asarray(a, np.float64)
        return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) or 1.0))
    return {
        "rows_sampled": int(len(rows)), "vocab_rows_sampled": int(len(cols)),
        "loss_abs": float(np.max(np.abs(loss[rows] - loss64))),
        "logits_max_abs": float(np.max(np.abs(gmax[rows] - m))),
        "grad_input_abs": float(np.max(np.abs(grad_input[rows].astype(np.float64) - gi64))),
        "grad_input_rel_to_max": rel(grad_input[rows], gi64),
        "grad_weight_abs": float(np.max(np.abs(gw[cols].astype(np.float64) - gw64))),
        "grad_weight_rel_to_max": rel(gw[cols], gw64),
    }


def _fmt_bytes(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def print_report(r: dict) -> None:
    s = r["shape"]
    print(f"fastgrad: LM-head gradient, BT={s['BT']} H={s['H']} V={s['V']} {r['dtype']} "
          f"mode={r['mode']} shards={r['shards']} threads={r['threads']}")
    print(f"  inputs: weight {r['sources']['weight']}; input {r['sources']['input']}; "
          f"target {r['sources']['target']}")
    print("  phase times:")
    for k, v in r["phases_s"].items():
        print(f"    {k:<16} {v:9.3f} s")
    g = r["gflops"]
    fb = r["fraction_of_blas"]
    print(f"  GFLOP/s: forward {g['forward']:.1f} ({fb['forward']:.0%} of BLAS), backward "
          f"{g['backward']:.1f} ({fb['backward']:.0%} of BLAS); BLAS fp32 GEMM measured now: "
          f"{g['blas_fp32_measured']:.1f}")
    m = r["memory"]
    print(f"  memory: peak RSS forward {_fmt_bytes(m['peak_rss_forward_bytes'])}, backward "
          f"{_fmt_bytes(m['peak_rss_backward_bytes'])} (process before the phases "
          f"{_fmt_bytes(m['rss_before_bytes'])}, inputs+outputs {_fmt_bytes(m['inputs_outputs_bytes'])}); "
          f"the [BT, V] fp32 logits it never held: {_fmt_bytes(m['logits_fp32_bytes_avoided'])}")
    e = r["max_error_vs_golden"]
    print(f"  vs float64 golden ({e['rows_sampled']} rows, {e['vocab_rows_sampled']} vocab rows): "
          f"loss {e['loss_abs']:.2e}, grad_input {e['grad_input_abs']:.2e} "
          f"({e['grad_input_rel_to_max']:.2e} of max), grad_weight {e['grad_weight_abs']:.2e} "
          f"({e['grad_weight_rel_to_max']:.2e} of max)")
    print(f"  mean loss {r['loss_mean']:.4f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastgrad",
        description="Large-vocabulary LM-head gradient (aclnnFusedLinearCrossEntropyLossGrad) on the CPU. "
                    "Subcommands: fastgrad bench | compare | golden (see `fastgrad SUBCOMMAND -h`).")
    p.add_argument("--bt", type=int, default=DEFAULT["bt"], help="tokens (rows), default 2048")
    p.add_argument("--hidden", type=int, default=DEFAULT["hidden"], help="hidden size H, default 896")
    p.add_argument("--vocab", type=int, default=DEFAULT["vocab"], help="vocabulary V, default 151936")
    p.add_argument("--dtype", default=None, help="default bfloat16, or the loaded weight's dtype", choices=["bfloat16", "bf16", "float16", "fp16",
                                                                "float32", "fp32"])
    p.add_argument("--mode", default="memory-saving", choices=["memory-saving", "high-performance"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--shards", type=int, default=1, help="vocabulary shards (run in turn, combined as the all-reduce would)")
    p.add_argument("--samples", type=int, default=8, help="sampled rows / vocab rows for the golden check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input", help=".npy hidden states [BT, H]")
    p.add_argument("--weight", help=".npy LM-head weight [V, H]")
    p.add_argument("--target", help=".npy int targets [BT]")
    p.add_argument("--safetensors", help="checkpoint to take the LM head from")
    p.add_argument("--tensor", help="tensor name in --safetensors (default lm_head.weight or the tied embedding)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    res = run_job(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_report(res)
    return 0
