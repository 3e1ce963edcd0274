"""msprobe dumps in: fastgrad's golden for the calls of the seven ops an msprobe dump recorded.

msprobe (``pip install mindstudio-probe``; ``PrecisionDebugger(task="tensor", level="L1" or
"mix")``) writes, per step and rank, ``step<N>/rank<R>/`` (or ``proc<pid>/`` without
torch.distributed) holding ``dump.json``, ``stack.json``, ``construct.json`` and
``dump_tensor_data/<Entry>.<n>.<forward|backward>.<input|output>.<i>.pt``.  ``dump.json``'s
``data`` maps ``<Prefix>.<api>.<n>.forward`` to ``{input_args, input_kwargs, output}`` and
``<...>.backward`` to ``{input, output}``: a backward record's ``input`` holds the gradients
flowing in, its ``output`` the gradients the API's **last autograd node** returns, in that
node's input order (``None`` where an input needs no gradient).

:func:`read_dump` reads such a directory; :func:`map_dump` finds the calls fastgrad can
recompute and says why for the others; :func:`check_dump` recomputes every recorded output with
fastgrad's golden (the float64 reference backend, the device's roundings) and judges it with the
Ascend single benchmark (:func:`fastgrad.compare`; integer outputs must be equal);
:func:`write_bench_dump` writes a copy of the dump whose mapped outputs are fastgrad's, for
``msprobe compare``.

What maps (entry → fastgrad op: the recorded outputs compared):

* ``Functional.smooth_l1_loss.N.backward`` → ``smooth_l1_loss_backward``: ``output.0`` (d input),
  ``output.1`` (d target = -d input);
* ``Functional.embedding.N.backward`` → ``embedding_dense_backward``: ``output.0`` (d weight);
* ``Torch|Functional|Tensor.softmax.N.backward`` over the last dim → ``scaled_masked_softmax_backward``
  (scale 1, no mask): ``output.0`` (with ``dtype=``, as Hugging Face's ``softmax(x, -1,
  dtype=torch.float32)``: when that gradient is in the softmax's dtype, the softmax node's);
* ``NPU.npu_scaled_masked_softmax.N.backward`` and ``NPU.npu_scaled_masked_softmax_backward.N.forward``
  → ``scaled_masked_softmax_backward``: ``output.0``;
* ``NPU.npu_cross_entropy_loss.N.backward`` and ``NPU.npu_cross_entropy_loss_backward.N.forward`` →
  ``cross_entropy_loss_grad``: ``output.0`` (d input);
* ``NPU.npu_fused_linear_online_max_sum.N.forward`` → ``fused_linear_online_max_sum``: ``output.0-5``;
* ``NPU.npu_fused_cross_entropy_loss_with_max_sum.N.forward`` → ``fused_cross_entropy_loss_with_max_sum``:
  ``output.0-1``;
* ``NPU.npu_fused_linear_cross_entropy_loss_with_max_sum_backward.N.forward`` →
  ``fused_linear_cross_entropy_loss_grad``: ``output.0-1``;
* ``Aten.smooth_l1_loss_backward*`` / ``Aten.embedding_dense_backward*`` forward records → the same
  ops: ``output.0``.

A tensor record without ``data_name`` is an empty tensor (msprobe saves no file for a null
storage pointer: the empty array) or one kept as statistics only (the entry's reason); a dump
whose ``data_mode`` left out the inputs is reported per entry.

Traps (each reported by name, never guessed):

* ``Functional.cross_entropy.N.backward.output.0`` is **not** d loss / d logits: msprobe hooks
  the functional API's last autograd node, ``nll_loss``, so the record holds the gradient into
  ``nll_loss`` (d loss / d log_softmax: ``-w/W`` at the targets, 0 elsewhere).  fastgrad's
  ``cross_entropy_loss_grad`` (aclnnCrossEntropyLossGrad) is the gradient w.r.t. the logits:
  dump ``NPU.npu_cross_entropy_loss`` instead.
* The three fused-linear ops appear only when registered:
  ``PrecisionDebugger.register_custom_api(torch_npu, "<name>", "NPU")``.
* NPU tensors are loaded with ``torch.load(..., map_location="cpu", weights_only=True)``.
* ``npu_fused_linear_online_max_sum``'s ``target_mask`` padding bits (rows >= BT of the last
  byte): the kernel pads the target with 0 before comparing, the torch_npu doc says 1;
  consumers ignore them, so only the BT row bits are judged (a padding difference is noted).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._msprobe_io import (
    Dump,
    DumpError,
    NoData,
    empty_or_no_data,
    find_dump_json,
    load_pt,
    read_dump,
    to_numpy,
    to_torch,
)

#: The seven ops' family: API names (after the prefix) whose records are not silently skipped.
_FAMILY = re.compile(r"smooth_l1|embedding|softmax|cross_entropy|nll_loss|npu_")

_ENTRY = re.compile(r"^(?P<api>.+)\.(?P<n>\d+)\.(?P<dir>forward|backward)$")

#: The entries :func:`map_entry` recomputes: backward records, forward records (and Aten ops).
_BACKWARD_APIS = frozenset(
    ("Functional.smooth_l1_loss", "Functional.embedding", "Torch.embedding", "Torch.softmax", "Functional.softmax")
    + ("Tensor.softmax", "NPU.npu_scaled_masked_softmax", "NPU.npu_cross_entropy_loss")
)
_FORWARD_APIS = frozenset(
    ("NPU.npu_fused_linear_online_max_sum", "NPU.npu_fused_cross_entropy_loss_with_max_sum")
    + ("NPU.npu_fused_linear_cross_entropy_loss_with_max_sum_backward", "NPU.npu_cross_entropy_loss_backward")
    + ("NPU.npu_scaled_masked_softmax_backward",)
)
_ATEN_OPS = frozenset(("smooth_l1_loss_backward", "embedding_dense_backward"))

CROSS_ENTROPY_TRAP = (
    "Functional.cross_entropy trap: msprobe hooks the functional API's last autograd node (nll_loss), "
    "so backward.output.0 is the gradient into nll_loss (d loss/d log_softmax), not d loss/d logits; "
    "fastgrad's cross_entropy_loss_grad (aclnnCrossEntropyLossGrad) is d/d logits: dump "
    "NPU.npu_cross_entropy_loss instead"
)


# ------------------------------------------------------------------------------ mapping ----


@dataclass
class Output:
    """One recorded output to judge: ``label`` (``output.0``), its record, and how the golden is
    taken from the op's outputs (index, and ``negate`` for d target of smooth-L1)."""

    label: str
    name: str
    record: dict
    index: int
    negate: bool = False


