"""TRL (issue 28, point 4): TRL's trainers replace model.forward with their fused LM head
(trl.trainer.utils.add_fused_lm_head) and train on model(..., fused_lm_head=True).  With
fastgrad.torch.apply_to before the trainer is built (instance or class), or on trainer.model
after, that call runs through fastgrad — checked by counting fastgrad's calls — and gives
TRL's own head's losses, entropies and accuracies.  trl is in the test extra; without it
these tests skip."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install fastgrad[test] installs it)")
pytest.importorskip("datasets")

import fastgrad.torch as ft  # noqa: E402
import fastgrad.torch.hf as fhf  # noqa: E402

V = 300


def tiny(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      pad_token_id=296, eos_token_id=297, bos_token_id=298)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 0.5)
    return m


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i}": i for i in range(296)}
    vocab.update({"<pad>": 296, "<eos>": 297, "<bos>": 298, "<unk>": 299})
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


def dataset():
    from datasets import Dataset
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(16):
        n = int(torch.randint(5, 20, (1,), generator=g))
        rows.append({"text": " ".join(f"w{int(i)}" for i in torch.randint(0, 296, (n,), generator=g))})
    return Dataset.from_list(rows)


@pytest.fixture
def calls(monkeypatch):
    n = [0]
    real = fhf.linear_cross_entropy

    def counting(*a, **k):
        n[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(fhf, "linear_cross_entropy", counting)
    return n


def _sft(mode, calls, tmp_path, bf16=False):
    from transformers import LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer
    m = tiny()
    if mode == "instance-before":
        ft.apply_to(m)
    if mode == "class-before":
        ft.apply_to(LlamaForCausalLM)
    try:
        args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                         seed=0, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, max_length=32,
                         bf16=bf16)
        tr = SFTTrainer(model=m, args=args, train_dataset=dataset(), processing_class=tokenizer())
        if mode == "after":
            ft.apply_to(tr.model)
        calls[0] = 0
        tr.train()
    finally:
        ft.revert(LlamaForCausalLM)
    logs = [r for r in tr.state.log_history if "loss" in r]
    return [(r["loss"], r["entropy"], r["mean_token_accuracy"]) for r in logs], calls[0]


@pytest.mark.parametrize("mode,bf16,rtol", [("instance-before", False, 1e-5), ("class-before", False, 1e-5),
                                            ("after", False, 1e-5), ("instance-before", True, 3e-3)])
def test_sft_trainer_trains_through_fastgrad(mode, bf16, rtol, calls, tmp_path):
    """fp32: the same losses, entropies and accuracies as TRL's head.  bf16=True (CPU autocast):
    TRL's head multiplies in bf16 under autocast, fastgrad in fp32 — close, not equal."""
    ref, n_ref = _sft("none", calls, tmp_path, bf16)
    got, n = _sft(mode, calls, tmp_path, bf16)
    assert n_ref == 0 and n == 4        # 2 steps x 2 micro-batches, every one through fastgrad
    assert len(got) == len(ref) == 2
    for a, b in zip(got, ref):
        for x, y in zip(a, b):
            assert abs(x - y) <= rtol * max(1.0, abs(y)), (got, ref)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shifted", [False, True])
def test_fused_head_outputs_equal_trls(temperature, shifted, calls):
    """model(..., fused_lm_head=True) per-token outputs: fastgrad's == TRL's own head's, with
    TRL's temperature (GRPO/RLOO pass theirs), pre-shifted labels and num_items_in_batch."""
    from trl.trainer.utils import add_fused_lm_head
    x = torch.randint(0, 296, (2, 10), generator=torch.Generator().manual_seed(3))
    labels = x.clone()
    labels[0, :4] = -100
    kw = {"shift_labels": labels[:, 1:].contiguous()} if shifted else {}
    outs = []
    for patched in (False, True):
        m = tiny().train()
        if patched:
            ft.apply_to(m)
        add_fused_lm_head(m, temperature=temperature, outputs=("log_probs", "entropy", "is_top1"))
        assert ft.is_patched(m) == patched
        ids = x[:, :-1] if shifted else x
        o = m(input_ids=ids, labels=None if shifted else labels, fused_lm_head=True, num_items_in_batch=7, **kw)
        o.loss.backward()
        outs.append((o, m.lm_head.weight.grad.clone()))
    (a, ga), (b, gb) = outs
    assert calls[0] == 1
    for f in ("log_probs", "entropy"):
        torch.testing.assert_close(getattr(b, f), getattr(a, f), rtol=1e-5, atol=1e-5, msg=f)
    assert torch.equal(a.is_top1, b.is_top1) and torch.equal(a.label_mask, b.label_mask)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)


def test_class_patch_flag_copied_by_trls_wraps(calls):
    """TRL's head copies the class forward's attributes (functools.wraps): a flag-based check
    took it for fastgrad's.  is_patched checks identity; an instance patch after TRL's own head
    (installed without fastgrad's hook) replaces it."""
    from transformers import LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head
    trl_own = getattr(add_fused_lm_head, "_fastgrad_original", add_fused_lm_head)
    m = tiny().train()
    ft.apply_to(LlamaForCausalLM)
    try:
        trl_own(m, outputs=("log_probs",))          # TRL's head over the class patch
        assert not ft.is_patched(m)
        ft.apply_to(m)
        assert ft.is_patched(m)
        x = torch.randint(0, 296, (2, 8))
        m(input_ids=x, labels=x, fused_lm_head=True).loss.backward()
        assert calls[0] == 1
    finally:
        ft.revert(LlamaForCausalLM)


def test_revert_gives_trls_head_back(calls):
    from trl.trainer.utils import add_fused_lm_head
    m = tiny().train()
    ft.apply_to(m)
    add_fused_lm_head(m, temperature=0.5, outputs=("log_probs",))
    x = torch.randint(0, 296, (2, 8))
    a = m(input_ids=x, labels=x, fused_lm_head=True)
    ft.revert(m)
    assert not ft.is_patched(m)
    b = m(input_ids=x, labels=x, fused_lm_head=True)       # TRL's own head, same temperature
    assert calls[0] == 1
    torch.testing.assert_close(b.log_probs, a.log_probs.detach(), rtol=1e-5, atol=1e-5)


def test_unsupported_trl_outputs_keep_trls_head():
    """Outputs fastgrad does not compute (KTO's mean_logits) keep TRL's own head."""
    from trl.trainer.utils import add_fused_lm_head
    m = tiny().train()
    ft.apply_to(m)
    add_fused_lm_head(m, outputs=("log_probs", "mean_logits"))
    assert not ft.is_patched(m)
