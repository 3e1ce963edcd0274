"""``fastgrad`` — the main job: a large-vocabulary LM-head gradient on a workstation.

Runs the companion forward (:func:`fastgrad.fused_linear_online_max_sum`, the shard statistics
combined with :func:`fastgrad.vocab_parallel.combine_shard_statistics`,
:func:`fastgrad.fused_cross_entropy_loss_with_max_sum`) and the fused linear cross-entropy
gradient (:func:`fastgrad.fused_linear_cross_entropy_loss_grad`) — public ops only — at a real
model's LM-head shape, by default Qwen2.5-0.5B's (V = 151,936, H = 896, BT = 2048, bf16), in
memory-saving mode.  Before any work it validates every flag, file and environment setting,
estimates the peak memory from the tile plan (refusing a job that does not fit) and checks
``--out`` (writable, room for the results).  It then reports as it goes, flushing each line (a
redirected stdout shows progress): the header, inputs and memory estimate; the time estimate
(the job's FLOPs over the BLAS rate measured on the spot; a job above ``CONFIRM_ABOVE_S`` asks,
or needs ``--yes``); one row per phase as it ends (time, the phase's peak RSS beside the
process's true peak, ``VmHWM``); then GFLOP/s, memory, and the error of N sampled rows and N
vocabulary rows against the float64 golden (the reference backend on row / vocabulary-row
subsets: no matrix is widened whole).  SIGINT/SIGTERM print the partial report.

Exit status: 0 done, 1 ``--check`` failed, 2 bad usage / file / shape / value / setting, a job
that does not fit or a failed write (after the report; partial files removed), 3 internal error
(``--debug`` shows tracebacks), 130/143 interrupted by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..benchmarks.report import json_default
from ..benchmarks.timing import current_rss, peak_rss
from . import checkpoint as ck
from ._common import CliError, OneLineParser, add_device_options, enter_device, refuse_missing_kernel, subcommand_epilog

MiB = 2**20
DEFAULT: dict[str, Any] = dict(bt=2048, hidden=896, vocab=151936, dtype="bfloat16")
#: Interpreter, Numba/LLVM and the compiled kernels: what the estimate adds to the RSS measured
#: before the job (measured: ~80-150 MiB for the JIT, its caches and the bf16 kernel on top of the imports).
JIT_ALLOWANCE = 160 * MiB
#: Vocabulary rows per golden-check chunk: at most this many bytes of float64 weight at a time.
GOLDEN_CHUNK_BYTES = 32 * MiB
RUN_DTYPES = ("bfloat16", "float16", "float32")
#: Rows and vocabulary rows of the golden check when --samples is not given.
DEFAULT_SAMPLES = 8
#: Jobs estimated to take longer than this ask for confirmation (``--yes`` skips the question).
CONFIRM_ABOVE_S = 600.0
#: What the output directory needs beyond the tensors: report.json, the safetensors header.
OUT_SLACK_BYTES = 1 * MiB


# ------------------------------------------------------------------ memory: RSS, peaks


#: this process's RSS now / its high-water mark (``VmHWM``: never ``ru_maxrss``, see ``peak_rss``)
rss_bytes = current_rss
process_peak_bytes = peak_rss


class PhaseMemory:
    """Samples RSS every few ms on a thread: the phase's own peak, without touching the kernel's
    high-water mark."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def __enter__(self):
        self.peak = rss_bytes()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def _loop(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        if self._t is not None:
            self._t.join()
        self.peak = max(self.peak, rss_bytes())
        return False


def memory_limit_bytes() -> tuple[int, str]:
    """What this process may grow to: available memory + its own RSS, capped by a cgroup limit."""
    import psutil

    limit = int(psutil.virtual_memory().available) + rss_bytes()
    src = "available memory"
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            v = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            cur = int(f.read().strip())
        if v != "max" and int(v) - cur + rss_bytes() < limit:
            limit, src = int(v) - cur + rss_bytes(), "the cgroup's memory.max"
    except (OSError, ValueError):
        pass
    return limit, src


def fmt_bytes(n: float) -> str:
    n = float(n)
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MiB:.0f} MiB"


# ------------------------------------------------------------------ argument types


def _int(flag: str, lo: int, hi: int | None = None):
    def parse(s: str) -> int:
        try:
            v = int(s, 0) if isinstance(s, str) else int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"expected an integer {rng}, got {s}")
        return v

    parse.__name__ = flag
    return parse


