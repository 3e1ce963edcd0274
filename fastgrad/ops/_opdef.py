"""Op declarations and the one path every public op takes (op_def + op_api + op_host).

Each op module declares its op once, in the spirit of CANN's ``op_host/*_def.cpp`` (``OpDef``
lists each input and output with its dtypes, each attribute with its type) and of xformers'
``not_supported_reasons``:

* :class:`TensorDef` — an input: the dtypes the device accepts, the extra dtypes fastgrad
  accepts outside strict mode (extensions), the ranks (device / extension), whether it may be
  None.
* :class:`AttrDef` — an attribute: its kind (float, int, bool, reduction), its range, and the
  values the device accepts (strict mode rejects the rest).
* :class:`OpDef` — the op: its inputs, attributes, a ``relations`` function (shape relations
  and value checks between arguments; it declares the outputs), a ``device_limits`` function
  (what strict mode rejects beyond the per-argument limits), a pure ``plan`` (op_host: from
  shapes and attributes only) and a ``result`` builder.

:func:`execute` is the generic path: adapt the arrays (:mod:`fastgrad.arrays`), check them
against the declaration collecting **every** reason (one :class:`~fastgrad.AclnnError` lists
them all), check ``out=`` (shape, dtype, writable, no overlap with any input), make the plan,
allocate, call the backend (:func:`fastgrad.backends.dispatch`), and hand the results back as
the caller's kind.  Nothing is written to ``out`` before all checks passed.

Data flows one way: user arrays → ``arrays`` → op (declaration → checks → plan) → backend →
kernel → ``arrays`` → user.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _config, arrays
from ..backends import backend_takes_plan, dispatch, get_backend, resolve_backend
from ..dtypes import dtype_name, parse_dtype
from ..enums import REDUCTIONS
from ..errors import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, AclnnError
from ..soc import SocProfile, get_profile

# the inner status codes (a tiling failure, no kernel for the SoC) are named in fastgrad/errors.py

#: the two calls of an aclnn API: ``aclnnXxxGetWorkspaceSize`` (checks, tiling, the workspace size)
#: and ``aclnnXxx`` (the launch).  Every :class:`~fastgrad.AclnnError` an op raises carries the
#: one it models as ``phase`` (see :meth:`Call.fail`).
PHASES = ("workspace", "run")

#: int64 range: integer attributes beyond it are rejected (the aclnn attributes are int64_t).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class TensorDef:
    """One array input of an op."""

    name: str
    dtypes: tuple  # the device's dtypes
    ext_dtypes: tuple = ()  # accepted outside strict mode (extensions)
    ndim: tuple[int, int | None] = (0, None)  # the device's rank range (inclusive)
    ext_ndim: tuple[int, int | None] | None = None  # rank range outside strict mode
    optional: bool | Callable[[dict, bool], bool] = False  # may be None (given the raw args, strict)
    scalar_ok: bool = False  # a Python number is accepted (as a 0-d fp32 array)

    def allowed(self, strict: bool) -> tuple:
        return tuple(np.dtype(d) for d in (self.dtypes if strict else self.dtypes + self.ext_dtypes))

    def ranks(self, strict: bool) -> tuple[int, int | None]:
        return self.ndim if strict or self.ext_ndim is None else self.ext_ndim


@dataclass(frozen=True)
class AttrDef:
    """One attribute of an op."""

    name: str
    kind: str  # "float" | "int" | "bool" | "reduction" | "dtype" | "choice"
    lo: float | None = None  # inclusive bounds, always enforced
    hi: float | None = None
    finite: bool = True  # floats: NaN/Inf rejected
    device: tuple | None = None  # values the device accepts (strict mode)
    device_why: str = ""
    optional: bool = False  # None is accepted (and passed on as None)
    choices: tuple = ()  # "choice": the accepted values (strings)
    c_float: bool = False  # floats: the device holds it as a C float (strict mode rounds it to fp32 first)


@dataclass
class Call:
    """One call of an op while it is checked: arrays, attributes, outputs, reasons."""

    op: OpDef
    strict: bool
    raw: dict
    a: dict[str, Any] = field(default_factory=dict)  # NumPy views of the array inputs (None if absent)
    attrs: dict = field(default_factory=dict)  # parsed attributes
    outs: dict = field(default_factory=dict)  # name -> OutSpec, or None (not produced)
    reasons: list = field(default_factory=list)  # (param, message)
    info: dict = field(default_factory=dict)  # op-private derived values (BT, V, ...)
    skip_compute: bool = False  # the device returns without launching
    soc: SocProfile = field(default_factory=lambda: get_profile(_config.get_soc_version()))
    inner: list = field(default_factory=list)  # (status, param, message, phase): a failure past the op_api checks
    settings: _config.Settings | None = None  # the settings in force, read once per call (execute)

    def bad(self, param: str, expected: str, got: Any) -> None:
        """Record that ``param`` is out of range (161002)."""
        self.reasons.append((param, f"{param}: expected {expected}, got {got}"))

    def fail(self, status: int, param: str, expected: str, got: Any, phase: str = "workspace") -> None:
        """Record a failure the device reports with another code than 161002 (a tiling failure,
        no kernel for the SoC): raised in strict mode only, after every 161002 reason.

        ``phase``: which of the aclnn API's two calls fails on the device — ``"workspace"``
        (``aclnnXxxGetWorkspaceSize``: raised with the checks, before anything is allocated) or
        ``"run"`` (``aclnnXxx``: the first call succeeded, e.g. an l0 op that discards its
        launcher's tiling status; raised after the outputs are allocated, where the kernel would
        run, ``out=`` untouched).  The error's ``phase`` attribute says which."""
        if phase not in PHASES:  # pragma: no cover - a declaration error
            raise AssertionError(f"phase {phase!r}")
        self.inner.append((int(status), param, f"{param}: expected {expected}, got {got}", phase))

    def shape_of(self, name: str) -> tuple:
        return tuple(int(d) for d in self.a[name].shape)

    def expect_shape(self, name: str, shape: tuple, what: str = "") -> None:
        a = self.a.get(name)
        if a is not None and tuple(a.shape) != tuple(shape):
            self.bad(name, what or f"shape {tuple(shape)}", f"shape {tuple(a.shape)}")


