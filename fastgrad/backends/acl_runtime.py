"""The CANN runtime through ``ctypes``: discovery, prototypes, device set-up, one op call.

This module knows the C ABI and nothing about fastgrad's ops (those are in ``acl.py``).

Discovery (first hit wins, per library):

1. ``FASTGRAD_ACL_LIB_DIR`` — when set, the *only* place looked at (the tests point it at a
   fake runtime; a user can point it at a custom toolkit);
2. ``$ASCEND_HOME_PATH/lib64``, ``$ASCEND_TOOLKIT_HOME/lib64``,
   ``/usr/local/Ascend/ascend-toolkit/latest/lib64``, then every ``LD_LIBRARY_PATH`` entry;
3. the dynamic loader's own search (``dlopen("libascendcl.so")``: ld.so.cache, rpath).

``libascendcl.so`` (aclInit, aclrt*) and ``libopapi.so`` (the aclnn ops) are required;
``libnnopbase.so`` (aclCreateTensor, aclDestroyTensor) is loaded when present (otherwise the
symbols are taken from whichever loaded library exports them, as libopapi links it), and
so are the per-domain op libraries newer toolkits ship (``libopapi_nn.so``, ...).  Every
library is opened ``RTLD_GLOBAL``; a symbol is looked up in each library in load order.

Device set-up happens once per process, lazily and under a lock: ``aclInit`` (at the first
probe; ``ACL_ERROR_REPEAT_INITIALIZE`` is accepted when someone — torch_npu — initialised
first, and then fastgrad leaves ``aclFinalize`` to them), ``aclrtSetDevice``
(``FASTGRAD_ACL_DEVICE``, default 0), ``aclrtCreateStream``, ``aclrtGetCurrentContext``.  Other
threads bind that context with ``aclrtSetCurrentContext`` on first use.  ``atexit`` destroys the
stream, resets the device and finalizes.  Op calls are serialized by a process-wide lock.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
from ctypes import (POINTER, byref, c_bool, c_char_p, c_double, c_float, c_int, c_int32, c_int64,
                    c_size_t, c_uint32, c_uint64, c_void_p)

import ml_dtypes
import numpy as np

from ..errors import AclnnError, ACLNN_ERR_RUNTIME_ERROR

ENV_LIB_DIR = "FASTGRAD_ACL_LIB_DIR"
ENV_DEVICE = "FASTGRAD_ACL_DEVICE"
DEFAULT_TOOLKIT_LIB = "/usr/local/Ascend/ascend-toolkit/latest/lib64"

REQUIRED_LIBS = ("libascendcl.so", "libopapi.so")
OPTIONAL_LIBS = ("libnnopbase.so", "libopapi_nn.so", "libopapi_math.so",
                 "libaclnn_ops_train.so", "libaclnn_ops_infer.so", "libaclnn_math.so")
LOAD_ORDER = ("libascendcl.so", "libnnopbase.so", "libopapi.so") + OPTIONAL_LIBS[1:]

# --- enums (acl/acl_base.h, acl/acl_rt.h) -------------------------------------------------
ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_FORMAT_ND = 2
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2

#: aclDataType of each NumPy dtype the ops take (acl_base.h values).
ACL_DTYPE = {
    np.dtype(np.float32): 0,         # ACL_FLOAT
    np.dtype(np.float16): 1,         # ACL_FLOAT16
    np.dtype(np.int8): 2,            # ACL_INT8
    np.dtype(np.int32): 3,           # ACL_INT32
    np.dtype(np.uint8): 4,           # ACL_UINT8
    np.dtype(np.int16): 6,           # ACL_INT16
    np.dtype(np.uint16): 7,          # ACL_UINT16
    np.dtype(np.uint32): 8,          # ACL_UINT32
    np.dtype(np.int64): 9,           # ACL_INT64
    np.dtype(np.uint64): 10,         # ACL_UINT64
    np.dtype(np.float64): 11,        # ACL_DOUBLE
    np.dtype(np.bool_): 12,          # ACL_BOOL
    np.dtype(ml_dtypes.bfloat16): 27,  # ACL_BF16
}

# --- runtime prototypes: name -> (restype, argtypes) ---------------------------------------
_P = c_void_p
RUNTIME_PROTOS = {
    "aclInit": (c_int, [c_char_p]),
    "aclFinalize": (c_int, []),
    "aclGetRecentErrMsg": (c_char_p, []),
    "aclrtGetDeviceCount": (c_int, [POINTER(c_uint32)]),
    "aclrtSetDevice": (c_int, [c_int32]),
    "aclrtResetDevice": (c_int, [c_int32]),
    "aclrtGetCurrentContext": (c_int, [POINTER(c_void_p)]),
    "aclrtSetCurrentContext": (c_int, [c_void_p]),
    "aclrtCreateStream": (c_int, [POINTER(c_void_p)]),
    "aclrtDestroyStream": (c_int, [c_void_p]),
    "aclrtSynchronizeStream": (c_int, [c_void_p]),
    "aclrtMalloc": (c_int, [POINTER(c_void_p), c_size_t, c_int]),
    "aclrtFree": (c_int, [c_void_p]),
    "aclrtMemcpy": (c_int, [c_void_p, c_size_t, c_void_p, c_size_t, c_int]),
    # aclnn/acl_meta.h (libnnopbase)
    "aclCreateTensor": (c_void_p, [POINTER(c_int64), c_uint64, c_int, POINTER(c_int64), c_int64, c_int,
                                   POINTER(c_int64), c_uint64, c_void_p]),
    "aclDestroyTensor": (c_int, [c_void_p]),
    "aclDestroyAclOpExecutor": (c_int, [c_void_p]),
}
#: Symbols without which the backend cannot run at all.
REQUIRED_SYMBOLS = ("aclInit", "aclrtGetDeviceCount", "aclrtSetDevice", "aclrtCreateStream",
                    "aclrtSynchronizeStream", "aclrtMalloc", "aclrtFree", "aclrtMemcpy",
                    "aclCreateTensor", "aclDestroyTensor")

#: The aclnn first-stage prototypes, *without* the trailing ``uint64_t *workspaceSize,
#: aclOpExecutor **executor`` (added for every op).  Tensor arguments are ``c_void_p``.
#: Sources: seeds 000-004 and the ops-nn docs of the two companion ops.
OP_PROTOS = {
    # (input, weight, target, int64 vocabStartIndex, int64 vocabEndIndex, logitsMaxLocalOut,
    #  sumExpLogitsLocalOut, predictedLogitsLocalOut, targetMaskOut, maskedTargetOut,
    #  vocabParallelLogitsOutOptional)
    "aclnnFusedLinearOnlineMaxSum": [_P, _P, _P, c_int64, c_int64, _P, _P, _P, _P, _P, _P],
    # (logitsMax, sumExpLogits, predictedLogits, float labelSmoothing, inputOptional, weightOptional,
    #  vocabParallelLogitsOptional, lossOut, softMaxOutOptional)
    "aclnnFusedCrossEntropyLossWithMaxSum": [_P, _P, _P, c_float, _P, _P, _P, _P, _P],
    # (grad, input, weight, targetMask, maskedTarget, float labelSmoothing, logitsMaxOptional,
    #  sumExpLogitsOptional, softmaxOptional, inputGradOut, weightGradOut)
    "aclnnFusedLinearCrossEntropyLossGrad": [_P, _P, _P, _P, _P, c_float, _P, _P, _P, _P, _P],
    # (gradLoss, logProb, target, weightOptional, gradZlossOptional, lseForZlossOptional,
    #  const char *reduction, int64 ignoreIndex, float labelSmoothing, float lseSquareScaleForZloss, xGradOut)
    "aclnnCrossEntropyLossGrad": [_P, _P, _P, _P, _P, _P, c_char_p, c_int64, c_float, c_float, _P],
    # (gradOutput, y, mask, double scale, bool fixTriuMask, out)
    "aclnnScaledMaskedSoftmaxBackward": [_P, _P, _P, c_double, c_bool, _P],
    # (gradOut, self, target, int64 reduction, float beta, gradInput)
    "aclnnSmoothL1LossBackward": [_P, _P, _P, c_int64, c_float, _P],
    # (grad, indices, uint64 numWeights, uint64 paddingIdx, bool scaleGradByFreq, out)
    "aclnnEmbeddingDenseBackward": [_P, _P, c_uint64, c_uint64, c_bool, _P],
}
#: The second stage, identical for every op: (void *workspace, uint64 workspaceSize,
#: aclOpExecutor *executor, aclrtStream stream).
RUN_PROTO = (c_int, [c_void_p, c_uint64, c_void_p, c_void_p])


class Unavailable(Exception):
    """The runtime cannot be used; the message is the reason shown to the user."""


def search_dirs() -> tuple[list[str], bool]:
    """Directories searched for the libraries, and whether the override env var is set."""
    override = os.environ.get(ENV_LIB_DIR)
    if override:
        return [override], True
    dirs = []
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        v = os.environ.get(var)
        if v:
            dirs.append(os.path.join(v, "lib64"))
    dirs.append(DEFAULT_TOOLKIT_LIB)
    dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out, False


def find_library(name: str, dirs: list[str]) -> str | None:
    for d in dirs:
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    return None


class Runtime:
    """The loaded CANN libraries, their prototyped functions, and the device state."""

    def __init__(self, libs: dict[str, ctypes.CDLL], paths: dict[str, str]):
        self.libs = libs              # load order preserved
        self.paths = paths
        self._fns: dict[str, object] = {}
        self.lock = threading.RLock()  # serializes set-up and op calls
        self._tls = threading.local()
        self.acl_initialized = False   # aclInit done (by us or by someone else)
        self.owns_acl = False          # we called aclInit successfully -> we aclFinalize
        self.device = None
        self.stream = None
        self.context = None
        self._ctx_generation = 0
        self._atexit = False
        self.finalized = False

    # --- symbols ---------------------------------------------------------------------
    def find_symbol(self, name: str):
        for lib in self.libs.values():
            try:
                return getattr(lib, name)
            except AttributeError:
                continue
        return None

    def has(self, name: str) -> bool:
        return name in self._fns or self.find_symbol(name) is not None

    def fn(self, name: str):
        """The C function ``name`` with its prototype set (AclnnError 361001 when missing)."""
        f = self._fns.get(name)
        if f is not None:
            return f
        f = self.find_symbol(name)
        if f is None:
            raise AclnnError(ACLNN_ERR_RUNTIME_ERROR,
                             f"symbol {name} not found in {', '.join(self.paths.values())} "
                             "(CANN toolkit too old for this op?)")
        if name in RUNTIME_PROTOS:
            f.restype, f.argtypes = RUNTIME_PROTOS[name][0], list(RUNTIME_PROTOS[name][1])
        elif name.endswith("GetWorkspaceSize") and name[:-len("GetWorkspaceSize")] in OP_PROTOS:
            f.restype = c_int
            f.argtypes = list(OP_PROTOS[name[:-len("GetWorkspaceSize")]]) + [POINTER(c_uint64),
                                                                              POINTER(c_void_p)]
        elif name in OP_PROTOS:
            f.restype, f.argtypes = RUN_PROTO[0], list(RUN_PROTO[1])
        else:  # pragma: no cover - programming error
            raise KeyError(f"no prototype for {name}")
        self._fns[name] = f
        return f

    # --- errors ----------------------------------------------------------------------
    def recent_error(self) -> str:
        try:
            msg = self.fn("aclGetRecentErrMsg")()
        except Exception:
            return ""
        return msg.decode("utf-8", "replace").strip() if msg else ""

    def check(self, ret: int, what: str) -> None:
        """Raise ``AclnnError(ret, ...)`` with the runtime's message when ``ret`` is non-zero."""
        if ret != ACL_SUCCESS:
            msg = self.recent_error()
            raise AclnnError(int(ret), f"{what} returned {int(ret)}" + (f": {msg}" if msg else ""), what)

    # --- set-up ------------------------------------------------------------------------
    def init_acl(self) -> None:
        with self.lock:
            if self.acl_initialized:
                return
            ret = self.fn("aclInit")(None)
            if ret == ACL_ERROR_REPEAT_INITIALIZE:      # someone (torch_npu) initialised already
                self.acl_initialized = True
                return
            self.check(ret, "aclInit")
            self.acl_initialized = self.owns_acl = True
            self._register_atexit()

    def device_count(self) -> int:
        n = c_uint32(0)
        self.check(self.fn("aclrtGetDeviceCount")(byref(n)), "aclrtGetDeviceCount")
        return int(n.value)

    def _register_atexit(self):
        if not self._atexit:
            atexit.register(self.finalize)
            self._atexit = True

    def ensure_device(self) -> None:
        """Set device, create the stream (once per process), and bind this thread's context."""
        if self.stream is None:
            with self.lock:
                if self.stream is None:
                    if self.finalized:
                        raise AclnnError(ACLNN_ERR_RUNTIME_ERROR, "the acl runtime was finalized")
                    self.init_acl()
                    dev = int(os.environ.get(ENV_DEVICE, "0"))
                    self.check(self.fn("aclrtSetDevice")(dev), "aclrtSetDevice")
                    self.device = dev
                    self._register_atexit()
                    stream = c_void_p()
                    self.check(self.fn("aclrtCreateStream")(byref(stream)), "aclrtCreateStream")
                    self.stream = stream.value
                    if self.has("aclrtGetCurrentContext"):
                        ctx = c_void_p()
                        self.check(self.fn("aclrtGetCurrentContext")(byref(ctx)), "aclrtGetCurrentContext")
                        self.context = ctx.value
                    self._ctx_generation += 1
                    self._tls.generation = self._ctx_generation  # set-up thread already bound
        if self.context is not None and getattr(self._tls, "generation", None) != self._ctx_generation:
            self.check(self.fn("aclrtSetCurrentContext")(self.context), "aclrtSetCurrentContext")
            self._tls.generation = self._ctx_generation

    def finalize(self) -> None:
        """Destroy the stream, reset the device, and aclFinalize if we initialised (at exit)."""
        with self.lock:
            if self.finalized:
                return
            self.finalized = True
            try:
                if self.stream is not None:
                    self.fn("aclrtDestroyStream")(self.stream)
                    self.stream = None
                if self.device is not None:
                    self.fn("aclrtResetDevice")(self.device)
                    self.device = None
                if self.owns_acl:
                    self.fn("aclFinalize")()
            except Exception:  # pragma: no cover - never raise at interpreter exit
                pass


