"""The Hugging Face patch (fastgrad.torch.apply_to) under inputs a user training on a workstation
gives it, against the unpatched model as the oracle (tiny Llama configs, float64): each test is a
defect fuzzing found."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastgrad.torch as ft  # noqa: E402

V = 97


def tiny(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.float64).train()


def ids(shape=(2, 9), seed=1):
    return torch.randint(3, V, shape, generator=torch.Generator().manual_seed(seed))


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_positional_labels_take_the_fastgrad_path():
    """``model(input_ids, attention_mask, position_ids, cache, inputs_embeds, labels)``: the labels
    given positionally.  Before, only ``kwargs["labels"]`` was looked at, so the patched forward
    called the original: the [B, T, V] logits built, fastgrad silently not used."""
    x = ids()
    lab = x.clone()
    lab[0, :3] = -100
    mask = torch.ones_like(x)
    m = tiny()
    ref = m(x, mask, None, None, None, lab)
    ref.loss.backward()
    ref_g = _grads(m)
    m.zero_grad(set_to_none=True)
    ft.apply_to(m)
    out = m(x, mask, None, None, None, lab)
    assert out.logits is None                      # the fastgrad loss, no logits
    torch.testing.assert_close(out.loss.detach().double(), ref.loss.detach().double(), rtol=1e-6, atol=1e-7)
    out.loss.backward()
    got_g = _grads(m)
    assert set(got_g) == set(ref_g)
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], rtol=1e-5, atol=1e-8)
    # the same positionally and by keyword; the original's own TypeErrors for bad calls
    kw = m(input_ids=x, attention_mask=mask, labels=lab).loss.detach()
    assert torch.equal(m(x, mask, None, None, None, lab).loss.detach(), kw)
    with pytest.raises(TypeError, match="multiple values"):
        m(x, mask, None, None, None, lab, labels=lab)
    with pytest.raises(TypeError, match="positional arguments"):
        m(x, mask, None, None, None, lab, None, 0, 5)
    # no labels, positionally: the original (logits returned)
    assert m(x, mask).logits.shape == (2, 9, V)
