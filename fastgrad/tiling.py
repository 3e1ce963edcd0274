"""op_host layer: tile plans chosen from shapes and a memory budget, inspectable without running.

The NPU's memory-saving FusedLinearCrossEntropyLossGrad kernel (ops-nn
``fused_linear_cross_entropy_loss_grad_tiling.cpp``, ``MemFriendlyTilingFunc``) cuts the
``[BT, V]`` logits into base blocks of 128 rows × 256 vocabulary columns, recomputes each block
with the Cube unit (``mm0``, fp32 out), applies the vector epilogue, casts to bf16/fp16 and feeds two
more matmuls (``mm1``: grad_input += g·W, ``mm2``: grad_weight += gᵀ·X) accumulated in fp32
workspaces.  On the CPU the same plan is made of larger tiles — multiples of those base blocks — so
that each GEMM is big enough for BLAS to run at full speed, while the fastgrad-owned scratch
memory stays under a budget that does not grow with BT×V.

The plan depends only on the shapes and the budget — never on the thread count — so results are
bitwise identical for every thread count.

Budget: ``FASTGRAD_WORKSPACE_MB`` (default 256 MiB) or :func:`set_workspace_budget` (the setting
lives in ``fastgrad._config``, with the others).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from . import _config
from ._plan_types import (  # noqa: F401  (re-exported: the plans' types)
    _NATIVE_KINDS,
    BLAS,
    NATIVE_COLS,
    Buffer,
    GemmChoice,
    _round_down,
    b_cols,
    b_size,
    fp32_operands,
    native_kind,
    npad,
)

#: The device's base block (ops-nn MemFriendlyTilingFunc: baseBT = 128, baseV = 256).
BASE_BT = 128
BASE_V = 256
#: Upper bounds on one tile: beyond these, BLAS gains nothing and the tile leaves the caches.
MAX_BT_TILE = 4096
MAX_V_TILE = 8192

#: the setting lives in the settings module (``fastgrad._config``); kept here under its old names
set_workspace_budget = _config.set_workspace_budget
workspace_budget = _config.workspace_budget


def lm_head_buffers(
    mode: str,
    BT: int,
    H: int,
    bt: int,
    vt: int,
    *,
    dtype: str = "float32",
    gemm: GemmChoice | None = None,
    filtered: bool = False,
) -> tuple[Buffer, ...]:
    """Every buffer the LM-head loop (``lm_head/loop.py``: its operands and the op's epilogue)
    allocates for a plan of ``bt × vt`` tiles over ``[BT, V]`` with hidden size ``H``, input
    ``dtype`` and the GEMMs ``gemm`` — the list the kernels take their buffers from, so the memory
    estimate is what the call holds (tests/test_lm_head_buffers.py measures it).

    Not listed: ``[BT]`` row vectors of the entry points (statistics, target columns), the
    gradient filter's per-block index arrays (a few KiB), and the GEMM engines' own per-thread
    buffers (OpenBLAS's packing; the native kernel's copies of ``A`` rows, ≤ 512 × 2048 words per
    pool thread, kept between calls)."""
    gemm = BLAS if gemm is None else gemm
    bt, vt = max(int(bt), 0), max(int(vt), 0)
    kind = gemm.exact_for_dtype(dtype)
    b16, f16k = kind == "bf16", kind == "f32"
    wide = dtype != "float32"  # 16-bit operands: fp32 copies for BLAS
    grad = mode != "forward"
    logits = mode != "high_performance"
    hp = npad(H) if f16k else H
    out: list[Buffer] = []

    def add(name, shape, dt, scope):
        out.append(Buffer(name, tuple(int(d) for d in shape), dt, scope))

    # the operands (``lm_head.loop.Operands``): fp32 X and W tiles where BLAS or the fp32 kernel takes them
    fp32_ops = fp32_operands(grad, kind)
    if fp32_ops and wide:
        add("x32", (BT, hp), "float32", "call")
        add("w32_tile", (vt, hp), "float32", "tile")
    if kind is not None and logits:  # the logits on the native kernel (``_bf16dot.Logits``)
        if f16k:
            if not fp32_ops:
                add("x32", (BT, npad(H)), "float32", "call")
            add("w_packed", (H, b_cols(vt)), "float32", "tile")
        else:
            out.extend(logits16_buffers(BT, H, vt, gemm.a_form))
    if not grad:  # the online max-sum's epilogue
        add("logits_tile", (bt, vt), "float32", "tile")
        return tuple(out)
    # the FLCE grad's epilogue (``FlceGrad``)
    n_bt = -(-BT // bt) if bt else 0
    add("grad_input_acc", (BT, H), "float32", "call")
    add("g_tile", (bt, vt), "float32", "tile")
    add("grad_weight_tile", (vt, H), "float32", "tile")
    if b16:
        rows = sum(b_size(min(bt, BT - b0), H) for b0 in range(0, BT, bt)) if bt else 0
        add("x_pairs_tiles", (rows,), "uint32", "call")
        add("w_pairs_tile", (b_size(vt, H),), "uint32", "tile")
    elif not f16k:  # BLAS: each product into scratch, then summed
        add("product", (bt, H), "float32", "tile")
        if n_bt > 1:
            add("grad_weight_product", (vt, H), "float32", "tile")
    if filtered and logits:
        fb, rb = FILTER_COLS, min(FILTER_ROWS, bt)
        add("filter_flags", (bt, -(-vt // fb)), "bool", "tile")
        add("kept_g", (rb, vt), "float32", "tile")
        if b16:
            add("kept_w16", (vt, H), "uint16", "tile")
            add("kept_w_pairs", (b_size(vt, H),), "uint32", "tile")
        else:
            add("kept_w", (vt, H), "float32", "tile")
            add("kept_product", (rb, H), "float32", "tile")
        add("kept_grad_weight", (vt, H), "float32", "tile")
    return tuple(out)


def _scope_bytes(buffers, scope: str) -> int:
    return sum(b.nbytes for b in buffers if b.scope == scope)


@dataclass(frozen=True)
class LinearCETiling:
    """Tile plan over ``(BT, V)`` for the fused linear cross-entropy ops.

    Execution order: vocabulary tiles outer, row tiles inner, so each ``grad_weight`` tile is
    finished (and rounded) before the next starts, and ``grad_input`` accumulates over the
    vocabulary tiles in a fixed order.

    Attributes
    ----------
    BT, V, H : int
        Rows (tokens), local vocabulary size, hidden size.
    bt_tile, v_tile : int
        Tile sizes (multiples of the device's 128 × 256 base block, or the full extent).
    mode : str
        ``"memory_saving"`` (logits recomputed per tile), ``"high_performance"`` (softmax given)
        or ``"forward"`` (the online max/sum companion op).
    workspace_bytes : int
        The memory the loop allocates (bytes): ``fixed_bytes + tile_bytes``, the sum of
        :attr:`buffers`; independent of V beyond one tile.
    budget_bytes : int
        The budget the plan was made for (it bounds ``tile_bytes``).
    fixed_bytes : int
        The ``"call"`` buffers (``[BT, H]``-sized: grad_input accumulator, copies of ``X``).
    tile_bytes : int
        The ``"tile"`` buffers (logits/g tile, weight tile forms, grad_weight tile, products).
    gemm : GemmChoice
        The GEMMs the kernel runs (chosen by the op layer from the settings).
    buffers : tuple of Buffer
        Every buffer the loop allocates (:func:`lm_head_buffers`); ``fixed_bytes`` is the sum of
        its ``"call"`` buffers, ``tile_bytes`` of its ``"tile"`` buffers, ``workspace_bytes``
        of all: the memory estimate is this list.
    filter_eps, filter_rows, filter_cols : float or None, int, int
        Gradient filtering (memory-saving mode): blocks of ``filter_rows × filter_cols`` whose
        every ``|softmax - onehot|`` is below ``filter_eps`` are skipped in the gradient GEMMs.
    blocks_total, blocks_skipped : int
        Filled in the plan a call returns (``return_plan=True``): how many blocks were seen and
        skipped.
    """

    BT: int
    V: int
    H: int
    bt_tile: int
    v_tile: int
    mode: str
    workspace_bytes: int
    budget_bytes: int
    fixed_bytes: int = 0
    tile_bytes: int = 0
    filter_eps: float | None = None
    filter_rows: int = 0
    filter_cols: int = 0
    blocks_total: int = 0
    blocks_skipped: int = 0
    gemm: GemmChoice = BLAS
    buffers: tuple[Buffer, ...] = ()
    grad_input_tile: tuple[int, int] = (512, 512)

    @property
    def n_bt_tiles(self) -> int:
        return -(-self.BT // self.bt_tile) if self.BT else 0

    @property
    def n_v_tiles(self) -> int:
        return -(-self.V // self.v_tile) if self.V else 0

    @property
    def n_tiles(self) -> int:
        return self.n_bt_tiles * self.n_v_tiles

    @property
    def logits_bytes_avoided(self) -> int:
        """Size of the fp32 ``[BT, V]`` matrix this plan never materializes."""
        return 4 * self.BT * self.V

    def v_ranges(self) -> Iterator[tuple[int, int]]:
        for v0 in range(0, self.V, self.v_tile):
            yield v0, min(v0 + self.v_tile, self.V)

    def bt_ranges(self) -> Iterator[tuple[int, int]]:
        for b0 in range(0, self.BT, self.bt_tile):
            yield b0, min(b0 + self.bt_tile, self.BT)

    def tiles(self) -> Iterator[tuple[int, int, int, int]]:
        """(b0, b1, v0, v1) in execution order."""
        for v0, v1 in self.v_ranges():
            for b0, b1 in self.bt_ranges():
                yield b0, b1, v0, v1


#: Gradient-filtering block: rows × vocabulary columns (two and a quarter of the device's base block).
FILTER_ROWS = 256
FILTER_COLS = 64


def plan_linear_cross_entropy(
    BT: int,
    V: int,
    H: int,
    *,
    mode: str = "memory_saving",
    widen: bool = True,
    budget_bytes: int | None = None,
    filter_eps: float | None = None,
    gemm: GemmChoice = BLAS,
    dtype: str | None = None,
) -> LinearCETiling:
    """Choose the tile plan for the fused linear cross-entropy ops from shapes and a budget.

    The op_host tiling: from shapes and the budget only, never from the thread count.

    Parameters
    ----------
    BT, V, H : int
        Shapes: input ``[BT, H]``, weight ``[V, H]``.
    mode : {"memory_saving", "high_performance", "forward"}
    widen : bool
        True when the inputs are 16-bit (ignored when ``dtype`` is given).
    budget_bytes : int, optional
        Budget for the per-tile scratch (``tile_bytes``); default :func:`workspace_budget`.  The
        fixed ``[BT, H]`` fp32 buffers (grad_input accumulator, fp32 input copy) are
        output-sized and outside the budget (``fixed_bytes``).  Tiles shrink down to one
        128 × 256 base block to fit; ``tile_bytes <= budget_bytes`` unless even that block does
        not fit.
    filter_eps : float, optional
        Gradient filtering threshold (memory-saving mode only); its buffers are counted.
    gemm : GemmChoice
        The GEMMs the kernel will run (the op layer's choice, recorded in the plan).
    dtype : str, optional
        The inputs' dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``); default from
        ``widen`` (``"bfloat16"`` / ``"float32"``).  With ``gemm`` it decides the buffers.

    The tiles are sized from :func:`lm_head_buffers` — the buffers the loop will allocate — so
    ``tile_bytes`` (the ``"tile"`` buffers) is what the budget bounds and ``workspace_bytes`` what
    the call holds.
    """
    filtered = filter_eps is not None and mode == "memory_saving"
    budget = workspace_budget() if budget_bytes is None else int(budget_bytes)
    BT, V, H = int(BT), int(V), int(H)
    dt = dtype if dtype is not None else ("bfloat16" if widen else "float32")

    def tile_bytes(bt: int, vt: int) -> int:
        return _scope_bytes(lm_head_buffers(mode, BT, H, bt, vt, dtype=dt, gemm=gemm, filtered=filtered), "tile")

    bt = max(1, min(BT, MAX_BT_TILE))
    if bt < BT:
        bt = _round_down(bt, BASE_BT)
    while True:
        # tile bytes are affine in vt for a fixed bt (up to the packed B's 64-column granule)
        fixed_part = tile_bytes(bt, 0)
        per_col = max(1, -(-(tile_bytes(bt, BASE_V) - fixed_part) // BASE_V))
        vt = (budget - fixed_part) // per_col
        if vt >= min(BASE_V, max(V, 1)) or bt <= BASE_BT:
            break
        bt = max(BASE_BT, _round_down(bt // 2, BASE_BT))
    if vt >= V:
        vt = max(V, 1)
    else:
        vt = max(BASE_V, _round_down(vt, BASE_V))
    vt = max(1, min(vt, MAX_V_TILE, max(V, 1)))
    while vt > BASE_V and tile_bytes(bt, vt) > budget:  # the granule's rounding
        vt -= BASE_V
    buffers = lm_head_buffers(mode, BT, H, bt, vt, dtype=dt, gemm=gemm, filtered=filtered)
    fixed, tile = _scope_bytes(buffers, "call"), _scope_bytes(buffers, "tile")
    return LinearCETiling(
        BT=BT,
        V=V,
        H=H,
        bt_tile=bt,
        v_tile=vt,
        mode=mode,
        workspace_bytes=fixed + tile,
        budget_bytes=budget,
        fixed_bytes=fixed,
        tile_bytes=tile,
        filter_eps=float(filter_eps) if filtered and filter_eps is not None else None,
        filter_rows=FILTER_ROWS if filtered else 0,
        filter_cols=FILTER_COLS if filtered else 0,
        gemm=gemm,
        buffers=buffers,
        grad_input_tile=grad_input_tile(bt, H, largest=(512, 512)),
    )


#: vocabulary columns per chunk of the training loss's vocabulary-major passes (the forward alone
#: and the recompute of the gradient from a saved log-sum-exp)
TRAIN_VM_CHUNK = 2048

#: The training loss's row-block GEMM grids (``kernels/_gemm``'s tasks; each tile one
#: single-threaded BLAS call, so the bits do not depend on the thread count): the logits
#: ``X[b]·W[v]ᵀ`` in tiles of ≤ 1024 rows × ≤ 2048 vocabulary columns, ``grad_weight``'s
#: ``Gᵀ·X[b]`` in blocks of ≤ 1024 vocabulary rows (all ``H`` columns), ``grad_input``'s
#: ``G·W[v]`` in tiles of ≤ 1024 rows × ≤ 512 columns of ``H`` (below).  From the shapes only.
#: The first two were 512 × 512 and 512 rows (the aclnn ops' grid, ``_gemm.ROW_BLOCK``/
#: ``COL_BLOCK``, which their bit pins keep): at the Qwen2.5-0.5B head, bf16, a 2-core Zen 3, the
#: fused step ~4 % faster (best of 5, two runs; new ÷ old per interleaved round: median 0.96 over
#: 10; 0.98 at V = 32768, 12 rounds; ``bench/results/README.md``)
#: — a chunk's 52 GEMM tasks become 16, each packing its operands once for 4x the work.
TRAIN_LOGITS_TILE = (1024, 2048)
TRAIN_GRAD_WEIGHT_ROWS = 1024
#: ``grad_input``'s tiles were 512 × 512 until 2026-11-26: at a 683-row block that is 2 × 2 tiles of
#: 342 × 448, each packing its ``G`` rows and ``W`` columns (``K`` = a whole vocabulary chunk).  Up to
#: 1024 rows (1 × 2 tiles there) packs the weight chunk once instead of twice: in the step (Qwen2.5
#: head, bf16, 2-core Zen 3) the ``G·W`` tiles ran at 0.93–1.05 of the logits tiles' GF/s in the
#: same step (median ~1.01) against 0.94–0.99 (~0.95), and the step took 0.85–1.04 of the old
#: grid's time per interleaved round (median 0.97 over 16 rounds in three runs, faster in 13;
#: ``bench/results/README.md``)
TRAIN_GRAD_INPUT_TILE = (1024, 512)

#: ``grad_input``'s ``G·W`` is an accumulator summed over the vocabulary (chunk after chunk, tile
#: after tile): its tiles are the only independent tasks of that step, and the chain of steps over
#: the vocabulary is the loop's critical path on many cores.  At the Qwen2.5 head (683-row blocks,
#: H 896) the (1024, 512) grid gave 2 tasks per step: on a 16-core Xeon the train step ran at 3.2x
#: the 16-thread sgemm bound (bench/results/xeon_emr.md).  :func:`grad_input_tile` cuts it to at
#: least this many tiles (from the shapes only, never the thread count), down to
#: :data:`GRAD_INPUT_MIN_TILE` a side; each output element is still one BLAS call over the same
#: ``K`` (the chunk), so the bits do not depend on the grid (tests/test_grad_input_grid.py).
GRAD_INPUT_TASKS = 16
GRAD_INPUT_MIN_TILE = 128


def grad_input_tile(rows: int, H: int, largest: tuple[int, int] = TRAIN_GRAD_INPUT_TILE) -> tuple[int, int]:
    """``grad_input``'s GEMM tile (rows × columns of ``H``) for a block of ``rows`` rows: ``largest``,
    halved (columns first, then rows, each down to :data:`GRAD_INPUT_MIN_TILE`) until the block has
    :data:`GRAD_INPUT_TASKS` tiles.  From the shapes only."""
    r, c = (max(int(x), 1) for x in largest)
    rows, H = max(int(rows), 1), max(int(H), 1)
    r, c = min(r, rows), min(c, H)

    def tiles(r: int, c: int) -> int:
        return -(-rows // r) * -(-H // c)

    while tiles(r, c) < GRAD_INPUT_TASKS:
        if c > GRAD_INPUT_MIN_TILE:
            c = max(GRAD_INPUT_MIN_TILE, -(-c // 2))
        elif r > GRAD_INPUT_MIN_TILE:
            r = max(GRAD_INPUT_MIN_TILE, -(-r // 2))
        else:
            break
    return r, c


@dataclass(frozen=True)
class TileGrid:
    """Tiles of the LM-head loop (``lm_head/loop.run``) over ``[BT, V]``: vocabulary tiles of
    ``v_tile`` rows (the last one shorter) outer, ``n_bt`` equal row blocks inner — the training
    loss's recompute (:attr:`TrainingPlan.recompute_grid`)."""

    BT: int
    V: int
    v_tile: int
    n_bt: int

    @property
    def n_tiles(self) -> int:
        return (-(-self.V // self.v_tile) if self.v_tile else 0) * self.n_bt

    def v_ranges(self) -> Iterator[tuple[int, int]]:
        for v0 in range(0, self.V, self.v_tile):
            yield v0, min(v0 + self.v_tile, self.V)

    def bt_ranges(self) -> Iterator[tuple[int, int]]:
        for k in range(self.n_bt):
            yield (k * self.BT) // self.n_bt, ((k + 1) * self.BT) // self.n_bt

    @property
    def largest_bt(self) -> int:
        """Rows of the largest row block (the row-block buffers' size)."""
        return -(-self.BT // self.n_bt) if self.n_bt else 0


@dataclass(frozen=True)
class TrainingPlan:
    """The training loss's plan (``kernels/linear_cross_entropy.py``), made by the op layer
    (``ops/linear_cross_entropy.py``) from the shapes, the budget and what the call computes —
    never from the thread count, and from the *global* vocabulary, so every rank of a
    vocabulary-parallel group plans the same row blocks (the all-reduce runs per block).

    Attributes
    ----------
    BT, K, V, H : int
        Rows, local vocabulary rows of the weight, global vocabulary, hidden size.
    budget_rows : int
        Rows whose fp32 logits ``[rows, V]`` fit the budget (≥ 1, a multiple of 8 from 8 on).
    block_rows : int
        The row blocks' size limit: ``budget_rows``, or for the forward alone (no gradient) all
        rows while ``[BT, recompute_chunk]`` fits half the budget.  The blocks are
        :meth:`row_blocks`: ``ceil(BT / block_rows)`` equal blocks.
    v_chunk : int
        Vocabulary rows per chunk of a row block (the forward alone: ≤ ``TRAIN_VM_CHUNK``).
    vocab_major : bool
        The gradient is recomputed from a saved log-sum-exp, vocabulary chunk by chunk
        (``_vocab_major``: chunks of ``recompute_chunk`` columns, row blocks of ``recompute_rows``).
    recompute_chunk, recompute_rows : int
    whole_weight : bool
        The 16-bit weight is widened once to fp32 (when it takes at most a quarter of the budget),
        else per chunk.
    budget_bytes : int
    buffers : tuple of Buffer
        Every buffer the kernel allocates for this call (:func:`training_buffers`; the kernel
        takes them by name through ``lm_head/loop.Workspace``, which refuses any other):
        :attr:`workspace_bytes` is their sum — what the call holds besides its outputs.
    logits16 : bool
        The logits run on the native bf16 kernel (``GemmChoice.logits16`` with bf16 operands).
    filter_rows, filter_cols : int
        Gradient filtering (``filter_eps``): blocks of ``filter_rows`` rows (at most a row block)
        × ``filter_cols`` vocabulary columns are kept or skipped whole; 0 where nothing is filtered
        (no ``filter_eps``, no gradient, or no vocabulary: :func:`training_modes`).
    logits_tile, grad_input_tile : tuple of int
        The row blocks' GEMM grids: the logits' and ``grad_input``'s largest tile (rows ×
        columns of the product), and ``grad_weight_rows``: ``grad_weight``'s blocks of vocabulary
        rows (:data:`TRAIN_LOGITS_TILE` and its neighbours).
    grad_weight_rows : int
    accumulate_in_gemm : bool
        The row blocks' accumulating GEMM tiles (``grad_input[b] += G·W[v]`` over the chunks,
        ``grad_weight[v] += Gᵀ·X[b]`` over the row blocks) add their product in the BLAS call
        (``GemmChoice.beta1``: ``beta = 1``, ``kernels/_gemm.IN_BLAS``) instead of through a
        scratch product and a second pass: no ``grad_input_product`` / ``grad_weight_product``
        buffers (the latter kept for a 16-bit ``grad_weight``'s products).  The vocabulary-major
        recompute and gradient filtering's kept blocks keep their scratch.
    staged_statistics, staged_gradient : bool
        The row block's statistics sweep (resp. gradient sweep) runs in stages
        (``lm_head/loop.Sweep``): chunk ``c``'s GEMM tiles beside chunk ``c + 1``'s widening
        and chunk ``c - 1``'s (resp. ``c + 1``'s) element-wise pass, as a dependency graph of what
        each step reads and writes (no barrier between stages) — the same calls on the same
        operands as chunk by chunk, so the same bits.  Staged where the
        logits run on the fp32 engines (not the bf16 kernel) and the gradient follows in the same
        call (the statistics), and then where nothing is filtered and ``grad_weight`` is summed in
        the compute dtype (the gradient).
    grad16 : bool
        ``precision="fast"`` in the fused row blocks (the gradient in the same call as the
        statistics, on the bf16 logits kernel, dense, ``grad_weight`` summed in fp32): ``g``
        rounded to bf16 with its rounding error's mean part restored, and both gradient GEMMs on
        the exact-product bf16 kernel — the three GEMMs of the step on the kernel, no fp32 copy of
        the weight (:func:`fast_fused`).
    """

    BT: int
    K: int
    V: int
    H: int
    budget_rows: int
    block_rows: int
    v_chunk: int
    vocab_major: bool
    recompute_chunk: int
    recompute_rows: int
    whole_weight: bool
    budget_bytes: int
    logits16: bool = False
    filter_rows: int = 0
    filter_cols: int = 0
    logits_tile: tuple[int, int] = TRAIN_LOGITS_TILE
    grad_input_tile: tuple[int, int] = TRAIN_GRAD_INPUT_TILE
    grad_weight_rows: int = TRAIN_GRAD_WEIGHT_ROWS
    accumulate_in_gemm: bool = False
    staged_statistics: bool = False
    staged_gradient: bool = False
    grad16: bool = False
    weight16_cached: bool = False
    fallback: str | None = None
    gemm: GemmChoice = BLAS
    buffers: tuple[Buffer, ...] = ()

    @property
    def n_blocks(self) -> int:
        return -(-self.BT // self.block_rows) if self.BT else 0

    @property
    def workspace_bytes(self) -> int:
        """Bytes of :attr:`buffers`."""
        return sum(b.nbytes for b in self.buffers)

    @property
    def largest_block(self) -> int:
        """Rows of the largest of :meth:`row_blocks` (the row-block buffers' size)."""
        return -(-self.BT // self.n_blocks) if self.BT else 0

    @property
    def recompute_grid(self) -> TileGrid:
        """The recompute's tiles: ``recompute_chunk`` vocabulary rows × ``ceil(BT /
        recompute_rows)`` equal row blocks (``kernels/linear_cross_entropy._vocab_major``)."""
        return TileGrid(self.BT, self.K, self.recompute_chunk, -(-self.BT // self.recompute_rows) if self.BT else 0)

    def row_blocks(self) -> Iterator[tuple[int, int]]:
        """``(b0, b1)`` of the equal row blocks, in order."""
        n = self.n_blocks
        for k in range(n):
            yield (k * self.BT) // n, ((k + 1) * self.BT) // n


@dataclass(frozen=True)
class LossParams:
    """The training loss's scalar parameters (``fastgrad.linear_cross_entropy``), derived once by
    the op layer (``ops/linear_cross_entropy.py``) from the call's attributes and handed to the
    kernel and the golden as one frozen object (``lm_head/passes.kernel_arrays`` packs
    them for the Numba passes).

    Attributes
    ----------
    temperature : float
        Logits divided by it (after the softcap).
    softcap : float or None
        ``z = softcap·tanh(L / softcap)``; None: no softcap.
    eps : float
        Label smoothing ε.
    eps_over_V, eps_wsum_over_V : float
        ε / V and ε·Σw / V (the global vocabulary V, the class weights' sum).
    z_scale2 : float
        2 · ``lse_square_scale`` (the z-loss's derivative factor).
    need_zsum : bool
        The statistics include ``Σ_v w_v·z_v`` (label smoothing in the forward).
    vocab_start_index : int
        This shard's first global vocabulary column.
    filter_eps : float or None
        Gradient filtering's threshold (CCE's ``filter_eps``); None: dense.
    round_grad : bool
        ``precision="fast"``: ``dloss/dL`` rounded to bf16 where a bf16 kernel runs the gradient.
    """

    temperature: float = 1.0
    softcap: float | None = None
    eps: float = 0.0
    eps_over_V: float = 0.0
    eps_wsum_over_V: float = 0.0
    z_scale2: float = 0.0
    need_zsum: bool = False
    vocab_start_index: int = 0
    filter_eps: float | None = None
    round_grad: bool = False


def training_budget_rows(vocab_size: int, itemsize: int, budget: int) -> int:
    """Rows per block: the block's logits ``[rows, V]`` (``itemsize`` bytes each) fit ``budget``
    (≥ 1, a multiple of 8 when ≥ 8).  From the global V."""
    nb = max(1, int(budget) // max(1, int(vocab_size) * int(itemsize)))
    return nb if nb < 8 else (nb // 8) * 8


def training_modes(*, want_grad: bool, recompute: bool, filtered: bool, K: int, BT: int) -> tuple[bool, bool]:
    """``(vocab_major, filtering)`` of a training-loss call — the one rule the plan is made by and
    the kernel checks its plan against: the gradient recomputed from a saved ``lse`` runs
    vocabulary-major unless it is filtered; gradient filtering (``filter_eps`` given) runs where
    a gradient over a non-empty vocabulary is computed."""
    filtering = bool(filtered and want_grad and K > 0)
    return bool(recompute and want_grad and not filtered and K > 0 and BT > 0), filtering


def fast_fused(
    *, logits16: bool, fast: bool, want_grad: bool, recompute: bool, filtering: bool, accum16_gw: bool, K: int, BT: int
) -> bool:
    """``TrainingPlan.grad16``: ``precision="fast"``'s bf16 gradient GEMMs in the fused row blocks
    — the one rule the plan is made by and the kernel checks its plan against."""
    return bool(
        logits16 and fast and want_grad and not recompute and not filtering and not accum16_gw and K > 0 and BT > 0
    )


def _fast_fallback(
    fast: bool, grad: bool, logits16: bool, vocab_major: bool, grad16: bool, filtering: bool, accum16_gw: bool
) -> str | None:
    """:attr:`TrainingPlan.fallback`: why ``precision="fast"`` computes ``"accurate"`` here, or None."""
    if not (fast and grad) or grad16 or (vocab_major and logits16):
        return None
    if not logits16:
        why = (
            "its logits do not run on the exact-product bf16 kernel here (it needs bf16 input and weight, "
            "fastgrad.torch's training loss, the GEMM setting 'auto' and a CPU whose 'auto' takes the kernel)"
        )
    elif filtering:
        why = "gradient filtering (filter_eps) keeps the fp32 gradient"
    else:
        why = "a 16-bit grad_weight (accum_dtype) in the fused row blocks keeps the fp32 gradient GEMMs"
    return f"precision='fast' computes as 'accurate' (bitwise): {why}"


def plan_training_loss(
    BT: int,
    K: int,
    V: int,
    H: int,
    *,
    itemsize: int,
    widen: bool,
    want_grad: bool,
    recompute: bool,
    filtered: bool,
    logits16: bool,
    v_chunk: int,
    budget_bytes: int | None = None,
    grads: tuple[bool, bool, bool] | None = None,
    accum16: bool = False,
    fast: bool = False,
    a_form: str | None = None,
    staged: bool = True,
    beta1: bool = False,
    gemm: GemmChoice = BLAS,
) -> TrainingPlan:
    """The training loss's plan (:class:`TrainingPlan`).  ``itemsize``: the compute dtype's
    (4, or 8 for fp64); ``widen``: 16-bit operands (fp32 copies of the weight);
    ``want_grad``/``recompute``/``filtered``: what the call computes (``recompute``: ``lse``
    given); ``logits16``: the logits run on the bf16 kernel (no fp32 weight for the forward alone);
    ``v_chunk``: the row block's vocabulary chunk.  For the buffer list (:func:`training_buffers`):
    ``grads`` which of (grad_input, grad_weight, grad_bias) are computed (default: all or none,
    as ``want_grad``), ``accum16`` a 16-bit ``grad_weight`` (``accum_dtype``), ``fast``
    ``precision="fast"`` asked, ``a_form`` the bf16 kernel's ``A`` form (``GemmChoice.a_form``).
    ``staged``: the row blocks' sweeps may run in stages (``staged_statistics``/``staged_gradient``
    where the call allows them; False: chunk by chunk — the same bits).  ``beta1``: the GEMM
    choice's ``GemmChoice.beta1`` (the row blocks' accumulating tiles in the BLAS call:
    ``accumulate_in_gemm``, with the fp32 logits — not on the bf16 kernel's ``precision="fast"``).
    ``gemm``: the call's GEMM choice, recorded in the plan (:attr:`TrainingPlan.gemm`)."""
    budget = workspace_budget() if budget_bytes is None else int(budget_bytes)
    BT, K, V, H = int(BT), int(K), int(V), int(H)
    rows = training_budget_rows(max(V, 1), itemsize, budget)
    block = max(1, min(rows, BT))
    vc_req = int(v_chunk)
    if not want_grad:  # the forward alone: one chunk at a time, all rows while they fit half the budget
        vc_req = min(vc_req, TRAIN_VM_CHUNK)
        block = min(max(BT, 1), max(block, (budget // 2) // (vc_req * itemsize)))
    vc = max(1, min(vc_req, max(K, 1)))
    rc = min(vc, TRAIN_VM_CHUNK)
    g3 = (want_grad,) * 3 if grads is None else tuple(bool(g) for g in grads)
    vocab_major, filtering = training_modes(want_grad=want_grad, recompute=recompute, filtered=filtered, K=K, BT=BT)
    # the row blocks' stages: the statistics where the logits run on the fp32 engines with a
    # gradient to follow; the gradient where it is dense and grad_weight summed in the compute dtype
    staged_stats = bool(staged) and not logits16 and want_grad and not recompute
    staged_grad = staged_stats and not filtering and not (accum16 and g3[1]) and K > 0
    grad16 = fast_fused(
        logits16=logits16,
        fast=fast,
        want_grad=want_grad,
        recompute=recompute,
        filtering=filtering,
        accum16_gw=accum16 and g3[1],
        K=K,
        BT=BT,
    )
    plan = TrainingPlan(
        BT=BT,
        K=K,
        V=V,
        H=H,
        budget_rows=rows,
        block_rows=block,
        grad_input_tile=grad_input_tile(block, H),
        v_chunk=vc,
        vocab_major=vocab_major,
        recompute_chunk=rc,
        recompute_rows=max(1, min(BT, budget // 2 // max(1, rc * itemsize))),
        whole_weight=widen and K * H * 4 <= budget // 4 and not (logits16 and not want_grad) and not grad16,
        budget_bytes=budget,
        logits16=bool(logits16),
        filter_rows=max(1, min(FILTER_ROWS, block)) if filtering else 0,
        filter_cols=FILTER_COLS if filtering else 0,
        accumulate_in_gemm=bool(beta1) and want_grad and not vocab_major,
        staged_statistics=staged_stats,
        staged_gradient=staged_grad,
        grad16=grad16,
        weight16_cached=grad16 and -(-BT // block) > 1 and 2 * b_size(H, max(K, 1)) * 4 <= 4 * budget,
        gemm=gemm,
        fallback=_fast_fallback(
            fast, want_grad and K > 0 and BT > 0, logits16, vocab_major, grad16, filtering, accum16 and g3[1]
        ),
    )
    return replace(
        plan,
        buffers=training_buffers(
            plan,
            itemsize=itemsize,
            widen=widen,
            grads=(g3[0], g3[1], g3[2]),
            recompute=recompute,
            accum16=accum16,
            fast=fast,
            a_form=a_form,
        ),
    )


#: rows per group of ``precision="fast"``'s partial column sums of the rounding error (fixed:
#: bitwise at any thread count; ``kernels/linear_cross_entropy._round_g_bf16``)
FAST_E_GROUP = 32


def logits16_buffers(BT: int, H: int, vt: int, a_form: str | None) -> tuple[Buffer, ...]:
    """The buffers of the bf16 logits on the native kernel (``kernels/_bf16dot.Logits``) for
    ``[BT, H]`` rows and vocabulary tiles of ``vt`` rows: ``X`` widened once (``a_form`` "f32")
    or paired with a zero column (odd ``H``), the packed tile, the tile's padded pairs (odd ``H``)."""
    out = []
    if a_form == "f32":
        out.append(Buffer("x32", (BT, H), "float32", "call"))
    elif H % 2:
        out.append(Buffer("x_pairs_padded", (BT, H + 1), "uint16", "call"))
    out.append(Buffer("w_packed", ((H + 1) // 2, b_cols(vt)), "uint32", "tile"))
    if H % 2:
        out.append(Buffer("w_pairs_padded", (vt, H + 1), "uint16", "tile"))
    return tuple(out)


def training_buffers(
    plan: TrainingPlan,
    *,
    itemsize: int,
    widen: bool,
    grads: tuple[bool, bool, bool],
    recompute: bool,
    accum16: bool = False,
    fast: bool = False,
    a_form: str | None = None,
) -> tuple[Buffer, ...]:
    """Every buffer the training loss's kernel (``kernels/linear_cross_entropy.py``) allocates for
    ``plan`` (its row blocks, chunks, vocabulary-major recompute, whole or chunked weight) and what
    the call computes (see :func:`plan_training_loss`): the list it takes its buffers from, so
    ``plan.workspace_bytes`` is what the call holds (tests/test_training_buffers.py measures it).

    Scope ``"call"``: sized by the call (copies of ``X`` or of the whole weight, ``[BT, H]``
    products, ``[K]`` indices); ``"tile"``: by the plan (a row block's logits, a chunk's weight
    and products).  Not listed: ``[BT]`` row vectors (statistics, coefficients, target columns),
    the filter's per-block index arrays (``[K]`` int64 per row block, freed before the next),
    a non-contiguous weight's contiguous copy, and the GEMM engines' own per-thread buffers."""
    BT, K, H, logits16 = plan.BT, plan.K, plan.H, plan.logits16
    gi, gw, gb = grads
    want_grad = gi or gw or gb
    cdt = "float64" if itemsize == 8 else "float32"
    out: list[Buffer] = []

    def add(name, shape, dt, scope):
        out.append(Buffer(name, tuple(int(d) for d in shape), dt, scope))

    if BT == 0:
        return ()
    if plan.vocab_major:  # ``_vocab_major``: the recompute of the gradient from a saved lse
        grid = plan.recompute_grid
        vc, nblocks, nr = grid.v_tile, grid.n_bt, grid.largest_bt
        if logits16:
            out += logits16_buffers(BT, H, vc, a_form)
        b16 = logits16 and fast  # the gradient GEMMs on the bf16 kernel too
        widen_x = widen and not b16
        if widen_x and nblocks == 1:
            add("x_whole", (BT, H), cdt, "call")
        elif widen_x:
            add("x_block", (nr, H), cdt, "tile")
        if widen and not b16:
            add("w_chunk", (vc, H), cdt, "tile")
        add("logits_block", (nr, vc), cdt, "tile")
        if gi and not b16:
            add("grad_input_product", (nr, H), cdt, "tile")
        if gw and accum16:
            add("grad_weight_chunk", (vc, H), cdt, "tile")
        if gw and nblocks > 1 and not b16:
            add("grad_weight_product", (vc, H), cdt, "tile")
        if b16:
            nchunks = -(-K // vc)
            add("fast_e_col", (-(-nr // FAST_E_GROUP), vc), cdt, "tile")
            add("fast_e_row", (BT, nchunks), cdt, "call")
            add("fast_w_mean", (nchunks, H), cdt, "call")
            add("fast_x_mean", (nblocks, H), cdt, "call")
            if gw:
                add("x_pairs_block", (b_size(nr, H),), "uint32", "tile")
            if gi:
                add("w_pairs_chunk", (b_size(vc, H),), "uint32", "tile")
                add("fast_product", (BT, H), cdt, "call")
        return tuple(out)
    # the row blocks (``linear_cross_entropy_cpu``)
    vc = plan.v_chunk
    fwd_only = not want_grad
    nb_rows = plan.largest_block
    if logits16:
        out += logits16_buffers(BT, H, vc, a_form)
    g16 = plan.grad16  # the gradient GEMMs on the bf16 kernel: no fp32 weight or X
    if widen and plan.whole_weight:
        add("w_whole", (K, H), cdt, "call")
    elif widen and (not logits16 or (gi and not g16)):  # with the bf16 logits kernel: grad_input's operand only
        add("w_chunk", (vc, H), cdt, "tile")
        if plan.staged_statistics:  # the staged sweeps' second chunk
            add("w_chunk_next", (vc, H), cdt, "tile")
    if widen and (not logits16 or (want_grad and not g16)):  # the forward alone on the bf16 kernel reads no X
        add("x_block", (nb_rows, H), cdt, "tile")
    add("logits_block", (nb_rows, vc if fwd_only else max(K, 1)), cdt, "tile")
    if g16:  # precision="fast" in the fused row blocks (kernels/linear_cross_entropy._RowStep)
        nchunks = -(-K // vc)
        add("fast_e_col", (-(-nb_rows // FAST_E_GROUP), vc), cdt, "tile")
        add("fast_e_row", (nb_rows, nchunks), cdt, "tile")
        add("fast_w_mean", (nchunks, H), cdt, "call")
        add("fast_x_mean", (1, H), cdt, "tile")
        if gw:
            add("x_pairs_block", (b_size(nb_rows, H),), "uint32", "tile")
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
    return tuple(out)


#: The plan type kernels take (the op_host → op_kernel contract).
LinearCrossEntropyPlan = LinearCETiling
