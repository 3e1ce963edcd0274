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


#: causal LMs transformers ships outside fastgrad's table, each with a tiny config (no hub
#: download): GPT-2/OPT/GPT-NeoX/Bloom/Falcon (other heads or tied layouts), Falcon-H1
#: (lm_head_multiplier), MiniCPM3 (scaled hidden states), StableLM, Starcoder2, Phi
_TINY = dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
UNSUPPORTED = {
    "GPT2LMHeadModel": dict(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64),
    "OPTForCausalLM": dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64),
    "GPTNeoXForCausalLM": dict(_TINY, intermediate_size=64),
    "BloomForCausalLM": dict(vocab_size=V, hidden_size=32, n_layer=1, n_head=2),
    "FalconForCausalLM": dict(_TINY),
    "FalconH1ForCausalLM": dict(_TINY, intermediate_size=64, num_key_value_heads=1, head_dim=16,
                                mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8,
                                mamba_n_groups=1, lm_head_multiplier=0.5),
    "MiniCPM3ForCausalLM": dict(_TINY, intermediate_size=64, num_key_value_heads=2, q_lora_rank=16,
                                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16),
    "StableLmForCausalLM": dict(_TINY, intermediate_size=64, num_key_value_heads=1),
    "Starcoder2ForCausalLM": dict(_TINY, intermediate_size=64, num_key_value_heads=1),
    "PhiForCausalLM": dict(_TINY, intermediate_size=64),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_architectures_refused_before_a_step(name):
    """Every causal LM outside the table is refused at ``apply_to`` (161002 naming the supported
    families), the instance and the class alike, and the model is left as it was: its own forward,
    its own loss."""
    cls = getattr(transformers, name)
    try:
        cfg = cls.config_class(**UNSUPPORTED[name])
        torch.manual_seed(0)
        m = cls(cfg).train()
    except Exception as e:  # pragma: no cover - a config this transformers cannot build
        pytest.fail(f"tiny {name} could not be built: {e!r}")
    fwd = m.forward
    for target in (m, cls):
        with pytest.raises(fg.AclnnError, match="supported family") as e:
            ft.apply_to(target)
        assert e.value.status == 161002 and isinstance(e.value, ValueError)
    assert not ft.is_patched(m)
    assert m.forward == fwd and type(m).forward is cls.forward
    x = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(3))
    out = m(input_ids=x, labels=x)
    assert out.logits is not None and torch.isfinite(out.loss)


def _micro_batches():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randint(0, V, (2, 10), generator=g), torch.randint(0, V, (2, 14), generator=g)]
    labels = [x.clone() for x in xs]
    labels[0][0, :4] = -100
    labels[1][1, 7:] = -100
    return xs, labels


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "qwen3_moe"])
def test_gradient_accumulation_num_items_in_batch(family):
    """The Trainer's gradient accumulation: each micro-batch's loss is ``sum / num_items_in_batch``
    (the label count of the whole accumulated batch), the gradients summed over micro-batches.
    Patched == unpatched: each micro-batch's loss and the accumulated gradients."""
    xs, labels = _micro_batches()
    n_items = sum(int((lab[:, 1:] != -100).sum()) for lab in labels)
    m = tiny(family)

    def accumulate():
        m.zero_grad(set_to_none=True)
        losses = []
        for x, lab in zip(xs, labels):
            out = m(input_ids=x, labels=lab, num_items_in_batch=torch.tensor(n_items))
            out.loss.backward()
            losses.append(out.loss.detach())
        return losses, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    ref_losses, ref_grads = accumulate()
    ft.apply_to(m)
    try:
        got_losses, got_grads = accumulate()
    finally:
        ft.revert(m)
    for a, b in zip(got_losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    # the per-micro-batch losses are sums over n_items, not means of the micro-batch
    assert abs(float(ref_losses[0]) - float(m(input_ids=xs[0], labels=labels[0]).loss)) > 1e-3
    assert set(got_grads) == set(ref_grads)
    for n in ref_grads:
        err = float((got_grads[n] - ref_grads[n]).abs().max())
        assert err <= 1e-4 * float(ref_grads[n].abs().max()) + 1e-8, (n, err)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
def test_packed_sequences_position_ids(family):
    """Padding-free packing (``DataCollatorWithFlattening``): several sequences in one row,
    ``position_ids`` restarting at each, the first label of each sequence -100.  Patched ==
    unpatched, loss and every gradient."""
    g = torch.Generator().manual_seed(7)
    lens = [5, 7, 4]
    x = torch.randint(3, V, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    labels = x.clone()
    start = 0
    for n in lens:
        labels[0, start] = -100
        start += n
    m = tiny(family)

    def step():
        m.zero_grad(set_to_none=True)
        out = m(input_ids=x, position_ids=pos, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = step()
    ft.apply_to(m)
    try:
        got_loss, got_grads = step()
    finally:
        ft.revert(m)
    torch.testing.assert_close(got_loss, ref_loss, rtol=2e-6, atol=2e-6)
    assert set(got_grads) == set(ref_grads)
    for n in ref_grads:
        err = float((got_grads[n] - ref_grads[n]).abs().max())
        assert err <= 1e-4 * float(ref_grads[n].abs().max()) + 1e-8, (n, err)
