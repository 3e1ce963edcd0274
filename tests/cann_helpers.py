"""The CANN test cases of the seven ops (tests/cann_cases/*.json) made runnable.

What is here, all written for fastgrad's tests from the ops-nn case files, executors and goldens
(hicann/ops-nn at the commit recorded in each JSON file; paths relative to that repository):

* **inputs** — :func:`atk_inputs` / :func:`ttk_inputs` generate a case's tensors as the ATK/TTK
  data generators and the op's executor do (see tests/cann_cases/README.md for each rule);
* **canonical arguments** — the fastgrad op's keyword arguments of a case (:func:`atk_canonical`,
  :func:`ttk_canonical`);
* **goldens** — float64 NumPy re-writings of each op's own golden (``executor_*.py``,
  ``tests/assets/golden.py``), following the kernel of the case's SoC where golden and kernel
  differ (:data:`GOLDENS`; every such point is named in the function's docstring);
* **standards** — the ATK single benchmark (``compare.py``'s ``"single"``, with the case's own
  threshold when it names one), the double benchmark, and the TTK rule (:func:`ttk_judge`);
* **shrinking** — :func:`shrink` reduces the batch dimensions of very large cases (never the
  reduced/last dimension, the dtypes or the attributes) so that the file fits CI's time.
"""

from __future__ import annotations

import json
import math
import pathlib
import zlib
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

CASES_DIR = pathlib.Path(__file__).resolve().parent / "cann_cases"

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {
    "bf16": BF16,
    "bfloat16": BF16,
    "fp16": np.dtype(np.float16),
    "float16": np.dtype(np.float16),
    "fp32": np.dtype(np.float32),
    "float32": np.dtype(np.float32),
    "float": np.dtype(np.float32),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(bool),
}

#: a case's tensors above this many elements are shrunk (batch dimensions only), see :func:`shrink`
SHRINK_ELEMENTS = 1 << 18
#: cases with more elements than this (after shrinking) are marked ``slow`` (they still run)
SLOW_ELEMENTS = 1 << 16

ATK_FILES = (
    "atk_aclnnFusedLinearOnlineMaxSum",
    "atk_aclnnFusedCrossEntropyLossWithMaxSum",
    "atk_aclnnFusedLinearCrossEntropyLossGrad",
    "atk_aclnnCrossEntropyLossGrad",
    "atk_aclnnScaledMaskedSoftmaxBackward",
    "atk_aclnnSmoothL1LossBackward",
    "atk_aclnnEmbeddingDenseBackward",
)
TTK_FILES = (
    "ttk_kernel_fused_cross_entropy_loss_with_max_sum",
    "ttk_aclnn_fused_cross_entropy_loss_with_max_sum",
    "ttk_kernel_cross_entropy_loss_grad_st",
    "ttk_kernel_smooth_l1_loss_grad_v2_st",
    "ttk_kernel_embedding_dense_grad_v2_st",
    "ttk_kernel_embedding_dense_grad_st",
)

_CACHE: dict = {}


def load(stem: str) -> dict:
    if stem not in _CACHE:
        _CACHE[stem] = json.loads((CASES_DIR / f"{stem}.json").read_text())
    return _CACHE[stem]


def case_key(stem: str, case: dict) -> str:
    return str(case["id"]) if "id" in case else case["name"]


def seed_of(stem: str, key: str) -> int:
    return zlib.crc32(f"{stem}:{key}".encode())


# ----------------------------------------------------------------------------------------------
# value generation (the ATK/TTK rules, tests/cann_cases/README.md)
# ----------------------------------------------------------------------------------------------


def _special(v):
    return isinstance(v, str) and v.lstrip("-") in ("inf", "nan")


def gen_tensor(rng: np.random.Generator, dtype: np.dtype, shape, spec) -> np.ndarray:
    """One tensor: ``spec`` is [lo, hi] (uniform; integers inclusive), a fill ('nan', 'inf', '-inf',
    or [v, v] with v special), ``{"name": "nd", "mean": [a, b], "std": [c, d]}`` (normal with
    mean ~ U(a, b), std ~ U(c, d)), True/False (bool fill), or None (the default range [0, 1])."""
    shape = tuple(shape)
    with np.errstate(over="ignore", invalid="ignore"):
        return _gen(rng, np.dtype(dtype), shape, spec)


def _gen(rng: np.random.Generator, dtype: np.dtype, shape: tuple, spec) -> np.ndarray:
    if isinstance(spec, str) and _special(spec):
        return np.full(shape, float(spec), np.float32).astype(dtype)
    if isinstance(spec, bool):
        return np.full(shape, spec, dtype)
    if isinstance(spec, dict):
        mean = rng.uniform(*spec["mean"])
        std = rng.uniform(*spec["std"])
        return rng.normal(mean, std, shape).astype(np.float32).astype(dtype)
    if spec is None or (isinstance(spec, (list, tuple)) and spec[0] is None):
        spec = [0, 1]
    lo, hi = spec
    if _special(lo) or _special(hi):
        if lo == hi or (isinstance(lo, str) and isinstance(hi, str) and lo.lstrip("-") == hi.lstrip("-") == "nan"):
            return np.full(shape, float(lo), np.float32).astype(dtype)
        return rng.choice(np.array([float(lo), float(hi)], np.float32), size=shape).astype(dtype)
    if dtype == np.dtype(bool):
        if lo == hi:
            return np.full(shape, bool(lo), bool)
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(int(lo), int(hi) + 1, size=shape).astype(dtype)
    return rng.uniform(float(lo), float(hi), shape).astype(np.float32).astype(dtype)


