"""``fastgrad bench --from-profile FILE``: an NPU profile's kernels of the seven ops beside the CPU.

Usage::

    fastgrad bench --from-profile op_summary_*.csv | kernel_details.csv
                   [--repeat N] [--budget S] [--threads N] [--json PATH] [--markdown PATH] [--plot DIR]

Reads msprof's ``op_summary_*.csv`` or the torch_npu profiler's ``kernel_details.csv`` (level >= 1:
the shape columns), groups the rows of each aclnn call, maps the seven ops' kernels to fastgrad's
benchmark cases by op type, shapes and dtypes, times the CPU on the same shapes and prints NPU µs
beside CPU ms with GFLOP/s or GB/s for both; unmapped op types are listed with the reason.  See
:mod:`fastgrad.ascend.profile`.  Exit status 0, or 2 for an unreadable or level-0 file.
"""

from __future__ import annotations

import argparse
import sys

from ._common import CliError


def run(args: argparse.Namespace) -> int:
    """Run from the parsed ``fastgrad bench`` arguments (``args.from_profile`` set)."""
    from ..ascend import profile as P
    from ..benchmarks.timing import threads

    if args.compare or args.from_json or args.list:
        raise CliError("--from-profile", "alone (not with --compare, --from-json or --list)", "both")
    thr = None
    if args.threads:
        try:
            thr = int(args.threads)
            if thr < 1:
                raise ValueError
        except ValueError:
            raise CliError("--threads", "one integer >= 1 with --from-profile", repr(args.threads)) from None
    if args.repeat is not None and args.repeat < 1:
        raise CliError("--repeat", "an integer >= 1", args.repeat)
    repeat = args.repeat or (3 if args.quick else 5)
    budget = args.budget if args.budget is not None else (2.0 if args.quick else 30.0)
    import os

    if os.path.isdir(args.from_profile):
        raise CliError(
            "--from-profile",
            "a profile CSV file (msprof's op_summary_*.csv or the torch_npu profiler's kernel_details.csv)",
            repr(args.from_profile),
            hint="a directory",
        )
    try:  # a bad or level-0 file: one line before any work
        P.check_level(P.read_profile(args.from_profile))
    except P.ProfileError as e:
        raise CliError(f"--from-profile: {e}") from None
    from .run import _check_dir_writable, check_writable_file

    # every destination checked before the CPU runs (not after it), as plain `fastgrad bench` does
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
        if path:
            check_writable_file(path, flag)
    if args.plot:
        if os.path.exists(args.plot) and not os.path.isdir(args.plot):
            raise CliError("--plot", "a directory (created when missing)", repr(args.plot), hint="an existing file")
        _check_dir_writable(os.path.abspath(args.plot), "--plot", repr(args.plot))

    def progress(r):
        if not args.quiet:
            print(f"  line {r['line']} {r['op_type']} -> {r['case']}: CPU {r['cpu_ms']:.3f} ms", file=sys.stderr)

    with threads(thr):
        report = P.compare_profile(args.from_profile, repeat=repeat, budget_s=budget, progress=progress)
    print(P.format_table(report))
    if args.json:
        P.save(report, args.json)
        print(f"wrote {args.json}")
    if args.markdown:
        from ._common import write_markdown

        write_markdown(args.markdown, P.format_markdown(report))
    if args.plot:
        files = P.plot(report, args.plot)
        print("wrote " + ", ".join(files) if files else "no plot written: matplotlib is not installed or no row mapped")
    return 0
