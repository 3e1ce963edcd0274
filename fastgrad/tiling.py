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

from dataclasses import replace

from . import _config
from .lm_head.plan_types import (  # noqa: F401  (re-exported: the plans' types, the op_host → op_kernel contract)
    _NATIVE_KINDS,
    ACLNN_GEMM_TILE,
    BLAS,
    FAST_E_GROUP,
    FILTER_COLS,
    FILTER_ROWS,
    NATIVE_COLS,
    TRAIN_GRAD_INPUT_TILE,
    TRAIN_GRAD_WEIGHT_ROWS,
    TRAIN_LOGITS_TILE,
    Buffer,
    BufferSource,
    GemmChoice,
    LinearCETiling,
    LinearCrossEntropyPlan,
    LossParams,
    TileGrid,
    TrainingPlan,
    _round_down,
    b_cols,
    b_size,
    fast_fused,
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
    """Every buffer the LM-head loop (``lm_head/loop.py``: its operands and the op's epilogue,
    each declaring its own: ``Operands.buffers`` + ``OnlineStats.buffers`` / ``FlceGrad.buffers``)
    allocates for a plan of ``bt × vt`` tiles over ``[BT, V]`` with hidden size ``H``, input
    ``dtype`` and the GEMMs ``gemm`` — the list the kernels take their buffers from, so the memory
    estimate is what the call holds (tests/test_lm_head_buffers.py measures it).

    Not listed: ``[BT]`` row vectors of the entry points (statistics, target columns), the
    gradient filter's per-block index arrays (a few KiB), and the GEMM engines' own per-thread
    buffers (OpenBLAS's packing; the native kernel's copies of ``A`` rows, ≤ 512 × 2048 words per
    pool thread, kept between calls)."""
    from .lm_head.epilogues.flce_grad import FlceGrad
    from .lm_head.epilogues.online_stats import OnlineStats
    from .lm_head.loop import Operands

    gemm = BLAS if gemm is None else gemm
    bt, vt = max(int(bt), 0), max(int(vt), 0)
    grad, logits = mode != "forward", mode != "high_performance"
    out = Operands.buffers(BT, H, bt, vt, dtype=dtype, gemm=gemm, logits=logits, grad=grad)
    if not grad:  # the online max-sum's epilogue
        return tuple(out + OnlineStats.buffers(bt, vt))
    b16 = gemm.exact_for_dtype(dtype) == "bf16"
    paired = b16 and gemm.a_form == "pairs"  # the epilogue makes gᵀ's pairs
    return tuple(out + FlceGrad.buffers(BT, H, bt, vt, b16=b16, filtered=filtered and logits, paired=paired))


def _scope_bytes(buffers, scope: str) -> int:
    return sum(b.nbytes for b in buffers if b.scope == scope)


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
        grad_input_tile=grad_input_tile(bt, H, largest=ACLNN_GEMM_TILE),
    )


#: vocabulary columns per chunk of the training loss's vocabulary-major passes (the forward alone
#: and the recompute of the gradient from a saved log-sum-exp)
TRAIN_VM_CHUNK = 2048

#: ``grad_input``'s ``G·W`` is an accumulator summed over the vocabulary (chunk after chunk, tile
#: after tile): its tiles are the only independent tasks of a vocabulary step, and the chain of
#: steps is a critical path on many cores.  At the Qwen2.5 head (683-row blocks, H 896) the
#: (1024, 512) grid gave 2 tasks per step: on a 16-core Xeon the train step took several times the
#: 16-thread sgemm bound (bench/results/xeon_emr.md).  :func:`grad_input_tile` cuts the grid to at
#: least :data:`GRAD_INPUT_TASKS` tiles for the FLCE grad and for the training loss with its
#: logits on the bf16 kernel, and to :data:`TRAIN_GRAD_INPUT_TASKS` for the training loss on BLAS
#: logits tiles (its staged sweep runs those slower tiles and ``Gᵀ·X`` beside the chain: on 16
#: threads 8 tiles model as fast as 16 there, and 5 % slower with the bf16 logits kernel).
#: From the shapes and the GEMM choice only, never the thread count: the grid decides bits on
#: OpenBLAS's AVX2 kernels (Haswell / Zen: an output element's sum depends on the call's rows and
#: columns there; not on its AVX-512 kernels — tests/test_grad_input_grid.py), so a grid that
#: followed the thread count would make the results follow it too.  Each tile is a BLAS call that
#: packs its operands again: 28 tiles of 171 × 128 ran the 683 × 8192 × 896 product at 84 GF/s
#: against 103 GF/s for one call and 96 GF/s for 8 tiles of 342 × 224 (OpenBLAS's Haswell kernel,
#: one thread, Zen 4).  Figures: bench/results/README.md.
GRAD_INPUT_TASKS = 16
TRAIN_GRAD_INPUT_TASKS = 8
GRAD_INPUT_MIN_TILE = 128


