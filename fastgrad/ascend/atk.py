"""fastgrad as the golden of an ATK executor: the seven aclnn APIs called by their parameter names.

An ATK executor (``tests/st/aclnn*/executor_*.py`` in ops-nn) is a ``BaseApi`` class whose
``__call__`` receives the case's tensors and attributes by the aclnn parameter names
(``gradLoss``, ``logProb``, ``targetMask`` …) and returns the golden outputs.  With fastgrad it is
one line::

    from fastgrad.ascend import atk_golden

    class CrossEntropyLossGradGolden(BaseApi):
        def __call__(self, input_data, with_output=False):
            return atk_golden("aclnnCrossEntropyLossGrad", **input_data.kwargs)

:func:`atk_golden` takes CPU torch tensors (bf16 included) or NumPy arrays and Python scalars,
returns the same kind, one tensor for a one-output API and a tuple in aclnn output order
otherwise, computed by fastgrad's public ops under the SoC profile ``soc_version`` (default: the
current setting, ``fg.get_soc_version()``).

Parameter names: the aclnn names of the prototypes (``aclnn_*.h``; ``weightOptional``,
``reductionOptional`` …), and the spellings the ops-nn ATK case files use (``targets``,
``logits_max``, ``y_grad``, ``fixed_triu_mask``, ``vocabParallelLogitsOutFlag``); matching
ignores case, ``_`` and an ``Optional`` suffix.  Output arguments (``lossOut``, ``out`` …) are
accepted and ignored.  Absent optional inputs: leave them out or pass None.

Source: the prototypes in ``fastgrad/backends/aclnn_prototypes.h`` (hicann/ops-nn e5c3fa9).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import invalid

OP = "atk_golden"


@dataclass(frozen=True)
class AclnnApi:
    """One aclnn API: its parameters (signature order, outputs excluded), outputs, fastgrad call."""

    name: str
    op: str
    params: tuple
    attrs: tuple
    outputs: tuple
    call: Callable[[dict], list]
    aliases: dict = field(default_factory=dict)
    required_attrs: tuple = ()  # attributes without a default (a missing one is 161001)


def _norm(name: str) -> str:
    n = re.sub(r"[_\s]", "", str(name)).lower()
    return n[: -len("optional")] if n.endswith("optional") and n != "optional" else n


def _fg():
    import fastgrad

    return fastgrad


def _flom(a: dict) -> list:
    flag = as_flag(_or(a.get("vocabParallelLogitsOutFlag"), False), "vocabParallelLogitsOutFlag")
    r = _fg().fused_linear_online_max_sum(
        a["input"], a["weight"], a["target"], a["vocabStartIndex"], a["vocabEndIndex"], return_logits=flag
    )
    out = list(r)
    return out if flag else out[:5]


def _fce(a: dict) -> list:
    loss, sm = _fg().fused_cross_entropy_loss_with_max_sum(
        a["logitsMax"],
        a["sumExpLogits"],
        a["predictedLogits"],
        _or(a.get("labelSmoothing"), 0.0),
        a.get("vocabParallelLogitsOptional"),
    )
    return [loss] if sm is None else [loss, sm]


def _flce(a: dict) -> list:
    gi, gw = _fg().fused_linear_cross_entropy_loss_grad(
        a["grad"],
        a["input"],
        a["weight"],
        a["targetMask"],
        a["maskedTarget"],
        _or(a.get("labelSmoothing"), 0.0),
        a.get("logitsMaxOptional"),
        a.get("sumExpLogitsOptional"),
        a.get("softmaxOptional"),
    )
    return [gi, gw]


def _ce(a: dict) -> list:
    return [
        _fg().cross_entropy_loss_grad(
            a["gradLoss"],
            a["logProb"],
            a["target"],
            a.get("weightOptional"),
            _or(a.get("reductionOptional"), "mean"),
            _or(a.get("ignoreIndex"), -100),
            _or(a.get("labelSmoothing"), 0.0),
            a.get("gradZlossOptional"),
            a.get("lseForZlossOptional"),
            _or(a.get("lseSquareScaleForZloss"), 0.0),
        )
    ]


def _sms(a: dict) -> list:
    return [
        _fg().scaled_masked_softmax_backward(
            a["gradOutput"],
            a["y"],
            a.get("mask"),
            _or(a.get("scale"), 1.0),
            as_flag(_or(a.get("fixTriuMask"), False), "fixTriuMask"),
        )
    ]


def _sl1(a: dict) -> list:
    return [
        _fg().smooth_l1_loss_backward(
            a["gradOut"], a["self"], a["target"], _or(a.get("reduction"), "mean"), _or(a.get("beta"), 1.0)
        )
    ]


def _emb(a: dict) -> list:
    return [
        _fg().embedding_dense_backward(
            a["grad"],
            a["indices"],
            _int(a["numWeights"], "numWeights"),
            _int(_or(a.get("paddingIdx"), -1), "paddingIdx"),
            as_flag(_or(a.get("scaleGradByFreq"), False), "scaleGradByFreq"),
        )
    ]


def _or(v, default):
    return default if v is None else v


def as_flag(v: Any, name: str, op: str = OP) -> bool:
    """A bool attribute: a bool, NumPy bool, number or one-element array/tensor, read as Python's
    ``bool``; a string (``"False"`` is truthy in Python) or a many-element array is AclnnError
    161002 naming ``name``."""
    if isinstance(v, (str, bytes)):
        raise invalid(name, "a bool (True/False)", repr(v), op)
    try:
        return bool(v)
    except (TypeError, ValueError, RuntimeError):  # many elements (NumPy: ValueError, torch: RuntimeError)
        raise invalid(name, "a bool (True/False)", repr(v), op) from None


def _int(v, name: str) -> int:
    try:
        if float(v) != int(v):
            raise ValueError
        return int(v)
    except (TypeError, ValueError, OverflowError):
        raise invalid(name, "an integer", repr(v), OP) from None


#: the seven aclnn APIs (prototypes: fastgrad/backends/aclnn_prototypes.h)
APIS = {
    api.name: api
    for api in (
        AclnnApi(
            "aclnnFusedLinearOnlineMaxSum",
            "fused_linear_online_max_sum",
            ("input", "weight", "target", "vocabStartIndex", "vocabEndIndex", "vocabParallelLogitsOutFlag"),
            ("vocabStartIndex", "vocabEndIndex", "vocabParallelLogitsOutFlag"),
            (
                "logitsMaxLocalOut",
                "sumExpLogitsLocalOut",
                "predictedLogitsLocalOut",
                "targetMaskOut",
                "maskedTargetOut",
                "vocabParallelLogitsOutOptional",
            ),
            _flom,
            required_attrs=("vocabStartIndex", "vocabEndIndex"),
        ),
        AclnnApi(
            "aclnnFusedCrossEntropyLossWithMaxSum",
            "fused_cross_entropy_loss_with_max_sum",
            (
                "logitsMax",
                "sumExpLogits",
                "predictedLogits",
                "labelSmoothing",
                "inputOptional",
                "weightOptional",
                "vocabParallelLogitsOptional",
            ),
            ("labelSmoothing",),
            ("lossOut", "softMaxOutOptional"),
            _fce,
        ),
        AclnnApi(
            "aclnnFusedLinearCrossEntropyLossGrad",
            "fused_linear_cross_entropy_loss_grad",
            (
                "grad",
                "input",
                "weight",
                "targetMask",
                "maskedTarget",
                "labelSmoothing",
                "logitsMaxOptional",
                "sumExpLogitsOptional",
                "softmaxOptional",
            ),
            ("labelSmoothing",),
            ("inputGradOut", "weightGradOut"),
            _flce,
        ),
        AclnnApi(
            "aclnnCrossEntropyLossGrad",
            "cross_entropy_loss_grad",
            (
                "gradLoss",
                "logProb",
                "target",
                "weightOptional",
                "gradZlossOptional",
                "lseForZlossOptional",
                "reductionOptional",
                "ignoreIndex",
                "labelSmoothing",
                "lseSquareScaleForZloss",
            ),
            ("reductionOptional", "ignoreIndex", "labelSmoothing", "lseSquareScaleForZloss"),
            ("out",),
            _ce,
            {"targets": "target"},
        ),
        AclnnApi(
            "aclnnScaledMaskedSoftmaxBackward",
            "scaled_masked_softmax_backward",
            ("gradOutput", "y", "mask", "scale", "fixTriuMask"),
            ("scale", "fixTriuMask"),
            ("out",),
            _sms,
            {"ygrad": "gradOutput", "fixedtriumask": "fixTriuMask"},
        ),
        AclnnApi(
            "aclnnSmoothL1LossBackward",
            "smooth_l1_loss_backward",
            ("gradOut", "self", "target", "reduction", "beta"),
            ("reduction", "beta"),
            ("gradInput",),
            _sl1,
        ),
        AclnnApi(
            "aclnnEmbeddingDenseBackward",
            "embedding_dense_backward",
            ("grad", "indices", "numWeights", "paddingIdx", "scaleGradByFreq"),
            ("numWeights", "paddingIdx", "scaleGradByFreq"),
            ("out",),
            _emb,
            required_attrs=("numWeights",),
        ),
    )
}


def find_api(aclnn_name: str) -> AclnnApi:
    """The API named ``aclnn_name`` (``"aclnnCrossEntropyLossGrad"``, also without the ``aclnn``
    prefix, any case).  AclnnError 161002 naming the seven otherwise."""
    key = _norm(aclnn_name)
    for name, api in APIS.items():
        if key in (_norm(name), _norm(name[len("aclnn") :])):
            return api
    raise invalid("aclnn_name", "one of " + ", ".join(APIS), repr(aclnn_name), OP)


def bind(api: AclnnApi, args: tuple = (), kwargs: dict | None = None) -> dict:
    """The arguments by aclnn name: ``args`` positional in the signature order (inputs and
    attributes, then outputs, which are dropped) — or, when any attribute comes by keyword, the
    tensors only (inputs, then outputs) —, ``kwargs`` by any accepted spelling.  A name that is no
    parameter, or one given twice, is AclnnError 161002."""
    kwargs = dict(kwargs or {})
    lookup = {_norm(p): p for p in api.params + api.outputs}
    lookup.update({k: v for k, v in api.aliases.items()})
    named: dict[str, Any] = {}
    for k, v in kwargs.items():
        p = lookup.get(_norm(k))
        if p is None:
            raise invalid(k, f"a parameter of {api.name}: " + ", ".join(api.params), repr(k), OP)
        if p in named:
            raise invalid(k, "given once", "given twice", OP)
        named[p] = v
    attrs_by_name = any(p in api.attrs for p in named)
    order = tuple(p for p in api.params if not (attrs_by_name and p in api.attrs)) + api.outputs
    if len(args) > len(order):
        raise invalid("args", f"at most {len(order)} positional arguments", len(args), OP)
    out: dict[str, Any] = dict(zip(order, args))
    for p, v in named.items():
        if p in out:
            raise invalid(p, "given once", "given twice (positionally and by name)", OP)
        out[p] = v
    for o in api.outputs:
        out.pop(o, None)
    return out


def call_api(api: AclnnApi, bound: dict, soc_version: str | None = None) -> list:
    """fastgrad's outputs of ``api`` (a list, aclnn order) for arguments bound by :func:`bind`."""
    fg = _fg()
    missing = [p for p in api.params if p not in api.attrs and not p.endswith("Optional") and p != "mask"]
    missing = [p for p in missing if bound.get(p) is None and p not in ("vocabParallelLogitsOutFlag",)]
    missing += [p for p in api.required_attrs if bound.get(p) is None]
    if missing:
        from ..errors import null_error

        raise null_error(missing[0], OP)
    if soc_version is None:
        return api.call(bound)
    with fg.soc_version(soc_version):
        return api.call(bound)


