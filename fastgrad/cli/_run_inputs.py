"""The main job's inputs: resolving and checking the arguments, the memory estimate from the
plan, materializing the inputs, the BLAS rate (``fastgrad/cli/run.py``)."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import checkpoint as ck
from ._common import CliError, _missing_dirs, _prepare_out, _remove_dir_if_empty, probe_write  # noqa: F401 (re-exported)
from ._run_args import (
    DEFAULT,
    DEFAULT_SAMPLES,
    GOLDEN_CHUNK_BYTES,
    JIT_ALLOWANCE,
    OUT_SLACK_BYTES,
    RUN_DTYPES,
    MiB,
    fmt_bytes,
    memory_limit_bytes,
    rss_bytes,
)

# ------------------------------------------------------------------ inputs: resolve, validate


@dataclass
class Job:
    args: argparse.Namespace
    dtype: np.dtype
    BT: int
    H: int
    V: int
    w_src: Any = None  # array (maybe memory-mapped) or None (generated)
    x_src: Any = None
    t_src: Any = None
    sources: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    bounds: list = field(default_factory=list)
    estimate: dict = field(default_factory=dict)
    out_created: bool = False  # --out did not exist before this run (removed if nothing is written)
    out_dirs_made: list = field(default_factory=list)  # --out and its parents this run created


def _float_matrix(a: np.ndarray, flag: str, what: str) -> None:
    from ..dtypes import BFLOAT16

    if not (a.dtype.kind == "f" or a.dtype == BFLOAT16):
        raise CliError(flag, f"a floating-point {what} (bfloat16, float16, float32 or float64)", f"dtype {a.dtype}")


def check_settings() -> None:
    """Read every setting the job will use from the environment now, before any work: an
    invalid value (``FASTGRAD_WORKSPACE_MB=abc``, ``FASTGRAD_GEMM=mkl``, ``FASTGRAD_STRICT=maybe``)
    raises ``AclnnParamError`` naming the variable (one line, exit 2)."""
    from .. import _config, _outcache, tiling

    tiling.workspace_budget()
    _config.gemm_setting()
    _config.is_strict()
    _outcache.output_cache_limit()


def _given(args, name) -> bool:
    return getattr(args, name) is not None


def resolve(args) -> Job:
    """Validate every flag and file and find the shapes, allocating nothing big (files are
    memory-mapped)."""
    from ..dtypes import parse_dtype

    check_settings()
    srcs = [f for f in ("model", "safetensors", "weight") if _given(args, f)]
    if len(srcs) > 1:
        raise CliError(f"--{srcs[1]}", "at most one of --model, --safetensors, --weight", "--" + " and --".join(srcs))
    if args.tensor is not None and srcs[:1] not in (["model"], ["safetensors"]):
        raise CliError("--tensor", "--safetensors CKPT or --model DIR to name a tensor of", "no checkpoint")
    sources, notes = {}, []
    files: list[str] = []  # the files the inputs are read from (--out must not replace one)
    w = None
    if args.model is not None:
        md = ck.open_model_dir(args.model)
        name = args.tensor or md.head
        if name is None and md.candidates:
            raise CliError(
                "--model",
                "one LM head in the checkpoint",
                f"{args.model!r} with {len(md.candidates)} ({ck._list(md.candidates)})",
                hint="name it with --tensor",
            )
        if name is None:
            raise CliError(
                "--model",
                "an LM head in the checkpoint (lm_head.weight, or a tied input embedding "
                "such as model.embed_tokens.weight / embeddings.word_embeddings.weight)",
                f"{args.model!r} with {ck._list(md.tensors)}",
                hint="; ".join([*md.notes, "name it with --tensor"]),
            )
        if name not in md.tensors:
            raise CliError("--tensor", f"a tensor of {args.model!r} ({ck._list(md.tensors)})", repr(name))
        w = ck.load_tensor(md.tensors[name], "--model")
        files += [md.tensors[name].file]
        arch = ck.model_arch(md)
        tied = " (tied input embedding)" if md.tied and not args.tensor else ""
        for what in ck.head_transforms(md, name):
            notes.append(
                f"{what} is not applied: the op's loss is the cross-entropy of the plain logits "
                "x·Wᵀ (the model's own loss differs)"
            )
        sources["weight"] = f"{args.model} ({arch}): {name}{tied} from {os.path.basename(md.tensors[name].file)}"
        cv, ch = ck.model_dims(md)
        if w.ndim == 2 and ch is not None and ch != w.shape[1]:
            raise CliError("--model", f"{name} of shape [V, hidden_size={ch}] (config.json)", f"shape {list(w.shape)}")
        if w.ndim == 2 and cv is not None and cv != w.shape[0]:
            notes.append(f"config.json says vocab_size={cv}; {name} has {w.shape[0]} rows (used as V)")
    elif args.safetensors is not None:
        st = ck.SafetensorsFile(args.safetensors, "--safetensors")
        name = args.tensor
        if name is None:
            name = next((n for n in ck.HEAD_NAMES + ck.TIED_NAMES if n in st.tensors), None)
            if name is None:
                raise CliError(
                    "--tensor",
                    f"the LM head's name (no lm_head.weight or tied embedding in "
                    f"{args.safetensors!r}; it has {ck._list(st.names())})",
                    "none",
                )
        elif name not in st.tensors:
            raise CliError("--tensor", f"a tensor of {args.safetensors!r} ({ck._list(st.names())})", repr(name))
        w = st.load(name, "--safetensors")
        sources["weight"] = f"{args.safetensors}:{name}"
        files.append(args.safetensors)
    elif args.weight is not None:
        w, sources["weight"] = ck.load_array_arg(args.weight, "--weight")
        files.append(ck.spec_path(args.weight))
    wflag = "--" + (srcs[0] if srcs else "weight")
    if w is not None:
        _float_matrix(w, wflag, "[V, H] matrix")
        if w.ndim != 2:
            raise CliError(wflag, "a 2-D [V, H] weight matrix", f"shape {list(w.shape)}")
        if w.shape[0] < 1 or w.shape[1] < 1:
            raise CliError(wflag, "a non-empty [V, H] weight (V >= 1, H >= 1)", f"shape {list(w.shape)}")
        V, H = int(w.shape[0]), int(w.shape[1])
        for flag, val, have in (("--vocab", args.vocab, V), ("--hidden", args.hidden, H)):
            if val is not None and val != have:
                raise CliError(flag, f"the loaded weight's {have} (or leave it out)", val)
    else:
        V = int(args.vocab if args.vocab is not None else DEFAULT["vocab"])
        H = int(args.hidden if args.hidden is not None else DEFAULT["hidden"])
        sources["weight"] = "generated N(0, 1/H)"
    # dtype
    if args.dtype is not None:
        dtype = parse_dtype(args.dtype)
    elif w is not None and str(w.dtype) in RUN_DTYPES:
        dtype = w.dtype
    elif w is not None:
        dtype = parse_dtype("float32")
        notes.append(f"weight is {w.dtype}: run in float32 (--dtype to choose)")
    else:
        dtype = parse_dtype(DEFAULT["dtype"])
    if w is not None and w.dtype != dtype:
        notes.append(f"weight cast from {w.dtype} to {dtype}")
    # input
    x = None
    if args.input is not None:
        x, sources["input"] = ck.load_array_arg(args.input, "--input", ck.INPUT_NAMES)
        files.append(ck.spec_path(args.input))
        _float_matrix(x, "--input", "[BT, H] array")
        if x.ndim < 2 or x.shape[-1] != H:
            raise CliError(
                "--input", f"hidden states [BT, {H}] or [B, T, {H}] (H = the weight's {H})", f"shape {list(x.shape)}"
            )
        x = x.reshape(-1, H)
        if x.shape[0] < 1:
            raise CliError("--input", "at least one row", f"shape {list(x.shape)}")
        if args.bt is not None and args.bt != x.shape[0]:
            raise CliError("--bt", f"--input's {x.shape[0]} rows (or leave it out)", args.bt)
        BT = int(x.shape[0])
        if x.dtype != dtype:
            notes.append(f"input cast from {x.dtype} to {dtype}")
    else:
        BT = int(args.bt if args.bt is not None else DEFAULT["bt"])
        sources["input"] = "generated N(0, 1)"
    # target
    t = None
    if args.target is not None:
        t, sources["target"] = ck.load_array_arg(args.target, "--target", ck.TARGET_NAMES)
        files.append(ck.spec_path(args.target))
        if t.dtype.kind not in "iu":
            raise CliError("--target", "integer token ids", f"dtype {t.dtype}")
        t = t.reshape(-1)
        if t.shape[0] != BT:
            raise CliError(
                "--target",
                f"{BT} ids (one per row of " + ("--input" if x is not None else "--bt") + ")",
                f"{t.shape[0]} (shape {list(np.shape(t))})",
            )
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= V:
            bad = int(np.argmax((t < 0) | (t >= V)))
            raise CliError(
                "--target",
                f"ids in [0, V={V})",
                f"{int(t[bad])} at row {bad}",
                hint="drop ignored (-100) positions first" if lo < 0 else "",
            )
    else:
        sources["target"] = "generated uniform"
    if args.shards > V:
        raise CliError("--shards", f"1..{V} (at least one vocabulary row per shard, V={V})", args.shards)
    if args.filter_eps is not None and args.mode != "memory-saving":
        raise CliError(
            "--filter-eps",
            "--mode memory-saving (filtering skips blocks of the recomputed logits)",
            f"--mode {args.mode}",
        )
    from .._config import max_threads

    if args.threads is not None and args.threads > max_threads():
        raise CliError(
            "--threads", f"1..{max_threads()} (the CPUs this process may use, NUMBA_NUM_THREADS)", args.threads
        )
    if args.samples is None:
        args.samples = min(DEFAULT_SAMPLES, BT, V)
    if args.samples > min(BT, V):
        raise CliError(
            "--samples",
            f"at most min(BT, V) = {min(BT, V)} (N sampled rows of the {BT} and N vocabulary rows of the {V})",
            args.samples,
        )
    if args.check and args.samples == 0:
        raise CliError("--check", "--samples >= 1 (the check compares sampled rows with the golden)", "--samples 0")
    if args.out is not None:
        _refuse_out_over_inputs(args, files)
    made = _missing_dirs(args.out) if args.out is not None else []
    created = _prepare_out(args.out) if args.out is not None else False
    bounds = [int(b) for b in np.linspace(0, V, args.shards + 1).round()]
    job = Job(args, np.dtype(dtype), BT, H, V, w, x, t, sources, notes, bounds, out_created=created)
    job.out_dirs_made = made if created else []
    return job


def out_file_names(args) -> list[str]:
    """The files ``--out`` receives (each written as ``NAME.part``, then renamed)."""
    names = ["results.safetensors"] if args.out_format == "safetensors" else [n + ".npy" for n in OUTPUT_TENSORS]
    return names + ["report.json"]


def _refuse_out_over_inputs(args, files: list[str]) -> None:
    """``--out`` must not replace a file the job reads (``--input OUT/results.safetensors:grad_input
    --out OUT``): the user's file would be overwritten by the results."""
    inputs = [f for f in files if os.path.isfile(f)]
    for name in out_file_names(args):
        for p in (os.path.join(args.out, name), os.path.join(args.out, name + ".part")):
            hit = next((f for f in inputs if os.path.exists(p) and os.path.samefile(p, f)), None)
            if hit is not None:
                raise CliError(
                    "--out",
                    "a directory whose results do not replace an input file",
                    repr(args.out),
                    hint=f"{p!r} would overwrite {hit!r}, which this job reads: choose another --out",
                )


