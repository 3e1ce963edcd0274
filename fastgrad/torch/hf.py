"""Hugging Face ``transformers`` integration: the causal-LM loss through fastgrad.

``apply_to(model_or_class)`` (or ``apply_fastgrad_to_llama()``, ``..._qwen2()``, ``..._qwen3()``,
``..._mistral()``, ``..._gemma2()``, as Liger's ``apply_liger_kernel_to_*``) replaces the
``forward`` of a ``*ForCausalLM`` so that, **in training mode with labels**, the loss is
:func:`fastgrad.torch.linear_cross_entropy` of the last hidden states and the LM-head weight
(shifted labels, ``ignore_index=-100``, Gemma-2's ``final_logit_softcapping``; ``sum /
num_items_in_batch`` when the Trainer passes it for gradient accumulation) and the ``[B, T, V]``
logits are never built (``outputs.logits`` is None).  Everything else — eval mode, no labels,
generation — runs the original ``forward`` unchanged.

``torch.compile``: the fastgrad loss is a graph break (a Python autograd Function over NumPy
kernels); compile the decoder (``model.model = torch.compile(model.model)``) rather than the
whole causal-LM.
"""

from __future__ import annotations

import functools
import importlib
import types

import torch

from ..errors import invalid
from .functional import linear_cross_entropy

__all__ = [
    "apply_to",
    "revert",
    "apply_fastgrad_to_llama",
    "apply_fastgrad_to_qwen2",
    "apply_fastgrad_to_qwen3",
    "apply_fastgrad_to_mistral",
    "apply_fastgrad_to_gemma2",
    "SUPPORTED",
]

#: architecture -> (module, class) of the current transformers release
SUPPORTED = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralForCausalLM"),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", "Gemma2ForCausalLM"),
}
_ATTR = "_fastgrad_original_forward"
#: the loss keyword arguments the Trainer / loss_function take (not passed to the decoder)
_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


def _make_forward(original, **loss_kw):
    @functools.wraps(original)
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        if labels is None or not self.training:
            return original(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.pop("num_items_in_batch", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        shift_labels = kwargs.pop("shift_labels", None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        head = self.get_output_embeddings()
        softcap = getattr(self.config, "final_logit_softcapping", None)
        if shift_labels is None:
            target, shift = labels, 1
        else:
            target, shift = shift_labels, 0
        reduction = "sum" if num_items is not None else "mean"
        loss = linear_cross_entropy(
            hidden,
            head.weight,
            target.to(hidden.device),
            ignore_index=ignore_index,
            reduction=reduction,
            bias=getattr(head, "bias", None),
            softcap=softcap,
            shift=shift,
            **loss_kw,
        )
        if num_items is not None:
            if torch.is_tensor(num_items):
                num_items = num_items.to(loss.device)
            loss = loss / num_items
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    forward._fastgrad_patched = True
    return forward


def apply_to(model_or_class, **loss_kw):
    """Route the training loss of a causal-LM model (instance or class) through fastgrad.

    ``loss_kw`` are passed to :func:`linear_cross_entropy` (e.g. ``lse_square_scale``,
    ``label_smoothing``, ``precision``).  An instance is patched alone; a class patches every
    instance.  Returns the argument.  Raises AclnnError 161002 for an object without the
    causal-LM structure (``model.model`` decoder, ``get_output_embeddings()``).
    """
    if isinstance(model_or_class, type):
        cls = model_or_class
        if getattr(cls.forward, "_fastgrad_patched", False):
            return cls
        if not hasattr(cls, "get_output_embeddings"):
            raise invalid("model_or_class", "a transformers *ForCausalLM class", cls.__name__, "apply_to")
        original = cls.forward
        setattr(cls, _ATTR, original)
        cls.forward = _make_forward(original, **loss_kw)
        return cls
    model = model_or_class
    if not (hasattr(model, "get_output_embeddings") and hasattr(model, "model")):
        raise invalid("model_or_class", "a transformers *ForCausalLM model", type(model).__name__, "apply_to")
    if getattr(model.forward, "_fastgrad_patched", False):
        return model
    original = type(model).forward
    model.forward = types.MethodType(_make_forward(original, **loss_kw), model)
    return model


def revert(model_or_class):
    """Undo :func:`apply_to`."""
    if isinstance(model_or_class, type):
        if _ATTR in model_or_class.__dict__:
            model_or_class.forward = model_or_class.__dict__[_ATTR]
            delattr(model_or_class, _ATTR)
    elif "forward" in vars(model_or_class):
        del model_or_class.forward
    return model_or_class


def _arch(name):
    def apply(**loss_kw):
        mod, cls = SUPPORTED[name]
        return apply_to(getattr(importlib.import_module(mod), cls), **loss_kw)

    apply.__name__ = f"apply_fastgrad_to_{name}"
    apply.__doc__ = f"Patch ``{SUPPORTED[name][1]}`` (every instance): see :func:`apply_to`."
    return apply


apply_fastgrad_to_llama = _arch("llama")
apply_fastgrad_to_qwen2 = _arch("qwen2")
apply_fastgrad_to_qwen3 = _arch("qwen3")
apply_fastgrad_to_mistral = _arch("mistral")
apply_fastgrad_to_gemma2 = _arch("gemma2")
