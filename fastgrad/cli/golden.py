"""``fastgrad golden``: golden outputs of a public op from input files (float64 reference).

Usage::

    fastgrad golden OP --inputs DIR --out DIR [--format npy|bin] [--attr NAME=VALUE ...]
                       [--backend reference]
    fastgrad golden --from-msprobe RANK_DIR --out DIR [--bench-dump DIR] [--soc-version NAME]
                       (an msprobe dump's calls of the seven ops: ``fastgrad/cli/msprobe.py``)

Input convention (``DIR``):

* ``<param>.npy`` — one file per array parameter, named exactly as the op's parameter
  (``input.npy``, ``weight.npy``, ``target_mask.npy`` ...; bfloat16 arrays saved from
  ``ml_dtypes`` are stored by NumPy as ``|V2`` and read back as bfloat16);
* or ``<param>.bin`` — a raw little-endian dump, with a sidecar ``<param>.json``
  ``{"dtype": "bfloat16", "shape": [2048, 896]}``;
* ``attrs.json`` — optional, the scalar parameters: ``{"reduction": "mean", "beta": 1.0}``;
  ``--attr name=value`` (value parsed as JSON, else taken as a string) overrides it.

Parameters without a file or attribute take the op's defaults; a required parameter without a
file is one line naming it (exit 2).  Outputs go to ``OUT/<output_name>.npy`` (or ``.bin`` + ``.json``
sidecar with ``--format bin``), named as in :data:`OUTPUT_NAMES`; outputs that are None
(e.g. ``vocab_parallel_logits`` without ``return_logits``) are not written.
``OUT/manifest.json`` records the op, backend, versions, the inputs, the attributes and the
outputs (dtype, shape, file).

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


def read_inputs(op: str, inputs_dir: str, attrs: dict | None = None) -> tuple[dict, list]:
    """The keyword arguments of ``op`` found in ``inputs_dir`` (+ ``attrs``), and the names of
    files that match no parameter."""
    import fastgrad as fg

    from ..compare import load_array

    fn = getattr(fg, op)
    params = [p for p in inspect.signature(fn).parameters if p != "out"]
    kwargs, used = {}, {"attrs.json"}
    for p in params:
        for ext in (".npy", ".bin"):
            path = os.path.join(inputs_dir, p + ext)
            if os.path.exists(path):
                kwargs[p] = load_array(path)
                used.add(p + ext)
                if ext == ".bin":
                    used.add(p + ".json")
                break
    file_attrs = {}
    ap = os.path.join(inputs_dir, "attrs.json")
    if os.path.exists(ap):
        with open(ap) as f:
            file_attrs = json.load(f)
    merged = dict(file_attrs, **(attrs or {}))
    for k, v in merged.items():
        if k not in params:
            raise ValueError(f"attribute {k!r} is not a parameter of {op} (parameters: {', '.join(params)})")
        if k in kwargs:
            raise ValueError(f"{k!r} is given both as a file and as an attribute")
        kwargs[k] = v
    unused = sorted(f for f in os.listdir(inputs_dir) if f not in used)
    return kwargs, unused


def golden(
    op: str, inputs_dir: str, out_dir: str, *, attrs: dict | None = None, fmt: str = "npy", backend: str = "reference"
) -> dict:
    """Run ``op`` on the inputs in ``inputs_dir`` through ``backend`` and write its outputs to
    ``out_dir``; returns ``{output_name: array}`` (None outputs omitted)."""
    import fastgrad as fg

    from ..compare import save_array
    from ..dtypes import dtype_name

    if op not in OUTPUT_NAMES:
        raise ValueError(f"unknown op {op!r}; one of: {', '.join(OPS)}")
    kwargs, unused = read_inputs(op, inputs_dir, attrs)
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
        path = save_array(os.path.join(out_dir, f"{name}.{fmt}"), a)
        outputs[name] = a
        manifest_out[name] = {"dtype": dtype_name(a.dtype), "shape": list(a.shape), "file": os.path.basename(path)}
    manifest = {
        "op": op,
        "backend": backend,
        "fastgrad": fg.__version__,
        "inputs": {
            k: ({"dtype": dtype_name(v.dtype), "shape": list(v.shape)} if isinstance(v, np.ndarray) else {"value": v})
            for k, v in kwargs.items()
        },
        "outputs": manifest_out,
        "ignored_files": unused,
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, default=str)
    return outputs


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="fastgrad golden",
        description="Golden outputs of a fastgrad op from input files, through the float64 reference backend.",
    )
    p.add_argument("op", help="public op name: " + ", ".join(OPS))
    p.add_argument("--inputs", required=True, metavar="DIR", help="directory of <param>.npy/.bin files")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for <output>.npy/.bin")
    p.add_argument("--format", default="npy", choices=["npy", "bin"], help="output file format")
    p.add_argument(
        "--attr",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="scalar parameter (JSON value), e.g. --attr reduction='\"sum\"' or --attr beta=0.5",
    )
    p.add_argument("--backend", default="reference", help="backend computing the outputs (default reference)")
    return p


def main(argv: list[str]) -> int:
    from ..errors import AclnnError

    if any(a == "--from-msprobe" or a.startswith("--from-msprobe=") for a in argv):
        from .msprobe import main as from_msprobe  # `fastgrad golden --from-msprobe RANK_DIR --out DIR`

        return from_msprobe(argv)
    p = build_parser()
    args = p.parse_args(argv)
    if args.op not in OUTPUT_NAMES:
        print(f"fastgrad golden: unknown op {args.op!r}; one of: {', '.join(OPS)}", file=sys.stderr)
        return 2
    if not os.path.isdir(args.inputs):
        print(f"fastgrad golden: --inputs {args.inputs!r} is not a directory", file=sys.stderr)
        return 2
    from .run import _prepare_out

    _prepare_out(args.out)  # writable before any work (a CliError: one line, exit 2)
    try:
        attrs = dict(_parse_attr(a) for a in args.attr)
        outputs = golden(args.op, args.inputs, args.out, attrs=attrs, fmt=args.format, backend=args.backend)
    except AclnnError as e:  # a rejected input is a usage error (exit 2); 1 means "a check failed"
        print(f"fastgrad golden: {args.op} rejected the inputs: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError, NotImplementedError) as e:
        print(f"fastgrad golden: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for name, a in outputs.items():
        print(f"{os.path.join(args.out, name + '.' + args.format)}  {a.dtype} {list(a.shape)}")
    return 0