@dataclass
class Mapped:
    """A dump entry fastgrad recomputes: ``op`` with ``kwargs`` (arrays and attributes)."""

    entry: str
    op: str
    kwargs: dict
    outputs: list


@dataclass
class Unmapped:
    entry: str
    reason: str
    family: bool = True  # one of the seven ops' family (printed), or any other API (counted)


def _val(rec: Any) -> Any:
    if isinstance(rec, dict) and "value" in rec and "data_name" not in rec:
        return rec["value"]
    return rec


def _arg(fwd: dict, pos: int | None, kw: str, default: Any = None) -> Any:
    """A forward argument: ``input_kwargs[kw]``, else ``input_args[pos]``, else ``default``."""
    kwargs = fwd.get("input_kwargs") or {}
    if kw in kwargs:
        return kwargs[kw]
    args = fwd.get("input_args") or []
    if pos is not None and pos < len(args):
        return args[pos]
    return default


def _is_tensor(rec: Any) -> bool:
    return isinstance(rec, dict) and str(rec.get("type") or "").endswith("Tensor")


def _outputs(rec_list: Any, names: tuple) -> list:
    """The recorded tensor outputs with data (empty tensors and Nones skipped)."""
    out = []
    for i, r in enumerate(rec_list or []):
        if _is_tensor(r) and r.get("data_name") and i < len(names) and math.prod(r.get("shape") or [1]) > 0:
            out.append(Output(f"output.{i}", names[i], r, i))
    return out


_LEGACY = {(True, True): "mean", (False, True): "sum"}


def _legacy_reduction(size_average, reduce, reduction):
    """torch.nn._reduction.legacy_get_string, when a deprecated flag is given."""
    if size_average is None and reduce is None:
        return reduction
    sa = True if size_average is None else bool(size_average)
    rd = True if reduce is None else bool(reduce)
    return "none" if not rd else _LEGACY[(sa, rd)]


def _softmax_dim(api: str, fwd: dict, ndim: int):
    if api == "Functional.softmax":
        dim = _val(_arg(fwd, 1, "dim"))
        if dim is None:  # torch's _get_softmax_dim
            dim = 0 if ndim in (0, 1, 3) else 1
        dtype = _val(_arg(fwd, 3, "dtype"))
    else:
        dim = _val(_arg(fwd, 1, "dim"))
        dtype = _val(_arg(fwd, 2, "dtype"))
    return dim, dtype


