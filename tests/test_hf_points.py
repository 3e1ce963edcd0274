"""The Hugging Face points of issue 28, one test each (tiny Llama configs, fp32):
return_dict=False (1), double backward refused (3), apply_to keywords checked and re-applied
(5), logits_to_keep with labels as unpatched (6), the cache keyword of current transformers and
no deprecation warning (7), one graph break when compiling the whole patched model (8),
return_* flags validated (9).  Logit scaling (2): tests/test_hf_families.py; TRL (4):
tests/test_trl.py."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402

V = 300


def tiny(seed=0, cls=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return (cls or LlamaForCausalLM)(cfg).train()


def ids(shape=(2, 12), seed=1):
    return torch.randint(3, V, shape, generator=torch.Generator().manual_seed(seed))


# 1 -------------------------------------------------------------------------------------------
def test_return_dict_false_in_training():
    m = tiny()
    x = ids()
    ref = m(input_ids=x, labels=x).loss.detach()
    ref_t = m(input_ids=x, labels=x, return_dict=False)
    ft.apply_to(m)
    out = m(input_ids=x, labels=x, return_dict=False)
    assert isinstance(out, tuple) and isinstance(ref_t, tuple)
    torch.testing.assert_close(out[0].detach(), ref, rtol=2e-6, atol=2e-6)
    out[0].backward()
    m.config.return_dict = False        # the config's setting (unpatched, transformers 5.24 fails here:
                                        # its decoder returns a tuple too)
    out = m(input_ids=x, labels=x)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0].detach(), ref, rtol=2e-6, atol=2e-6)


# 3 -------------------------------------------------------------------------------------------
def test_double_backward_through_the_model_is_refused():
    """A gradient penalty / Hessian through the patched model raises (before: silently wrong —
    a Hessian of zeros w.r.t. the hidden states, a penalty off by 3.9 against a max of 4.6)."""
    m = tiny()
    ft.apply_to(m)
    x = ids()
    loss = m(input_ids=x, labels=x).loss
    params = [p for p in m.parameters() if p.requires_grad]
    with pytest.raises(RuntimeError, match="create_graph") as e:
        torch.autograd.grad(loss, params, create_graph=True)
    assert isinstance(e.value, fg.AclnnError) and e.value.status == 361001


# 5 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{"softcap": 5.0}, {"ignore_index": 0}, {"reduction": "sum"},
                                {"return_token_accuracy": True}, {"shift": 2}, {"bias": None},
                                {"lse_sqare_scale": 1e-4}])
def test_apply_to_refuses_the_models_keywords(kw):
    m = tiny()
    with pytest.raises(fg.AclnnError, match=next(iter(kw))) as e:
        ft.apply_to(m, **kw)
    assert e.value.status == 161002 and not ft.is_patched(m)


def test_second_apply_to_replaces_the_keywords():
    m = tiny()
    x = ids()

    def manual(**kw):
        with torch.no_grad():
            h = m.model(input_ids=x).last_hidden_state
            return ft.linear_cross_entropy(h, m.lm_head.weight, x, shift=1, **kw)

    ft.apply_to(m)
    torch.testing.assert_close(m(input_ids=x, labels=x).loss.detach(), manual(), rtol=1e-6, atol=1e-6)
    ft.apply_to(m, lse_square_scale=0.1, label_smoothing=0.2)
    got = m(input_ids=x, labels=x).loss.detach()
    want = manual(lse_square_scale=0.1, label_smoothing=0.2)
    assert abs(float(want) - float(manual())) > 1e-2       # the keywords matter
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the loss stays a tensor (no NamedTuple) and a class patch under an instance patch
    assert isinstance(m(input_ids=x, labels=x).loss, torch.Tensor)
    ft.revert(m)
    assert not ft.is_patched(m)


def test_class_patch_then_instance_patch():
    from transformers import LlamaForCausalLM
    m = tiny()
    x = ids()
    ft.apply_to(LlamaForCausalLM, lse_square_scale=0.5)
    try:
        assert ft.is_patched(m)
        a = m(input_ids=x, labels=x).loss.detach()
        ft.apply_to(m)                                   # this instance: no z-loss
        b = m(input_ids=x, labels=x).loss.detach()
        ft.revert(m)
        c = m(input_ids=x, labels=x).loss.detach()       # back to the class patch
    finally:
        ft.revert(LlamaForCausalLM)
    assert float(a) > float(b) + 1e-3 and torch.equal(a, c)


# 6 -------------------------------------------------------------------------------------------
def test_logits_to_keep_with_labels_as_unpatched():
    m = tiny()
    x = ids((2, 12))
    idx = torch.tensor([[2, 5, 7, 11], [0, 1, 9, 10]])
    lab_idx = torch.take_along_dim(x, idx, 1)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 3:9] = True
    mask[1, 1:4] = True
    cases = [(idx, lab_idx), (5, x[:, -5:]), (mask, x[mask])]
    refs = [m(input_ids=x, labels=lab, logits_to_keep=k).loss.detach() for k, lab in cases]
    with pytest.raises(Exception):
        m(input_ids=x, labels=x, logits_to_keep=5)          # unpatched: full labels with an int raise
    ft.apply_to(m)
    for (k, lab), ref in zip(cases, refs):
        got = m(input_ids=x, labels=lab, logits_to_keep=k).loss
        torch.testing.assert_close(got.detach(), ref, rtol=2e-6, atol=2e-6)
        got.backward()
    with pytest.raises(fg.AclnnError, match="logits_to_keep") as e:
        m(input_ids=x, labels=x, logits_to_keep=5)          # patched: raises too, saying why
    assert e.value.status == 161002


# 7 -------------------------------------------------------------------------------------------
def test_cache_keyword_and_no_deprecation_warning():
    """The patched forward passes the caller's keywords as given: no past_key_values= added
    (transformers 5.24 warned on every call; the shim goes in 5.40), the new cache keyword
    reaches the decoder, and generate() warns nothing about both names."""
    import inspect

    from transformers import DynamicCache
    m = tiny()
    ft.apply_to(m)
    x = ids()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(input_ids=x, labels=x).loss.backward()            # training
        m.eval()
        m(input_ids=x, labels=x)                            # eval
        m.generate(x[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=3,
                   do_sample=False, pad_token_id=0)
        m.train()
        if "cache" in inspect.signature(type(m).forward).parameters:
            out = m(input_ids=x, labels=x, cache=DynamicCache(config=m.config), use_cache=True)
            assert out.cache is not None and out.cache.get_seq_length() == 12
    # the signature generate() validates against is the model's own
    assert list(inspect.signature(m.forward).parameters) == list(
        inspect.signature(type(m).forward).parameters)[1:]


# 8 -------------------------------------------------------------------------------------------
def test_compile_whole_model_one_break():
    """torch.compile of the whole patched model: the decoder is one graph and the loss one break
    (torch.compiler.disable) — before, dynamo traced into fastgrad's Python: 24 graphs, 23 breaks."""
    m = tiny()
    ft.apply_to(m)
    x = ids()
    torch._dynamo.reset()
    ex = torch._dynamo.explain(m)(input_ids=x, labels=x)
    torch._dynamo.reset()
    assert ex.graph_count <= 2 and len(ex.break_reasons) <= 1, (ex.graph_count, ex.break_reasons)


# 9 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["return_z_loss", "return_token_accuracy", "return_predicted_tokens",
                                  "return_entropy"])
def test_return_flags_must_be_bool(flag):
    h = torch.randn(4, 8)
    w = torch.randn(10, 8)
    t = torch.randint(0, 10, (4,))
    with pytest.raises(fg.AclnnError, match=flag) as e:
        ft.linear_cross_entropy(h, w, t, **{flag: "yes"})
    assert e.value.status == 161002
