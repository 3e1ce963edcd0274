"""The benchmark cases: the ONE definition shared by ``fastgrad bench`` and ``pytest bench/``.

A :class:`Case` is one op at one shape, dtype and mode.  It knows how to build its inputs
(deterministically, from a seed), the work it must do (``flops``: the GEMMs it needs;
``bytes``: the minimum bytes it must read and write), which bound applies (``"gemm"``: the
fp32 GEMMs in ``gemm``, timed through NumPy's BLAS; ``"copy"``: ``bytes`` at the measured copy
bandwidth), and its :class:`Runner`\\ s:

* ``kind="fastgrad"`` — the public fastgrad op; one row per backend (cpu, reference, acl);
* ``kind="baseline"`` — PyTorch computing the same result on the CPU (skipped, with a note,
  when torch is not installed);
* ``kind="bound"`` — the GEMM bound (copy-bound cases get their bound row from the measured
  bandwidth instead).

Full cases are the LLM-sized shapes the issues name; ``quick=True`` gives small shapes with
the same structure (for CI smoke tests: every runner of every case runs in well under a
second).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from ._case_base import (  # noqa: F401  (re-exported)
    _DT,
    _SHORT,
    ALIASES,
    BF16,
    F16,
    F32,
    Case,
    Runner,
    _flce_inputs,
    _normal,
    _rng,
    _torch,
    tt,
)
from .cases_copy import (  # noqa: F401  (re-exported)
    _alloc,
    _ce_case,
    _embedding_case,
    _fastgrad_runners,
    _fce_case,
    _smooth_l1_case,
    _softmax_case,
    _with_out,
)

# ------------------------------------------------------------------------ FLCE family ----


def _torch_flce(dtype_name):
    """PyTorch eager autograd with materialized logits: cross_entropy(x @ w.T, t, 'none')
    weighted by grad, backward -> (grad_input, grad_weight)."""

    def make(inp):
        torch = _torch()
        F = torch.nn.functional
        if dtype_name == "float32":
            x = torch.from_numpy(inp["input"].astype(np.float32))
            w = torch.from_numpy(inp["weight"].astype(np.float32))
        else:
            x, w = tt(inp["input"]), tt(inp["weight"])
        t = tt(inp["torch_target"])
        g = tt(inp["grad"]).to(x.dtype)

        def run():
            xx = x.detach().requires_grad_()
            ww = w.detach().requires_grad_()
            loss = F.cross_entropy(xx @ ww.T, t, reduction="none", ignore_index=-100)
            (loss * g).sum().backward()
            return xx.grad, ww.grad

        return run

    return make


def _flce_grad(inp, **kw):
    """The FLCE grad op on a case's inputs; ``kw``: the statistics (or ``softmax``), filter_eps, ..."""
    import fastgrad as fg

    return fg.fused_linear_cross_entropy_loss_grad(
        inp["grad"], inp["input"], inp["weight"], inp["target_mask"], inp["masked_target"], **kw
    )


def _stats(inp) -> dict:
    return {"logits_max": inp["logits_max"], "sum_exp_logits": inp["sum_exp_logits"]}


