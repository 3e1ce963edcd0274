"""PEFT LoRA on the LM head through ``fastgrad.torch.apply_to``: the loss and every trainable
gradient equal the unpatched model's (fp32), other head modules refused before a step runs,
and the patch seen through accelerate's forward wrappers (issue 44).

Tiny random Llama models (no downloads).  The unpatched model is the oracle: PEFT's
``lora.Linear.forward`` computes ``x·Wᵀ + b + s·B(A(dropout(x)))`` and transformers'
``ForCausalLMLoss`` the loss over the ``[B, T, V]`` logits.
"""

from __future__ import annotations

import copy
import functools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402


def _llama(seed=0, tie=False):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(cfg).float()


def _peft(model, targets, dropout=0.0, bias="none", save=()):
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules=list(targets),
        init_lora_weights=False,  # B ≠ 0: the adapter changes the logits from the first step
        lora_bias=bias == "lora",
        modules_to_save=list(save) or None,
    )
    return peft.get_peft_model(model, cfg)


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _step(model, ids, labels, seed=7, **kw):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both runs
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


def _compare(ref_model, got_model, **kw):
    ids, labels = _batch()
    ref, gref = _step(ref_model, ids, labels, **kw)
    got, ggot = _step(got_model, ids, labels, **kw)
    assert got.logits is None  # fastgrad's path ran: no [B, T, V]
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert set(ggot) == set(gref) and gref
    for n in gref:
        torch.testing.assert_close(ggot[n], gref[n], rtol=1e-4, atol=1e-6, msg=n)
    return ref, gref


@pytest.mark.parametrize(
    "targets,dropout,bias",
    [
        (["lm_head"], 0.0, "none"),
        (["lm_head"], 0.1, "none"),
        (["q_proj", "v_proj", "lm_head"], 0.1, "none"),
        (["q_proj", "v_proj", "lm_head"], 0.0, "lora"),
    ],
)
def test_lora_head_equals_unpatched(targets, dropout, bias):
    ref = _peft(_llama(), targets, dropout, bias)
    got = copy.deepcopy(ref)
    ft.apply_to(got)  # a PeftModel: its causal LM is patched
    assert ft.is_patched(got.get_base_model())
    _, g = _compare(ref, got)
    head_b = [n for n in g if "lm_head.lora_B" in n]
    assert head_b and all(g[n].abs().sum() > 0 for n in head_b)  # the adapter is trained


def test_lora_head_patched_before_peft_and_with_num_items():
    base = _llama()
    ref = _peft(copy.deepcopy(base), ["lm_head"], 0.1)
    ft.apply_to(base)  # fastgrad first, PEFT after: the head is checked at the step
    got = _peft(base, ["lm_head"], 0.1)
    got.load_state_dict(ref.state_dict())
    _compare(ref, got, num_items_in_batch=torch.tensor(11))


def test_two_adapters_and_disabled_adapters():
    ref = _peft(_llama(), ["lm_head"], 0.0)
    ref.add_adapter("second", peft.LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    ref.base_model.set_adapter(["default", "second"])
    got = copy.deepcopy(ref)
    ft.apply_to(got)
    _compare(ref, got)
    ids, labels = _batch()
    with ref.disable_adapter(), got.disable_adapter():  # the base head alone (nothing to train)
        lg, lr = got(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
        assert lg.logits is None
        torch.testing.assert_close(lg.loss, lr.loss, rtol=1e-5, atol=1e-6)


def test_modules_to_save_head():
    ref = _peft(_llama(), ["q_proj"], 0.0, save=["lm_head"])
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "modules_to_save" in n:
                p.add_(0.05)  # the trained copy differs from the original head
    got = copy.deepcopy(ref)
    ft.apply_to(got)
    _compare(ref, got)


def test_merged_lora_head():
    ref = _peft(_llama(), ["lm_head"], 0.0)
    ref.merge_adapter()  # W + s·B·A in the base weight (the adapters get no gradient then)
    got = copy.deepcopy(ref)
    ft.apply_to(got)
    ids, labels = _batch()
    ref.train(), got.train()
    lg, lr = got(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert lg.logits is None
    torch.testing.assert_close(lg.loss, lr.loss, rtol=1e-5, atol=1e-6)


class _ScaledHead(torch.nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lin = lin
        self.weight = lin.weight

    def forward(self, x):
        return 2.0 * self.lin(x)


def test_other_heads_refused_at_apply_to():
    m = _llama()
    m.lm_head = _ScaledHead(m.lm_head)
    with pytest.raises(fg.AclnnError, match="lm_head") as info:
        ft.apply_to(m)
    assert info.value.status == 161002 and "_ScaledHead" in str(info.value)
    assert not ft.is_patched(m)
    dora = _llama()
    dora = peft.get_peft_model(dora, peft.LoraConfig(r=2, target_modules=["lm_head"], use_dora=True))
    with pytest.raises(fg.AclnnError, match="variant"):
        ft.apply_to(dora)


def test_other_head_refused_at_the_step_under_a_class_patch():
    cls = transformers.LlamaForCausalLM
    m = _llama()
    m.lm_head = _ScaledHead(m.lm_head)
    ft.apply_to(cls)
    try:
        ids, labels = _batch()
        m.train()
        with pytest.raises(fg.AclnnError, match="lm_head"):
            m(input_ids=ids, labels=labels)
    finally:
        ft.revert(cls)
    assert not ft.is_patched(cls)


def _accelerate_wrap(model):
    """What accelerate's ``Accelerator.prepare_model`` does with mixed precision
    (accelerate/accelerator.py: the autocast context around ``model.forward.__func__``, then
    ``convert_outputs_to_fp32``, each ``functools.wraps``)."""
    from accelerate.utils import convert_outputs_to_fp32

    model._original_forward = model.forward
    fwd = model.forward.__func__

    @functools.wraps(fwd)
    def autocast_forward(*a, **k):
        with torch.autocast("cpu", enabled=False):
            return fwd(*a, **k)

    import types

    model.forward = types.MethodType(autocast_forward, model)
    model.forward = types.MethodType(convert_outputs_to_fp32(model.forward.__func__), model)


def test_is_patched_and_revert_see_through_accelerate_wrappers():
    m = _llama()
    ref = copy.deepcopy(m)
    ft.apply_to(m)
    _accelerate_wrap(m)
    assert ft.is_patched(m)
    ids, labels = _batch()
    out, _ = _step(m, ids, labels)
    assert out.logits is None  # fastgrad's forward runs under the wrappers
    ft.apply_to(m, options="low_memory")  # re-applying keeps the wrappers, takes the keywords
    assert ft.is_patched(m)
    ft.revert(m)
    assert not ft.is_patched(m)
    out, _ = _step(m, ids, labels)
    assert out.logits is not None  # the original forward, through the wrappers
    torch.testing.assert_close(out.loss, _step(ref, ids, labels)[0].loss)
    ft.apply_to(m)
    assert ft.is_patched(m)
    assert _step(m, ids, labels)[0].logits is None