def attr_value(rng: np.random.Generator, spec: dict):
    """An ATK attribute: a fixed value, a [lo, hi] range (uniform), or a special fill of a bool
    attribute ('nan'/'inf'/'-inf': truthy, as Python's bool(float(...)))."""
    v = spec["value"]
    kind = spec["dtype"]
    if isinstance(v, list):
        if kind == "int":
            return int(rng.integers(int(v[0]), int(v[1]) + 1))
        return float(rng.uniform(float(v[0]), float(v[1])))
    if kind == "bool":
        return bool(float(v)) if isinstance(v, str) else bool(v)
    if kind in ("float", "float32", "double"):
        return float(v)
    if kind == "int":
        return int(v)
    return v


# ----------------------------------------------------------------------------------------------
# shrinking (CI time): batch dimensions only
# ----------------------------------------------------------------------------------------------


def _halve_leading(shapes: list, n_lead: int, limit: int) -> list:
    """Halve (ceil) the largest of the first ``n_lead`` dimensions of every shape together until
    the largest shape has <= limit elements; dimensions of size 1 (broadcast) stay 1."""
    shapes = [list(s) if s is not None else None for s in shapes]
    ref = max((s for s in shapes if s is not None), key=math.prod)
    while math.prod(ref) > limit:
        lead = ref[:n_lead]
        if not lead or max(lead) <= 1:
            break
        k = int(np.argmax(lead))
        old = ref[k]
        new = (old + 1) // 2
        for s in shapes:
            if s is not None and len(s) > k and s[k] == old:
                s[k] = new
    return shapes