def map_entry(dump: Dump, name: str) -> Mapped | Unmapped | None:  # noqa: C901 - one branch per API
    """The mapping of one ``dump.json`` key, an :class:`Unmapped` with the reason, or None for a
    record that is part of another entry (a forward whose backward is the mapped call)."""
    m = _ENTRY.match(name)
    if not m:
        return Unmapped(name, "not an msprobe API entry name (<Prefix>.<api>.<n>.<forward|backward>)", False)
    api, n, direction = m.group("api"), m.group("n"), m.group("dir")
    rec = dump.data[name]
    fwd = dump.data.get(f"{api}.{n}.forward") or {}
    short = api.split(".", 1)[1] if "." in api else api
    if api.startswith("Aten."):
        short = short.split(".")[0]  # Aten.<op>.<overload>
    family = _FAMILY.search(short) is not None
    if not isinstance(rec, dict) or not isinstance(fwd, dict):
        return Unmapped(name, "record not understood (not a JSON object)", family)
    aten = api.startswith("Aten.") and short in _ATEN_OPS
    mapped_here = api in _BACKWARD_APIS if direction == "backward" else api in _FORWARD_APIS or aten
    if mapped_here and fwd and "input_args" not in fwd and "input_kwargs" not in fwd:
        return Unmapped(name, f"{api}.{n}.forward records no inputs (a dump whose data_mode leaves out 'input')")
    if mapped_here and direction == "backward" and "input" not in rec:
        return Unmapped(name, "records no incoming gradient (a dump whose data_mode leaves out 'input')")

    def t(r):
        if _is_tensor(r) and not r.get("data_name"):
            return empty_or_no_data(r)  # an empty tensor, or _NoData (the dump kept only statistics)
        return dump.tensor(r)

    if direction == "backward":
        grads_in = rec.get("input") or []
        outs = rec.get("output") or []
        if api == "Functional.cross_entropy":
            return Unmapped(name, CROSS_ENTROPY_TRAP)
        if not fwd:
            return Unmapped(name, f"no {api}.{n}.forward record (fastgrad needs the forward's inputs)", family)
        if api == "Functional.smooth_l1_loss":
            red = _legacy_reduction(
                _val(_arg(fwd, 2, "size_average")),
                _val(_arg(fwd, 3, "reduce")),
                _val(_arg(fwd, 4, "reduction", {"value": "mean"})),
            )
            kw = {
                "grad_out": t(grads_in[0] if grads_in else None),
                "input": t(_arg(fwd, 0, "input")),
                "target": t(_arg(fwd, 1, "target")),
                "reduction": red,
                "beta": float(_val(_arg(fwd, 5, "beta", {"value": 1.0}))),
            }
            o = _outputs(outs, ("grad_input", "grad_target"))
            for x in o:
                x.index, x.negate = 0, x.label == "output.1"
            return Mapped(name, "smooth_l1_loss_backward", kw, o)
        if api in ("Functional.embedding", "Torch.embedding"):
            wpos, ipos = (1, 0) if api == "Functional.embedding" else (0, 1)
            wrec = _arg(fwd, wpos, "weight")
            if _val(_arg(fwd, 6 if api == "Functional.embedding" else 4, "sparse", {"value": False})):
                return Unmapped(name, "sparse=True: a sparse gradient, not embedding_dense_backward")
            W = int((wrec or {}).get("shape", [0])[0])
            pad_arg = _val(_arg(fwd, 2, "padding_idx"))
            pad = -1 if pad_arg is None else int(pad_arg)  # None: no padding row (fastgrad's -1)
            if pad_arg is not None and pad < 0 and api == "Functional.embedding":
                pad += W  # F.embedding's padding_idx=-k is row W-k (aten's -1 is "none")
            sgf = _val(_arg(fwd, 5 if api == "Functional.embedding" else 3, "scale_grad_by_freq", {"value": False}))
            kw = {
                "grad": t(grads_in[0] if grads_in else None),
                "indices": t(_arg(fwd, ipos, "input" if api == "Functional.embedding" else "indices")),
                "num_weights": W,
                "padding_idx": pad,
                "scale_grad_by_freq": bool(sgf),
            }
            o = [x for x in _outputs(outs, ("grad_weight",) * len(outs)) if x.record.get("shape") == wrec.get("shape")]
            for x in o:
                x.index, x.name = 0, "grad_weight"
            return Mapped(name, "embedding_dense_backward", kw, o[:1])
        if api in ("Torch.softmax", "Functional.softmax", "Tensor.softmax"):
            y_rec = (fwd.get("output") or [None])[0]
            shape = (y_rec or {}).get("shape") or []
            dim, dtype = _softmax_dim(api, fwd, len(shape))
            g_rec = (outs or [None])[0]
            if dtype is not None and not (_is_tensor(g_rec) and g_rec.get("dtype") == (y_rec or {}).get("dtype")):
                # softmax(x, dtype=) casts x, then softmaxes: the recorded gradient is the softmax
                # node's (in dtype) unless the kernel took the cast in (half_to_float: x's dtype)
                got = g_rec.get("dtype") if isinstance(g_rec, dict) else None
                return Unmapped(name, f"softmax with dtype={dtype}: its recorded gradient is {got}, not the softmax's")
            if dim is None or int(dim) not in (-1, len(shape) - 1):
                return Unmapped(name, f"softmax over dim {dim} of a {len(shape)}-D tensor: fastgrad's is the last dim")
            mshape = (1,) * max(0, len(shape) - 2) + tuple(shape[-2:]) if shape else ()
            kw = {
                "grad_output": t(grads_in[0] if grads_in else None),
                "y": t(y_rec),
                "mask": np.zeros(mshape, np.bool_),
                "scale": 1.0,
                "fix_triu_mask": False,
            }
            return Mapped(name, "scaled_masked_softmax_backward", kw, _outputs(outs, ("out",))[:1])
        if api == "NPU.npu_scaled_masked_softmax":
            kw = {
                "grad_output": t(grads_in[0] if grads_in else None),
                "y": t((fwd.get("output") or [None])[0]),
                "mask": t(_arg(fwd, 1, "mask")),
                "scale": float(_val(_arg(fwd, 2, "scale", {"value": 1.0}))),
                "fix_triu_mask": bool(_val(_arg(fwd, 3, "fixed_triu_mask", {"value": False}))),
            }
            return Mapped(name, "scaled_masked_softmax_backward", kw, _outputs(outs, ("out",))[:1])
        if api == "NPU.npu_cross_entropy_loss":
            red = _val(_arg(fwd, 3, "reduction", {"value": "mean"}))
            g = t(grads_in[0] if grads_in else None)
            if g is not None and red != "none" and g.size == 1:
                g = g.reshape(())
            kw = {
                "grad_loss": g,
                "log_prob": t((fwd.get("output") or [None, None])[1]),
                "target": t(_arg(fwd, 1, "target")),
                "weight": t(_arg(fwd, 2, "weight")),
                "reduction": red,
                "ignore_index": int(_val(_arg(fwd, 4, "ignore_index", {"value": -100}))),
                "label_smoothing": float(_val(_arg(fwd, 5, "label_smoothing", {"value": 0.0}))),
            }
            return Mapped(name, "cross_entropy_loss_grad", kw, _outputs(outs, ("x_grad",))[:1])
        if _FAMILY.search(short):
            return Unmapped(name, f"backward of {api}: not one of the seven ops fastgrad reproduces")
        return Unmapped(name, f"{api}: not one of the seven ops", False)

    # forward records
    if api == "NPU.npu_fused_linear_online_max_sum":
        kw = {
            "input": t(_arg(fwd, 0, "input")),
            "weight": t(_arg(fwd, 1, "weight")),
            "target": t(_arg(fwd, 2, "target")),
            "vocab_start_index": int(_val(_arg(fwd, 3, "vocab_start_index"))),
            "vocab_end_index": int(_val(_arg(fwd, 4, "vocab_end_index"))),
            "return_logits": bool(_val(_arg(fwd, 5, "return_logits", {"value": False}))),
        }
        names = (
            "logits_max_local",
            "sum_exp_logits_local",
            "predicted_logits_local",
            "target_mask",
            "masked_target",
            "vocab_parallel_logits",
        )
        return Mapped(name, "fused_linear_online_max_sum", kw, _outputs(rec.get("output"), names))
    if api == "NPU.npu_fused_cross_entropy_loss_with_max_sum":
        for k in ("input", "weight"):
            if _is_tensor(_arg(fwd, None, k)):
                return Unmapped(name, f"{k}= given: the device reserves it (当前仅支持None); fastgrad does not take it")
        ls = _val(_arg(fwd, None, "label_smoothing", {"value": 0.0}))
        kw = {
            "logits_max": t(_arg(fwd, 0, "logits_max")),
            "sum_exp_logits": t(_arg(fwd, 1, "sum_exp_logits")),
            "predicted_logits": t(_arg(fwd, 2, "predicted_logits")),
            "label_smoothing": 0.0 if ls is None else float(ls),
            "vocab_parallel_logits": t(_arg(fwd, None, "vocab_parallel_logits")),
        }
        return Mapped(
            name, "fused_cross_entropy_loss_with_max_sum", kw, _outputs(rec.get("output"), ("loss", "softmax"))
        )
    if api == "NPU.npu_fused_linear_cross_entropy_loss_with_max_sum_backward":
        kw = {
            "grad": t(_arg(fwd, 0, "grad")),
            "input": t(_arg(fwd, 1, "input")),
            "weight": t(_arg(fwd, 2, "weight")),
            "target_mask": t(_arg(fwd, 3, "target_mask")),
            "masked_target": t(_arg(fwd, 4, "masked_target")),
            "label_smoothing": float(_val(_arg(fwd, 5, "label_smoothing", {"value": 0.0}))),
            "logits_max": t(_arg(fwd, 6, "logits_max")),
            "sum_exp_logits": t(_arg(fwd, 7, "sum_exp_logits")),
            "softmax": t(_arg(fwd, 8, "softmax")),
        }
        return Mapped(
            name, "fused_linear_cross_entropy_loss_grad", kw, _outputs(rec.get("output"), ("grad_input", "grad_weight"))
        )
    if api == "NPU.npu_cross_entropy_loss_backward":
        red = _val(_arg(fwd, 6, "reduction", {"value": "mean"}))
        g = t(_arg(fwd, 0, "grad_loss"))
        if g is not None and red != "none" and g.size == 1:
            g = g.reshape(())
        kw = {
            "grad_loss": g,
            "log_prob": t(_arg(fwd, 1, "log_prob")),
            "target": t(_arg(fwd, 2, "target")),
            "weight": t(_arg(fwd, 3, "weight")),
            "reduction": red,
            "ignore_index": int(_val(_arg(fwd, 7, "ignore_index", {"value": -100}))),
            "label_smoothing": float(_val(_arg(fwd, 8, "label_smoothing", {"value": 0.0}))),
        }
        return Mapped(name, "cross_entropy_loss_grad", kw, _outputs(rec.get("output"), ("x_grad",))[:1])
    if api == "NPU.npu_scaled_masked_softmax_backward":
        kw = {
            "grad_output": t(_arg(fwd, 0, "y_grad")),
            "y": t(_arg(fwd, 1, "y")),
            "mask": t(_arg(fwd, 2, "mask")),
            "scale": float(_val(_arg(fwd, 3, "scale", {"value": 1.0}))),
            "fix_triu_mask": bool(_val(_arg(fwd, 4, "fixed_triu_mask", {"value": False}))),
        }
        return Mapped(name, "scaled_masked_softmax_backward", kw, _outputs(rec.get("output"), ("out",))[:1])
    if api.startswith("Aten.") and short == "smooth_l1_loss_backward":
        kw = {
            "grad_out": t(_arg(fwd, 0, "grad_output")),
            "input": t(_arg(fwd, 1, "self")),
            "target": t(_arg(fwd, 2, "target")),
            "reduction": int(_val(_arg(fwd, 3, "reduction"))),
            "beta": float(_val(_arg(fwd, 4, "beta", {"value": 1.0}))),
        }
        return Mapped(name, "smooth_l1_loss_backward", kw, _outputs(rec.get("output"), ("grad_input",))[:1])
    if api.startswith("Aten.") and short == "embedding_dense_backward":
        kw = {
            "grad": t(_arg(fwd, 0, "grad_output")),
            "indices": t(_arg(fwd, 1, "indices")),
            "num_weights": int(_val(_arg(fwd, 2, "num_weights"))),
            "padding_idx": int(_val(_arg(fwd, 3, "padding_idx"))),
            "scale_grad_by_freq": bool(_val(_arg(fwd, 4, "scale_grad_by_freq"))),
        }
        return Mapped(name, "embedding_dense_backward", kw, _outputs(rec.get("output"), ("out",))[:1])
    if api in ("Functional.smooth_l1_loss", "Functional.embedding", "Torch.embedding", "NPU.npu_cross_entropy_loss"):
        if f"{api}.{n}.backward" in dump.data:
            return None  # the inputs of the mapped backward entry
        return Unmapped(name, f"forward of {api} without a backward record: fastgrad reproduces the backward only")
    if api in ("Torch.softmax", "Functional.softmax", "Tensor.softmax", "NPU.npu_scaled_masked_softmax"):
        if f"{api}.{n}.backward" in dump.data:
            return None
        return Unmapped(name, f"forward of {api} without a backward record: fastgrad reproduces the backward only")
    if api == "Functional.cross_entropy":
        if f"{api}.{n}.backward" in dump.data:
            return None  # reported once, with the backward
        return Unmapped(name, "forward loss of Functional.cross_entropy: fastgrad reproduces gradients only")
    if api.startswith("NPU."):
        return Unmapped(name, f"{api}: a torch_npu op fastgrad does not implement")
    if _FAMILY.search(short):
        return Unmapped(name, f"{api}: not one of the seven ops (fastgrad's ops fuse it with its neighbour)")
    return Unmapped(name, f"{api}: not one of the seven ops", False)


