"""Hugging Face ``transformers`` integration: the causal-LM loss through fastgrad.

``apply_to(model_or_class)`` (or ``apply_fastgrad_to_<family>()``, as Liger's
``apply_liger_kernel_to_*``) replaces the ``forward`` of a ``*ForCausalLM`` of a supported family
(:data:`SUPPORTED`) so that, **in training mode with labels**, the loss is
:func:`fastgrad.torch.linear_cross_entropy` of the last hidden states and the LM-head weight and
the ``[B, T, V]`` logits are never built (``outputs.logits`` is None).  The head's own transform
is applied exactly as the family's ``forward`` does it: Granite's ``logits / logits_scaling``,
Cohere's ``logits * logit_scale``, Gemma-2/3's ``final_logit_softcapping`` (a scale ``s > 0``
before a softcap ``c`` is ``softcap=c/s, temperature=1/s``).  A class outside the table — or a
subclass that overrides ``forward`` — is refused (AclnnError 161002), never computed with a head
fastgrad does not know.

The rest of the model's contract is kept: the labels are shifted as ``ForCausalLMLoss`` does
(or ``shift_labels`` taken as given), ``sum / num_items_in_batch`` when the Trainer passes it,
``logits_to_keep`` slices the hidden states as the model does (labels must match the kept
positions, as unpatched), ``return_dict=False`` returns a tuple, the MoE families add their
router load-balancing loss, and the decoder gets exactly the keywords the caller gave (the
cache keyword of the installed transformers — ``cache`` since 5.x — is never renamed or
added).  Eval mode, no labels and ``generate`` call the original ``forward`` with the caller's
arguments, untouched.

TRL: TRL's trainers (``SFTTrainer``, ``GRPOTrainer``, ...) replace ``model.forward`` with their
fused LM head (``trl.trainer.utils.add_fused_lm_head``) and call ``model(..., fused_lm_head=True)``
for per-token log-probabilities.  The patched ``forward`` serves that call through fastgrad
(``reduction="none"``: ``log_probs = -loss``, the entropy, ``is_top1``).  ``apply_to`` before the
trainer is built: fastgrad's hook on ``add_fused_lm_head`` records TRL's temperature and outputs
and keeps the fastgrad forward; ``apply_to(trainer.model)`` after: the temperature and outputs
are read from TRL's head and the fastgrad forward replaces it.

``torch.compile``: the loss is one graph break (``torch.compiler.disable``); the decoder before
it is compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import math
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from ..errors import invalid
from .functional import linear_cross_entropy

__all__ = [
    "apply_to",
    "revert",
    "is_patched",
    "SUPPORTED",
    "LOSS_KEYWORDS",
    "check_head",
]

_OP = "apply_to"


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """A family's ``*ForCausalLM``: its module and class, how its logits are scaled before the
    softcap (``scale(model) -> float``), whether it softcaps
    (``config.final_logit_softcapping``) and whether it adds a router load-balancing loss."""

    module: str
    cls: str
    scale: Callable[[Any], float] | None = None
    softcap: bool = False
    moe: bool = False


def _granite_scale(m: Any) -> float:
    return 1.0 / float(m.config.logits_scaling)  # logits = lm_head(h) / logits_scaling


def _cohere_scale(m: Any) -> float:
    return float(m.logit_scale)  # logits = lm_head(h) * self.logit_scale


def _spec(name: str, cls: str, **kw: Any) -> HeadSpec:
    return HeadSpec(f"transformers.models.{name}.modeling_{name}", cls, **kw)


#: family -> its ``*ForCausalLM`` and head transform (the heads read from each family's
#: ``forward`` in transformers 5.24): Liger-Kernel's text families with this head, and Cohere
SUPPORTED: dict[str, HeadSpec] = {
    "llama": _spec("llama", "LlamaForCausalLM"),
    "mistral": _spec("mistral", "MistralForCausalLM"),
    "mixtral": _spec("mixtral", "MixtralForCausalLM", moe=True),
    "gemma": _spec("gemma", "GemmaForCausalLM"),
    "gemma2": _spec("gemma2", "Gemma2ForCausalLM", softcap=True),
    "gemma3_text": _spec("gemma3", "Gemma3ForCausalLM", softcap=True),
    "qwen2": _spec("qwen2", "Qwen2ForCausalLM"),
    "qwen3": _spec("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": _spec("qwen3_moe", "Qwen3MoeForCausalLM", moe=True),
    "phi3": _spec("phi3", "Phi3ForCausalLM"),
    "granite": _spec("granite", "GraniteForCausalLM", scale=_granite_scale),
    "granitemoe": _spec("granitemoe", "GraniteMoeForCausalLM", scale=_granite_scale, moe=True),
    "olmo2": _spec("olmo2", "Olmo2ForCausalLM"),
    "olmo3": _spec("olmo3", "Olmo3ForCausalLM"),
    "glm4": _spec("glm4", "Glm4ForCausalLM"),
    "smollm3": _spec("smollm3", "SmolLM3ForCausalLM"),
    "exaone4": _spec("exaone4", "Exaone4ForCausalLM"),
    "cohere": _spec("cohere", "CohereForCausalLM", scale=_cohere_scale),
    "cohere2": _spec("cohere2", "Cohere2ForCausalLM", scale=_cohere_scale),
}

#: keywords of :func:`linear_cross_entropy` ``apply_to`` passes on; the others are the model's
#: (``ignore_index``, ``reduction``, ``shift``, ``softcap``, ``bias`` come from the model, the
#: Trainer and the head) and are refused
LOSS_KEYWORDS = (
    "options",
    "precision",
    "fused",
    "filter_eps",
    "accum_dtype",
    "label_smoothing",
    "lse_square_scale",
    "temperature",
    "ce_weight",
)
#: TRL's per-token outputs the fastgrad head computes
TRL_OUTPUTS = ("log_probs", "entropy", "is_top1")
_ORIG = "_fastgrad_original_forward"
_SETTINGS = "_fastgrad_loss_kw"
_TRL = "_fastgrad_trl_head"
#: set by :func:`revert` on an instance whose fastgrad forward sits under another wrapper
#: (accelerate's): the forward then calls the original, untouched
_BYPASS = "_fastgrad_reverted"


def _spec_of_class(cls: type) -> tuple[str, HeadSpec] | None:
    """The family whose ``*ForCausalLM`` defines ``cls``'s forward (a subclass overriding it: None)."""
    for klass in cls.__mro__:
        if "forward" in vars(klass) or _ORIG in vars(klass):
            for name, spec in SUPPORTED.items():
                if klass.__name__ == spec.cls and klass.__module__ == spec.module:
                    return name, spec
            return None
    return None


