"""PyTorch integration: a fused linear cross-entropy loss for the LM head, vocabulary parallel.

* :func:`linear_cross_entropy` — ``F.cross_entropy(hidden @ weight.T, target, ...)`` without ever
  materializing the ``[BT, V]`` logits, through :func:`fastgrad.linear_cross_entropy` (row
  blocks, forward and backward fused; the aclnn pipeline with ``precision="device"``).  With
  ``process_group=`` the weight is a vocabulary shard and the statistics are all-reduced as
  Megatron's ``_VocabParallelCrossEntropy``.
* :class:`LinearCrossEntropyLoss` — the ``nn.Module`` face.
* :mod:`fastgrad.torch.nn` — PyTorch 2.13's API as a front door:
  ``fastgrad.torch.nn.functional.linear_cross_entropy`` and ``fastgrad.torch.nn.LinearCrossEntropyLoss``
  with exactly the signatures of ``torch.nn.functional.linear_cross_entropy`` and
  ``torch.nn.LinearCrossEntropyLoss`` (switching is one import).
* :class:`LinearCrossEntropyOptions` — fastgrad's modes in one object, with named presets.
* :func:`apply_to` / ``apply_fastgrad_to_<arch>()`` — Hugging Face causal LMs train through it.
* :mod:`fastgrad.torch.distributed` — shard layout helpers (:func:`split_vocab`,
  :func:`shard_weight`, :func:`vocab_shard_range`).

PyTorch is optional for fastgrad; only this subpackage needs it.  See ``docs/torch.md``.
"""

try:
    import torch as _torch  # noqa: F401  (absolute import: the real PyTorch)
except ImportError as _e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "fastgrad.torch needs PyTorch, which is not installed. Install its CPU build with "
        "`pip install torch --index-url https://download.pytorch.org/whl/cpu` "
        "(a plain `pip install torch` pulls the CUDA build, GBs). The rest of fastgrad works without it."
    ) from _e

from .distributed import shard_weight, split_vocab, vocab_shard_range
from .functional import LinearCrossEntropyFunction, LinearCrossEntropyOutput, linear_cross_entropy
from .hf import (
    apply_fastgrad_to_cohere,
    apply_fastgrad_to_cohere2,
    apply_fastgrad_to_exaone4,
    apply_fastgrad_to_gemma,
    apply_fastgrad_to_gemma2,
    apply_fastgrad_to_gemma3_text,
    apply_fastgrad_to_glm4,
    apply_fastgrad_to_granite,
    apply_fastgrad_to_granitemoe,
    apply_fastgrad_to_llama,
    apply_fastgrad_to_mistral,
    apply_fastgrad_to_mixtral,
    apply_fastgrad_to_olmo2,
    apply_fastgrad_to_olmo3,
    apply_fastgrad_to_phi3,
    apply_fastgrad_to_qwen2,
    apply_fastgrad_to_qwen3,
    apply_fastgrad_to_qwen3_moe,
    apply_fastgrad_to_smollm3,
    apply_to,
    is_patched,
    revert,
)
from .module import LinearCrossEntropyLoss
from .options import PRESETS, LinearCrossEntropyOptions, choose_schedule

__all__ = [
    "linear_cross_entropy",
    "LinearCrossEntropyFunction",
    "LinearCrossEntropyOutput",
    "LinearCrossEntropyLoss",
    "LinearCrossEntropyOptions",
    "PRESETS",
    "choose_schedule",
    "split_vocab",
    "shard_weight",
    "vocab_shard_range",
    "apply_to",
    "is_patched",
    "revert",
    "apply_fastgrad_to_llama",
    "apply_fastgrad_to_mistral",
    "apply_fastgrad_to_mixtral",
    "apply_fastgrad_to_gemma",
    "apply_fastgrad_to_gemma2",
    "apply_fastgrad_to_gemma3_text",
    "apply_fastgrad_to_qwen2",
    "apply_fastgrad_to_qwen3",
    "apply_fastgrad_to_qwen3_moe",
    "apply_fastgrad_to_phi3",
    "apply_fastgrad_to_granite",
    "apply_fastgrad_to_granitemoe",
    "apply_fastgrad_to_olmo2",
    "apply_fastgrad_to_olmo3",
    "apply_fastgrad_to_glm4",
    "apply_fastgrad_to_smollm3",
    "apply_fastgrad_to_exaone4",
    "apply_fastgrad_to_cohere",
    "apply_fastgrad_to_cohere2",
]