def map_dump(dump: Dump) -> tuple[list, list]:
    """(mapped entries, unmapped entries with reasons), in dump order."""
    mapped: list[Mapped] = []
    unmapped: list[Unmapped] = []
    for name in dump.data:
        try:
            r = map_entry(dump, name)
        except NoData as e:
            r = Unmapped(name, str(e))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, DumpError):
                raise
            r = Unmapped(name, f"record not understood ({type(e).__name__}: {e})")
        if r is None:
            continue
        if isinstance(r, Mapped) and not r.outputs:
            r = Unmapped(name, "no recorded tensor output with data")
        if isinstance(r, Mapped):
            mapped.append(r)
        else:
            unmapped.append(r)
    return mapped, unmapped


# ------------------------------------------------------------------------------ checking ----


@dataclass
class Row:
    """One judged output: the summary's row."""

    entry: str
    op: str
    output: str
    dtype: str
    shape: tuple
    standard: str
    verdict: str
    metrics: dict = field(default_factory=dict)
    errors: str = ""
    golden: Any = None
    actual: Any = None

    def csv_row(self) -> dict:
        m = self.metrics
        return {
            "entry": self.entry,
            "op": self.op,
            "output": self.output,
            "dtype": self.dtype,
            "shape": "x".join(map(str, self.shape)) if self.shape else "scalar",
            "standard": self.standard,
            "verdict": self.verdict,
            "MERE": _num(m.get("MERE")),
            "MARE": _num(m.get("MARE")),
            "max_abs_err": _num(m.get("max_abs_err")),
            "mismatches": m.get("mismatches", ""),
            "errors": self.errors,
        }


