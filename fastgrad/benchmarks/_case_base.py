"""The benchmark cases' types and input helpers (``fastgrad.benchmarks.cases`` re-exports them)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from ..cli._common import SHORT_NAMES

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
_DT = {"bfloat16": BF16, "float16": F16, "float32": F32}
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

#: Short names accepted by ``--ops`` besides the op names themselves: the command's short op names
#: (``cli/_common.SHORT_NAMES``, which every golden command takes too) and the bench's own
ALIASES = {
    **SHORT_NAMES,
    "forward": "fused_linear_online_max_sum",
    "lce": "linear_cross_entropy",
    "train": "linear_cross_entropy",
    "train_step": "linear_cross_entropy",
}


@dataclass
class Runner:
    """One way to compute a case: ``make(inputs)`` returns the zero-argument callable timed."""

    name: str
    kind: str  # "fastgrad" | "baseline" | "bound"
    make: Callable[[dict], Callable[[], Any]] | None  # None: a bound, computed by the runner
    mode: str = ""  # appended to the case's mode (e.g. "out=")
    needs_torch: bool = False


@dataclass
class Case:
    op: str
    mode: str
    dtype: str
    shape: dict
    build: Callable[[], dict]
    runners: list
    flops: float = 0.0
    bytes: float = 0.0
    bound: str = "copy"  # "copy" | "gemm"
    gemm: list = field(default_factory=list)  # [(M, K, N), ...] for bound="gemm"
    memory: bool = False  # peak RSS measured in a spawned subprocess
    needs_torch: bool = False  # the case itself is a torch workload
    note: str = ""

    @property
    def shape_str(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.shape.items())

    @property
    def id(self) -> str:
        return f"{self.op}[{self.mode}]/{_SHORT.get(self.dtype, self.dtype)}/{self.shape_str}"


# ---------------------------------------------------------------------------- helpers ----


def _torch():
    import torch

    return torch


def tt(a: np.ndarray):
    """NumPy -> torch CPU tensor sharing memory (bf16 through an int16 view)."""
    torch = _torch()
    if a.dtype == BF16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _rng(*key) -> np.random.Generator:
    """A generator seeded from the case's key (stable across processes and runs)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _normal(rng, shape, dtype, scale=1.0) -> np.ndarray:
    """Standard normal data of ``dtype`` without a float64 temporary of the whole array."""
    a = rng.standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
        a *= np.float32(scale)
    return a if dtype == F32 else a.astype(dtype)


def _flce_inputs(BT, H, V, dtype, seed, softmax=False, chunk=16384, stats=True) -> dict:
    """FLCE inputs with consistent statistics: the row max and sum of exp of the fp32 logits
    (computed here by chunked fp32 GEMMs), a target per row, every 16th row masked."""
    dt = _DT[dtype]
    rng = _rng("flce", BT, H, V, dtype, seed)
    x = _normal(rng, (BT, H), dt)
    w = _normal(rng, (V, H), dt, 1.0 / math.sqrt(H))
    target = rng.integers(0, V, BT, dtype=np.int64)
    bits = (np.arange(BT) % 16) == 15
    masked_target = np.where(bits, 0, target).astype(np.int64)
    xf = x.astype(np.float32)
    m = np.full(BT, -np.inf, np.float32)
    s = np.zeros(BT, np.float32)
    sm = np.empty((BT, V), np.float32) if softmax else None
    for v0 in range(0, V if stats else 0, chunk):
        lg = xf @ w[v0 : v0 + chunk].astype(np.float32).T
        if sm is not None:
            sm[:, v0 : v0 + lg.shape[1]] = lg
        mc = lg.max(axis=1)
        mn = np.maximum(m, mc)
        s = s * np.exp(m - mn) + np.exp(lg - mn[:, None]).sum(axis=1, dtype=np.float32)
        m = mn
        del lg
    inp = {
        "input": x,
        "weight": w,
        "target": target,
        "target_mask": np.packbits(bits, bitorder="little"),
        "masked_target": masked_target,
        "grad": np.full(BT, 1.0 / BT, np.float32),
        "logits_max": m,
        "sum_exp_logits": s,
        "torch_target": np.where(bits, -100, target).astype(np.int64),
    }
    if sm is not None:
        for r0 in range(0, BT, 256):
            blk = sm[r0 : r0 + 256]
            blk -= m[r0 : r0 + 256, None]
            np.exp(blk, out=blk)
            blk /= s[r0 : r0 + 256, None]
        inp["softmax"] = sm
    return inp
