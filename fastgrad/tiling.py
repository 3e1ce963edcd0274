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

from dataclasses import dataclass

from . import _config

#: The device's base block (ops-nn MemFriendlyTilingFunc: baseBT = 128, baseV = 256).
BASE_BT = 128
BASE_V = 256
#: Upper bounds on one tile: beyond these, BLAS gains nothing and the tile leaves the caches.
MAX_BT_TILE = 4096
MAX_V_TILE = 8192

#: the setting lives in the settings module (``fastgrad._config``); kept here under its old names
set_workspace_budget = _config.set_workspace_budget
workspace_budget = _config.workspace_budget


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
    """

    engine: str = "blas"
    exact: str | None = None
    variant: str | None = None
    logits16: bool = False
    isa: str = "auto"

    def exact_for(self, a, b) -> str | None:
        """The exact-product kernel for operands ``a`` and ``b`` (both 16-bit of one dtype), or None."""
        if a.dtype != b.dtype or a.dtype.itemsize != 2:
            return None
        want = "bf16" if a.dtype.name == "bfloat16" else "f32" if a.dtype.name == "float16" else None
        return self.exact if self.exact == want else None


#: BLAS for everything: what a plan made without the op layer's choice runs
BLAS = GemmChoice()


def _round_down(x: int, m: int) -> int:
    return (x // m) * m


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
        Peak scratch memory fastgrad allocates for the op: ``fixed_bytes + tile_bytes``,
        independent of BT×V.
    budget_bytes : int
        The budget the plan was made for (it bounds ``tile_bytes``).
    fixed_bytes : int
        Output-sized fp32 buffers (``[BT, H]`` grad_input accumulator, fp32 input copy).
    tile_bytes : int
        Per-tile scratch (logits/g tile, fp32 weight tile, grad_weight tile, products).
    gemm : GemmChoice
        The GEMMs the kernel runs (chosen by the op layer from the settings).
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

    def v_ranges(self):
        for v0 in range(0, self.V, self.v_tile):
            yield v0, min(v0 + self.v_tile, self.V)

    def bt_ranges(self):
        for b0 in range(0, self.BT, self.bt_tile):
            yield b0, min(b0 + self.bt_tile, self.BT)

    def tiles(self):
        """(b0, b1, v0, v1) in execution order."""
        for v0, v1 in self.v_ranges():
            for b0, b1 in self.bt_ranges():
                yield b0, b1, v0, v1


def _fixed_bytes(mode: str, BT: int, H: int, widen: bool) -> int:
    """Output-sized fp32 buffers: the grad_input accumulator and the fp32 copy of input."""
    return 4 * BT * H * ((mode != "forward") + bool(widen))


#: Gradient-filtering block: rows × vocabulary columns (two and a quarter of the device's base block).
FILTER_ROWS = 256
FILTER_COLS = 64


def _tile_bytes(mode: str, BT: int, H: int, bt: int, vt: int, widen: bool, filtered: bool = False) -> int:
    """Scratch of one tile — the one formula both the tile search and the report use."""
    per_col = 4 * bt  # logits / g tile
    if widen:
        per_col += 4 * H  # fp32 weight tile
    extra = 0
    if mode != "forward":
        per_col += 4 * H  # grad_weight tile accumulator
        extra += 4 * bt * H  # g·W product of one tile
        if bt < BT or filtered:
            per_col += 4 * H  # gᵀ·X product of one row tile
        if filtered:
            per_col += 8 * H + 4 * min(FILTER_ROWS, bt) + bt // FILTER_COLS + 1  # gathered W, gᵀX, g; flags
            extra += 4 * min(FILTER_ROWS, bt) * H
    return per_col * vt + extra


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
) -> LinearCETiling:
    """Choose the tile plan for the fused linear cross-entropy ops from shapes and a budget.

    The op_host tiling: from shapes and the budget only, never from the thread count.

    Parameters
    ----------
    BT, V, H : int
        Shapes: input ``[BT, H]``, weight ``[V, H]``.
    mode : {"memory_saving", "high_performance", "forward"}
    widen : bool
        True when the inputs are 16-bit and need fp32 copies for BLAS (counted in the workspace).
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
    """
    filtered = filter_eps is not None and mode == "memory_saving"
    budget = workspace_budget() if budget_bytes is None else int(budget_bytes)
    BT, V, H = int(BT), int(V), int(H)
    bt = max(1, min(BT, MAX_BT_TILE))
    if bt < BT:
        bt = _round_down(bt, BASE_BT)
    while True:
        fixed_part = _tile_bytes(mode, BT, H, bt, 0, widen, filtered)
        per_col = _tile_bytes(mode, BT, H, bt, 1, widen, filtered) - fixed_part
        vt = (budget - fixed_part) // per_col if per_col else V
        if vt >= min(BASE_V, max(V, 1)) or bt <= BASE_BT:
            break
        bt = max(BASE_BT, _round_down(bt // 2, BASE_BT))
    if vt >= V:
        vt = max(V, 1)
    else:
        vt = max(BASE_V, _round_down(vt, BASE_V))
    vt = max(1, min(vt, MAX_V_TILE, max(V, 1)))
    fixed = _fixed_bytes(mode, BT, H, widen)
    tile = _tile_bytes(mode, BT, H, bt, vt, widen, filtered)
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
    )


#: The plan type kernels take (the op_host → op_kernel contract).
LinearCrossEntropyPlan = LinearCETiling