def remove_made_dirs(job: Job) -> None:
    """Remove ``--out`` and the parents this run made for it, deepest first, while empty."""
    for d in job.out_dirs_made or [job.args.out]:
        try:
            os.rmdir(d)
        except OSError:
            return


def check_writable_file(path: str, flag: str) -> None:
    """A file ``flag`` writes at the end: not a directory, and its nearest existing ancestor a
    directory that takes a new file (missing directories are created at the end).  Checked
    before any work; the check leaves nothing behind."""
    if os.path.isdir(path):
        raise CliError(flag, "a file path", repr(path), hint="a directory")
    _check_dir_writable(os.path.dirname(os.path.abspath(path)), flag, repr(path))


def _check_dir_writable(d: str, flag: str, given: str) -> None:
    while not os.path.exists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise CliError(flag, "a path under a directory", given, hint=f"{d!r} is a file")
    e = probe_write(d)
    if e is not None:
        raise CliError(flag, "a writable location", given, hint=f"{d!r}: {e.strerror or e}")


#: The tensors ``--out`` receives (``run_job``'s), as ``NAME.npy`` or in ``results.safetensors``.
OUTPUT_TENSORS = ("grad_input", "grad_weight", "loss", "logits_max", "sum_exp_logits", "predicted_logits", "target")


