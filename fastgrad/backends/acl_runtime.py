"""The CANN runtime through ``ctypes``: discovery, prototypes, device set-up, one op call.

This module knows the C ABI and nothing about fastgrad's ops (those are in ``acl.py``).

Discovery (first hit wins, per library):

1. ``FASTGRAD_ACL_LIB_DIR`` — when set, the *only* place looked at (the tests point it at a
   fake runtime; a user can point it at a custom toolkit);
2. ``$ASCEND_HOME_PATH/lib64``, ``$ASCEND_TOOLKIT_HOME/lib64``, ``/usr/local/Ascend/cann/lib64``
   (CANN >= 8.5), ``/usr/local/Ascend/ascend-toolkit/latest/lib64``, then every
   ``LD_LIBRARY_PATH`` entry;
3. the dynamic loader's own search (``dlopen("libascendcl.so")``: ld.so.cache, rpath).

``libascendcl.so`` (aclInit, aclrt*) is required, and an op library: the per-domain
``libopapi_nn.so`` (+ ``libopapi_math.so``) of current toolkits, or, only when none of those
exists, the deprecated all-in-one ``libopapi.so`` (never both: they export the same symbols).
``libnnopbase.so`` (aclCreateTensor, aclDestroyTensor) is loaded when present.  Every library
is opened ``RTLD_GLOBAL``; a symbol is looked up in each library in load order.

Every C prototype comes from ONE table, the vendored header ``aclnn_prototypes.h`` (parsed
here; the tests' fake runtime is compiled against the same file).

Device set-up happens once per process, lazily and under a lock: ``aclInit`` (at the first
probe; ``ACL_ERROR_REPEAT_INITIALIZE`` is accepted when someone — torch_npu — initialised
first, and then fastgrad leaves ``aclFinalize`` to them), ``aclrtSetDevice``
(``FASTGRAD_ACL_DEVICE``, default 0), ``aclrtCreateStream``, ``aclrtGetCurrentContext``.  Other
threads bind that context with ``aclrtSetCurrentContext`` on first use.  ``atexit`` synchronises
and destroys the stream and releases only what fastgrad took (see :meth:`Runtime.finalize`:
``aclFinalizeReference`` when exported; no reset/finalize of a runtime torch_npu owns).  Op
calls are serialized by a process-wide lock.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import sys
import threading
from collections.abc import Sequence
from ctypes import (
    POINTER,
    byref,
    c_bool,
    c_char_p,
    c_double,
    c_float,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)
from typing import TYPE_CHECKING, TypeAlias

import ml_dtypes
import numpy as np

from .. import _config
from ..errors import ACLNN_ERR_RUNTIME_ERROR, AclnnError, invalid

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

ENV_LIB_DIR = _config.ENV_ACL_LIB_DIR
ENV_DEVICE = _config.ENV_ACL_DEVICE
#: Default install locations, newest layout first: CANN >= 8.5 installs under
#: /usr/local/Ascend/cann (set_env.sh there), older toolkits under ascend-toolkit/latest.
DEFAULT_TOOLKIT_LIBS = ("/usr/local/Ascend/cann/lib64", "/usr/local/Ascend/ascend-toolkit/latest/lib64")
DEFAULT_TOOLKIT_LIB = DEFAULT_TOOLKIT_LIBS[-1]

#: The per-domain op libraries of current toolkits (the seven ops live in ops-nn ->
#: libopapi_nn.so).  ``libopapi.so`` is the deprecated all-in-one library: it is loaded only
#: when none of these is found, never together with them (both export the same aclnn symbols).
OPAPI_SPLIT_LIBS = ("libopapi_nn.so", "libopapi_math.so")
OPAPI_LEGACY_LIB = "libopapi.so"
REQUIRED_LIBS = ("libascendcl.so",)
OPTIONAL_LIBS = ("libnnopbase.so",)
LOAD_ORDER = ("libascendcl.so", "libnnopbase.so") + OPAPI_SPLIT_LIBS + (OPAPI_LEGACY_LIB,)

# --- enums (acl/acl_base.h, acl/acl_rt.h) -------------------------------------------------
ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_FORMAT_ND = 2
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2

#: aclDataType of each NumPy dtype the ops take (acl_base.h values).
ACL_DTYPE = {
    np.dtype(np.float32): 0,  # ACL_FLOAT
    np.dtype(np.float16): 1,  # ACL_FLOAT16
    np.dtype(np.int8): 2,  # ACL_INT8
    np.dtype(np.int32): 3,  # ACL_INT32
    np.dtype(np.uint8): 4,  # ACL_UINT8
    np.dtype(np.int16): 6,  # ACL_INT16
    np.dtype(np.uint16): 7,  # ACL_UINT16
    np.dtype(np.uint32): 8,  # ACL_UINT32
    np.dtype(np.int64): 9,  # ACL_INT64
    np.dtype(np.uint64): 10,  # ACL_UINT64
    np.dtype(np.float64): 11,  # ACL_DOUBLE
    np.dtype(np.bool_): 12,  # ACL_BOOL
    np.dtype(ml_dtypes.bfloat16): 27,  # ACL_BF16
}

# --- prototypes: ONE table, the vendored header ---------------------------------------------
#: The C header every prototype is taken from (vendored text of the CANN headers; see its
#: comments for the file and line of each).  The tests' fake runtime is compiled against the
#: same file, so a prototype that disagrees with it fails the fake's build.
PROTOTYPE_HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "aclnn_prototypes.h")

#: C type (normalised spelling) -> ctypes type.  Anything else is an error: a new type must be
#: mapped here deliberately.
C_TYPES = {
    "aclError": c_int,
    "aclnnStatus": c_int,
    "aclDataType": c_int,
    "aclFormat": c_int,
    "aclrtMemMallocPolicy": c_int,
    "aclrtMemcpyKind": c_int,
    "int32_t": c_int32,
    "int64_t": c_int64,
    "uint32_t": c_uint32,
    "uint64_t": c_uint64,
    "size_t": c_size_t,
    "float": c_float,
    "double": c_double,
    "bool": c_bool,
    "aclrtStream": c_void_p,
    "aclrtContext": c_void_p,
    "void*": c_void_p,
    "aclTensor*": c_void_p,
    "aclOpExecutor*": c_void_p,
    "char*": c_char_p,
    "void**": POINTER(c_void_p),
    "aclOpExecutor**": POINTER(c_void_p),
    "aclrtStream*": POINTER(c_void_p),
    "aclrtContext*": POINTER(c_void_p),
    "int64_t*": POINTER(c_int64),
    "uint64_t*": POINTER(c_uint64),
    "uint32_t*": POINTER(c_uint32),
}


def _norm_type(decl: str) -> tuple[str, str | None]:
    """``"const aclTensor *out"`` -> (``"aclTensor*"``, ``"out"``); ``"void"`` -> (``"void"``, None)."""
    decl = re.sub(r"\bconst\b", " ", decl)
    decl = decl.replace("*", " * ")
    toks = decl.split()
    if toks == ["void"]:
        return "void", None
    stars = toks.count("*")
    words = [t for t in toks if t != "*"]
    if len(words) == 1:  # unnamed parameter or a return type
        return words[0] + "*" * stars, None
    return words[0] + "*" * stars, words[-1]


def parse_prototypes(text: str) -> dict:
    """Every function declaration of the header: ``name -> (ret_c, [(c_type, param_name), ...])``."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)
    protos = {}
    for m in re.finditer(r"([A-Za-z_][\w\s\*]*?)\b(acl\w+)\s*\(([^()]*)\)\s*;", text):
        ret, name, params = m.group(1), m.group(2), m.group(3)
        if "typedef" in ret:
            continue
        ret_c, _ = _norm_type(ret)
        args = []
        for p in params.split(","):
            c, n = _norm_type(p)
            if c != "void":
                args.append((c, n))
        protos[name] = (ret_c, args)
    return protos


