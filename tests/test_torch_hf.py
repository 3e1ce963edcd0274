"""Hugging Face integration (fastgrad.torch.apply_to): a scaled-down Qwen2 trained under
``Trainer`` patched and unpatched from the same seed, and the peak-memory saving."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")   # the Trainer needs it

import fastgrad.torch as ft  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 32768


def _text_ids(n_tokens: int) -> list[int]:
    """Real text: the standard library's docstrings, two ASCII bytes per token (ids < 16384)."""
    import inspect
    import json as j
    import os as o
    docs = "\n".join(inspect.getdoc(m) or "" for m in (o, j, inspect, subprocess, sys))
    b = [c & 127 for c in docs.encode()]
    ids = [b[i] * 128 + b[i + 1] for i in range(0, len(b) - 1, 2)]
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]


def _model(dtype, vocab=V):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(dtype)


def _train(patched: bool, dtype, steps=20, T=32, vocab=V):
    from transformers import Trainer, TrainingArguments
    ids = _text_ids(40 * T)
    data = [{"input_ids": torch.tensor(ids[i * T:(i + 1) * T]),
             "labels": torch.tensor(ids[i * T:(i + 1) * T])} for i in range(40)]
    for k, d in enumerate(data):   # a few ignored labels, as padding would give
        if k % 3 == 0:
            d["labels"][-4:] = -100
    model = _model(dtype, vocab)
    if patched:
        ft.apply_to(model)
    args = TrainingArguments(output_dir="/tmp/fg-hf-trainer", per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=steps, learning_rate=1e-3,
                             logging_steps=1, report_to=[], save_strategy="no", seed=0,
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    tr = Trainer(model=model, args=args, train_dataset=data)
    tr.train()
    return [r["loss"] for r in tr.state.log_history if "loss" in r], model


# bf16: 10 steps over half the vocabulary (the ids stay < 16384) — unpatched PyTorch's bf16 GEMMs
# are emulated on an AVX2-only CPU (16 s for the 20-step run at V = 32768 on a 2-core Zen 3)
@pytest.mark.parametrize("dtype,rtol,steps,vocab", [(torch.float32, 1e-4, 20, V), (torch.bfloat16, 3e-2, 10, 16384)])
def test_trainer_patched_equals_unpatched(dtype, rtol, steps, vocab):
    ref, _ = _train(False, dtype, steps, vocab=vocab)
    got, model = _train(True, dtype, steps, vocab=vocab)
    assert len(got) == len(ref) == steps
    for a, b in zip(got, ref):
        assert abs(a - b) <= rtol * abs(b), (got, ref)
    # eval / generation unchanged: logits come back outside training
    model.eval()
    x = torch.tensor([_text_ids(8)])
    out = model(input_ids=x, labels=x)
    assert out.logits is not None and out.logits.shape == (1, 8, vocab)
    model.train()
    out = model(input_ids=x, labels=x)
    assert out.logits is None and out.loss.requires_grad


def test_apply_to_arch_classes_and_revert():
    from transformers.models.gemma2 import modeling_gemma2 as g2
    cls = g2.Gemma2ForCausalLM
    orig = cls.forward
    ft.apply_fastgrad_to_gemma2()
    try:
        assert cls.forward is not orig
        cfg = g2.Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=16, final_logit_softcapping=5.0)
        torch.manual_seed(0)
        m = cls(cfg).train()
        x = torch.randint(0, 300, (2, 10))
        got = m(input_ids=x, labels=x).loss
        ft.revert(cls)
        assert cls.forward is orig
        ref = m(input_ids=x, labels=x).loss          # the model's own (softcapped) loss
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    finally:
        ft.revert(cls)
    for fn in (ft.apply_fastgrad_to_llama, ft.apply_fastgrad_to_qwen2, ft.apply_fastgrad_to_qwen3,
               ft.apply_fastgrad_to_mistral):
        c = fn()
        ft.revert(c)