def _original_forward(cls: type) -> Callable:
    """The class's unpatched forward (through a class patch)."""
    for klass in cls.__mro__:
        if _ORIG in vars(klass):
            return vars(klass)[_ORIG]
        if "forward" in vars(klass):
            return vars(klass)["forward"]
    raise invalid("model_or_class", "a class with a forward", cls.__name__, _OP)


def _is_ours(fn: Any) -> bool:
    f = getattr(fn, "__func__", fn)
    return getattr(f, "__code__", None) is _PATCHED_CODE


def _chain(fn: Any):
    """``fn`` and the functions it wraps (``functools.wraps``' ``__wrapped__``, through bound
    methods): accelerate's ``convert_outputs_to_fp32`` and autocast wrappers around a forward.
    Stops at fastgrad's forward (whose ``__wrapped__`` is the original) and at TRL's fused head
    (which replaces the head: what it wraps is not what runs)."""
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        yield fn
        if _is_ours(fn) or _trl_head_settings(fn) is not None:
            return
        fn = getattr(getattr(fn, "__func__", fn), "__wrapped__", None)


def _ours_in(fn: Any) -> bool:
    return any(_is_ours(f) for f in _chain(fn))


def is_patched(model_or_class: Any) -> bool:
    """Whether the effective ``forward`` of a model (instance) or class is fastgrad's, or a
    wrapper of it (accelerate's ``convert_outputs_to_fp32`` / autocast, any ``functools.wraps``
    chain) — checked by identity, not by a flag (``functools.wraps`` copies flags onto other
    wrappers, TRL's head); False after :func:`revert` left such a wrapper in place."""
    if isinstance(model_or_class, type):
        return _ours_in(vars(model_or_class).get("forward", getattr(model_or_class, "forward", None)))
    if vars(model_or_class).get(_BYPASS, False):
        return False
    inst = vars(model_or_class).get("forward")
    if inst is not None:
        return _ours_in(inst)
    return _ours_in(type(model_or_class).forward)


