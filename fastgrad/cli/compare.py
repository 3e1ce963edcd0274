"""``fastgrad compare``: judge an output file against golden data (Ascend accuracy standards).

Usage::

    fastgrad compare ACTUAL GOLDEN [--standard single|double|legacy] [--reference REF]
                     [--level L0|L1|L2] [--dtype DT] [--shape 2,3]
                     [--golden-dtype DT] [--reference-dtype DT] [--json]

Files are ``.npy``, ``.pt`` (one tensor, e.g. an msprobe dump's ``dump_tensor_data/*.pt``: loaded
with ``map_location="cpu", weights_only=True``) or raw little-endian ``.bin`` dumps (as the aclnn
sample programs write them).  A ``.bin`` file's dtype comes from ``--dtype`` (``--golden-dtype`` /
``--reference-dtype`` when they differ, e.g. an fp32 golden beside a bf16 output), from its
``<stem>.json`` sidecar (``fastgrad golden --format bin`` and ``fastgrad case`` write one), or,
for a raw dump without one, from the other side's sidecar or ``.npy`` header, shape included: a
raw NPU output against ``fastgrad case``'s golden needs neither ``--dtype`` nor ``--shape``.
``--golden-dtype`` / ``--reference-dtype`` name a raw dump's dtype: given for a ``.npy`` or ``.pt``
that holds another, they are refused.  ``--shape`` reshapes every file (element counts must agree).
Integer outputs are compared for equality, value by value across integer dtypes.
``--dtype`` also names the output dtype whose thresholds apply (default: the actual file's).

Exit status: 0 pass, 1 fail, 2 bad usage or unreadable input.  See :mod:`fastgrad.compare`
for the standards.
"""

from __future__ import annotations

import argparse
import json

from ._common import CliError, OneLineParser, print_or_pipe_closed

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
    from ..compare import _parse_shape
    from ..errors import AclnnError

    try:
        dims = _parse_shape(s)
    except AclnnError:
        dims = None
    if not dims:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated sizes >= 0 whose product fits int64, such as 2,3,4, got {s!r}"
        )
    return dims


def _eps_type(s: str) -> float:
    import math

    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not 0 <= v < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 such as 1e-7, got {s!r}")
    return v


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
        "--level",
        choices=["L0", "L1", "L2"],
        help="with --standard double: the level required to pass (default L0)",
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
        help="dtype of a .bin --reference when it differs from --dtype (float64 allowed)",
    )
    p.add_argument("--shape", type=_shape_type, help="reshape the files, e.g. 2,3,4")
    p.add_argument("--eps", type=_eps_type, default=None, help="eps of the relative error (default 1e-7)")
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


def _is_raw(path: str) -> bool:
    return not path.lower().endswith((".npy", ".pt", ".pth"))


def _meta(what: str, path: str) -> dict | None:
    """What a file says of itself: a ``.bin``'s sidecar, a ``.npy``'s header (dtype, shape); None
    for a raw file without a sidecar (and for ``.pt``, read whole only when compared).  A malformed
    sidecar is a :class:`CliError` naming the file."""
    from ..compare import read_sidecar
    from ..errors import AclnnError

    if path.lower().endswith(".npy"):
        import numpy as np

        from ..dtypes import dtype_name

        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None
        if a.dtype.kind == "V" and a.dtype.itemsize == 2 and a.dtype.names is None:
            dt = "bfloat16"
        else:  # the element type: a big-endian header's '>f4' donates float32 to a raw dump
            dt = dtype_name(a.dtype.newbyteorder("="))
        return {"dtype": dt, "shape": list(a.shape)}
    if not _is_raw(path):
        return None
    try:
        return read_sidecar(path, strict=True)
    except AclnnError as e:
        raise CliError(f"{what}: {_lib_message(e)}") from None


def _load_stored(path: str):
    """A ``.pt`` file's array as stored (None when it cannot be read: the load proper says why)."""
    from ..compare import load_array
    from ..errors import AclnnError

    try:
        return load_array(path)
    except (AclnnError, OSError):
        return None


