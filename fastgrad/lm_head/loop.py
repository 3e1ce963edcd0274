"""The LM-head loop of the aclnn ops: one tile order, one logits source, named epilogues.

``FusedLinearOnlineMaxSum`` and ``FusedLinearCrossEntropyLossGrad`` walk the same tile plan
(``tiling.LinearCETiling``: vocabulary tiles outer, row tiles inner) over the same logits
``L = X[b] · W[v]ᵀ``; they differ only in what they do with each tile.  This module holds what
they share:

* :class:`Operands` — ``X`` and the weight's vocabulary tiles in the forms the plan's GEMMs take
  (``plan.gemm``, the op layer's choice): the native exact-product kernel's packed operands
  (``_bf16dot.Logits``) or fp32 rows for BLAS (16-bit tiles widened exactly, padded to the fp32
  kernel's ``B`` width for fp16), and the logits GEMM of a tile;
* :func:`run` — the loop: per vocabulary tile ``operands.chunk`` then ``epilogue.begin``, per
  row tile ``epilogue.tile``, then ``epilogue.end``; the progress hook after each tile.

An epilogue is an object with ``begin(v0, v1)``, ``tile(b0, b1, v0, v1)`` and ``end(v0, v1)``
(:class:`Epilogue`); the ops' epilogues are ``fused_linear_online_max_sum.OnlineStats`` (the
online max/sum and the target's logit) and ``fused_linear_cross_entropy_loss_grad.FlceGrad`` (the
device's epilogue with its roundings, gradient filtering, the two gradient GEMMs).  A new
LM-head feature of these ops is a new epilogue in its op's kernel file; the loop, the operands
and the GEMM choice do not change.  The training loss (``kernels/linear_cross_entropy.py``) runs its
recompute from a saved log-sum-exp on this loop (``_RecomputeGrad``: its operands and epilogue
over ``TrainingPlan.recompute_grid``).

Its fused step and forward take the other order, :func:`run_row_blocks` — row blocks outer, because a
row's gradient needs the row's statistics over the whole vocabulary first (and, vocabulary-
parallel, the all-reduce of each block's statistics): per row block, a **statistics sweep** over
the vocabulary chunks, ``end_statistics`` (the row's statistics complete), a **gradient sweep**,
``end_rows``.  A sweep (:class:`Sweep`) is per-chunk steps given as task lists; :func:`sweep` runs
them chunk by chunk or in stages (software pipelining: chunk ``c``'s GEMM tiles beside chunk
``c + 1``'s widening and the element-wise pass of its neighbour), the same tasks either way, so
the same bits.  Where the steps say what they read and write (``Sweep.uses``) the stages are a
priority, not barriers: the sweep runs as a dependency graph (``_gemm.run_graph``) whose edges
are the conflicts of the chunk-by-chunk order, so a stage's last tiles no longer hold the next
stage's back (the pool's idle time in the training step fell to about a third:
bench/results/README.md).  The epilogue (``linear_cross_entropy._RowStep``) says what each
step computes and uses; the loop, the stage schedule and the graph are here.

Both orders take their buffers from the plan's list through :class:`Workspace`.

Nothing here reads a setting: the GEMMs are the plan's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from .. import dtypes as D
from .._outcache import empty as scratch
from ..errors import InternalError
from ..kernels import _bf16dot
from ..kernels._gemm import matmul_nt, nn_tasks, run_graph, run_tasks, tn_tasks
from ..kernels._linear import fp32_block
from .plan_types import Buffer, GemmChoice, LinearCrossEntropyPlan, TrainingPlan, b_size, fp32_operands, npad

__all__ = [
    "Workspace",
    "Operands",
    "Epilogue",
    "TilePlan",
    "ChunkOperands",
    "run",
    "Sweep",
    "sweep",
    "RowPlan",
    "RowEpilogue",
    "run_row_blocks",
]


_T = TypeVar("_T")


def need(x: _T | None, what: str) -> _T:
    """``x``, which the plan's buffer list or the call's arguments guarantee here; an
    :class:`~fastgrad.errors.InternalError` naming ``what`` where that broke (never ``assert``:
    ``python -O`` removes those)."""
    if x is None:
        raise InternalError(f"{what} is missing (the plan and the kernel disagree)")
    return x


class Workspace:
    """The plan's buffers (``plan.buffers``), handed out by name — the only memory the loop
    allocates, so the plan's ``workspace_bytes`` is what a call holds.  Each buffer is declared
    once, by the component that takes it (``Operands.buffers``, ``_bf16dot.Logits.buffers``, the
    epilogues' ``buffers``), and the plan's list is the concatenation of those declarations
    (``tiling.lm_head_buffers`` / ``training_buffers``): the components take them by name and
    restate neither size, dtype nor the condition.

    :meth:`take` returns the declared buffer as a flat array of its size and dtype (recycled
    scratch, ``fastgrad._outcache``); a name the plan does not declare is an
    :class:`~fastgrad.errors.InternalError` (a plan made for other operands or another GEMM
    choice).  :meth:`get`: the same, or None where the plan declares no such buffer (a buffer
    the call needs only in some cases: the declaration's condition decides)."""

    def __init__(self, plan: LinearCrossEntropyPlan | TrainingPlan):
        self._listed = {b.name: b for b in plan.buffers}

    def take(self, name: str) -> np.ndarray:
        b = self._listed.get(name)
        if b is None:
            raise InternalError(
                f"the plan declares no buffer {name!r} (it declares {sorted(self._listed)}): made for other operands?"
            )
        return scratch(b.size, b.dtype)

    def get(self, name: str) -> np.ndarray | None:
        return self.take(name) if name in self._listed else None


class Epilogue(Protocol):
    """What the loop calls (see the module doc)."""

    def begin(self, v0: int, v1: int) -> None: ...

    def tile(self, b0: int, b1: int, v0: int, v1: int) -> None: ...

    def end(self, v0: int, v1: int) -> None: ...


class Operands:
    """The GEMM engine of one call: ``X`` and ``W``'s vocabulary tiles in the forms the plan's
    GEMMs take (``plan.gemm``: BLAS / oneDNN over fp32 operands, or the native exact-product
    kernel), prepared once (``X``) or once per tile (:meth:`chunk`), and the three products of
    the loop — :meth:`logits` ``X[b]·W[v]ᵀ``, :meth:`grad_weight` ``(+)= Gᵀ·X[b]`` and
    :meth:`grad_input` ``+= G·W[v]`` — into fp32 accumulators.

    ``logits``: the logits GEMM is needed (False: high-performance mode, ``softmax`` given).
    ``weight_tiles``: ``"logits"`` — fp32 tiles of ``W`` only where the logits run on BLAS (the
    online max-sum); ``"all"`` — fp32 tiles for every non-bf16 path (the FLCE grad's gradient
    GEMMs take them as ``B``; padded to ``_bf16dot.npad(H)`` columns on the fp32 kernel).

    Attributes after :meth:`chunk`: ``W32p`` (the padded fp32 tile or None) and ``W32`` (its
    first ``H`` columns); ``Xp`` / ``X32`` likewise for ``X`` (None on the bf16 kernel)."""

    def __init__(
        self,
        input: np.ndarray,
        weight: np.ndarray,
        plan: LinearCrossEntropyPlan,
        *,
        logits: bool = True,
        weight_tiles: str = "logits",
    ):
        if weight_tiles not in ("logits", "all"):
            raise ValueError(f"weight_tiles must be 'logits' or 'all', got {weight_tiles!r}")
        if input.ndim != 2 or weight.ndim != 2 or input.shape[1] != weight.shape[1]:
            raise ValueError(f"input [BT, H] and weight [V, H] must share H, got {input.shape} and {weight.shape}")
        if input.dtype != weight.dtype:
            raise ValueError(f"input and weight must share a dtype, got {input.dtype} and {weight.dtype}")
        BT, H = input.shape
        self.H = H
        self.kind = plan.gemm.exact_for(input, weight)  # "bf16", "f32" (fp16 operands) or None (BLAS)
        self.engine = plan.gemm.engine
        self.form = plan.gemm.a_form  # the native variant's A form (bf16: "pairs" or "f32")
        self.spec = _bf16dot.spec_named(plan.gemm.variant) if self.kind else None  # the plan's variant
        self.b16, self.f16k = self.kind == "bf16", self.kind == "f32"
        self.Hp = _bf16dot.npad(H) if self.f16k else H
        self.W = weight if weight.flags.c_contiguous else np.ascontiguousarray(weight)
        self.ws = ws = Workspace(plan)
        self._gi_tile = plan.grad_input_tile  # grad_input's G·W grid (the plan's, from the shapes)
        # fp32 X and W tiles where a GEMM of this call runs on BLAS or the fp32 kernel takes them
        self._fp32 = fp32_operands(weight_tiles == "all", self.kind)
        # (the buffers: :meth:`buffers`, the plan's list; 16-bit operands widened into them — a plan
        # made for fp32 operands declares none, and is refused here)
        widen = self._fp32 and input.dtype != D.FLOAT32
        self.Xp = fp32_block(input, 0, BT, ws.take("x32") if widen else None, width=self.Hp) if self._fp32 else None
        self.X32 = None if self.Xp is None else self.Xp[:, :H]
        self._w_buf = ws.take("w32_tile") if widen else None
        # the logits on the exact-product kernel (its packed W tile, X in its A form)
        self.lg = None
        if self.kind and logits:
            self.lg = _bf16dot.Logits(input, self.W, plan.v_tile, self.Xp, ws=ws, form=self.form, spec=self.spec)
        self.W32p: np.ndarray | None = None
        self.W32: np.ndarray | None = None
        # the gradient GEMMs' operands and products (weight_tiles="all": the FLCE grad)
        self.xinter: dict[int, np.ndarray] = {}
        self.wt_inter = self.prod = self.gw_tmp = None
        if weight_tiles == "all":
            if self.b16:  # X's row tiles as grad_weight's B, once, in one buffer; W's tile as grad_input's
                rows = [(b0, b1, _bf16dot.b_size(b1 - b0, H)) for b0, b1 in plan.bt_ranges()]
                xi = ws.take("x_pairs_tiles")
                o = 0
                for b0, b1, n in rows:
                    self.xinter[b0] = _bf16dot.interleave(input[b0:b1], xi[o : o + n])
                    o += n
                self.wt_inter = ws.take("w_pairs_tile")
            elif self.kind is None:  # BLAS: each product into scratch, then summed
                self.prod = ws.take("product")
                self.gw_tmp = ws.get("grad_weight_product")
        self._bp_i: np.ndarray | None = None
        self._v = (0, 0)

    @staticmethod
    def buffers(
        BT: int, H: int, bt: int, vt: int, *, dtype: str, gemm: GemmChoice, logits: bool, grad: bool
    ) -> list[Buffer]:
        """The buffers :class:`Operands` takes for a plan of ``bt × vt`` tiles over ``BT`` rows of
        hidden size ``H``, ``dtype`` operands and the GEMMs ``gemm``; ``logits``/``grad``: the
        logits GEMM runs (not high-performance mode) / the gradient GEMMs run (``weight_tiles="all"``).
        fp32 copies of ``X`` (once) and ``W``'s tile where BLAS or the fp32 kernel takes 16-bit
        operands, the native logits' (``_bf16dot.Logits.buffers``), and the gradient GEMMs': ``X``'s
        row tiles and ``W``'s tile as the bf16 kernel's ``B``, or BLAS's scratch products."""
        kind = gemm.exact_for_dtype(dtype)
        b16, f16k = kind == "bf16", kind == "f32"
        hp = npad(H) if f16k else H
        fp32 = fp32_operands(grad, kind)
        out = []
        if fp32 and dtype != "float32":
            out += [Buffer("x32", (BT, hp), "float32", "call"), Buffer("w32_tile", (vt, hp), "float32", "tile")]
        if kind is not None and logits:
            out += _bf16dot.Logits.buffers(BT, H, vt, f16=f16k, form=gemm.a_form, x_given=fp32)
        if grad and b16:
            # the row tiles' pairs: the full tiles', then the last one's (closed form: any BT)
            rows = (BT // bt) * b_size(bt, H) + (b_size(BT % bt, H) if BT % bt else 0) if bt else 0
            out += [
                Buffer("x_pairs_tiles", (rows,), "uint32", "call"),
                Buffer("w_pairs_tile", (b_size(vt, H),), "uint32", "tile"),
            ]
        elif grad and kind is None:  # BLAS: each product into scratch, then summed over the row tiles
            out.append(Buffer("product", (bt, H), "float32", "tile"))
            if bt and -(-BT // bt) > 1:
                out.append(Buffer("grad_weight_product", (vt, H), "float32", "tile"))
        return out

    def chunk(self, v0: int, v1: int) -> None:
        """Prepare vocabulary tile ``[v0, v1)``: its fp32 rows and/or its packed form."""
        self._v = (v0, v1)
        self._bp_i = None  # the tile as grad_input's B (bf16), made when a dense tile needs it
        if self._fp32:
            self.W32p = fp32_block(self.W, v0, v1, self._w_buf, width=self.Hp)
            self.W32 = self.W32p[:, : self.H]
        if self.lg is not None:
            self.lg.chunk(v0, v1)

    def grad_weight(self, G: np.ndarray, b0: int, b1: int, out: np.ndarray, acc: bool) -> None:
        """``out[nv, H] (+)= Gᵀ · X[b0:b1]`` (``acc``: summed onto ``out``) for ``G`` fp32
        ``[b1-b0, nv]`` of the current tile; on the native kernel ``G`` must hold values of the
        input dtype (each product exact).  ``G`` is read, not written."""
        H = self.H
        if self.b16:
            _bf16dot.matmul_tn(G, self.xinter[b0], H, out, acc=acc, form=self.form, spec=self.spec)
        elif self.f16k:
            if self.Xp is None:
                raise ValueError("the fp32 kernel's X is missing")
            _bf16dot.matmul(G.T, self.Xp[b0:b1], H, out, acc=acc, spec=self.spec)
        else:
            run_tasks(self._grad_weight_tasks(G, b0, b1, out, acc), self.engine)

    def _grad_weight_tasks(self, G: np.ndarray, b0: int, b1: int, out: np.ndarray, acc: bool) -> list:
        """The fp32 engines' tiles of :meth:`grad_weight`, as tasks (``_gemm.tn_tasks``)."""
        if self.X32 is None:
            raise ValueError("the BLAS path's fp32 X is missing (Operands made with weight_tiles='logits'?)")
        tmp = None
        if acc:
            if self.gw_tmp is None:
                raise ValueError("a sum onto grad_weight without the plan's grad_weight_product buffer")
            tmp = self.gw_tmp[: out.size].reshape(out.shape)
        return tn_tasks(G, self.X32[b0:b1], out, tmp, self.engine)

    def grad_input(self, G: np.ndarray, b0: int, b1: int, out: np.ndarray) -> None:
        """``out[nb, H] += G · W[v0:v1]`` for ``G`` fp32 ``[b1-b0, nv]`` of the current tile.  On
        the bf16 kernel ``G`` is overwritten by its pairs: call it after :meth:`grad_weight`."""
        H = self.H
        if self.b16:
            _bf16dot.matmul(_bf16dot.pairs_in_place(G, self.form), self.w_pairs(), H, out, acc=True, spec=self.spec)
        elif self.f16k:
            if self.W32p is None:
                raise ValueError("the fp32 kernel's W tile is missing (no chunk yet)")
            _bf16dot.matmul(G, self.W32p, H, out, acc=True, spec=self.spec)
        else:
            run_tasks(self._grad_input_tasks(G, b0, b1, out), self.engine)

    def w_pairs(self) -> np.ndarray:
        """The current tile's ``W`` as the bf16 kernel's ``B`` of ``g·W`` (consecutive rows paired,
        :func:`_bf16dot.interleave`), made on the first call of the tile."""
        if self.wt_inter is None:
            raise ValueError("the bf16 kernel's W tile buffer is missing (weight_tiles='all')")
        if self._bp_i is None:
            v0, v1 = self._v
            self._bp_i = _bf16dot.interleave(self.W[v0:v1], self.wt_inter)
        return self._bp_i

    def _grad_input_tasks(self, G: np.ndarray, b0: int, b1: int, out: np.ndarray) -> list:
        """The fp32 engines' tiles of :meth:`grad_input`, as tasks (``_gemm.nn_tasks``)."""
        if self.W32 is None or self.prod is None:
            raise ValueError("the BLAS path's W tile or product buffer is missing")
        nb = b1 - b0
        r, c = self._gi_tile
        return nn_tasks(G, self.W32, out, self.prod[: nb * self.H].reshape(nb, self.H), self.engine, rows=r, cols=c)

    def grad_products(
        self, G: np.ndarray, b0: int, b1: int, gw_out: np.ndarray, gw_acc: bool, gi_out: np.ndarray
    ) -> None:
        """:meth:`grad_weight` (onto ``gw_out``, ``gw_acc``) then :meth:`grad_input` (onto
        ``gi_out``) of the current tile.  On the fp32 engines their tiles run as one task list,
        one barrier: ``g·W``'s out tile ``[bt, H]`` has few 512 × 512 tiles (4 at BT 1024, H 896)
        and would leave most threads of a many-core machine idle beside ``gᵀX``'s; the same calls
        on the same operands into separate outputs and scratch, so the same bits."""
        if self.kind is not None:  # the native kernel: in order (the bf16 one overwrites G)
            self.grad_weight(G, b0, b1, gw_out, acc=gw_acc)
            self.grad_input(G, b0, b1, gi_out)
            return
        tasks = self._grad_weight_tasks(G, b0, b1, gw_out, gw_acc) + self._grad_input_tasks(G, b0, b1, gi_out)
        run_tasks(tasks, self.engine)

    def grad_products_paired(
        self, gt: np.ndarray, gp: np.ndarray, b0: int, gw_out: np.ndarray, gw_acc: bool, gi_out: np.ndarray
    ) -> None:
        """:meth:`grad_products` on the bf16 kernel from ``A`` operands already made: ``gt`` (``gᵀ``'s
        pairs ``[nv, ceil(nb/2)]``) and ``gp`` (``G``'s rows paired, ``[nb, ceil(nv/2)]``) — the same
        sums as :meth:`grad_weight` (``matmul_tn``) and :meth:`grad_input` (``pairs_in_place``)."""
        if not self.b16 or self.form != "pairs":
            raise ValueError(f"paired operands are the bf16 kernel's vdpbf16ps form, not {self.kind} / {self.form}")
        gi = _bf16dot.matmul_tasks(gp, self.w_pairs(), self.H, gi_out, acc=True, spec=self.spec)
        gw = _bf16dot.matmul_tasks(gt, self.xinter[b0], self.H, gw_out, acc=gw_acc, spec=self.spec)
        run_tasks(gi + gw)  # both read only the operands: one barrier, grad_input's longer tasks first

    def logits(self, b0: int, b1: int, out: np.ndarray) -> None:
        """``out[b1-b0, v1-v0] = X[b0:b1] · W[v0:v1]ᵀ`` in fp32 for the current tile."""
        if self.lg is not None:
            self.lg.logits(b0, b1, out)
            return
        if self.X32 is None or self.W32 is None:
            raise ValueError("logits: no fp32 operands (Operands made with logits=False, or no chunk yet)")
        matmul_nt(self.X32[b0:b1], self.W32, out, engine=self.engine)


class TilePlan(Protocol):
    """What the loop reads of a plan: ``tiling.LinearCETiling`` (the aclnn ops) or
    ``tiling.TileGrid`` (the training loss's recompute)."""

    @property
    def n_tiles(self) -> int: ...

    def v_ranges(self) -> Iterable[tuple[int, int]]: ...

    def bt_ranges(self) -> Iterable[tuple[int, int]]: ...


class ChunkOperands(Protocol):
    """What the loop calls of the operands (:class:`Operands`; the training loss's recompute)."""

    def chunk(self, v0: int, v1: int) -> None: ...


def run(
    plan: TilePlan, operands: ChunkOperands, epilogue: Epilogue, progress: Callable[[int, int], object] | None = None
) -> None:
    """The loop (module doc): the plan's tiles in its order, ``progress(done, total)`` after each."""
    done = 0
    for v0, v1 in plan.v_ranges():
        operands.chunk(v0, v1)
        epilogue.begin(v0, v1)
        for b0, b1 in plan.bt_ranges():
            epilogue.tile(b0, b1, v0, v1)
            done += 1
            if progress is not None:
                progress(done, plan.n_tiles)
        epilogue.end(v0, v1)


@dataclass(frozen=True)
class Sweep:
    """One pass of :func:`run_row_blocks` over a row block's ``n`` vocabulary chunks.

    ``steps[k](c)`` returns the tasks of step ``k`` for chunk ``c`` (callables of no argument,
    ``_gemm.row_tasks`` / ``nt_tasks`` / ...); step ``k`` of a chunk reads what its step ``k - 1``
    wrote, and a step's tasks are independent of each other.  A step is asked for its tasks once
    per chunk, in the order the sweep runs them (a step may record what a later step of the same
    chunk reads, e.g. the chunk's widened weight).  ``staged``: stage ``t`` runs step ``k`` of chunk
    ``t - k`` for every ``k`` as one task list, the ``lead`` steps' tasks first (the GEMM tiles,
    the longest; an index or a tuple of them), one barrier per stage; else chunk by chunk, step
    by step, one barrier each.

    ``uses`` (staged only): ``uses(k, c)`` → ``(reads, writes)``, the resources (hashable names:
    a buffer, a chunk's part of one, an accumulator) step ``k`` of chunk ``c`` reads and writes
    besides the sweep's read-only inputs.  With it the stages are a priority, not barriers: the
    sweep is a dependency graph (``_gemm.run_graph``) whose edges are the conflicts (read after
    write, write after read or write) in the chunk-by-chunk order plus each chunk's step order,
    so the next stage's tasks start as soon as what they need is done — and the result is the
    chunk-by-chunk result.  A stage order that would run two conflicting steps the other way
    round is refused (``ValueError``) before anything runs."""

    n: int
    steps: tuple[Callable[[int], list], ...]
    staged: bool = False
    lead: int | tuple[int, ...] = 0
    uses: Callable[[int, int], tuple[Iterable, Iterable]] | None = None


def _stage_order(s: Sweep) -> list[list[tuple[int, int]]]:
    """The stages of a staged sweep: per stage ``t`` the ``(step, chunk)`` pairs it runs, the
    lead steps first, then the others in step order."""
    lead = (s.lead,) if isinstance(s.lead, int) else tuple(s.lead)
    if not lead or any(not 0 <= k < len(s.steps) for k in lead) or len(set(lead)) != len(lead):
        raise ValueError(f"Sweep.lead must index its {len(s.steps)} steps, got {s.lead}")
    order = list(lead) + [k for k in range(len(s.steps)) if k not in lead]
    return [[(k, t - k) for k in order if 0 <= t - k < s.n] for t in range(s.n + len(s.steps) - 1 if s.n else 0)]


def sweep(s: Sweep, engine: str) -> None:
    """Run ``s`` (:class:`Sweep`) on the GEMM pool (``_gemm.run_tasks``, ``engine``'s threads;
    ``_gemm.run_graph`` where the sweep says what its steps use)."""
    if not s.staged:
        for c in range(s.n):
            for step in s.steps:
                run_tasks(step(c), engine)
        return
    stages = _stage_order(s)
    if s.uses is None:
        for stage in stages:
            tasks: list = []
            for k, c in stage:
                tasks += s.steps[k](c)
            run_tasks(tasks, engine)
        return
    order = [kc for stage in stages for kc in stage]
    preds = _conflicts(s.uses, s.n, len(s.steps), order)
    run_graph([s.steps[k](c) for k, c in order], preds, engine)


def _conflicts(uses, n: int, n_steps: int, order: list[tuple[int, int]]) -> list[set[int]]:
    """The predecessors of each ``(step, chunk)`` of ``order`` (its index there): the last writer
    of each resource it reads or writes and the readers since, walked in the chunk-by-chunk
    order, and the chunk's previous step.  ``ValueError`` where ``order`` puts a predecessor
    after its successor."""
    pos = {kc: i for i, kc in enumerate(order)}
    preds: list[set[int]] = [set() for _ in order]
    last_w: dict = {}
    readers: dict = {}
    for c in range(n):
        for k in range(n_steps):
            i = pos[(k, c)]
            r, w = (set(x) for x in uses(k, c))
            deps = {last_w[x] for x in r | w if x in last_w}
            for x in w:
                deps.update(readers.pop(x, ()))
            if k:
                deps.add(pos[(k - 1, c)])
            deps.discard(i)
            late = [order[j] for j in deps if j > i]
            if late:
                raise ValueError(
                    f"the sweep's stages run (step, chunk) {(k, c)} before {late}, which it depends on "
                    "in the chunk-by-chunk order"
                )
            preds[i] = deps
            for x in r - w:
                readers.setdefault(x, []).append(i)
            for x in w:
                last_w[x] = i
    return preds


class RowPlan(Protocol):
    """What :func:`run_row_blocks` reads of a plan (``tiling.TrainingPlan``)."""

    def row_blocks(self) -> Iterable[tuple[int, int]]: ...


class RowEpilogue(Protocol):
    """What :func:`run_row_blocks` calls (the module doc; ``linear_cross_entropy._RowStep``)."""

    def begin_rows(self, b0: int, b1: int) -> None: ...

    def statistics(self) -> Sweep: ...

    def end_statistics(self) -> Sweep | None: ...

    def end_rows(self) -> None: ...


def run_row_blocks(
    plan: RowPlan, epilogue: RowEpilogue, engine: str, progress: Callable[[int, int], object] | None = None
) -> None:
    """The row-major loop (module doc): per row block of ``plan.row_blocks()``, ``begin_rows``,
    the statistics sweep, ``end_statistics`` (which returns the gradient sweep, or None), that
    sweep, ``end_rows``; ``progress(done, total)`` after each row block."""
    blocks = list(plan.row_blocks())
    for k, (b0, b1) in enumerate(blocks):
        epilogue.begin_rows(b0, b1)
        sweep(epilogue.statistics(), engine)
        grad = epilogue.end_statistics()
        if grad is not None:
            sweep(grad, engine)
        epilogue.end_rows()
        if progress is not None:
            progress(k + 1, len(blocks))