def load() -> Runtime:
    """Find and open the libraries (raises :class:`Unavailable` with the reason)."""
    dirs, exclusive = search_dirs()
    paths: dict[str, str] = {}
    for name in REQUIRED_LIBS + OPTIONAL_LIBS:
        p = find_library(name, dirs)
        if p is None and not exclusive and name in REQUIRED_LIBS + ("libnnopbase.so",):
            p = name  # let the dynamic loader search (ld.so.cache, rpath)
        if p is not None:
            paths[name] = p
    mode = getattr(os, "RTLD_GLOBAL", 0) | getattr(os, "RTLD_NOW", 0)
    libs: dict[str, ctypes.CDLL] = {}
    for name in LOAD_ORDER:
        p = paths.get(name)
        if p is None:
            continue
        try:
            libs[name] = ctypes.CDLL(p, mode=mode)
        except OSError as e:
            if name in REQUIRED_LIBS:
                where = ", ".join(dirs) + ("" if exclusive else ", the dynamic loader's path")
                raise Unavailable(f"{name} not found or not loadable (searched {where}; "
                                  f"set {ENV_LIB_DIR} or ASCEND_HOME_PATH): {e}") from None
            paths.pop(name)
    for name in REQUIRED_LIBS:
        if name not in libs:
            raise Unavailable(f"{name} not found (searched {', '.join(dirs)})")
    rt = Runtime(libs, {n: paths[n] for n in libs})
    missing = [s for s in REQUIRED_SYMBOLS if rt.find_symbol(s) is None]
    if missing:
        raise Unavailable(f"the CANN libraries in {os.path.dirname(paths['libascendcl.so']) or 'the loader path'} "
                          f"lack {', '.join(missing)}")
    return rt