def _pos_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB > 0, got {s!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a number of MiB > 0, got {s}")
    return v


def _filter_eps_arg(s: str) -> float | str:
    if s.strip().lower() == "auto":
        return "auto"
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number in (0, 1], got {s!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected auto or a number in (0, 1], got {s}")
    return v


def _dtype_arg(s: str) -> str:
    from ..dtypes import DTYPE_ALIASES, dtype_name

    dt = DTYPE_ALIASES.get(s.strip().lower())
    name = dtype_name(dt) if dt is not None else None
    if name not in RUN_DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of float32 (fp32), bfloat16 (bf16), float16 (fp16), got {s!r}")
    return name


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        from .._version import __version__

        try:  # the installed version, without importing Numba (seconds): `fastgrad --version` is instant
            numba_version = version("numba")
        except PackageNotFoundError:
            numba_version = "not installed"
        print(
            f"fastgrad {__version__} (numpy {np.__version__}, numba {numba_version}, "
            f"Python {platform.python_version()})"
        )
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="fastgrad",
        description="The main job: the large-vocabulary LM-head gradient (aclnnFusedLinearCrossEntropyLossGrad)\n"
        "on the CPU, in bounded memory, checked against a float64 golden.\n"
        "Exit status: 0 done, 1 --check failed, 2 bad usage/file/value or the job does not fit,\n"
        "3 internal error.",
        epilog=subcommand_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_Version)
    g = p.add_argument_group("shape and precision (generated data)")
    g.add_argument("--bt", type=_int("--bt", 1), default=None, help="tokens (rows), default 2048 or --input's")
    g.add_argument(
        "--hidden", type=_int("--hidden", 1), default=None, help="hidden size H, default 896 or the weight's"
    )
    g.add_argument(
        "--vocab", type=_int("--vocab", 1), default=None, help="vocabulary V, default 151936 or the weight's"
    )
    g.add_argument(
        "--dtype",
        type=_dtype_arg,
        default=None,
        help="float32 | bfloat16 | float16 (aliases fp32, bf16, fp16); default the loaded weight's "
        "(bfloat16 for generated data)",
    )
    g.add_argument("--seed", type=_int("--seed", 0), default=0, help="seed of generated data and of the sampling")
    r = p.add_argument_group("real data")
    r.add_argument(
        "--model",
        metavar="DIR",
        help="Hugging Face model directory (config.json + safetensors, "
        "single or sharded): its LM head (lm_head.weight, else the tied input embedding)",
    )
    r.add_argument("--safetensors", metavar="CKPT", help="a .safetensors file to take the LM head from")
    r.add_argument(
        "--tensor", help="tensor name in --safetensors/--model (default: lm_head.weight, else the tied embedding)"
    )
    r.add_argument("--weight", metavar="NPY", help="LM-head weight [V, H] (.npy or FILE.safetensors[:NAME])")
    r.add_argument(
        "--input", metavar="FILE", help="hidden states [BT, H] or [B, T, H] (.npy or FILE.safetensors[:NAME])"
    )
    r.add_argument(
        "--target", metavar="FILE", help="target ids [BT] or [B, T] in [0, V) (.npy or FILE.safetensors[:NAME])"
    )
    r.add_argument(
        "--list-tensors", metavar="CKPT", help="list the tensors of a .safetensors file or model directory and exit"
    )
    j = p.add_argument_group("job")
    j.add_argument(
        "--mode",
        default="memory-saving",
        choices=["memory-saving", "high-performance"],
        help="memory-saving (default): recompute the logits tile by tile, never [BT, V]; "
        "high-performance: hold a shard's [BT, V] logits and softmax",
    )
    j.add_argument(
        "--filter-eps",
        type=_filter_eps_arg,
        default=None,
        metavar="{auto,FLOAT}",
        help="gradient filtering (memory-saving mode): skip the gradient GEMMs of blocks whose "
        "every |softmax - onehot| is below it; auto = the dtype's eps/32 (CCE's)",
    )
    j.add_argument(
        "--threads", type=_int("--threads", 1), default=None, help="threads, 1..the CPUs available (default: all)"
    )
    j.add_argument(
        "--shards",
        type=_int("--shards", 1),
        default=1,
        help="vocabulary shards, run in turn and combined as the all-reduce would (1..V)",
    )
    j.add_argument(
        "--workspace-mb",
        type=_pos_float,
        default=None,
        help="scratch budget of the tile plans in MiB (default FASTGRAD_WORKSPACE_MB or 256)",
    )
    j.add_argument(
        "--memory-limit-mb",
        type=_pos_float,
        default=None,
        help="refuse jobs whose estimated peak exceeds this (default: available memory)",
    )
    # no --strict: the job accumulates shards in fp32 outputs (out=), a documented extension that
    # strict mode refuses; FASTGRAD_STRICT is recorded as it is
    d = p.add_argument_group("device (recorded in report.json)")
    add_device_options(d, strict=False)
    o = p.add_argument_group("checks and output")
    o.add_argument(
        "--samples",
        type=_int("--samples", 0),
        default=None,
        help="golden check on N sampled rows and N sampled vocabulary rows, N <= min(BT, V) "
        "(default 8, or min(BT, V) when smaller; 0: no check)",
    )
    o.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when the sampled golden error exceeds the Ascend single-benchmark threshold",
    )
    o.add_argument(
        "--out", metavar="DIR", help="write grad_input, grad_weight, loss and statistics there, with report.json"
    )
    o.add_argument(
        "--out-format",
        default="safetensors",
        choices=["safetensors", "npy"],
        help="results.safetensors (default) or one .npy per tensor",
    )
    o.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help=f"run a job estimated above {CONFIRM_ABOVE_S / 60:.0f} min without asking "
        "(without it such a job asks on a terminal and is refused when stdin is not one)",
    )
    o.add_argument(
        "--json", action="store_true", help="print the report as JSON on stdout (the progress lines go to stderr)"
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar (the bar is shown on a terminal only)")
    o.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


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
    w = None
    if args.model is not None:
        md = ck.open_model_dir(args.model)
        name = args.tensor or md.head
        if name is None:
            raise CliError(
                "--model",
                "an LM head in the checkpoint (lm_head.weight, or a tied input embedding "
                "such as model.embed_tokens.weight / embeddings.word_embeddings.weight)",
                f"{args.model!r} with {ck._list(md.tensors)}",
                hint="name it with --tensor",
            )
        if name not in md.tensors:
            raise CliError("--tensor", f"a tensor of {args.model!r} ({ck._list(md.tensors)})", repr(name))
        w = ck.load_tensor(md.tensors[name], "--model")
        arch = ",".join(md.config.get("architectures") or []) or md.config.get("model_type", "?")
        tied = " (tied input embedding)" if md.tied and not args.tensor else ""
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
    elif args.weight is not None:
        w, sources["weight"] = ck.load_array_arg(args.weight, "--weight")
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
    created = _prepare_out(args.out) if args.out is not None else False
    bounds = [int(b) for b in np.linspace(0, V, args.shards + 1).round()]
    return Job(args, np.dtype(dtype), BT, H, V, w, x, t, sources, notes, bounds, out_created=created)


def _prepare_out(path: str) -> bool:
    """Check ``--out`` before any work: a directory (created when missing) where a file can be
    created.  Returns True when this call created it (removed again if the job never writes)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError("--out", "a directory (created when missing)", repr(path), hint="an existing file")
    created = not os.path.exists(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CliError("--out", "a directory that can be created", repr(path), hint=e.strerror or str(e)) from None
    probe = os.path.join(path, f".fastgrad-write-test-{os.getpid()}")
    try:  # os.access says yes to root on a read-only mount: try it
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        if created:
            _remove_dir_if_empty(path)
        raise CliError("--out", "a writable directory", repr(path), hint=e.strerror or str(e)) from None
    return created


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
    probe = os.path.join(d, f".fastgrad-write-test-{os.getpid()}")
    try:  # os.access says yes to root on a read-only mount: try it
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise CliError(flag, "a writable location", given, hint=f"{d!r}: {e.strerror or e}") from None


def _remove_dir_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


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
    from .. import _config
    from ..ops._engines import lm_head_plan

    s = _config.settings()
    fwd = lm_head_plan(BT, Vs, H, "forward", dtype, s, budget_bytes=budget_bytes)
    bwd_mode = "memory_saving" if mode == "memory-saving" else "high_performance"
    return fwd, lm_head_plan(BT, Vs, H, bwd_mode, dtype, s, budget_bytes=budget_bytes)


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


# ------------------------------------------------------------------ the job


class _Bar:
    """tqdm over the tiles of one op call, fed by ``fastgrad.progress``'s ``callback(done, total)``."""

    def __init__(self, desc: str, enabled: bool):
        self.desc, self.enabled, self.last = desc, enabled, 0
        self.bar: Any = None

    def __call__(self, done: int, total: int):
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit="tile", file=sys.stderr, leave=False)
        self.bar.update(done - self.last)
        self.last = done

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _warm(fg, dtype, filter_eps=None):
    """Compile the kernels on a tiny problem so the timings exclude compilation (strict mode off:
    the device would refuse shapes this small; the job itself runs under the user's setting)."""
    with fg.strict(False):
        _warm_calls(fg, dtype, filter_eps)


