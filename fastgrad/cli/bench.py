"""``fastgrad bench``: the benchmark report (cases in :mod:`fastgrad.benchmarks.cases`).

Usage::

    fastgrad bench [--quick] [--ops flce,ce,...] [--threads 1,2] [--backend cpu,acl]
                   [--repeat N] [--budget S] [--json PATH] [--plot DIR] [--markdown PATH]
                   [--compare other.json] [--from-json PATH] [--no-torch] [--list]

Prints a table; ``--json`` writes the report (schema in ``docs/benchmarks.md``), ``--plot``
one PNG per op (needs matplotlib), ``--markdown`` a Markdown table.  ``--compare other.json``
prints a saved report (e.g. from an NPU host running ``--backend acl``) beside this one;
``--from-json`` renders a saved report instead of running.  Exit status 0, or 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys

from . import OneLineParser


def _csv(s):
    return [x.strip() for x in s.split(",") if x.strip()] if s else []


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="fastgrad bench",
        description="fastgrad benchmark report: every public op against PyTorch and the machine's bounds.",
    )
    p.add_argument("--quick", action="store_true", help="small shapes, few repetitions (< 1 min)")
    p.add_argument(
        "--ops",
        help="comma-separated ops (names, substrings or aliases: "
        "flce, floms, fce, ce, softmax, smooth_l1, embedding, train)",
    )
    p.add_argument("--threads", help="comma-separated thread counts (default: all cores)")
    p.add_argument(
        "--backend",
        default=None,
        help="comma-separated fastgrad backends, one row each (cpu|reference|acl; "
        "default: cpu, plus acl when available)",
    )
    p.add_argument("--repeat", type=int, default=None, help="timed repetitions per row (default 5, quick 3)")
    p.add_argument(
        "--budget", type=float, default=None, help="stop repeating a row after this many seconds (default 30, quick 2)"
    )
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="DIR", help="write one PNG per op (needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH", help="write a Markdown table")
    p.add_argument("--compare", metavar="OTHER_JSON", help="show a saved report beside this one")
    p.add_argument("--from-json", metavar="PATH", help="render a saved report instead of running")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines")
    p.add_argument("--no-subprocess", action="store_true", help="run memory cases in-process (no peak RSS)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    from .. import benchmarks as B
    from ..backends import available_backends

    other = None
    if args.compare:
        try:
            other = B.load(args.compare)
        except (OSError, ValueError) as e:
            print(f"fastgrad bench: {e}", file=sys.stderr)
            return 2
    if args.from_json:
        try:
            report = B.load(args.from_json)
        except (OSError, ValueError) as e:
            print(f"fastgrad bench: {e}", file=sys.stderr)
            return 2
    else:
        cases = B.select(B.all_cases(args.quick), _csv(args.ops))
        if not cases:
            print(f"fastgrad bench: no case matches --ops {args.ops!r}", file=sys.stderr)
            return 2
        if args.list:
            for c in cases:
                print(c.id + (f"    ({c.note})" if c.note else ""))
            return 0
        avail = available_backends()
        backends = _csv(args.backend) or (["cpu"] + (["acl"] if "acl" in avail else []))
        bad = [b for b in backends if b not in avail]
        if bad:
            reasons = available_backends(with_reasons=True)
            print(
                "fastgrad bench: backend(s) unavailable: "
                + ", ".join(f"{b} ({reasons.get(b, 'unknown backend')})" for b in bad),
                file=sys.stderr,
            )
            return 2
        try:
            thr: list = [int(t) for t in _csv(args.threads)] or [None]
            if any(t is not None and t < 1 for t in thr):
                raise ValueError
        except ValueError:
            print(
                f"fastgrad bench: --threads: expected comma-separated integers >= 1, got {args.threads!r}",
                file=sys.stderr,
            )
            return 2
        repeat = args.repeat or (3 if args.quick else 5)
        budget = args.budget if args.budget is not None else (2.0 if args.quick else 30.0)

        def progress(r):
            if not args.quiet:
                t = r.get("time_median_s")
                tt = f"{t * 1e3:.3g} ms" if t else r["status"] + (f" ({r['note'][:70]})" if r.get("note") else "")
                print(
                    f"  {r['case']}  {r['backend']}{' ' + r['variant'] if r.get('variant') else ''}"
                    f"  thr={r['threads']}: {tt}",
                    file=sys.stderr,
                    flush=True,
                )

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
        )
    print(B.format_table(report))
    if other is not None:
        print("\n=== side by side ===")
        print(B.format_compare(report, other, args.from_json or "this run", args.compare))
    if args.json:
        B.save(report, args.json)
        print(f"\nwrote {args.json}")
    if args.markdown:
        import os

        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(B.format_markdown(report))
        print(f"wrote {args.markdown}")
    if args.plot:
        files = B.plot(report, args.plot)
        if files:
            print("wrote " + ", ".join(files))
        else:
            print("no plots written: matplotlib is not installed (pip install 'fastgrad[plot]')")
    return 0