# --- process-wide state ---------------------------------------------------------------------
_state_lock = threading.Lock()
_runtime: Runtime | None = None
_reason: str | None = None
_probed = False


def probe() -> str | None:
    """None when the runtime loads and a device is present, else the reason. Never raises.

    The first call loads the libraries, runs aclInit and aclrtGetDeviceCount; later calls
    return the cached answer.
    """
    global _runtime, _reason, _probed
    if _probed:
        return _reason
    with _state_lock:
        if _probed:
            return _reason
        rt, reason = None, None
        try:
            rt = load()
            rt.init_acl()
            n = rt.device_count()
            if n == 0:
                reason = "the CANN runtime loaded but no Ascend device is present (aclrtGetDeviceCount = 0)"
        except Unavailable as e:
            reason = str(e)
        except AclnnError as e:
            reason = f"the CANN runtime failed to initialise: {e}"
        except Exception as e:  # never raise from a probe
            reason = f"the CANN runtime could not be loaded: {e!r}"
        _runtime, _reason, _probed = rt, reason, True
        return reason


def runtime() -> Runtime:
    """The usable runtime (AclnnError 361001 with the reason when unavailable)."""
    reason = probe()
    if reason is not None or _runtime is None:
        raise AclnnError(ACLNN_ERR_RUNTIME_ERROR, f"the acl backend is unavailable: {reason}")
    return _runtime


def _reset_for_tests() -> None:
    """Finalize the current runtime (if any) and forget the probe, so the next probe reloads.

    Test hook: lets a test point ``FASTGRAD_ACL_LIB_DIR`` at a fake runtime and back.
    """
    global _runtime, _reason, _probed
    with _state_lock:
        if _runtime is not None:
            _runtime.finalize()
        _runtime, _reason, _probed = None, None, False