def _check_loss_kw(loss_kw: dict) -> dict:
    bad = [k for k in loss_kw if k not in LOSS_KEYWORDS]
    if bad:
        raise invalid(
            bad[0],
            f"one of {', '.join(LOSS_KEYWORDS)} (the model's head, the Trainer and the labels set "
            "softcap, ignore_index, reduction, shift, bias; return_* would change outputs.loss)",
            f"{bad[0]}={loss_kw[bad[0]]!r}",
            _OP,
        )
    return dict(loss_kw)


def _head_transform(model: Any, spec: HeadSpec, extra_temperature: float) -> tuple[float | None, float]:
    """``(softcap, temperature)`` for :func:`linear_cross_entropy` giving the family's logits
    ``softcap_c(s·z) / T``: ``c/s`` and ``T/s`` (``c·tanh(s·z/c) = s·(c/s)·tanh(z/(c/s))``)."""
    s = 1.0 if spec.scale is None else spec.scale(model)
    if not (math.isfinite(s) and s > 0):
        raise invalid("logit scale", "a finite scale > 0 of the model's logits", s, _OP)
    c = model.config.final_logit_softcapping if spec.softcap else None
    softcap = None if c is None else float(c) / s
    return softcap, float(extra_temperature) / s


def _slice_kept(hidden: torch.Tensor, logits_to_keep: Any) -> torch.Tensor:
    """``slice_logits_to_keep`` of transformers: the hidden states the model's head would see."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
    return hidden[:, logits_to_keep, :]


def _bind(original: Callable, model: Any, args: tuple, kwargs: dict) -> dict:
    """The caller's arguments by name (positional ones bound to the original's signature)."""
    if not args:
        return dict(kwargs)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [n for n, p in inspect.signature(original).parameters.items() if p.kind in positional][1:]
    named = dict(zip(names, args))
    clash = set(named) & set(kwargs)
    if clash or len(args) > len(names):
        raise TypeError(
            f"forward() got {len(args)} positional arguments for {len(names)}, or multiple values for {sorted(clash)}"
        )
    return {**named, **kwargs}


def _router_aux(model: Any, outputs: Any, attention_mask: Any) -> torch.Tensor:
    mod = sys.modules[_spec_of_class(type(model))[1].module]  # type: ignore[index]
    return mod.load_balancing_loss_func(
        outputs.router_logits, model.num_experts, model.num_experts_per_tok, attention_mask
    )


def _make_forward(original: Callable) -> Callable:
    def forward(self, *args, **kwargs):
        if vars(self).get(_BYPASS, False):  # reverted under a wrapper (accelerate's): the original
            return original(self, *args, **kwargs)
        fused_head = kwargs.pop("fused_lm_head", False)
        if not fused_head and not self.training:
            return original(self, *args, **kwargs)
        # the labels may be positional (model(input_ids, attention_mask, ..., labels))
        try:
            kw = _bind(original, self, args, kwargs)
        except TypeError:  # arguments the original does not take: its own TypeError
            return original(self, *args, **kwargs)
        if not fused_head and kw.get("labels") is None:
            return original(self, *args, **kwargs)
        return _training_forward(self, original, kw, fused_head)

    forward.__wrapped__ = original  # type: ignore[attr-defined]  # generate() reads the signature
    forward.__name__ = "forward"
    forward.__qualname__ = getattr(original, "__qualname__", "forward")
    forward.__doc__ = original.__doc__
    return forward


_PATCHED_CODE = _make_forward(lambda self: None).__code__


def _is_plain_linear(m: Any) -> bool:
    """An ``nn.Linear`` whose forward is ``nn.Linear``'s (``x·Wᵀ + b``)."""
    return isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward


