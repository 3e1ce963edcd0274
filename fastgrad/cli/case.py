"""``fastgrad case``: one command writes a complete device test case of one op.

Usage::

    fastgrad case OP --shape DIMS --dtype DT --out DIR [--soc-version NAME] [--strict|--no-strict]
                  [--seed N] [--attr NAME=VALUE ...] [--mode memory-saving|high-performance] [--force]

``OP`` is one of the seven ops, by fastgrad's name or its aclnn name (``aclnnCrossEntropyLossGrad``).
``--shape`` gives the op's dimensions (:data:`SHAPES`): ``BT,H,V`` for the three fused
linear cross-entropy ops, ``N,C`` for the cross-entropy grad, ``B,N,S1,S2`` for the scaled
masked softmax backward, any shape for the smooth-L1 backward, ``T,W,D`` (tokens, num_weights,
embedding dim) for the embedding backward.  ``--dtype`` is the floating dtype of the inputs
(``float16``/``bfloat16``/``float32`` where the op takes it).

``DIR`` receives::

    inputs/<param>.bin + <param>.json (+ <param>.npy)   every array input, as the op names it
    inputs/attrs.json                                   the scalar parameters
    golden/<output>.bin + <output>.json (+ .npy)        every output of the float64 golden
    chain/<op>/...                                      upstream ops that made inputs (when any)
    manifest.json                                       op, aclnn name, SoC, strict mode, seed,
                                                        dtype, shape, fastgrad version, command

The data is generated from ``--seed`` (default 0); inputs that another op makes on the device
come from that op's golden, so the case is consistent: the FLCE grad's ``logits_max`` /
``sum_exp_logits`` / ``target_mask`` / ``masked_target`` are the online max-sum's outputs for its
``input``/``weight``/``target`` (``--mode high-performance``: its ``softmax`` is the
loss-with-max-sum's), and the loss-with-max-sum's statistics and logits are the online
max-sum's (``chain/``).  ``inputs/`` is what ``fastgrad golden OP --inputs DIR/inputs`` reads,
and every ``.bin`` carries its dtype and shape in its sidecar, so ``fastgrad compare NPU.bin
DIR/golden/OUT.bin`` needs no ``--dtype``/``--shape``.

A SoC without a kernel of the op (the fused linear ops on Ascend950) is refused: one line, exit 2.
Exit status 0 written; 2 bad usage or inputs the op rejects (its aclnn status is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

from ._common import (
    ACLNN_OF,
    CliError,
    OneLineParser,
    add_device_options,
    enter_device,
    op_choices,
    refuse_missing_kernel,
    resolve_op,
)

if TYPE_CHECKING:  # NumPy is imported when a command runs, not with the CLI
    import numpy as np

#: What ``--shape`` names for each op (the dimension names; ``...``: any number of dimensions).
SHAPES = {
    "fused_linear_online_max_sum": ("BT", "H", "V"),
    "fused_cross_entropy_loss_with_max_sum": ("BT", "H", "V"),
    "fused_linear_cross_entropy_loss_grad": ("BT", "H", "V"),
    "cross_entropy_loss_grad": ("N", "C"),
    "scaled_masked_softmax_backward": ("B", "N", "S1", "S2"),
    "smooth_l1_loss_backward": ("...",),
    "embedding_dense_backward": ("T", "W", "D"),
}

FLOMS, FCE, FLCE = (
    "fused_linear_online_max_sum",
    "fused_cross_entropy_loss_with_max_sum",
    "fused_linear_cross_entropy_loss_grad",
)


def _shape_help() -> str:
    return "; ".join(f"{op}: {','.join(d)}" for op, d in SHAPES.items())


def parse_shape(op: str, text: str) -> tuple[int, ...]:
    names = SHAPES[op]
    try:
        dims = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        dims = ()
    want = "sizes" if names == ("...",) else ",".join(names)
    if not dims or any(d < 1 for d in dims) or (names != ("...",) and len(dims) != len(names)):
        raise CliError("--shape", f"{want} of {op} as integers >= 1, e.g. {_example(op)}", repr(text))
    return dims


def _example(op: str) -> str:
    return {
        FLOMS: "256,128,4096",
        FCE: "256,128,4096",
        FLCE: "256,128,4096",
        "cross_entropy_loss_grad": "64,32000",
        "scaled_masked_softmax_backward": "2,4,128,128",
        "smooth_l1_loss_backward": "64,512",
        "embedding_dense_backward": "512,32000,64",
    }[op]


def _normal(rng, shape, dt, scale=1.0):
    import numpy as np

    a = rng.standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
        a *= np.float32(scale)
    return a.astype(dt)


def _flce_inputs(dims, dt, rng) -> dict:
    """input ~ N(0, 1), weight ~ N(0, 1/H) (the LM head's scale), target uniform in [0, V)."""
    import numpy as np

    BT, H, V = dims
    return {
        "input": _normal(rng, (BT, H), dt),
        "weight": _normal(rng, (V, H), dt, 1.0 / np.sqrt(H)),
        "target": rng.integers(0, V, BT, dtype=np.int64),
    }


def generate(
    op: str, dims: tuple[int, ...], dt: np.dtype, rng: np.random.Generator, mode: str = "memory-saving"
) -> tuple[dict, dict, list]:
    """The op's array inputs, its attributes and the chain of upstream ops that made some of them
    (``[(op, inputs, attrs, {output: array})]``); the chain runs on the current backend, SoC and
    strict mode (the caller sets them).  ``mode``: the FLCE grad's (``"high-performance"``: its
    ``softmax`` input from the loss-with-max-sum, instead of the statistics)."""
    import numpy as np

    import fastgrad as fg

    if op == FLOMS:
        V = dims[2]
        return _flce_inputs(dims, dt, rng), {"vocab_start_index": 0, "vocab_end_index": V}, []
    if op in (FCE, FLCE):
        V = dims[2]
        up_in = _flce_inputs(dims, dt, rng)
        hp = op == FLCE and mode == "high-performance"
        up_attrs: dict[str, Any] = {"vocab_start_index": 0, "vocab_end_index": V, "return_logits": op == FCE or hp}
        f = fg.fused_linear_online_max_sum(**up_in, **up_attrs)
        up_out = {k: v for k, v in f._asdict().items() if v is not None}
        chain = [(FLOMS, up_in, up_attrs, up_out)]
        if op == FCE:
            inputs = {
                "logits_max": f.logits_max_local,
                "sum_exp_logits": f.sum_exp_logits_local,
                "predicted_logits": f.predicted_logits_local,
                "vocab_parallel_logits": f.vocab_parallel_logits,
            }
            return inputs, {"label_smoothing": 0.0}, chain
        BT = dims[0]
        inputs = {
            "grad": np.full(BT, 1.0 / BT, np.float32),  # d mean(loss) / d loss
            "input": up_in["input"],
            "weight": up_in["weight"],
            "target_mask": f.target_mask,
            "masked_target": f.masked_target,
        }
        if hp:
            loss, softmax = fg.fused_cross_entropy_loss_with_max_sum(
                f.logits_max_local,
                f.sum_exp_logits_local,
                f.predicted_logits_local,
                vocab_parallel_logits=f.vocab_parallel_logits,
            )
            inputs["softmax"] = softmax
            fce_in = {
                "logits_max": f.logits_max_local,
                "sum_exp_logits": f.sum_exp_logits_local,
                "predicted_logits": f.predicted_logits_local,
                "vocab_parallel_logits": f.vocab_parallel_logits,
            }
            chain.append((FCE, fce_in, {"label_smoothing": 0.0}, {"loss": loss, "softmax": softmax}))
        else:
            inputs["logits_max"] = f.logits_max_local
            inputs["sum_exp_logits"] = f.sum_exp_logits_local
        return inputs, {"label_smoothing": 0.0}, chain
    if op == "cross_entropy_loss_grad":
        N, C = dims
        x = rng.standard_normal((N, C), dtype=np.float32)
        x -= x.max(axis=1, keepdims=True)
        x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
        inputs = {
            "grad_loss": np.array(1.0, dt),
            "log_prob": x.astype(dt),
            "target": rng.integers(0, C, N, dtype=np.int64),
        }
        return inputs, {"reduction": "mean", "ignore_index": -100, "label_smoothing": 0.0}, []
    if op == "scaled_masked_softmax_backward":
        B, N, S1, S2 = dims
        z = rng.standard_normal((B, N, S1, S2), dtype=np.float32)
        z = np.exp(z - z.max(axis=-1, keepdims=True))
        z /= z.sum(axis=-1, keepdims=True)
        mask = np.triu(np.ones((S1, S2), np.bool_), 1)[None, None] | (rng.random((B, 1, S1, S2)) < 0.05)
        inputs = {"grad_output": _normal(rng, (B, N, S1, S2), dt), "y": z.astype(dt), "mask": mask}
        return inputs, {"scale": 1.0, "fix_triu_mask": False}, []
    if op == "smooth_l1_loss_backward":
        inputs = {"grad_out": np.array(1.0, dt), "input": _normal(rng, dims, dt), "target": _normal(rng, dims, dt)}
        return inputs, {"reduction": "mean", "beta": 1.0}, []
    if op == "embedding_dense_backward":
        T, W, D = dims
        inputs = {"grad": _normal(rng, (T, D), dt), "indices": rng.integers(0, W, T, dtype=np.int64)}
        return inputs, {"num_weights": W, "padding_idx": -1, "scale_grad_by_freq": False}, []
    raise CliError("OP", op_choices(), repr(op))  # pragma: no cover - resolved before


def _write(folder: str, arrays: dict) -> dict:
    """``<name>.bin`` + ``<name>.json`` + ``<name>.npy`` of each array; returns the manifest entries."""
    import numpy as np

    from ..compare import save_array
    from ..dtypes import dtype_name

    os.makedirs(folder, exist_ok=True)
    out = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        save_array(os.path.join(folder, name + ".bin"), a)
        save_array(os.path.join(folder, name + ".npy"), a)
        out[name] = {"dtype": dtype_name(a.dtype), "shape": list(a.shape), "file": name + ".bin"}
    return out


def _attrs_json(folder: str, attrs: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "attrs.json"), "w") as f:
        json.dump(attrs, f, indent=1)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="fastgrad case",
        description="Write a complete device test case of one op: every input and every golden output as "
        ".bin + .json sidecar (and .npy), and a manifest (SoC, strict mode, seed, fastgrad version, command).",
        epilog="--shape per op: "
        + _shape_help()
        + ".  Then: fastgrad compare NPU_OUT.bin DIR/golden/OUT.bin (dtype and shape from the golden's sidecar).",
    )
    p.add_argument("op", metavar="OP", help="the op, by fastgrad's or aclnn's name: " + op_choices())
    p.add_argument("--shape", required=True, metavar="DIMS", help="the op's dimensions, comma-separated (see below)")
    p.add_argument(
        "--dtype",
        required=True,
        metavar="DT",
        help="floating dtype of the inputs: float16|bfloat16|float32 (aliases fp16, bf16, fp32)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the case's directory (created; must be empty or new)")
    add_device_options(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the generated data (default 0)")
    p.add_argument(
        "--attr",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a scalar parameter (JSON value), e.g. --attr label_smoothing=0.1",
    )
    p.add_argument(
        "--mode",
        choices=["memory-saving", "high-performance"],
        default="memory-saving",
        help="FLCE grad only: the statistics (memory-saving, default) or the softmax (high-performance) as input",
    )
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    return p


def main(argv: list[str]) -> int:
    import contextlib

    args = build_parser().parse_args(argv)  # first: `-h` imports nothing of the package

    import numpy as np

    from ..dtypes import DTYPE_ALIASES, dtype_name
    from ..errors import AclnnError
    from .golden import _parse_attr

    op = resolve_op(args.op)
    if op is None:
        raise CliError("OP", "one of " + op_choices(), repr(args.op))
    dims = parse_shape(op, args.shape)
    dt = DTYPE_ALIASES.get(args.dtype.strip().lower())
    if dt is None or dt.name == "float64":
        raise CliError("--dtype", "float16, bfloat16 or float32 (aliases fp16, bf16, fp32)", repr(args.dtype))
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or (os.listdir(args.out) and not args.force)):
        what = "a file" if not os.path.isdir(args.out) else "a non-empty directory (--force writes into it)"
        raise CliError("--out", "a new or empty directory", repr(args.out), hint=what)
    try:
        overrides = dict(_parse_attr(a) for a in args.attr)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.mode != "memory-saving" and op != FLCE:
        raise CliError("--mode", f"memory-saving for {op} (high-performance is the FLCE grad's)", args.mode)
    import fastgrad as fg

    from .run import _prepare_out

    with contextlib.ExitStack() as stack:
        device = enter_device(stack, args)
        refuse_missing_kernel(op, device["soc_version"])
        _prepare_out(args.out)
        chain_note = " (the online max-sum's golden first)" if op in (FCE, FLCE) else ""
        print(
            f"fastgrad case: {ACLNN_OF[op]} {args.shape} {dtype_name(dt)} on {device['soc_version']}: generating the "
            f"inputs and the float64 golden{chain_note} ...",
            flush=True,
        )
        rng = np.random.default_rng(args.seed)
        stack.enter_context(fg.use_backend("reference"))
        try:
            with fg.strict(False):  # the upstream ops make data; only the case's own op is judged by strict mode
                inputs, attrs, chain = generate(op, dims, dt, rng, args.mode)
            unknown = [k for k in overrides if k not in attrs]
            if unknown:
                raise CliError("--attr", f"a scalar parameter of {op} ({', '.join(attrs)})", ", ".join(unknown))
            attrs.update(overrides)
            res = getattr(fg, op)(**inputs, **attrs)
        except AclnnError as e:
            print(
                f"fastgrad case: {op} rejected the case on {device['soc_version']}: {' '.join(str(e).split())}",
                file=sys.stderr,
            )
            return 2
    from .golden import OUTPUT_NAMES

    if not isinstance(res, tuple):
        res = (res,)
    names = getattr(res, "_fields", None) or OUTPUT_NAMES[op]
    outputs = {n: v for n, v in zip(names, res) if v is not None}
    man_in = _write(os.path.join(args.out, "inputs"), inputs)
    _attrs_json(os.path.join(args.out, "inputs"), attrs)
    man_out = _write(os.path.join(args.out, "golden"), outputs)
    man_chain = []
    feeds = {
        "logits_max_local": "logits_max",
        "sum_exp_logits_local": "sum_exp_logits",
        "predicted_logits_local": "predicted_logits",
        "vocab_parallel_logits": "vocab_parallel_logits",
    }
    for up_op, up_in, up_attrs, up_out in chain:
        folder = os.path.join(args.out, "chain", up_op)
        entry = {"op": up_op, "aclnn": ACLNN_OF[up_op], "attrs": up_attrs, "dir": os.path.join("chain", up_op)}
        if up_in:
            entry["inputs"] = _write(os.path.join(folder, "inputs"), up_in)
            _attrs_json(os.path.join(folder, "inputs"), up_attrs)
        entry["outputs"] = _write(os.path.join(folder, "golden"), up_out)
        entry["feeds"] = {o: feeds.get(o, o) for o in up_out if feeds.get(o, o) in inputs}
        man_chain.append(entry)
    manifest = {
        "kind": "fastgrad device test case",
        "op": op,
        "aclnn": ACLNN_OF[op],
        **device,
        "backend": "reference (float64 golden with the device's roundings)",
        "dtype": dtype_name(dt),
        "shape": dict(zip(SHAPES[op], dims)) if SHAPES[op] != ("...",) else list(dims),
        "mode": args.mode if op == FLCE else None,
        "seed": args.seed,
        "fastgrad": fg.__version__,
        "command": "fastgrad case " + " ".join(shlex.quote(a) for a in argv),
        "attrs": attrs,
        "inputs": man_in,
        "outputs": man_out,
        "chain": man_chain,
        "check": f"fastgrad compare NPU_OUTPUT.bin {os.path.join(args.out, 'golden', '<output>.bin')}",
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, default=str)
    print(f"  written to {args.out} (strict {'on' if device['strict'] else 'off'}, seed {args.seed}):")
    for where, man in (("inputs", man_in), ("golden", man_out)):
        for m in man.values():
            print(f"  {where}/{m['file']}  {m['dtype']} {m['shape']}")
    print(f"  check an NPU output: fastgrad compare NPU_OUT.bin {os.path.join(args.out, 'golden', '<output>.bin')}")
    return 0
