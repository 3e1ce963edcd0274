"""`fastgrad --model DIR` on checkpoints laid out as real users' are (wrapper prefixes, missing or
malformed config fields, head transforms, adapters), `--out` beside the inputs: the job takes the
head the model itself uses, says what it does not compute, and answers a mistake with one line
(exit 2).  The oracle of the fast tests is the float64 cross-entropy of the file's own head
tensor (NumPy); the slow sweep builds the checkpoints with transformers' ``save_pretrained`` and
takes the head from ``model.get_output_embeddings()``."""

import builtins
import hashlib
import json

import numpy as np
import pytest
from cli_helpers import fastgrad_inprocess, fastgrad_subprocess, one_line

from fastgrad.cli import checkpoint as ck

V, H, BT = 40, 8, 6
fastgrad = fastgrad_inprocess


def _dir(d, tensors, config):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    ck.save_safetensors(str(d / "model.safetensors"), tensors)
    return d


def _oracle_loss(x, w, t):
    """Per-row cross-entropy of the logits x·Wᵀ in float64."""
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    m = z.max(1, keepdims=True)
    return (m[:, 0] + np.log(np.exp(z - m).sum(1))) - z[np.arange(len(t)), t]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_model_fuzz")
    rng = np.random.default_rng(7)
    emb = rng.standard_normal((V, H)).astype(np.float32)
    head = (3 * rng.standard_normal((V, H))).astype(np.float32)  # far from emb: the losses differ
    x = rng.standard_normal((BT, H)).astype(np.float32)
    t = rng.integers(0, V, BT)
    np.save(d / "x.npy", x)
    np.save(d / "t.npy", t)
    return d, emb, head, x, t


def _run_loss(d, model, *extra, out_root=None):
    out = (out_root or d) / ("out_" + model.name)
    p = fastgrad("--model", model, "--input", d / "x.npy", "--target", d / "t.npy", "--out", out,
                 "--no-progress", "--json", *extra)
    assert p.returncode == 0, p.stderr
    return np.asarray(ck.SafetensorsFile(str(out / "results.safetensors")).load("loss")), json.loads(p.stdout)


def test_prefixed_untied_head_is_used_not_the_embedding(data):
    """A LLaVA-style checkpoint (language_model.lm_head.weight beside
    language_model.model.embed_tokens.weight, no tie_word_embeddings at the top): the model's head
    is its lm_head; it used to run on the embedding as a 'tied' head."""
    d, emb, head, x, t = data
    m = _dir(d / "llava", {"language_model.model.embed_tokens.weight": emb, "language_model.lm_head.weight": head,
                           "vision_tower.proj.weight": np.ones((4, 4), np.float32)},
             {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "text_config": {"model_type": "llama", "hidden_size": H, "vocab_size": V}})
    loss, rep = _run_loss(d, m)
    assert "language_model.lm_head.weight" in rep["sources"]["weight"]
    np.testing.assert_allclose(loss, _oracle_loss(x, head, t), rtol=1e-5, atol=1e-5)
    assert not np.allclose(loss, _oracle_loss(x, emb, t), rtol=1e-2)


def test_several_prefixed_heads_are_named_not_guessed(data):
    d, emb, head, x, t = data
    m = _dir(d / "two", {"a.lm_head.weight": head, "b.lm_head.weight": emb, "model.embed_tokens.weight": emb},
             {"hidden_size": H, "vocab_size": V})
    one_line(fastgrad("--model", m, "--bt", 4), "--model", "a.lm_head.weight", "b.lm_head.weight", "--tensor")
    loss, rep = _run_loss(d, m, "--tensor", "a.lm_head.weight")
    np.testing.assert_allclose(loss, _oracle_loss(x, head, t), rtol=1e-5, atol=1e-5)
    p = fastgrad("--list-tensors", m)
    assert p.returncode == 0 and "several (a.lm_head.weight, b.lm_head.weight)" in p.stderr, p.stderr