@dataclass
class OutSpec:
    """An output: its shape, its dtype, and the other dtypes an ``out=`` array may have."""

    shape: tuple
    dtype: np.dtype
    accept: tuple = ()  # further dtypes accepted for a user's out (the buffer's dtype)
    size_param: str | None = None  # the parameter that sets its size (named if it cannot be allocated)


@dataclass(frozen=True)
class OpDef:
    """The declaration of one op (see the module docstring)."""

    name: str
    aclnn: str
    inputs: tuple[TensorDef, ...]
    attrs: tuple[AttrDef, ...]
    outputs: tuple[str, ...]
    relations: Callable[[Call], None]
    device_limits: Callable[[Call], None] | None = None
    plan: Callable[[Call], Any] | None = None
    result: Callable[[Call, dict], Any] | None = None
    source: str = ""
    #: the backend's arguments, when they are not the inputs and attributes by name (the
    #: training loss: per-row coefficients, its outputs as a dict); the plan is then made for
    #: every backend (``call.info["plan"]``) and ``kernel_args`` passes it on
    kernel_args: Callable[[Call], dict] | None = None
    #: ``(backend, why)``: a backend without an implementation of this op runs ``backend``'s,
    #: with a ``RuntimeWarning`` once per process and backend (None: 361001, as for the aclnn ops)
    fallback: tuple[str, str] | None = None


# ----------------------------------------------------------------------------------------------
# attribute parsing
# ----------------------------------------------------------------------------------------------


def _scalar(value):
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    if arrays.is_torch(value) and value.ndim == 0:
        return value.item()
    return value


