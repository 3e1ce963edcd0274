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
Every flag is checked before any work: ``--seed`` (>= 0), ``--shape`` (no empty item; refused when
even the float64 golden's largest arrays cannot fit in memory), ``--attr`` (a parameter of the op,
with a value the op takes: tried on a small case of the op first).  A refusal, Ctrl-C or a failed
write (a full disk: one line naming ``--out`` and the file) removes what the run wrote, and the
folder when it made it.  ``--force`` replaces an older case in ``DIR``.
Exit status 0 written; 2 bad usage or inputs the op rejects (its aclnn status is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from typing import TYPE_CHECKING, Any

from ._common import (
    ACLNN_OF,
    CliError,
    OneLineParser,
    OutputFolder,
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
    from ._common import parse_sizes

    names = SHAPES[op]
    want = "sizes" if names == ("...",) else ",".join(names)
    expected = f"{want} of {op} as integers >= 1, e.g. {_example(op)}"
    dims = parse_sizes(text, "--shape", expected, minimum=1)
    if not dims or (names != ("...",) and len(dims) != len(names)):
        raise CliError("--shape", expected, repr(text))
    return dims


def _min_bytes(op: str, dims: tuple[int, ...]) -> int:
    """A lower bound of the memory the case takes: the float64 golden's largest arrays (the fused
    linear ops' logits, the weight), nothing else.  Refusing only when even this does not fit, the
    estimate never refuses a case that would run."""
    import math

    if op in (FLOMS, FCE, FLCE):
        BT, H, V = dims
        return 8 * (BT * V + V * H + BT * H)
    if op == "embedding_dense_backward":
        T, W, D = dims
        return 8 * (W * D + T * D)
    return 8 * 2 * math.prod(dims)


def _check_memory(op: str, dims: tuple[int, ...], text: str) -> None:
    from ._run_args import fmt_bytes, memory_limit_bytes

    need = _min_bytes(op, dims)
    limit, src = memory_limit_bytes()
    if need > limit:
        raise CliError(
            "--shape",
            f"a case that fits in memory ({src}: {fmt_bytes(limit)})",
            f"{text!r}, whose float64 golden alone takes at least {fmt_bytes(need)}",
        )


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


def _write(folder: str, arrays: dict, out: OutputFolder | None = None) -> dict:
    """``<name>.bin`` + ``<name>.json`` + ``<name>.npy`` of each array; returns the manifest entries.
    ``out``: the files are recorded there before they are written (removed if the command fails)."""
    import numpy as np

    from ..compare import save_array
    from ..dtypes import dtype_name

    os.makedirs(folder, exist_ok=True)
    res = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        base = os.path.join(folder, name)
        if out is not None:
            out.add(base + ".bin", base + ".json")
        save_array(base + ".bin", a)
        if out is not None:
            out.add(base + ".npy")
        save_array(base + ".npy", a)
        res[name] = {"dtype": dtype_name(a.dtype), "shape": list(a.shape), "file": name + ".bin"}
    return res


def _attrs_json(folder: str, attrs: dict, out: OutputFolder | None = None) -> None:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "attrs.json")
    if out is not None:
        out.add(path)
    with open(path, "w") as f:
        json.dump(attrs, f, indent=1)


#: What a case writes in its folder (``--force`` replaces these, and only in a case's folder).
CASE_ENTRIES = ("inputs", "golden", "chain", "manifest.json")


def _is_case(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "manifest.json")) as f:
            return json.load(f).get("kind") == "fastgrad device test case"
    except (OSError, ValueError, AttributeError):
        return False


def _check_force(folder: str) -> list[str]:
    """``--force`` over a non-empty ``folder``: the entries of an older case to remove before
    writing (an older case of another op would leave its files for ``golden --inputs`` to pick up).
    A folder that holds a case's entries but is no case is refused."""
    if not os.path.isdir(folder):
        return []
    old = [e for e in CASE_ENTRIES if os.path.lexists(os.path.join(folder, e))]
    if old and not _is_case(folder):
        raise CliError(
            "--out",
            "a new or empty directory, or (--force) one holding a fastgrad case (its manifest.json)",
            repr(folder),
            hint=f"not a case, and it holds {', '.join(old)}: --force would replace them",
        )
    return old


def _clear(folder: str, entries: list[str]) -> None:
    import shutil

    for e in entries:
        path = os.path.join(folder, e)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


#: The scalar parameters ``--attr`` may set, per op (what :func:`generate` gives them).
ATTRS = {
    FLOMS: ("vocab_start_index", "vocab_end_index"),
    FCE: ("label_smoothing",),
    FLCE: ("label_smoothing",),
    "cross_entropy_loss_grad": ("reduction", "ignore_index", "label_smoothing"),
    "scaled_masked_softmax_backward": ("scale", "fix_triu_mask"),
    "smooth_l1_loss_backward": ("reduction", "beta"),
    "embedding_dense_backward": ("num_weights", "padding_idx", "scale_grad_by_freq"),
}


def _fit_attrs(op: str, inputs: dict, attrs: dict) -> None:
    """Inputs whose shape an attribute sets: the CE grad's ``grad_loss`` is (N,) for
    ``reduction="none"`` (a scalar for mean and sum)."""
    import numpy as np

    if op == "cross_entropy_loss_grad" and attrs.get("reduction") == "none":
        g = inputs["grad_loss"]
        inputs["grad_loss"] = np.full(inputs["log_prob"].shape[0], 1.0, g.dtype)


