"""The main job's constants, memory helpers, argument types, parser and printer (``fastgrad/cli/run.py``)."""

from __future__ import annotations

import argparse
import math
import platform
import sys
import threading
from typing import Any

import numpy as np

from ..benchmarks.timing import current_rss, peak_rss
from ._common import OneLineParser, add_device_options, subcommand_epilog

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
    if not (math.isfinite(v) and v * 2**20 >= 1):  # 1e-9 MiB is 0 bytes: refused by the flag
        raise argparse.ArgumentTypeError(f"expected a number of MiB > 0 (at least one byte), got {s}")
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


class Say:
    """The report's lines, written as soon as they are known and flushed each time, so a
    redirected or piped stdout shows them as the job goes (``print`` alone buffers a file)."""

    def __init__(self, stream=None):
        self.stream = stream

    def __call__(self, line: str = "") -> None:
        print(line, file=self.stream if self.stream is not None else sys.stdout, flush=True)


PHASE_HEADER = "  phase              time      phase peak RSS   process peak RSS (VmHWM)"


def fmt_seconds(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"
