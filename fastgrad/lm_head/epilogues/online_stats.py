"""The online max-sum's epilogue of the LM-head loop (:class:`OnlineStats`): the logits rounded
to ``logits_dtype``, each row's running max and sum of exponentials, the target's logit; the
buffer it takes is declared here (:func:`OnlineStats.buffers`), once.  The op's entry point and
sources: ``kernels/fused_linear_online_max_sum.py``."""

from __future__ import annotations

import numpy as np

from ... import dtypes as D
from ..._jit import njit, tjit
from ...kernels._gemm import run_rows
from ...kernels._linear import narrow
from ...kernels._vmath import exp_f32, row_max_nan, row_sum_exp
from ..loop import Operands
from ..plan_types import Buffer, LinearCrossEntropyPlan


@njit
def _round_row(L, i, code):
    for j in range(L.shape[1]):
        L[i, j] = D.round_f32(L[i, j], code)


@tjit
def _online_tile(lo, hi, L, row0, col0, code, m_run, s_run, tcol, picked):
    """Round L [nb, nv] to the input dtype in place; fold it into the running max/sum."""
    nb, nv = L.shape
    for i in range(lo, hi):
        r = row0 + i
        if code != 0:
            _round_row(L, i, code)
        mt, nan = row_max_nan(L[i], np.float32(-np.inf))
        if nan:
            mt = np.float32(np.nan)
        st = row_sum_exp(L[i], mt, np.float32(0.0))
        m0 = m_run[r]
        if m0 >= mt:
            mnew = m0
        elif mt > m0:
            mnew = mt
        else:  # a NaN on either side
            mnew = np.float32(np.nan)
        if mnew == -np.inf:
            s_run[r] = s_run[r] + st
        elif mt == -np.inf:
            # a tile of -inf logits only (st is exp(-inf + inf) = NaN) adds exp(-inf - mnew) = 0
            # per column: the running sum stays (m0 == mnew, the factor 1)
            pass
        elif m0 == -np.inf:
            # only -inf logits before this tile (s_run NaN, or 0 on the first tile): each adds 0
            s_run[r] = st * exp_f32(mt - mnew)
        else:
            s_run[r] = s_run[r] * exp_f32(m0 - mnew) + st * exp_f32(mt - mnew)
        m_run[r] = mnew
        t = tcol[r] - col0
        if t >= 0 and t < nv:
            picked[r] = L[i, t]


class OnlineStats:
    """The online max-sum's epilogue of the LM-head loop (``lm_head/loop.py``), per tile: the
    logits (rounded to ``logits_dtype`` first, as the kernel's matmul output), the running max
    and sum of exponentials per row, the target's logit, and the logits themselves when asked
    (``vocab_parallel_logits``)."""

    def __init__(
        self,
        ops: Operands,
        plan: LinearCrossEntropyPlan,
        code: int,
        lmax: np.ndarray,
        sexp: np.ndarray,
        tcol: np.ndarray,
        picked: np.ndarray,
        logits: np.ndarray | None,
    ) -> None:
        self.ops, self.code, self.tcol, self.out = ops, code, tcol, logits
        self.lmax, self.sexp, self.picked = lmax, sexp, picked  # the running statistics
        self.l_buf = ops.ws.take("logits_tile")  # (:meth:`buffers`, the plan's list)

    @staticmethod
    def buffers(bt: int, vt: int) -> list[Buffer]:
        """The buffer an :class:`OnlineStats` takes: the fp32 logits of one ``bt × vt`` tile."""
        return [Buffer("logits_tile", (bt, vt), "float32", "tile")]

    def begin(self, v0: int, v1: int) -> None:
        pass

    def tile(self, b0: int, b1: int, v0: int, v1: int) -> None:
        nb, nv = b1 - b0, v1 - v0
        Lt = self.l_buf[: nb * nv].reshape(nb, nv)
        self.ops.logits(b0, b1, Lt)
        run_rows(_online_tile, nb, Lt, b0, v0, self.code, self.lmax, self.sexp, self.tcol, self.picked)
        if self.out is not None:
            narrow(Lt, self.out[b0:b1, v0:v1])  # on the pool: no OpenMP region (fork-safe)

    def end(self, v0: int, v1: int) -> None:
        pass
