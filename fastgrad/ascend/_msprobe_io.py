"""msprobe dumps, the reading half: find one rank's ``dump.json``, read it, load its tensor files.

:mod:`fastgrad.ascend.msprobe` maps and judges what this reads (and re-exports these names).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported on use
    import torch


class DumpError(ValueError):
    """The directory is not a readable msprobe dump (the CLI reports it as a usage error)."""


class NoData(Exception):
    """A tensor the golden needs is a record without ``data_name`` (statistics only): the entry's reason."""


def empty_or_no_data(rec: dict) -> np.ndarray:
    """The array of a tensor record without ``data_name``: msprobe saves no file for an empty
    tensor (its storage pointer is null), so one with a 0 in its shape is that empty array;
    any other raises :class:`NoData`."""
    import torch

    shape = rec.get("shape")
    what = f"an input tensor ({rec.get('dtype')} {shape})"
    if isinstance(shape, list) and 0 in shape:
        dt = getattr(torch, str(rec.get("dtype")).removeprefix("torch."), None)
        if isinstance(dt, torch.dtype):
            return to_numpy(torch.empty(shape, dtype=dt))
    raise NoData(
        f"{what} has no data in the dump (no data_name: task 'statistics', or left out by the dump's "
        "'list' / 'data_mode'); fastgrad needs it"
    )


@dataclass
class Dump:
    """One rank's msprobe dump: ``path`` (the directory of ``dump.json``), its ``data`` records."""

    path: str
    data: dict
    meta: dict
    tensor_dir: str

    def tensor(self, rec: Any) -> np.ndarray | None:
        """The array of one tensor record (None for a record without data)."""
        if not isinstance(rec, dict) or not rec.get("data_name"):
            return None
        p = os.path.join(self.tensor_dir, rec["data_name"])
        if not os.path.exists(p):
            raise DumpError(f"{p}: missing (dump.json names it; was the dump made with task 'tensor'?)")
        return load_pt(p)


def load_pt(path: str) -> np.ndarray:
    """A ``.pt`` tensor as a NumPy array (bf16 as ``ml_dtypes.bfloat16``), loaded onto the CPU
    with ``weights_only=True`` (NPU tensors included: ``map_location="cpu"``)."""
    import torch

    try:
        t = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt file raises anything (struct.error, UnpicklingError, ...)
        raise DumpError(f"{path}: not a weights-only torch file ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(t, torch.Tensor):
        raise DumpError(f"{path}: expected one tensor, found {type(t).__name__}")
    return to_numpy(t)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """CPU torch tensor → NumPy copy (bf16 through an int16 view)."""
    import ml_dtypes
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    """NumPy → CPU torch tensor (bf16 through an int16 view)."""
    import ml_dtypes
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def find_dump_json(path: str) -> str:
    """The ``dump.json`` of ``path``: the file itself, the directory holding it, or the only one below."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise DumpError(f"{path}: no such file or directory")
    direct = os.path.join(path, "dump.json")
    if os.path.exists(direct):
        return direct
    found = []
    for root, _dirs, files in os.walk(path):
        if "dump.json" in files:
            found.append(os.path.join(root, "dump.json"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise DumpError(f"{path}: no dump.json in it or below (expected an msprobe step<N>/rank<R>/ directory)")
    raise DumpError(
        f"{path}: {len(found)} dump.json files below it (one rank at a time: "
        + ", ".join(os.path.relpath(os.path.dirname(f), path) for f in sorted(found)[:4])
        + ("" if len(found) <= 4 else ", ...")
        + ")"
    )


def read_dump(path: str) -> Dump:
    """Read one rank's dump (``path``: ``step<N>/rank<R>/``, ``proc<pid>/`` or its ``dump.json``)."""
    dj = find_dump_json(path)
    try:
        with open(dj, encoding="utf-8") as f:  # msprobe writes UTF-8, whatever the locale
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise DumpError(f"{dj}: not JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise DumpError(f"{dj}: not UTF-8 JSON (byte {e.start})") from None
    if not isinstance(d, dict) or not isinstance(d.get("data"), dict):
        raise DumpError(f"{dj}: not an msprobe dump.json (no 'data' object)")
    if d.get("framework") not in (None, "pytorch"):
        raise DumpError(f"{dj}: framework {d.get('framework')!r}; fastgrad reads PyTorch dumps")
    root = os.path.dirname(os.path.abspath(dj))
    tdir = os.path.join(root, "dump_tensor_data")
    meta = {k: v for k, v in d.items() if k != "data"}
    return Dump(root, d["data"], meta, tdir)