def shrink(op: str, shapes: dict, limit: int = SHRINK_ELEMENTS, main: str | None = None) -> tuple[dict, str | None]:
    """The case's tensor shapes, with the batch dimensions reduced when a tensor exceeds ``limit``
    elements.  Kept: the last (reduced) dimension of every row op (C of cross-entropy, V of the
    softmax output, S2 of the masked softmax, D of the embedding), the broadcast structure
    (size-1 dimensions), all dtypes and attributes.  ``main`` names the tensor that carries the
    rows ([N, C] of the row ops, ``grad`` of the embedding).  Returns (shapes, note) — note is
    None when nothing changed."""
    big = max((math.prod(s) for s in shapes.values() if s is not None), default=0)
    if big <= limit or main is None or shapes.get(main) is None:
        return shapes, None
    names = [n for n, s in shapes.items() if s is not None]
    old = {n: list(shapes[n]) for n in names}
    out = dict(shapes)
    if op in ("cross_entropy_loss_grad", "fused_cross_entropy_loss_with_max_sum"):
        n_rows, cols = shapes[main]
        new_n = min(n_rows, max(4, limit // max(cols, 1)))  # at least 4 rows (several rows per reduction)
        for n in names:
            s = list(shapes[n])
            # [N, C] / [N, H] tensors and the [N] row vectors; the class weight [C] of
            # cross-entropy (ATK weightOptional, TTK input 3) keeps C
            class_weight = op == "cross_entropy_loss_grad" and n in ("weightOptional", "3")
            if s and s[0] == n_rows and len(s) <= 2 and not class_weight:
                s[0] = new_n
            out[n] = s
    elif op in ("scaled_masked_softmax_backward", "embedding_dense_backward"):
        n_lead = 3 if op == "scaled_masked_softmax_backward" else len(shapes[main]) - 1
        order = [main] + [n for n in names if n != main]
        lst = _halve_leading([shapes[n] for n in order], n_lead, limit)
        out.update(dict(zip(order, lst)))
    else:
        return shapes, None
    note = ", ".join(f"{n} {old[n]}->{out[n]}" for n in names if list(out[n]) != old[n])
    return out, (note or None)


#: the tensor carrying the rows of each op's ATK cases (see :func:`shrink`)
ATK_MAIN = {
    "cross_entropy_loss_grad": "logProb",
    "fused_cross_entropy_loss_with_max_sum": "vocab_parallel_logits",
    "scaled_masked_softmax_backward": "y_grad",
    "embedding_dense_backward": "grad",
}


def ttk_shapes(case: dict, op: str) -> tuple[dict, str | None]:
    """A TTK case's input shapes by position ("0", "1", ...; the embedding's grad named "grad" and
    viewed as indices.shape + [D], as golden.py does), and the row-carrying tensor."""
    lst = case.get("input_shapes") or case.get("tensor_view_shapes")
    n_in = len(case["input_data_ranges"]) if "tensor_view_shapes" in case else len(lst)
    shapes = {str(i): (list(lst[i]) if lst[i] is not None else None) for i in range(n_in)}
    main = None
    if op == "embedding_dense_backward":
        g = shapes.pop("0")
        shapes = {"grad": list(lst[1]) + [g[-1]], **shapes}
        main = "grad"
    elif op == "cross_entropy_loss_grad":
        main = "1"
    elif op == "fused_cross_entropy_loss_with_max_sum":
        main = "5"
    return shapes, main


# ----------------------------------------------------------------------------------------------
# prepared cases
# ----------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """One case, ready to run: the fastgrad op, its keyword arguments, the SoC profile."""

    stem: str
    key: str
    op: str
    soc: str
    kwargs: dict
    standard: dict
    shrink_note: str | None = None
    notes: list = field(default_factory=list)
    raw: dict = field(default_factory=dict)  # the generated inputs by the case file's names
    reference: object = None  # the third-party output (double benchmark), computed lazily


def atk_shapes(case: dict) -> dict:
    return {n: t["shape"] for n, t in case["tensors"].items()}


def atk_inputs(stem: str, case: dict, op: str, shrink_limit: int = SHRINK_ELEMENTS) -> tuple[dict, str | None]:
    """The case's inputs by the ATK case file's names (tensors and attributes), generated as the
    ATK generator and the op's executor do, and the shrink note."""
    rng = np.random.default_rng(seed_of(stem, case_key(stem, case)))
    shapes, note = shrink(op, atk_shapes(case), shrink_limit, ATK_MAIN.get(op))
    raw: dict = {}
    for name, t in case["tensors"].items():
        raw[name] = gen_tensor(rng, DTYPES[t["dtype"]], shapes[name], t["range"])
    for name, a in case["attrs"].items():
        raw[name] = attr_value(rng, a)
    if op == "embedding_dense_backward":
        # executor_aclnnEmbeddingDenseBackward.py init_by_input_data: the indices are replaced by
        # np.random.randint(0, numWeights, indices.shape) whatever the case's range says
        idx = raw["indices"]
        raw["indices"] = rng.integers(0, raw["numWeights"], size=idx.shape).astype(idx.dtype)
    return raw, note


def atk_canonical(op: str, raw: dict) -> dict:
    """The fastgrad op's keyword arguments from an ATK case's inputs (the executor's choices)."""
    if op == "fused_linear_online_max_sum":
        return dict(
            input=raw["input"],
            weight=raw["weight"],
            target=raw["target"],
            vocab_start_index=raw["vocabStartIndex"],
            vocab_end_index=raw["vocabEndIndex"],
            return_logits=raw["vocabParallelLogitsOutFlag"],
        )
    if op == "fused_cross_entropy_loss_with_max_sum":
        # input / weight are optional aclnn inputs the op never reads (golden and executor ignore them)
        return dict(
            logits_max=raw["logits_max"],
            sum_exp_logits=raw["sum_exp_logits"],
            predicted_logits=raw["predicted_logits"],
            label_smoothing=raw["labelSmoothing"],
            vocab_parallel_logits=raw["vocab_parallel_logits"],
        )
    if op == "fused_linear_cross_entropy_loss_grad":
        return dict(
            grad=raw["grad"],
            input=raw["input"],
            weight=raw["weight"],
            target_mask=raw["targetMask"],
            masked_target=raw["maskedTarget"],
            label_smoothing=raw["labelSmoothing"],
            logits_max=raw["logitsMaxOptional"],
            sum_exp_logits=raw["sumExpLogitsOptional"],
            softmax=raw["softmaxOptional"],
        )
    if op == "cross_entropy_loss_grad":
        # executor_aclnnCrossEntropyLossGrad.py (the pyaclnn executor) passes nullptr for
        # gradZlossOptional and lseForZlossOptional: the z-loss inputs are absent
        return dict(
            grad_loss=raw["gradLoss"],
            log_prob=raw["logProb"],
            target=raw["targets"],
            weight=raw["weightOptional"],
            reduction=raw["reduction"],
            ignore_index=raw["ignoreIndex"],
            label_smoothing=raw["labelSmoothing"],
            lse_square_scale_for_zloss=raw["lseSquareScaleForZloss"],
        )
    if op == "scaled_masked_softmax_backward":
        return dict(
            grad_output=raw["y_grad"],
            y=raw["y"],
            mask=raw["mask"],
            scale=raw["scale"],
            fix_triu_mask=raw["fixed_triu_mask"],
        )
    if op == "smooth_l1_loss_backward":
        return dict(
            grad_out=raw["gradOut"],
            input=raw["self"],
            target=raw["target"],
            reduction=int(raw["reduction"]),
            beta=raw["beta"],
        )
    if op == "embedding_dense_backward":
        return dict(
            grad=raw["grad"],
            indices=raw["indices"],
            num_weights=raw["numWeights"],
            padding_idx=raw["paddingIdx"],
            scale_grad_by_freq=raw["scaleGradByFreq"],
        )
    raise KeyError(op)


def atk_standard(meta: dict, case: dict) -> dict:
    """{"kind": "single"|"double", "threshold": {dtype: T} or None} from the case's standard."""
    std = case.get("standard", meta.get("standard"))
    acc = std.get("acc") if isinstance(std, dict) else std
    if acc == "double_benchmark":
        return {"kind": "double"}
    out: dict = {"kind": "single", "threshold": None}
    if isinstance(acc, dict) and "single_bm" in acc:
        sb = acc["single_bm"]
        if isinstance(sb, dict) and "bf16_error" in sb:
            base, exp = sb["bf16_error"].split("**")
            out["threshold"] = {"bfloat16": float(base) ** float(exp)}
    # "single_bm" / {"single_bm": ...} / "default": the single benchmark (the ATK default for
    # floating-point compute ops, ops-precision-standard's community Threshold standard)
    return out


def prepare_atk(stem: str, index: int, shrink_limit: int = SHRINK_ELEMENTS) -> Prepared:
    data = load(stem)
    case = data["cases"][index]
    op = data["op"]
    raw, note = atk_inputs(stem, case, op, shrink_limit)
    meta = {k: v for k, v in data.items() if k != "cases"}
    # ATK cases name no SoC: the aclnn default profile (Atlas A2)
    return Prepared(
        stem, case_key(stem, case), op, "Ascend910B", atk_canonical(op, raw), atk_standard(meta, case), note, raw=raw
    )


# TTK -----------------------------------------------------------------------------------------

#: each TTK op's inputs and attributes in op-definition order (op_host/*_def.cpp)
TTK_DEFS = {
    "fused_cross_entropy_loss_with_max_sum": (
        ("logits_max", "sum_exp_logits", "predicted_logits", "input", "weight", "vocab_parallel_logits"),
        ("label_smoothing",),
    ),
    "cross_entropy_loss_grad": (
        ("grad_loss", "log_prob", "target", "weight", "grad_zloss", "lse_for_zloss"),
        ("reduction", "ignore_index", "label_smoothing", "lse_square_scale_for_zloss"),
    ),
    "smooth_l1_loss_grad_v2": (("predict", "label", "dout"), ("sigma", "reduction")),
    "embedding_dense_grad_v2": (
        ("grad", "sort_indices", "pos_idx"),
        ("num_weights", "padding_idx", "scale_grad_by_freq"),
    ),
    "embedding_dense_grad": (("grad", "indices"), ("num_weights", "padding_idx", "scale_grad_by_freq")),
}

#: the aclnn signature of the TTK aclnn file's API (tensors and attributes, outputs last)
TTK_ACLNN_DEFS = {
    "aclnnFusedCrossEntropyLossWithMaxSum": (
        "logitsMax",
        "sumExpLogits",
        "predictedLogits",
        "labelSmoothing",
        "inputOptional",
        "weightOptional",
        "vocabParallelLogitsOptional",
        "lossOut",
        "softmaxOutOptional",
    ),
}


def ttk_inputs(stem: str, case: dict, op: str, shrink_limit: int = SHRINK_ELEMENTS):
    """(tensors in op-definition order — None where absent —, attrs, shrink note, output dtypes)."""
    rng = np.random.default_rng(seed_of(stem, case["name"]))
    dtypes_l = case.get("input_dtypes") or case.get("tensor_dtypes")
    ranges = case.get("input_data_ranges") or []
    shapes, main = ttk_shapes(case, op)
    new, note = shrink(op, shapes, shrink_limit, main)
    order = list(new)  # positional: "grad" stands for position 0
    tensors = []
    for i, name in enumerate(order):
        if new[name] is None or dtypes_l[i] is None:
            tensors.append(None)
            continue
        spec = ranges[i] if i < len(ranges) else None
        tensors.append(gen_tensor(rng, DTYPES[dtypes_l[i]], new[name], spec))
    if op == "embedding_dense_backward" and len(tensors) == 3:
        # input.py: (grad, sort_indices, pos_idx) = the stable sort of the indices and its argsort
        # (the case's range for sort_indices is the range of the unsorted indices)
        idx = tensors[1]
        flat = idx.reshape(-1)
        pos = np.argsort(flat, kind="stable")
        tensors[1] = np.sort(flat, kind="stable").reshape(idx.shape)
        tensors[2] = pos.astype(tensors[2].dtype).reshape(idx.shape)
    out_dtypes = case.get("output_dtypes")
    if out_dtypes is None and "output_tensor_indexes" in case:
        out_dtypes = [dtypes_l[i] for i in case["output_tensor_indexes"]]
    return tensors, dict(case.get("attributes") or {}), note, list(out_dtypes or [])


def ttk_canonical(op: str, kernel: str, tensors: list, attrs: dict) -> dict:
    """The fastgrad op's keyword arguments from a TTK case (tensors in op-definition order)."""
    if op == "fused_cross_entropy_loss_with_max_sum":
        ls = attrs.get("label_smoothing", attrs.get("labelSmoothing", 0.0))
        if stem_is_kernel_level(kernel):
            # a kernel-level case: the kernel and both tilings never read label_smoothing (ops-nn
            # op_kernel/fused_cross_entropy_loss_with_max_sum*.h; golden.py deletes it); only the
            # aclnn API refuses a non-zero value (aclnn_fused_cross_entropy_loss_with_max_sum.cpp:114,
            # pinned by test_kernel_level_label_smoothing_is_the_aclnn_refusal): the kernel computes
            # the case with 0
            ls = 0.0
        return dict(
            logits_max=tensors[0],
            sum_exp_logits=tensors[1],
            predicted_logits=tensors[2],
            label_smoothing=ls,
            vocab_parallel_logits=tensors[5],
        )
    if op == "cross_entropy_loss_grad":
        return dict(
            grad_loss=tensors[0],
            log_prob=tensors[1],
            target=tensors[2],
            weight=tensors[3],
            grad_zloss=tensors[4],
            lse_for_zloss=tensors[5],
            reduction=attrs.get("reduction", "mean"),
            ignore_index=attrs.get("ignore_index", -100),
            label_smoothing=attrs.get("label_smoothing", 0.0),
            lse_square_scale_for_zloss=attrs.get("lse_square_scale_for_zloss", 0.0),
        )
    if op == "smooth_l1_loss_backward":
        return dict(
            grad_out=tensors[2],
            input=tensors[0],
            target=tensors[1],
            reduction=attrs.get("reduction", "mean"),
            beta=attrs.get("sigma", 1.0),
        )
    if op == "embedding_dense_backward":
        if kernel == "embedding_dense_grad_v2":
            idx = unsort_indices(tensors[1], tensors[2])
        else:
            idx = tensors[1]
        grad = tensors[0].reshape(tuple(idx.shape) + (tensors[0].shape[-1],))
        return dict(
            grad=grad,
            indices=idx,
            num_weights=attrs["num_weights"],
            padding_idx=attrs.get("padding_idx", -1),
            scale_grad_by_freq=attrs.get("scale_grad_by_freq", False),
        )
    raise KeyError(op)


def unsort_indices(sort_indices: np.ndarray, pos_idx: np.ndarray) -> np.ndarray:
    """The original indices from EmbeddingDenseGradV2's (sort_indices, pos_idx): golden.py's scatter."""
    flat = np.zeros(sort_indices.size, sort_indices.dtype)
    flat[pos_idx.reshape(-1).astype(np.int64)] = sort_indices.reshape(-1)
    return flat.reshape(sort_indices.shape)


def ttk_soc(case: dict) -> str:
    """The SoC of a TTK case: its soc_series, else Ascend950 (the files live in tests/st/arch35)."""
    soc = case.get("soc_series")
    if soc:
        return soc[0] if isinstance(soc, (list, tuple)) else str(soc)
    return "Ascend950"


def stem_is_kernel_level(kernel: str | None) -> bool:
    """A TTK case that calls the kernel (``op_name``, e.g. FusedCrossEntropyLossWithMaxSum), not
    the aclnn API (``api_name``, aclnn…)."""
    return bool(kernel) and not str(kernel).startswith("aclnn")


def ttk_kernel_name(case: dict) -> str:
    return case.get("op_name") or case.get("api_name")


def prepare_ttk(stem: str, index: int, shrink_limit: int = SHRINK_ELEMENTS) -> Prepared:
    data = load(stem)
    case = data["cases"][index]
    op = data["op"]
    tensors, attrs, note, out_dtypes = ttk_inputs(stem, case, op, shrink_limit)
    kernel = ttk_kernel_name(case)
    kw = ttk_canonical(op, kernel, tensors, attrs)
    tol = [tuple(t) for t in case["precision_tolerances"]]
    std = {"kind": "ttk", "tolerances": tol, "absolute": float(case["absolute_precision"]), "out_dtypes": out_dtypes}
    p = Prepared(stem, case["name"], op, ttk_soc(case), kw, std, note)
    p.raw = {"tensors": tensors, "attrs": attrs, "kernel": kernel}
    return p


def case_elements(stem: str, case: dict, op: str) -> int:
    """The largest tensor of the case after shrinking (for the slow mark)."""
    if "tensors" in case:
        shapes, _ = shrink(op, atk_shapes(case), SHRINK_ELEMENTS, ATK_MAIN.get(op))
    else:
        shapes, main = ttk_shapes(case, op)
        shapes, _ = shrink(op, shapes, SHRINK_ELEMENTS, main)
    return max((math.prod(s) for s in shapes.values() if s is not None), default=0)


# ----------------------------------------------------------------------------------------------
# goldens (float64, the op's own golden; the kernel of the SoC where they differ)
# ----------------------------------------------------------------------------------------------


def f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def round_to(x: np.ndarray, dtype) -> np.ndarray:
    """float64 -> dtype (RNE, through fp32 for 16-bit types as the device) -> float64."""
    dt = np.dtype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the rounding's result
        if dt == np.float32:
            return x.astype(np.float32).astype(np.float64)
        return x.astype(np.float32).astype(dt).astype(np.float64)


def golden_fused_linear_online_max_sum(
    input, weight, target, vocab_start_index, vocab_end_index, return_logits=False, soc=None
) -> list:
    """executor_aclnnFusedLinearOnlineMaxSum.py: logits in float64 (the executor: fp64 -> fp32; the
    kernel's matmul output type is a point of issue 25, irrelevant for these cases whose inputs are
    all 0), max, Σexp, the target's logit minus max (0 when masked), the target mask packed LSB-first
    with padding rows computed from target 0, masked_target = t - start (0 when masked)."""
    x, w = f64(input), f64(weight)
    t = np.asarray(target).astype(np.int64)
    logits = x @ w.T
    bt, v = logits.shape
    m = logits.max(axis=1) if v else np.full(bt, -np.inf)
    s = np.exp(logits - m[:, None]).sum(axis=1)
    mask = (t < vocab_start_index) | (t >= vocab_end_index)
    mt = np.where(mask, 0, t - vocab_start_index)
    if np.any(mt >= v):
        raise AssertionError("target - vocab_start_index >= V: the executor's golden indexes out of bounds")
    pred = np.where(mask, 0.0, logits[np.arange(bt), mt] - m)
    pad = (-bt) % 8
    padded = np.concatenate([mask, np.full(pad, (0 < vocab_start_index) or (0 >= vocab_end_index))])
    packed = np.packbits(padded.astype(np.uint8), bitorder="little")
    outs = [m, s, pred, packed, mt.astype(np.asarray(target).dtype)]
    if return_logits:
        outs.append(logits)
    return outs


def golden_fused_cross_entropy_loss_with_max_sum(
    logits_max, sum_exp_logits, predicted_logits, label_smoothing=0.0, vocab_parallel_logits=None, soc=None
) -> list:
    """golden.py / executor: loss = log(sum_exp) - predicted; softmax = exp(logits - max)·(1/sum_exp)
    (the golden's and the kernel's reciprocal multiply); label_smoothing is not read (golden.py
    deletes it)."""
    m, s, p = f64(logits_max), f64(sum_exp_logits), f64(predicted_logits)
    with np.errstate(all="ignore"):
        loss = np.log(s) - p
        if vocab_parallel_logits is None:
            return [loss, None]
        sm = np.exp(f64(vocab_parallel_logits) - m[:, None]) * (1.0 / s)[:, None]
    return [loss, sm]


def golden_fused_linear_cross_entropy_loss_grad(
    grad,
    input,
    weight,
    target_mask,
    masked_target,
    label_smoothing=0.0,
    logits_max=None,
    sum_exp_logits=None,
    softmax=None,
    soc=None,
) -> list:
    """executor_aclnnFusedLinearCrossEntropyLossGrad.py (high-performance mode: softmax given):
    g = (softmax - onehot·(1 - mask))·grad, rounded to the input dtype (the executor's and the
    kernel's cast before the Cube matmuls), grad_input = g·weight, grad_weight = gᵀ·input."""
    if softmax is None:
        raise NotImplementedError("the ATK cases all give softmax")
    p = f64(softmax).copy()
    bt = p.shape[0]
    tm = np.asarray(target_mask)
    if tm.dtype != bool:
        tm = np.unpackbits(tm, bitorder="little")[:bt].astype(bool)
    mt = np.asarray(masked_target).astype(np.int64)
    rows = np.arange(bt)
    p[rows, mt] -= 1.0 - tm.astype(np.float64)
    g = round_to(p * f64(grad)[:, None], np.asarray(input).dtype)
    return [g @ f64(weight), g.T @ f64(input)]


def golden_cross_entropy_loss_grad(
    grad_loss,
    log_prob,
    target,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    label_smoothing=0.0,
    grad_zloss=None,
    lse_for_zloss=None,
    lse_square_scale_for_zloss=0.0,
    soc=None,
) -> list:
    """golden.py / executor_aclnnCrossEntropyLossGrad.py: nll backward fused with log-softmax
    backward, p = exp(log_prob) (not renormalised), w_i = weight[t_i]·[t_i != ignore_index],
    mean divides by Σw_i (0 -> NaN everywhere, as the device), label smoothing term
    (ls/C)·(p·Σ_c weight_c - weight_j).  z-loss inputs are never read (A2/A3 kernel)."""
    red = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction)
    lp = f64(log_prob)
    n, c = lp.shape
    t = np.asarray(target).astype(np.int64)
    w = np.ones(c) if weight is None else f64(weight)
    g = f64(grad_loss).reshape(-1)
    keep = (t != ignore_index).astype(np.float64)
    wy = w[t] * keep
    ls = float(label_smoothing)
    with np.errstate(all="ignore"):
        if red == "mean":
            scale = np.full(n, g[0] / wy.sum())
        elif red == "sum":
            scale = np.full(n, g[0])
        else:
            scale = g
        p = np.exp(lp)
        nll = scale * wy * (1.0 - ls)
        out = p * nll[:, None]
        out[np.arange(n), t] -= nll
        if ls != 0.0:
            sm = (scale * keep * ls / c)[:, None] * w[None, :]
            out = out + p * sm.sum(axis=1, keepdims=True) - sm
    return [out]


def _sms_reduce_sum(x: np.ndarray) -> np.ndarray:
    """executor_aclnnScaledMaskedSoftmaxBackward.py reduce_sum in fp32: the rows padded with 0 to a
    multiple of 64 when S2 <= 1024 (blocks of 8), else blocks of 64; each block summed by pairwise
    halving (odd lengths padded with 0); for S2 <= 1024 the blocks folded onto the first 8 in
    order; then a pairwise tree over the blocks."""
    lines, n = x.shape
    x = x.astype(np.float32)
    if n <= 1024:
        block = 8
        al = (n + 63) // 64 * 64
        x = np.concatenate([x, np.zeros((lines, al - n), np.float32)], axis=1)
        n = al
    else:
        block = 64
    blocks = (n + block - 1) // block
    out = np.zeros((lines, blocks), np.float32)
    for i in range(blocks):
        b = x[:, i * block : min((i + 1) * block, n)]
        while b.shape[1] > 1:
            if b.shape[1] % 2:
                b = np.concatenate([b, np.zeros((lines, 1), np.float32)], axis=1)
            b = b[:, 0::2] + b[:, 1::2]
        out[:, i] = b[:, 0]
    if n <= 1024:
        for i in range(1, blocks // block):
            out[:, :8] += out[:, i * 8 : (i + 1) * 8]
        out = out[:, :8]
    while out.shape[1] > 1:
        if out.shape[1] % 2:
            out = np.concatenate([out, np.zeros((lines, 1), np.float32)], axis=1)
        out = out[:, 0::2] + out[:, 1::2]
    return out[:, 0]


def golden_scaled_masked_softmax_backward(grad_output, y, mask, scale=1.0, fix_triu_mask=False, soc=None) -> list:
    """fp32 as the device, the reduction in the executor's (the kernel's vector-unit) order.
    Form: the executor computes dy·y - Σ·y for every S2; the kernel does so only for padded
    S2 > 1024 (``large_headdim.h``); for padded S2 <= 1024 it calls AscendC ``SoftmaxGrad``
    (``norm_headdim.h``): (dy - Σ)·y — followed here (issue 25).  Then ·scale, 0 where mask."""
    dy = np.asarray(grad_output).astype(np.float32)
    yy = np.asarray(y).astype(np.float32)
    s2 = dy.shape[-1]
    lines = dy.reshape(-1, s2)
    yl = yy.reshape(-1, s2)
    with np.errstate(all="ignore"):
        prod = lines * yl
        tot = _sms_reduce_sum(prod)[:, None]
        if (s2 + 63) // 64 * 64 <= 1024:
            xg = (lines - tot) * yl
        else:
            xg = prod - tot * yl
        xg = (xg * np.float32(scale)).reshape(dy.shape)
    m = np.broadcast_to(np.asarray(mask, bool), dy.shape) if mask is not None else np.zeros(dy.shape, bool)
    if fix_triu_mask:
        s1 = dy.shape[-2]
        m = m | np.triu(np.ones((s1, s2), bool), 1)
    return [np.where(m, np.float32(0), xg).astype(np.float64)]


def golden_smooth_l1_loss_backward(grad_out, input, target, reduction="mean", beta=1.0, soc="Ascend910B") -> list:
    """golden.py / executor (torch's smooth_l1_loss_backward): |d| < β: d/β, else sign(d); times
    grad_out; mean divides by the number of elements.  On Ascend910B/910_93 the TBE kernel
    (``impl/dynamic/smooth_l1_loss_grad_v2.py``) computes -[d <= -β] + [d >= β] + [|d| < β]·d/(β + 1e-6)
    instead: followed for those profiles (issue 25)."""
    red = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction)
    x, t, go = f64(input), f64(target), f64(grad_out)
    shape = np.broadcast_shapes(x.shape, t.shape, go.shape)
    d = np.broadcast_to(x - t, shape)
    b = float(beta)
    with np.errstate(all="ignore"):
        if soc in ("Ascend910B", "Ascend910_93"):
            r = -(d <= -b).astype(np.float64) + (d >= b) + (np.abs(d) < b) * (d / (b + 1e-6))
        else:
            r = np.where(np.abs(d) < b, d / b, np.sign(d))
        r = r * np.broadcast_to(go, shape)
        if red == "mean":
            r = r / max(math.prod(shape), 1)
    return [r]


def golden_embedding_dense_backward(
    grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False, soc=None
) -> list:
    """golden.py / executor (torch's embedding_dense_backward): out[k] = Σ_{idx_i = k} grad[i] (float64
    here), row padding_idx 0 (an index never equals a padding_idx outside [0, num_weights));
    scale_grad_by_freq multiplies by the fp32 reciprocal 1.0f/count as the kernel
    (``embedding_dense_grad_v2_scale.h``), where torch divides."""
    g = f64(grad)
    d = g.shape[-1]
    g = g.reshape(-1, d)
    idx = np.asarray(indices).astype(np.int64).reshape(-1)
    out = np.zeros((int(num_weights), d))
    with np.errstate(all="ignore"):
        np.add.at(out, idx, g)
        if scale_grad_by_freq:
            cnt = np.bincount(idx, minlength=int(num_weights)).astype(np.float64)
            rec = np.where(cnt > 0, (np.float32(1.0) / np.maximum(cnt, 1).astype(np.float32)).astype(np.float64), 0.0)
            out = out * rec[:, None]
    if 0 <= padding_idx < num_weights:
        out[padding_idx] = 0.0
    return [out]


GOLDENS = {
    "fused_linear_online_max_sum": golden_fused_linear_online_max_sum,
    "fused_cross_entropy_loss_with_max_sum": golden_fused_cross_entropy_loss_with_max_sum,
    "fused_linear_cross_entropy_loss_grad": golden_fused_linear_cross_entropy_loss_grad,
    "cross_entropy_loss_grad": golden_cross_entropy_loss_grad,
    "scaled_masked_softmax_backward": golden_scaled_masked_softmax_backward,
    "smooth_l1_loss_backward": golden_smooth_l1_loss_backward,
    "embedding_dense_backward": golden_embedding_dense_backward,
}


def golden(p: Prepared) -> list:
    return GOLDENS[p.op](**p.kwargs, soc=p.soc)


def output_dtypes(p: Prepared) -> list:
    """The output dtype of each output, aclnn order (None: an integer output compared exactly)."""
    k = p.kwargs
    if p.op == "fused_linear_online_max_sum":
        f32 = np.dtype(np.float32)
        return [f32, f32, f32, None, None, np.asarray(k["input"]).dtype]
    if p.op == "fused_cross_entropy_loss_with_max_sum":
        return [np.dtype(np.float32), np.dtype(np.float32)]
    if p.op == "fused_linear_cross_entropy_loss_grad":
        return [np.asarray(k["input"]).dtype] * 2
    if p.op == "cross_entropy_loss_grad":
        return [np.asarray(k["log_prob"]).dtype]
    if p.op == "scaled_masked_softmax_backward":
        return [np.asarray(k["grad_output"]).dtype]
    if p.op == "smooth_l1_loss_backward":
        return [np.result_type(*(np.asarray(k[n]).dtype for n in ("grad_out", "input", "target")))]
    if p.op == "embedding_dense_backward":
        return [np.asarray(k["grad"]).dtype]
    raise KeyError(p.op)


def third_party(p: Prepared) -> list:
    """The double benchmark's third-party output: the op's executor (torch CPU, the case's dtype)."""
    import torch

    if p.op != "embedding_dense_backward":
        raise KeyError(p.op)
    k = p.kwargs
    g = np.asarray(k["grad"])
    tg = torch.from_numpy(g.view(np.int16)).view(torch.bfloat16) if g.dtype == BF16 else torch.from_numpy(g)
    idx = torch.from_numpy(np.asarray(k["indices"]).astype(np.int64))
    scale = bool(k["scale_grad_by_freq"])
    r = torch.ops.aten.embedding_dense_backward(tg, idx, int(k["num_weights"]), int(k["padding_idx"]), False)
    if scale:
        # the executor's torch divides the sums by the counts; the kernel multiplies by the fp32
        # reciprocal 1.0f/count (embedding_dense_grad_v2_scale.h:100-104, followed by fastgrad and
        # the golden above).  The third party takes the kernel's formula on torch's own fp32 sums:
        # with torch's division the double benchmark compares two roundings of the scale against
        # one, and on a small output (ATK case 24: 12 against 7 one-ulp differences) the device's
        # own arithmetic misses the RMSE ratio (2.79 > 2)
        cnt = torch.bincount(idx.reshape(-1), minlength=int(k["num_weights"])).to(torch.float32)
        rec = torch.where(cnt > 0, 1.0 / torch.clamp(cnt, min=1.0), torch.zeros_like(cnt))
        r = (r.float() * rec[:, None]).to(r.dtype)
    return [r.float().numpy()]


# ----------------------------------------------------------------------------------------------
# running and judging
# ----------------------------------------------------------------------------------------------


def as_list(op: str, r) -> list:
    """fastgrad's result as a list in aclnn output order (NumPy)."""
    if op == "fused_linear_online_max_sum":
        return list(r)
    if op in ("fused_cross_entropy_loss_with_max_sum", "fused_linear_cross_entropy_loss_grad"):
        return list(r)
    return [r]


def soc_context(name: str):
    import fastgrad as fg

    return fg.soc_version(name)


def run_fastgrad(p: Prepared) -> list:
    import warnings

    import fastgrad as fg

    with soc_context(p.soc), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return as_list(p.op, getattr(fg, p.op)(**p.kwargs))


def single(actual, gold: np.ndarray, dtype, threshold: float | None = None) -> tuple[bool, str]:
    """The ATK single benchmark (compare.py "single"): MERE < T, MARE < 10 T, inf/NaN in place;
    ``threshold`` overrides T (the case's own, e.g. FLCE grad's bf16_error 2**-6)."""
    from fastgrad.compare import compare

    r = compare(actual, gold, dtype=dtype, standard="single")
    if threshold is None:
        return r.passed, "; ".join(r.failures)
    m = r.metrics
    fails = []
    if m["special_mismatch"]:
        fails.append(f"inf/NaN placement differs at {m['special_mismatch']} positions")
    if not m["MERE"] < threshold:
        fails.append(f"MERE {m['MERE']:.4g} >= {threshold:.4g}")
    if not m["MARE"] < 10 * threshold:
        fails.append(f"MARE {m['MARE']:.4g} >= {10 * threshold:.4g}")
    return not fails, "; ".join(fails)


def ttk_judge(actual, gold: np.ndarray, dtype, rtol: float, ratio: float, absolute: float) -> tuple[bool, str]:
    """The TTK rule (CANN's 'double thousandth' family, with the case's numbers): the golden is
    rounded to the output dtype (the TTK goldens return output-dtype arrays); an element is wrong
    when |a - g| > absolute_precision and |a - g| > rtol·|g|; the output passes when inf/NaN match
    position for position and at most ``ratio`` of the elements are wrong."""
    a = np.asarray(actual).astype(np.float64)
    g = round_to(gold, dtype) if dtype is not None else gold
    if a.shape != g.shape:
        return False, f"shape {a.shape} != golden {g.shape}"
    an, gn = np.isnan(a), np.isnan(g)
    special = int(
        np.count_nonzero((an != gn) | (np.isposinf(a) != np.isposinf(g)) | (np.isneginf(a) != np.isneginf(g)))
    )
    fin = np.isfinite(a) & np.isfinite(g)
    d = np.abs(a[fin] - g[fin])
    bad = int(np.count_nonzero((d > absolute) & (d > rtol * np.abs(g[fin]))))
    fails = []
    if special:
        fails.append(f"inf/NaN placement differs at {special} positions")
    if bad > ratio * a.size:
        fails.append(f"{bad}/{a.size} elements beyond (rtol {rtol:g}, absolute {absolute:g}); at most {ratio:g} may")
    return not fails, "; ".join(fails)


def judge(p: Prepared, actual: list, gold: list, reference: list | None = None) -> list[str]:
    """Every failure of a case (empty: the case passes)."""
    dts = output_dtypes(p)
    fails = []
    std = p.standard
    for i, g in enumerate(gold):
        if g is None:
            continue
        a = actual[i] if i < len(actual) else None
        if a is None:
            fails.append(f"output {i}: missing")
            continue
        a = np.asarray(a)
        if dts[i] is None:  # integer outputs: exact
            if a.shape != g.shape or not np.array_equal(a.astype(np.int64), np.asarray(g).astype(np.int64)):
                fails.append(f"output {i}: integers differ")
            continue
        if a.shape != g.shape:
            fails.append(f"output {i}: shape {a.shape} != {g.shape}")
            continue
        if a.size == 0:
            continue
        dt = dts[i]
        name = {np.dtype(np.float16): "float16", BF16: "bfloat16", np.dtype(np.float32): "float32"}[np.dtype(dt)]
        # every executor and golden returns its output in the output dtype (``.to(dtype)``): the
        # standards compare two values of that dtype
        g = round_to(np.asarray(g, np.float64), dt)
        if std["kind"] == "ttk":
            tol = std["tolerances"][i] if i < len(std["tolerances"]) else std["tolerances"][-1]
            ok, why = ttk_judge(a, g, dt, tol[0], tol[1], std["absolute"])
        elif std["kind"] == "double":
            from fastgrad.compare import compare

            r = compare(a, g, dtype=dt, standard="double", reference=reference[i])
            ok, why = r.passed, "; ".join(r.failures)
        else:
            th = (std.get("threshold") or {}).get(name)
            ok, why = single(a, g, dt, th)
        if not ok:
            fails.append(f"output {i} ({name}): {why}")
    return fails
