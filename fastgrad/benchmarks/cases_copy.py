"""The bandwidth-bound benchmark cases (cross-entropy grads, softmax grad, smooth-L1, embedding):
``fastgrad.benchmarks.cases`` lists them with the LM-head family."""

from __future__ import annotations

import numpy as np

from .. import _outcache
from ._case_base import (
    _DT,
    Case,
    Runner,
    _normal,
    _rng,
    _torch,
    tt,
)

# ------------------------------------------------------------- bandwidth-bound family ----


def _with_out(call, out_shape_dtype):
    """A fastgrad runner factory with a preallocated ``out=`` (allocated once, outside timing)."""

    def make(inp):
        shape, dtype = out_shape_dtype(inp)
        out = np.empty(shape, dtype)

        def run():
            return call(inp, out)

        return run

    return make


def _alloc(call, cache_mb=None):
    """Without ``out=``: a new output per call (``cache_mb=0``: on fresh pages, the output cache
    off for the call — what an allocation costs without it)."""

    def make(inp):
        def run():
            if cache_mb is None:
                return call(inp, None)
            with _outcache.output_cache(cache_mb):
                return call(inp, None)

        return run

    return make


def _fastgrad_runners(call, out_shape_dtype):
    """The bandwidth ops' fastgrad rows: a new output (recycled memory), ``out=``, fresh pages."""
    return [
        Runner("fastgrad", "fastgrad", _alloc(call)),
        Runner("fastgrad", "fastgrad", _with_out(call, out_shape_dtype), "out="),
        Runner("fastgrad", "fastgrad", _alloc(call, cache_mb=0), "fresh-pages"),
    ]


def _fce_case(BT, V, dtype) -> Case:
    import fastgrad as fg

    dt = _DT[dtype]

    def inputs():
        rng = _rng("fce", BT, V, dtype)
        lg = _normal(rng, (BT, V), dt)
        lf = lg.astype(np.float32)
        m = lf.max(axis=1)
        se = np.exp(lf - m[:, None]).sum(axis=1, dtype=np.float32)
        pred = lf[np.arange(BT), rng.integers(0, V, BT)] - m
        return {
            "logits_max": m,
            "sum_exp_logits": se,
            "predicted_logits": pred.astype(np.float32),
            "vocab_parallel_logits": lg,
        }

    def fastgrad_run(inp):
        def run():
            return fg.fused_cross_entropy_loss_with_max_sum(
                inp["logits_max"],
                inp["sum_exp_logits"],
                inp["predicted_logits"],
                vocab_parallel_logits=inp["vocab_parallel_logits"],
            )

        return run

    def torch_run(inp):
        torch = _torch()
        lg = tt(inp["vocab_parallel_logits"])
        m, se, p = (tt(inp[k]) for k in ("logits_max", "sum_exp_logits", "predicted_logits"))

        def run():
            return torch.log(se) - p, torch.exp(lg.float() - m[:, None]) * (1.0 / se)[:, None]

        return run

    return Case(
        "fused_cross_entropy_loss_with_max_sum",
        "softmax",
        dtype,
        {"BT": BT, "V": V},
        inputs,
        [Runner("fastgrad", "fastgrad", fastgrad_run), Runner("torch", "baseline", torch_run, needs_torch=True)],
        bytes=float(BT * V * (dt.itemsize + 4) + BT * 16),
    )


def _ce_case(N, C, dtype) -> Case:
    import fastgrad as fg

    dt = _DT[dtype]

    def inputs():
        rng = _rng("ce", N, C, dtype)
        x = rng.standard_normal((N, C), dtype=np.float32)
        x -= x.max(axis=1, keepdims=True)
        x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
        return {
            "grad_loss": np.array(1.0, dt),
            "log_prob": x.astype(dt),
            "target": rng.integers(0, C, N, dtype=np.int64),
        }

    def call(inp, out):
        return fg.cross_entropy_loss_grad(inp["grad_loss"], inp["log_prob"], inp["target"], reduction="mean", out=out)

    def torch_run(inp):
        torch = _torch()
        aten = torch.ops.aten
        g, lp, t = tt(inp["grad_loss"]), tt(inp["log_prob"]), tt(inp["target"])
        total = torch.tensor(float(N), dtype=lp.dtype)

        def run():
            gn = aten.nll_loss_backward(g, lp, t, None, 1, -100, total)
            return aten._log_softmax_backward_data(gn, lp, 1, lp.dtype)

        return run

    return Case(
        "cross_entropy_loss_grad",
        "mean",
        dtype,
        {"N": N, "C": C},
        inputs,
        [
            *_fastgrad_runners(call, lambda i: (i["log_prob"].shape, dt)),
            Runner("torch", "baseline", torch_run, needs_torch=True),
        ],
        bytes=float(2 * N * C * dt.itemsize + N * 8),
        note="torch: aten.nll_loss_backward + aten._log_softmax_backward_data",
    )


