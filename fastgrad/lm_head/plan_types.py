"""The LM-head plans' types — the op_host → op_kernel contract: the aclnn ops' tile plan
(``LinearCETiling``), the training loss's (``TrainingPlan``, its recompute grid ``TileGrid``, its
scalar ``LossParams``), the GEMM choice (``GemmChoice``), a buffer's declaration (``Buffer``) and
the native kernel's operand layouts, with the constants and rules the plans and the kernels share
(the row blocks' grids, filtering's block, ``fast_fused``).  Made only by the op layer's plan
functions in ``fastgrad.tiling`` (which re-exports every name here); taken by the kernels.
Imports nothing of fastgrad's, so both sides — and the components' buffer declarations that the
plans concatenate — import it without a cycle."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

#: the native kernel's operand kind per 16-bit dtype name: bf16 pairs, or fp16 on the fp32 kernel
_NATIVE_KINDS = {"bfloat16": "bf16", "float16": "f32"}


def native_kind(dtype: npt.DTypeLike) -> str | None:
    """The native exact-product kernel's operand kind for ``dtype`` (a dtype or its name):
    ``"bf16"`` (bf16 pairs), ``"f32"`` (fp16 values on the fp32 kernel) or None (no kernel: BLAS)."""
    import numpy as np

    return _NATIVE_KINDS.get(dtype if isinstance(dtype, str) else np.dtype(dtype).name)


@dataclass(frozen=True)
class GemmChoice:
    """Which GEMMs one LM-head call runs, chosen once by the op layer from the settings
    (``fastgrad._config.settings()``: the GEMM setting, the native ISA, ``fastgrad.torch``'s
    preference) and recorded in its plan; no kernel reads a setting.

    Attributes
    ----------
    engine : {"blas", "onednn"}
        The fp32 tiles: NumPy's BLAS or PyTorch's oneDNN matmul (``fastgrad.gemm_engine``).
    exact : {"bf16", "f32"} or None
        16-bit operands on the native exact-product kernel (``kernels/_bf16dot.py``): ``"bf16"``
        (bf16 pairs) or ``"f32"`` (fp16 operands widened, the fp32 kernel); None: BLAS.
    variant : str or None
        The native kernel spec that runs them (``kernels/_native.py``: ``avx512_bf16dp``, …).
    logits16 : bool
        The training loss's logits GEMMs of bf16 operands on the native kernel (``"auto"`` inside
        ``fastgrad.torch``).
    isa : {"auto", "avx512", "avx2"}
        The native ISA setting the choice was made under.
    a_form : {"pairs", "f32"} or None
        The form of ``A`` the native variant takes (``KernelSpec.a_forms[0]``): bf16 pairs
        (``vdpbf16ps``) or fp32 values (the FMA variants); it decides which copies of ``X`` the
        loop holds (:func:`lm_head_buffers`).
    beta1 : bool
        The ``"blas"`` engine adds a tile's product onto its output in the same call (NumPy's
        OpenBLAS's ``cblas_sgemm`` with ``beta = 1``: ``kernels/_gemm.blas_accumulates``); the
        training loss's accumulating tiles then take no scratch product
        (:attr:`TrainingPlan.accumulate_in_gemm`).  The aclnn ops' kernels do not read it.
    fallback : str or None
        What the settings asked for and this machine could not run, and what runs instead (e.g.
        the GEMM setting ``"onednn"`` where its accuracy probe failed: BLAS); the op layer warns
        once per distinct fallback (``fastgrad.ops._engines.warn_fallback``).  None: as asked.
    """

    engine: str = "blas"
    exact: str | None = None
    variant: str | None = None
    logits16: bool = False
    isa: str = "auto"
    a_form: str | None = None
    beta1: bool = False
    fallback: str | None = None

    def exact_for(self, a: np.ndarray, b: np.ndarray) -> str | None:
        """The exact-product kernel for operands ``a`` and ``b`` (both 16-bit of one dtype), or None."""
        return self.exact_for_dtype(a.dtype) if a.dtype == b.dtype else None

    def exact_for_dtype(self, dtype: npt.DTypeLike) -> str | None:
        """The exact-product kernel this choice runs for operands of ``dtype`` (or its name), or None."""
        want = native_kind(dtype)
        return self.exact if (want is not None and self.exact == want) else None

    def describe(self) -> str:
        """What the GEMMs of 16-bit operands run on, in words (the command's and the bench's
        reports): ``"bf16 exact-product kernel (<variant>)"``, ``"fp32 kernel (<variant>, fp16
        operands)"``, else the fp32 engine's ``"BLAS sgemm"`` / ``"oneDNN matmul"``."""
        if self.exact == "bf16":
            return f"bf16 exact-product kernel ({self.variant})"
        if self.exact == "f32":
            return f"fp32 kernel ({self.variant}, fp16 operands)"
        return "oneDNN matmul" if self.engine == "onednn" else "BLAS sgemm"