def _warm_calls(fg, dtype, filter_eps=None):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4)).astype(dtype)
    w = rng.standard_normal((5, 4)).astype(dtype)
    t = np.array([0, 1, 4])
    r = fg.fused_linear_online_max_sum(x, w, t, 0, 5, return_logits=True)
    _, sm = fg.fused_cross_entropy_loss_with_max_sum(
        r.logits_max_local,
        r.sum_exp_logits_local,
        r.predicted_logits_local,
        vocab_parallel_logits=r.vocab_parallel_logits,
    )
    fg.fused_linear_cross_entropy_loss_grad(
        np.ones(3, np.float32),
        x,
        w,
        r.target_mask,
        r.masked_target,
        logits_max=r.logits_max_local,
        sum_exp_logits=r.sum_exp_logits_local,
    )
    fg.fused_linear_cross_entropy_loss_grad(np.ones(3, np.float32), x, w, r.target_mask, r.masked_target, softmax=sm)
    if filter_eps is not None:  # the filtered path (flags, gathered products), every block but the targets'
        fg.fused_linear_cross_entropy_loss_grad(
            np.ones(3, np.float32),
            x,
            w,
            r.target_mask,
            r.masked_target,
            logits_max=r.logits_max_local,
            sum_exp_logits=r.sum_exp_logits_local,
            filter_eps=1.0,
        )


#: The phase table's column heads (the rows are printed as each phase ends).
PHASE_HEADER = "  phase              time      phase peak RSS   process peak RSS (VmHWM)"


class Say:
    """The report's lines, written as soon as they are known and flushed each time, so a
    redirected or piped stdout shows them as the job goes (``print`` alone buffers a file)."""

    def __init__(self, stream=None):
        self.stream = stream

    def __call__(self, line: str = "") -> None:
        print(line, file=self.stream if self.stream is not None else sys.stdout, flush=True)


class Phases:
    """Times each phase and samples its RSS; prints its row of the report as it ends (once the
    table is open: rows that end before are printed when it opens)."""

    def __init__(self, say: Say | None = None):
        self.time: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.process_peak: dict[str, int] = {}
        self.current: tuple[str, float] | None = None  # the phase running now and its start
        self.say = say
        self.table_open = False

    def open_table(self) -> None:
        self.table_open = True
        if self.say is not None:
            self.say(PHASE_HEADER)
            for name in self.time:
                self._row(name)

    def _row(self, name: str) -> None:
        if self.say is not None:
            self.say(
                f"    {name:<16} {self.time[name]:8.3f} s  {fmt_bytes(self.peak[name]):>12}   "
                f"{fmt_bytes(self.process_peak[name]):>12}"
            )

    def run(self, name, fn, *a, **kw):
        self.current = (name, time.perf_counter())
        with PhaseMemory() as pm:
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.time[name] = time.perf_counter() - t0
        self.current = None
        self.peak[name] = pm.peak
        # VmHWM is read from per-CPU-batched RSS counters and can dip by a few pages between
        # two reads; the high-water mark itself never goes down: the running maximum
        self.process_peak[name] = max(process_peak_bytes(), *self.process_peak.values(), 0)
        if self.table_open:
            self._row(name)
        return out


def job_flops(job: Job) -> dict[str, float]:
    """The job's floating-point operations: the GEMMs of the forward and the backward, and the
    float64 golden check's (sampled rows against every vocabulary row, sampled vocabulary rows
    against every row)."""
    BT, H, V = job.BT, job.H, job.V
    hp, shards, n = job.args.mode == "high-performance", job.args.shards, job.args.samples
    # memory-saving: mm0 (recomputed logits) + mm1 + mm2; high-performance: mm1 + mm2 (+ the
    # logits recomputed per shard when there are several)
    bwd = (6.0 if not hp else (4.0 if shards == 1 else 6.0)) * BT * V * H
    return {"forward": 2.0 * BT * V * H, "backward": bwd, "golden_check": 8.0 * n * V * H + 6.0 * BT * n * H}