# One interpreter for both models (the import of transformers is most of the run): the patched
# model's step is measured first, then the unpatched one's after its own warm-up — the unpatched
# step's logits ([B·T, V] fp32, 64 MiB: larger than glibc's mmap threshold) are fresh mappings,
# so nothing the patched step freed can hide them, and whatever the unpatched warm-up left in the
# heap only lowers the unpatched figure (the assertion's harder side).
_RSS_SCRIPT = r"""
import json, sys, threading, time, psutil, torch
sys.path.insert(0, {tests!r})
from test_torch_hf import _model, _text_ids
import fastgrad.torch as ft
B, T = 4, 128
x = torch.tensor(_text_ids(B * T)).reshape(B, T)
proc = psutil.Process()
res = {{}}
for patched in (True, False):
    torch.manual_seed(0)
    model = _model(torch.float32).train()
    if patched:
        ft.apply_to(model)
    def step():
        model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)
    step(); step()                              # warm-up (kernels compiled, buffers allocated)
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)
    th = threading.Thread(target=sample); th.start()
    step()
    done.set(); th.join()
    res["1" if patched else "0"] = peak[0] - base
    del model
print(json.dumps(res))
"""


def test_patched_step_peak_rss_smaller_by_logits():
    pytest.importorskip("psutil")
    code = _RSS_SCRIPT.format(tests=os.path.join(ROOT, "tests"))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    logits = 4 * 128 * V * 4
    assert res["0"] - res["1"] >= logits, (res, logits)


@pytest.mark.parametrize("target", ["decoder", "whole"])
def test_torch_compile(target):
    """``torch.compile`` of the decoder (documented use), or of the whole patched model (the
    loss is a graph break): same loss and gradients as the uncompiled patched model.  The
    ``aot_eager`` backend traces forward and backward through dynamo/AOTAutograd without
    needing a C++ compiler on the test machine."""
    torch._dynamo.reset()
    x = torch.tensor([_text_ids(24)]).reshape(2, 12)
    ref_model, model = _model(torch.float32).train(), _model(torch.float32).train()
    ft.apply_to(ref_model)
    ft.apply_to(model)
    if target == "decoder":
        model.model = torch.compile(model.model, backend="aot_eager")
        run = model
    else:
        run = torch.compile(model, backend="aot_eager")
    for _ in range(2):   # the second call reuses the compiled graphs (gradient accumulation)
        ref = ref_model(input_ids=x, labels=x).loss
        got = run(input_ids=x, labels=x).loss
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        ref.backward()
        got.backward()
    for (n, p), q in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    torch._dynamo.reset()


def test_autocast_keeps_an_fp32_head_in_fp32():
    """docs/torch.md, "Autocast": the decoder's output is cast to the head's dtype, so an fp32 head
    computes in fp32 — even though ``fastgrad.torch.linear_cross_entropy`` itself casts its
    operands to the autocast dtype as ``F.linear`` does (the patch calls it outside autocast).
    The loss against float64 of the fp32 head on the decoder's own output: fp32-close, where a
    bf16 head is ~1e-3 off."""
    import fastgrad.torch.hf as hf

    model = _model(torch.float32, vocab=512)
    with torch.no_grad():
        model.lm_head.weight *= 30  # logits of a few units: a bf16 head is visibly off
    ids = torch.tensor([_text_ids(33)]) % 512
    ft.apply_to(model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
            hidden = model.model(input_ids=ids).last_hidden_state
    finally:
        hf.revert(model)
    h, W = hidden.detach()[0, :-1], model.lm_head.weight.detach()
    ref = torch.nn.functional.cross_entropy(h.double() @ W.double().T, ids[0, 1:]).item()
    bf16 = torch.nn.functional.cross_entropy(h.bfloat16().double() @ W.bfloat16().double().T, ids[0, 1:]).item()
    assert abs(bf16 - ref) > 1e-4 * abs(ref)  # (the test can tell the two heads apart)
    assert abs(loss.item() - ref) <= 2e-6 * abs(ref), (loss.item(), ref, bf16)
