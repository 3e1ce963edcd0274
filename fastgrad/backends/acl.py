"""The ``"acl"`` backend: every public op on an Ascend NPU through the CANN ``aclnn`` C API.

Status: **verified against the ABI, not yet on hardware** — the tests run this module against
a fake CANN runtime (``tests/acl_fake/fake_acl.c``) that exports the same C symbols and
signatures and records every call (see ``docs/acl_backend.md``).

Each op follows the seed samples' sequence exactly::

    aclrtMalloc(HUGE_FIRST) + aclrtMemcpy(H2D) + aclCreateTensor   for every input and output
    aclnnXxxGetWorkspaceSize(..., &workspaceSize, &executor)
    aclrtMalloc(workspace)  (only when workspaceSize > 0)
    aclnnXxx(workspace, workspaceSize, executor, stream)
    aclrtSynchronizeStream(stream)
    aclrtMemcpy(D2H) into each output
    aclDestroyTensor + aclrtFree for everything                    (on every path, errors included)

A non-zero status from any call raises ``AclnnError`` with that status and the runtime's
``aclGetRecentErrMsg()``.  Device, context and stream are set up once per process (see
``acl_runtime``).

Layout choices:

* Inputs keep their real strides when they are a positive-stride view whose memory span is at
  most twice its element count (transposes, column slices): the span is copied once and the
  aclTensor gets the view's strides, with the span as its storage shape, so the device sees a
  non-contiguous tensor, as the aclnn docs allow.  Other views (negative or zero strides,
  sparse slices) are made contiguous on the host first.  C-contiguous arrays are described
  exactly as the samples do (contiguous strides, storage shape = view shape).
* Outputs are the C-contiguous arrays the op layer allocates; their current contents are
  copied to the device first (as the samples do), so what the device leaves untouched stays
  untouched.
* Empty tensors get no device memory (``tensorData = nullptr``).
* :class:`DeviceArray` operands (memory already on the device, e.g. torch_npu tensors through
  :func:`device_array_from_torch`) are passed without copies: their aclTensor is built on the
  device pointer with their own strides and offset, and outputs are written in place.
"""

from __future__ import annotations

import contextlib
import math
from ctypes import byref, c_int64, c_uint64, c_void_p
from dataclasses import dataclass

import numpy as np

from . import acl_runtime as _rt
from . import implements
from ..errors import AclnnError, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_RUNTIME_ERROR

BACKEND = "acl"

#: Reduction strings -> the aclnn integers (smooth_l1_loss_backward's int64 reduction).
REDUCTION_INT = {"none": 0, "mean": 1, "sum": 2}
_U64 = (1 << 64) - 1


def unavailable_reason() -> str | None:
    """None when the CANN runtime loads and a device is present, else why not (never raises)."""
    try:
        return _rt.probe()
    except Exception as e:  # pragma: no cover - probe() already never raises
        return f"probe failed: {e!r}"


# --- device-resident operands (zero-copy) ---------------------------------------------------
@dataclass(frozen=True)
class DeviceArray:
    """An operand already in device memory.

    ``ptr`` is the device address of the *storage* start; the view is ``shape``/``strides``
    (in elements) from element ``offset``; ``storage_elems`` is the storage's length in
    elements.  Only ``.shape``, ``.dtype``, ``.ndim`` and ``.size`` are NumPy-like.
    """

    ptr: int
    shape: tuple
    strides: tuple
    offset: int
    dtype: np.dtype
    storage_elems: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


_TORCH_TO_NUMPY = None