def _ctype(c: str, where: str):
    if c not in C_TYPES:
        raise KeyError(f"{where}: C type {c!r} has no ctypes mapping")
    return C_TYPES[c]


#: A ctypes prototype: ``(restype or None for void, [argtypes])``.
Prototype: TypeAlias = "tuple[type | None, list[type]]"
#: One entry of :data:`PROTOTYPE_VARIANTS`: ``(min_version, max_version_exclusive, prototype)``.
PrototypeVariant: TypeAlias = "tuple[Sequence[int] | None, Sequence[int] | None, Prototype]"


def load_prototypes(path: str = PROTOTYPE_HEADER) -> dict[str, Prototype]:
    """``name -> (restype, [argtypes])`` for every declaration of the vendored header."""
    with open(path, encoding="utf-8") as f:
        parsed = parse_prototypes(f.read())
    out = {}
    for name, (ret, args) in parsed.items():
        restype = None if ret == "void" else _ctype(ret, name)
        out[name] = (restype, [_ctype(c, f"{name}({n})") for c, n in args])
    return out


#: C declarations (parsed) and the ctypes prototypes built from them.
C_PROTOTYPES = parse_prototypes(open(PROTOTYPE_HEADER, encoding="utf-8").read())
PROTOTYPES = load_prototypes()