def _mini_dims(op: str, dims: tuple[int, ...]) -> tuple[int, ...]:
    """A small case of the same op that keeps the sizes an attribute may be checked against (V of
    the vocabulary indices, W of the embedding's padding index, C, the softmax's S1, S2)."""
    if op in (FLOMS, FCE, FLCE):
        return (1, 1, dims[2])
    if op == "cross_entropy_loss_grad":
        return (1, dims[1])
    if op == "scaled_masked_softmax_backward":
        return (1, 1, dims[2], dims[3])
    if op == "embedding_dense_backward":
        return (1, dims[1], 1)
    return (1,) * len(dims)


def _check_attrs(op: str, dims: tuple[int, ...], dt, mode: str, overrides: dict, given: list) -> None:
    """Refuse ``--attr`` overrides the op rejects before generating the case: run the op on a small
    case of the same kind with and without them (the small case alone is not judged: a refusal
    counts only when the overrides make it)."""
    import numpy as np

    import fastgrad as fg

    from ..errors import AclnnError

    unknown = [k for k in overrides if k not in ATTRS[op]]
    if unknown:
        raise CliError("--attr", f"a scalar parameter of {op} ({', '.join(ATTRS[op])})", ", ".join(unknown))
    if not overrides:
        return
    mini = _mini_dims(op, dims)

    def run(extra: dict):
        with fg.strict(False):
            inputs, attrs, _ = generate(op, mini, dt, np.random.default_rng(0), mode)
        attrs.update(extra)
        _fit_attrs(op, inputs, attrs)
        getattr(fg, op)(**inputs, **attrs)

    try:
        run({})
    except (AclnnError, MemoryError):
        return  # the small case is no measure of this one: the full run judges the overrides
    try:
        run(overrides)
    except AclnnError as e:
        msg = " ".join(str(e).split())
        raise CliError("--attr", f"a value {op} takes", " ".join(given), hint=msg) from None
    except (TypeError, ValueError) as e:  # a value of the wrong kind ("abc" for a float)
        raise CliError("--attr", f"a value {op} takes", " ".join(given), hint=" ".join(str(e).split())) from None


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
    p.add_argument("--seed", type=_seed, default=0, help="seed of the generated data, an integer >= 0 (default 0)")
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
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty --out: an older case there (its inputs/, golden/, chain/, manifest.json) "
        "is replaced; a folder holding those entries that is no case is refused",
    )
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
    old_case = _check_force(args.out) if args.force else []
    try:
        overrides = dict(_parse_attr(a) for a in args.attr)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.mode != "memory-saving" and op != FLCE:
        raise CliError("--mode", f"memory-saving for {op} (high-performance is the FLCE grad's)", args.mode)
    _check_memory(op, dims, args.shape)
    import fastgrad as fg

    with contextlib.ExitStack() as stack:
        device = enter_device(stack, args)
        refuse_missing_kernel(op, device["soc_version"])
        stack.enter_context(fg.use_backend("reference"))
        _check_attrs(op, dims, dt, args.mode, overrides, args.attr)  # before the (long) generation
        out = stack.enter_context(OutputFolder.prepared(args.out))
        chain_note = " (the online max-sum's golden first)" if op in (FCE, FLCE) else ""
        print(
            f"fastgrad case: {ACLNN_OF[op]} {args.shape} {dtype_name(dt)} on {device['soc_version']}: generating the "
            f"inputs and the float64 golden{chain_note} ...",
            flush=True,
        )
        rng = np.random.default_rng(args.seed)
        try:
            with fg.strict(False):  # the upstream ops make data; only the case's own op is judged by strict mode
                inputs, attrs, chain = generate(op, dims, dt, rng, args.mode)
            attrs.update(overrides)
            _fit_attrs(op, inputs, attrs)
            res = getattr(fg, op)(**inputs, **attrs)
        except AclnnError as e:
            raise CliError(f"{op} rejected the case on {device['soc_version']}: {' '.join(str(e).split())}") from None
        except MemoryError:
            raise CliError("--shape", "a case that fits in memory", repr(args.shape), hint="out of memory") from None
        _clear(args.out, old_case)
        _write_case(args, argv, op, dims, dt, device, inputs, attrs, chain, res, out)
    return 0


def _write_case(args, argv, op, dims, dt, device, inputs, attrs, chain, res, out: OutputFolder) -> None:
    import fastgrad as fg

    from ..dtypes import dtype_name
    from .golden import OUTPUT_NAMES

    if not isinstance(res, tuple):
        res = (res,)
    names = getattr(res, "_fields", None) or OUTPUT_NAMES[op]
    outputs = {n: v for n, v in zip(names, res) if v is not None}
    man_in = _write(os.path.join(args.out, "inputs"), inputs, out)
    _attrs_json(os.path.join(args.out, "inputs"), attrs, out)
    man_out = _write(os.path.join(args.out, "golden"), outputs, out)
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
            entry["inputs"] = _write(os.path.join(folder, "inputs"), up_in, out)
            _attrs_json(os.path.join(folder, "inputs"), up_attrs, out)
        entry["outputs"] = _write(os.path.join(folder, "golden"), up_out, out)
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
    path = os.path.join(args.out, "manifest.json")
    out.add(path)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, default=str)
    print(f"  written to {args.out} (strict {'on' if device['strict'] else 'off'}, seed {args.seed}):")
    for where, man in (("inputs", man_in), ("golden", man_out)):
        for m in man.values():
            print(f"  {where}/{m['file']}  {m['dtype']} {m['shape']}")
    print(f"  check an NPU output: fastgrad compare NPU_OUT.bin {os.path.join(args.out, 'golden', '<output>.bin')}")
