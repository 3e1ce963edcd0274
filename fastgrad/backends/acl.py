"""The ``"acl"`` backend: every public op on an Ascend NPU through the CANN ``aclnn`` C API.

Status: **verified against the ABI, not yet on hardware** — the tests run this module against
a fake CANN runtime (``tests/acl_fake/fake_acl.c``) that exports the same C symbols and
signatures and records every call (see ``docs/acl_backend.md``).

Each op follows the sequence of the aclnn docs' sample programs exactly::

    aclrtMalloc(HUGE_FIRST) + aclrtMemcpy(H2D) + aclCreateTensor   for every input and output
    aclnnXxxGetWorkspaceSize(..., &workspaceSize, &executor)
    aclrtMalloc(workspace)  (only when workspaceSize > 0)
    aclnnXxx(workspace, workspaceSize, executor, stream)
    aclrtSynchronizeStream(stream)
    aclrtMemcpy(D2H) into each output
    aclDestroyTensor + aclrtFree for everything                    (on every path, errors included;
                                                                    after a stream sync when stage
                                                                    two was reached)

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
from collections.abc import Iterator
from ctypes import byref, c_int64, c_uint64, c_void_p
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, cast

import numpy as np
import numpy.typing as npt

from ..errors import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_RUNTIME_ERROR, AclnnError
from . import acl_runtime as _rt

if TYPE_CHECKING:
    import torch

BACKEND = "acl"

#: Reduction strings -> the aclnn integers (smooth_l1_loss_backward's int64 reduction).
from ..enums import REDUCTION_CODES as REDUCTION_INT  # noqa: E402

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
    #: the device the memory lives on (checked against the one fastgrad opened), None = unknown
    device_index: int | None = None
    #: the stream that produced the data (torch_npu's current stream): synchronised before use
    stream: int | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


#: One tensor of an op (the op layer's adapted operands): a host array (copied to the device,
#: outputs copied back) or memory already on the device (used in place).
Operand: TypeAlias = "np.ndarray | DeviceArray"

_TORCH_TO_NUMPY = None


def device_array_from_torch(t: torch.Tensor) -> DeviceArray:
    """Describe a torch_npu tensor (``t.device.type == "npu"``) as a :class:`DeviceArray`.

    No data moves: the aclTensor is later built on ``t.untyped_storage().data_ptr()`` with
    ``t.stride()`` and ``t.storage_offset()``.  The tensor's device index and torch_npu's
    current stream on that device are recorded: the backend refuses a tensor on another device
    than the one it opened, and synchronises that stream before its own op reads the memory.
    A tensor in a private format (FRACTAL_NZ, NC1HWC0, ...: ``torch_npu.get_npu_format``) is
    refused (161002), as its memory is not the row-major view its shape and strides describe.
    """
    global _TORCH_TO_NUMPY
    import ml_dtypes
    import torch

    if _TORCH_TO_NUMPY is None:
        _TORCH_TO_NUMPY = {
            torch.float32: np.float32,
            torch.float16: np.float16,
            torch.bfloat16: ml_dtypes.bfloat16,
            torch.float64: np.float64,
            torch.int8: np.int8,
            torch.uint8: np.uint8,
            torch.int16: np.int16,
            torch.int32: np.int32,
            torch.int64: np.int64,
            torch.bool: np.bool_,
        }
    if t.device.type != "npu":
        raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"expected an NPU tensor, got device {t.device}")
    import torch_npu

    fmt = getattr(torch_npu, "get_npu_format", None)
    if fmt is not None:
        f = int(fmt(t))
        if f not in _rt.BASE_FORMATS:
            raise AclnnError(
                ACLNN_ERR_PARAM_INVALID,
                f"an NPU tensor in the private format {f} (acl_base.h aclFormat; e.g. 29 = "
                "FRACTAL_NZ) cannot be passed as ND: convert it first with "
                "torch_npu.npu_format_cast(t, 2)",
            )
    index = t.device.index
    stream = None
    npu = getattr(torch_npu, "npu", None)
    if npu is not None and hasattr(npu, "current_stream"):
        s = npu.current_stream(t.device)
        raw = getattr(s, "npu_stream", None)
        stream = int(raw) if raw is not None else None
    st = t.untyped_storage()
    return DeviceArray(
        ptr=int(st.data_ptr()),
        shape=tuple(t.shape),
        strides=tuple(t.stride()),
        offset=int(t.storage_offset()),
        dtype=np.dtype(_TORCH_TO_NUMPY[t.dtype]),
        storage_elems=int(st.nbytes()) // t.element_size(),
        device_index=None if index is None else int(index),
        stream=stream,
    )


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


def strided_layout(a: np.ndarray) -> tuple[np.ndarray, list[int], list[int]]:
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
            strides.append(cont[d])  # irrelevant for a size-1 dim; keep it canonical
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
        self.device_ptrs: list[int] = []  # aclrtMalloc'd, freed in close()
        self.tensors: list[int] = []  # aclCreateTensor'd, destroyed in close()
        self.copy_back: list[tuple] = []  # (host ndarray, device ptr, nbytes)
        self.executor: int | None = None
        self.executor_consumed = False
        self.workspace_size: int | None = None
        self.stage_one_done = False  # the first call succeeded: later failures are the "run" phase
        self.launched = False  # stage two was called: work may be on the stream
        self.synced = False  # ... and the stream was synchronised since
        self.foreign_streams: list[int] = []  # producers' streams (torch_npu), synced before launch

    def check(self, ret: int, what: str, name: str | None = None) -> None:
        """``Runtime.check`` for this op: the message starts with the aclnn API (and names the
        operand, when there is one); anything after a successful first call is the ``"run"`` phase
        (the workspace allocation, the launch, the synchronisation that reports the launch's
        asynchronous errors, the copies back)."""
        self.rt.check(ret, what, op=self.op, phase="run" if self.stage_one_done else None, param=name)

    # device memory
    def malloc(self, nbytes: int, name: str) -> int:
        p = c_void_p()
        ret = self.rt.fn("aclrtMalloc")(byref(p), int(nbytes), _rt.ACL_MEM_MALLOC_HUGE_FIRST)
        self.check(ret, f"aclrtMalloc ({name}, {int(nbytes)} bytes)", name)
        ptr = int(p.value or 0)
        self.device_ptrs.append(ptr)
        return ptr

    def _acl_dtype(self, dtype, name: str) -> int:
        try:
            return _rt.ACL_DTYPE[np.dtype(dtype)]
        except KeyError:
            raise AclnnError(
                ACLNN_ERR_PARAM_INVALID, f"{self.op}: {name}: dtype {np.dtype(dtype)} has no aclDataType", name
            ) from None

    def _create(self, shape, acl_dtype: int, strides, offset, storage, data, name: str) -> int:
        t = self.rt.fn("aclCreateTensor")(
            _i64(shape),
            len(shape),
            acl_dtype,
            _i64(strides),
            int(offset),
            _rt.ACL_FORMAT_ND,
            _i64(storage),
            len(storage),
            data,
        )
        if not t:
            msg = self.rt.recent_error()
            raise AclnnError(
                ACLNN_ERR_RUNTIME_ERROR,
                f"{self.op}: aclCreateTensor ({name}) returned nullptr" + (f": {msg}" if msg else ""),
                name,
            )
        self.tensors.append(t)
        return t

    def _device_tensor(self, a: DeviceArray, name: str) -> int:
        if a.device_index is not None and self.rt.device is not None and int(a.device_index) != int(self.rt.device):
            raise AclnnError(
                ACLNN_ERR_PARAM_INVALID,
                f"{self.op}: {name} is on NPU {a.device_index} but the acl backend opened "
                f"device {self.rt.device} (set {_rt.ENV_DEVICE}={a.device_index})",
                name,
            )
        if a.stream and a.stream != self.rt.stream and a.stream not in self.foreign_streams:
            self.foreign_streams.append(a.stream)
        acl = self._acl_dtype(a.dtype, name)
        return self._create(a.shape, acl, a.strides, a.offset, [a.storage_elems], a.ptr or None, name)

    def _h2d(self, dev: int, src: np.ndarray, nbytes: int, name: str) -> None:
        ret = self.rt.fn("aclrtMemcpy")(dev, nbytes, src.ctypes.data, nbytes, _rt.ACL_MEMCPY_HOST_TO_DEVICE)
        self.check(ret, f"aclrtMemcpy ({name}, host to device, {nbytes} bytes)", name)

    def input(self, a: npt.ArrayLike | DeviceArray | None, name: str) -> int | None:
        """aclTensor for the input ``name`` (the aclnn parameter; None -> nullptr)."""
        if a is None:
            return None
        if isinstance(a, DeviceArray):
            return self._device_tensor(a, name)
        a = np.asarray(a)
        acl = self._acl_dtype(a.dtype, name)  # refused before any device memory is taken
        if a.size == 0:
            return self._create(a.shape, acl, _contiguous_strides(a.shape), 0, list(a.shape), None, name)
        src, strides, storage = strided_layout(a)
        nbytes = int(math.prod(storage)) * a.itemsize
        dev = self.malloc(nbytes, name)
        self._h2d(dev, src, nbytes, name)
        return self._create(a.shape, acl, strides, 0, storage, dev, name)

    def output(self, a: Operand | None, name: str) -> int | None:
        """aclTensor for the output ``name`` (None -> nullptr); copied back after the sync."""
        if a is None:
            return None
        if isinstance(a, DeviceArray):
            return self._device_tensor(a, name)
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or not a.flags.writeable:
            raise AclnnError(
                ACLNN_ERR_RUNTIME_ERROR, f"{self.op}: {name}: outputs must be writable C-contiguous arrays", name
            )
        acl = self._acl_dtype(a.dtype, name)
        if a.size == 0:
            return self._create(a.shape, acl, _contiguous_strides(a.shape), 0, list(a.shape), None, name)
        nbytes = a.nbytes
        dev = self.malloc(nbytes, name)
        self._h2d(dev, a, nbytes, name)
        t = self._create(a.shape, acl, _contiguous_strides(a.shape), 0, list(a.shape), dev, name)
        self.copy_back.append((a, dev, nbytes, name))
        return t

    def run(self, *args: int | float | bytes | None) -> None:
        """Both stages, the sync and the copies back. ``args``: the first-stage arguments."""
        rt = self.rt
        ws = c_uint64(0)
        executor = c_void_p()
        stage_one = f"{self.op}GetWorkspaceSize"
        for s in self.foreign_streams:  # the producers' pending writes (torch_npu) land first
            self.check(rt.fn("aclrtSynchronizeStream")(s), "aclrtSynchronizeStream (a producer's stream)")
        self.check(rt.fn(stage_one)(*args, byref(ws), byref(executor)), stage_one)
        self.executor = executor.value
        self.workspace_size = int(ws.value)
        self.stage_one_done = True
        workspace = self.malloc(self.workspace_size, "workspace") if self.workspace_size > 0 else None
        self.executor_consumed = True  # stage two takes ownership, whatever it returns
        self.launched = True  # ... and may have queued work, whatever it returns
        self.check(rt.fn(self.op)(workspace, self.workspace_size, self.executor, rt.stream), self.op)
        self.check(rt.fn("aclrtSynchronizeStream")(rt.stream), "aclrtSynchronizeStream")
        self.synced = True
        # A failed copy must leave every output as it was: all but the largest are copied into
        # scratch, the largest straight into its array, last; the scratch is committed after.
        backs = sorted(self.copy_back, key=lambda b: b[2])
        staged = []
        for k, (host, dev, nbytes, name) in enumerate(backs):
            dst = host if k == len(backs) - 1 else np.empty_like(host)
            ret = rt.fn("aclrtMemcpy")(dst.ctypes.data, nbytes, dev, nbytes, _rt.ACL_MEMCPY_DEVICE_TO_HOST)
            self.check(ret, f"aclrtMemcpy ({name}, device to host, {nbytes} bytes)", name)
            if dst is not host:
                staged.append((host, dst))
        for host, dst in staged:
            np.copyto(host, dst)

    def close(self) -> list[str]:
        """Destroy every tensor, free every allocation; returns the failures.

        Raises only an interrupt (``KeyboardInterrupt``: Ctrl-C while a synchronisation waits),
        after every resource was released: each release step runs whatever the others did."""
        errors: list[str] = []
        interrupt: BaseException | None = None
        rt = self.rt
        if self.launched and not self.synced:
            # acl_rt.h: memory a queued task may still use must not be freed before the stream
            # is synchronised -- so on an error path after the launch, synchronise first (again,
            # when an interrupt may have come before the call: the sync itself cannot be cut short)
            while True:
                try:
                    ret = rt.sync()
                    break
                except BaseException as e:
                    interrupt = interrupt or e
            self.synced = True
            if ret:
                errors.append(f"aclrtSynchronizeStream (before freeing) returned {ret}")
        steps: list[tuple[str, object]] = []
        if self.executor and not self.executor_consumed and rt.has("aclDestroyAclOpExecutor"):
            steps.append(("aclDestroyAclOpExecutor", self.executor))
        steps += [("aclDestroyTensor", t) for t in reversed(self.tensors)]
        steps += [("aclrtFree", p) for p in reversed(self.device_ptrs)]
        self.tensors.clear()
        self.device_ptrs.clear()
        for fn, handle in steps:
            try:
                ret = rt.fn(fn)(handle)
            except BaseException as e:  # an interrupt: release the rest first
                interrupt = interrupt or e
                continue
            if ret:
                errors.append(f"{fn} returned {ret}")
        if interrupt is not None:
            raise interrupt
        return errors


@contextlib.contextmanager
def op_call(op: str) -> Iterator[Call]:
    """Context manager for one aclnn op: the runtime set up, a :class:`Call`, cleanup always.

    Calls are serialized by the runtime's lock (one stream per process).
    """
    rt = _rt.runtime()
    with rt.lock:
        # both calls of the API first: an op library without them (an older CANN) is refused before
        # any device memory, and never after stage one made an executor that nothing would free
        rt.fn(op + "GetWorkspaceSize")
        rt.fn(op)
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
                raise AclnnError(
                    ACLNN_ERR_RUNTIME_ERROR, f"{op}: releasing device resources failed: " + "; ".join(errors)
                )


# --- the seven ops (same keyword signatures as the "cpu" backend) -----------------------------
def fused_linear_online_max_sum(
    *,
    input: Operand,
    weight: Operand,
    target: Operand,
    vocab_start_index: int,
    vocab_end_index: int,
    return_logits: bool = False,
    logits_dtype: npt.DTypeLike | None = None,
    out: tuple[Operand, Operand, Operand, Operand, Operand, Operand | None],
) -> None:
    """aclnnFusedLinearOnlineMaxSum. ``out`` = (logits_max_local, sum_exp_logits_local,
    predicted_logits_local, target_mask, masked_target, vocab_parallel_logits or None).

    The device has no choice of logits precision: its matmul writes the logits in the input
    dtype and the vector unit reads them back from there (op_kernel/fused_linear_online_max_sum.cpp:
    38,41 instantiate ``mmT = DTYPE_INPUT``; fused_linear_online_max_sum.h:753-757 casts the mmT
    logits to fp32).  ``logits_dtype=float32`` (fp32 statistics) is a CPU extension: 161002 here.
    """
    if logits_dtype is not None and np.dtype(logits_dtype) != np.dtype(input.dtype):
        raise AclnnError(
            ACLNN_ERR_PARAM_INVALID,
            f"fused_linear_online_max_sum: logits_dtype={np.dtype(logits_dtype).name} is not "
            f"available on the device, whose logits are the input dtype ({np.dtype(input.dtype).name}); "
            "use the cpu backend for fp32 statistics",
        )
    lmax, sumexp, pred, mask, masked, logits = out
    with op_call("aclnnFusedLinearOnlineMaxSum") as c:
        c.run(
            c.input(input, "input"),
            c.input(weight, "weight"),
            c.input(target, "target"),
            int(vocab_start_index),
            int(vocab_end_index),
            c.output(lmax, "logitsMaxLocalOut"),
            c.output(sumexp, "sumExpLogitsLocalOut"),
            c.output(pred, "predictedLogitsLocalOut"),
            c.output(mask, "targetMaskOut"),
            c.output(masked, "maskedTargetOut"),
            c.output(logits, "vocabParallelLogitsOutOptional"),
        )


def fused_cross_entropy_loss_with_max_sum(
    *,
    logits_max: Operand,
    sum_exp_logits: Operand,
    predicted_logits: Operand,
    label_smoothing: float = 0.0,
    vocab_parallel_logits: Operand | None = None,
    out: tuple[Operand, Operand | None],
) -> None:
    """aclnnFusedCrossEntropyLossWithMaxSum (inputOptional/weightOptional = nullptr).
    ``out`` = (loss, softmax or None).

    The device accepts only ``labelSmoothing = 0`` (its first stage rejects anything else), so
    it always receives 0.0; label smoothing (a fastgrad extension, rejected in strict mode by the
    op layer as the device would) is applied afterwards on the host from the device's softmax,
    with the same formula as the "cpu" backend (``fastgrad.vocab_parallel.smoothed_loss``) —
    so a non-zero ``label_smoothing`` needs host outputs: with a device-resident ``loss`` or
    ``softmax`` (:class:`DeviceArray`, a torch_npu tensor) it raises ``AclnnError`` 161002
    (``ACLNN_ERR_PARAM_INVALID``) before anything runs, instead of returning the unsmoothed loss.
    """
    loss, softmax = out
    if label_smoothing != 0.0 and not (isinstance(loss, np.ndarray) and isinstance(softmax, np.ndarray)):
        where = "loss" if not isinstance(loss, np.ndarray) else "softmax"
        raise AclnnError(
            ACLNN_ERR_PARAM_INVALID,
            f"label_smoothing={label_smoothing}: the ascend backend smooths the loss on the host from the "
            f"device's softmax, so out must be host (NumPy) arrays; got {where} as "
            f"{'no output' if (where == 'softmax' and softmax is None) else 'device memory'}",
        )
    with op_call("aclnnFusedCrossEntropyLossWithMaxSum") as c:
        c.run(
            c.input(logits_max, "logitsMax"),
            c.input(sum_exp_logits, "sumExpLogits"),
            c.input(predicted_logits, "predictedLogits"),
            0.0,
            None,
            None,
            c.input(vocab_parallel_logits, "vocabParallelLogitsOptional"),
            c.output(loss, "lossOut"),
            c.output(softmax, "softMaxOutOptional"),
        )
    if label_smoothing != 0.0:
        from ..vocab_parallel import smoothed_loss

        host_loss = cast("np.ndarray", loss)  # both host arrays (device outputs refused above)
        host_loss[...] = smoothed_loss(host_loss, cast("np.ndarray", softmax), label_smoothing)


def fused_linear_cross_entropy_loss_grad(
    *,
    grad: Operand,
    input: Operand,
    weight: Operand,
    target_mask: Operand,
    masked_target: Operand,
    label_smoothing: float = 0.0,
    logits_max: Operand | None = None,
    sum_exp_logits: Operand | None = None,
    softmax: Operand | None = None,
    out: tuple[Operand | None, Operand | None],
) -> None:
    """aclnnFusedLinearCrossEntropyLossGrad. ``out`` = (grad_input, grad_weight).

    The device overwrites ``softmaxOptional``; host inputs are copied, so the caller's softmax
    is unchanged.  (A :class:`DeviceArray` softmax *is* overwritten: clone it first.)
    """
    grad_input, grad_weight = out
    with op_call("aclnnFusedLinearCrossEntropyLossGrad") as c:
        c.run(
            c.input(grad, "grad"),
            c.input(input, "input"),
            c.input(weight, "weight"),
            c.input(target_mask, "targetMask"),
            c.input(masked_target, "maskedTarget"),
            float(label_smoothing),
            c.input(logits_max, "logitsMaxOptional"),
            c.input(sum_exp_logits, "sumExpLogitsOptional"),
            c.input(softmax, "softmaxOptional"),
            c.output(grad_input, "inputGradOut"),
            c.output(grad_weight, "weightGradOut"),
        )


def cross_entropy_loss_grad(
    *,
    grad_loss: Operand,
    log_prob: Operand,
    target: Operand,
    weight: Operand | None = None,
    reduction: str | int = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    grad_zloss: Operand | None = None,
    lse_for_zloss: Operand | None = None,
    lse_square_scale_for_zloss: float = 0.0,
    out: Operand,
    ignore_any_sign: bool = True,
    smooth_arch35: bool = False,
) -> None:
    """aclnnCrossEntropyLossGrad (reduction passed as the C string "none"/"mean"/"sum").

    ``ignore_any_sign`` (the CPU kernels' SoC rule) is not passed: the device applies its own."""
    red = reduction if isinstance(reduction, str) else {v: k for k, v in REDUCTION_INT.items()}[int(reduction)]
    with op_call("aclnnCrossEntropyLossGrad") as c:
        c.run(
            c.input(grad_loss, "gradLoss"),
            c.input(log_prob, "logProb"),
            c.input(target, "target"),
            c.input(weight, "weightOptional"),
            c.input(grad_zloss, "gradZlossOptional"),
            c.input(lse_for_zloss, "lseForZlossOptional"),
            red.encode("ascii"),
            int(ignore_index),
            float(label_smoothing),
            float(lse_square_scale_for_zloss),
            c.output(out, "out"),
        )


def scaled_masked_softmax_backward(
    *,
    grad_output: Operand,
    y: Operand,
    mask: Operand | None = None,
    scale: float = 1.0,
    fix_triu_mask: bool = False,
    out: Operand,
) -> None:
    """aclnnScaledMaskedSoftmaxBackward (scale as C double, fixTriuMask as C bool)."""
    with op_call("aclnnScaledMaskedSoftmaxBackward") as c:
        c.run(
            c.input(grad_output, "gradOutput"),
            c.input(y, "y"),
            c.input(mask, "mask"),
            float(scale),
            bool(fix_triu_mask),
            c.output(out, "out"),
        )


def smooth_l1_loss_backward(
    *,
    grad_out: Operand,
    input: Operand,
    target: Operand,
    reduction: str | int = "mean",
    beta: float = 1.0,
    out: Operand,
    smooth_l1_kernel: str = "tbe",
) -> None:
    """aclnnSmoothL1LossBackward (reduction as int64: none=0, mean=1, sum=2; beta as C float).

    ``smooth_l1_kernel`` (the CPU kernels' SoC choice) is not passed: the device runs its own."""
    red = REDUCTION_INT[reduction] if isinstance(reduction, str) else int(reduction)
    with op_call("aclnnSmoothL1LossBackward") as c:
        c.run(
            c.input(grad_out, "gradOut"),
            c.input(input, "self"),
            c.input(target, "target"),
            red,
            float(beta),
            c.output(out, "gradInput"),
        )


def embedding_dense_backward(
    *,
    grad: Operand,
    indices: Operand,
    num_weights: int,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    out: Operand,
    result_dtype: npt.DTypeLike | None = None,
    deterministic_cores: int = 0,
) -> None:
    """aclnnEmbeddingDenseBackward (numWeights, paddingIdx as uint64: a negative padding_idx is
    passed as its two's complement, which the device reads as "no padding row").
    ``result_dtype`` and ``deterministic_cores`` are the CPU kernel's: the device decides them
    itself (its deterministic mode is the context's ``ACL_OPT_DETERMINISTIC``)."""
    with op_call("aclnnEmbeddingDenseBackward") as c:
        c.run(
            c.input(grad, "grad"),
            c.input(indices, "indices"),
            int(num_weights) & _U64,
            int(padding_idx) & _U64,
            bool(scale_grad_by_freq),
            c.output(out, "out"),
        )


#: The backend's implementation table (pulled by the registry; see backends/__init__.py).
TAKES_PLAN = False
IMPLS = {
    "fused_linear_online_max_sum": fused_linear_online_max_sum,
    "fused_cross_entropy_loss_with_max_sum": fused_cross_entropy_loss_with_max_sum,
    "fused_linear_cross_entropy_loss_grad": fused_linear_cross_entropy_loss_grad,
    "cross_entropy_loss_grad": cross_entropy_loss_grad,
    "scaled_masked_softmax_backward": scaled_masked_softmax_backward,
    "smooth_l1_loss_backward": smooth_l1_loss_backward,
    "embedding_dense_backward": embedding_dense_backward,
}