def device_array_from_torch(t) -> DeviceArray:
    """Describe a torch_npu tensor (``t.device.type == "npu"``) as a :class:`DeviceArray`.

    No data moves: the aclTensor is later built on ``t.untyped_storage().data_ptr()`` with
    ``t.stride()`` and ``t.storage_offset()``.
    """
    global _TORCH_TO_NUMPY
    import torch
    import ml_dtypes

    if _TORCH_TO_NUMPY is None:
        _TORCH_TO_NUMPY = {torch.float32: np.float32, torch.float16: np.float16,
                           torch.bfloat16: ml_dtypes.bfloat16, torch.float64: np.float64,
                           torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16,
                           torch.int32: np.int32, torch.int64: np.int64, torch.bool: np.bool_}
    if t.device.type != "npu":
        raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"expected an NPU tensor, got device {t.device}")
    st = t.untyped_storage()
    return DeviceArray(ptr=int(st.data_ptr()), shape=tuple(t.shape), strides=tuple(t.stride()),
                       offset=int(t.storage_offset()), dtype=np.dtype(_TORCH_TO_NUMPY[t.dtype]),
                       storage_elems=int(st.nbytes()) // t.element_size())


def torch_npu_available() -> bool:
    """True when ``torch_npu`` is importable (the zero-copy path can be used)."""
    import importlib.util

    return importlib.util.find_spec("torch_npu") is not None


# --- one op call ------------------------------------------------------------------------------
def _contiguous_strides(shape) -> list[int]:
    strides, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= int(shape[d])
    return strides


def strided_layout(a: np.ndarray):
    """How a host array goes to the device: ``(array_to_copy_from, strides, storage_shape)``.

    ``strides`` are in elements.  A positive-stride, at-most-2x-sparse view keeps its
    strides (the covering span is copied); anything else is copied contiguous.
    """
    if a.flags.c_contiguous:
        return a, _contiguous_strides(a.shape), list(a.shape)
    item = a.itemsize
    cont = _contiguous_strides(a.shape)
    strides, span = [], item
    for d, (n, s) in enumerate(zip(a.shape, a.strides)):
        if n == 1:
            strides.append(cont[d])       # irrelevant for a size-1 dim; keep it canonical
            continue
        if s <= 0 or s % item:
            c = np.ascontiguousarray(a)
            return c, cont, list(a.shape)
        strides.append(s // item)
        span += (n - 1) * s
    if span > 2 * a.nbytes:
        c = np.ascontiguousarray(a)
        return c, cont, list(a.shape)
    return a, strides, [span // item]


def _i64(values):
    values = [int(v) for v in values]
    return (c_int64 * len(values))(*values)


class Call:
    """Resources of one op call; :meth:`close` releases all of them (errors included)."""

    def __init__(self, rt: _rt.Runtime, op: str):
        self.rt, self.op = rt, op
        self.device_ptrs: list[int] = []      # aclrtMalloc'd, freed in close()
        self.tensors: list[int] = []          # aclCreateTensor'd, destroyed in close()
        self.copy_back: list[tuple] = []      # (host ndarray, device ptr, nbytes)
        self.executor: int | None = None
        self.executor_consumed = False
        self.workspace_size: int | None = None

    # device memory
    def malloc(self, nbytes: int) -> int:
        p = c_void_p()
        self.rt.check(self.rt.fn("aclrtMalloc")(byref(p), int(nbytes), _rt.ACL_MEM_MALLOC_HUGE_FIRST), "aclrtMalloc")
        self.device_ptrs.append(p.value)
        return p.value

    def _create(self, shape, dtype, strides, offset, storage, data) -> int:
        try:
            acl_dtype = _rt.ACL_DTYPE[np.dtype(dtype)]
        except KeyError:
            raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{self.op}: dtype {np.dtype(dtype)} has no aclDataType") from None
        t = self.rt.fn("aclCreateTensor")(_i64(shape), len(shape), acl_dtype, _i64(strides), int(offset),
                                          _rt.ACL_FORMAT_ND, _i64(storage), len(storage), data)
        if not t:
            msg = self.rt.recent_error()
            raise AclnnError(ACLNN_ERR_RUNTIME_ERROR, "aclCreateTensor returned nullptr" + (f": {msg}" if msg else ""),
                             "aclCreateTensor")
        self.tensors.append(t)
        return t

    def _device_tensor(self, a: DeviceArray) -> int:
        return self._create(a.shape, a.dtype, a.strides, a.offset, [a.storage_elems], a.ptr or None)

    def input(self, a) -> int | None:
        """aclTensor for an input (None -> nullptr)."""
        if a is None:
            return None
        if isinstance(a, DeviceArray):
            return self._device_tensor(a)
        a = np.asarray(a)
        if a.size == 0:
            return self._create(a.shape, a.dtype, _contiguous_strides(a.shape), 0, list(a.shape), None)
        src, strides, storage = strided_layout(a)
        nbytes = int(math.prod(storage)) * a.itemsize
        dev = self.malloc(nbytes)
        self.rt.check(self.rt.fn("aclrtMemcpy")(dev, nbytes, src.ctypes.data, nbytes, _rt.ACL_MEMCPY_HOST_TO_DEVICE),
                      "aclrtMemcpy")
        return self._create(a.shape, a.dtype, strides, 0, storage, dev)

    def output(self, a) -> int | None:
        """aclTensor for an output (None -> nullptr); copied back after the sync."""
        if a is None:
            return None
        if isinstance(a, DeviceArray):
            return self._device_tensor(a)
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or not a.flags.writeable:
            raise AclnnError(ACLNN_ERR_RUNTIME_ERROR, f"{self.op}: outputs must be writable C-contiguous arrays")
        if a.size == 0:
            return self._create(a.shape, a.dtype, _contiguous_strides(a.shape), 0, list(a.shape), None)
        nbytes = a.nbytes
        dev = self.malloc(nbytes)
        self.rt.check(self.rt.fn("aclrtMemcpy")(dev, nbytes, a.ctypes.data, nbytes, _rt.ACL_MEMCPY_HOST_TO_DEVICE),
                      "aclrtMemcpy")
        t = self._create(a.shape, a.dtype, _contiguous_strides(a.shape), 0, list(a.shape), dev)
        self.copy_back.append((a, dev, nbytes))
        return t

    def run(self, *args) -> None:
        """Both stages, the sync and the copies back. ``args``: the first-stage arguments."""
        rt = self.rt
        ws = c_uint64(0)
        executor = c_void_p()
        stage_one = f"{self.op}GetWorkspaceSize"
        rt.check(rt.fn(stage_one)(*args, byref(ws), byref(executor)), stage_one)
        self.executor = executor.value
        self.workspace_size = int(ws.value)
        workspace = self.malloc(self.workspace_size) if self.workspace_size > 0 else None
        self.executor_consumed = True  # stage two takes ownership, whatever it returns
        rt.check(rt.fn(self.op)(workspace, self.workspace_size, self.executor, rt.stream), self.op)
        rt.check(rt.fn("aclrtSynchronizeStream")(rt.stream), "aclrtSynchronizeStream")
        for host, dev, nbytes in self.copy_back:
            rt.check(rt.fn("aclrtMemcpy")(host.ctypes.data, nbytes, dev, nbytes, _rt.ACL_MEMCPY_DEVICE_TO_HOST),
                     "aclrtMemcpy")

    def close(self) -> list[str]:
        """Destroy every tensor, free every allocation; returns the failures (never raises)."""
        errors = []
        rt = self.rt
        if self.executor and not self.executor_consumed and rt.has("aclDestroyAclOpExecutor"):
            ret = rt.fn("aclDestroyAclOpExecutor")(self.executor)
            if ret:
                errors.append(f"aclDestroyAclOpExecutor returned {ret}")
        for t in reversed(self.tensors):
            ret = rt.fn("aclDestroyTensor")(t)
            if ret:
                errors.append(f"aclDestroyTensor returned {ret}")
        for p in reversed(self.device_ptrs):
            ret = rt.fn("aclrtFree")(p)
            if ret:
                errors.append(f"aclrtFree returned {ret}")
        self.tensors.clear()
        self.device_ptrs.clear()
        return errors


@contextlib.contextmanager
def op_call(op: str):
    """Context manager for one aclnn op: the runtime set up, a :class:`Call`, cleanup always.

    Calls are serialized by the runtime's lock (one stream per process).
    """
    rt = _rt.runtime()
    with rt.lock:
        rt.ensure_device()
        call = Call(rt, op)
        failed = False
        try:
            yield call
        except BaseException:
            failed = True
            raise
        finally:
            errors = call.close()
            if errors and not failed:
                raise AclnnError(ACLNN_ERR_RUNTIME_ERROR, f"{op}: releasing device resources failed: "
                                 + "; ".join(errors))


# --- the seven ops (same keyword signatures as the "cpu" backend) -----------------------------
@implements(BACKEND, "fused_linear_online_max_sum")
def fused_linear_online_max_sum(*, input, weight, target, vocab_start_index, vocab_end_index,
                                return_logits=False, out):
    """aclnnFusedLinearOnlineMaxSum. ``out`` = (logits_max_local, sum_exp_logits_local,
    predicted_logits_local, target_mask, masked_target, vocab_parallel_logits or None)."""
    lmax, sumexp, pred, mask, masked, logits = out
    with op_call("aclnnFusedLinearOnlineMaxSum") as c:
        c.run(c.input(input), c.input(weight), c.input(target), int(vocab_start_index), int(vocab_end_index),
              c.output(lmax), c.output(sumexp), c.output(pred), c.output(mask), c.output(masked),
              c.output(logits))


@implements(BACKEND, "fused_cross_entropy_loss_with_max_sum")
def fused_cross_entropy_loss_with_max_sum(*, logits_max, sum_exp_logits, predicted_logits,
                                          label_smoothing=0.0, vocab_parallel_logits=None, out):
    """aclnnFusedCrossEntropyLossWithMaxSum (inputOptional/weightOptional = nullptr).
    ``out`` = (loss, softmax or None).

    Backend contract (as the "cpu" backend): the *unsmoothed* loss and the softmax; the op
    layer applies label smoothing (a fastgrad extension) afterwards from the softmax.  So
    ``labelSmoothing`` is passed to the device as 0.0, the only value it accepts (strict mode
    rejects label_smoothing != 0 in the op layer, as the device would).
    """
    loss, softmax = out
    with op_call("aclnnFusedCrossEntropyLossWithMaxSum") as c:
        c.run(c.input(logits_max), c.input(sum_exp_logits), c.input(predicted_logits), 0.0,
              None, None, c.input(vocab_parallel_logits), c.output(loss), c.output(softmax))


@implements(BACKEND, "fused_linear_cross_entropy_loss_grad")
def fused_linear_cross_entropy_loss_grad(*, grad, input, weight, target_mask, masked_target,
                                         label_smoothing=0.0, logits_max=None, sum_exp_logits=None,
                                         softmax=None, out):
    """aclnnFusedLinearCrossEntropyLossGrad. ``out`` = (grad_input, grad_weight).

    The device overwrites ``softmaxOptional``; host inputs are copied, so the caller's softmax
    is unchanged.  (A :class:`DeviceArray` softmax *is* overwritten: clone it first.)
    """
    grad_input, grad_weight = out
    with op_call("aclnnFusedLinearCrossEntropyLossGrad") as c:
        c.run(c.input(grad), c.input(input), c.input(weight), c.input(target_mask), c.input(masked_target),
              float(label_smoothing), c.input(logits_max), c.input(sum_exp_logits), c.input(softmax),
              c.output(grad_input), c.output(grad_weight))


@implements(BACKEND, "cross_entropy_loss_grad")
def cross_entropy_loss_grad(*, grad_loss, log_prob, target, weight=None, reduction="mean",
                            ignore_index=-100, label_smoothing=0.0, grad_zloss=None, lse_for_zloss=None,
                            lse_square_scale_for_zloss=0.0, out):
    """aclnnCrossEntropyLossGrad (reduction passed as the C string "none"/"mean"/"sum")."""
    red = reduction if isinstance(reduction, str) else {v: k for k, v in REDUCTION_INT.items()}[int(reduction)]
    with op_call("aclnnCrossEntropyLossGrad") as c:
        c.run(c.input(grad_loss), c.input(log_prob), c.input(target), c.input(weight), c.input(grad_zloss),
              c.input(lse_for_zloss), red.encode("ascii"), int(ignore_index), float(label_smoothing),
              float(lse_square_scale_for_zloss), c.output(out))


@implements(BACKEND, "scaled_masked_softmax_backward")
def scaled_masked_softmax_backward(*, grad_output, y, mask=None, scale=1.0, fix_triu_mask=False, out):
    """aclnnScaledMaskedSoftmaxBackward (scale as C double, fixTriuMask as C bool)."""
    with op_call("aclnnScaledMaskedSoftmaxBackward") as c:
        c.run(c.input(grad_output), c.input(y), c.input(mask), float(scale), bool(fix_triu_mask), c.output(out))


@implements(BACKEND, "smooth_l1_loss_backward")
def smooth_l1_loss_backward(*, grad_out, input, target, reduction="mean", beta=1.0, out):
    """aclnnSmoothL1LossBackward (reduction as int64: none=0, mean=1, sum=2; beta as C float)."""
    red = REDUCTION_INT[reduction] if isinstance(reduction, str) else int(reduction)
    with op_call("aclnnSmoothL1LossBackward") as c:
        c.run(c.input(grad_out), c.input(input), c.input(target), red, float(beta), c.output(out))


@implements(BACKEND, "embedding_dense_backward")
def embedding_dense_backward(*, grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False, out):
    """aclnnEmbeddingDenseBackward (numWeights, paddingIdx as uint64: a negative padding_idx is
    passed as its two's complement, which the device reads as "no padding row")."""
    with op_call("aclnnEmbeddingDenseBackward") as c:
        c.run(c.input(grad), c.input(indices), int(num_weights) & _U64, int(padding_idx) & _U64,
              bool(scale_grad_by_freq), c.output(out))
