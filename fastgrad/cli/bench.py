"""``fastgrad bench``: the benchmark report (cases in :mod:`fastgrad.benchmarks.cases`).

Usage::

    fastgrad bench --headline      (the README's headline: the LM-head gradient at Qwen2.5-0.5B's
                                    shape against PyTorch fp32/bf16 and the GEMM bound, a few minutes)
    fastgrad bench [--quick] [--ops flce,ce,...] [--threads 1,2] [--backend cpu,acl]
                   [--repeat N] [--budget S] [--json PATH] [--plot DIR] [--markdown PATH]
                   [--compare other.json] [--from-json PATH] [--no-torch] [--list]
    fastgrad bench --from-profile op_summary_*.csv|kernel_details.csv [--repeat N] [--json PATH]
                   (an NPU profile's kernels of the seven ops beside the CPU: ``fastgrad/cli/profile.py``)

Prints a line per row and one per case as it finishes (with the time so far and an estimate of
the time left), then the table; ``--json`` writes the report (schema in ``docs/benchmarks.md``)
and ``--markdown`` a Markdown table after every case (an interrupted run keeps the cases that
finished, marked partial; exit 130), ``--plot`` one PNG per op at the end (needs matplotlib).  ``--compare other.json``
prints a saved report (e.g. from an NPU host running ``--backend acl``) beside this one;
``--from-json`` renders a saved report instead of running.  Exit status 0, or 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._common import CliError, OneLineParser, write_markdown

if TYPE_CHECKING:  # the benchmarks are imported when a command runs, not with the CLI
    from ..benchmarks.cases import Case


def _csv(s):
    return [x.strip() for x in s.split(",") if x.strip()] if s else []


def _items(s: str | None, flag: str, what: str) -> list[str]:
    """A comma-separated flag's items: [] when the flag is not given; a given value with an empty
    item (``''``, ``,,``, ``1,,2``, a trailing comma) is a :class:`CliError` naming the flag (an
    empty ``--ops`` would otherwise select every case)."""
    if s is None:
        return []
    items = [x.strip() for x in s.split(",")]
    if not all(items):
        raise CliError(flag, f"comma-separated {what}, none empty", repr(s))
    return items


def _positive(kind, what: str):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            v = None
        if v is None or not v > 0 or v != v:
            raise argparse.ArgumentTypeError(f"expected {what} > 0, got {s!r}")
        return v

    return parse


#: Printed with every --quick report: its rows are too short to time.
QUICK_NOTE = (
    "--quick: small shapes, few repetitions: the times are at the timer's and the scheduler's "
    "resolution and the fractions of bound are noise; run without --quick for figures to quote"
)


REPORT_JSON = "a fastgrad bench report (JSON, from fastgrad bench --json)"

#: ``--headline``: the case and rows of the README's first figure
HEADLINE_CASE = "fused_linear_cross_entropy_loss_grad[memory-saving]/bf16/BT=2048,H=896,V=151936"
HEADLINE_ROWS = ("fastgrad", "torch-fp32", "torch-bf16", "bound")


def row_labels(case: Case, backends: Sequence[str] = ("cpu",)) -> list[str]:
    """A case's rows as the results name them (``report._label``): ``fastgrad:cpu``,
    ``fastgrad:cpu (out=)``, ``torch-fp32``, ..."""
    out = []
    for r in case.runners:
        if r.kind == "fastgrad":
            out += [f"fastgrad:{b}" + (f" ({r.mode})" if r.mode else "") for b in backends]
        else:
            out.append(r.name)
    return out


def _duration(s: float) -> str:
    s = max(0.0, s)
    return f"{s:.0f}s" if s < 90 else (f"{s / 60:.0f}m{s % 60:02.0f}s" if s < 3600 else f"{s / 3600:.1f}h")


def _load_report(path: str, flag: str) -> dict:
    """A saved report, or one line (exit 2) saying what the file is instead."""
    import json
    import os

    from .. import benchmarks as B

    if os.path.isdir(path):
        raise CliError(flag, "a report .json file", repr(path), hint="a directory")
    try:
        return B.load(path)
    except FileNotFoundError:
        raise CliError(flag, "an existing report .json file", repr(path), hint="no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = "not text" if isinstance(e, UnicodeDecodeError) else f"not JSON: {e.msg} at line {e.lineno}"
        raise CliError(flag, REPORT_JSON, f"{path!r} ({why})") from None
    except ValueError as e:
        raise CliError(flag, REPORT_JSON, f"{path!r} ({e})") from None
    except OSError as e:
        raise CliError(flag, "a readable report .json file", repr(path), hint=e.strerror or str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="fastgrad bench",
        description="fastgrad benchmark report: every public op against PyTorch and the machine's bounds.",
    )
    p.add_argument(
        "--headline",
        action="store_true",
        help="the README's headline, a few minutes: the LM-head gradient at Qwen2.5-0.5B's shape ("
        + HEADLINE_CASE
        + ") with the rows "
        + ",".join(HEADLINE_ROWS)
        + ", --repeat 3",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small shapes, few repetitions (< 1 min): checks that everything runs; its times are noise",
    )
    p.add_argument(
        "--ops",
        help="comma-separated ops (names, substrings or aliases: "
        "flce, floms, fce, ce, softmax, smooth_l1, embedding, train); a full case id as --list "
        "prints it selects that case only",
    )
    p.add_argument("--threads", help="comma-separated thread counts (default: all cores)")
    p.add_argument(
        "--backend",
        default=None,
        help="comma-separated fastgrad backends, one row each (cpu|reference|acl; "
        "default: cpu, plus acl when available)",
    )
    p.add_argument(
        "--repeat",
        type=_positive(int, "an integer"),
        default=None,
        help="timed repetitions per row, >= 1 (default 5, quick 3)",
    )
    p.add_argument(
        "--budget",
        type=_positive(float, "a number of seconds"),
        default=None,
        help="stop repeating a row after this many seconds (default 30, quick 2)",
    )
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="DIR", help="write one PNG per op (needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH", help="write a Markdown table")
    p.add_argument("--compare", metavar="OTHER_JSON", help="show a saved report beside this one")
    p.add_argument("--from-json", metavar="PATH", help="render a saved report instead of running")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines")
    p.add_argument(
        "--rows",
        type=_csv,
        default=None,
        help="comma-separated row names to run, e.g. fastgrad,bound,torch-fp32 (default: all; "
        "--list shows each case's rows)",
    )
    p.add_argument("--no-subprocess", action="store_true", help="run memory cases in-process (no peak RSS)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument(
        "--from-profile",
        metavar="FILE",
        help="NPU profile (msprof op_summary_*.csv or torch_npu kernel_details.csv, level >= 1): "
        "its kernels of the seven ops beside the CPU on the same shapes",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.from_profile:
        from .profile import run as run_from_profile  # fastgrad/cli/profile.py

        return run_from_profile(args)
    from .. import benchmarks as B
    from ..backends import available_backends
    from .run import _check_dir_writable, check_writable_file

    # every destination checked before the benchmark runs (not after it)
    if args.json:
        check_writable_file(args.json, "--json")
    if args.markdown:
        check_writable_file(args.markdown, "--markdown")
    if args.plot:
        import importlib.util
        import os

        if os.path.exists(args.plot) and not os.path.isdir(args.plot):
            raise CliError("--plot", "a directory (created when missing)", repr(args.plot), hint="an existing file")
        _check_dir_writable(os.path.abspath(args.plot), "--plot", repr(args.plot))
        if importlib.util.find_spec("matplotlib") is None:
            raise CliError("--plot", "matplotlib installed (pip install matplotlib)", "no matplotlib")
    other = None
    if args.compare:
        other = _load_report(args.compare, "--compare")
    if args.from_json:
        report = _load_report(args.from_json, "--from-json")
    else:
        from ._common import resolve_op

        if args.headline:
            if args.ops or args.rows is not None or args.quick:
                raise CliError("--headline", "no --ops, --rows or --quick with it (it names its own)", "both")
            args.ops, args.rows = HEADLINE_CASE, list(HEADLINE_ROWS)
            args.repeat = args.repeat or 3
        words = [
            resolve_op(w) if resolve_op(w) and w.lower().startswith("aclnn") else w
            for w in _items(args.ops, "--ops", "case names or ops")
        ]
        cases = B.select(B.all_cases(args.quick), words)
        if not cases:
            print(f"fastgrad bench: no case matches --ops {args.ops!r}", file=sys.stderr)
            return 2
        if args.list:
            for c in cases:
                print(c.id + (f"    ({c.note})" if c.note else ""))
                labels = row_labels(c)
                names = list(dict.fromkeys(r.name for r in c.runners))
                print("    rows: " + ", ".join(labels))
                if names != labels:
                    print("    --rows names: " + ", ".join(names))
            return 0
        if args.rows is not None:
            names = sorted({r.name for c in cases for r in c.runners})
            unknown = [r for r in args.rows if r not in names]
            if unknown or not args.rows:
                raise CliError("--rows", f"row names of the selected cases ({', '.join(names)})", ",".join(unknown))
        avail = available_backends()
        backends = _items(args.backend, "--backend", "backend names") or (["cpu"] + (["acl"] if "acl" in avail else []))
        bad = [b for b in backends if b not in avail]
        if bad:
            reasons = available_backends(with_reasons=True)
            print(
                "fastgrad bench: backend(s) unavailable: "
                + ", ".join(f"{b} ({reasons.get(b, 'unknown backend')})" for b in bad),
                file=sys.stderr,
            )
            return 2
        from .._config import max_threads

        _items(args.threads, "--threads", "thread counts")
        try:
            thr: list = [int(t) for t in _csv(args.threads)] or [None]
            if any(t is not None and not 1 <= t <= max_threads() for t in thr):
                raise ValueError
        except ValueError:
            print(
                f"fastgrad bench: --threads: expected comma-separated integers in 1..{max_threads()} "
                f"(the CPUs available), got {args.threads!r}",
                file=sys.stderr,
            )
            return 2
        if args.quick and not args.quiet:
            print(f"fastgrad bench: {QUICK_NOTE}", file=sys.stderr, flush=True)
        repeat = args.repeat or (3 if args.quick else 5)
        budget = args.budget if args.budget is not None else (2.0 if args.quick else 30.0)

        from ..benchmarks.report import _label, save_text

        def on_case_start(case, k, total):
            if not args.quiet:
                where = " (in a fresh subprocess, for its peak RSS)" if case.memory and not args.no_subprocess else ""
                print(f"  [{k}/{total}] {case.id}{where} ...", file=sys.stderr, flush=True)

        def progress(r):
            if not args.quiet:
                t = r.get("time_median_s")
                note = str(r.get("note") or "")
                if note.startswith(r["status"] + ":"):  # "skipped: torch not installed"
                    note = note[len(r["status"]) + 1 :].strip()
                tt = f"{t * 1e3:.3g} ms" if t else r["status"] + (f" ({note[:70]})" if note else "")
                print(f"    {_label(r)}  thr={r['threads']}: {tt}", file=sys.stderr, flush=True)

        state = {"report": None}

        def on_case(rep, done, total):
            state["report"] = rep
            if args.json:
                B.save(rep, args.json)
            if args.markdown:
                save_text(B.format_markdown(rep), args.markdown)
            if not args.quiet:
                el = rep["elapsed_s"]
                eta = f", about {_duration(el / done * (total - done))} left" if done < total else ""
                print(f"  [{done}/{total}] cases done, {_duration(el)} so far{eta}", file=sys.stderr, flush=True)

        if not args.quiet:
            print(
                f"fastgrad bench: {len(cases)} case(s) x {len(thr)} thread setting(s); a line as each case "
                "starts, its rows when it ends, then the time so far and left"
                + ("; the report is written after each case" if args.json or args.markdown else ""),
                file=sys.stderr,
                flush=True,
            )
        try:
            report = B.run(
                cases,
                backends=backends,
                thread_counts=thr,
                repeat=repeat,
                budget_s=budget,
                quick=args.quick,
                use_torch=not args.no_torch,
                memory=not args.no_subprocess,
                progress=progress,
                only_rows=None if args.rows is None else set(args.rows),
                on_case=on_case,
                on_case_start=on_case_start,
            )
        except KeyboardInterrupt:
            rep = state["report"]
            kept = [p for p in (args.json, args.markdown) if p and rep is not None]
            done = rep["settings"]["cases_done"] if rep is not None else 0
            print(
                f"fastgrad bench: interrupted after {done} of {len(cases) * len(thr)} case(s)"
                + (f"; kept them in {', '.join(kept)} (marked partial)" if kept else ""),
                file=sys.stderr,
            )
            return 130
    print(B.format_table(report))
    if args.quick or (report.get("settings") or {}).get("quick"):
        print(f"\nnote: {QUICK_NOTE}")
    if other is not None:
        print("\n=== side by side ===")
        print(B.format_compare(report, other, args.from_json or "this run", args.compare))
    if args.json:
        B.save(report, args.json)
        print(f"\nwrote {args.json}")
    if args.markdown:
        write_markdown(args.markdown, B.format_markdown(report))
    if args.plot:
        files = B.plot(report, args.plot)
        if files:
            print("wrote " + ", ".join(files))
        else:
            print("no plots written: matplotlib is not installed (pip install matplotlib)")
    return 0
