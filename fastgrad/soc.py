"""SoC profiles: where the CANN kernels of the seven ops differ between Ascend chips.

The user compares with one NPU; its kernels differ by SoC.  A profile names what differs, each
value with the ops-nn source it comes from (``hicann/ops-nn`` at e5c3fa9, paths relative to that
repository).  The setting itself lives in :mod:`fastgrad._config` (``fg.set_soc_version``,
``fg.soc_version``, ``FASTGRAD_SOC_VERSION``); the op layer (``fastgrad/ops``) reads the profile
and hands the kernels plain parameters — no kernel reads this module's state.

Names are the ones CANN writes (``aclrtGetSocName``; ``op_host/config/<soc>`` directories):

=================  =========================  ==================================================
profile            CANN names accepted        product
=================  =========================  ==================================================
``"Ascend910B"``   ``Ascend910B``,            Atlas A2 training/inference (the default)
                   ``Ascend910B1``…``B4``,
                   ``Ascend910B4-1``, …
``"Ascend910_93"`` ``Ascend910_93``,          Atlas A3 training/inference
                   ``Ascend910_9391``,
                   ``Ascend910_9382``, …
``"Ascend950"``    ``Ascend950``,             Ascend 950PR / 950DT (arch35, "regbase")
                   ``Ascend950PR_…``,
                   ``Ascend950DT_…``
=================  =========================  ==================================================

Matching is case-insensitive (ops-nn's config directories write ``ascend910b``); an unknown
name raises ``ValueError`` listing the profiles.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: the profile names, in CANN's spelling
ASCEND910B = "Ascend910B"
ASCEND910_93 = "Ascend910_93"
ASCEND950 = "Ascend950"
SOC_VERSIONS = (ASCEND910B, ASCEND910_93, ASCEND950)
DEFAULT_SOC_VERSION = ASCEND910B


@dataclass(frozen=True)
class SocProfile:
    """What the kernels of one SoC do differently (each field: its source at ops-nn e5c3fa9)."""

    #: the profile's CANN name
    name: str
    #: the product line
    product: str
    #: ``fused_linear_online_max_sum`` / ``fused_linear_cross_entropy_loss_grad`` have a kernel:
    #: ``op_host/config`` holds ascend910b and ascend910_93 binaries only
    #: (``matmul/fused_linear_online_max_sum/op_host/fused_linear_online_max_sum_def.cpp:75-76``;
    #: the FLCE grad's op_api refuses other SoCs, ``aclnn_fused_linear_cross_entropy_loss_grad.cpp:215-223,317``)
    fused_linear_ops: bool
    #: smooth-L1 backward kernel: ``"tbe"`` — the CANN opp TBE DSL
    #: ``impl/dynamic/smooth_l1_loss_grad_v2.py`` (A2/A3; ops-nn
    #: ``experimental/loss/smooth_l1_loss_grad_v2`` registers it for ascend910b):
    #: ``-[d <= -β] + [d >= β] + [|d| < β]·d/(β + 1e-6)``; ``"dag"`` — the arch35 AscendC DAG
    #: (``loss/smooth_l1_loss_grad_v2/op_kernel/arch35/smooth_l1_loss_grad_v2_dag.h``; binary
    #: for ascend950 only, ``op_host/config/ascend950``)
    smooth_l1_kernel: str
    #: scaled masked softmax backward: the largest last dimension S2 the op_api accepts
    #: (``vfusion/scaled_masked_softmax_grad_v2/op_host/op_api/aclnn_scaled_masked_softmax_backward.cpp:32-33,104-109``:
    #: 4096, 8192 on regbase SoCs; the tiling the same, ``scaled_masked_softmax_grad_v2_tiling.cpp:41-42,136-143``)
    softmax_grad_max_s2: int
    #: cross-entropy grad: the target dtypes the kernel is built for
    #: (``loss/cross_entropy_loss_grad/op_host/cross_entropy_loss_grad_def.cpp:44-49`` int64 for
    #: ascend910b/910_93, ``:20-21,96-101,126`` int64 and int32 for ascend950)
    ce_grad_target_dtypes: tuple
    #: cross-entropy grad: a row is ignored when ``target == ignore_index`` whatever the sign
    #: (910B kernel: ``op_kernel/cross_entropy_loss_grad_base.h:198-220``), or only when
    #: ``ignore_index >= 0`` (arch35: ``op_kernel/arch35/cross_entropy_loss_grad_weight_none.h:143-175``,
    #: ``..._weight_not_none.h:132-143,479-486``; the mean then divides by N, resp. Σ weight[t])
    ce_grad_ignore_any_sign: bool
    #: cross-entropy grad: the kernel computes ``label_smoothing != 0`` (arch35 ``SmoothLabel``,
    #: ``arch35/cross_entropy_loss_grad_weight_none.h:57-93,117-119``); the 910B kernel never
    #: writes its output then (``cross_entropy_loss_grad_weight_none.h:119-130``) or writes
    #: garbage (``cross_entropy_loss_grad_weight_not_none.h:133-149``)
    ce_grad_label_smoothing: bool
    #: the AI-vector-core count the tilings split rows over (``GetCoreNumAiv()``): the deterministic
    #: embedding kernel's core partition depends on it (``index/embedding_dense_grad_v2/op_host/
    #: embedding_dense_grad_v2_tiling.cpp:298-300,512``, ``Tiling4Deterministic`` :191-197).  40 on
    #: Ascend910B3/B4 (20 AI cores × 2), 48 on B1/B2 and the A3 dies (24 × 2); the family names
    #: (``"Ascend910B"``, ``"Ascend910_93"``) take 48 — name the chip for the other count.  None on
    #: Ascend 950 (no fastgrad behaviour depends on it there)
    aiv_cores: int | None = None
    #: the CANN name the profile was asked for (``"Ascend910B3"``); the family name by default
    chip: str = ""


#: Atlas A2 (the default); A3 runs the same binaries (op_host/config/ascend910b and .../ascend910_93)
_A2 = SocProfile(
    name=ASCEND910B,
    product="Atlas A2 training/inference",
    fused_linear_ops=True,
    smooth_l1_kernel="tbe",
    softmax_grad_max_s2=4096,
    ce_grad_target_dtypes=("int64",),
    ce_grad_ignore_any_sign=True,
    ce_grad_label_smoothing=False,
    aiv_cores=48,
    chip=ASCEND910B,
)

PROFILES: dict[str, SocProfile] = {
    ASCEND910B: _A2,
    ASCEND910_93: replace(_A2, name=ASCEND910_93, product="Atlas A3 training/inference", chip=ASCEND910_93),
    ASCEND950: SocProfile(
        name=ASCEND950,
        product="Ascend 950PR/950DT",
        fused_linear_ops=False,
        smooth_l1_kernel="dag",
        softmax_grad_max_s2=8192,
        ce_grad_target_dtypes=("int64", "int32"),
        ce_grad_ignore_any_sign=False,
        ce_grad_label_smoothing=True,
        chip=ASCEND950,
    ),
}

#: the chips whose AI-vector-core count differs from their family's (lower-case CANN names;
#: a longer name such as ``Ascend910B4-1`` takes the longest entry it starts with)
AIV_CORES: dict[str, int] = {
    "ascend910b1": 48,
    "ascend910b2": 48,
    "ascend910b2c": 48,
    "ascend910b3": 40,
    "ascend910b4": 40,
}

#: prefixes of the finer names ``aclrtGetSocName`` returns, longest first
_PREFIXES = (("ascend910_93", ASCEND910_93), ("ascend910b", ASCEND910B), ("ascend950", ASCEND950))


def profile_name(name: str) -> str:
    """The profile a CANN SoC name belongs to (``"Ascend910B3"`` -> ``"Ascend910B"``).

    Raises ``ValueError`` for anything else (a name of a SoC fastgrad has no profile for,
    such as ``"Ascend310P3"``, or not a string).
    """
    low = name.strip().lower() if isinstance(name, str) else None
    for prefix, prof in _PREFIXES:
        if low is not None and low.startswith(prefix):
            return prof
    raise ValueError(
        f"soc_version: expected one of {', '.join(SOC_VERSIONS)} (or a finer CANN name of one of "
        f"them, e.g. Ascend910B3, Ascend910_9391, Ascend950PR_9599), got {name!r}"
    )


def get_profile(name: str) -> SocProfile:
    """The :class:`SocProfile` of a CANN SoC name (see :func:`profile_name`): the family's
    behaviours, with ``chip`` the name given and ``aiv_cores`` the chip's (:data:`AIV_CORES`)."""
    prof = PROFILES[profile_name(name)]
    low = name.strip().lower()
    if low == prof.name.lower():
        return prof
    cores = prof.aiv_cores
    for chip in sorted(AIV_CORES, key=len, reverse=True):
        if low.startswith(chip):
            cores = AIV_CORES[chip]
            break
    return replace(prof, chip=name.strip(), aiv_cores=cores)