def _peft_kind(m: Any) -> str | None:
    """``"lora"`` for PEFT's ``lora.Linear``, ``"modules_to_save"`` for its ``ModulesToSaveWrapper``."""
    mod = type(m).__module__
    if not mod.startswith("peft."):
        return None
    names = {c.__name__ for c in type(m).__mro__}
    if "ModulesToSaveWrapper" in names:
        return "modules_to_save"
    if type(m).__name__ == "Linear" and mod.startswith("peft.tuners.lora") and hasattr(m, "base_layer"):
        return "lora"
    return None


def _refuse_head(head: Any, why: str) -> None:
    raise invalid(
        "lm_head",
        "an nn.Linear LM head, PEFT's LoRA Linear on one (lora.Linear: W + s·B·A with its dropout) or "
        f"PEFT's modules_to_save copy of one ({why})",
        f"{type(head).__module__}.{type(head).__qualname__}",
        _OP,
    )


def _active_head(head: Any) -> Any:
    """The module PEFT's ``ModulesToSaveWrapper`` runs (its copy, or the original when adapters
    are off), recursively; any other head as is."""
    while _peft_kind(head) == "modules_to_save":
        act = list(getattr(head, "active_adapters", []) or [])
        if head.disable_adapters or not act or any(a not in head.modules_to_save for a in act):
            head = head.original_module
        else:
            head = head.modules_to_save[act[0]]
    return head


def _head_weight(head: Any) -> torch.Tensor:
    head = _active_head(head)
    return head.weight if _is_plain_linear(head) else head.base_layer.weight


def check_head(head: Any) -> None:
    """Refuse (AclnnError 161002, naming ``lm_head`` and its type) a head the patched forward
    does not compute exactly: anything but an ``nn.Linear``, PEFT's ``lora.Linear`` on one
    (vanilla LoRA, not DoRA or another variant, not ``fan_in_fan_out``) and PEFT's
    ``modules_to_save`` wrapper of one of those."""
    head = _active_head(head)
    if _is_plain_linear(head):
        return
    if _peft_kind(head) != "lora":
        _refuse_head(head, "another module type may compute its logits otherwise, and fastgrad would drop it")
    if not _is_plain_linear(head.base_layer):
        _refuse_head(head, "the LoRA layer's base_layer is not an nn.Linear")
    if getattr(head, "fan_in_fan_out", False):
        _refuse_head(head, "fan_in_fan_out LoRA")
    if head.disable_adapters and head.merged:
        _refuse_head(head, "adapters disabled while merged: PEFT unmerges them in its forward")
    if head.disable_adapters or head.merged:
        return
    for a in head.active_adapters:
        if a not in head.lora_A:
            continue
        if a in getattr(head, "lora_variant", {}) or getattr(head, "use_dora", {}).get(a, False):
            _refuse_head(head, f"adapter {a!r} is a LoRA variant (DoRA, ...), not W + s·B·A")
        if not (_is_plain_linear(head.lora_A[a]) and _is_plain_linear(head.lora_B[a])):
            _refuse_head(head, f"adapter {a!r}'s lora_A / lora_B are not nn.Linear")


def _head_precision() -> contextlib.AbstractContextManager:
    """The head's loss outside autocast: the decoder's output is cast to the head's dtype first
    (docs/torch.md, "Autocast"), so an fp32 head computes in fp32 — under autocast
    ``fastgrad.torch.linear_cross_entropy`` would cast its operands to the autocast dtype, as
    ``F.linear`` does.  No context at all without autocast (``torch.compile`` of the model keeps
    its one graph break at the loss)."""
    if torch.is_autocast_enabled("cpu"):
        return torch.autocast("cpu", enabled=False)
    return contextlib.nullcontext()


