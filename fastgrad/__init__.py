"""fastgrad: Numba-parallel CPU kernels reproducing CANN aclnn backward operators.

Public ops (aclnn names in snake_case; contract in docs/spec.md):

* :func:`fused_linear_online_max_sum`            (aclnnFusedLinearOnlineMaxSum)
* :func:`fused_cross_entropy_loss_with_max_sum`  (aclnnFusedCrossEntropyLossWithMaxSum)
* :func:`fused_linear_cross_entropy_loss_grad`   (aclnnFusedLinearCrossEntropyLossGrad)
* :func:`cross_entropy_loss_grad`                (aclnnCrossEntropyLossGrad)
* :func:`scaled_masked_softmax_backward`         (aclnnScaledMaskedSoftmaxBackward)
* :func:`smooth_l1_loss_backward`                (aclnnSmoothL1LossBackward)
* :func:`embedding_dense_backward`               (aclnnEmbeddingDenseBackward)

Backends: ``available_backends``, ``set_backend``, ``use_backend``; strict device parity:
``strict``; the SoC whose kernels the ops follow:
``soc_version``, ``set_soc_version``, ``get_soc_version`` (fastgrad/soc.py); errors:
:class:`AclnnError` with ``.status``; large fresh outputs on recycled memory:
``output_cache``, ``set_output_cache_limit``, ``empty_cache``, ``output_cache_info``; the GEMM
engine of the fused linear kernels: ``gemm_engine``, ``set_gemm_engine``, ``gemm``; the
device's deterministic mode (``ACL_OPT_DETERMINISTIC``): ``deterministic``, ``set_deterministic``,
``is_deterministic``; every
setting in force at once: ``settings()`` (a frozen :class:`Settings`, fastgrad/_config.py); one call's
own settings: ``options=Options(...)`` (the LM-head ops); the tile plan an LM-head op will run:
``plan(op, BT, V, H, dtype=...)``, its GEMMs: ``gemm_choice(dtype)``.
"""

import importlib
from typing import TYPE_CHECKING, Any

from ._config import (
    Options,
    Settings,
    deterministic,
    gemm,
    gemm_engine,
    get_num_threads,
    get_soc_version,
    is_deterministic,
    is_strict,
    num_threads,
    progress,
    set_deterministic,
    set_gemm_engine,
    set_num_threads,
    set_soc_version,
    set_strict,
    settings,
    soc_version,
    strict,
)
from ._version import __version__
from .errors import (
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_ERR_RUNTIME_ERROR,
    AclnnError,
    AclnnNullptrError,
    AclnnParamError,
    AclnnRuntimeError,
)

#: the names whose modules import NumPy's kernels and Numba, loaded on first use: ``import
#: fastgrad`` (and so ``fastgrad -h`` / ``--version``) imports none of them
_LAZY = {
    "empty_cache": "._outcache",
    "output_cache": "._outcache",
    "output_cache_info": "._outcache",
    "set_output_cache_limit": "._outcache",
    "available_backends": ".backends",
    "get_backend": ".backends",
    "set_backend": ".backends",
    "use_backend": ".backends",
    "compare": ".compare",
    "cross_entropy_loss_grad": ".ops.cross_entropy_loss_grad",
    "embedding_dense_backward": ".ops.embedding_dense_backward",
    "fused_cross_entropy_loss_with_max_sum": ".ops.fused_cross_entropy_loss_with_max_sum",
    "fused_linear_cross_entropy_loss_grad": ".ops.fused_linear_cross_entropy_loss_grad",
    "fused_linear_online_max_sum": ".ops.fused_linear_online_max_sum",
    "linear_cross_entropy": ".ops.linear_cross_entropy",
    "plan": ".ops.plan",
    "gemm_choice": ".ops.plan",
    "scaled_masked_softmax_backward": ".ops.scaled_masked_softmax_backward",
    "smooth_l1_loss_backward": ".ops.smooth_l1_loss_backward",
}

if TYPE_CHECKING:  # the lazy names, for type checkers and IDEs
    from ._outcache import empty_cache, output_cache, output_cache_info, set_output_cache_limit
    from .backends import available_backends, get_backend, set_backend, use_backend
    from .compare import compare
    from .ops.cross_entropy_loss_grad import cross_entropy_loss_grad
    from .ops.embedding_dense_backward import embedding_dense_backward
    from .ops.fused_cross_entropy_loss_with_max_sum import fused_cross_entropy_loss_with_max_sum
    from .ops.fused_linear_cross_entropy_loss_grad import fused_linear_cross_entropy_loss_grad
    from .ops.fused_linear_online_max_sum import fused_linear_online_max_sum
    from .ops.linear_cross_entropy import linear_cross_entropy
    from .ops.plan import gemm_choice, plan
    from .ops.scaled_masked_softmax_backward import scaled_masked_softmax_backward
    from .ops.smooth_l1_loss_backward import smooth_l1_loss_backward


def __getattr__(name: str) -> Any:
    """A public name of :data:`_LAZY`, imported on first use (then a plain attribute)."""
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    "linear_cross_entropy",
    "AclnnError",
    "AclnnNullptrError",
    "AclnnParamError",
    "AclnnRuntimeError",
    "ACLNN_ERR_PARAM_NULLPTR",
    "ACLNN_ERR_PARAM_INVALID",
    "ACLNN_ERR_RUNTIME_ERROR",
    "strict",
    "set_strict",
    "is_strict",
    "soc_version",
    "set_soc_version",
    "get_soc_version",
    "set_num_threads",
    "get_num_threads",
    "num_threads",
    "progress",
    "gemm",
    "gemm_engine",
    "set_gemm_engine",
    "settings",
    "Options",
    "Settings",
    "deterministic",
    "set_deterministic",
    "is_deterministic",
    "empty_cache",
    "output_cache",
    "output_cache_info",
    "set_output_cache_limit",
    "available_backends",
    "set_backend",
    "get_backend",
    "use_backend",
    "fused_linear_online_max_sum",
    "fused_cross_entropy_loss_with_max_sum",
    "fused_linear_cross_entropy_loss_grad",
    "cross_entropy_loss_grad",
    "scaled_masked_softmax_backward",
    "smooth_l1_loss_backward",
    "embedding_dense_backward",
    "compare",
    "plan",
    "gemm_choice",
]