def test_untied_family_without_tie_key_has_no_head(data):
    """config.json of model_type llama without tie_word_embeddings, no lm_head.weight: transformers
    unties Llama by default (its head would be initialized at random), so the embedding is not the
    head; it used to run on it.  Gemma, tied by default, still takes its embedding."""
    d, emb, head, x, t = data
    m = _dir(d / "llama_nokey", {"model.embed_tokens.weight": emb},
             {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "vocab_size": V})
    one_line(fastgrad("--model", m, "--bt", 4), "--model", "tie_word_embeddings", "'llama'", "--tensor")
    g = _dir(d / "gemma_nokey", {"model.embed_tokens.weight": emb},
             {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_size": H, "vocab_size": V})
    loss, rep = _run_loss(d, g)
    np.testing.assert_allclose(loss, _oracle_loss(x, emb, t), rtol=1e-5, atol=1e-5)
    assert "(tied input embedding)" in rep["sources"]["weight"]


@pytest.mark.parametrize("config, tensors, said", [
    ({"model_type": "gemma2", "final_logit_softcapping": 30.0}, {}, "final_logit_softcapping=30.0"),
    ({"model_type": "gemma3", "text_config": {"final_logit_softcapping": 25.0}}, {}, "final_logit_softcapping=25.0"),
    ({"model_type": "cohere", "logit_scale": 0.0625}, {}, "logit_scale=0.0625"),
    ({"model_type": "granite", "logits_scaling": 8.0}, {}, "logits_scaling=8.0"),
    ({"model_type": "phi"}, {"lm_head.bias": np.ones(V, np.float32)}, "lm_head.bias"),
    ({"model_type": "gemma2", "final_logit_softcapping": None}, {}, None),
    ({"model_type": "cohere", "logit_scale": 1.0}, {}, None),
])
def test_head_transforms_the_op_does_not_apply_are_said(data, config, tensors, said):
    """A softcap, logit scale or head bias of the model is not part of the op: the report says so
    (it used to say nothing), the result is still the plain logits' cross-entropy."""
    d, emb, head, x, t = data
    m = _dir(d / f"tr_{config['model_type']}_{said is None}_{len(config)}",
             {"model.embed_tokens.weight": emb, "lm_head.weight": head, **tensors},
             {"hidden_size": H, "vocab_size": V, "tie_word_embeddings": False, **config})
    loss, rep = _run_loss(d, m)
    np.testing.assert_allclose(loss, _oracle_loss(x, head, t), rtol=1e-5, atol=1e-5)
    notes = [n for n in rep["notes"] if "is not applied" in n]
    if said is None:
        assert notes == []
    else:
        assert len(notes) == 1 and said in notes[0] and "x·Wᵀ" in notes[0], rep["notes"]


def _ascii_default_open(file, mode="r", *a, **kw):
    """``open`` as under a C/POSIX locale without UTF-8 mode: text files default to ASCII."""
    if "b" not in mode and not a and kw.get("encoding") is None:
        kw["encoding"] = "ascii"
    return builtins.open(file, mode, *a, **kw)


def test_utf8_config_is_read_whatever_the_locale(data, monkeypatch):
    """A config.json with non-ASCII text (UTF-8, as JSON and transformers read it) was decoded
    with the locale's encoding: under an ASCII locale a valid model was refused."""
    d, emb, head, x, t = data
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": H, "vocab_size": V, "tie_word_embeddings": False,
           "_name_or_path": "通义千问/café"}
    m = _dir(d / "utf8", {"lm_head.weight": head}, cfg)
    (m / "config.json").write_bytes(json.dumps(cfg, ensure_ascii=False).encode("utf-8"))
    (m / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"note": "é"}, "weight_map": {"lm_head.weight": "model.safetensors"}},
                   ensure_ascii=False), encoding="utf-8")
    monkeypatch.setattr(ck, "open", _ascii_default_open, raising=False)
    loss, rep = _run_loss(d, m)
    np.testing.assert_allclose(loss, _oracle_loss(x, head, t), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_utf8_config_under_the_c_locale_subprocess(data, tmp_path, monkeypatch):
    d, emb, head, x, t = data
    cfg = {"hidden_size": H, "vocab_size": V, "tie_word_embeddings": False, "_name_or_path": "模型"}
    m = _dir(tmp_path / "m", {"lm_head.weight": head}, cfg)
    (m / "config.json").write_bytes(json.dumps(cfg, ensure_ascii=False).encode("utf-8"))
    monkeypatch.setenv("LC_ALL", "C")
    monkeypatch.setenv("PYTHONCOERCECLOCALE", "0")
    monkeypatch.setenv("PYTHONUTF8", "0")
    p = fastgrad_subprocess("--model", m, "--bt", 4, "--samples", 0, "--no-progress")
    assert p.returncode == 0, p.stderr


def test_malformed_config_fields_are_not_internal_errors(data, tmp_path):
    d, emb, head, x, t = data
    base = {"hidden_size": H, "vocab_size": V, "tie_word_embeddings": False}
    m = _dir(tmp_path / "arch", {"lm_head.weight": head}, {**base, "architectures": [1, "X"]})
    p = fastgrad("--model", m, "--bt", 4, "--samples", 0, "--json", "--no-progress")
    assert p.returncode == 0, p.stderr                      # was exit 3: TypeError joining the names
    assert "(1,X)" in json.loads(p.stdout)["sources"]["weight"]
    m = _dir(tmp_path / "arch_str", {"lm_head.weight": head}, {**base, "architectures": "LlamaForCausalLM"})
    p = fastgrad("--model", m, "--bt", 4, "--samples", 0, "--json", "--no-progress")
    assert "(LlamaForCausalLM)" in json.loads(p.stdout)["sources"]["weight"]     # was "(L,l,a,m,a,...)"
    m = _dir(tmp_path / "bool_h", {"lm_head.weight": head}, {**base, "hidden_size": True})
    assert fastgrad("--model", m, "--bt", 4, "--samples", 0, "--no-progress").returncode == 0
    m = _dir(tmp_path / "idx", {"lm_head.weight": head}, base)
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": 1}}))
    one_line(fastgrad("--model", m), "--model", "model.safetensors.index.json", "weight_map")   # was exit 3
    m = _dir(tmp_path / "cfgdir", {"lm_head.weight": head}, base)
    (m / "config.json").unlink()
    (m / "config.json").mkdir()
    one_line(fastgrad("--model", m), "--model", "config.json")      # was "cannot use ...", no flag


def test_peft_adapter_folder_says_what_it_is(tmp_path):
    a = tmp_path / "adapter"
    a.mkdir()
    (a / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen2.5-0.5B",
                                                       "peft_type": "LORA"}))
    ck.save_safetensors(str(a / "adapter_model.safetensors"), {"x.lora_A.weight": np.ones((2, 8), np.float32)})
    one_line(fastgrad("--model", a), "--model", "config.json", "PEFT adapter", "Qwen/Qwen2.5-0.5B", "merge")


