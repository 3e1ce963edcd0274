"""fastgrad inside the Ascend engineer's tools (TTK/ATK goldens, msprobe dumps, NPU profiles).

Submodules are imported on first use, so ``import fastgrad.ascend`` stays light:

* :mod:`fastgrad.ascend.ttk` — a TTK golden plugin (``__golden__`` for the seven ops' kernel and
  aclnn entry points); ``fastgrad ttk-plugin --out DIR`` writes it as a file of its own.
* :func:`atk_golden` (:mod:`fastgrad.ascend.atk`) — the golden of an ATK executor: an aclnn API
  called by its parameter names, torch tensors in and out.

Everything here calls fastgrad's public ops only.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["atk_golden", "ttk", "atk"]


def atk_golden(aclnn_name: str, *args: Any, soc_version: str | None = None, **kwargs: Any) -> Any:
    """See :func:`fastgrad.ascend.atk.atk_golden` (imported on first call)."""
    from .atk import atk_golden as _atk_golden

    return _atk_golden(aclnn_name, *args, soc_version=soc_version, **kwargs)


def __getattr__(name: str) -> Any:
    """Submodules on first access (``fastgrad.ascend.ttk``, ``.atk``, ``.msprobe``, ...)."""
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{name}":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        raise