def _flce_cases(BT, H, V, dtype, quick, grad_only=False) -> list:
    """The FLCE grad in both modes and the online max-sum at one shape; ``grad_only``: the
    memory-saving grad against its bound alone (no PyTorch rows: the fp16 case, where PyTorch's
    CPU fp16 GEMMs would take minutes)."""
    import fastgrad as fg

    s = _DT[dtype].itemsize
    shape = {"BT": BT, "H": H, "V": V}
    io_bytes = float(2 * (BT * H + V * H) * s + BT * 16)  # read x, w; write gi, gw

    def ms(inp):
        return lambda: _flce_grad(inp, **_stats(inp))

    def ms_onednn(inp):
        def run():
            with fg.gemm("onednn"):
                return _flce_grad(inp, **_stats(inp))

        return run

    def hp(inp):
        return lambda: _flce_grad(inp, softmax=inp["softmax"])

    def fwd(inp):
        V_ = inp["weight"].shape[0]

        def run():
            return fg.fused_linear_online_max_sum(inp["input"], inp["weight"], inp["target"], 0, V_)

        return run

    def torch_fwd(inp):
        torch = _torch()
        x = torch.from_numpy(inp["input"].astype(np.float32))
        w = torch.from_numpy(inp["weight"].astype(np.float32))
        t = tt(inp["target"])[:, None]

        def run():
            lg = x @ w.T
            m = lg.amax(dim=1)
            se = torch.exp(lg - m[:, None]).sum(dim=1)
            return m, se, lg.gather(1, t)[:, 0] - m

        return run

    g3 = [(BT, H, V), (BT, V, H), (V, BT, H)]
    gemm_flops = 2.0 * BT * H * V
    cases = [
        Case(
            "fused_linear_cross_entropy_loss_grad",
            "memory-saving",
            dtype,
            shape,
            lambda: _flce_inputs(BT, H, V, dtype, 0),
            [Runner("fastgrad", "fastgrad", ms), Runner("bound", "bound", None)]
            if grad_only
            else [
                Runner("fastgrad", "fastgrad", ms),
                Runner("fastgrad-onednn", "baseline", ms_onednn, needs_torch=True),
                Runner("torch-fp32", "baseline", _torch_flce("float32"), needs_torch=True),
                Runner(f"torch-{_SHORT[dtype]}", "baseline", _torch_flce(dtype), needs_torch=True),
                Runner("bound", "bound", None),
            ],
            flops=3 * gemm_flops,
            bytes=io_bytes,
            bound="gemm",
            gemm=g3,
            memory=True,
            note="bound: the 3 fp32 GEMMs [BT,H]x[H,V], [BT,V]x[V,H], [V,BT]x[BT,H]"
            + ("" if grad_only else "; fastgrad-onednn: the same op on the oneDNN GEMM engine (fg.gemm('onednn'))"),
        ),
        Case(
            "fused_linear_cross_entropy_loss_grad",
            "high-performance",
            dtype,
            shape,
            lambda: _flce_inputs(BT, H, V, dtype, 0, softmax=True),
            [Runner("fastgrad", "fastgrad", hp), Runner("bound", "bound", None)],
            flops=2 * gemm_flops,
            bytes=io_bytes + 4.0 * BT * V,
            bound="gemm",
            gemm=g3[1:],
            memory=True,
            note="bound: the 2 fp32 GEMMs [BT,V]x[V,H], [V,BT]x[BT,H]",
        ),
        Case(
            "fused_linear_online_max_sum",
            "forward",
            dtype,
            shape,
            lambda: _flce_inputs(BT, H, V, dtype, 0),
            [
                Runner("fastgrad", "fastgrad", fwd),
                Runner("torch-fp32", "baseline", torch_fwd, needs_torch=True),
                Runner("bound", "bound", None),
            ],
            flops=gemm_flops,
            bytes=float((BT * H + V * H) * s + BT * 28),
            bound="gemm",
            gemm=g3[:1],
            memory=True,
            note="bound: the fp32 GEMM [BT,H]x[H,V]",
        ),
    ]
    return cases[:1] if grad_only else cases


#: The sparsity sweep of the gradient-filtering cases: target mean softmax entropies (nats);
#: None is the uniform case (every probability 1/V: below bf16's threshold 2⁻¹² once V > 4096,
#: so every block but the targets' is skipped); "no-skip" the adversarial case where every block
#: holds a probability above the threshold in some row (nothing can be skipped: the filter's
#: overhead alone).
SPARSITY_ENTROPIES: tuple = (0.5, 2.0, 4.0, None, "no-skip")


