"""``fastgrad compare``: judge an output file against golden data (Ascend accuracy standards).

Usage::

    fastgrad compare ACTUAL GOLDEN [--standard single|double|legacy] [--reference REF]
                     [--level L0|L1|L2] [--dtype DT] [--shape 2,3]
                     [--golden-dtype DT] [--reference-dtype DT] [--json]

Files are ``.npy``, ``.pt`` (one tensor, e.g. an msprobe dump's ``dump_tensor_data/*.pt``: loaded
with ``map_location="cpu", weights_only=True``) or raw little-endian ``.bin`` dumps (as the aclnn
sample programs write them).  A ``.bin`` file's dtype comes from ``--dtype`` (``--golden-dtype`` /
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

from ._common import CliError, OneLineParser

#: The output dtypes whose thresholds the standards define (``--dtype``), and what a raw golden
#: or third-party dump may also be stored as (``--golden-dtype``, ``--reference-dtype``).
THRESHOLD_DTYPES = ("float32", "bfloat16", "float16")
DUMP_DTYPES = THRESHOLD_DTYPES + ("float64",)


def _dtype_type(allowed: tuple):
    def parse(s: str) -> str:
        from ..dtypes import DTYPE_ALIASES, dtype_name

        dt = DTYPE_ALIASES.get(s.strip().lower())
        name = dtype_name(dt) if dt is not None else None
        if name is None or name not in allowed:
            aliases = "fp32, bf16, fp16" + (", fp64" if "float64" in allowed else "")
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(allowed)} (aliases {aliases}), got {s!r}")
        return name

    return parse


def _shape_type(s: str) -> tuple[int, ...]:
    parts = [p.strip() for p in s.split(",")]
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes >= 0 such as 2,3,4, got {s!r}")
    return dims


def _check_file(path: str, what: str) -> None:
    """One line (exit 2) for a path that is not a readable .npy/.bin file, before reading it."""
    import os

    from .checkpoint import _check_npy_header

    if os.path.isdir(path):
        raise CliError(what, "a .npy or .bin file", repr(path), hint="a directory")
    if not os.path.exists(path):
        raise CliError(what, "an existing .npy or .bin file", repr(path), hint="no such file")
    if path.lower().endswith(".npy"):
        _check_npy_header(path, what)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="fastgrad compare",
        description="Compare an output against golden data with the Ascend operator accuracy "
        "standards (single / double benchmark, legacy double-thousandth).",
    )
    p.add_argument("actual", help="output under test (.npy, .pt (e.g. an msprobe dump's tensor) or .bin)")
    p.add_argument("golden", help="golden output (.npy, .pt or .bin)")
    p.add_argument(
        "--standard",
        default="single",
        choices=["single", "double", "legacy"],
        help="single benchmark (against the golden), double (against a third-party output, "
        "--reference) or legacy double-thousandth (default single)",
    )
    p.add_argument("--reference", help="third-party output for --standard double (.npy or .bin)")
    p.add_argument(
        "--level", default="L0", choices=["L0", "L1", "L2"], help="double benchmark level required to pass (default L0)"
    )
    p.add_argument(
        "--dtype",
        type=_dtype_type(THRESHOLD_DTYPES),
        help="dtype of the .bin files and of the thresholds (float32|bfloat16|float16, aliases fp32|bf16|fp16; "
        "default: the actual file's)",
    )
    p.add_argument(
        "--golden-dtype",
        type=_dtype_type(DUMP_DTYPES),
        help="dtype of a .bin golden when it differs from --dtype (float64 allowed)",
    )
    p.add_argument(
        "--reference-dtype",
        type=_dtype_type(DUMP_DTYPES),
        help="dtype of a .bin reference when it differs from --dtype (float64 allowed)",
    )
    p.add_argument("--shape", type=_shape_type, help="reshape the files, e.g. 2,3,4")
    p.add_argument("--eps", type=float, default=None, help="eps of the relative error (default 1e-7)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _same_size(args, actual, golden, ref) -> None:
    """Files that disagree in element count: name the dtype a raw dump was read with (the usual
    cause: a wrong --dtype), not the golden's shape."""

    def how(path, a, dt_flag, dt):
        if path.lower().endswith(".npy"):
            return f"{a.size} elements in {path} ({a.dtype}, .npy)"
        return f"{a.size} elements read as {a.dtype} from the raw {path} ({dt_flag} {dt or 'from its .json sidecar'})"

    g_flag = "--golden-dtype" if args.golden_dtype else "--dtype"
    r_flag = "--reference-dtype" if args.reference_dtype else "--dtype"
    files = [("ACTUAL", args.actual, actual, "--dtype", args.dtype)]
    files.append(("GOLDEN", args.golden, golden, g_flag, args.golden_dtype or args.dtype))
    if ref is not None:
        files.append(("--reference", args.reference, ref, r_flag, args.reference_dtype or args.dtype))
    if len({a.size for _, _, a, _, _ in files}) == 1:
        return
    raw = [f for f in files if not f[1].lower().endswith(".npy")]
    flag = raw[0][3] if raw else "GOLDEN"
    raise CliError(
        flag,
        "files of the same number of elements",
        "; ".join(how(p, a, fl, dt) for _, p, a, fl, dt in files),
        hint="check the dtype a raw .bin dump is read with" if raw else "",
    )


def main(argv: list[str]) -> int:
    from ..compare import REL_EPS, compare, load_array
    from ..errors import AclnnError

    p = build_parser()
    args = p.parse_args(argv)

    def load(path, dtype):  # the dtype options describe raw .bin files; .npy and .pt carry their own
        return load_array(path, dtype if not path.lower().endswith((".npy", ".pt", ".pth")) else None, args.shape)

    _check_file(args.actual, "ACTUAL")
    _check_file(args.golden, "GOLDEN")
    if args.reference:
        _check_file(args.reference, "--reference")
    try:
        actual = load(args.actual, args.dtype)
        golden = load(args.golden, args.golden_dtype or args.dtype)
        ref = None
        if args.reference:
            ref = load(args.reference, args.reference_dtype or args.dtype)
        _same_size(args, actual, golden, ref)
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
