"""PyTorch integration: a fused linear cross-entropy loss for the LM head, vocabulary parallel.

* :func:`linear_cross_entropy` — ``F.cross_entropy(hidden @ weight.T, target, ...)`` without ever
  materializing the ``[BT, V]`` logits: forward through :func:`fastgrad.fused_linear_online_max_sum`
  (+ :func:`fastgrad.fused_cross_entropy_loss_with_max_sum`), backward through the memory-saving
  :func:`fastgrad.fused_linear_cross_entropy_loss_grad`.  With ``process_group=`` the weight is a
  vocabulary shard and the statistics are all-reduced as Megatron's ``_VocabParallelCrossEntropy``.
* :class:`LinearCrossEntropyLoss` — the ``nn.Module`` face.
* :mod:`fastgrad.torch.distributed` — shard layout helpers (:func:`split_vocab`,
  :func:`shard_weight`, :func:`vocab_shard_range`).

PyTorch is optional for fastgrad; only this subpackage needs it.  See ``docs/torch.md``.
"""

try:
    import torch as _torch  # noqa: F401  (absolute import: the real PyTorch)
except ImportError as _e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "fastgrad.torch needs PyTorch, which is not installed. Install it with "
        "`pip install torch` (CPU-only wheels: "
        "`pip install torch --index-url https://download.pytorch.org/whl/cpu`) "
        "or `pip install fastgrad[torch]`. The rest of fastgrad works without it."
    ) from _e

from .functional import LinearCrossEntropyFunction, linear_cross_entropy
from .module import LinearCrossEntropyLoss
from .distributed import split_vocab, shard_weight, vocab_shard_range

__all__ = ["linear_cross_entropy", "LinearCrossEntropyFunction", "LinearCrossEntropyLoss",
           "split_vocab", "shard_weight", "vocab_shard_range"]
