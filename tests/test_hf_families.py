"""fastgrad.torch.apply_to on every family of fastgrad.torch.hf.SUPPORTED (Liger-Kernel's text
families with this head, and Cohere): a tiny config of each, patched == unpatched — the loss
and every parameter's gradient — with the head's own logit transform (Granite's
logits_scaling, Cohere's logit_scale, Gemma-2/3's softcap) and the MoE families' router
load-balancing loss; and a head fastgrad does not know is refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402
from fastgrad.torch.hf import SUPPORTED  # noqa: E402

V = 300
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: per family: what makes its head or its loss differ from Llama's (made to bite)
EXTRA = {
    "gemma2": dict(final_logit_softcapping=3.0),
    "gemma3_text": dict(final_logit_softcapping=3.0),
    "granite": dict(logits_scaling=8.0),
    "granitemoe": dict(logits_scaling=8.0, num_local_experts=4, num_experts_per_tok=2,
                       output_router_logits=True, router_aux_loss_coef=0.5),
    "cohere": dict(logit_scale=0.3),
    "cohere2": dict(logit_scale=0.3),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                    router_aux_loss_coef=0.5),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      output_router_logits=True, router_aux_loss_coef=0.5),
}


def tiny(family, **over):
    import importlib
    spec = SUPPORTED[family]
    cls = getattr(importlib.import_module(spec.module), spec.cls)
    cfg = cls.config_class(**{**SMALL, **EXTRA.get(family, {}), **over})
    torch.manual_seed(0)
    m = cls(cfg).train()
    with torch.no_grad():   # a head whose logits are not tiny, so scaling and softcaps bite
        m.get_output_embeddings().weight.normal_(0, 1.0)
    return m


def _step(m, x, labels):
    m.zero_grad(set_to_none=True)
    out = m(input_ids=x, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_family_patched_equals_unpatched(family):
    m = tiny(family)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (2, 12), generator=g)
    labels = x.clone()
    labels[0, :3] = -100
    ref_loss, ref_grads = _step(m, x, labels)
    ft.apply_to(m)
    try:
        assert ft.is_patched(m)
        got_loss, got_grads = _step(m, x, labels)
    finally:
        ft.revert(m)
    assert not ft.is_patched(m)
    torch.testing.assert_close(got_loss, ref_loss, rtol=2e-6, atol=2e-6)
    assert set(got_grads) == set(ref_grads)
    for n in ref_grads:   # fp32 sums in another order: relative to the gradient's own scale
        err = float((got_grads[n] - ref_grads[n]).abs().max())
        assert err <= 1e-4 * float(ref_grads[n].abs().max()) + 1e-8, (n, err)


def test_scaling_is_applied_not_ignored():
    """The issue's numbers: Granite (logits_scaling 8) gave 15.66 for the model's 10.48, Cohere
    15.64 for 10.41 — the scale had been dropped.  The scaled loss must differ from the
    unscaled one by far more than the tolerance, and fastgrad must give the scaled one."""
    for family, over in (("granite", {}), ("cohere", {})):
        m = tiny(family, **over)
        x = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            ref = m(input_ids=x, labels=x).loss
            h = m.model(input_ids=x).last_hidden_state[:, :-1]
            unscaled = torch.nn.functional.cross_entropy(
                (h @ m.lm_head.weight.T).reshape(-1, V), x[:, 1:].reshape(-1))
        assert abs(float(ref) - float(unscaled)) > 0.5
        ft.apply_to(m)
        got = m(input_ids=x, labels=x).loss
        ft.revert(m)
        torch.testing.assert_close(got.detach(), ref, rtol=2e-6, atol=2e-6)


def test_unknown_heads_are_refused():
    """A class outside the table (its head may transform the logits: Falcon-H1's multiplier,
    MiniCPM3's scaled hidden states, ...), and a subclass overriding forward, are refused."""
    from transformers import LlamaConfig, LlamaForCausalLM, PhiConfig, PhiForCausalLM
    cfg = PhiConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2)
    with pytest.raises(fg.AclnnError, match="supported family") as e:
        ft.apply_to(PhiForCausalLM(cfg))
    assert e.value.status == 161002

    class Scaled(LlamaForCausalLM):
        def forward(self, *a, **k):
            out = super().forward(*a, **k)
            return out

    with pytest.raises(fg.AclnnError, match="supported family"):
        ft.apply_to(Scaled(LlamaConfig(**{k: v for k, v in SMALL.items()})))
    with pytest.raises(fg.AclnnError, match="supported family"):
        ft.apply_to(Scaled)
    with pytest.raises(fg.AclnnError, match="supported family"):
        ft.apply_to(torch.nn.Linear(2, 2))

    class Plain(LlamaForCausalLM):   # a subclass that keeps the family's forward is fine
        pass

    m = Plain(LlamaConfig(**SMALL)).train()
    ft.apply_to(m)
    assert ft.is_patched(m)