#: The seven aclnn ops bound by the backend (each has ``<op>GetWorkspaceSize`` and ``<op>``).
OPS = (
    "aclnnFusedLinearOnlineMaxSum",
    "aclnnFusedCrossEntropyLossWithMaxSum",
    "aclnnFusedLinearCrossEntropyLossGrad",
    "aclnnCrossEntropyLossGrad",
    "aclnnScaledMaskedSoftmaxBackward",
    "aclnnSmoothL1LossBackward",
    "aclnnEmbeddingDenseBackward",
)

#: Prototypes that differ between CANN releases: ``name -> [(min_version, max_version_exclusive,
#: (restype, argtypes)), ...]`` (versions as tuples of ints, None = unbounded).  When a name is
#: listed, the variant is chosen by the version the runtime reports (``aclsysGetVersionStr``);
#: when the runtime reports none, or no variant covers it, the call is refused (361001) rather
#: than guessed.  Empty today: every revision of the ops-nn headers and docs in the public
#: history declares the prototypes of ``aclnn_prototypes.h`` (e.g. aclnnCrossEntropyLossGrad's
#: ``double labelSmoothing`` in all revisions of docs/aclnnCrossEntropyLossGrad.md).
PROTOTYPE_VARIANTS: dict[str, list[PrototypeVariant]] = {}

#: Symbols without which the backend cannot run at all.
REQUIRED_SYMBOLS = (
    "aclInit",
    "aclrtGetDeviceCount",
    "aclrtSetDevice",
    "aclrtCreateStream",
    "aclrtSynchronizeStream",
    "aclrtMalloc",
    "aclrtFree",
    "aclrtMemcpy",
    "aclCreateTensor",
    "aclDestroyTensor",
)

#: aclFormat values torch_npu reports for layouts the backend may describe as ND (acl_base.h:
#: NCHW 0, NHWC 1, ND 2, NCDHW 30).  Anything else (NC1HWC0 3, FRACTAL_Z 4, FRACTAL_NZ 29, ...)
#: is a private format whose memory is not the row-major view its shape suggests.
BASE_FORMATS = {0: "NCHW", 1: "NHWC", 2: "ND", 30: "NCDHW"}


def parse_version(s: str | None) -> tuple[int, ...] | None:
    """``"8.2.RC1"`` -> (8, 2, 1); ``"8.0.0.alpha003"`` -> (8, 0, 0, 3); None/garbage -> None."""
    if not s:
        return None
    nums = re.findall(r"\d+", s)
    return tuple(int(n) for n in nums) if nums else None


