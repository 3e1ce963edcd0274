"""The training loss's row-major order: :class:`_RowStep`, the epilogue of the LM-head loop's row
blocks (statistics sweep, gradient sweep, filtering's kept blocks, ``precision="fast"``'s bf16
gradient GEMMs; ``kernels/linear_cross_entropy.py``: the module doc)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import dtypes as D
from ...errors import InternalError
from ...kernels import _bf16dot
from ...kernels._gemm import (
    IN_BLAS,
    matmul_nn,
    nn_tasks,
    nt_tasks,
    row_tasks,
    run_rows,
    run_tasks,
    tn_tasks,
)
from ...kernels._linear import fp32_block_tasks
from ..loop import Sweep, Workspace, need, sweep
from ..params import GradOutputs, PassConstants, RowCoefficients
from ..passes import (
    F_BIAS,
    F_SOFTCAP,
    P_INV_TEMPERATURE,
    _add_outer,
    _block,
    _colsum_into,
    _filter_flags,
    _filtered_products,
    _grad_pass,
    _grad_round_bf16,
    _round_g_bf16,
    _scatter_add_rounded,
    _stats_chunk,
    add_target_rows,
    add_target_weight,
    col_means16,
    col_means16_tasks,
    live_rows,
)
from ..plan_types import FAST_E_GROUP, Buffer, GemmChoice, LossParams, TrainingPlan, b_size, fast_fused
from .recompute import _bf16_logits


def part_view(buf: np.ndarray, k: int, n: int) -> np.ndarray:
    """The ``B`` :func:`_bf16dot.interleave` wrote into ``buf`` for a ``[k, n]`` operand."""
    w = _bf16dot.b_cols(n)
    return buf[: ((k + 1) // 2) * w].reshape((k + 1) // 2, w)


class _RowStep:
    """The fused step's and the forward's epilogue of the LM-head loop's row-major order
    (``lm_head.loop.run_row_blocks`` over ``plan.row_blocks()``; the module doc's steps 1-4).  Per row block:

    * :meth:`statistics` — the sweep over the vocabulary chunks: the chunk's weight widened
      (16-bit, unless the whole weight was widened once), its logits (BLAS tiles, or the bf16
      kernel), its statistics (``_stats_chunk``; none with a saved ``lse``);
    * :meth:`end_statistics` — the row's statistics made global (``combine``) and written (lse,
      max, sum_exp, z_target, z_sum, argmax, z_mean, entropy); returns the gradient sweep:
      dense — the gradient pass (``_grad_pass``) and the chunk's weight, then the two gradient
      GEMMs and ``grad_bias``'s column sums (a 16-bit ``grad_weight``: its product, then its rounded
      scatter-add) — or, filtered, the gradient pass then ``grad_bias`` and the block flags;
    * :meth:`end_rows` — filtered: the kept blocks' products (``_filtered_products``), or the
      dense products where every block is kept.

    The sweeps run in stages where the plan says so (``plan.staged_statistics`` /
    ``plan.staged_gradient``).  Every buffer from the plan's list (``ws``).  Arguments after
    ``ws`` as :func:`_vocab_major`'s, and ``out``/``params``/``combine`` as
    :func:`linear_cross_entropy_cpu`'s; ``need_ent``: the entropy's statistic is computed."""

    def __init__(
        self,
        input: np.ndarray,
        W: np.ndarray,
        cdt: Any,  # np.float32 or np.float64 (the compute dtype)
        plan: TrainingPlan,
        gemm: GemmChoice,
        ws: Workspace,
        *,
        grads: GradOutputs,
        rows: RowCoefficients,
        consts: PassConstants,
        out: dict[str, Any],
        params: LossParams,
        combine: Callable | None,
        recompute: bool,
        need_ent: bool,
    ) -> None:
        self.input, self.W, self.cdt, self.plan = input, W, cdt, plan
        self.gi, self.gw, self.gw_acc, self.gw_code, self.gb = grads
        gi, gw, gw_code = self.gi, self.gw, self.gw_code
        self.tcol, self.wt_c, self.lse_all, self.coef_ce, self.coef_z, self.coef_h, self.zmean_all = rows
        self.rows = rows
        self.cw_c, self.bias_c, self.par, self.flags = consts
        self.out, self.combine, self.recompute, self.need_ent = out, combine, recompute, need_ent
        self.col0 = int(params.vocab_start_index)
        self.eng = gemm.engine
        H, K = input.shape[1], W.shape[0]
        self.H, self.K = H, K
        self.want_grad = gi is not None or gw is not None or self.gb is not None
        self.fwd_only = not self.want_grad
        vc = plan.v_chunk
        self.chunks = [(v0, min(K, v0 + vc)) for v0 in range(0, K, vc)]
        self.widen = widen = W.dtype != cdt
        take = ws.take
        # the logits of bf16 operands on the exact-product bf16 kernel where the plan says so;
        # the weight then needs no widening for the forward alone
        self.bfl = bfl = _bf16_logits(input, W, vc, plan, gemm, ws)
        # precision="fast" (plan.grad16): g rounded to bf16, both gradient GEMMs on the kernel too
        self.b16 = b16 = plan.grad16
        if b16 != fast_fused(
            logits16=plan.logits16,
            fast=params.round_grad,
            want_grad=gi is not None or gw is not None or self.gb is not None,
            recompute=recompute,
            filtering=plan.filter_rows > 0,
            accum16_gw=gw_code is not None,
            K=W.shape[0],
            BT=input.shape[0],
        ):
            raise InternalError(f"plan.grad16 is {b16}, the call's arguments say otherwise")
        # the whole weight in the compute dtype when it is small, else widened per chunk (in
        # plan.weight_buffers buffers where a sweep runs in stages: the next chunks widened while
        # chunk c is read); the buffers on recycled memory (fastgrad._outcache): a training loop's
        # next step takes no fresh pages (the buffers of :func:`buffers`, the plan's list, by name)
        get = ws.get
        self.wfull = _block(W, 0, K, cdt, take("w_whole")) if (widen and plan.whole_weight) else None
        # (with the logits on the bf16 kernel the chunk is read by grad_input's GEMM alone)
        wbuf = get("w_chunk")
        self.wbufs: tuple = ()
        if wbuf is not None:
            nxt = get("w_chunk_next")  # the staged sweeps' next chunks
            n = wbuf.size
            more = () if nxt is None else tuple(nxt[i * n : (i + 1) * n] for i in range(nxt.size // n))
            self.wbufs = (wbuf, *more)
        # the row block's X in the compute dtype: for the BLAS logits and the gradient GEMMs (the
        # forward alone on the bf16 logits kernel reads none)
        self.need_x = bfl is None or (self.want_grad and not b16)
        self.xbuf = take("x_block") if (input.dtype != cdt and self.need_x) else None
        self.Lbuf = take("logits_block")  # the row block's logits
        # the accumulating tiles' scratch products, unless they add in the BLAS call
        self.tmp_h = get("grad_input_product")
        self.tmp_w = get("grad_weight_product")  # (also a 16-bit grad_weight's products)
        self.all_rows = None
        if gw_code is not None:  # a 16-bit grad_weight's rows, for the rounded scatter-add
            self.all_rows = take("vocab_rows")[:K]
            self.all_rows[:] = np.arange(K, dtype=np.int64)
        par, flags = self.par, self.flags
        self.transform = bool(flags[F_SOFTCAP] or flags[F_BIAS] or par[P_INV_TEMPERATURE] != 1)
        self.first = True  # the first row block: grad_weight written, not summed onto
        self._filters(params, ws)
        self._w: dict[int, np.ndarray] = {}
        self.wpk_all: np.ndarray | None = None
        self.wi_all: np.ndarray | None = None
        if b16:
            self._fast_buffers(gemm, ws)

    def _fast_buffers(self, gemm, ws) -> None:
        """``precision="fast"``'s state (``plan.grad16``): the rounding error's sums, the chunks'
        mean rows of ``W`` (once per call), the row block's mean row of ``X`` (over its live
        rows, :func:`live_rows`), the bf16 pairs of ``X[b]`` (``grad_weight``'s ``B``) and of
        ``W``'s chunk (``grad_input``'s ``B``)."""
        H, take, get, vc = self.H, ws.take, ws.get, self.plan.v_chunk
        nch = len(self.chunks)
        self.spec = _bf16dot.spec_named(gemm.variant)
        self.form = gemm.a_form
        self.e_col = take("fast_e_col")
        self.e_row_buf = take("fast_e_row")
        self.e_t_buf = take("fast_e_target")
        self.w_bar = take("fast_w_mean")[: nch * H].reshape(nch, H)
        self.x_bar = take("fast_x_mean")[:H]
        wu = self.W.view(np.uint16)
        chunks = enumerate(self.chunks)
        run_tasks([t for c, (v0, v1) in chunks for t in col_means16_tasks(H, wu[v0:v1], D.BF16, self.w_bar[c])])
        self.xi_buf = get("x_pairs_block")
        self.wi_buf = get("w_pairs_chunk")
        self.prod = get("fast_product")
        # vdpbf16ps's A operands made by the fused pass (_grad_round16): gᵀ's pairs, G's own rows
        # paired — declared where that pass runs (grad_weight computed, no grad_bias) on that form
        self.gt_buf = get("fast_gt_pairs")
        self.xint: np.ndarray | None = None
        if self.plan.weight16_cached:  # the weight's two bf16 layouts, made in the first row block
            self.wpk_size = _bf16dot.b_size(H, vc)
            self.wpk_all = take("w_packed_all")
            self.wi_size = _bf16dot.b_size(vc, H)
            self.wi_all = get("w_pairs_all")

    def _filters(self, params, ws) -> None:
        """Gradient filtering's state (module doc): on when ``filter_eps`` is given with a gradient."""
        cdt, K, take, get = self.cdt, self.K, ws.take, ws.get
        feps = params.filter_eps
        self.fstats = self.out.get("filter_stats")
        if self.fstats is not None:
            self.fstats.setdefault("blocks_total", 0)
            self.fstats.setdefault("blocks_skipped", 0)
        self.filtered = self.plan.filter_rows > 0  # (training_modes: filter_eps given, a gradient, K > 0)
        if not self.filtered:
            return
        nb_max = self.plan.block_rows
        fb, rb = self.plan.filter_cols, self.plan.filter_rows
        self.fb, self.rb = fb, rb
        nblk = -(-K // fb)
        self.fflags = take("filter_flags")[: nb_max * nblk].reshape(nb_max, nblk)
        # the row scale: |upstream grad · 1/Σw| (coef_ce); a row whose gradient is identically 0
        # (ignored, or a zero upstream grad) is negligible everywhere
        coef_ce, coef_z = self.coef_ce, self.coef_z
        self.thr_all = np.where((coef_ce == 0) & (coef_z == 0), np.inf, float(feps) * np.abs(coef_ce)).astype(cdt)
        if not self.widen:
            self.fwsrc, self.fwcode = self.W, None
        elif self.wfull is not None:
            self.fwsrc, self.fwcode = self.wfull, None
        else:
            self.fwsrc, self.fwcode = self.W.view(np.uint16), D.code_of(self.W.dtype)
        self.fbufs = (take("kept_g"), get("kept_w"), get("kept_product"), get("kept_grad_weight"))

    # -- the row block
    def begin_rows(self, b0: int, b1: int) -> None:
        nb, cdt = b1 - b0, self.cdt
        self.b0, self.b1, self.nb = b0, b1, nb
        self.X = _block(self.input, b0, b1, cdt, self.xbuf) if self.need_x else self.input[b0:b1]
        ch = self.chunks
        self.offs = np.array([0 if self.fwd_only else nb * v0 for v0, _ in ch], np.int64) if ch else _EMPTY_I
        self.widths = np.array([v1 - v0 for v0, v1 in ch], np.int64) if ch else _EMPTY_I
        self._w = {}
        if self.b16:
            nch = len(self.chunks)
            self.e_row = self.e_row_buf[: nb * nch].reshape(nb, nch)
            self.e_row[...] = 0
            self.e_t = self.e_t_buf[:nb]
            self.e_t[...] = 0
            xu = self.input[b0:b1].view(np.uint16)
            live = live_rows(self.coef_ce[b0:b1], self.coef_z[b0:b1], self.coef_h[b0:b1])
            col_means16(self.H, xu if live is None else xu[live], D.BF16, self.x_bar)
            self.xint = None if self.xi_buf is None else _bf16dot.interleave(self.input[b0:b1], self.xi_buf)
        if not self.recompute:
            self.m = np.full(nb, -np.inf, cdt)
            self.s = np.zeros(nb, cdt)
            self.zt = np.zeros(nb, cdt)
            self.zs = np.zeros(nb, cdt)
            self.am = np.full(nb, -1, np.int64)
            self.sz = np.zeros(nb, cdt)

    def _chunk_block(self, c: int) -> np.ndarray:
        """Chunk ``c``'s part of the row block's logits (or gradient): ``[nb, v1 - v0]``."""
        v0, v1 = self.chunks[c]
        off = self.offs[c]
        return self.Lbuf[off : off + self.nb * (v1 - v0)].reshape(self.nb, v1 - v0)

    def _weight(self, c: int) -> list:
        """Chunk ``c``'s weight rows in the compute dtype (recorded for the chunk's GEMMs) and the
        tasks that widen them (none: already in the compute dtype, or widened whole)."""
        v0, v1 = self.chunks[c]
        if not self.widen:
            self._w[c] = self.W[v0:v1]
            return []
        if self.wfull is not None:
            self._w[c] = self.wfull[v0:v1]
            return []
        Wc, tasks = fp32_block_tasks(self.W, v0, v1, self.wbufs[c % len(self.wbufs)])
        self._w[c] = Wc
        return tasks

    # -- the statistics sweep
    def statistics(self) -> Sweep:
        """Per chunk: its weight, its logits, its statistics (the logits' GEMM tiles lead a stage)."""
        steps = (self._logits_weight, self._logits, self._stats)
        return Sweep(len(self.chunks), steps, staged=self.plan.staged_statistics, lead=1, uses=self._stats_uses)

    def _wkey(self, c: int) -> set:
        """The widened weight's buffer chunk ``c`` takes, as a resource (none: read-only)."""
        return {("w", c % len(self.wbufs))} if self.wbufs else set()

    def _stats_uses(self, k: int, c: int) -> tuple[set, set]:
        """What step ``k`` of the statistics sweep reads and writes for chunk ``c`` (``Sweep.uses``)."""
        L = ("L", c)
        if k == 0:  # the weight widened into its buffer
            return set(), self._wkey(c)
        if k == 1:  # the logits
            return self._wkey(c), {L}
        return set(), {L, "row_stats"}  # the transform in place, the running statistics

    def _logits_weight(self, c: int) -> list:
        return [] if self.bfl is not None else self._weight(c)

    def _logits(self, c: int) -> list:
        Lc = self._chunk_block(c)
        if self.bfl is not None:  # one task: the kernel's own parallel call, on this thread
            v0, v1 = self.chunks[c]
            return [functools.partial(self._logits16, v0, v1, Lc)]
        r, k = self.plan.logits_tile
        return nt_tasks(self.X, self._w[c], Lc, engine=self.eng, rows=r, cols=k)

    def _logits16(self, v0: int, v1: int, Lc: np.ndarray) -> None:
        if self.wpk_all is None:
            self.bfl.chunk(v0, v1)
        else:  # plan.weight16_cached: packed once, in the first row block, into its slice of the cache
            c = v0 // self.plan.v_chunk
            part = self.wpk_all[c * self.wpk_size : (c + 1) * self.wpk_size]
            if self.first:
                self.bfl.pbuf = part
                self.bfl.chunk(v0, v1)
            else:
                self.bfl.use(part, v1 - v0)
        self.bfl.logits(self.b0, self.b1, Lc)

    def _stats(self, c: int) -> list:
        """``_stats_chunk``'s tasks for chunk ``c`` (its last argument: the column shift — the forward
        alone keeps one chunk at a time at offset 0)."""
        if self.recompute:
            return []
        nb, b0, b1 = self.nb, self.b0, self.b1
        stats = (self.m, self.s, self.zt, self.zs, self.am, self.sz)
        shift = self.chunks[c][0] if self.fwd_only else 0
        consts = (self.bias_c, self.cw_c, self.tcol[b0:b1], self.par, self.flags, self.transform)
        return row_tasks(_stats_chunk, nb, self.Lbuf, self.offs[c], self.widths[c], nb, *consts, *stats, shift)

    def end_statistics(self) -> Sweep | None:
        """The row's statistics complete (made global, written); the gradient sweep, or None."""
        if not self.recompute:
            self._row_statistics()
        if not self.want_grad or not self.K:
            return None
        if self.filtered:
            self.fflags[: self.nb] = False
            return Sweep(len(self.chunks), (self._grad, self._colsum_flags))
        return self._gradient_sweep(with_pass=True, staged=self.plan.staged_gradient)

    def _row_statistics(self) -> None:
        b0, b1, cdt, out = self.b0, self.b1, self.cdt, self.out
        m, s, zt, zs, am, sz = self.m, self.s, self.zt, self.zs, self.am, self.sz
        zs[m == -np.inf] = 0  # a row without a finite logit: Σ w z is 0, as Σ exp
        am = np.where(am >= 0, am + self.col0, -1)
        if self.combine is not None:
            if self.need_ent:
                m, s, zt, zs, am, sz = self.combine(m, s, zt, zs, am, sz)
            else:
                m, s, zt, zs, am = self.combine(m, s, zt, zs, am)
        with np.errstate(divide="ignore", invalid="ignore"):
            lse_b = (m + np.log(s)).astype(cdt)
            if self.need_ent:  # μ = Σ p·z = max + Σ e·(z - max) / Σ e; entropy = lse - μ
                dz = np.asarray(sz) / s
                self.zmean_all[b0:b1] = (m + dz).astype(cdt)
                if out.get("entropy") is not None:
                    out["entropy"][b0:b1] = np.log(s) - dz
        self.lse_all[b0:b1] = lse_b
        for key, val in (("max", m), ("sum_exp", s), ("z_target", zt), ("z_sum", zs), ("argmax", am)):
            if out.get(key) is not None:
                out[key][b0:b1] = val

    # -- the gradient sweep
    def _gradient_sweep(self, *, with_pass: bool, staged: bool) -> Sweep:
        """Per chunk: (``with_pass``) its gradient pass, and its weight; its two gradient GEMMs
        (and ``grad_bias``'s column sums, ``with_pass``); a 16-bit ``grad_weight``'s product, then
        its rounded scatter-add.  The GEMM tiles lead a stage.  ``precision="fast"``
        (``plan.grad16``, chunk by chunk): the pass, ``grad_bias``'s sums, ``g`` rounded to bf16,
        then the two GEMMs on the bf16 kernel (:meth:`_fast_products`)."""
        if self.b16:
            if self.gb is None:  # no grad_bias sums of the unrounded G: the pass and the rounding fused
                return Sweep(len(self.chunks), (self._grad_round16, self._fast_products))
            return Sweep(len(self.chunks), (self._grad, self._colsum, self._round16, self._fast_products))
        steps: list[Callable[[int], list]] = [
            functools.partial(self._pass_and_weight, with_pass),
            self._grad_input_product,
            functools.partial(self._grad_weight_product, with_pass),
        ]
        if self.gw is not None and self.gw_code is not None:
            steps += [self._grad_weight16, self._grad_weight16_add]
        uses = functools.partial(self._grad_uses, with_pass)
        return Sweep(len(self.chunks), tuple(steps), staged=staged, lead=(1, 2), uses=uses)

    def _grad_uses(self, with_pass: bool, k: int, c: int) -> tuple[set, set]:
        """What step ``k`` of the gradient sweep reads and writes for chunk ``c`` (``Sweep.uses``)."""
        L = ("L", c)
        if k == 0:  # the gradient pass in place, the weight widened for grad_input's GEMM
            return set(), ({L} if with_pass else set()) | (self._wkey(c) if self.gi is not None else set())
        if k == 1:  # grad_input[b] (+)= G·W[v]: one accumulator over the chunks
            return {L} | self._wkey(c), ({"grad_input"} if self.gi is not None else set())
        if k == 2:  # grad_weight[v] (+)= Gᵀ·X[b] (a shared scratch unless summed in the call), grad_bias[v]
            w: set = {("grad_weight", c), ("grad_bias", c)}
            if self.gw is not None and self.gw_code is None and not self.first and not self.plan.accumulate_in_gemm:
                w.add("grad_weight_product")
            return {L}, w
        if k == 3:  # a 16-bit grad_weight: the chunk's product into scratch
            return {L}, {"grad_weight_product"}
        return {"grad_weight_product"}, {"grad_weight"}  # ... rounded onto the output

    def _grad(self, c: int) -> list:
        """``_grad_pass``'s tasks: chunk ``c``'s logits overwritten by the gradient ``G``."""
        b0, b1, nb = self.b0, self.b1, self.nb
        rows = tuple(a[b0:b1] for a in self.rows)
        args = (self.Lbuf, self.offs[c : c + 1], self.widths[c : c + 1], nb, self.cw_c, *rows)
        return row_tasks(_grad_pass, nb, *args, self.par, self.flags, self.recompute, self.bias_c, 0)

    def _round16(self, c: int) -> list:
        """``precision="fast"``: chunk ``c``'s ``G`` rounded to bf16 in place, its rounding error
        summed per row (``e_row[:, c]``) and per row group and column (``e_col``), the target
        column's apart (``e_t``)."""
        nb, w = self.nb, self.widths[c]
        ng = -(-nb // FAST_E_GROUP)
        ec = self.e_col[: ng * w].reshape(ng, w)
        tc = self.tcol[self.b0 : self.b1]
        return row_tasks(_round_g_bf16, ng, self._chunk_block(c), self.e_row[:, c], ec, tc, self.chunks[c][0], self.e_t)

    def _grad_round16(self, c: int) -> list:
        """:meth:`_grad` then :meth:`_round16` of chunk ``c`` as one pass, row group by row group
        (``_grad_round_bf16``: the same bits; no ``grad_bias`` to sum in between), which on the
        ``vdpbf16ps`` form (the plan declared ``fast_gt_pairs``) also makes both gradient GEMMs'
        ``A``: ``gᵀ``'s pairs and ``G``'s rows paired in place (:meth:`_fast_products_run`)."""
        b0, b1, nb, w = self.b0, self.b1, self.nb, int(self.widths[c])
        rows = tuple(a[b0:b1] for a in self.rows)
        args = (self.Lbuf, self.offs[c : c + 1], self.widths[c : c + 1], nb, self.cw_c, rows, self.par, self.flags)
        ng = -(-nb // FAST_E_GROUP)
        ec = self.e_col[: ng * w].reshape(ng, w)
        G = self._chunk_block(c)
        u = G.view(np.uint32)
        no = np.empty((0, 0), np.uint32)
        if self.gt_buf is not None:
            pairs = (u, u[:, : (w + 1) // 2] if self.gi is not None else no, self._gt_pairs(w, nb))
        else:
            pairs = (u, no, no)
        e_sums = (self.e_row[:, c], ec, self.e_t)
        return row_tasks(_grad_round_bf16, ng, *args, self.recompute, self.bias_c, 0, G, *e_sums, pairs)

    def _gt_pairs(self, w: int, nb: int) -> np.ndarray:
        """``gᵀ``'s pairs ``[w, ceil(nb/2)]`` of the current chunk in ``fast_gt_pairs``."""
        kp = (nb + 1) // 2
        return need(self.gt_buf, "fast_gt_pairs")[: w * kp].reshape(w, kp)

    def _fast_products(self, c: int) -> list:
        """``precision="fast"``: chunk ``c``'s two gradient GEMMs on the bf16 kernel (one task:
        the kernel's own parallel calls, on this thread) — ``grad_weight[v] (+)= Gᵀ·X[b]`` and
        the mean part of the rounding error ``(Σ_t e)·mean_t X[b]`` and the targets' own
        ``e_t[i]·X[i]`` (:func:`add_target_rows`), then ``grad_input[b] (+)=
        G·W[v]`` (``G`` overwritten by its pairs); where the fused pass made both ``A`` operands,
        the two GEMMs' tiles as one task list (one barrier, ``grad_input``'s tiles first)."""
        return [functools.partial(self._fast_products_run, c)]

    def _fast_products_run(self, c: int) -> None:
        v0, v1 = self.chunks[c]
        G, H, nb, w = self._chunk_block(c), self.H, self.nb, v1 - v0
        pre = self.gt_buf is not None  # A made by the fused pass (_grad_round16)
        tasks: list = []
        if self.gi is not None and pre:
            tasks = self._grad_input_tasks(G, c, pre)
        if self.gw is not None:
            acc = self.gw[v0:v1]
            xi = need(self.xint, "X's pairs")
            if pre:  # gᵀ's pairs: the same sums as matmul_tn's
                gt = self._gt_pairs(w, nb)
                run_tasks(tasks + _bf16dot.matmul_tasks(gt, xi, H, acc, not self.first, spec=self.spec))
                tasks = []
            else:
                _bf16dot.matmul_tn(G, xi, H, acc, acc=not self.first, form=self.form, spec=self.spec)
            ng = -(-nb // FAST_E_GROUP)
            run_rows(_add_outer, w, acc, self.e_col[: ng * w].reshape(ng, w).sum(0), self.x_bar)
            xu = self.input[self.b0 : self.b1].view(np.uint16)
            add_target_rows(acc, self.tcol[self.b0 : self.b1], v0, self.e_t, xu, D.BF16)
        if self.gi is not None and not pre:
            tasks = self._grad_input_tasks(G, c, pre)
        run_tasks(tasks)

    def _grad_input_tasks(self, G: np.ndarray, c: int, pre: bool) -> list:
        """``grad_input[b] (+)= G·W[v]`` of chunk ``c`` on the bf16 kernel, as tasks (``W``'s chunk
        paired first, unless cached; ``G``'s rows paired in place unless ``pre``)."""
        v0, v1 = self.chunks[c]
        w, H = v1 - v0, self.H
        if self.wi_all is None:
            wi = _bf16dot.interleave(self.W[v0:v1], self.wi_buf)
        else:  # plan.weight16_cached: paired once, in the first row block
            k = v0 // self.plan.v_chunk
            part = self.wi_all[k * self.wi_size : (k + 1) * self.wi_size]
            wi = _bf16dot.interleave(self.W[v0:v1], part) if self.first else part_view(part, w, H)
        gi = need(self.gi, "grad_input")[self.b0 : self.b1]
        A = G.view(np.uint32)[:, : (w + 1) // 2] if pre else _bf16dot.pairs_in_place(G, self.form)
        return _bf16dot.matmul_tasks(A, wi, H, gi, v0 > 0, spec=self.spec)

    def _colsum(self, c: int) -> list:
        if self.gb is None:
            return []
        nb, off, w = self.nb, self.offs[c], self.widths[c]
        return row_tasks(_colsum_into, w, self.Lbuf, off, w, nb, self.gb, off // nb)

    def _pass_and_weight(self, with_pass: bool, c: int) -> list:
        return (self._grad(c) if with_pass else []) + (self._weight(c) if self.gi is not None else [])

    def _grad_input_product(self, c: int) -> list:
        """``grad_input[b] (+)= G·W[v]`` for chunk ``c``, as tasks (summed over the chunks: in the
        BLAS call, or through the scratch product)."""
        if self.gi is None:
            return []
        v0 = self.chunks[c][0]
        nb, H, b0, b1 = self.nb, self.H, self.b0, self.b1
        tmp = self._sum_with(v0 == 0, self.tmp_h, (nb, H))
        r, k = self.plan.grad_input_tile
        return nn_tasks(self._chunk_block(c), self._w[c], self.gi[b0:b1], tmp, self.eng, rows=r, cols=k)

    def _sum_with(self, first: bool, scratch, shape: tuple[int, int]):
        """An accumulating tile's ``tmp`` (``_gemm._mm_into``): None for the first term (written),
        else ``IN_BLAS`` where the plan sums in the BLAS call, or ``scratch``'s first ``shape``."""
        if first:
            return None
        if self.plan.accumulate_in_gemm:
            return IN_BLAS
        return scratch[: shape[0] * shape[1]].reshape(shape)

    def _grad_weight_product(self, with_colsum: bool, c: int) -> list:
        """(In the compute dtype) ``grad_weight[v] (+)= Gᵀ·X[b]`` for chunk ``c``, as tasks (summed
        over the row blocks), and ``grad_bias``'s column sums (``with_colsum``)."""
        t = []
        if self.gw is not None and self.gw_code is None:
            v0, v1 = self.chunks[c]
            tmp = self._sum_with(self.first, self.tmp_w, (v1 - v0, self.H))
            t = tn_tasks(self._chunk_block(c), self.X, self.gw[v0:v1], tmp, self.eng, rows=self.plan.grad_weight_rows)
        return t + (self._colsum(c) if with_colsum else [])

    def _grad_weight16(self, c: int) -> list:
        """A 16-bit ``grad_weight`` (``accum_dtype``): chunk ``c``'s ``Gᵀ·X[b]`` into scratch."""
        v0, v1 = self.chunks[c]
        tw = need(self.tmp_w, "grad_weight_product")[: (v1 - v0) * self.H].reshape(v1 - v0, self.H)
        return tn_tasks(self._chunk_block(c), self.X, tw, None, self.eng, rows=self.plan.grad_weight_rows)

    def _grad_weight16_add(self, c: int) -> list:
        """... then summed onto the output's rows with rounding (the output zeroed first)."""
        v0, v1 = self.chunks[c]
        tw = need(self.tmp_w, "grad_weight_product")[: (v1 - v0) * self.H].reshape(v1 - v0, self.H)
        rows = need(self.all_rows, "vocab_rows")[v0:v1]
        return row_tasks(_scatter_add_rounded, v1 - v0, self.gw_acc, rows, tw, self.gw_code)

    def _colsum_flags(self, c: int) -> list:
        """Filtered: ``grad_bias``'s column sums and the block flags of chunk ``c`` (read-only on ``G``)."""
        nb, b0, b1 = self.nb, self.b0, self.b1
        F = self.fflags[:nb]
        thr = self.thr_all[b0:b1]
        flags = row_tasks(_filter_flags, nb, self.Lbuf, self.offs[c], self.widths[c], nb, thr, self.fb, F)
        return self._colsum(c) + flags

    def end_rows(self) -> None:
        """Filtered: the kept blocks' products (or the dense ones where every block is kept).
        ``precision="fast"``: ``grad_input[b] += e_row · w_bar``, the rounding error's mean part
        over the chunks, then the targets' ``e_t[i]·W[t_i]`` (:func:`add_target_weight`)."""
        if self.filtered:
            self._kept_products()
        if self.b16 and self.gi is not None and self.want_grad and self.K:
            nb, H = self.nb, self.H
            tmp = need(self.prod, "fast_product")[: nb * H].reshape(nb, H)
            gi = self.gi[self.b0 : self.b1]
            matmul_nn(self.e_row, self.w_bar, gi, tmp=tmp, engine=self.eng)
            add_target_weight(gi, self.tcol[self.b0 : self.b1], self.e_t, self.W.view(np.uint16), D.BF16)
        self.first = False

    def _kept_products(self) -> None:
        nb, b0, b1, fb, rb, K = self.nb, self.b0, self.b1, self.fb, self.rb, self.K
        F = self.fflags[:nb]
        tc = self.tcol[b0:b1]
        own = np.flatnonzero(tc >= 0)
        F[own, tc[own] // fb] = True  # the target column is never filtered
        keep = np.logical_or.reduceat(F, np.arange(0, nb, rb), axis=0)
        n_keep = int(keep.sum())
        if self.fstats is not None:
            self.fstats["blocks_total"] += keep.size
            self.fstats["blocks_skipped"] += keep.size - n_keep
        if n_keep == keep.size:  # every block kept: the dense path, unchanged (bitwise)
            sweep(self._gradient_sweep(with_pass=False, staged=False), self.eng)
            return
        _filtered_products(
            self.Lbuf,
            self.offs,
            self.widths,
            nb,
            keep,
            fb,
            rb,
            K,
            self.plan.v_chunk,
            self.fwsrc,
            self.fwcode,
            self.X,
            None if self.gi is None else self.gi[b0:b1],
            self.gw_acc,
            self.fbufs,
            self.gw_code,
            self.eng,
        )


_EMPTY_I = np.zeros(0, np.int64)


def buffers(
    plan: TrainingPlan,
    *,
    cdt: str,
    widen: bool,
    grads: tuple[bool, bool, bool],
    accum16: bool,
    a_form: str | None,
) -> list[Buffer]:
    """The buffers the row blocks (:class:`_RowStep`) take for ``plan`` in the compute dtype
    ``cdt``: the bf16 logits' (``plan.logits16``), the weight whole or by chunk
    (``plan.weight_buffers`` chunks where the statistics run in stages) and the row block's
    ``X`` for 16-bit operands (``widen``), the row block's logits (a chunk of them for the
    forward alone), ``precision="fast"``'s (``plan.grad16``: the rounding error's sums, the mean
    rows, the bf16 pairs, the weight's layouts kept across the row blocks), the accumulating
    GEMMs' scratch products (unless they add in the BLAS call), a 16-bit ``grad_weight``'s rows
    (``accum16``), and gradient filtering's (``plan.filter_rows``).  ``grads``: which of
    (grad_input, grad_weight, grad_bias) are computed."""
    BT, K, H, logits16 = plan.BT, plan.K, plan.H, plan.logits16
    gi, gw, gb = grads
    want_grad = gi or gw or gb
    vc, nb_rows = plan.v_chunk, plan.largest_block
    out: list[Buffer] = []

    def add(name: str, shape: tuple[int, ...], dt: str, scope: str) -> None:
        out.append(Buffer(name, tuple(int(d) for d in shape), dt, scope))

    if logits16:
        out += _bf16dot.Logits.buffers(BT, H, vc, f16=False, form=a_form)
    g16 = plan.grad16  # the gradient GEMMs on the bf16 kernel: no fp32 weight or X
    if widen and plan.whole_weight:
        add("w_whole", (K, H), cdt, "call")
    elif widen and (not logits16 or (gi and not g16)):  # with the bf16 logits kernel: grad_input's operand only
        add("w_chunk", (vc, H), cdt, "tile")
        if plan.weight_buffers > 1:  # the staged sweeps' next chunks
            add("w_chunk_next", (plan.weight_buffers - 1, vc, H), cdt, "tile")
    if widen and (not logits16 or (want_grad and not g16)):  # the forward alone on the bf16 kernel reads no X
        add("x_block", (nb_rows, H), cdt, "tile")
    add("logits_block", (nb_rows, max(K, 1) if want_grad else vc), cdt, "tile")
    if g16:
        nchunks = -(-K // vc)
        add("fast_e_col", (-(-nb_rows // FAST_E_GROUP), vc), cdt, "tile")
        add("fast_e_row", (nb_rows, nchunks), cdt, "tile")
        add("fast_e_target", (nb_rows,), cdt, "tile")
        add("fast_w_mean", (nchunks, H), cdt, "call")
        add("fast_x_mean", (1, H), cdt, "tile")
        if gw:
            add("x_pairs_block", (b_size(nb_rows, H),), "uint32", "tile")
            if a_form == "pairs" and not gb:  # gᵀ's pairs, made by the fused pass (_grad_round16)
                add("fast_gt_pairs", (vc, (nb_rows + 1) // 2), "uint32", "tile")
        if gi:
            add("w_pairs_chunk", (b_size(vc, H),), "uint32", "tile")
            add("fast_product", (nb_rows, H), cdt, "tile")
        if plan.weight16_cached:  # the weight's two layouts, kept across the row blocks
            add("w_packed_all", (nchunks * b_size(H, vc),), "uint32", "call")
            if gi:
                add("w_pairs_all", (nchunks * b_size(vc, H),), "uint32", "call")
    if gi and not plan.accumulate_in_gemm and not g16:
        add("grad_input_product", (nb_rows, H), cdt, "tile")
    if gw and not g16:
        if accum16 or not plan.accumulate_in_gemm:  # (a 16-bit grad_weight: its products' scratch)
            add("grad_weight_product", (vc, H), cdt, "tile")
        if accum16:
            add("vocab_rows", (K,), "int64", "call")
    if plan.filter_rows:  # gradient filtering (training_modes)
        rb = plan.filter_rows
        add("filter_flags", (plan.block_rows, -(-K // plan.filter_cols)), "bool", "tile")
        add("kept_g", (rb, vc), cdt, "tile")
        if gi:
            add("kept_w", (vc, H), cdt, "tile")
            add("kept_product", (rb, H), cdt, "tile")
        if gw:
            add("kept_grad_weight", (vc, H), cdt, "tile")
    return out