CSV_FIELDS = (
    "entry",
    "op",
    "output",
    "dtype",
    "shape",
    "standard",
    "verdict",
    "MERE",
    "MARE",
    "max_abs_err",
    "mismatches",
    "errors",
)


def _num(x) -> str:
    if x is None:
        return ""
    return f"{float(x):.3g}"


def _judge(entry: str, op: str, out: Output, actual: np.ndarray, golden: np.ndarray, bt: int | None) -> Row:
    from ..compare import compare
    from ..dtypes import dtype_name

    label = f"{out.label} {out.name}"
    dt = dtype_name(actual.dtype)
    if actual.shape != golden.shape:
        return Row(entry, op, label, dt, actual.shape, "-", "FAIL", {}, f"shape {actual.shape}, golden {golden.shape}")
    if actual.dtype.kind in "iub" or golden.dtype.kind in "iub":
        a, g = actual, golden
        note = ""
        if out.name == "target_mask" and bt is not None:  # judge the BT row bits; padding noted
            ab = np.unpackbits(a.astype(np.uint8), bitorder="little")
            gb = np.unpackbits(g.astype(np.uint8), bitorder="little")
            if not np.array_equal(ab[bt:], gb[bt:]):
                note = f"padding bits (rows >= {bt}) differ: {ab[bt:].tolist()} vs {gb[bt:].tolist()} (ignored)"
            a, g = ab[:bt], gb[:bt]
        bad = int(np.count_nonzero(np.asarray(a).astype(np.int64) != np.asarray(g).astype(np.int64)))
        verdict = "PASS" if bad == 0 else "FAIL"
        err = (f"{bad} of {a.size} differ" if bad else "") + (("; " if bad else "") + note if note else "")
        return Row(entry, op, label, dt, actual.shape, "exact", verdict, {"mismatches": bad}, err, golden, actual)
    res = compare(actual, golden, dtype=actual.dtype if dt in ("float16", "bfloat16", "float32") else "float32")
    return Row(
        entry,
        op,
        label,
        dt,
        actual.shape,
        "single",
        "PASS" if res.passed else "FAIL",
        dict(res.metrics),
        "; ".join(res.failures),
        golden,
        actual,
    )