def select_prototype(
    name: str, version: tuple[int, ...] | None, variants: dict[str, list[PrototypeVariant]] | None = None
) -> Prototype:
    """The ctypes prototype of ``name`` for the runtime ``version`` (see PROTOTYPE_VARIANTS)."""
    variants = PROTOTYPE_VARIANTS if variants is None else variants
    if name in variants:
        if version is None:
            raise AclnnError(
                ACLNN_ERR_RUNTIME_ERROR,
                f"{name}: its C prototype differs between CANN releases and the runtime "
                "reports no version (aclsysGetVersionStr); refusing to guess the ABI",
            )
        for lo, hi, proto in variants[name]:
            if (lo is None or version >= tuple(lo)) and (hi is None or version < tuple(hi)):
                return proto
        raise AclnnError(
            ACLNN_ERR_RUNTIME_ERROR,
            f"{name}: no known C prototype for CANN {'.'.join(map(str, version))}; refusing to guess the ABI",
        )
    if name not in PROTOTYPES:  # pragma: no cover - programming error
        raise KeyError(f"no prototype for {name} in {PROTOTYPE_HEADER}")
    return PROTOTYPES[name]


class Unavailable(Exception):
    """The runtime cannot be used; the message is the reason shown to the user."""


def search_dirs() -> tuple[list[str], bool]:
    """Directories searched for the libraries, and whether the override env var is set (read by
    the settings module: ``fastgrad._config.acl_library_dirs``)."""
    return _config.acl_library_dirs(tuple(DEFAULT_TOOLKIT_LIBS))


def find_library(name: str, dirs: list[str]) -> str | None:
    for d in dirs:
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    return None