#: The staged statistics sweep widens weight chunk ``c + n`` into the buffer chunk ``c``'s logits
#: read (``n``: :attr:`TrainingPlan.weight_buffers`), so at most ``n`` chunks' logits tiles run at
#: once: at the Qwen2.5 head (683-row blocks, 4 tiles of ≤ 1024 × 2048 per 8192-column chunk) two
#: buffers kept 8 of 16 threads busy (bench/schedule_model.py: the BLAS path's train step 70 % →
#: 94 % of 16 threads with four; bench/results/README.md).  :func:`weight_buffers` keeps at least
#: this many tiles in flight, from the shapes only, with at most :data:`MAX_WEIGHT_BUFFERS` buffers.
STAGED_LOGITS_TASKS = 16
MAX_WEIGHT_BUFFERS = 4


def weight_buffers(rows: int, chunk: int, tile: tuple[int, int] = TRAIN_LOGITS_TILE) -> int:
    """The staged statistics sweep's widened weight chunks (:attr:`TrainingPlan.weight_buffers`)
    for a block of ``rows`` rows and chunks of ``chunk`` columns on logits tiles of ``tile``: two,
    or more until they hold :data:`STAGED_LOGITS_TASKS` tiles, at most :data:`MAX_WEIGHT_BUFFERS`."""
    per = -(-max(int(rows), 1) // tile[0]) * -(-max(int(chunk), 1) // tile[1])
    return max(2, min(MAX_WEIGHT_BUFFERS, -(-STAGED_LOGITS_TASKS // per)))


def grad_input_tile(
    rows: int, H: int, largest: tuple[int, int] = TRAIN_GRAD_INPUT_TILE, tasks: int = GRAD_INPUT_TASKS
) -> tuple[int, int]:
    """``grad_input``'s GEMM tile (rows × columns of ``H``) for a block of ``rows`` rows: ``largest``,
    its longer side halved (columns on a tie; each side down to :data:`GRAD_INPUT_MIN_TILE`, then
    the other) until the block has ``tasks`` tiles — the squarest tiles of that count, which a BLAS
    call runs fastest (:data:`GRAD_INPUT_TASKS`).  From the shapes only."""
    r, c = (max(int(x), 1) for x in largest)
    rows, H = max(int(rows), 1), max(int(H), 1)
    r, c = min(r, rows), min(c, H)
    m = GRAD_INPUT_MIN_TILE

    def tiles(r: int, c: int) -> int:
        return -(-rows // r) * -(-H // c)

    while tiles(r, c) < tasks:
        if c > m and (c >= r or r <= m):
            c = max(m, -(-c // 2))
        elif r > m:
            r = max(m, -(-r // 2))
        else:
            break
    return r, c


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
    # gradient to follow; the gradient where it is dense, grad_weight summed in the compute dtype
    # and its GEMMs on the fp32 engines (not precision="fast"'s fused pass and bf16 kernel)
    staged_stats = bool(staged) and not logits16 and want_grad and not recompute
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
    staged_grad = bool(staged) and want_grad and not recompute and not filtering and not (accum16 and g3[1])
    staged_grad = staged_grad and K > 0 and not grad16
    plan = TrainingPlan(
        BT=BT,
        K=K,
        V=V,
        H=H,
        budget_rows=rows,
        block_rows=block,
        grad_input_tile=grad_input_tile(block, H, tasks=GRAD_INPUT_TASKS if logits16 else TRAIN_GRAD_INPUT_TASKS),
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
        weight_buffers=weight_buffers(block, vc) if staged_stats else 1,
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
            accum16=accum16,
            fast=fast,
            a_form=a_form,
        ),
    )


def training_buffers(
    plan: TrainingPlan,
    *,
    itemsize: int,
    widen: bool,
    grads: tuple[bool, bool, bool],
    accum16: bool = False,
    fast: bool = False,
    a_form: str | None = None,
) -> tuple[Buffer, ...]:
    """Every buffer the training loss's kernel (``kernels/linear_cross_entropy.py``) allocates for
    ``plan`` and what the call computes (see :func:`plan_training_loss`): the concatenation of its
    components' own declarations (``lm_head.epilogues.recompute.buffers`` for the
    vocabulary-major recompute, ``lm_head.epilogues.train_rows.buffers`` for the row blocks, each
    with the bf16 logits' ``kernels/_bf16dot.Logits.buffers``), the list the kernel takes its
    buffers from by name, so
    ``plan.workspace_bytes`` is what the call holds (tests/test_training_buffers.py measures it).

    Scope ``"call"``: sized by the call (copies of ``X`` or of the whole weight, ``[BT, H]``
    products, ``[K]`` indices); ``"tile"``: by the plan (a row block's logits, a chunk's weight
    and products).  Not listed: ``[BT]`` row vectors (statistics, coefficients, target columns),
    the filter's per-block index arrays (``[K]`` int64 per row block, freed before the next),
    a non-contiguous weight's contiguous copy, and the GEMM engines' own per-thread buffers."""
    from .lm_head.epilogues import recompute as vocab_major
    from .lm_head.epilogues import train_rows

    if plan.BT == 0:
        return ()
    cdt = "float64" if itemsize == 8 else "float32"
    g3 = (bool(grads[0]), bool(grads[1]), bool(grads[2]))
    if plan.vocab_major:  # the recompute of the gradient from a saved lse
        return tuple(
            vocab_major.buffers(plan, cdt=cdt, widen=widen, grads=g3, accum16=accum16, fast=fast, a_form=a_form)
        )
    return tuple(train_rows.buffers(plan, cdt=cdt, widen=widen, grads=g3, accum16=accum16, a_form=a_form))