def recompute(mapped: Mapped, backend: str = "reference") -> tuple:
    """fastgrad's outputs of one mapped entry (the op's output tuple)."""
    import fastgrad as fg

    with fg.use_backend(backend):
        res = getattr(fg, mapped.op)(**mapped.kwargs)
    return res if isinstance(res, tuple) else (res,)


def check_dump(dump: Dump, mapped: list, backend: str = "reference") -> tuple[list, list]:
    """Judge every mapped entry: (rows, entries fastgrad rejected as :class:`Unmapped`)."""
    from ..errors import AclnnError

    rows, rejected = [], []
    for mp in mapped:
        try:
            res = recompute(mp, backend)
        except AclnnError as e:
            rejected.append(Unmapped(mp.entry, f"fastgrad's {mp.op} rejected the recorded inputs: {e}"))
            continue
        bt = None
        if mp.op == "fused_linear_online_max_sum":
            bt = int(mp.kwargs["input"].shape[0])
        for out in mp.outputs:
            actual = dump.tensor(out.record)
            golden = res[out.index]
            if actual is None:
                rows.append(Row(mp.entry, mp.op, out.label, "", (), "-", "FAIL", {}, "the dump holds no data for it"))
                continue
            if golden is None:
                rows.append(Row(mp.entry, mp.op, out.label, "", (), "-", "FAIL", {}, "fastgrad returned no output"))
                continue
            golden = np.asarray(golden)
            if out.negate:
                golden = -golden
            rows.append(_judge(mp.entry, mp.op, out, actual, golden, bt))
    return rows, rejected