class Runtime:
    """The loaded CANN libraries, their prototyped functions, and the device state."""

    def __init__(self, libs: dict[str, ctypes.CDLL], paths: dict[str, str]):
        self.libs = libs  # load order preserved
        self.paths = paths
        self._fns: dict[str, CFuncPtr] = {}
        self.lock = threading.RLock()  # serializes set-up and op calls
        self._tls = threading.local()
        self.acl_initialized = False  # aclInit done (by us or by someone else)
        self.owns_acl = False  # we called aclInit successfully -> we aclFinalize
        self.device: int | None = None
        self.stream: int | None = None
        self.context: int | None = None
        self._ctx_generation = 0
        self._atexit = False
        self.finalized = False
        self.acl_refcounted = False  # our aclInit took a reference (success or REPEAT) -> drop it
        self._version: str | None | bool = False  # False: not queried yet
        self._soc: str | None | bool = False  # False: not queried yet
        self.pid = os.getpid()  # the process that loaded it (a forked child cannot use it)

    # --- symbols ---------------------------------------------------------------------
    def find_symbol(self, name: str) -> CFuncPtr | None:
        for lib in self.libs.values():
            try:
                return getattr(lib, name)
            except AttributeError:
                continue
        return None

    def has(self, name: str) -> bool:
        return name in self._fns or self.find_symbol(name) is not None

    def fn(self, name: str) -> CFuncPtr:
        """The C function ``name`` with its prototype set (AclnnError 361001 when missing)."""
        f = self._fns.get(name)
        if f is not None:
            return f
        f = self.find_symbol(name)
        if f is None:
            raise AclnnError(
                ACLNN_ERR_RUNTIME_ERROR,
                f"symbol {name} not found in {', '.join(self.paths.values())} (CANN toolkit too old for this op?)",
            )
        f.restype, argtypes = select_prototype(name, self.version_tuple())
        f.argtypes = list(argtypes)
        self._fns[name] = f
        return f

    # --- version -----------------------------------------------------------------------
    def version(self) -> str | None:
        """The CANN version the runtime reports (``aclsysGetVersionStr("runtime")``), or None
        when the toolkit predates that call or cannot tell (no ASCEND_HOME_PATH, ...)."""
        if not isinstance(self._version, bool):
            return self._version
        v = None
        f = self.find_symbol("aclsysGetVersionStr")
        if f is not None:
            buf = ctypes.create_string_buffer(256)  # ACL_PKG_VERSION_MAX_SIZE is 128
            try:
                f.restype, f.argtypes = PROTOTYPES["aclsysGetVersionStr"][0], list(PROTOTYPES["aclsysGetVersionStr"][1])
                if f(b"runtime", buf) == ACL_SUCCESS and buf.value:
                    v = buf.value.decode("utf-8", "replace").strip()
            except Exception:  # never fail because of a version query
                v = None
        self._version = v
        return v

    def version_tuple(self) -> tuple[int, ...] | None:
        return parse_version(self.version())

    # --- SoC ---------------------------------------------------------------------------
    def soc_name(self) -> str | None:
        """The device's SoC as CANN names it (``aclrtGetSocName``: ``"Ascend910B3"``,
        ``"Ascend910_9391"``, ...), or None when the runtime lacks the call or it fails.  Asked once
        (after ``aclInit``); the ops then follow that SoC's profile (``fastgrad/soc.py``)."""
        if not isinstance(self._soc, bool):
            return self._soc
        v = None
        if self.find_symbol("aclrtGetSocName") is not None:
            try:
                self.init_acl()
                r = self.fn("aclrtGetSocName")()
                v = r.decode("utf-8", "replace").strip() if r else None
            except Exception:  # never fail an op because of the query
                v = None
        self._soc = v or None
        return self._soc

    # --- errors ----------------------------------------------------------------------
    def recent_error(self) -> str:
        try:
            msg = self.fn("aclGetRecentErrMsg")()
        except Exception:
            return ""
        return msg.decode("utf-8", "replace").strip() if msg else ""

    def check(
        self, ret: int, what: str, *, op: str | None = None, phase: str | None = None, param: str | None = None
    ) -> None:
        """Raise ``AclnnError(ret, ...)`` with the runtime's message when ``ret`` is non-zero.

        ``op``: the aclnn API being called, put before ``what`` in the message; ``phase``: which of
        its two calls the failure belongs to (default: ``"run"`` for the launch ``aclnnXxx``, else
        ``"workspace"``); ``param``: the operand concerned (default: ``what``)."""
        if ret != ACL_SUCCESS:
            msg = self.recent_error()
            where = f"{op}: " if op and not what.startswith(op) else ""
            text = f"{where}{what} returned {int(ret)}" + (f": {msg}" if msg else "")
            # which of an aclnn API's two calls failed (fastgrad.ops._opdef.PHASES): its first,
            # aclnnXxxGetWorkspaceSize, or its second, the launch aclnnXxx
            if phase is None:
                phase = "run" if what.startswith("aclnn") and not what.endswith("GetWorkspaceSize") else "workspace"
            raise AclnnError(int(ret), text, what if param is None else param, phase=phase)

    # --- set-up ------------------------------------------------------------------------
    def init_acl(self) -> None:
        with self.lock:
            if self.acl_initialized:
                return
            ret = self.fn("aclInit")(None)
            if ret == ACL_ERROR_REPEAT_INITIALIZE:
                # someone (torch_npu) initialised already.  Recent CANN counts this call as a
                # reference (aclInitImpl: aclInitRefCount++ before returning REPEAT_INITIALIZE),
                # which aclFinalizeReference gives back at exit; older CANN has no count and no
                # aclFinalizeReference, and then there is nothing of ours to undo.
                self.acl_initialized = True
                self.acl_refcounted = self.has("aclFinalizeReference")
                self._register_atexit()
                return
            self.check(ret, "aclInit")
            self.acl_initialized = self.owns_acl = True
            self.acl_refcounted = self.has("aclFinalizeReference")
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
        """Set device, create the stream (once per process), and bind this thread's context.

        All or nothing: the device is set once (``aclrtSetDevice`` takes a reference that only
        one ``aclrtResetDevice`` at exit gives back), and a stream whose context could not be
        read is destroyed, so that a failed set-up is retried whole by the next call."""
        if self.stream is None:
            with self.lock:
                if self.stream is None:
                    if self.finalized:
                        raise AclnnError(ACLNN_ERR_RUNTIME_ERROR, "the acl runtime was finalized")
                    self.init_acl()
                    if self.device is None:
                        dev = _config.acl_device_id()
                        n = self.device_count()
                        if dev >= n:  # (aclrtSetDevice's int32_t would also wrap 2**32 to device 0)
                            raise invalid(
                                ENV_DEVICE,
                                f"a device id below {n} (aclrtGetDeviceCount = {n}; environment variable)",
                                dev,
                            )
                        self.check(self.fn("aclrtSetDevice")(dev), "aclrtSetDevice")
                        self.device = dev
                        self._register_atexit()
                    stream = c_void_p()
                    self.check(self.fn("aclrtCreateStream")(byref(stream)), "aclrtCreateStream")
                    ctx = c_void_p()
                    try:
                        if self.has("aclrtGetCurrentContext"):
                            self.check(self.fn("aclrtGetCurrentContext")(byref(ctx)), "aclrtGetCurrentContext")
                    except BaseException:
                        self.fn("aclrtDestroyStream")(stream)
                        raise
                    self.context = ctx.value
                    self.stream = stream.value
                    self._ctx_generation += 1
                    self._tls.generation = self._ctx_generation  # set-up thread already bound
        if self.context is not None and getattr(self._tls, "generation", None) != self._ctx_generation:
            self.check(self.fn("aclrtSetCurrentContext")(self.context), "aclrtSetCurrentContext")
            self._tls.generation = self._ctx_generation

    @staticmethod
    def torch_npu_loaded() -> bool:
        """True when torch_npu is imported in this process: it then owns the device's lifetime."""
        return "torch_npu" in sys.modules

    def sync(self, stream: int | None = None) -> int:
        """aclrtSynchronizeStream(stream or ours); returns the status (never raises)."""
        s = self.stream if stream is None else stream
        if s is None:
            return ACL_SUCCESS
        try:
            return int(self.fn("aclrtSynchronizeStream")(s))
        except Exception:  # pragma: no cover
            return -1

    def finalize(self) -> None:
        """Release what fastgrad took, and only that (at exit; never raises).

        * our stream: synchronised, then destroyed;
        * the device: ``aclrtResetDevice`` only when fastgrad initialised acl itself and torch_npu
          is not loaded (torch_npu resets its own devices at its shutdown, which may run after
          this atexit hook);
        * acl: ``aclFinalizeReference`` when exported (reference-counted CANN: drops exactly the
          reference our aclInit took, REPEAT_INITIALIZE included), else ``aclFinalize`` only when
          fastgrad initialised acl and torch_npu is not loaded.
        """
        with self.lock:
            if self.finalized:
                return
            self.finalized = True
            foreign = self.torch_npu_loaded()
            try:
                if self.stream is not None:
                    self.sync()
                    self.fn("aclrtDestroyStream")(self.stream)
                    self.stream = None
                if self.device is not None:
                    if self.owns_acl and not foreign:
                        self.fn("aclrtResetDevice")(self.device)
                    self.device = None
                if self.acl_refcounted:
                    self.fn("aclFinalizeReference")(None)
                elif self.owns_acl and not foreign:
                    self.fn("aclFinalize")()
            except Exception:  # pragma: no cover - never raise at interpreter exit
                pass