def parse_attr(d: AttrDef, value: Any, call: Call) -> Any:
    """Parse one attribute; records a reason and returns None when it is out of range."""
    v = _scalar(value)
    name = d.name
    if value is None and d.optional:
        return None
    if d.kind == "choice":
        if isinstance(v, str) and v in d.choices:
            return v
        call.bad(name, " or ".join(repr(c) for c in d.choices), repr(value))
        return None
    if d.kind == "dtype":
        if value is None:
            return None
        try:
            return parse_dtype(value)
        except AclnnError:
            call.bad(
                name, "a dtype (float32, float16, bfloat16, or their NumPy/torch/ml_dtypes spellings)", repr(value)
            )
            return None
    if d.kind == "bool":
        if not isinstance(v, (bool, np.bool_)):
            call.bad(name, "a bool", repr(value))
            return None
        v = bool(v)
    elif d.kind == "reduction":
        if isinstance(v, str) and v.strip().lower() in ("none", "mean", "sum"):
            return v.strip().lower()
        if isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) and int(v) in REDUCTIONS:
            return REDUCTIONS[int(v)]
        call.bad(name, "'none'|'mean'|'sum' or 0|1|2", repr(value))
        return None
    elif d.kind == "int":
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            call.bad(name, "an integer", repr(value))
            return None
        v = int(v)
        if not INT64_MIN <= v <= INT64_MAX:
            call.bad(name, "an integer in the int64 range", v)
            return None
    elif d.kind == "float":
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
            call.bad(name, "a real number", repr(value))
            return None
        try:
            v = float(v)
        except OverflowError:
            call.bad(name, "a real number in the float64 range", repr(value))
            return None
        if d.c_float and call.strict:
            # the aclnn API takes (or the op's attribute stores) a C float: the device checks
            # and uses fp32(v) — -1e-50 is -0.0 there, 1e-50 is 0, 1 + 1e-9 is 1
            with np.errstate(over="ignore"):
                v = float(np.float32(v))
        if d.finite and not math.isfinite(v):
            call.bad(name, "a finite number", v)
            return None
    else:  # pragma: no cover - a declaration error
        raise AssertionError(f"unknown attribute kind {d.kind!r}")
    if (d.lo is not None and not v >= d.lo) or (d.hi is not None and not v <= d.hi):
        lo = "-inf" if d.lo is None else d.lo
        hi = "inf" if d.hi is None else d.hi
        call.bad(name, f"a value in [{lo}, {hi}]", v)
        return None
    if call.strict and d.device is not None and v not in d.device:
        why = d.device_why or f"one of {d.device} (the device's limit; strict mode)"
        call.bad(name, why, v)
        return None
    return v


# ----------------------------------------------------------------------------------------------
# the generic path
# ----------------------------------------------------------------------------------------------


def current_profile(soc_version: str | None = None, backend: str | None = None) -> SocProfile:
    """The SoC profile the ops follow now: on the ``"acl"`` backend (``backend``, default
    :func:`fastgrad.backends.get_backend`) the device's own (``aclrtGetSocName``), elsewhere the
    setting's (``soc_version``, default :func:`fastgrad._config.get_soc_version`)."""
    if (get_backend() if backend is None else backend) == "acl":
        from ..backends import acl_runtime

        name = acl_runtime.device_soc_name()
        if name:
            try:
                return get_profile(name)
            except ValueError:  # a SoC without a profile: the setting's checks
                pass
    return get_profile(_config.get_soc_version() if soc_version is None else soc_version)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.generic, np.ndarray))


def _phased(err: AclnnError, phase: str) -> AclnnError:
    err.phase = phase  # type: ignore[attr-defined]
    return err


def _raise(call: Call) -> None:
    params = [p for p, _ in call.reasons]
    msgs = [m for _, m in call.reasons]
    msg = f"{call.op.name}: " + "; ".join(msgs)
    raise _phased(AclnnError(ACLNN_ERR_PARAM_INVALID, msg, params[0], msgs), "workspace")


def _raise_inner(call: Call, phase: str) -> None:
    """Raise the first strict-mode failure of ``phase`` (see :meth:`Call.fail`), if any."""
    found = [f for f in call.inner if f[3] == phase]
    if not found:
        return
    status, param, msg, _ = found[0]
    where = (
        f"{call.op.aclnn}GetWorkspaceSize"
        if phase == "workspace"
        else f"{call.op.aclnn} (the run call; {call.op.aclnn}GetWorkspaceSize succeeded)"
    )
    raise _phased(
        AclnnError(
            status, f"{call.op.name}: {msg} (device: {call.soc.name}; at {where})", param, [f[2] for f in found]
        ),
        phase,
    )


