"""``embedding_dense_backward`` — op_api layer of aclnnEmbeddingDenseBackward."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..arrays import ArrayLike
from ..dtypes import BFLOAT16, FLOAT32, FLOAT_DTYPES
from ._opdef import AttrDef, Call, OpDef, OutSpec, TensorDef, execute

OP = "embedding_dense_backward"

#: Index dtypes the aclnn doc lists (strict mode accepts exactly these).
DEVICE_INDEX_DTYPES = tuple(
    np.dtype(d) for d in (np.float32, np.float16, np.float64, np.int32, np.int64, np.int16, np.int8, np.uint8, np.bool_)
)
#: Further index dtypes accepted outside strict mode (cast to integer as the device's Cast).
EXT_INDEX_DTYPES = tuple(np.dtype(d) for d in (np.uint16, np.uint32, np.uint64)) + (BFLOAT16,)
MAX_DIMS = 8


def _relations(c: Call) -> None:
    g, idx = c.a["grad"], c.a["indices"]
    nw = c.attrs["num_weights"]
    d = g.shape[-1]
    rows = math.prod(g.shape[:-1])
    if d != 0 and rows != idx.size:
        c.bad(
            "grad",
            f"leading axes with {idx.size} elements in all (indices.size)",
            f"shape {tuple(g.shape)} for indices of shape {tuple(idx.shape)}",
        )
    if idx.size and (g.size or not c.strict):
        # an index is never outside [0, num_weights) — but strict mode accepts what the device
        # accepts: an empty grad (D = 0) takes the op_api's empty path
        # (aclnn_embedding_dense_backward.cpp:311-326, ops-nn e5c3fa9: ZerosLike on out, the
        # indices never read) after CheckParams (:154-176, no value check), so any index values
        # succeed there; outside strict mode fastgrad keeps its own check (device_parity row 9d)
        if idx.dtype == BFLOAT16 or idx.dtype.kind == "f":
            with np.errstate(invalid="ignore"):
                v = np.trunc(idx.astype(np.float64))
        else:
            v = idx
        lo, hi = v.min(), v.max()
        if not (lo >= 0 and hi < nw):
            c.bad("indices", f"values in [0, {nw}) (num_weights)", f"values in [{lo}, {hi}]")
    c.outs["grad_weight"] = OutSpec((nw, d), g.dtype, accept=FLOAT_DTYPES, size_param="num_weights")
    rdt = _result_dtype(c)
    # the device's deterministic mode (fg.deterministic()): the A2/A3 tiling picks the
    # deterministic kernel for an fp32 result only (embedding_dense_grad_v2_tiling.cpp:285); its
    # order depends on the AI-vector-core count (the SoC profile's)
    cores = c.soc.aiv_cores if (c.settings is not None and c.settings.deterministic) else None
    det = int(cores) if (cores and rdt == FLOAT32 and c.soc.name != "Ascend950") else 0
    c.info["kernel_args"] = {"result_dtype": rdt, "deterministic_cores": det}


#: aclnn_embedding_dense_backward.cpp:44-47: the thresholds of IsNeedCast (:227-235)
GRAD_ROW_LIMIT = 512
MEMORY_THRESHOLD = 100 * 1024 * 1024


def _result_dtype(c: Call) -> np.dtype:
    """The dtype the device's result has before the op_api's final Cast to ``out``'s dtype
    (``aclnn_embedding_dense_backward.cpp:407``).  A2/A3 widen a 16-bit grad to fp32 first
    (:332-341) when ``IsNeedCast``: the tensors take < 100 MB as 16-bit, or fewer than 512 grad
    rows, or ``scale_grad_by_freq``; otherwise, and on Ascend 950 (never, ``!is950``), the
    result is in grad's dtype.  Either way the sums accumulate in fp32."""
    g = c.a["grad"]
    if g.dtype == FLOAT32:
        return FLOAT32
    rows = math.prod(g.shape[:-1])
    out_len = c.attrs["num_weights"] * g.shape[-1]
    need_cast = (g.size + out_len) * 2 < MEMORY_THRESHOLD or rows < GRAD_ROW_LIMIT or c.attrs["scale_grad_by_freq"]
    return FLOAT32 if (c.soc.name != "Ascend950" and need_cast) else g.dtype


DECL = OpDef(
    name=OP,
    aclnn="aclnnEmbeddingDenseBackward",
    inputs=(
        # ranks: op_api CheckMaxDimension (aclnn_embedding_dense_backward.cpp:95-99) bounds both by
        # 8 and nothing else; a 1-D grad with 0-d indices (F.embedding(scalar_index, W)'s
        # backward) passes CheckDimension (:101-123, 1 == 1) and gradRow == 1 skips the sort (:251-256)
        TensorDef("grad", FLOAT_DTYPES, ndim=(1, MAX_DIMS), ext_ndim=(1, None)),
        TensorDef("indices", DEVICE_INDEX_DTYPES, ext_dtypes=EXT_INDEX_DTYPES, ndim=(0, MAX_DIMS), ext_ndim=(0, None)),
    ),
    attrs=(AttrDef("num_weights", "int", lo=0), AttrDef("padding_idx", "int"), AttrDef("scale_grad_by_freq", "bool")),
    outputs=("grad_weight",),
    relations=_relations,
    source="aclnnEmbeddingDenseBackward.md; ops-nn index/embedding_dense_grad_v2; ATen Embedding.cpp",
)