def load() -> Runtime:
    """Find and open the libraries (raises :class:`Unavailable` with the reason)."""
    dirs, exclusive = search_dirs()
    paths: dict[str, str] = {}
    for name in REQUIRED_LIBS + OPTIONAL_LIBS:
        p = find_library(name, dirs)
        if p is None and not exclusive:
            p = name  # let the dynamic loader search (ld.so.cache, rpath)
        if p is not None:
            paths[name] = p
    # op libraries: the split ones when any is installed, else the deprecated libopapi.so
    found = {n: find_library(n, dirs) for n in OPAPI_SPLIT_LIBS}
    split = {n: p for n, p in found.items() if p is not None}
    if split:
        paths.update(split)
    else:
        p = find_library(OPAPI_LEGACY_LIB, dirs)
        if p is not None:
            paths[OPAPI_LEGACY_LIB] = p
        elif not exclusive:  # loader search: the split library first
            paths[OPAPI_SPLIT_LIBS[0]] = OPAPI_SPLIT_LIBS[0]
            paths[OPAPI_LEGACY_LIB] = OPAPI_LEGACY_LIB
    where = ", ".join(dirs) + ("" if exclusive else ", the dynamic loader's path")
    for name in REQUIRED_LIBS:
        if name not in paths:
            raise Unavailable(f"{name} not found (searched {where})")
    mode = getattr(os, "RTLD_GLOBAL", 0) | getattr(os, "RTLD_NOW", 0)
    libs: dict[str, ctypes.CDLL] = {}
    load_errors: list[str] = []  # libraries found but not loadable (a missing dependency, ...)
    for name in LOAD_ORDER:
        p = paths.get(name)
        if p is None:
            continue
        if name == OPAPI_LEGACY_LIB and any(n in libs for n in OPAPI_SPLIT_LIBS):
            paths.pop(name)  # never both
            continue
        try:
            libs[name] = ctypes.CDLL(p, mode=mode)
        except OSError as e:
            paths.pop(name)
            load_errors.append(str(e) if p in str(e) else f"{p}: {e}")
            if name in REQUIRED_LIBS:
                raise Unavailable(
                    f"{name} not found or not loadable (searched {where}; set {ENV_LIB_DIR} or ASCEND_HOME_PATH): {e}"
                ) from None
    unloadable = f"; found but not loadable: {'; '.join(load_errors)}" if load_errors else ""
    if not any(n in libs for n in OPAPI_SPLIT_LIBS + (OPAPI_LEGACY_LIB,)):
        raise Unavailable(
            f"no aclnn op library found ({' or '.join(OPAPI_SPLIT_LIBS + (OPAPI_LEGACY_LIB,))}; searched {where})"
            + unloadable
        )
    rt = Runtime(libs, {n: paths[n] for n in libs})
    missing = [s for s in REQUIRED_SYMBOLS if rt.find_symbol(s) is None]
    if missing:
        raise Unavailable(
            f"the CANN libraries in {os.path.dirname(paths['libascendcl.so']) or 'the loader path'} "
            f"lack {', '.join(missing)}{unloadable}"
        )
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