def _head_operands(head: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(hidden', weight', bias')`` whose linear cross-entropy is the head's: an ``nn.Linear``
    as is; PEFT's LoRA ``x·Wᵀ + b + Σ_a s_a·B_a(A_a(dropout_a(x)))`` as one product of widened
    operands ``[x | s_1·A_1(D_1(x)) | …] · [W | B_1 | …]ᵀ`` (the low-rank factors through
    autograd: their gradients, and the dropout's, are PyTorch's; ``[BT, V]`` never exists), the
    adapters in PEFT's order so the dropout draws the same masks; ``lora_B``'s own bias times
    ``s_a`` added to the bias."""
    check_head(head)
    head = _active_head(head)
    if _is_plain_linear(head):
        return hidden, head.weight, head.bias
    base = head.base_layer
    W, b = base.weight, base.bias
    if head.disable_adapters or head.merged:
        return hidden, W, b
    xs, ws = [hidden], [W]
    for a in head.active_adapters:
        if a not in head.lora_A:
            continue
        A, B, drop, s = head.lora_A[a], head.lora_B[a], head.lora_dropout[a], head.scaling[a]
        u = A(drop(hidden.to(A.weight.dtype))) * s
        xs.append(u.to(hidden.dtype))
        ws.append(B.weight.to(W.dtype))
        if B.bias is not None:
            b = (torch.zeros(W.shape[0], dtype=W.dtype) if b is None else b) + (B.bias * s).to(W.dtype)
    if len(xs) == 1:
        return hidden, W, b
    return torch.cat(xs, -1), torch.cat(ws, 1), b


def _training_forward(self, original: Callable, kw: dict, fused_head: bool):
    name, spec = _spec_of_class(type(self)) or (None, None)
    if spec is None:  # the class was swapped after the patch
        raise invalid("model", "a supported *ForCausalLM", type(self).__name__, _OP)
    loss_kw = dict(getattr(self, _SETTINGS, {}) or {})
    labels = kw.pop("labels", None)
    logits_to_keep = kw.pop("logits_to_keep", 0)
    return_dict = kw.pop("return_dict", None)
    num_items = kw.pop("num_items_in_batch", None)
    ignore_index = kw.pop("ignore_index", -100)
    shift_labels = kw.pop("shift_labels", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    router = None
    if spec.moe:
        router = kw.pop("output_router_logits", None)
        if router is None:
            router = getattr(self.config, "output_router_logits", False)
        kw["output_router_logits"] = router
    if fused_head:
        kw["use_cache"] = False
    # the decoder's own output object whatever return_dict says (the model returns the tuple)
    outputs = self.model(**kw, return_dict=True)
    hidden = outputs.last_hidden_state
    head = self.get_output_embeddings()
    check_head(head)  # before anything is computed with it
    w_dtype = _head_weight(head).dtype
    if hidden.dtype != w_dtype:  # autocast: the decoder's output in the autocast dtype
        hidden = hidden.to(w_dtype)  # the head in the weight's precision (fp32: exact)
    softcap, temperature = _head_transform(self, spec, loss_kw.pop("temperature", 1.0))
    if fused_head:
        return _trl_forward(
            self, outputs, hidden, head, labels, shift_labels, num_items, softcap, temperature, loss_kw, router, kw
        )
    hidden = _slice_kept(hidden, logits_to_keep)
    if shift_labels is None:
        target, shift = labels, 1
    else:
        target, shift = shift_labels, 0
    target = target.to(hidden.device)
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise invalid(
            "labels",
            f"the shape of the positions the head scores, {tuple(hidden.shape[:-1])} (logits_to_keep="
            f"{logits_to_keep if not torch.is_tensor(logits_to_keep) else 'a tensor'}; as unpatched, labels must "
            "match the kept positions)",
            f"shape {tuple(target.shape)}",
            _OP,
        )
    reduction = "sum" if num_items is not None else "mean"
    hidden, weight, bias = _head_operands(head, hidden)
    with _head_precision():
        loss = linear_cross_entropy(
            hidden,
            weight,
            target,
            ignore_index=ignore_index,
            reduction=reduction,
            bias=bias,
            softcap=softcap,
            temperature=temperature,
            shift=shift,
            **loss_kw,
        )
    if num_items is not None:
        if torch.is_tensor(num_items):
            num_items = num_items.to(loss.device)
        loss = loss / num_items
    fields: dict[str, Any] = {"loss": loss, "logits": None}
    aux = None
    if spec.moe and router:
        aux = _router_aux(self, outputs, kw.get("attention_mask"))
        loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        fields["loss"] = loss
    out_cls = _output_class(spec)
    names = {f.name for f in dataclasses.fields(out_cls)}
    for f in ("cache", "past_key_values", "hidden_states", "attentions", "router_logits"):
        if f in names and hasattr(outputs, f):
            fields[f] = getattr(outputs, f)
    if "aux_loss" in names:
        fields["aux_loss"] = aux
    out = out_cls(**fields)
    return out if return_dict else out.to_tuple()


def _output_class(spec: HeadSpec) -> type:
    from transformers import modeling_outputs as mo

    return mo.MoeCausalLMOutputWithPast if spec.moe else mo.CausalLMOutputWithPast


def _trl_forward(
    self, outputs, hidden, head, labels, shift_labels, num_items, softcap, temperature, loss_kw, router, kw
):
    """TRL's ``fused_lm_head=True`` call (``trl.trainer.utils.add_fused_lm_head``), through fastgrad:
    per-token ``log_probs`` (0 where the label is -100), ``entropy``, ``is_top1``, ``label_mask``
    and ``loss = -Σ log_probs / (label count or num_items_in_batch)``; its temperature divides
    the logits after the model's head transform."""
    from trl.trainer.utils import FusedCausalLMOutput

    trl = dict(getattr(self, _TRL, None) or {"temperature": 1.0, "outputs": ("log_probs",)})
    changes = [k for k in ("label_smoothing", "lse_square_scale", "ce_weight") if loss_kw.get(k)]
    if changes:
        raise invalid(
            changes[0],
            "not set for TRL's fused LM head (its outputs are per-token log-probabilities)",
            loss_kw[changes[0]],
            _OP,
        )
    for k in ("label_smoothing", "lse_square_scale", "ce_weight"):
        loss_kw.pop(k, None)
    if shift_labels is None:
        hidden, target = hidden[:, :-1], labels[:, 1:]
    else:
        target = shift_labels
    mask = target != -100
    want = set(trl["outputs"])
    hidden, weight, bias = _head_operands(head, hidden)
    with _head_precision():
        r = linear_cross_entropy(
            hidden,
            weight,
            target,
            ignore_index=-100,
            reduction="none",
            bias=bias,
            softcap=softcap,
            temperature=temperature * float(trl["temperature"]),
            return_entropy="entropy" in want,
            return_predicted_tokens=True,
            **loss_kw,
        )
    log_probs = -r.loss
    is_top1 = (r.predicted_tokens == target) & mask if "is_top1" in want else None
    denom = mask.sum().clamp(min=1) if num_items is None else num_items
    loss = -log_probs.sum() / denom
    aux = None
    if router:
        aux = _router_aux(self, outputs, kw.get("attention_mask"))
        loss = loss + getattr(self.config.get_text_config(), "router_aux_loss_coef", 0.0) * aux
    return FusedCausalLMOutput(
        loss=loss,
        log_probs=log_probs,
        entropy=r.entropy if "entropy" in want else None,
        log_sum_sq_probs=None,
        mean_logits=None,
        is_top1=is_top1,
        label_mask=mask,
        aux_loss=aux,
    )


# ----------------------------------------------------------------------------------------------
# TRL
# ----------------------------------------------------------------------------------------------


def _trl_head_settings(fn: Any) -> dict | None:
    """TRL's fused head on an instance: its temperature and outputs read from the closure of
    ``add_fused_lm_head``'s forward; None when ``fn`` is not TRL's head."""
    f = getattr(fn, "__func__", fn)
    code = getattr(f, "__code__", None)  # TRL's head copies the model forward's names (functools.wraps)
    if code is None or "add_fused_lm_head" not in getattr(code, "co_qualname", "") or "trl" not in code.co_filename:
        return None
    cells = dict(zip(f.__code__.co_freevars, f.__closure__ or ()))
    try:
        return {
            "temperature": float(cells["temperature"].cell_contents),
            "outputs": tuple(cells["outputs"].cell_contents),
        }
    except (KeyError, ValueError):
        raise invalid(
            "model",
            "TRL's fused LM head of trl 1.x (its temperature and outputs readable); apply fastgrad before "
            "building the trainer",
            "an unknown TRL head",
            _OP,
        ) from None


def _install_trl_hook() -> None:
    """Wrap ``trl.trainer.utils.add_fused_lm_head`` (and the names TRL's trainer modules imported)
    so that on a fastgrad-patched model it records TRL's temperature and outputs and keeps the
    fastgrad forward, which serves ``fused_lm_head=True``.  Other models, and heads asking for
    outputs fastgrad does not compute (``mean_logits``, ``log_sum_sq_probs``), get TRL's head."""
    if importlib.util.find_spec("trl") is None:
        return
    try:
        u = importlib.import_module("trl.trainer.utils")
    except Exception:  # a broken TRL install: the HF patch works without it
        return
    orig = u.add_fused_lm_head
    if getattr(orig, "_fastgrad_hook", False):
        return

    def add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
        if is_patched(model) and set(outputs) <= set(TRL_OUTPUTS):
            # fastgrad computes the head's GEMMs in fp32 anyway: cast_lm_head_to_fp32 changes nothing
            object.__setattr__(model, _TRL, {"temperature": float(temperature), "outputs": tuple(outputs)})
            return None
        return orig(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)

    add_fused_lm_head.__doc__ = orig.__doc__
    add_fused_lm_head._fastgrad_hook = True  # type: ignore[attr-defined]
    add_fused_lm_head._fastgrad_original = orig  # type: ignore[attr-defined]
    u.add_fused_lm_head = add_fused_lm_head  # type: ignore[attr-defined]
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("trl.") and getattr(mod, "add_fused_lm_head", None) is orig:
            mod.add_fused_lm_head = add_fused_lm_head  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------
# apply / revert
# ----------------------------------------------------------------------------------------------


def _refuse_class(cls: type) -> None:
    raise invalid(
        "model_or_class",
        f"a *ForCausalLM of a supported family whose forward is the family's own ({len(SUPPORTED)} families: "
        "fastgrad.torch.hf.SUPPORTED); for another model, compute its loss from the hidden states with "
        "fastgrad.torch.linear_cross_entropy(hidden, model.lm_head.weight, labels) (docs/torch.md, "
        "'Hugging Face models')",
        cls.__name__,
        _OP,
    )


def apply_to(model_or_class: Any, **loss_kw: Any) -> Any:
    """Route the training loss of a causal-LM model (instance or class) through fastgrad.

    Parameters
    ----------
    model_or_class : a ``transformers`` ``*ForCausalLM`` of a family in :data:`SUPPORTED`
        (instance or class).  An instance is patched alone; a class patches every instance.
    **loss_kw
        Passed to :func:`linear_cross_entropy`: only :data:`LOSS_KEYWORDS` (``options``,
        ``precision``, ``fused``, ``filter_eps``, ``accum_dtype``, ``label_smoothing``,
        ``lse_square_scale``, ``temperature`` — multiplied with the head's own —, ``ce_weight``).
        A second ``apply_to`` replaces them (the latest call wins).

    Returns
    -------
    The argument.

    Raises
    ------
    fastgrad.AclnnError
        161002 (a ``ValueError``): a class outside :data:`SUPPORTED` or one overriding the
        family's ``forward``; a keyword outside :data:`LOSS_KEYWORDS`; a model whose forward
        was replaced by something other than fastgrad's or TRL's fused head.
    """
    loss_kw = _check_loss_kw(loss_kw)
    _install_trl_hook()
    if type(model_or_class).__module__.startswith("peft.") and hasattr(model_or_class, "get_base_model"):
        apply_to(model_or_class.get_base_model(), **loss_kw)  # a PeftModel: its causal LM
        return model_or_class
    if isinstance(model_or_class, type):
        cls = model_or_class
        if _spec_of_class(cls) is None:
            _refuse_class(cls)
        if not _is_ours(vars(cls).get("forward")):
            original = _original_forward(cls)
            setattr(cls, _ORIG, original)
            cls.forward = _make_forward(original)  # type: ignore[attr-defined]
        setattr(cls, _SETTINGS, loss_kw)
        return cls
    model = model_or_class
    if not isinstance(model, torch.nn.Module) or _spec_of_class(type(model)) is None:
        _refuse_class(type(model))
    check_head(model.get_output_embeddings())  # a head fastgrad would compute wrongly: refused now
    inst = vars(model).get("forward")
    vars(model).pop(_BYPASS, None)
    if inst is not None and not _is_ours(inst) and _ours_in(inst):
        # fastgrad's forward under accelerate's wrappers: keep the chain, take the new keywords
        object.__setattr__(model, _SETTINGS, loss_kw)
        return model
    if inst is not None and not _is_ours(inst):
        trl = _trl_head_settings(inst)
        if trl is None:
            raise invalid(
                "model",
                "a model whose forward is its class's, fastgrad's or TRL's fused LM head "
                "(apply fastgrad before wrapping forward)",
                f"forward replaced by {getattr(inst, '__qualname__', type(inst).__name__)}",
                _OP,
            )
        object.__setattr__(model, _TRL, trl)
    if inst is None or not _is_ours(inst):
        original = _original_forward(type(model))
        object.__setattr__(model, "forward", types.MethodType(_make_forward(original), model))
    object.__setattr__(model, _SETTINGS, loss_kw)
    return model


def revert(model_or_class: Any) -> Any:
    """Undo :func:`apply_to` (and forget its keywords); a model that served TRL's fused head
    gets TRL's own head back."""
    if isinstance(model_or_class, type):
        if _ORIG in vars(model_or_class):
            model_or_class.forward = vars(model_or_class)[_ORIG]  # type: ignore[attr-defined]
            delattr(model_or_class, _ORIG)
        if _SETTINGS in vars(model_or_class):
            delattr(model_or_class, _SETTINGS)
        return model_or_class
    d = vars(model_or_class)
    if "forward" in d and _is_ours(d["forward"]):
        del d["forward"]
    elif "forward" in d and _ours_in(d["forward"]):
        # under another wrapper (accelerate's convert_outputs_to_fp32 around fastgrad's forward):
        # the wrapper stays, fastgrad's forward becomes a pass-through to the original
        object.__setattr__(model_or_class, _BYPASS, True)
    d.pop(_SETTINGS, None)
    trl = d.pop(_TRL, None)
    if trl is not None:  # the model served TRL's fused head: give it TRL's own head back
        u = importlib.import_module("trl.trainer.utils")
        add = getattr(u.add_fused_lm_head, "_fastgrad_original", u.add_fused_lm_head)
        add(model_or_class, temperature=trl["temperature"], outputs=trl["outputs"])
    return model_or_class


def _arch(name: str) -> Callable[..., type]:
    def apply(**loss_kw: Any) -> type:
        spec = SUPPORTED[name]
        return apply_to(getattr(importlib.import_module(spec.module), spec.cls), **loss_kw)

    apply.__name__ = f"apply_fastgrad_to_{name}"
    apply.__doc__ = f"Patch ``{SUPPORTED[name].cls}`` (every instance): see :func:`apply_to`."
    return apply


apply_fastgrad_to_llama = _arch("llama")
apply_fastgrad_to_mistral = _arch("mistral")
apply_fastgrad_to_mixtral = _arch("mixtral")
apply_fastgrad_to_gemma = _arch("gemma")
apply_fastgrad_to_gemma2 = _arch("gemma2")
apply_fastgrad_to_gemma3_text = _arch("gemma3_text")
apply_fastgrad_to_qwen2 = _arch("qwen2")
apply_fastgrad_to_qwen3 = _arch("qwen3")
apply_fastgrad_to_qwen3_moe = _arch("qwen3_moe")
apply_fastgrad_to_phi3 = _arch("phi3")
apply_fastgrad_to_granite = _arch("granite")
apply_fastgrad_to_granitemoe = _arch("granitemoe")
apply_fastgrad_to_olmo2 = _arch("olmo2")
apply_fastgrad_to_olmo3 = _arch("olmo3")
apply_fastgrad_to_glm4 = _arch("glm4")
apply_fastgrad_to_smollm3 = _arch("smollm3")
apply_fastgrad_to_exaone4 = _arch("exaone4")
apply_fastgrad_to_cohere = _arch("cohere")
apply_fastgrad_to_cohere2 = _arch("cohere2")
__all__ += [f"apply_fastgrad_to_{n}" for n in SUPPORTED]