def _adapt_inputs(op: OpDef, call: Call) -> None:
    """161001 for missing inputs, then NumPy views, dtypes and ranks (reasons collected)."""
    missing = []
    for td in op.inputs:
        v = call.raw.get(td.name)
        opt = td.optional(call.raw, call.strict) if callable(td.optional) else td.optional
        if v is None and not opt:
            missing.append(td.name)
    if missing:
        msg = f"{op.name}: " + "; ".join(f"{n} is required but None was given" for n in missing)
        raise _phased(AclnnError(ACLNN_ERR_PARAM_NULLPTR, msg, missing[0], msg.split("; ")), "workspace")

    kinds = set()
    for td in op.inputs:
        v = call.raw.get(td.name)
        if v is None:
            call.a[td.name] = None
            continue
        if td.scalar_ok and _is_number(v):
            call.a[td.name] = np.asarray(v, dtype=np.float32)
            continue
        if isinstance(v, np.ndarray):
            kinds.add(arrays.NUMPY)
        elif arrays.is_torch(v):
            kinds.add(arrays.TORCH)
        try:
            a = arrays.as_numpy(v, td.name, op=op.name)
        except AclnnError as e:
            call.reasons.append((td.name, e.message.split(": ", 1)[-1]))
            continue
        call.a[td.name] = a
        allowed = td.allowed(call.strict)
        if a.dtype not in allowed:
            ext = "" if call.strict or a.dtype not in td.allowed(False) else " (strict mode)"
            call.bad(td.name, "dtype in (" + ", ".join(dtype_name(d) for d in allowed) + ")" + ext, dtype_name(a.dtype))
        lo, hi = td.ranks(call.strict)
        if a.ndim < lo or (hi is not None and a.ndim > hi):
            want = f"{lo}-D" if hi == lo else (f"at least {lo}-D" if hi is None else f"{lo}-D to {hi}-D")
            strict = " (strict mode)" if call.strict and td.ext_ndim is not None else ""
            call.bad(td.name, f"a {want} tensor{strict}", f"shape {tuple(a.shape)}")
    if len(kinds) > 1:
        call.bad(
            "input",
            "all array arguments of one kind (all NumPy arrays or all torch tensors)",
            "NumPy arrays and torch tensors mixed",
        )


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Do two arrays share an element?  The bounds test first; the exact (costlier) one after."""
    return bool(a.size and b.size and np.may_share_memory(a, b) and np.shares_memory(a, b))


def _check_outs(op: OpDef, call: Call, out) -> list:
    """Validate ``out=`` against the declared outputs; returns the checked NumPy views."""
    names = list(op.outputs)
    if out is None:
        return [None] * len(names)
    users = list(out) if len(names) > 1 else [out]
    if len(names) > 1 and (not isinstance(out, (tuple, list)) or len(out) != len(names)):
        call.bad("out", f"a tuple ({', '.join(names)})", type(out).__name__)
        return [None] * len(names)
    checked: list[np.ndarray | None] = []
    inputs = [a for a in call.a.values() if isinstance(a, np.ndarray)]
    for i, (name, user) in enumerate(zip(names, users)):
        label = "out" if len(names) == 1 else f"out[{i}] ({name})"
        spec = call.outs.get(name)
        if user is None or spec is None:
            checked.append(None)
            continue
        try:
            a = arrays.as_numpy(user, label, op=op.name)
        except AclnnError as e:
            call.reasons.append((label, e.message.split(": ", 1)[-1]))
            checked.append(None)
            continue
        ok = (np.dtype(spec.dtype),) + tuple(np.dtype(d) for d in spec.accept)
        if a.dtype not in ok:
            call.bad(label, "dtype in (" + ", ".join(dtype_name(d) for d in ok) + ")", dtype_name(a.dtype))
        if tuple(a.shape) != tuple(spec.shape):
            call.bad(label, f"shape {tuple(spec.shape)}", f"shape {tuple(a.shape)}")
        if not a.flags.writeable:
            call.bad(label, "a writable array", "a read-only array")
        if any(_overlap(a, b) for b in inputs):
            call.bad(
                label,
                "memory that overlaps no input (fastgrad never computes in place)",
                "an array sharing memory with an input",
            )
        for j, prev in enumerate(checked):
            if prev is not None and _overlap(a, prev):
                call.bad(label, f"memory that overlaps no other output (out[{j}])", "overlapping outputs")
        checked.append(a)
    return checked


def _allocate(call: Call, users: list, checked: list) -> list[arrays.Out | None]:
    bufs: list[arrays.Out | None] = []
    for name, user, chk in zip(call.op.outputs, users, checked):
        spec = call.outs.get(name)
        if spec is None:
            bufs.append(None)
            continue
        dt = chk.dtype if chk is not None else np.dtype(spec.dtype)
        try:
            nbytes = math.prod(spec.shape) * dt.itemsize
            if nbytes > INT64_MAX:
                raise ValueError("too big")
            bufs.append(arrays.prepare_out(user, chk, spec.shape, dt))
        except (MemoryError, ValueError):
            param = spec.size_param or name
            raise AclnnError(  # (the workspace phase: an AclnnError without .phase reads as it)
                ACLNN_ERR_PARAM_INVALID,
                f"{call.op.name}: {param}: expected an output that fits in memory, got "
                f"{name} of shape {tuple(spec.shape)} ({dtype_name(dt)})",
                param,
            ) from None
    return bufs


#: (op, backend) pairs whose fallback was reported (``OpDef.fallback``: once per process each)
_FALLBACK_WARNED: set[tuple[str, str]] = set()


def _implementation(op: OpDef, backend: str) -> Callable:
    """``op``'s implementation on ``backend``, or on its declared fallback (``OpDef.fallback``,
    with one ``RuntimeWarning`` per process and backend)."""
    try:
        return dispatch(op.name, backend)
    except AclnnError:
        if op.fallback is None or op.fallback[0] == backend:
            raise
    fb, why = op.fallback
    if (op.name, backend) not in _FALLBACK_WARNED:
        import warnings

        _FALLBACK_WARNED.add((op.name, backend))
        warnings.warn(f"{op.name} has no {backend!r} implementation ({why}): ran the {fb!r} kernel", RuntimeWarning, 4)
    return dispatch(op.name, fb)


def execute(op: OpDef, args: dict, out: Any = None, options: Any = None) -> Any:
    """Run ``op`` on ``args`` (its inputs and attributes by name): check, plan, compute, wrap.
    ``options``: a :class:`fastgrad._config.Options` (the call's own settings over those in
    force), or None; anything else is refused (161002) before any work."""
    s = _config.settings()  # every setting, read once for this call
    if options is not None:
        if not isinstance(options, _config.Options):
            from ..errors import invalid

            raise invalid("options", "a fastgrad.Options or None", type(options).__name__, op.name)
        s = options.resolve(s)
    backend = resolve_backend(s.backend)  # once: the SoC profile and the dispatch agree
    call = Call(op, s.strict, args, soc=current_profile(s.soc_version, backend), settings=s)
    _adapt_inputs(op, call)
    for d in op.attrs:
        call.attrs[d.name] = parse_attr(d, args.get(d.name), call)
    if call.reasons:
        _raise(call)
    op.relations(call)
    if not call.reasons and call.strict and op.device_limits is not None:
        op.device_limits(call)
    if call.reasons:
        _raise(call)
    checked = _check_outs(op, call, out)
    if call.reasons:
        _raise(call)
    # the op_api's checks passed; its l0 op / tiling fails (strict mode only): in the first call
    _raise_inner(call, "workspace")

    kind = arrays.kind_of(*[v for v in (args.get(t.name) for t in op.inputs) if not _is_number(v)])
    call.info["kind"] = kind  # the caller's array kind (a result builder wraps its values in it)
    names = list(op.outputs)
    users = [None] * len(names) if out is None else (list(out) if len(names) > 1 else [out])
    bufs = _allocate(call, users, checked)
    _raise_inner(call, "run")  # ... or only in the second: the launch (out= untouched)
    if call.skip_compute:  # the device returns without launching: a user's out untouched
        for b in bufs:
            if b is not None and b.user is None:
                b.buffer[...] = 0
        results = {
            n: (None if b is None else (b.user if b.user is not None else arrays.wrap(b.buffer, kind)))
            for n, b in zip(names, bufs)
        }
        return (
            op.result(call, results)
            if op.result
            else (results[names[0]] if len(names) == 1 else tuple(results[n] for n in names))
        )
    elif op.kernel_args is not None:  # the op's own arguments (and its plan, on every backend)
        impl = _implementation(op, backend)
        if op.plan is not None:
            call.info["plan"] = op.plan(call)
        impl(**op.kernel_args(call))
    else:
        kw = {t.name: call.a[t.name] for t in op.inputs}
        kw.update(call.attrs)
        kw.update(call.info.get("kernel_args", {}))
        buffers = tuple(b.buffer if b is not None else None for b in bufs)
        kw["out"] = buffers if len(names) > 1 else buffers[0]
        if op.plan is not None and backend_takes_plan(backend):
            kw["plan"] = call.info["plan"] = op.plan(call)
            kw["progress"] = s.progress
            if call.info.get("want_stats"):
                kw["stats"] = call.info["stats"] = {}
        _implementation(op, backend)(**kw)
    results = {n: (b.result(kind) if b is not None else None) for n, b in zip(names, bufs)}
    if op.result is not None:
        return op.result(call, results)
    return results[names[0]] if len(names) == 1 else tuple(results[n] for n in names)


# ----------------------------------------------------------------------------------------------
# helpers for declarations
# ----------------------------------------------------------------------------------------------


def broadcasts(shape_from: tuple, shape_to: tuple) -> bool:
    """True when ``shape_from`` broadcasts to ``shape_to`` (NumPy rules, one direction)."""
    if len(shape_from) > len(shape_to):
        return False
    return all(a == b or a == 1 for a, b in zip(reversed(tuple(shape_from)), reversed(tuple(shape_to))))