def _mean_entropy(x, w) -> float:
    """Mean softmax entropy (nats) of the rows ``x`` (fp32 copies of the rounded inputs)."""
    lg = x @ w.T
    lg -= lg.max(axis=1, keepdims=True)
    p = np.exp(lg)
    p /= p.sum(axis=1, keepdims=True)
    return float(-(p * np.log(np.maximum(p, 1e-38))).sum(axis=1).mean())


def _no_skip_inputs(BT, H, V, dtype, seed=0):
    """Every filter block kept: row r's hidden state is ``20·e_k`` (``k = r mod c``, c the
    filter's column block) and weight row v is ``e_{v mod c}`` plus small noise, so row r puts
    probability ≈ c/V on each column ``v ≡ k (mod c)`` — one column in every block of c
    columns, ≈ 4.2e-4 > 2⁻¹² at V = 151936 — and the row blocks cover every residue."""
    from .. import tiling

    c = tiling.FILTER_COLS
    rng = _rng("no-skip", BT, H, V, dtype, seed)
    w = _normal(rng, (V, H), F32, 0.1 / math.sqrt(H))
    w[np.arange(V), np.arange(V) % c] += 1.0
    x = np.zeros((BT, H), np.float32)
    x[np.arange(BT), np.arange(BT) % c] = 20.0
    target = (np.arange(BT) % c + c * rng.integers(0, max(1, V // c), BT)).astype(np.int64) % V
    return x, w, target


def _sparse_flce_inputs(BT, H, V, dtype, entropy, seed=0) -> dict:
    """LLM-like sparsity, reproducibly: each hidden state is a mix of a few candidate tokens'
    embeddings (candidates drawn Zipf-like, so frequent tokens have low ids as in BPE
    vocabularies) plus noise, scaled by a strength chosen by bisection so that the softmax has
    the given mean entropy on a sample of rows.  ``entropy=None``: the uniform case."""
    dt = _DT[dtype]
    if entropy == "no-skip":
        x, w, target = _no_skip_inputs(BT, H, V, dtype, seed)
        return _filter_case_inputs(x.astype(dt), w.astype(dt), target, V)
    rng = _rng("sparse", BT, H, V, dtype, entropy, seed)
    w = _normal(rng, (V, H), F32, 1.0 / math.sqrt(H))
    k = 4
    ranks = np.minimum((rng.zipf(1.2, size=(BT, k)) - 1), V - 1)
    mix = rng.dirichlet(np.ones(k), size=BT).astype(np.float32)
    base = np.einsum("bk,bkh->bh", mix, w[ranks]) * np.float32(math.sqrt(H))
    noise = rng.standard_normal((BT, H), dtype=np.float32) * np.float32(0.5)
    target = ranks[np.arange(BT), rng.integers(0, k, BT)].astype(np.int64)
    sample = slice(0, min(BT, 64))

    def mean_entropy(alpha):
        return _mean_entropy((alpha * base[sample] + noise[sample]).astype(dt).astype(np.float32), w)

    if entropy is None:
        alpha, x = 0.0, np.zeros((BT, H), np.float32)
    else:
        lo, hi = 0.0, 64.0
        for _ in range(30):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if mean_entropy(mid) > entropy else (lo, mid)
        alpha = 0.5 * (lo + hi)
        x = alpha * base + noise
    return _filter_case_inputs(x.astype(dt), w.astype(dt), target, V)


def _filter_case_inputs(x, wd, target, V) -> dict:
    """The FLCE grad's inputs (statistics from the online max-sum) and the measured mean entropy."""
    import fastgrad as fg

    BT = x.shape[0]
    f = fg.fused_linear_online_max_sum(x, wd, target, 0, V, logits_dtype=np.float32)
    sample = slice(0, min(BT, 64))
    return {
        "input": x,
        "weight": wd,
        "target": target,
        "target_mask": f.target_mask,
        "masked_target": f.masked_target,
        "grad": np.full(BT, 1.0 / BT, np.float32),
        "logits_max": f.logits_max_local,
        "sum_exp_logits": f.sum_exp_logits_local,
        "mean_entropy": _mean_entropy(x[sample].astype(np.float32), wd.astype(np.float32)),
    }


def _sparse_flce_cases(BT, H, V, dtype) -> list:
    """Issue 14: the filtered memory-saving grad (filter_eps="auto") against the dense grad and
    the three-GEMM bound over the entropy sweep; the filtered row's note gives the measured mean
    entropy, the fraction of blocks skipped and the error against the dense result."""

    def call(inp, eps, plan=False):
        return _flce_grad(inp, **_stats(inp), filter_eps=eps, return_plan=plan)

    def filtered(inp):
        last = {}

        def run():
            last["r"] = call(inp, "auto", plan=True)
            return last["r"]

        def metrics():
            gi, gw, pl = last["r"]
            di, dw = call(inp, None)
            err = max(
                float(np.max(np.abs(gi.astype(np.float32) - di.astype(np.float32)), initial=0)),
                float(np.max(np.abs(gw.astype(np.float32) - dw.astype(np.float32)), initial=0)),
            )
            scale = (
                max(
                    float(np.max(np.abs(di.astype(np.float32)), initial=0)),
                    float(np.max(np.abs(dw.astype(np.float32)), initial=0)),
                )
                or 1.0
            )
            frac = pl.blocks_skipped / max(pl.blocks_total, 1)
            return {
                "mean_entropy": inp["mean_entropy"],
                "blocks_skipped_fraction": frac,
                "max_abs_err_vs_dense": err,
                "max_rel_err_vs_dense": err / scale,
                "note": f"entropy {inp['mean_entropy']:.2f} nats, {frac:.1%} of blocks skipped, "
                f"max err vs dense {err / scale:.2g} of max",
            }

        run.metrics = metrics  # type: ignore[attr-defined]
        return run

    def dense(inp):
        return lambda: call(inp, None)

    cases = []
    for e in SPARSITY_ENTROPIES:
        label = "uniform" if e is None else (e if isinstance(e, str) else f"entropy={e:g}")
        cases.append(
            Case(
                "fused_linear_cross_entropy_loss_grad",
                f"memory-saving filter_eps=auto {label}",
                dtype,
                {"BT": BT, "H": H, "V": V},
                functools.partial(_sparse_flce_inputs, BT, H, V, dtype, e),
                [
                    Runner("fastgrad", "fastgrad", filtered),
                    Runner("fastgrad-dense", "baseline", dense),
                    Runner("bound", "bound", None),
                ],
                flops=3 * 2.0 * BT * H * V,
                bound="gemm",
                gemm=[(BT, H, V), (BT, V, H), (V, BT, H)],
                memory=True,
                note="gradient filtering (CCE's filter_eps); baseline = the same op dense",
            )
        )
    return cases


def _lce_step(filter_eps=None, fused=None, gemm=None, precision=None):
    """A runner factory: one ``fastgrad.torch.linear_cross_entropy`` loss + backward
    (``fused``, ``precision``: the keywords; ``gemm``: the GEMM engine, None = the default)."""

    def make(inp):
        from fastgrad.torch import linear_cross_entropy

        h, w, t = tt(inp["hidden"]), tt(inp["weight"]), tt(inp["target"])

        def step():
            hh = h.detach().requires_grad_()
            ww = w.detach().requires_grad_()
            loss = linear_cross_entropy(hh, ww, t, filter_eps=filter_eps, fused=fused, precision=precision)
            loss.backward()
            return loss, hh.grad, ww.grad

        def run():
            if gemm is None:
                return step()
            import fastgrad as fg

            with fg.gemm(gemm):
                return step()

        if "mean_entropy" in inp:  # the sweep's inputs: report their measured entropy
            run.metrics = lambda: {"mean_entropy": inp["mean_entropy"]}  # type: ignore[attr-defined]
        return run

    return make


def _loss64(inp) -> float:
    """The step's loss in float64 on the same (16-bit) values — ``F.cross_entropy`` of float64
    logits, 256 rows at a time (no ``[BT, V]`` float64) — computed once per inputs."""
    if "loss64" not in inp:
        torch = _torch()
        F = torch.nn.functional
        h, w, t = tt(inp["hidden"]).double(), tt(inp["weight"]).double(), tt(inp["target"])
        total = 0.0
        for r0 in range(0, h.shape[0], 256):
            z = h[r0 : r0 + 256] @ w.T
            total += float(F.cross_entropy(z, t[r0 : r0 + 256], reduction="sum"))
            del z
        inp["loss64"] = total / max(1, int((t != -100).sum()))
    return inp["loss64"]


def _with_loss_error(make):
    """A train-step runner factory whose rows also carry the step's loss and its error against
    float64 (``loss``, ``loss_err_fp64``: absolute, nats), measured after the timing."""

    def wrapped(inp):
        run = make(inp)
        last: dict = {}

        def timed():
            out = run()
            last["loss"] = out[0]
            return out

        def metrics():
            extra = dict(run.metrics()) if hasattr(run, "metrics") else {}
            if "loss" in last:
                loss = float(last["loss"].detach())
                extra.update(loss=loss, loss_err_fp64=abs(loss - _loss64(inp)))
            return extra

        timed.metrics = metrics  # type: ignore[attr-defined]
        return timed

    return wrapped


def _torch_lce_step(batch_chunk_size=None):
    """A runner factory: PyTorch 2.13's ``F.linear_cross_entropy`` + backward on the 16-bit
    parameters — ``options=LinearCrossEntropyOptions()`` (its defaults: chunking and accumulation
    picked per device and dtype) or ``batch_chunk_size`` rows per chunk (None: its defaults)."""

    def make(inp):
        torch = _torch()
        F = torch.nn.functional
        if not hasattr(F, "linear_cross_entropy"):
            raise NotImplementedError("torch.nn.functional.linear_cross_entropy needs PyTorch >= 2.13")
        h, w, t = tt(inp["hidden"]), tt(inp["weight"]), tt(inp["target"])
        if batch_chunk_size is None:
            opts = torch.nn.LinearCrossEntropyOptions()
        else:
            opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=min(batch_chunk_size, h.shape[0]))

        def run():
            hh = h.detach().requires_grad_()
            ww = w.detach().requires_grad_()
            loss = F.linear_cross_entropy(hh, ww, t, options=opts)
            loss.backward()
            return loss, hh.grad, ww.grad

        return run

    return make


def _filtered_train_step_case(BT, H, V, entropy=2.0) -> Case:
    """Issue 14: the fused training step with gradient filtering on LLM-like sparsity (the
    filter sweep's inputs at ``entropy`` nats), against the same step dense and PyTorch fp32;
    bound: ONE fp32 GEMM of the shape (the target: the step ≤ 1.4× it)."""

    def inputs():
        inp = _sparse_flce_inputs(BT, H, V, "bfloat16", entropy)
        return {
            "hidden": inp["input"],
            "weight": inp["weight"],
            "target": inp["target"],
            "mean_entropy": inp["mean_entropy"],
        }

    return Case(
        "linear_cross_entropy",
        f"train-step filter_eps=auto entropy={entropy:g}",
        "bfloat16",
        {"BT": BT, "H": H, "V": V},
        inputs,
        [
            Runner("fastgrad", "fastgrad", _with_loss_error(_lce_step("auto")), needs_torch=True),
            Runner("fastgrad-dense", "baseline", _with_loss_error(_lce_step(None)), needs_torch=True),
            Runner("torch-fp32", "baseline", _with_loss_error(_torch_step("float32")), needs_torch=True),
            Runner("bound", "bound", None),
        ],
        flops=2.0 * BT * H * V,
        bound="gemm",
        gemm=[(BT, H, V)],
        needs_torch=True,
        note="fastgrad.torch.linear_cross_entropy(filter_eps='auto') forward+backward; bound: one fp32 GEMM; "
        "loss_err_fp64: |loss - float64 loss| of the same values",
    )


def _torch_step(dtype_name):
    """A runner factory: ``F.cross_entropy`` on materialized logits + backward, in ``dtype_name``."""

    def make(inp):
        torch = _torch()
        F = torch.nn.functional
        h, w, t = tt(inp["hidden"]), tt(inp["weight"]), tt(inp["target"])
        if dtype_name == "float32":
            h, w = h.float(), w.float()

        def run():
            hh = h.detach().requires_grad_()
            ww = w.detach().requires_grad_()
            loss = F.cross_entropy(hh @ ww.T, t)
            loss.backward()
            return loss, hh.grad, ww.grad

        return run

    return make


def _train_step_case(BT, H, V) -> Case:
    """Issue 4: one LM-head loss + backward, fastgrad.torch.linear_cross_entropy vs
    F.cross_entropy on materialized logits (fp32 and bf16)."""

    def inputs():
        inp = _flce_inputs(BT, H, V, "bfloat16", 1, stats=False)
        return {"hidden": inp["input"], "weight": inp["weight"], "target": inp["target"]}

    return Case(
        "linear_cross_entropy",
        "train-step",
        "bfloat16",
        {"BT": BT, "H": H, "V": V},
        inputs,
        [
            Runner("fastgrad", "fastgrad", _with_loss_error(_lce_step()), needs_torch=True),
            Runner("fastgrad-fused", "baseline", _with_loss_error(_lce_step(fused=True)), needs_torch=True),
            Runner("fastgrad-recompute", "baseline", _with_loss_error(_lce_step(fused=False)), needs_torch=True),
            Runner("fastgrad-fast", "baseline", _with_loss_error(_lce_step(precision="fast")), needs_torch=True),
            Runner("fastgrad-blas", "baseline", _with_loss_error(_lce_step(gemm="blas")), needs_torch=True),
            Runner("torch-fp32", "baseline", _with_loss_error(_torch_step("float32")), needs_torch=True),
            Runner("torch-bf16", "baseline", _with_loss_error(_torch_step("bfloat16")), needs_torch=True),
            Runner("torch-lce", "baseline", _with_loss_error(_torch_lce_step()), needs_torch=True),
            Runner(f"torch-lce-bcs{BT}", "baseline", _with_loss_error(_torch_lce_step(BT)), needs_torch=True),
            Runner("bound", "bound", None),
        ],
        flops=3 * 2.0 * BT * H * V,
        bytes=float(2 * 2 * (BT * H + V * H)),
        bound="gemm",
        gemm=[(BT, H, V), (BT, V, H), (V, BT, H)],
        memory=True,
        needs_torch=True,
        note="fastgrad.torch.linear_cross_entropy forward+backward (default: the schedule rule — fused "
        "when its held gradients fit 1/4 of the available memory —, the GEMM "
        "engine of fastgrad.gemm_engine()); fastgrad-fused: fused=True (3 GEMMs, the fp32 [V, H] "
        "gradient held); fastgrad-recompute: fused=False (4 GEMMs, no fp32 [V, H]); "
        "torch-lce: PyTorch's F.linear_cross_entropy with LinearCrossEntropyOptions() (its defaults); "
        f"torch-lce-bcs{BT}: batch_chunk_size={BT} (its best measured at the Qwen2.5 head); "
        "loss_err_fp64: |loss - float64 loss| of the same bf16 values; "
        "fastgrad-fast: precision='fast' (dloss/dlogits rounded to bf16 with its mean "
        "error restored, all four GEMMs on the bf16 kernel where the CPU has AVX-512 BF16); "
        "fastgrad-blas: the default on NumPy's BLAS; flops = the 3 GEMMs of one "
        "materialized step; bound: those GEMMs in fp32 (NumPy's BLAS)",
    )


# ------------------------------------------------------------------------------ table ----


def all_cases(quick: bool = False) -> list:
    """Every benchmark case (LLM-sized, or small with ``quick``)."""
    cases = []
    if quick:
        for dtype in ("bfloat16",):
            cases += _flce_cases(128, 64, 2048, dtype, quick)
        cases += _flce_cases(128, 64, 2048, "float16", quick, grad_only=True)
        cases.append(_fce_case(256, 4096, "bfloat16"))
        for dtype in ("float32", "bfloat16"):
            cases.append(_ce_case(512, 4096, dtype))
        cases.append(_softmax_case(2, 4, 128, 128, "float16"))
        for dtype in ("float32", "bfloat16"):
            cases.append(_smooth_l1_case(1 << 20, dtype))
        for dtype in ("float32", "bfloat16"):
            cases.append(_embedding_case(1024, 4096, 256, dtype))
        cases.append(_train_step_case(128, 64, 2048))
        cases += _sparse_flce_cases(256, 64, 4096, "bfloat16")
        cases.append(_filtered_train_step_case(256, 64, 4096))
        return cases
    for BT, H, V in ((2048, 896, 151936), (1024, 896, 32000)):
        cases += _flce_cases(BT, H, V, "bfloat16", quick)
    for BT, H, V in ((2048, 896, 151936), (1024, 896, 32000)):
        cases += _flce_cases(BT, H, V, "float16", quick, grad_only=True)
    cases.append(_fce_case(2048, 32000, "bfloat16"))
    for dtype in ("float32", "bfloat16"):
        cases.append(_ce_case(4096, 32000, dtype))
    cases.append(_softmax_case(4, 16, 512, 512, "float16"))
    for dtype in ("float32", "bfloat16"):
        cases.append(_smooth_l1_case(16 * 2**20, dtype))
    for dtype in ("float32", "bfloat16"):
        cases.append(_embedding_case(8192, 32000, 1024, dtype))
    cases.append(_train_step_case(2048, 896, 151936))
    cases += _sparse_flce_cases(2048, 896, 151936, "bfloat16")
    cases.append(_filtered_train_step_case(2048, 896, 151936))
    return cases


def select(cases: list[Case], ops: Sequence[str]) -> list[Case]:
    """Cases picked by ``ops``, a list of words (``--ops``'s comma-separated pieces): an op name
    or an alias (:data:`ALIASES`) selects that op's cases; a case id (``--list`` prints them;
    split at its own commas, its pieces are joined back) selects that case only; any other word
    selects the cases whose id contains it.  All cases when ``ops`` is empty.  Case-insensitive."""
    if not ops:
        return list(cases)
    ids = {c.id.lower() for c in cases}
    ops_known = {c.op for c in cases} | set(ALIASES.values())
    words = [o.strip().lower() for o in ops]
    exact_ops, exact_ids, sub = set(), set(), []
    i = 0
    while i < len(words):
        # the longest run of pieces from here that is a case id ("…/BT=2048,H=896,V=151936")
        j = next((j for j in range(len(words), i, -1) if ",".join(words[i:j]) in ids), None)
        if j is not None:
            exact_ids.add(",".join(words[i:j]))
            i = j
            continue
        o = words[i]
        i += 1
        if o in ALIASES or o in ops_known:
            exact_ops.add(ALIASES.get(o, o))
        elif o:
            sub.append(o)
    return [c for c in cases if c.op in exact_ops or c.id.lower() in exact_ids or any(w in c.id.lower() for w in sub)]


def find_case(case_id: str, quick: bool) -> Case:
    for c in all_cases(quick):
        if c.id == case_id:
            return c
    raise KeyError(case_id)
