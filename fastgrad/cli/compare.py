"""``fastgrad compare``: judge an output file against golden data (Ascend accuracy standards).

Usage::

    fastgrad compare ACTUAL GOLDEN [--standard single|double|legacy] [--reference REF]
                     [--level L0|L1|L2] [--dtype DT] [--shape 2,3]
                     [--golden-dtype DT] [--reference-dtype DT] [--json]

Files are ``.npy`` or raw little-endian ``.bin`` dumps (as the aclnn sample programs write
them).  A ``.bin`` file's dtype comes from ``--dtype`` (``--golden-dtype`` /
``--reference-dtype`` when they differ, e.g. an fp32 golden beside a bf16 output) or from a
``<stem>.json`` sidecar; ``--shape`` reshapes every file (element counts must agree).
``--dtype`` also names the output dtype whose thresholds apply (default: the actual file's).

Exit status: 0 pass, 1 fail, 2 bad usage or unreadable input.  See :mod:`fastgrad.compare`
for the standards.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import OneLineParser


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="fastgrad compare",
        description="Compare an output against golden data with the Ascend operator accuracy "
        "standards (single / double benchmark, legacy double-thousandth).",
    )
    p.add_argument("actual", help="output under test (.npy or .bin)")
    p.add_argument("golden", help="golden output (.npy or .bin)")
    p.add_argument("--standard", default="single", choices=["single", "double", "legacy"])
    p.add_argument("--reference", help="third-party output for --standard double (.npy or .bin)")
    p.add_argument(
        "--level", default="L0", choices=["L0", "L1", "L2"], help="double benchmark level required to pass (default L0)"
    )
    p.add_argument(
        "--dtype",
        help="dtype of the .bin files and of the thresholds (float16|bfloat16|float32; default: the actual file's)",
    )
    p.add_argument("--golden-dtype", help="dtype of a .bin golden when it differs from --dtype")
    p.add_argument("--reference-dtype", help="dtype of a .bin reference when it differs from --dtype")
    p.add_argument("--shape", help="reshape the files, e.g. 2,3,4")
    p.add_argument("--eps", type=float, default=None, help="eps of the relative error (default 1e-7)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: list[str]) -> int:
    from ..compare import REL_EPS, compare, load_array
    from ..errors import AclnnError

    p = build_parser()
    args = p.parse_args(argv)

    def load(path, dtype):  # the dtype options describe raw .bin files; .npy carry their own
        return load_array(path, dtype if not path.lower().endswith(".npy") else None, args.shape)

    try:
        actual = load(args.actual, args.dtype)
        golden = load(args.golden, args.golden_dtype or args.dtype)
        ref = None
        if args.reference:
            ref = load(args.reference, args.reference_dtype or args.dtype)
        if args.standard == "double" and ref is None:
            print("fastgrad compare: --standard double needs --reference", file=sys.stderr)
            return 2
        res = compare(
            actual,
            golden,
            dtype=args.dtype,
            standard=args.standard,
            reference=ref,
            level=args.level,
            eps=REL_EPS if args.eps is None else args.eps,
        )
    except (AclnnError, OSError, ValueError) as e:
        print(f"fastgrad compare: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        print(res.summary())
    return 0 if res.passed else 1
