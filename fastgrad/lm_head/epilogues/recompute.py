"""The training loss's vocabulary-major recompute of the gradient from a saved log-sum-exp
(``_vocab_major``, :class:`_RecomputeGrad` on the LM-head loop; ``kernels/linear_cross_entropy.py``:
the module doc)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ... import dtypes as D
from ...kernels import _bf16dot
from ...kernels._gemm import (
    matmul_nn,
    matmul_nt,
    matmul_tn,
    run_rows,
    run_tasks,
)
from ..loop import Workspace, need
from ..loop import run as run_tiles
from ..params import GradOutputs, PassConstants, RowCoefficients
from ..passes import (
    _add_outer,
    _block,
    _colsum_into,
    _grad_pass,
    _round_g_bf16,
    _round_rows,
    add_target_rows,
    add_target_weight,
    col_means16,
    col_means16_tasks,
    live_rows,
)
from ..plan_types import BLAS, FAST_E_GROUP, Buffer, GemmChoice, TrainingPlan, b_size


def _bf16_logits(input, W, vc, plan, gemm, ws):
    """A :class:`_bf16dot.Logits` (its buffers from the plan's ``ws``) where the plan runs the
    logits on the bf16 kernel (``plan.logits16``, in the GEMM choice's ``a_form``), else None;
    a ``ValueError`` for such a plan on other operands."""
    if not plan.logits16:
        return None
    if input.dtype != D.BFLOAT16 or W.dtype != D.BFLOAT16:
        raise ValueError(f"plan.logits16 with {input.dtype} / {W.dtype} operands (bf16 expected)")
    return _bf16dot.Logits(input, W, vc, ws=ws, form=gemm.a_form, spec=_bf16dot.spec_named(gemm.variant))


def _vocab_major(
    input: np.ndarray,
    W: np.ndarray,
    cdt: Any,  # np.float32 or np.float64 (the compute dtype)
    grads: GradOutputs,
    rows: RowCoefficients,
    consts: PassConstants,
    plan: TrainingPlan,
    ws: Workspace,
    round_grad: bool = False,
    gemm: GemmChoice = BLAS,
    progress: Callable[[int, int], object] | None = None,
) -> None:
    """The gradient from a saved log-sum-exp, vocabulary chunk by vocabulary chunk, on the LM-head
    loop (``lm_head.loop.run`` over ``plan.recompute_grid``: vocabulary chunks outer, equal row blocks
    inner; :class:`_RecomputeGrad` is its operands and its epilogue).

    For each chunk of ``recompute_chunk`` columns: the weight's rows widened once; for each row
    block of at most ``recompute_rows`` rows (all rows while ``[BT, chunk]`` fits half the
    budget): the logits recomputed, turned into the gradient in place,
    ``grad_input[b] (+)= G·W[v]`` and ``grad_weight[v] (+)= Gᵀ·X[b]``.  A
    chunk's ``grad_weight`` is complete when its row loop ends, so a 16-bit ``grad_weight`` is
    rounded once from its fp32 sum (as the fp32 result rounded at the end) and no fp32 ``[K, H]``
    is held: the memory is the output plus ``O(vc·(BT + H))`` scratch.

    ``round_grad`` (``precision="fast"``), with the logits on the bf16 kernel: the gradient is
    rounded to bf16 in place and both gradient GEMMs run on the kernel (``W``'s chunk and ``X``'s
    rows interleaved as its ``B``), then the rounding error's mean part is added back (the op's
    docstring); the fp32 copies of ``X`` and of ``W``'s chunk are not made.

    ``grads``: (grad_input, grad_weight, its 16-bit bits or itself, its dtype code or None,
    grad_bias); ``rows``: the per-row arrays of ``_grad_pass`` (target column, target weight,
    lse, upstream coefficients, μ); ``consts``: (class weights, bias, par, flags); ``ws``: the
    plan's buffers (``tiling.training_buffers``); ``progress(done, total)`` after each tile.
    """
    grid = plan.recompute_grid
    rc = _RecomputeGrad(input, W, cdt, grads, rows, consts, plan, ws, round_grad, gemm)
    run_tiles(grid, rc, rc, progress)
    rc.finish()


class _RecomputeGrad:
    """The recompute's operands (:meth:`chunk`: the weight's chunk in the forms its GEMMs take)
    and its epilogue (:meth:`begin`, :meth:`tile`, :meth:`end`) for ``lm_head.loop.run``, then
    :meth:`finish` (``precision="fast"``: the rounding error's mean part of ``grad_input``).
    Arguments as :func:`_vocab_major`'s (its tiles: ``plan.recompute_grid``)."""

    def __init__(self, input, W, cdt, grads, rows, consts, plan, ws, round_grad, gemm):
        self.gi, self.gw, self.gw_acc, self.gw_code, self.gb = grads
        gw = self.gw
        self.rows, self.consts = rows, consts
        self.input, self.W, self.cdt, self.gemm = input, W, cdt, gemm
        self.spec = _bf16dot.spec_named(gemm.variant)  # the plan's native variant (None: BLAS)
        BT, H = input.shape
        self.BT, self.H = BT, H
        K = W.shape[0]
        grid = plan.recompute_grid
        vc, nblocks = grid.v_tile, grid.n_bt
        self.block_of = {b0: k for k, (b0, _) in enumerate(grid.bt_ranges())}
        self.nblocks = nblocks
        self.vc = vc
        self.bfl = bfl = _bf16_logits(input, W, vc, plan, gemm, ws)
        self.eng = gemm.engine
        # precision="fast": the gradient GEMMs on the kernel too, g rounded and compensated
        self.b16 = b16 = bfl is not None and round_grad
        widen_x = input.dtype != cdt and not b16
        # the buffers of :func:`buffers` (the plan's list), by name
        self.take, take, get = ws.take, ws.take, ws.get
        self.xall = None
        if nblocks == 1 and not b16:
            self.xall = _block(input, 0, BT, cdt, take("x_whole") if widen_x else None)
        self.xbuf = get("x_block")
        self.wbuf = take("w_chunk") if W.dtype != cdt and not b16 else None
        self.Lt = take("logits_block")
        self.th = get("grad_input_product")
        # a 16-bit grad_weight: the chunk summed in fp32 here, then rounded once
        self.tw = get("grad_weight_chunk")
        self.tw2 = get("grad_weight_product")
        self.offs = np.zeros(1, np.int64)
        self.xint = None
        if b16:
            nchunks = -(-K // vc)

            def zeros(name, shape):
                a = take(name)[: shape[0] * shape[1]].reshape(shape)
                a[...] = 0
                return a

            self.e_col = take("fast_e_col")  # the rounding error's partial column sums
            self.e_row = zeros("fast_e_row", (BT, nchunks))  # its row sums, per chunk
            self.e_t = take("fast_e_target")[:BT]  # the target column's, apart
            self.e_t[...] = 0
            self.w_bar = zeros("fast_w_mean", (nchunks, H))  # the chunk's mean row of W
            self.x_bar = zeros("fast_x_mean", (nblocks, H))  # the block's mean row of X
            xu = input.view(np.uint16)
            blocks = enumerate(grid.bt_ranges())
            tasks = []
            for k, (b0, b1) in blocks:  # each block's mean row over its live rows (not the ignored)
                live = live_rows(rows.coef_ce[b0:b1], rows.coef_z[b0:b1], rows.coef_h[b0:b1])
                tasks += col_means16_tasks(H, xu[b0:b1] if live is None else xu[b0:b1][live], D.BF16, self.x_bar[k])
            run_tasks(tasks)
            # X's rows as grad_weight's B (once with one row block), W's chunk as grad_input's B
            self.xi_buf = get("x_pairs_block")
            self.xint = _bf16dot.interleave(input, self.xi_buf) if (gw is not None and nblocks == 1) else None
            self.wi_buf = get("w_pairs_chunk")
        self.Wc = None
        self.widths = np.zeros(1, np.int64)

    # -- operands: the chunk's forms
    def chunk(self, v0: int, v1: int) -> None:
        W, H, bfl = self.W, self.H, self.bfl
        if self.b16:
            if bfl is None:  # b16 implies the kernel's logits (not an assert: python -O)
                raise ValueError("precision='fast' needs the bf16 logits kernel")
            bfl.chunk(v0, v1)
            self.Wc = _bf16dot.interleave(W[v0:v1], self.wi_buf) if self.gi is not None else None
            col_means16(H, W[v0:v1].view(np.uint16), D.BF16, self.w_bar[v0 // self.vc])
        else:
            self.Wc = W[v0:v1] if W.dtype == self.cdt else _block(W, v0, v1, self.cdt, self.wbuf)
            if bfl is not None:
                bfl.chunk(v0, v1)

    # -- epilogue
    def begin(self, v0: int, v1: int) -> None:
        self.widths = np.array([v1 - v0], np.int64)

    def tile(self, b0: int, b1: int, v0: int, v1: int) -> None:
        gi, gw, gb, H, eng, Lt = self.gi, self.gw, self.gb, self.H, self.eng, self.Lt
        tcol, wt_c, lse, coef_ce, coef_z, coef_h, zmean = self.rows
        cw_c, bias_c, par, flags = self.consts
        k = self.block_of[b0]
        nb, w = b1 - b0, v1 - v0
        if self.b16:
            X = self.xint
            if X is None and gw is not None:
                X = _bf16dot.interleave(self.input[b0:b1], self.xi_buf)
        else:
            X = self.xall[b0:b1] if self.xall is not None else _block(self.input, b0, b1, self.cdt, self.xbuf)
        G = Lt[: nb * w].reshape(nb, w)
        if self.bfl is not None:
            self.bfl.logits(b0, b1, G)
        else:
            matmul_nt(need(X, "the row block's X"), need(self.Wc, "the weight chunk"), G, engine=eng)
        run_rows(
            _grad_pass,
            nb,
            Lt,
            self.offs,
            self.widths,
            nb,
            cw_c,
            tcol[b0:b1],
            wt_c[b0:b1],
            lse[b0:b1],
            coef_ce[b0:b1],
            coef_z[b0:b1],
            coef_h[b0:b1],
            zmean[b0:b1],
            par,
            flags,
            True,
            bias_c,
            v0,
        )
        if gb is not None:
            run_rows(_colsum_into, w, Lt, 0, w, nb, gb, v0)
        acc = None
        if gw is not None:
            acc = gw[v0:v1] if self.tw is None else self.tw[: w * H].reshape(w, H)
        if self.b16:
            # g rounded to bf16 in place; gradient GEMMs of exact products on the kernel; the
            # rounding error's mean part restored: grad_input += (Σ_v e)·mean_v W (finish, one
            # GEMM over the chunks), grad_weight += (Σ_t e)·mean_t X; the target column's error
            # apart, with its own rows: grad_weight[t] += e_t·X, grad_input += e_t·W[t] (finish)
            ng = -(-nb // FAST_E_GROUP)
            ec = self.e_col[: ng * w].reshape(ng, w)
            e_t = self.e_t[b0:b1]
            run_rows(_round_g_bf16, ng, G, self.e_row[b0:b1, v0 // self.vc], ec, tcol[b0:b1], v0, e_t)
            if acc is not None:
                _bf16dot.matmul_tn(G, need(X, "X's pairs"), H, acc, acc=k > 0, form=self.gemm.a_form, spec=self.spec)
                run_rows(_add_outer, w, acc, ec.sum(0), self.x_bar[k])
                add_target_rows(acc, tcol[b0:b1], v0, e_t, self.input[b0:b1].view(np.uint16), D.BF16)
            if gi is not None:
                _bf16dot.matmul(
                    _bf16dot.pairs_in_place(G, self.gemm.a_form),
                    need(self.Wc, "W's pairs"),
                    H,
                    gi[b0:b1],
                    acc=v0 > 0,
                    spec=self.spec,
                )
            return
        if gi is not None:
            th = None if v0 == 0 else need(self.th, "grad_input_product")[: nb * H].reshape(nb, H)
            matmul_nn(G, need(self.Wc, "the weight chunk"), gi[b0:b1], tmp=th, engine=eng)
        if acc is not None:
            tw2 = None if k == 0 else need(self.tw2, "grad_weight_product")[: w * H].reshape(w, H)
            matmul_tn(G, need(X, "the row block's X"), acc, tmp=tw2, engine=eng)

    def end(self, v0: int, v1: int) -> None:
        if self.tw is not None:
            w = v1 - v0
            run_rows(_round_rows, w, self.gw_acc[v0:v1], self.tw[: w * self.H].reshape(w, self.H), self.gw_code)

    def finish(self) -> None:
        """``precision="fast"``: ``grad_input += e_row · w_bar`` (the rounding error's mean part),
        then the targets' ``e_t[i]·W[t_i]``."""
        if self.b16 and self.gi is not None:
            BT, H = self.BT, self.H
            tmp = self.take("fast_product")[: BT * H].reshape(BT, H)
            matmul_nn(self.e_row, self.w_bar, self.gi, tmp=tmp, engine=self.eng)
            add_target_weight(self.gi, self.rows.target_cols, self.e_t, self.W.view(np.uint16), D.BF16)


def buffers(
    plan: TrainingPlan,
    *,
    cdt: str,
    widen: bool,
    grads: tuple[bool, bool, bool],
    accum16: bool,
    fast: bool,
    a_form: str | None,
) -> list[Buffer]:
    """The buffers the recompute (:class:`_RecomputeGrad`) takes for ``plan.recompute_grid``:
    the bf16 logits' (``plan.logits16``), ``X`` and the weight's chunk in the compute dtype
    ``cdt`` (16-bit operands, ``widen``: ``X`` whole with one row block), the tile's logits, the
    accumulating GEMMs' scratch products, a 16-bit ``grad_weight``'s fp32 chunk (``accum16``), and
    ``precision="fast"``'s (``fast`` with the bf16 logits: the rounding error's sums, the mean
    rows, the bf16 pairs, the ``[BT, H]`` product).  ``grads``: which of (grad_input,
    grad_weight, grad_bias) are computed."""
    BT, K, H = plan.BT, plan.K, plan.H
    gi, gw, _gb = grads
    grid = plan.recompute_grid
    vc, nblocks, nr = grid.v_tile, grid.n_bt, grid.largest_bt
    out: list[Buffer] = []
    if plan.logits16:
        out += _bf16dot.Logits.buffers(BT, H, vc, f16=False, form=a_form)
    b16 = plan.logits16 and fast  # the gradient GEMMs on the bf16 kernel too
    widen_x = widen and not b16
    if widen_x and nblocks == 1:
        out.append(Buffer("x_whole", (BT, H), cdt, "call"))
    elif widen_x:
        out.append(Buffer("x_block", (nr, H), cdt, "tile"))
    if widen and not b16:
        out.append(Buffer("w_chunk", (vc, H), cdt, "tile"))
    out.append(Buffer("logits_block", (nr, vc), cdt, "tile"))
    if gi and not b16:
        out.append(Buffer("grad_input_product", (nr, H), cdt, "tile"))
    if gw and accum16:
        out.append(Buffer("grad_weight_chunk", (vc, H), cdt, "tile"))
    if gw and nblocks > 1 and not b16:
        out.append(Buffer("grad_weight_product", (vc, H), cdt, "tile"))
    if b16:
        nchunks = -(-K // vc)
        out += [
            Buffer("fast_e_col", (-(-nr // FAST_E_GROUP), vc), cdt, "tile"),
            Buffer("fast_e_row", (BT, nchunks), cdt, "call"),
            Buffer("fast_e_target", (BT,), cdt, "call"),
            Buffer("fast_w_mean", (nchunks, H), cdt, "call"),
            Buffer("fast_x_mean", (nblocks, H), cdt, "call"),
        ]
        if gw:
            out.append(Buffer("x_pairs_block", (b_size(nr, H),), "uint32", "tile"))
        if gi:
            out.append(Buffer("w_pairs_chunk", (b_size(vc, H),), "uint32", "tile"))
            out.append(Buffer("fast_product", (BT, H), cdt, "call"))
    return out