def check_out_files(job: Job) -> None:
    """Every file ``--out`` will receive can be written there: none is an existing directory
    (``OUT/results.safetensors/``), checked before the work, not after it."""
    path = job.args.out
    if path is None:
        return
    for name in out_file_names(job.args):
        f = os.path.join(path, name)
        for p in (f, f + ".part"):
            if os.path.isdir(p):
                raise CliError(
                    "--out", f"a directory where {name} can be written", repr(path), hint=f"{p!r} is a directory"
                )


def output_bytes(job: Job) -> int:
    """Bytes ``--out`` will write: the seven tensors, report.json and headers."""
    BT, H, V, isz = job.BT, job.H, job.V, job.dtype.itemsize
    return V * H * isz + BT * H * isz + 4 * BT * 4 + BT * 8 + OUT_SLACK_BYTES


def check_out_space(job: Job) -> None:
    """``--out`` must have room for the results before any work (the job is not run to fail at
    the end)."""
    import shutil

    path = job.args.out
    if path is None:
        return
    need = output_bytes(job)
    free = shutil.disk_usage(path).free
    if free < need:
        raise CliError(
            "--out",
            f"a directory with room for the results (about {fmt_bytes(need)})",
            f"{path!r} on a filesystem with {fmt_bytes(free)} free",
        )