# ------------------------------------------------------------------------------- writing ----


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def write_results(
    out_dir: str, mapped: list, rows: list, unmapped: list, meta: dict, record: Callable[[str], object] | None = None
) -> dict:
    """``summary.csv``, ``unmapped.csv``, ``summary.json`` and per entry
    ``entries/<entry>/{inputs,golden,actual}/<name>.npy``; returns the file paths.  ``record(path)``
    is called before each file is written (the command removes them again when it fails)."""
    from ..compare import save_array

    def w_(path: str) -> str:
        if record is not None:
            record(path)
        return path

    os.makedirs(out_dir, exist_ok=True)
    for mp in mapped:
        base = os.path.join(out_dir, "entries", _safe(mp.entry))
        os.makedirs(os.path.join(base, "inputs"), exist_ok=True)
        attrs = {}
        for k, v in mp.kwargs.items():
            if isinstance(v, np.ndarray):
                save_array(w_(os.path.join(base, "inputs", f"{k}.npy")), v)
            elif v is not None:
                attrs[k] = v
        with open(w_(os.path.join(base, "inputs", "attrs.json")), "w") as f:
            json.dump(attrs, f, indent=1)
    for r in rows:
        if r.golden is None:
            continue
        base = os.path.join(out_dir, "entries", _safe(r.entry))
        stem = _safe(r.output.replace(" ", "_"))
        for kind, arr in (("golden", r.golden), ("actual", r.actual)):
            os.makedirs(os.path.join(base, kind), exist_ok=True)
            save_array(w_(os.path.join(base, kind, f"{stem}.npy")), arr)
    summary = os.path.join(out_dir, "summary.csv")
    with open(w_(summary), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(r.csv_row())
    um = os.path.join(out_dir, "unmapped.csv")
    with open(w_(um), "w", newline="") as f:
        cw = csv.writer(f)
        cw.writerow(["entry", "family", "reason"])
        for u in unmapped:
            cw.writerow([u.entry, "yes" if u.family else "no", u.reason])
    js = os.path.join(out_dir, "summary.json")
    with open(w_(js), "w") as f:
        json.dump(
            {
                "schema": "fastgrad-msprobe-golden/1",
                **meta,
                "rows": [r.csv_row() for r in rows],
                "unmapped": [{"entry": u.entry, "family": u.family, "reason": u.reason} for u in unmapped],
            },
            f,
            indent=1,
        )
    return {"summary": summary, "unmapped": um, "json": js}


def format_table(rows: list, unmapped: list) -> str:
    """The terminal table: one line per judged output, then the family entries not mapped."""
    cols = ("entry", "op", "output", "dtype", "shape", "standard", "verdict", "errors")
    data = []
    for r in rows:
        c = r.csv_row()
        m = r.metrics
        if r.standard == "single":
            err = f"MERE {_num(m.get('MERE'))} MARE {_num(m.get('MARE'))}"
        elif r.standard == "exact":
            err = f"{m.get('mismatches', 0)} differ"
        else:
            err = ""
        if r.errors:
            err = (err + "; " if err else "") + r.errors
        c["errors"] = err
        data.append([str(c[k]) for k in cols])
    widths = [max([len(h)] + [len(d[i]) for d in data]) for i, h in enumerate(cols)]
    widths[-1] = len(cols[-1])
    lines = ["  ".join(h.ljust(w) for h, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(d, widths)) for d in data]
    fam = [u for u in unmapped if u.family]
    if fam:
        lines.append("")
        lines.append(f"not mapped ({len(fam)}):")
        lines += [f"  {u.entry}: {u.reason}" for u in fam]
    other = [u for u in unmapped if not u.family]
    if other:
        apis = sorted({_api_of(u.entry) for u in other})
        lines.append(
            f"{len(other)} other entries are not calls of the seven ops ({', '.join(apis[:6])}"
            + (", ..." if len(apis) > 6 else "")
            + ")"
        )
    return "\n".join(lines)


def write_bench_dump(dump: Dump, rows: list, out_dir: str) -> str:
    """A copy of the dump (``out_dir/<rank dir name>/``) whose judged outputs are fastgrad's, with
    dump.json's statistics (Max, Min, Mean, Norm) recomputed, for
    ``msprobe compare -tp <the user's step dir> -gp out_dir``.  Returns the rank directory."""
    import torch

    dst = bench_dump_dir(dump, out_dir)
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(dump.path, dst)
    with open(os.path.join(dst, "dump.json")) as f:
        d = json.load(f)
    by_file = {}
    for r in rows:
        if r.golden is None:
            continue
        rec = _record_of(d["data"], r.entry, r.output.split(" ")[0])
        if rec is None:
            continue
        g = np.asarray(r.golden)
        if r.actual is not None and g.dtype != r.actual.dtype:
            g = g.astype(r.actual.dtype)
        by_file[rec["data_name"]] = g
        gt = to_torch(g)
        torch.save(gt, os.path.join(dst, "dump_tensor_data", rec["data_name"]))
        if gt.numel():
            f64 = gt.double() if gt.dtype != torch.bool else gt.to(torch.float64)
            rec["Max"], rec["Min"] = _stat(f64.max()), _stat(f64.min())
            if gt.is_floating_point():
                rec["Mean"], rec["Norm"] = _stat(f64.mean()), _stat(torch.linalg.vector_norm(f64))
    d["dump_data_dir"] = os.path.abspath(os.path.join(dst, "dump_tensor_data"))
    with open(os.path.join(dst, "dump.json"), "w") as f:
        json.dump(d, f, indent=1)
    return dst


def bench_dump_dir(dump: Dump, out_dir: str) -> str:
    """Where :func:`write_bench_dump` writes (``out_dir/<rank dir name>``); :class:`DumpError` when
    that is the user's dump or overlaps it (the copy replaces what is there)."""
    dst = os.path.realpath(os.path.join(out_dir, os.path.basename(os.path.normpath(dump.path))))
    src = os.path.realpath(dump.path)
    if dst == src or src.startswith(dst + os.sep) or dst.startswith(src + os.sep):
        raise DumpError(f"{out_dir}: the bench dump would replace or nest in the dump it is made from ({src})")
    return dst


def _stat(x) -> float | int:
    v = x.item()
    return int(v) if float(v).is_integer() and abs(v) < 2**53 else float(v)


def _record_of(data: dict, entry: str, label: str) -> dict | None:
    m = re.match(r"output\.(\d+)$", label)
    if not m or entry not in data:
        return None
    outs = data[entry].get("output") or []
    i = int(m.group(1))
    rec = outs[i] if i < len(outs) else None
    return rec if isinstance(rec, dict) and _is_tensor(rec) and rec.get("data_name") else None


def _api_of(entry: str) -> str:
    m = _ENTRY.match(entry)
    return m.group("api") if m else entry


__all__ = [
    "Dump",
    "DumpError",
    "Mapped",
    "Unmapped",
    "Row",
    "CROSS_ENTROPY_TRAP",
    "read_dump",
    "find_dump_json",
    "load_pt",
    "to_numpy",
    "to_torch",
    "map_dump",
    "map_entry",
    "check_dump",
    "recompute",
    "write_results",
    "write_bench_dump",
    "bench_dump_dir",
    "format_table",
]