def atk_golden(aclnn_name: str, *args: Any, soc_version: str | None = None, **kwargs: Any) -> Any:
    """The golden outputs of an aclnn API, computed by fastgrad, for an ATK executor.

    Parameters
    ----------
    aclnn_name : str
        One of the seven APIs (``"aclnnCrossEntropyLossGrad"``; the ``aclnn`` prefix optional).
    *args, **kwargs
        The API's inputs and attributes: positional in the aclnn signature order, or by name
        (aclnn names, the ATK case files' spellings; see the module docstring).  Tensors: CPU
        torch tensors or NumPy arrays (bf16 as ``torch.bfloat16`` / ``ml_dtypes.bfloat16``).
    soc_version : str, optional
        The SoC profile (``"Ascend910B"``, ``"Ascend910_93"``, ``"Ascend950"`` or a finer CANN
        name); default the current setting.

    Returns
    -------
    tensor or tuple of tensors
        The API's outputs in aclnn order, of the inputs' kind (torch in, torch out): one tensor
        for the one-output APIs; ``aclnnFusedLinearOnlineMaxSum`` gives 5 outputs, 6 with
        ``vocabParallelLogitsOutFlag=True``; ``aclnnFusedCrossEntropyLossWithMaxSum`` gives
        ``(loss,)`` without ``vocabParallelLogitsOptional``, else ``(loss, softmax)``.

    Raises
    ------
    AclnnError
        161001 when a required input, or an attribute without a default (``numWeights``,
        ``vocabStartIndex``/``vocabEndIndex``), is missing or None; 161002 for an unknown API or
        parameter name, a bool attribute given as a string (``"False"``) or many values, and
        whatever the op itself raises (its status codes).
    ValueError
        An unknown ``soc_version``.
    """
    api = find_api(aclnn_name)
    outs = call_api(api, bind(api, args, kwargs), soc_version)
    return outs[0] if len(api.outputs) == 1 else tuple(outs)