#: Rates the time estimate assumes beside the measured BLAS rate: random numbers generated, and
#: elements widened to float64 by the golden check, per second (conservative, 1 core).
GENERATE_PER_S = 1e8
WIDEN_PER_S = 2e8
#: Loading the compiled kernels from Numba's cache (the compile_warmup phase on a warm cache).
KERNEL_LOAD_S = 1.0


def estimate_seconds(job: Job, blas_gflops: float) -> tuple[float, str]:
    """Time the job should take, from its FLOPs over the BLAS rate measured on the spot (the
    golden check's float64 GEMMs at half of it), plus data generation and the golden check's
    widening of the weight.  Numba's compilation on a first run is not included."""
    f = job_flops(job)
    rate = max(blas_gflops, 1e-3) * 1e9
    gemm = f["forward"] + f["backward"]
    secs = gemm / rate + f["golden_check"] / (rate / 2)
    gen = (job.V * job.H if job.w_src is None else 0) + (job.BT * job.H if job.x_src is None else 0)
    secs += gen / GENERATE_PER_S
    if job.args.samples:
        secs += job.V * job.H / WIDEN_PER_S
    secs += KERNEL_LOAD_S
    detail = f"{gemm / 1e12:.3g} TFLOP of GEMMs at the fp32 BLAS rate measured now, {blas_gflops:.3g} GFLOP/s"
    kern = gemm_kernel(job.dtype)
    if kern != "BLAS sgemm":
        detail += f"; this CPU runs them on the {kern.split(' (')[0]}, usually faster"
    extra = (["generating the data"] if gen else []) + (["the float64 golden check"] if job.args.samples else [])
    if extra:
        detail += "; plus " + " and ".join(extra)
    return secs, detail + "; a first run also compiles the kernels"