def _after_fork_in_child() -> None:
    """``os.fork()`` in a process whose acl runtime was initialised: CANN's device, context and
    stream belong to the parent and cannot be used from the child (as with torch_npu, "cannot
    re-initialize NPU in forked subprocess"), and the inherited exit hook must not destroy or
    reset them.  The child's backend is unavailable, with that reason: ``"auto"`` runs on the
    CPU, ``"acl"`` raises 361001 saying to start workers with the ``"spawn"`` method.  The locks
    are new (one held by another thread of the parent at the fork would never be released)."""
    global _state_lock, _reason, _probed
    _state_lock = threading.Lock()
    rt = _runtime
    if rt is None or not rt.acl_initialized or rt.finalized:
        return
    rt.lock = threading.RLock()
    rt.finalized = True  # nothing of the parent's is released from here
    _reason = (
        f"the CANN runtime was initialised in process {rt.pid} before this process was forked from it; "
        "acl cannot be used in a forked child: start worker processes with the 'spawn' method "
        "(multiprocessing.get_context('spawn')), or use acl only in the children"
    )
    _probed = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def runtime() -> Runtime:
    """The usable runtime (AclnnError 361001 with the reason when unavailable)."""
    reason = probe()
    if reason is not None or _runtime is None:
        raise AclnnError(ACLNN_ERR_RUNTIME_ERROR, f"the acl backend is unavailable: {reason}")
    return _runtime


def device_soc_name() -> str | None:
    """The SoC name of the device the ``"acl"`` backend runs on (``aclrtGetSocName``), or None
    when the runtime is unavailable or cannot tell.  Never raises."""
    try:
        return runtime().soc_name()
    except Exception:
        return None


def _reset_for_tests() -> None:
    """Finalize the current runtime (if any) and forget the probe, so the next probe reloads.

    Test hook: lets a test point ``FASTGRAD_ACL_LIB_DIR`` at a fake runtime and back.
    """
    global _runtime, _reason, _probed
    with _state_lock:
        if _runtime is not None:
            _runtime.finalize()
        _runtime, _reason, _probed = None, None, False
