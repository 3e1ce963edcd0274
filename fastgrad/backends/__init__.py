"""Backend registry: where each op's implementation is chosen.

Backends:

* ``"cpu"``       — the Numba kernels (default).
* ``"reference"`` — float64 NumPy golden with the device's roundings (the oracle).
* ``"acl"``       — the CANN runtime through ctypes, when it loads (see ``backends/acl.py``).
* ``"auto"``      — ``"acl"`` when available, else ``"cpu"`` (a pseudo-backend).

Selection, highest priority first: :func:`use_backend` (context manager), :func:`set_backend`,
the ``FASTGRAD_BACKEND`` environment variable, then ``"cpu"``.  An explicitly requested backend
that is unavailable raises ``AclnnError`` 361001; ``"auto"`` falls back silently.

Each backend module holds its implementation table, ``IMPLS`` (op name → function, or
``"module:function"`` resolved lazily), and says whether its functions take the op_host plan
(``TAKES_PLAN``).  The registry pulls the table the first time the backend is used: kernels and
goldens never import the registry, and nothing registers itself by being imported.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, TypeVar, overload

from .. import _config
from ..errors import invalid, runtime_error

_F = TypeVar("_F", bound=Callable)


@dataclass
class Backend:
    name: str
    module: str | None  # module imported to register implementations
    probe: Callable[[], str | None]  # returns None when available, else the reason
    impls: dict = field(default_factory=dict)
    _loaded: bool = False

    takes_plan: bool = False

    def load(self) -> None:
        if not self._loaded and self.module:
            mod = importlib.import_module(self.module)
            for op, fn in getattr(mod, "IMPLS", {}).items():
                self.impls.setdefault(op, fn)
            self.takes_plan = bool(getattr(mod, "TAKES_PLAN", False))
        self._loaded = True

    def implementation(self, op: str) -> Callable | None:
        self.load()
        fn = self.impls.get(op)
        if isinstance(fn, str):
            mod, _, attr = fn.partition(":")
            fn = getattr(importlib.import_module(mod), attr)
            self.impls[op] = fn
        return fn

    def unavailable_reason(self) -> str | None:
        try:
            return self.probe()
        except Exception as e:  # a probe must never break import
            return f"probe failed: {e!r}"


_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, module: str | None, probe: Callable[[], str | None] = lambda: None) -> Backend:
    b = _BACKENDS.get(name)
    if b is None:
        b = Backend(name, module, probe)
        _BACKENDS[name] = b
    else:
        b.module, b.probe = module, probe
    return b


def implements(backend: str, op: str) -> Callable[[_F], _F]:
    """Decorator: add ``fn`` to ``backend``'s table (for third-party backends; fastgrad's own
    backends declare ``IMPLS`` tables instead)."""

    def deco(fn: _F) -> _F:
        b = _BACKENDS.get(backend) or register_backend(backend, None)
        b.impls[op] = fn
        return fn

    return deco


def _acl_probe() -> str | None:
    from . import acl  # noqa: F401  (lazy: ctypes only)

    return acl.unavailable_reason()


def _acl_module_exists() -> bool:
    import importlib.util

    return importlib.util.find_spec(__name__ + ".acl") is not None


register_backend("cpu", "fastgrad.backends.cpu")
register_backend("reference", "fastgrad.backends.reference")
register_backend(
    "acl",
    __name__ + ".acl",
    _acl_probe if _acl_module_exists() else (lambda: "the acl backend is not built into this fastgrad"),
)

PSEUDO = ("auto",)


@overload
def available_backends(with_reasons: Literal[False] = ...) -> list[str]: ...
@overload
def available_backends(with_reasons: Literal[True]) -> dict[str, str | None]: ...
@overload
def available_backends(with_reasons: bool) -> list[str] | dict[str, str | None]: ...


def available_backends(with_reasons: bool = False) -> list[str] | dict[str, str | None]:
    """Names of the backends usable now (``["cpu", "reference", ...]``).

    With ``with_reasons=True``, a dict of every registered backend to ``None`` (available) or
    the reason it is unavailable (e.g. ``"libascendcl.so not found ..."``).
    """
    reasons = {name: b.unavailable_reason() for name, b in _BACKENDS.items()}
    if with_reasons:
        return reasons
    return [n for n, r in reasons.items() if r is None]


def resolve_backend(name: str) -> str:
    """The backend a setting ``name`` runs on now (``"auto"``: ``"acl"`` where available, else
    ``"cpu"``); raises ``AclnnError`` 361001 for an unknown or unavailable backend (one read from
    ``FASTGRAD_BACKEND`` naming the variable), 161002 for a name that is no string."""
    if not isinstance(name, str):
        names = ", ".join(sorted(_BACKENDS) + list(PSEUDO))
        raise invalid("backend", f"a backend name (a str: {names})", repr(name))
    name = name.strip().lower()
    if name == "auto":
        acl = _BACKENDS.get("acl")
        if acl is not None and acl.unavailable_reason() is None:
            return "acl"
        return "cpu"
    if name not in _BACKENDS:
        if _config.backend_from_environment() and name == _config.backend_setting():
            raise runtime_error(  # 361001 as for any unknown backend, naming where it came from
                f"FASTGRAD_BACKEND (environment variable): unknown backend {name!r}; registered: "
                f"{sorted(_BACKENDS) + list(PSEUDO)}",
                "FASTGRAD_BACKEND",
            )
        raise runtime_error(f"unknown backend {name!r}; registered: {sorted(_BACKENDS) + list(PSEUDO)}", "backend")
    reason = _BACKENDS[name].unavailable_reason()
    if reason is not None:
        raise runtime_error(f"backend {name!r} is unavailable: {reason}", "backend")
    return name


def set_backend(name: str | None) -> None:
    """Select the process-wide backend by name (None: back to ``FASTGRAD_BACKEND``/"cpu").

    Raises AclnnError 361001 when the backend is unknown or unavailable.
    """
    if name is None:
        _config.set_backend_setting(None)
        return
    resolve_backend(name)
    _config.set_backend_setting(name)


def get_backend() -> str:
    """Name of the backend the next op call will run on."""
    return resolve_backend(_config.backend_setting())


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager: run the ops inside on backend ``name`` (raises 361001 if unavailable)."""
    resolve_backend(name)
    with _config.backend_context(name):
        yield


def dispatch(op: str, backend: str | None = None) -> Callable:
    """The implementation of ``op`` on the selected (or given) backend."""
    name = resolve_backend(backend) if backend else get_backend()
    fn = _BACKENDS[name].implementation(op)
    if fn is None:
        raise runtime_error(f"backend {name!r} does not implement {op}", "backend")
    return fn


def backend_takes_plan(name: str) -> bool:
    """Whether backend ``name``'s implementations take the op_host plan (and a progress hook)."""
    b = _BACKENDS[resolve_backend(name)]
    b.load()
    return b.takes_plan
