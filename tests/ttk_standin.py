"""Minimal stand-ins for the TTK and ATK runners (the real ones are not public packages).

* :func:`load_plugin` reads a golden plugin file as TTK does: the literal ``__golden__`` table
  (``ast.literal_eval`` of the assignment, never executed) and the module's functions it names.
* :func:`run_ttk_case` calls the plugin for one case of a TTK case file:
  ``fn(*inputs in op-definition order, **attrs, **ctx)`` for a kernel file (``op_name``), and for
  an aclnn file (``api_name``) ``fn(*input tensors, *output tensors, **attrs, **ctx)`` with the
  tensors of ``tensor_view_shapes`` in aclnn order; ``ctx`` holds ``output_dtypes``,
  ``output_ori_shapes``, ``short_soc_version``, ``full_soc_version`` and ``testcase_name``.
* :func:`run_atk_case` does what an ATK executor built on :func:`fastgrad.ascend.atk_golden`
  does: the case's inputs as torch tensors by the case file's names, the executor's own input
  rules (tests/cann_helpers.py), one call.

Inputs come from tests/cann_helpers.py (the same generator as tests/test_cann_cases.py).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
from dataclasses import dataclass
from types import ModuleType

import cann_helpers as ch
import numpy as np


@dataclass
class Plugin:
    module: ModuleType
    table: dict  # the literal __golden__

    def kernel(self, op_type: str):
        return getattr(self.module, self.table["kernel"][op_type])

    def aclnn(self, api: str):
        return getattr(self.module, self.table["aclnn"][api])


def literal_golden_table(path: pathlib.Path) -> dict:
    """The ``__golden__`` literal of a plugin file, read from its source (as TTK does)."""
    tree = ast.parse(pathlib.Path(path).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__golden__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{path}: no literal __golden__")


def load_plugin(path) -> Plugin:
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "golden.py"
    table = literal_golden_table(path)
    spec = importlib.util.spec_from_file_location(f"ttk_plugin_{abs(hash(str(path)))}", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return Plugin(mod, table)


def ttk_context(case: dict, out_dtypes: list) -> dict:
    soc = ch.ttk_soc(case)
    shapes = case.get("output_shapes")
    if shapes is None and "output_tensor_indexes" in case:
        shapes = [case["tensor_view_shapes"][i] for i in case["output_tensor_indexes"]]
    return {
        "output_dtypes": tuple(out_dtypes),
        "output_ori_shapes": tuple(tuple(s) if s is not None else None for s in (shapes or ())),
        "short_soc_version": soc,
        "full_soc_version": soc,
        "testcase_name": case["name"],
    }


def run_ttk_case(plugin: Plugin, stem: str, index: int, shrink_limit: int = ch.SHRINK_ELEMENTS):
    """(plugin outputs, the Prepared case with its canonical arguments) for one TTK case."""
    data = ch.load(stem)
    case = data["cases"][index]
    p = ch.prepare_ttk(stem, index, shrink_limit)
    tensors, attrs = p.raw["tensors"], p.raw["attrs"]
    ctx = ttk_context(case, p.standard["out_dtypes"])
    if "api_name" in case:
        outs = []
        for i in case["output_tensor_indexes"]:
            shape = case["tensor_view_shapes"][i]
            outs.append(None if shape is None else np.zeros(shape, ch.DTYPES[case["tensor_dtypes"][i]]))
        result = plugin.aclnn(case["api_name"])(*tensors, *outs, **attrs, **ctx)
    else:
        result = plugin.kernel(case["op_name"])(*tensors, **attrs, **ctx)
    return list(result), p


def to_torch(x):
    import torch

    if not isinstance(x, np.ndarray):
        return x
    if x.dtype == ch.BF16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def run_atk_case(stem: str, index: int, shrink_limit: int = ch.SHRINK_ELEMENTS, soc_version: str | None = None):
    """(atk_golden's outputs as NumPy, the Prepared case) for one ATK case: torch tensors by the
    case file's names; the CE executor's nullptr z-loss inputs left out."""
    from fastgrad.ascend import atk_golden

    data = ch.load(stem)
    p = ch.prepare_atk(stem, index, shrink_limit)
    kwargs = {k: to_torch(v) for k, v in p.raw.items()}
    if data["op"] == "cross_entropy_loss_grad":
        kwargs.pop("gradZlossOptional")
        kwargs.pop("lseForZlossOptional")
    out = atk_golden(data["aclnn_name"], soc_version=soc_version, **kwargs)
    outs = list(out) if isinstance(out, tuple) else [out]
    return [from_torch(o) for o in outs], p


def from_torch(t) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ch.BF16)
    return t.numpy()