def fmt_seconds(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def confirm(job: Job, est_s: float, say: Say) -> None:
    """Jobs estimated above ``CONFIRM_ABOVE_S`` run with ``--yes``, or when the user says yes on
    a terminal; without a terminal to ask they are refused (one line, exit 2), never left
    hanging on a prompt."""
    if est_s <= CONFIRM_ABOVE_S or job.args.yes:
        return
    what = f"the job is estimated at about {fmt_seconds(est_s)} (over {CONFIRM_ABOVE_S / 60:.0f} min)"
    stdin = sys.stdin
    if stdin is None or not stdin.isatty():
        raise CliError(f"{what}: pass --yes to run it (stdin is not a terminal to ask on), or use a smaller shape")
    print(f"fastgrad: {what}. Run it? [y/N] ", end="", file=sys.stderr, flush=True)
    answer = stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise Declined()


class Declined(Exception):
    """The user answered no to the confirmation."""


class Stopped(BaseException):
    """SIGTERM (or SIGINT) arrived: unwind to the partial report."""

    def __init__(self, signame: str, code: int):
        super().__init__(signame)
        self.signame, self.code = signame, code


def _on_signal(signum, frame):
    import signal

    raise Stopped(signal.Signals(signum).name, 128 + signum)


def header(job: Job, threads: int, say: Say) -> None:
    """The report's first lines, before any work: the job, its inputs, the memory estimate."""
    from .._version import __version__

    args, est = job.args, job.estimate
    say(
        f"fastgrad {__version__}: LM-head gradient, BT={job.BT} H={job.H} V={job.V} {job.dtype} "
        f"mode={args.mode} shards={args.shards} threads={threads}"
    )
    src = job.sources
    say(f"  inputs: weight {src['weight']}; input {src['input']}; target {src['target']}")
    for note in job.notes:
        say(f"  note: {note}")
    say(
        f"  memory estimated from the plan before allocating: {fmt_bytes(est['total_bytes'])} "
        f"(limit {fmt_bytes(est['limit_bytes'])}, {est['limit_source']}); backward tiles "
        f"{est['plan_backward']['bt_tile']}x{est['plan_backward']['v_tile']}, scratch "
        f"{fmt_bytes(est['plan_backward']['workspace_bytes'])}"
        + (f"; --out needs {fmt_bytes(output_bytes(job))}" if args.out is not None else "")
    )


def run_job(job: Job, ph: Phases | None = None, blas: float | None = None) -> tuple[dict, dict]:
    """Run the job's phases (``ph`` prints their rows as they end); returns (report, tensors to
    save).  ``blas``: the BLAS rate already measured (else measured here)."""
    import fastgrad as fg
    from fastgrad import vocab_parallel as vp

    from .._config import max_threads

    args = job.args
    threads = args.threads or max_threads()
    show = not args.no_progress and not args.json and sys.stderr.isatty()
    ph = ph if ph is not None else Phases()
    rss_start = rss_bytes()
    if not job.estimate:
        check_fits(job)
    if blas is None:
        blas = ph.run("blas_measure", measure_blas_gflops, job.BT, job.H, threads)
    x, w, t, grad = ph.run("load_inputs", load_inputs, job)
    BT, H, V = job.BT, job.H, job.V
    bounds, shards, hp = job.bounds, args.shards, args.mode == "high-performance"
    ph.run("compile_warmup", _warm, fg, x.dtype, args.filter_eps)
    rss_before = rss_bytes()

    # ---- forward: each shard's online max/sum, combined as the caller's all-reduce would
    def forward():
        outs = []
        for k in range(shards):
            a, b = bounds[k], bounds[k + 1]
            bar = _Bar(f"forward shard {k + 1}/{shards}", show)
            with fg.progress(bar):
                r = fg.fused_linear_online_max_sum(x, w[a:b], t, a, b, return_logits=hp and shards == 1)
            bar.close()
            outs.append(r)
        gmax, gsum, gpred = vp.combine_shard_statistics(
            [r.logits_max_local for r in outs],
            [r.sum_exp_logits_local for r in outs],
            [r.predicted_logits_local for r in outs],
            [~vp.unpack_target_mask(r.target_mask, BT) for r in outs],
        )
        loss, _ = fg.fused_cross_entropy_loss_with_max_sum(gmax, gsum, gpred)
        return outs, gmax, gsum, gpred, loss

    fwd, gmax, gsum, gpred, loss = ph.run("forward", forward)

    # ---- backward: each shard's FLCE grad with the global statistics
    filt: dict[str, Any] = {"blocks_total": 0, "blocks_skipped": 0, "filter_eps": None}

    def backward():
        gw = np.empty((V, H), x.dtype)
        if shards == 1:
            gi = np.empty((BT, H), x.dtype)
        else:
            gi_acc = np.zeros((BT, H), np.float32)
            gi_k = np.empty((BT, H), np.float32)  # the unrounded accumulator (fp32 out= extension)
        for k in range(shards):
            a, b = bounds[k], bounds[k + 1]
            r = fwd[k]
            kw = {}
            if hp:
                logits = r.vocab_parallel_logits
                if logits is None:  # several shards: recompute this shard's logits only
                    again = fg.fused_linear_online_max_sum(x, w[a:b], t, a, b, return_logits=True)
                    logits = again.vocab_parallel_logits
                    del again
                fwd[k] = r._replace(vocab_parallel_logits=None)
                _, kw["softmax"] = fg.fused_cross_entropy_loss_with_max_sum(
                    gmax, gsum, gpred, vocab_parallel_logits=logits
                )
                del logits
            else:
                kw = dict(logits_max=gmax, sum_exp_logits=gsum)
                if args.filter_eps is not None:
                    kw.update(filter_eps=args.filter_eps, return_plan=True)
            bar = _Bar(f"grad shard {k + 1}/{shards}", show)
            with fg.progress(bar):
                got = fg.fused_linear_cross_entropy_loss_grad(
                    grad, x, w[a:b], r.target_mask, r.masked_target, out=(gi if shards == 1 else gi_k, gw[a:b]), **kw
                )
            bar.close()
            if args.filter_eps is not None:
                plan = got[2]
                filt["filter_eps"] = plan.filter_eps
                filt["blocks_total"] += plan.blocks_total
                filt["blocks_skipped"] += plan.blocks_skipped
            kw.clear()
            if shards > 1:
                gi_acc += gi_k  # the caller's all-reduce of grad_input
        if shards > 1:
            del gi_k
            gi = gi_acc.astype(x.dtype)
        return gi, gw

    grad_input, grad_weight = ph.run("backward", backward)

    # ---- sampled check against the float64 golden
    golden = None
    if args.samples:
        golden = ph.run(
            "golden_check",
            golden_check,
            fg,
            vp,
            x,
            w,
            t,
            grad,
            gmax,
            gsum,
            loss,
            grad_input,
            grad_weight,
            fwd,
            bounds,
            args.samples,
            args.seed,
        )

    phases = ph.time
    flops = job_flops(job)
    flop_fwd, flop_bwd = flops["forward"], flops["backward"]
    gf_f = flop_fwd / phases["forward"] / 1e9
    gf_b = flop_bwd / phases["backward"] / 1e9
    io_bytes = x.nbytes + w.nbytes + grad_input.nbytes + grad_weight.nbytes
    est = job.estimate
    res = {
        "fastgrad": fg.__version__,
        **getattr(args, "device", {}),
        "shape": {"BT": BT, "H": H, "V": V},
        "dtype": str(x.dtype),
        "mode": args.mode,
        "shards": shards,
        "threads": threads,
        "sources": job.sources,
        "notes": job.notes,
        "phases_s": {k: round(v, 4) for k, v in phases.items()},
        "gflops": {"forward": gf_f, "backward": gf_b, "blas_fp32_measured": blas},
        "fraction_of_blas": {"forward": gf_f / blas, "backward": gf_b / blas},
        "memory": {
            "rss_start_bytes": rss_start,
            "rss_before_bytes": rss_before,
            "phase_peak_rss_bytes": dict(ph.peak),
            "process_peak_rss_bytes_after_phase": dict(ph.process_peak),
            "peak_rss_forward_bytes": ph.peak["forward"],
            "peak_rss_backward_bytes": ph.peak["backward"],
            "process_peak_rss_bytes": process_peak_bytes(),
            "inputs_outputs_bytes": io_bytes,
            "estimate": est,
            "logits_fp32_bytes_avoided": 0 if hp else 4 * BT * V,
            "logits_and_softmax_bytes_held": (BT * (-(-V // shards)) * (x.dtype.itemsize + 4)) if hp else 0,
        },
        "loss_mean": float(np.mean(loss, dtype=np.float64)),
        "gemm_kernel": gemm_kernel(x.dtype),
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
        },
    }
    if args.filter_eps is not None:
        res["filter"] = dict(filt, fraction_skipped=filt["blocks_skipped"] / max(filt["blocks_total"], 1))
    if golden is not None:
        res["max_error_vs_golden"] = golden["errors"]
        res["check"] = golden["check"]
    tensors = {
        "grad_input": grad_input,
        "grad_weight": grad_weight,
        "loss": loss,
        "logits_max": gmax,
        "sum_exp_logits": gsum,
        "predicted_logits": gpred,
        "target": t,
    }
    return res, tensors


# ------------------------------------------------------------------ golden check (sampled)


def sample_indices(rng, n: int, k: int, first) -> np.ndarray:
    """``k`` distinct indices in ``[0, n)`` (``k <= n``), sorted: the ones in ``first`` (in their
    order, duplicates dropped) before random ones."""
    extra = rng.choice(n, size=min(n, k + len(first)), replace=False)
    picked = list(dict.fromkeys(int(i) for i in (*first, *extra)))[:k]
    return np.array(sorted(picked), dtype=np.int64)


def golden_check(fg, vp, x, w, t, grad, gmax, gsum, loss, grad_input, grad_weight, fwd, bounds, samples, seed):
    """float64 golden on ``samples`` sampled rows and ``samples`` sampled vocabulary rows
    (the first and last of each among them) through the reference backend.

    * rows ``R``: the statistics and loss from the reference forward over vocabulary chunks
      (combined as the all-reduce), and ``grad_input[R]`` = the sum over vocabulary chunks of the
      reference FLCE grad on ``(input[R], weight[chunk])`` (fp32, unrounded), rounded once;
    * vocabulary rows ``C``: ``grad_weight[C]`` = the reference FLCE grad on ``(input, weight[C])``
      with ``masked_target`` remapped into ``C`` and ``target_mask`` set where the target is
      outside ``C``.
    The FLCE grad goldens take fastgrad's global statistics as inputs (they are the op's
    inputs); the statistics are checked on their own.  At most ``GOLDEN_CHUNK_BYTES`` of the
    weight is widened at a time.
    """
    BT, H = x.shape
    V = w.shape[0]
    dt = x.dtype
    rng = np.random.default_rng(seed + 1)
    rows = sample_indices(rng, BT, samples, [0, BT - 1])
    cols = sample_indices(rng, V, samples, [0, V - 1, *t[rows[: max(1, samples // 2)]]])
    xr, tr, gr = np.ascontiguousarray(x[rows]), t[rows], grad[rows]
    chunk = max(256, GOLDEN_CHUNK_BYTES // (8 * H))
    n = len(rows)
    stats: tuple[list, list, list, list] = ([], [], [], [])
    gi64 = np.zeros((n, H))
    with fg.use_backend("reference"):
        parts = []
        for c0 in range(0, V, chunk):
            c1 = min(c0 + chunk, V)
            r = fg.fused_linear_online_max_sum(xr, w[c0:c1], tr, c0, c1)
            parts.append((c0, c1, r.target_mask, r.masked_target))
            stats[0].append(r.logits_max_local)
            stats[1].append(r.sum_exp_logits_local)
            stats[2].append(r.predicted_logits_local)
            stats[3].append(~vp.unpack_target_mask(r.target_mask, n))
        m_g, s_g, p_g = vp.combine_shard_statistics(*stats)
        loss_g, _ = fg.fused_cross_entropy_loss_with_max_sum(m_g, s_g, p_g)
        for c0, c1, tm, mt in parts:
            gi_c = np.empty((n, H), np.float32) if dt != np.float32 else np.empty((n, H), dt)
            gw_c = np.empty((c1 - c0, H), dt)
            fg.fused_linear_cross_entropy_loss_grad(
                gr, xr, w[c0:c1], tm, mt, logits_max=gmax[rows], sum_exp_logits=gsum[rows], out=(gi_c, gw_c)
            )
            gi64 += gi_c
        gi_g = gi64.astype(np.float32).astype(dt)
        # vocabulary rows C: weight[C] as a "shard" whose column j is vocabulary row cols[j]
        pos = np.searchsorted(cols, t)
        inside = (pos < len(cols)) & (cols[np.minimum(pos, len(cols) - 1)] == t)
        tm_c = vp.pack_target_mask(~inside)
        mt_c = np.where(inside, pos, 0).astype(np.int64)
        gi_tmp = np.empty((BT, H), dt)
        gw_g = np.empty((len(cols), H), dt)
        fg.fused_linear_cross_entropy_loss_grad(
            grad, x, np.ascontiguousarray(w[cols]), tm_c, mt_c, logits_max=gmax, sum_exp_logits=gsum, out=(gi_tmp, gw_g)
        )
        del gi_tmp
    a_gi, a_gw = grad_input[rows], grad_weight[cols]

    def absmax(a, b):
        return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))

    def rel(a, b):
        b = np.asarray(b, np.float64)
        return absmax(a, b) / (float(np.max(np.abs(b))) or 1.0)

    errors = {
        "rows_sampled": int(n),
        "vocab_rows_sampled": int(len(cols)),
        "loss_abs": absmax(loss[rows], loss_g),
        "logits_max_abs": absmax(gmax[rows], m_g),
        "sum_exp_logits_rel": rel(gsum[rows], s_g),
        "grad_input_abs": absmax(a_gi, gi_g),
        "grad_input_rel_to_max": rel(a_gi, gi_g),
        "grad_weight_abs": absmax(a_gw, gw_g),
        "grad_weight_rel_to_max": rel(a_gw, gw_g),
    }
    verdicts = {}
    for name, a, g, d in (
        ("grad_input", a_gi, gi_g, dt),
        ("grad_weight", a_gw, gw_g, dt),
        ("loss", loss[rows], loss_g, np.float32),
    ):
        c = fg.compare(a, g, dtype=d, standard="single")
        verdicts[name] = {
            "passed": bool(c.passed),
            "dtype": c.dtype,
            "metrics": c.to_dict()["metrics"],
            "thresholds": c.to_dict()["thresholds"],
            "failures": list(c.failures),
        }
    check = {
        "standard": "single (Ascend single benchmark: MERE < T, MARE < 10 T)",
        "passed": all(v["passed"] for v in verdicts.values()),
        "outputs": verdicts,
    }
    return {"errors": errors, "check": check}


# ------------------------------------------------------------------ output


def write_outputs(out_dir: str, fmt: str, tensors: dict, report: dict) -> list[str]:
    """Write the tensors and ``report.json`` into ``out_dir``.  Each file is written as
    ``NAME.part`` and renamed when complete; when a write fails (a full disk) every file of
    this call, partial or complete, is removed and the ``OSError`` propagates."""
    written: list[str] = []

    def part(path: str) -> str:
        written.append(path + ".part")
        return path + ".part"

    def done(path: str) -> None:
        os.replace(path + ".part", path)
        written[-1] = path

    files = []
    try:
        if fmt == "safetensors":
            meta = {
                "fastgrad": report["fastgrad"],
                "dtype": report["dtype"],
                "mode": report["mode"],
                "shape": json.dumps(report["shape"]),
            }
            path = os.path.join(out_dir, "results.safetensors")
            written.append(path + ".part")  # save_safetensors writes PATH.part, then renames
            ck.save_safetensors(path, tensors, meta)
            written[-1] = path
            files.append(path)
        else:
            for name, a in tensors.items():
                path = os.path.join(out_dir, name + ".npy")
                with open(part(path), "wb") as fb:
                    np.save(fb, a, allow_pickle=False)
                done(path)
                files.append(path)
        report["outputs"] = {
            "dir": out_dir,
            "files": [os.path.basename(f) for f in files] + ["report.json"],
            "tensors": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in tensors.items()},
        }
        path = os.path.join(out_dir, "report.json")
        with open(part(path), "w") as f:
            json.dump(report, f, indent=1, default=json_default)
            f.write("\n")
        done(path)
        files.append(path)
    except BaseException:
        report.pop("outputs", None)
        for w in written:
            try:
                os.remove(w)
            except OSError:
                pass
        raise
    return files


def gemm_kernel(dtype: np.dtype) -> str:
    """What the NumPy-level fused linear ops run their GEMMs on for ``dtype`` here."""
    from ..ops import _engines

    return _engines.gemm_choice(dtype).describe()


def _pct_of_blas(f: float, kernel: str = "BLAS sgemm") -> str:
    s = f"{f:.0%} of BLAS"
    if f > 1.05 and kernel != "BLAS sgemm":
        s += f"; the {kernel.split(' (')[0]} beats fp32 BLAS"
    elif f > 1.05:
        s += ", above the measured BLAS rate: timing noise on a shared machine"
    return s


def print_report(r: dict, say: Say | None = None) -> None:
    """The whole report at once (the command prints it as it goes: :func:`header`, the phase
    rows, :func:`print_summary`)."""
    say = say or Say()
    s = r["shape"]
    say(
        f"fastgrad {r['fastgrad']}: LM-head gradient, BT={s['BT']} H={s['H']} V={s['V']} {r['dtype']} "
        f"mode={r['mode']} shards={r['shards']} threads={r['threads']}"
    )
    say(f"  inputs: weight {r['sources']['weight']}; input {r['sources']['input']}; target {r['sources']['target']}")
    for note in r.get("notes", []):
        say(f"  note: {note}")
    m = r["memory"]
    est = m["estimate"]
    say(
        f"  memory estimated from the plan before allocating: {fmt_bytes(est['total_bytes'])} "
        f"(limit {fmt_bytes(est['limit_bytes'])}, {est['limit_source']}); backward tiles "
        f"{est['plan_backward']['bt_tile']}x{est['plan_backward']['v_tile']}, scratch "
        f"{fmt_bytes(est['plan_backward']['workspace_bytes'])}"
    )
    say(PHASE_HEADER)
    for k, v in r["phases_s"].items():
        say(
            f"    {k:<16} {v:8.3f} s  {fmt_bytes(m['phase_peak_rss_bytes'][k]):>12}   "
            f"{fmt_bytes(m['process_peak_rss_bytes_after_phase'][k]):>12}"
        )
    print_summary(r, say)


def print_summary(r: dict, say: Say | None = None) -> None:
    """The report's lines after the phase table: rates, memory, filtering, golden errors, loss."""
    say = say or Say()
    m = r["memory"]
    est = m["estimate"]
    g = r["gflops"]
    fb = r["fraction_of_blas"]
    kern = r.get("gemm_kernel", "BLAS sgemm")
    say(
        f"  GFLOP/s: forward {g['forward']:.1f} ({_pct_of_blas(fb['forward'], kern)}), backward "
        f"{g['backward']:.1f} ({_pct_of_blas(fb['backward'], kern)}); BLAS fp32 GEMM measured now: "
        f"{g['blas_fp32_measured']:.1f}; GEMMs on: {kern}"
    )
    if "time_estimate_s" in r:
        total = sum(r["phases_s"].values())
        say(f"  time: {fmt_seconds(total)} in the phases (estimated {fmt_seconds(r['time_estimate_s'])})")
    if r["mode"] == "memory-saving":
        held = f"the [BT, V] fp32 logits it never held: {fmt_bytes(m['logits_fp32_bytes_avoided'])}"
    else:
        held = (
            f"high-performance mode held a shard's [BT, V] logits and fp32 softmax: "
            f"{fmt_bytes(m['logits_and_softmax_bytes_held'])}"
        )
    say(
        f"  memory: process peak {fmt_bytes(m['process_peak_rss_bytes'])} (estimate "
        f"{fmt_bytes(est['total_bytes'])}; inputs+outputs {fmt_bytes(m['inputs_outputs_bytes'])}, "
        f"process before the phases {fmt_bytes(m['rss_before_bytes'])}); {held}"
    )
    if "filter" in r:
        f = r["filter"]
        say(
            f"  gradient filtering: filter_eps {f['filter_eps']:.3g}, {f['blocks_skipped']} of "
            f"{f['blocks_total']} blocks skipped ({f['fraction_skipped']:.1%})"
        )
    if "max_error_vs_golden" in r:
        e = r["max_error_vs_golden"]
        say(
            f"  vs float64 golden ({e['rows_sampled']} rows, {e['vocab_rows_sampled']} vocab rows): "
            f"loss {e['loss_abs']:.2e}, grad_input {e['grad_input_abs']:.2e} "
            f"({e['grad_input_rel_to_max']:.2e} of max), grad_weight {e['grad_weight_abs']:.2e} "
            f"({e['grad_weight_rel_to_max']:.2e} of max)"
        )
        c = r["check"]
        parts = []
        for name, v in c["outputs"].items():
            mt = v["metrics"]
            parts.append(
                f"{name} {'pass' if v['passed'] else 'FAIL'} (MERE {mt.get('MERE', 0):.2e}, "
                f"MARE {mt.get('MARE', 0):.2e}, {v['dtype']})"
            )
        say(f"  Ascend single benchmark: {'PASS' if c['passed'] else 'FAIL'}: " + "; ".join(parts))
    say(f"  mean loss {r['loss_mean']:.6f}")
    if "outputs" in r:
        say(f"  wrote {', '.join(os.path.join(r['outputs']['dir'], f) for f in r['outputs']['files'])}")


def list_tensors(path: str) -> int:
    if os.path.isdir(path):
        md = ck.open_model_dir(path, "--list-tensors")
        infos = list(md.tensors.values())
    else:
        infos = list(ck.SafetensorsFile(path, "--list-tensors").tensors.values())
        md = None
    for i in infos:
        print(f"{i.name}\t{i.dtype}\t{list(i.shape)}\t{os.path.basename(i.file)}")
    if md is not None:
        head = md.head or "none found (name it with --tensor)"
        print(f"# LM head: {head}{' (tied input embedding)' if md.tied else ''}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command.  Order: validate every flag and file (exit 2), apply the settings, estimate
    memory (exit 2 when it does not fit) and check ``--out`` (writable, room for the results),
    print the header, measure the BLAS rate and print the time estimate, ask when the job is
    long (``--yes``), then run the phases, printing each row as it ends; SIGINT/SIGTERM print
    the partial report (exit 130/143); a failed write prints the report, removes the partial
    files and exits 2."""
    import contextlib

    args = build_parser().parse_args(argv)
    if args.list_tensors is not None:
        return list_tensors(args.list_tensors)
    with contextlib.ExitStack() as stack:
        # the SoC and strict mode the ops follow (--soc-version / --strict, else the environment)
        args.device = enter_device(stack, args)
        refuse_missing_kernel("fused_linear_cross_entropy_loss_grad", args.device["soc_version"])
        job = resolve(args)
        try:
            return _main(job)
        finally:
            if job.out_created:  # nothing written (refused, interrupted, failed): leave no empty dir
                _remove_dir_if_empty(args.out)


def _interrupted(e: BaseException, ph: Phases, say: Say, what: str) -> int:
    """The partial report of a job stopped by SIGINT/SIGTERM; returns 130/143."""
    signame, code = (e.signame, e.code) if isinstance(e, Stopped) else ("SIGINT", 130)
    cur = ph.current
    where = f"during {cur[0]} after {time.perf_counter() - cur[1]:.1f} s" if cur else "between phases"
    say(
        f"  interrupted by {signame} {where}; phases done: {', '.join(ph.time) or 'none'}; "
        f"process peak RSS {fmt_bytes(process_peak_bytes())}; {what}"
    )
    print(f"fastgrad: interrupted by {signame} (partial report above)", file=sys.stderr)
    return code


def _main(job: Job) -> int:
    import signal

    in_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _on_signal) if in_main else None
    try:
        return _job(job)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _job(job: Job) -> int:
    import fastgrad as fg

    from .. import _config, tiling
    from .._config import max_threads

    args = job.args
    say = Say(sys.stderr if args.json else sys.stdout)
    threads = args.threads or max_threads()
    old_threads, old_budget = fg.get_num_threads(), _config.workspace_budget_override()
    fg.set_num_threads(threads)
    if args.workspace_mb is not None:
        tiling.set_workspace_budget(int(args.workspace_mb * MiB))
    ph = Phases(say)
    try:
        check_fits(job)
        check_out_space(job)
        header(job, threads, say)
        blas = ph.run("blas_measure", measure_blas_gflops, job.BT, job.H, threads)
        est_s, detail = estimate_seconds(job, blas)
        say(f"  time estimated: about {fmt_seconds(est_s)} ({detail})")
        confirm(job, est_s, say)
        ph.open_table()
        res, tensors = run_job(job, ph, blas)
        res["time_estimate_s"] = est_s
    except Declined:
        print("fastgrad: not run (answered no)", file=sys.stderr)
        return 130
    except (Stopped, KeyboardInterrupt) as e:
        return _interrupted(e, ph, say, "no results written")
    finally:
        fg.set_num_threads(old_threads)
        tiling.set_workspace_budget(old_budget)
    failed = None
    if args.out is not None:
        try:
            ph.current = ("write_outputs", time.perf_counter())
            write_outputs(args.out, args.out_format, tensors, res)
            ph.current = None
            job.out_created = False
        except OSError as e:
            failed = e
            res["outputs_error"] = f"{e.filename or args.out}: {e.strerror or e}"
        except (Stopped, KeyboardInterrupt) as e:
            print_summary(res, say)
            return _interrupted(e, ph, say, "partial files removed")
    if args.json:
        print(json.dumps(res, indent=2, default=json_default), flush=True)
    else:
        print_summary(res, say)
    if failed is not None:
        name = failed.filename or args.out
        print(
            f"fastgrad: --out: could not write {name!r}: {failed.strerror or failed} "
            "(the report is above; partial files removed)",
            file=sys.stderr,
        )
        return 2
    if args.check and not res["check"]["passed"]:
        return 1
    return 0