def embedding_dense_backward(
    grad: ArrayLike,
    indices: ArrayLike,
    num_weights: int,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    *,
    out: Any = None,
) -> Any:
    """Gradient of an embedding lookup with respect to the embedding table.

    Parameters
    ----------
    grad : array_like, bfloat16 | float16 | float32, shape ``(*S, D)``
        Gradient of the lookup's output; its leading axes, flattened, match ``indices``
        flattened (``prod(S) == indices.size``).  Non-contiguous accepted.
    indices : array_like, shape ``S`` (any shape with ``prod(S)`` elements)
        Row of the table each grad row was read from.  int8 | uint8 | int16 | int32 | int64 |
        bool | float16 | float32 | float64 (the aclnn list; other integer dtypes and
        bfloat16 as extensions).  Floats are truncated toward zero (the device's Cast).
        Every index must lie in ``[0, num_weights)`` (strict mode, as the device, does not
        check them for an empty grad: D = 0 reads no index).
    num_weights : int
        Rows of the table (``numWeights``), ``>= 0``.
    padding_idx : int, default -1
        Row left at zero (its gradient is dropped); negative means none (the aten op's
        convention; ``F.embedding``'s negative-index normalization is the caller's job).
    scale_grad_by_freq : bool, default False
        Scale each row by the number of times its index occurs in ``indices``: the fp32 sum
        times the fp32 reciprocal ``1.0f / count`` (the device's ``Muls`` by ``reciScale``,
        ``embedding_dense_grad_v2_scale.h:100-104``), not a division (they differ by one ulp
        in a third to a half of random sums).
    out : array_like, optional
        Preallocated ``(num_weights, D)`` float array (contiguous or not), any of fp32, fp16,
        bf16: the device casts its result to ``out``'s dtype (``aclnn_embedding_dense_backward.cpp:407``).
        That result is fp32 for an fp32 grad; for a 16-bit grad it is the fp32 sums on
        A2/A3 when the op_api widens the grad (``IsNeedCast``, :227-235, :332-341: the tensors
        take < 100 MB as 16-bit, fewer than 512 grad rows, or ``scale_grad_by_freq``), so a bf16
        grad with an fp32 ``out`` returns the unrounded sums; otherwise (larger problems, and
        always on the ``"Ascend950"`` profile) it is rounded to grad's dtype first.  Written only
        after all validation passed.

    Returns
    -------
    grad_weight : ndarray or torch.Tensor, shape ``(num_weights, D)``, grad's dtype
        NumPy in -> NumPy out, torch in -> torch out.

    Notes
    -----
    ``out[k] = sum_{i : indices_i == k} grad_i`` accumulated in fp32 in index order, then
    ``*= fp32(1.0f / count(k))`` when ``scale_grad_by_freq``, rounded once (round-to-nearest-even)
    to grad's dtype (or ``out``'s, see above); rows never indexed, and row ``padding_idx``, are
    zero.  Deterministic (no atomics; bitwise identical for any thread count) — the device's
    default implementation is not (its doc; docs/spec.md).

    Deterministic mode (``fg.deterministic()`` / ``FASTGRAD_DETERMINISTIC=1``, the device's
    ``ACL_OPT_DETERMINISTIC``): on the A2/A3 profiles an fp32 result is summed in the order of
    the device's ``EmbeddingDenseGradV2DeterministKernel`` (docs/device_parity.md row 9b): the
    sorted indices split over the profile's AI-vector-core count (``soc.aiv_cores``: 40 on
    Ascend910B3/B4, 48 on B1/B2 and A3 — name the chip with ``fg.soc_version``), each run of
    one index summed by one core, backwards over its range then forwards past it, in fp32
    partials of 10 rows added into the row.  E.g. grad ``[[1], [2**-24], [2**-24]]``, indices
    ``[0, 0, 0]`` gives ``1.0000001`` (index order gives ``1.0``).  A 16-bit result (not widened
    by the op_api) and the Ascend 950 profile keep the index order (the 910B tiling takes the
    deterministic kernel for fp32 only, ``embedding_dense_grad_v2_tiling.cpp:285``).

    Deviations from PyTorch: its CPU kernel accumulates fp16/bf16 in 16 bits (4096 bf16 ones
    sum to 256); fastgrad accumulates in fp32 like the device (4096).  PyTorch scales each
    term by ``1/count``; fastgrad, as the device, multiplies the fp32 sum by ``fp32(1/count)`` once.  An index outside
    ``[0, num_weights)`` is undefined on the device and in PyTorch; fastgrad rejects it
    (161002) and never writes out of bounds.

    Ranks: the device takes grad and indices of rank up to 8 (grad 1-D with 0-d indices is
    ``F.embedding(scalar_index, W)``'s backward).  Extensions outside strict mode: ranks above 8,
    indices of dtypes beyond the aclnn list (uint16/32/64, bfloat16).

    Raises
    ------
    AclnnError
        161001 when ``grad`` or ``indices`` is None.
        161002 when grad's dtype is not bf16/fp16/fp32, indices' dtype is not supported,
        ``prod(grad.shape[:-1]) != indices.size`` (checked when D > 0, as the device),
        ``num_weights`` is negative, an index is outside ``[0, num_weights)`` (NaN/Inf
        included; in strict mode not for an empty grad), ``out`` has the wrong shape/dtype or is
        read-only, an attribute has the wrong type, or (strict mode) grad is not 1-8-D or
        indices not 0-8-D.

    Source: the CANN doc aclnnEmbeddingDenseBackward.md; CANN ops-nn
    ``index/embedding_dense_grad_v2`` (op_api ``aclnn_embedding_dense_backward.cpp``).
    """
    return execute(
        DECL,
        dict(
            grad=grad,
            indices=indices,
            num_weights=num_weights,
            padding_idx=padding_idx,
            scale_grad_by_freq=scale_grad_by_freq,
        ),
        out,
    )