#: BLAS for everything: what a plan made without the op layer's choice runs
BLAS = GemmChoice()


def _round_down(x: int, m: int) -> int:
    return (x // m) * m


@dataclass(frozen=True)
class Buffer:
    """One buffer the LM-head loop allocates (``lm_head/loop.Workspace`` hands it out by name).

    ``shape``: its largest extent (a tile at the edge of the matrix uses a prefix); ``dtype``: a
    NumPy dtype name; ``scope``: ``"call"`` (sized by the call: ``[BT, H]`` accumulators and
    copies of ``X``) or ``"tile"`` (sized by the tile plan, the part the budget bounds)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    scope: str

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        import numpy as np

        return self.size * np.dtype(self.dtype).itemsize


# The native kernel's packed ``B`` layout (``kernels/_bf16dot.py`` packs into it; the plan sizes it)
class BufferSource(Protocol):
    """Where a component takes its declared buffers, by name (the LM-head loop's ``Workspace``):
    ``take`` a declared one, ``get`` one the plan may not declare (None then)."""

    def take(self, name: str) -> np.ndarray: ...

    def get(self, name: str) -> np.ndarray | None: ...


NATIVE_COLS = 64  #: the packed ``B``'s column granule: a multiple of every variant's register tile


def npad(n: int) -> int:
    """Columns of the native kernels' ``B`` for ``n`` output columns: ``64·⌈n/64⌉``."""
    return -(-n // NATIVE_COLS) * NATIVE_COLS


def b_cols(n: int) -> int:
    """The row length of the native kernel's packed ``B`` for ``n`` columns: :func:`npad` ``(n)``,
    plus 64 where that is a multiple of 256 — rows 1 KiB · 2ʲ apart share a few L1/L2 sets, and a
    column tile of ``B`` is read down its rows (the AVX2 code at a 32 KiB row stride runs faster
    with the padding: bench/results/README.md).  Columns past ``n`` are zero and never read into
    an output."""
    w = npad(n)
    return w + NATIVE_COLS if w % 256 == 0 else w


def b_size(k: int, n: int) -> int:
    """uint32 elements of the native kernel's ``B`` for a ``[K, N]`` bf16 product: ``ceil(K/2)``
    rows of :func:`b_cols` ``(N)``."""
    return ((k + 1) // 2) * b_cols(n)


def fp32_operands(grad: bool, kind: str | None) -> bool:
    """The LM-head loop holds fp32 copies of ``X`` and of the weight tiles: where the logits run
    on BLAS (``kind`` None), and for the gradient GEMMs unless they run on the bf16 kernel (the
    fp32 kernel of fp16 operands takes them as its ``B``).  ``kind``: ``GemmChoice.exact_for``."""
    return (grad and kind != "bf16") or kind is None


#: The aclnn LM-head ops' GEMM grid: the largest tile (rows × columns of the product) of their
#: single-threaded BLAS calls (``kernels/_gemm.ROW_BLOCK`` / ``COL_BLOCK``; their bit pins keep it)
ACLNN_GEMM_TILE = (512, 512)

#: The training loss's row-block GEMM grids (``kernels/_gemm``'s tasks; each tile one
#: single-threaded BLAS call, so the bits do not depend on the thread count): the logits
#: ``X[b]·W[v]ᵀ`` in tiles of ≤ 1024 rows × ≤ 2048 vocabulary columns, ``grad_weight``'s
#: ``Gᵀ·X[b]`` in blocks of ≤ 1024 vocabulary rows (all ``H`` columns), ``grad_input``'s
#: ``G·W[v]`` in tiles of ≤ 1024 rows × ≤ 512 columns of ``H`` (below).  From the shapes only.
#: The first two were 512 × 512 and 512 rows (the aclnn ops' grid, ``_gemm.ROW_BLOCK``/
#: ``COL_BLOCK``, which their bit pins keep): the larger tiles make the fused step faster at the
#: Qwen2.5-0.5B head (figures in ``bench/results/README.md``, "Measurements behind the source's
#: choices") — a chunk's 52 GEMM tasks become 16, each packing its operands once for 4x the work.
TRAIN_LOGITS_TILE = (1024, 2048)
TRAIN_GRAD_WEIGHT_ROWS = 1024
#: ``grad_input``'s tiles were 512 × 512: at a 683-row block that is 2 × 2 tiles of 342 × 448, each
#: packing its ``G`` rows and ``W`` columns (``K`` = a whole vocabulary chunk).  Up to 1024 rows
#: (1 × 2 tiles there) packs the weight chunk once instead of twice: the ``G·W`` tiles then run at
#: about the logits tiles' rate and the step is faster (figures in ``bench/results/README.md``,
#: "Measurements behind the source's choices"); cut further into squarer tiles by
#: ``tiling.grad_input_tile`` until a block has ``tiling.TRAIN_GRAD_INPUT_TASKS``
TRAIN_GRAD_INPUT_TILE = (1024, 512)


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
    grad_input_tile: tuple[int, int] = ACLNN_GEMM_TILE

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
        operands as chunk by chunk, so the same bits.  The statistics staged where the logits
        run on the fp32 engines (not the bf16 kernel) and the gradient follows in the same call;
        the gradient where it follows the statistics in the same call, nothing is filtered,
        ``grad_weight`` is summed in the compute dtype and its GEMMs run on the fp32 engines (not
        :attr:`grad16`) — with the logits on either.
    weight_buffers : int
        The weight chunks widened to the compute dtype that a row block keeps at once (``w_chunk``
        and ``w_chunk_next``'s ``weight_buffers - 1``): 1, or where the statistics are staged
        enough that the chunks in flight hold :data:`tiling.STAGED_LOGITS_TASKS` logits tiles
        (2 to :data:`tiling.MAX_WEIGHT_BUFFERS`; widening chunk ``c + n`` waits for chunk ``c``'s
        logits, so with two a 683-row block's 4 tiles per chunk kept 8 of 16 threads busy).
        From the shapes only.
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
    weight_buffers: int = 1
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


def fast_fused(
    *, logits16: bool, fast: bool, want_grad: bool, recompute: bool, filtering: bool, accum16_gw: bool, K: int, BT: int
) -> bool:
    """``TrainingPlan.grad16``: ``precision="fast"``'s bf16 gradient GEMMs in the fused row blocks
    — the one rule the plan is made by and the kernel checks its plan against."""
    return bool(
        logits16 and fast and want_grad and not recompute and not filtering and not accum16_gw and K > 0 and BT > 0
    )


#: rows per group of ``precision="fast"``'s partial column sums of the rounding error (fixed:
#: bitwise at any thread count; ``lm_head/passes._round_g_bf16``); even: the fused pass pairs a
#: group's rows among themselves (``passes._grad_round_bf16``)
FAST_E_GROUP = 32


#: The plan type kernels take (the op_host → op_kernel contract).
LinearCrossEntropyPlan = LinearCETiling