def _md5(p):
    return hashlib.md5(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("fmt, flag, spec", [
    ("safetensors", "--input", "results.safetensors:grad_input"),
    ("safetensors", "--target", "results.safetensors:target"),
    ("npy", "--target", "target.npy"),
    ("npy", "--weight", "grad_weight.npy"),
])
def test_out_never_replaces_an_input_file(tmp_path, fmt, flag, spec):
    """Chaining runs (`--input OUT/results.safetensors:grad_input --out OUT`) replaced the user's
    input file with the new results; now refused before any work, the file unchanged."""
    out = tmp_path / "out"
    p = fastgrad("--bt", 6, "--hidden", 8, "--vocab", 40, "--dtype", "fp32", "--samples", 0, "--no-progress",
                 "--out", out, "--out-format", fmt)
    assert p.returncode == 0, p.stderr
    f = out / spec.split(":")[0]
    before = _md5(f), sorted(x.name for x in out.iterdir())
    shape = ("--vocab", 40, "--hidden", 8) if flag != "--weight" else ()
    common = (flag, f"{out}/{spec}", *shape, "--bt", 6, "--samples", 0, "--no-progress", "--out-format", fmt)
    one_line(fastgrad(*common, "--out", out), "--out", str(f))
    assert (_md5(f), sorted(x.name for x in out.iterdir())) == before
    # another --out holding a symlink to the input: the same file
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / f.name).symlink_to(f)
    one_line(fastgrad(*common, "--out", tmp_path / "other"), "--out")
    assert _md5(f) == before[0]


def test_failed_run_removes_the_parents_it_made_for_out(data, tmp_path):
    """--out a/b/out (none existing) and a run refused after --out was made: a/ and a/b/ were
    left behind (only out/ was removed)."""
    d, emb, head, x, t = data
    bad = tmp_path / "nan.npy"
    np.save(bad, np.full((BT, H), np.nan, np.float32))
    (tmp_path / "keep").mkdir()
    one_line(fastgrad("--input", bad, "--vocab", V, "--hidden", H, "--out", tmp_path / "a" / "b" / "out", "--no-progress"),
             "--input", "finite")
    one_line(fastgrad("--input", bad, "--vocab", V, "--hidden", H, "--out", tmp_path / "keep" / "c" / "out", "--no-progress"),
             "--input")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "nan.npy"]
    assert list((tmp_path / "keep").iterdir()) == []


# ------------------------------------------------------------------ transformers' own checkpoints

#: family -> (config class, model class, config keywords); tiny shapes
_FAMILIES = {
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen2_untied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 4}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 4, "final_logit_softcapping": 30.0}),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": H, "n_layer": 1, "n_head": 2, "n_positions": 16}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 16, "word_embed_proj_dim": H}),
    "phi_bias": ("PhiConfig", "PhiForCausalLM", {}),
}
_NOTE = {"gemma2": "final_logit_softcapping=30.0", "phi_bias": "lm_head.bias"}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(_FAMILIES))
@pytest.mark.parametrize("dtype, sharded", [("float32", False), ("bfloat16", True), ("float16", False)])
def test_save_pretrained_checkpoints_use_the_models_own_head(data, tmp_path, family, dtype, sharded):
    """The loss of `fastgrad --model` on a transformers ``save_pretrained`` checkpoint equals the
    float64 cross-entropy with ``model.get_output_embeddings().weight`` (rounded to the
    checkpoint's dtype, which the job runs in); a head transform it does not apply is noted."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import ml_dtypes

    d, emb, head, x, t = data
    cfg_cls, model_cls, kw = _FAMILIES[family]
    common = dict(hidden_size=H, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=V, max_position_embeddings=16)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**common, **kw}))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(tmp_path / "m", **({"max_shard_size": "1KB"} if sharded else {}))
    if sharded:
        assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    w = model.get_output_embeddings().weight.detach().to(torch.float64).numpy()
    loss, rep = _run_loss(d, tmp_path / "m", out_root=tmp_path)
    np_dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    assert rep["dtype"] == dtype
    tol = 1e-5 if dtype == "float32" else 1e-4  # fp32 sums of exact products of the rounded operands
    np.testing.assert_allclose(loss, _oracle_loss(x.astype(np_dt), w, t), rtol=tol, atol=tol)
    noted = [n for n in rep["notes"] if "is not applied" in n]
    assert len(noted) == (family in _NOTE) and all(_NOTE[family] in n for n in noted), rep["notes"]