def _softmax_case(B, N, S1, S2, dtype) -> Case:
    import fastgrad as fg

    dt = _DT[dtype]
    scale = 0.125

    def inputs():
        rng = _rng("smsb", B, N, S1, S2, dtype)
        z = rng.standard_normal((B, N, S1, S2), dtype=np.float32)
        z = np.exp(z - z.max(axis=-1, keepdims=True))
        z /= z.sum(axis=-1, keepdims=True)
        causal = np.triu(np.ones((S1, S2), np.bool_), 1)
        mask = causal[None, None] | (rng.random((B, 1, S1, S2)) < 0.05)
        return {"grad_output": _normal(rng, (B, N, S1, S2), dt), "y": z.astype(dt), "mask": mask}

    def call(inp, out):
        return fg.scaled_masked_softmax_backward(inp["grad_output"], inp["y"], inp["mask"], scale=scale, out=out)

    def torch_run(inp):
        torch = _torch()
        go, y, mask = tt(inp["grad_output"]), tt(inp["y"]), tt(inp["mask"])

        def run():
            gx = torch.ops.aten._softmax_backward_data(go, y, -1, y.dtype)
            return gx.mul_(scale).masked_fill_(mask, 0)

        return run

    E = B * N * S1 * S2
    return Case(
        "scaled_masked_softmax_backward",
        "broadcast-mask",
        dtype,
        {"B": B, "N": N, "S1": S1, "S2": S2},
        inputs,
        [
            *_fastgrad_runners(call, lambda i: (i["y"].shape, dt)),
            Runner("torch", "baseline", torch_run, needs_torch=True),
        ],
        bytes=float(3 * E * dt.itemsize + B * S1 * S2),
        note="torch: aten._softmax_backward_data, * scale, masked_fill",
    )


def _smooth_l1_case(n, dtype) -> Case:
    import fastgrad as fg

    dt = _DT[dtype]
    rows = 4096 if n % 4096 == 0 else 1
    shape = (rows, n // rows)

    def inputs():
        rng = _rng("sl1", n, dtype)
        return {"grad_out": np.array(1.0, dt), "input": _normal(rng, shape, dt), "target": _normal(rng, shape, dt)}

    def call(inp, out):
        return fg.smooth_l1_loss_backward(
            inp["grad_out"], inp["input"], inp["target"], reduction="mean", beta=1.0, out=out
        )

    def torch_run(inp):
        torch = _torch()
        g, x, t = tt(inp["grad_out"]), tt(inp["input"]), tt(inp["target"])

        def run():
            return torch.ops.aten.smooth_l1_loss_backward(g, x, t, 1, 1.0)

        return run

    return Case(
        "smooth_l1_loss_backward",
        "mean",
        dtype,
        {"n": n},
        inputs,
        [
            *_fastgrad_runners(call, lambda i: (shape, dt)),
            Runner("torch", "baseline", torch_run, needs_torch=True),
        ],
        bytes=float(3 * n * dt.itemsize),
        note="torch: aten.smooth_l1_loss_backward",
    )


def _embedding_case(T, W, Dm, dtype) -> Case:
    import fastgrad as fg

    dt = _DT[dtype]

    def inputs():
        rng = _rng("emb", T, W, Dm, dtype)
        return {"grad": _normal(rng, (T, Dm), dt), "indices": rng.integers(0, W, T, dtype=np.int64)}

    def call(inp, out):
        return fg.embedding_dense_backward(inp["grad"], inp["indices"], W, out=out)

    def torch_run(inp):
        torch = _torch()
        g, idx = tt(inp["grad"]), tt(inp["indices"])

        def run():
            return torch.ops.aten.embedding_dense_backward(g, idx, W, -1, False)

        return run

    return Case(
        "embedding_dense_backward",
        "dense",
        dtype,
        {"tokens": T, "num_weights": W, "D": Dm},
        inputs,
        [
            *_fastgrad_runners(call, lambda i: ((W, Dm), dt)),
            Runner("torch", "baseline", torch_run, needs_torch=True),
        ],
        bytes=float(T * Dm * dt.itemsize + T * 8 + W * Dm * dt.itemsize),
        note="bytes: read grad and indices, write the whole [num_weights, D] output",
    )