# ------------------------------------------------------------------ memory estimate (from the plan)


def _plans(BT, Vs, H, mode, dtype, budget_bytes=None):
    """The two ops' tile plans for the job, with the GEMMs the ops will choose (their buffer
    lists are the scratch estimate: ``tiling.lm_head_buffers``)."""
    import fastgrad

    fwd = fastgrad.plan("fused_linear_online_max_sum", BT, Vs, H, dtype=dtype, budget_bytes=budget_bytes)
    bwd_mode = "memory_saving" if mode == "memory-saving" else "high_performance"
    bwd = fastgrad.plan(
        "fused_linear_cross_entropy_loss_grad", BT, Vs, H, dtype=dtype, mode=bwd_mode, budget_bytes=budget_bytes
    )
    return fwd, bwd


def estimate_memory(job: Job, budget_bytes: int | None = None, shards: int | None = None) -> dict:
    """Peak RSS the job will reach, from the tile plans: inputs + outputs + the largest phase's
    scratch + the process's RSS now + the JIT allowance."""
    BT, H, V, isz = job.BT, job.H, job.V, job.dtype.itemsize
    shards = shards or job.args.shards
    Vs = -(-V // shards)
    fwd, bwd = _plans(BT, Vs, H, job.args.mode, job.dtype, budget_bytes)
    hp = job.args.mode == "high-performance"
    inputs = BT * H * isz + V * H * isz + BT * 8 + BT * 4
    for src in (job.w_src, job.x_src):  # a cast reads the whole file through the mapping
        if src is not None and src.dtype != job.dtype:
            inputs += src.nbytes
    outputs = V * H * isz + BT * H * isz + 6 * BT * 4 + shards * (BT + (BT + 7) // 8)
    if shards > 1:
        outputs += 2 * BT * H * 4  # fp32 grad_input accumulator and one shard's
    fwd_s = fwd.workspace_bytes + (BT * Vs * isz if hp else 0)
    bwd_s = bwd.workspace_bytes + (BT * Vs * (isz + 4) if hp else 0)  # logits + softmax
    nrow = job.args.samples
    chunk = min(V, max(256, GOLDEN_CHUNK_BYTES // (8 * H)))
    golden_s = (
        max(2 * chunk * H * 8 + nrow * chunk * 8 * 4, BT * H * 8 + 4 * BT * (2 * nrow + 2) * 8)
        if job.args.samples
        else 0
    )
    base = rss_bytes() + JIT_ALLOWANCE
    scratch = max(fwd_s, bwd_s, golden_s)
    return {
        "total_bytes": base + inputs + outputs + scratch,
        "base_bytes": base,
        "inputs_bytes": inputs,
        "outputs_bytes": outputs,
        "scratch_bytes": scratch,
        "forward_scratch_bytes": fwd_s,
        "backward_scratch_bytes": bwd_s,
        "golden_scratch_bytes": golden_s,
        "plan_forward": _plan_dict(fwd),
        "plan_backward": _plan_dict(bwd),
    }


def _plan_dict(p) -> dict:
    return {
        "bt_tile": p.bt_tile,
        "v_tile": p.v_tile,
        "n_tiles": p.n_tiles,
        "workspace_bytes": p.workspace_bytes,
        "budget_bytes": p.budget_bytes,
    }


def check_fits(job: Job) -> None:
    est = estimate_memory(job)
    job.estimate = est
    if job.args.memory_limit_mb is not None:
        limit, src = int(job.args.memory_limit_mb * MiB), "--memory-limit-mb"
    else:
        limit, src = memory_limit_bytes()
    est["limit_bytes"], est["limit_source"] = limit, src
    if est["total_bytes"] <= limit:
        return
    if src == "--memory-limit-mb" and limit < est["base_bytes"]:
        raise CliError(
            "--memory-limit-mb",
            f"at least the job's peak: it needs about {fmt_bytes(est['total_bytes'])}, and this process "
            f"alone is already {fmt_bytes(rss_bytes())} (+ {fmt_bytes(JIT_ALLOWANCE)} for the compiled kernels) "
            "before the job allocates anything",
            f"{job.args.memory_limit_mb:g}",
        )
    parts = (
        f"inputs {fmt_bytes(est['inputs_bytes'])} + outputs {fmt_bytes(est['outputs_bytes'])} + "
        f"scratch {fmt_bytes(est['scratch_bytes'])} + process and JIT {fmt_bytes(est['base_bytes'])}"
    )
    head = f"the job needs about {fmt_bytes(est['total_bytes'])} ({parts}) but {src} allows {fmt_bytes(limit)}"
    fixed = est["total_bytes"] - est["scratch_bytes"]
    fixes = []
    if fixed < limit:
        for mb in (128, 64, 32, 16, 8, 4, 2, 1):
            if estimate_memory(job, budget_bytes=mb * MiB)["total_bytes"] <= limit:
                fixes.append(f"--workspace-mb {mb}")
                break
        if job.args.mode == "high-performance":
            for k in (2, 4, 8, 16, 32, 64, 128, 256):
                if k <= job.V and estimate_memory(job, shards=k)["total_bytes"] <= limit:
                    fixes.append(f"--shards {k}")
                    break
            fixes.append("--mode memory-saving")
    if fixes:
        raise CliError(f"{head}; " + " or ".join(fixes) + " would fit")
    raise CliError(
        f"{head}; no --workspace-mb or --shards makes it fit (inputs and outputs "
        f"alone need {fmt_bytes(fixed)}): use a smaller --bt / --vocab / --hidden"
    )


# ------------------------------------------------------------------ inputs: materialize


def _random_matrix(rng, rows, cols, dtype, scale, chunk=8192):
    """Gaussian matrix generated chunk by chunk straight into ``dtype`` (no full fp32 temp)."""
    out = np.empty((rows, cols), dtype)
    for r0 in range(0, rows, chunk):
        r1 = min(r0 + chunk, rows)
        out[r0:r1] = (rng.standard_normal((r1 - r0, cols), dtype=np.float32) * scale).astype(dtype)
    return out


def _materialize(src, dtype, flag: str, chunk: int = 8192) -> np.ndarray:
    """A C-contiguous ``dtype`` copy of a (memory-mapped) source, checked finite, chunk by chunk."""
    out = np.empty(src.shape, dtype)
    for r0 in range(0, src.shape[0], chunk):
        blk = np.asarray(src[r0 : r0 + chunk])
        if blk.dtype.kind == "f" and blk.dtype != dtype and np.dtype(dtype).itemsize < blk.dtype.itemsize:
            with np.errstate(over="ignore"):
                conv = blk.astype(dtype)
        else:
            conv = blk.astype(dtype)
        fin = np.isfinite(conv)
        if not fin.all():
            r, c = np.argwhere(~fin)[0]
            why = "overflows " + str(dtype) if np.isfinite(blk[r, c]) else "is not finite"
            raise CliError(flag, f"finite values representable in {dtype}", f"{blk[r, c]} at [{r0 + r}, {c}] ({why})")
        out[r0 : r0 + chunk] = conv
    return out


def load_inputs(job: Job):
    rng = np.random.default_rng(job.args.seed)
    dt = job.dtype
    if job.w_src is not None:
        w = _materialize(
            job.w_src,
            dt,
            "--" + next(f for f in ("model", "safetensors", "weight") if getattr(job.args, f) is not None),
        )
        job.w_src = None  # drop the file mapping
    else:
        w = _random_matrix(rng, job.V, job.H, dt, 1.0 / np.sqrt(job.H))
    if job.x_src is not None:
        x = _materialize(job.x_src, dt, "--input")
        job.x_src = None
    else:
        x = _random_matrix(rng, job.BT, job.H, dt, 1.0)
    if job.t_src is not None:
        t = np.ascontiguousarray(job.t_src, dtype=np.int64)
        job.t_src = None
    else:
        t = rng.integers(0, job.V, job.BT).astype(np.int64)
    grad = np.full(job.BT, 1.0 / job.BT, np.float32)  # d(mean loss)/d(loss_r)
    return x, w, t, grad


# ------------------------------------------------------------------ BLAS rate on the spot


def measure_blas_gflops(BT: int, H: int, threads: int, seconds: float = 0.5, reps: int = 12) -> float:
    """fp32 GEMM rate of NumPy's BLAS at this problem's shape ([BT,H]·[H,2048]): the best of
    ``reps`` calls, or of as many as fit in ``seconds``."""
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
        for _ in range(reps):
            if time.perf_counter() > t_end:
                break
            t0 = time.perf_counter()
            np.matmul(a, b.T, out=c)
            best = min(best, time.perf_counter() - t0)
    return 2.0 * m * n * H / best / 1e9
