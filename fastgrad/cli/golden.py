"""``fastgrad golden``: golden outputs of a public op from input files (float64 reference).

Usage::

    fastgrad golden OP --inputs DIR --out DIR [--format npy|bin] [--attr NAME=VALUE ...]
                       [--dtype PARAM=DT ...] [--shape PARAM=DIMS ...]
                       [--soc-version NAME] [--strict|--no-strict] [--backend reference]
    fastgrad golden --from-msprobe RANK_DIR --out DIR [--bench-dump DIR] [--soc-version NAME]
                       (an msprobe dump's calls of the seven ops: ``fastgrad/cli/msprobe.py``)

``OP`` is fastgrad's name of the op or its aclnn name (``aclnnCrossEntropyLossGrad``).
``fastgrad case OP ...`` generates the inputs too (a whole device test case).

Input convention (``DIR``):

* ``<param>.npy`` — one file per array parameter, named exactly as the op's parameter
  (``input.npy``, ``weight.npy``, ``target_mask.npy`` ...; bfloat16 arrays saved from
  ``ml_dtypes`` are stored by NumPy as ``|V2`` and read back as bfloat16);
* or ``<param>.bin`` — a raw little-endian dump, with a sidecar ``<param>.json``
  ``{"dtype": "bfloat16", "shape": [2048, 896]}``, or ``--dtype PARAM=DT --shape PARAM=DIMS``;
* ``attrs.json`` — optional, the scalar parameters: ``{"reduction": "mean", "beta": 1.0}``;
  ``--attr name=value`` (value parsed as JSON, else taken as a string) overrides it.

Parameters without a file or attribute take the op's defaults; a required parameter without a
file is one line naming it (exit 2).  Outputs go to ``OUT/<output_name>.npy`` (or ``.bin`` + ``.json``
sidecar with ``--format bin``), named as in :data:`OUTPUT_NAMES`; outputs that are None
(e.g. ``vocab_parallel_logits`` without ``return_logits``) are not written.
``OUT/manifest.json`` records the op, backend, SoC (``--soc-version``, else ``FASTGRAD_SOC_VERSION``,
else Ascend910B), strict mode, versions, the inputs, the attributes and the outputs (dtype,
shape, file).  A SoC without a kernel of the op (the fused linear ops on Ascend950) is refused.

The outputs are computed by the float64 reference backend with the device's roundings
(``--backend`` may name another one, e.g. ``cpu`` to produce the third-party output of a
double-benchmark comparison).  Exit status: 0 written; 2 bad usage, unreadable files, or inputs
the op rejects (its aclnn status is printed) — 1 is the verdict of a check (``compare``,
``--check``) and ``golden`` has none.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

import numpy as np

from ._common import OneLineParser

#: Output names of each public op, in the order it returns them.
OUTPUT_NAMES = {
    "fused_linear_online_max_sum": (
        "logits_max_local",
        "sum_exp_logits_local",
        "predicted_logits_local",
        "target_mask",
        "masked_target",
        "vocab_parallel_logits",
    ),
    "fused_cross_entropy_loss_with_max_sum": ("loss", "softmax"),
    "fused_linear_cross_entropy_loss_grad": ("grad_input", "grad_weight"),
    "cross_entropy_loss_grad": ("x_grad",),
    "scaled_masked_softmax_backward": ("out",),
    "smooth_l1_loss_backward": ("grad_input",),
    "embedding_dense_backward": ("out",),
}

OPS = tuple(OUTPUT_NAMES)


def _parse_attr(text: str):
    if "=" not in text:
        raise ValueError(f"--attr expects NAME=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    try:
        return k.strip(), json.loads(v)
    except json.JSONDecodeError:
        return k.strip(), v


def read_inputs(
    op: str,
    inputs_dir: str,
    attrs: dict | None = None,
    dtypes: dict | None = None,
    shapes: dict | None = None,
) -> tuple[dict, list]:
    """The keyword arguments of ``op`` found in ``inputs_dir`` (+ ``attrs``), and the names of
    files that match no parameter.  ``dtypes`` / ``shapes``: ``{param: dtype / shape}`` of raw
    ``.bin`` files without a sidecar."""
    import fastgrad as fg

    from ..compare import load_array, read_sidecar
    from ..dtypes import dtype_name, parse_dtype
    from ..errors import AclnnError
    from ._common import CliError

    fn = getattr(fg, op)
    params = [p for p in inspect.signature(fn).parameters if p != "out"]
    dtypes, shapes = dtypes or {}, shapes or {}
    for flag, given in (("--dtype", dtypes), ("--shape", shapes)):
        bad = [k for k in given if k not in params]
        if bad:
            raise CliError(flag, f"PARAM=... for a parameter of {op} ({', '.join(params)})", ", ".join(bad))
    kwargs, used = {}, {"attrs.json"}
    for p in params:
        for ext in (".npy", ".bin"):
            path = os.path.join(inputs_dir, p + ext)
            if os.path.lexists(path):
                if not os.path.isfile(path):
                    raise CliError("--inputs", f"{p}{ext} as a file", repr(path), hint="a directory or not a file")
                side = None
                if ext == ".bin":
                    try:
                        side = read_sidecar(path, strict=True)
                    except AclnnError as e:
                        raise CliError("--inputs", f"a valid sidecar {p}.json", repr(path), hint=_msg(e)) from None
                if ext == ".bin" and side is None and p not in dtypes:
                    raise CliError(
                        "--inputs",
                        f"the dtype and shape of the raw {p}.bin: its sidecar {p}.json like "
                        f'{{"dtype": "bfloat16", "shape": [2048, 896]}}, or --dtype {p}=DT --shape {p}=DIMS',
                        f"{path!r} without {p}.json",
                    )
                if side is not None and p in dtypes and parse_dtype(side["dtype"]) != dtypes[p]:
                    raise CliError(
                        "--dtype",
                        f"no --dtype for {p}.bin, whose sidecar {p}.json says {side['dtype']} "
                        "(--dtype is for a raw .bin without its sidecar)",
                        f"{p}={dtype_name(dtypes[p])}",
                    )
                try:
                    kwargs[p] = load_array(path, dtypes.get(p), shapes.get(p))
                except (ValueError, OSError) as e:
                    raise CliError("--inputs", f"a readable {p}{ext}", repr(path), hint=_msg(e)) from None
                used.add(p + ext)
                if ext == ".bin":
                    used.add(p + ".json")
                break
    file_attrs: dict = {}
    ap = os.path.join(inputs_dir, "attrs.json")
    if os.path.lexists(ap):
        expected = 'attrs.json a JSON object of the scalar parameters, like {"reduction": "mean"}'
        try:
            with open(ap) as f:
                loaded = json.load(f)
        except (OSError, ValueError) as e:
            raise CliError("--inputs", expected, repr(ap), hint=_msg(e)) from None
        if not isinstance(loaded, dict):
            raise CliError("--inputs", expected, repr(ap), hint=f"a JSON {type(loaded).__name__}")
        file_attrs = loaded
    attrs = attrs or {}
    for k, v in dict(file_attrs, **attrs).items():
        where = "--attr" if k in attrs else "--inputs"
        got = k if k in attrs else f"{k!r} in {ap!r}"
        if k not in params:
            raise CliError(where, f"a parameter of {op} ({', '.join(params)})", got)
        if k in kwargs:
            raise CliError(where, f"{k} given once (it has a file in --inputs)", got)
        kwargs[k] = v
    unused = sorted(f for f in os.listdir(inputs_dir) if f not in used)
    return kwargs, unused


def _msg(e: BaseException) -> str:
    msg = getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)
    if msg.startswith("compare: "):
        msg = msg[len("compare: ") :]
    return " ".join(str(msg).split())


def golden(
    op: str,
    inputs_dir: str,
    out_dir: str,
    *,
    attrs: dict | None = None,
    fmt: str = "npy",
    backend: str = "reference",
    dtypes: dict | None = None,
    shapes: dict | None = None,
    device: dict | None = None,
) -> dict:
    """Run ``op`` on the inputs in ``inputs_dir`` through ``backend`` and write its outputs to
    ``out_dir``; returns ``{output_name: array}`` (None outputs omitted).  ``device``: the SoC
    and strict mode in force, for the manifest (default: the current settings)."""
    from .. import _config

    if op not in OUTPUT_NAMES:
        raise ValueError(f"unknown op {op!r}; one of: {', '.join(OPS)}")
    if device is None:
        from ..soc import profile_name

        soc = _config.get_soc_version()
        device = {"soc_version": soc, "soc_profile": profile_name(soc), "strict": _config.is_strict()}
    kwargs, unused = load_inputs(op, inputs_dir, attrs, dtypes, shapes)
    return compute(op, kwargs, unused, out_dir, fmt=fmt, backend=backend, device=device)


def load_inputs(
    op: str, inputs_dir: str, attrs: dict | None = None, dtypes: dict | None = None, shapes: dict | None = None
) -> tuple[dict, list]:
    """:func:`read_inputs`, and a :class:`CliError` naming the required parameters without a file."""
    import fastgrad as fg

    kwargs, unused = read_inputs(op, inputs_dir, attrs, dtypes, shapes)
    missing = [
        n
        for n, p in inspect.signature(getattr(fg, op)).parameters.items()
        if p.default is inspect.Parameter.empty and n not in kwargs and n != "out"
    ]
    if missing:
        from ._common import CliError

        have = sorted(f for f in os.listdir(inputs_dir) if f.endswith((".npy", ".bin")))
        raise CliError(
            "--inputs",
            f"a file for each required input of {op}: " + ", ".join(f"{n}.npy" for n in missing) + " (or .bin + .json)",
            f"{inputs_dir!r} with " + (", ".join(have) if have else "no .npy/.bin files"),
        )
    return kwargs, unused


def compute(
    op: str,
    kwargs: dict,
    unused: list,
    out_dir: str,
    *,
    fmt: str = "npy",
    backend: str = "reference",
    device: dict,
    out=None,
) -> dict:
    """Run ``op`` on ``kwargs`` through ``backend``, write its outputs and the manifest to
    ``out_dir`` (``out``: a :class:`~fastgrad.cli._common.OutputFolder` recording each file before
    it is written); returns ``{output_name: array}``."""
    import fastgrad as fg

    from ..compare import save_array
    from ..dtypes import dtype_name

    with fg.use_backend(backend):
        res = getattr(fg, op)(**kwargs)
    if not isinstance(res, tuple):
        res = (res,)
    names = getattr(res, "_fields", None) or OUTPUT_NAMES[op]
    os.makedirs(out_dir, exist_ok=True)
    outputs, manifest_out = {}, {}
    for name, val in zip(names, res):
        if val is None:
            continue
        a = np.asarray(val)
        path = os.path.join(out_dir, f"{name}.{fmt}")
        if out is not None:
            out.add(path, *([os.path.splitext(path)[0] + ".json"] if fmt == "bin" else []))
        save_array(path, a)
        outputs[name] = a
        manifest_out[name] = {"dtype": dtype_name(a.dtype), "shape": list(a.shape), "file": os.path.basename(path)}
    manifest = {
        "op": op,
        "backend": backend,
        **device,
        "fastgrad": fg.__version__,
        "inputs": {
            k: ({"dtype": dtype_name(v.dtype), "shape": list(v.shape)} if isinstance(v, np.ndarray) else {"value": v})
            for k, v in kwargs.items()
        },
        "outputs": manifest_out,
        "ignored_files": unused,
    }
    if out is not None:
        out.add(os.path.join(out_dir, "manifest.json"))
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, default=str)
    return outputs


def _param_values(flag: str, items: list, parse) -> dict:
    """``--dtype PARAM=DT`` / ``--shape PARAM=DIMS`` into ``{param: value}``."""
    from ._common import CliError

    out = {}
    for text in items:
        name, sep, value = text.partition("=")
        if not sep or not name.strip():
            raise CliError(
                flag, "PARAM=VALUE, e.g. " + ("log_prob=bf16" if flag == "--dtype" else "log_prob=64,32000"), repr(text)
            )
        try:
            out[name.strip()] = parse(value)
        except (ValueError, TypeError, CliError):
            raise CliError(
                flag, "a dtype such as bf16" if flag == "--dtype" else "sizes such as 64,32000", repr(text)
            ) from None
    return out


def _dims(text: str) -> tuple:
    from ._common import parse_sizes

    return parse_sizes(text, "--shape", "sizes such as 64,32000")


def build_parser() -> argparse.ArgumentParser:
    from ._common import add_device_options, op_choices

    p = OneLineParser(
        prog="fastgrad golden",
        description="Golden outputs of a fastgrad op from input files, through the float64 reference backend "
        "(`fastgrad case OP ...` generates the inputs too).",
        epilog="From an msprobe dump instead: fastgrad golden --from-msprobe RANK_DIR --out DIR "
        "[--bench-dump DIR] [--soc-version NAME] [--backend NAME] [--quiet] (every call of the seven ops "
        "recomputed and judged; --bench-dump DIR writes an msprobe dump of fastgrad's outputs for msprobe compare).",
    )
    p.add_argument("op", metavar="OP", help="the op, by fastgrad's or aclnn's name: " + op_choices())
    p.add_argument("--inputs", required=True, metavar="DIR", help="directory of <param>.npy/.bin files")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for <output>.npy/.bin")
    p.add_argument("--format", default="npy", choices=["npy", "bin"], help="output file format (bin: + .json sidecar)")
    p.add_argument(
        "--attr",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="scalar parameter (JSON value), e.g. --attr reduction='\"sum\"' or --attr beta=0.5",
    )
    p.add_argument(
        "--dtype",
        action="append",
        default=[],
        metavar="PARAM=DT",
        help="dtype of a raw PARAM.bin without its PARAM.json sidecar, e.g. --dtype log_prob=bf16",
    )
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="PARAM=DIMS",
        help="shape of a raw PARAM.bin without its sidecar, e.g. --shape log_prob=64,32000 (default: 1-D)",
    )
    add_device_options(p)
    p.add_argument("--backend", default="reference", help="backend computing the outputs (default reference)")
    p.add_argument(
        "--from-msprobe",
        metavar="RANK_DIR",
        help="instead of OP/--inputs: recompute an msprobe dump's calls of the seven ops (see below)",
    )
    p.add_argument("--bench-dump", metavar="DIR", help="with --from-msprobe: an msprobe dump of fastgrad's outputs")
    return p


def main(argv: list[str]) -> int:
    import contextlib

    from ._common import CliError, enter_device, op_choices, refuse_missing_kernel, resolve_op

    if any(a == "--from-msprobe" or a.startswith("--from-msprobe=") for a in argv) and not any(
        a in ("-h", "--help") for a in argv
    ):
        from .msprobe import main as from_msprobe  # `fastgrad golden --from-msprobe RANK_DIR --out DIR`

        return from_msprobe(argv)
    p = build_parser()
    args = p.parse_args(argv)  # first: `-h` imports nothing of the package

    from ..dtypes import parse_dtype
    from ..errors import AclnnError

    op = resolve_op(args.op)
    if op is None:
        raise CliError("OP", "one of " + op_choices(), repr(args.op))
    if args.bench_dump:
        raise CliError("--bench-dump", "--from-msprobe RANK_DIR with it", "OP --inputs")
    if not os.path.isdir(args.inputs):
        print(f"fastgrad golden: --inputs {args.inputs!r} is not a directory", file=sys.stderr)
        return 2
    dtypes = _param_values("--dtype", args.dtype, parse_dtype)
    shapes = _param_values("--shape", args.shape, _dims)
    try:
        attrs = dict(_parse_attr(a) for a in args.attr)
    except ValueError as e:
        raise CliError(str(e)) from None
    import fastgrad as fg

    from ._common import OutputFolder

    if args.backend not in fg.available_backends():
        raise CliError(
            "--backend", "an available backend (" + ", ".join(fg.available_backends()) + ")", repr(args.backend)
        )
    with contextlib.ExitStack() as stack:
        device = enter_device(stack, args)
        refuse_missing_kernel(op, device["soc_version"])
        kwargs, unused = load_inputs(op, args.inputs, attrs, dtypes, shapes)  # read and checked before any work
        # writable before any work (a CliError: one line, exit 2); removed again if nothing is written
        out = stack.enter_context(OutputFolder.prepared(args.out))
        try:
            outputs = compute(
                op, kwargs, unused, args.out, fmt=args.format, backend=args.backend, device=device, out=out
            )
        except AclnnError as e:  # a rejected input is a usage error (exit 2); 1 means "a check failed"
            raise CliError(f"{op} rejected the inputs: {' '.join(str(e).split())}") from None
        except (ValueError, TypeError, NotImplementedError) as e:
            raise CliError(f"{op}: {type(e).__name__}: {' '.join(str(e).split())}") from None
    for name, a in outputs.items():
        print(f"{os.path.join(args.out, name + '.' + args.format)}  {a.dtype} {list(a.shape)}")
    return 0