def _lib_message(e: Exception) -> str:
    """The library's message without its ``compare: `` prefix and ``[aclnn ...]`` suffix, on one line."""
    msg = getattr(e, "message", None) or str(e)
    if msg.startswith("compare: "):
        msg = msg[len("compare: ") :]
    return " ".join(msg.split())


def _donor(what: str, metas: dict) -> dict | None:
    """The dtype and shape a raw file without a sidecar takes: the golden's for the output under
    test and the reference (a float64 golden gives its shape only, not its dtype), the output's for the golden."""
    order = ["GOLDEN", "--reference", "ACTUAL"] if what != "GOLDEN" else ["ACTUAL", "--reference"]
    for other in order:
        m = metas.get(other)
        if other != what and m is not None:
            if what != "GOLDEN" and m.get("dtype") == "float64":
                continue
            return m
    return None


def _is_integer(a) -> bool:
    from ..dtypes import BFLOAT16

    return a.dtype.kind in "biu" and a.dtype != BFLOAT16


def _exact(actual, golden):
    """Integer outputs (a case's ``masked_target``, ``target_mask``): equal, element for element
    (as ``fastgrad golden --from-msprobe`` judges them)."""
    import numpy as np

    from ..compare import CompareResult
    from ..dtypes import dtype_name

    if actual.shape != golden.shape:
        bad, failures = actual.size, [f"shape {list(actual.shape)}, golden {list(golden.shape)}"]
    else:
        # equal values, exactly, across integer dtypes: the sign, then the bits of the value
        # (a uint64 2**64 - 1 is not an int64 -1; nothing goes through float64)
        a, g = np.asarray(actual), np.asarray(golden)
        neg_a = a < 0 if a.dtype.kind == "i" else np.zeros(a.shape, bool)
        neg_g = g < 0 if g.dtype.kind == "i" else np.zeros(g.shape, bool)
        same = (neg_a == neg_g) & (a.astype(np.uint64) == g.astype(np.uint64))
        bad = int(a.size - np.count_nonzero(same))
        failures = [f"{bad} of {actual.size} elements differ"] if bad else []
    return CompareResult(
        passed=not failures,
        standard="exact",
        dtype=dtype_name(actual.dtype),
        metrics={"mismatches": bad, "elements": int(actual.size)},
        thresholds={"mismatches": 0},
        failures=failures,
        follows="integer outputs: equal element for element (as fastgrad golden --from-msprobe)",
    )


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)  # first: `-h` imports nothing of the package

    from ..compare import REL_EPS, compare, load_array
    from ..dtypes import dtype_name
    from ..errors import AclnnError

    # options that only mean something beside another: refused, not ignored
    if args.reference and args.standard != "double":
        raise CliError(
            "--reference",
            "--standard double with it (single and legacy judge against GOLDEN only)",
            f"--standard {args.standard}",
        )
    if args.level and args.standard != "double":
        raise CliError(
            "--level", "--standard double with it (the double benchmark's levels)", f"--standard {args.standard}"
        )
    if args.reference_dtype and not args.reference:
        raise CliError("--reference-dtype", "--reference REF with it (the dtype of a raw reference)", "no --reference")
    if args.standard == "double" and not args.reference:
        raise CliError("--standard", "--reference REF with double (the third-party output)", "double without it")
    _check_file(args.actual, "ACTUAL")
    _check_file(args.golden, "GOLDEN")
    if args.reference:
        _check_file(args.reference, "--reference")
    files = [("ACTUAL", args.actual), ("GOLDEN", args.golden)] + (
        [("--reference", args.reference)] if args.reference else []
    )
    metas = {what: _meta(what, path) for what, path in files}

    def load(what, path, dtype, dtype_flag, own_flag):
        # the dtype options describe raw .bin files; .npy and .pt carry their own.  A raw .bin
        # without a dtype option takes its own sidecar's, else the other files' (a raw NPU dump
        # beside fastgrad's golden, whose sidecar knows the dtype and the shape)
        meta = metas[what]
        if _is_raw(path) and dtype is not None and meta is not None and meta["dtype"] != dtype:
            stem = path[: -len(".bin")] if path.lower().endswith(".bin") else path
            if own_flag:  # the flag describes this very file, and its sidecar says otherwise
                raise CliError(
                    dtype_flag,
                    f"{meta['dtype']} (what {stem}.json says of {path})",
                    dtype,
                    hint=f"drop {dtype_flag}, or fix the sidecar",
                )
            dtype = None  # --dtype as the golden's / reference's default: its own sidecar knows better
        if _is_raw(path) and dtype is None and meta is None:
            donor = _donor(what, metas)
            if donor is None:
                stem = path[: -len(".bin")] if path.lower().endswith(".bin") else path
                raise CliError(
                    what,
                    f"the dtype of the raw file {path!r}: {dtype_flag} DT (and --shape DIMS), or its sidecar "
                    f'{stem}.json like {{"dtype": "bfloat16", "shape": [2048, 896]}} (fastgrad golden --format bin '
                    "and fastgrad case write one beside each .bin)",
                    "a .bin with no sidecar, and no other file with one to take them from",
                )
            dtype, shape = donor["dtype"], args.shape if args.shape is not None else donor.get("shape")
        else:
            if not _is_raw(path) and own_flag and dtype_flag != "--dtype":
                # --golden-dtype / --reference-dtype describe a raw dump: a .npy / .pt that says
                # otherwise is refused, not read as what it says (--dtype also names the thresholds)
                stored = (meta or {}).get("dtype")
                if stored is None:  # a .pt: read once here, and used as read when not reshaped
                    whole = _load_stored(path)
                    stored = None if whole is None else dtype_name(whole.dtype)
                    if stored == dtype and args.shape is None:
                        return whole
                if stored is not None and stored != dtype:
                    raise CliError(
                        dtype_flag,
                        f"{stored} (the dtype stored in {path}) or no {dtype_flag}",
                        dtype,
                        hint=f"{dtype_flag} names the dtype of a raw .bin file",
                    )
            dtype, shape = (dtype if _is_raw(path) else None), args.shape
        try:
            return load_array(path, dtype, shape)
        except AclnnError as e:
            if e.param == "shape" and args.shape is None and dtype is not None and _is_raw(path):
                # the sidecar's shape does not fit the bytes read with the dtype flag's dtype
                raise CliError(dtype_flag, f"the dtype {path} holds", dtype, hint=_lib_message(e)) from None
            flag = "--shape" if e.param == "shape" and args.shape is not None else what
            raise CliError(f"{flag}: {_lib_message(e)}") from None
        except OSError as e:
            raise CliError(what, "a readable file", repr(path), hint=e.strerror or str(e)) from None

    actual = load("ACTUAL", args.actual, args.dtype, "--dtype", True)
    g_flag = "--golden-dtype" if args.golden_dtype else "--dtype"
    golden = load("GOLDEN", args.golden, args.golden_dtype or args.dtype, g_flag, bool(args.golden_dtype))
    ref = None
    if args.reference:
        r_flag = "--reference-dtype" if args.reference_dtype else "--dtype"
        ref = load(
            "--reference", args.reference, args.reference_dtype or args.dtype, r_flag, bool(args.reference_dtype)
        )
    _same_size(args, actual, golden, ref)
    if _is_integer(actual) or _is_integer(golden):
        if not (_is_integer(actual) and _is_integer(golden)):
            raise CliError(
                "GOLDEN",
                "integer outputs on both sides (compared for equality) or floating on both",
                f"ACTUAL {dtype_name(actual.dtype)}, GOLDEN {dtype_name(golden.dtype)}",
                hint="--dtype names a raw dump's dtype",
            )
        if args.standard != "single":
            raise CliError("--standard", "single (integer outputs are compared for equality)", args.standard)
        res = _exact(actual, golden)
    else:
        try:
            res = compare(
                actual,
                golden,
                dtype=args.dtype,
                standard=args.standard,
                reference=ref,
                level=args.level or "L0",
                eps=REL_EPS if args.eps is None else args.eps,
            )
        except (AclnnError, ValueError) as e:
            raise CliError(_lib_message(e)) from None
    # the verdict is the exit status even when the reader left (`fastgrad compare A G | head -1`)
    print_or_pipe_closed(json.dumps(res.to_dict(), indent=2) if args.json else res.summary())
    return 0 if res.passed else 1
