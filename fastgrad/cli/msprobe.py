"""``fastgrad golden --from-msprobe``: fastgrad's golden for the calls an msprobe dump recorded.

Usage::

    fastgrad golden --from-msprobe RANK_DIR --out DIR [--bench-dump DIR] [--soc-version NAME]
                    [--strict|--no-strict] [--backend reference] [--quiet]

``RANK_DIR`` is one rank's msprobe dump (``step<N>/rank<R>/`` or ``proc<pid>/``, made with
``PrecisionDebugger(task="tensor", level="L1" or "mix")``).  Every call of the seven ops (and of
the torch functions that map onto them) is recomputed with fastgrad's golden and judged with
the Ascend single benchmark (integer outputs: equal); ``DIR`` receives ``summary.csv``,
``unmapped.csv``, ``summary.json`` and ``entries/<entry>/{inputs,golden,actual}/``; the table is
printed.  ``--bench-dump DIR2`` writes a copy of the dump whose judged outputs are fastgrad's:
``msprobe compare -tp <RANK_DIR's parent> -gp DIR2``.  Mapping and traps:
:mod:`fastgrad.ascend.msprobe`; walk-through: ``docs/ascend_workflow.md``.

Exit status: 0 every judged output passes, 1 one fails or nothing could be judged, 2 bad usage
or an unreadable dump.
"""

from __future__ import annotations

import argparse
import os
import sys

from ._common import CliError, OneLineParser, add_device_options, enter_device, print_or_pipe_closed


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="fastgrad golden --from-msprobe",
        description="Recompute the seven ops' calls of an msprobe dump with fastgrad's golden and judge them.",
    )
    p.add_argument("--from-msprobe", required=True, metavar="RANK_DIR", help="msprobe step<N>/rank<R>/ directory")
    p.add_argument("--out", required=True, metavar="DIR", help="summary.csv, unmapped.csv, entries/ go here")
    p.add_argument("--bench-dump", metavar="DIR", help="write an msprobe-format dump whose outputs are fastgrad's")
    add_device_options(p)
    p.add_argument("--backend", default="reference", help="backend computing the golden (default reference)")
    p.add_argument("-q", "--quiet", action="store_true", help="no table, only the verdict line")
    return p


def main(argv: list[str]) -> int:
    import contextlib

    args = build_parser().parse_args(argv)
    with contextlib.ExitStack() as stack:
        args.device = enter_device(stack, args)
        return _run(args)


def _run(args) -> int:
    import fastgrad as fg

    from ..ascend import msprobe as M

    if args.backend not in fg.available_backends():
        raise CliError("--backend", "an available backend (" + ", ".join(fg.available_backends()) + ")", args.backend)
    for flag, path in (("--out", args.out), ("--bench-dump", args.bench_dump)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise CliError(flag, "a directory", f"the file {path!r}")
    try:
        dump = M.read_dump(args.from_msprobe)
    except M.DumpError as e:
        raise CliError("--from-msprobe", "one rank's msprobe dump", args.from_msprobe, hint=str(e)) from None
    if args.bench_dump:
        try:
            M.bench_dump_dir(dump, args.bench_dump)
        except M.DumpError as e:
            raise CliError(f"--bench-dump: {e}") from None
    from ._common import OutputFolder

    # --out writable before any work; what it wrote there removed again when the command fails
    with OutputFolder.prepared(args.out) as out:
        return _judge(args, dump, out)


def _judge(args, dump, out) -> int:
    import fastgrad as fg

    from ..ascend import msprobe as M

    try:
        mapped, unmapped = M.map_dump(dump)
        rows, rejected = M.check_dump(dump, mapped, args.backend)
    except M.DumpError as e:  # a tensor file dump.json names is missing or unreadable
        raise CliError(f"--from-msprobe: {e}") from None
    unmapped = unmapped + rejected
    meta = {
        "dump": os.path.abspath(dump.path),
        "backend": args.backend,
        **args.device,
        "fastgrad": fg.__version__,
        "standard": "single (ATK single benchmark); integer outputs exact",
    }
    files = M.write_results(args.out, mapped, rows, unmapped, meta, record=out.add)
    if not args.quiet:
        print_or_pipe_closed(M.format_table(rows, unmapped))
    bench = M.write_bench_dump(dump, rows, args.bench_dump) if args.bench_dump else None
    n_fail = sum(r.verdict != "PASS" for r in rows)
    n_entries = len({r.entry for r in rows})
    verdict = "PASS" if rows and not n_fail else "FAIL"
    print_or_pipe_closed(
        f"\n{verdict}: {len(rows) - n_fail}/{len(rows)} outputs of {n_entries} entries pass"
        f"; {sum(u.family for u in unmapped)} not mapped; summary {files['summary']}"
    )
    if bench:
        print_or_pipe_closed(
            f"bench dump: {bench}  (msprobe compare -tp {os.path.dirname(dump.path)} -gp {args.bench_dump})"
        )
    if not rows:
        print("nothing to judge: no call of the seven ops with tensor data in this dump", file=sys.stderr)
    return 0 if verdict == "PASS" else 1
