"""``LinearCrossEntropyLoss``: the ``nn.Module`` face of :func:`linear_cross_entropy`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import invalid
from . import distributed as _vp
from ._errors import torch_error
from .functional import LinearCrossEntropyOutput, linear_cross_entropy

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["LinearCrossEntropyLoss"]


class LinearCrossEntropyLoss(torch.nn.Module):
    r"""Fused LM-head cross-entropy: ``loss(hidden, weight, target)``.

    Equivalent to ``nn.CrossEntropyLoss(ignore_index, reduction, label_smoothing)`` applied to
    ``hidden @ weight.T``, without materializing the ``[BT, V]`` logits; see
    :func:`fastgrad.torch.linear_cross_entropy` for shapes, dtypes, precision and errors.

    Parameters
    ----------
    ignore_index : int, default -100
    reduction : {"mean", "sum", "none"}, default "mean"
    label_smoothing : float in [0, 1], default 0 (PyTorch's meaning, global vocabulary)
    ce_weight, softcap, temperature, lse_square_scale, return_z_loss, return_token_accuracy,
    return_predicted_tokens, return_entropy, shift, precision, fused, filter_eps, accum_dtype, options
        As :func:`fastgrad.torch.linear_cross_entropy` (Liger / CCE names; ``options``: fastgrad's
        modes as one :class:`fastgrad.torch.LinearCrossEntropyOptions` or a preset name);
        ``forward`` takes an optional LM-head ``bias``.  PyTorch's module signature
        (``in_features, num_classes, ...``, the linear layer inside) is
        :class:`fastgrad.torch.nn.LinearCrossEntropyLoss`.
    process_group : torch.distributed.ProcessGroup, optional
        Vocabulary parallel: ``weight`` is this rank's shard.  The shard layout
        (``vocab_start_index``, ``vocab_size``) is all-gathered on the first call and reused;
        this rank's shard size must not change afterwards (AclnnError 161002), since a re-gather on one
        rank only would hang the others.
    vocab_start_index, vocab_size : int, optional
        Give the layout explicitly (no collective).

    Examples
    --------
    >>> loss_fn = LinearCrossEntropyLoss(ignore_index=-100)
    >>> loss = loss_fn(hidden, model.lm_head.weight, labels)   # hidden [B, T, H], labels [B, T]
    >>> loss.backward()
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        process_group: dist.ProcessGroup | None = None,
        *,
        vocab_start_index: int | None = None,
        vocab_size: int | None = None,
        ce_weight: torch.Tensor | None = None,
        softcap: float | None = None,
        temperature: float = 1.0,
        lse_square_scale: float = 0.0,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
        return_entropy: bool = False,
        shift: bool | int = False,
        precision: str | None = None,
        fused: bool | None = None,
        filter_eps: float | str | None = None,
        accum_dtype: torch.dtype | None = None,
        # None, a preset name or a LinearCrossEntropyOptions (or PyTorch's): as linear_cross_entropy
        options: Any = None,
    ):
        super().__init__()
        self.ce_weight = ce_weight
        self.softcap = softcap
        self.temperature = temperature
        self.lse_square_scale = lse_square_scale
        self.return_z_loss = return_z_loss
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens
        self.return_entropy = return_entropy
        self.shift = shift
        self.precision = precision
        self.fused = fused
        self.filter_eps = filter_eps
        self.accum_dtype = accum_dtype
        self.options = options
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.process_group = process_group
        self.vocab_start_index = vocab_start_index
        self.vocab_size = vocab_size
        self._layout: tuple[int, int, int] | None = None  # (local V, start, global V)

    def _shard_layout(self, local_vocab: int) -> tuple[int | None, int | None]:
        if self.process_group is None or (self.vocab_start_index is not None and self.vocab_size is not None):
            return self.vocab_start_index, self.vocab_size
        if self._layout is None:
            try:
                _vp.check_group(self.process_group)
            except TypeError as e:  # 161002 that is still the TypeError, as linear_cross_entropy's
                raise torch_error(TypeError, str(e), "process_group", "LinearCrossEntropyLoss") from None
            start, _, V = _vp.vocab_shard_range(local_vocab, self.process_group)
            self._layout = (local_vocab, start, V)
        elif self._layout[0] != local_vocab:
            raise invalid(
                "weight",
                f"this rank's shard of {self._layout[0]} rows, as when the "
                "layout was gathered (pass vocab_start_index/vocab_size or make a new "
                "module)",
                f"{local_vocab} rows",
                "LinearCrossEntropyLoss",
            )
        _, start, V = self._layout
        return (
            start if self.vocab_start_index is None else self.vocab_start_index,
            V if self.vocab_size is None else self.vocab_size,
        )

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | LinearCrossEntropyOutput:
        if isinstance(weight, torch.Tensor):
            start, V = self._shard_layout(weight.shape[0])
        else:  # refused by linear_cross_entropy (161002 naming weight) before any collective
            start, V = self.vocab_start_index, self.vocab_size
        return linear_cross_entropy(
            hidden,
            weight,
            target,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            process_group=self.process_group,
            vocab_start_index=start,
            vocab_size=V,
            bias=bias,
            ce_weight=self.ce_weight,
            softcap=self.softcap,
            temperature=self.temperature,
            lse_square_scale=self.lse_square_scale,
            return_z_loss=self.return_z_loss,
            return_token_accuracy=self.return_token_accuracy,
            return_predicted_tokens=self.return_predicted_tokens,
            return_entropy=self.return_entropy,
            shift=self.shift,
            precision=self.precision,
            fused=self.fused,
            filter_eps=self.filter_eps,
            accum_dtype=self.accum_dtype,
            options=self.options,
        )

    def extra_repr(self) -> str:
        s = f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"
        if self.process_group is not None:
            s += ", vocab_parallel=True"
        return s
