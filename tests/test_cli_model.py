"""`fastgrad --model DIR` on tiny Hugging Face-style directories built here (nothing is
downloaded), `--out`, `--check`, `--list-tensors`, and the golden check's sampling."""

import json

import ml_dtypes
import numpy as np
import pytest
from cli_helpers import fastgrad_inprocess

from fastgrad.cli import checkpoint as ck

V, H, BT = 300, 24, 20


fastgrad = fastgrad_inprocess


def _model_dir(d, tensors, config, index=False):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if not index:
        ck.save_safetensors(str(d / "model.safetensors"), tensors)
        return d
    names = list(tensors)
    half = len(names) // 2
    wmap = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-{i + 1:05d}-of-00002.safetensors"
        ck.save_safetensors(str(d / fn), {n: tensors[n] for n in part})
        wmap.update({n: fn for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_model")
    rng = np.random.default_rng(0)
    emb = (rng.standard_normal((V, H)) * 0.2).astype(ml_dtypes.bfloat16)
    head = (rng.standard_normal((V, H)) * 0.2).astype(ml_dtypes.bfloat16)
    norm = np.ones(H, ml_dtypes.bfloat16)
    x = rng.standard_normal((2, BT // 2, H)).astype(np.float32)          # [B, T, H]
    t = rng.integers(0, V, (2, BT // 2))
    np.save(d / "x.npy", x)
    np.save(d / "t.npy", t)
    ck.save_safetensors(str(d / "batch.safetensors"), {"hidden_states": x, "labels": t})
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "vocab_size": V}
    dirs = {
        "tied": _model_dir(d / "tied", {"model.embed_tokens.weight": emb, "model.norm.weight": norm},
                           {**llama, "tie_word_embeddings": True}),
        "untied_sharded": _model_dir(d / "untied", {"model.embed_tokens.weight": emb, "model.norm.weight": norm,
                                                    "lm_head.weight": head},
                                     {**llama, "tie_word_embeddings": False}, index=True),
        "bert": _model_dir(d / "bert", {"embeddings.word_embeddings.weight": emb,
                                        "embeddings.LayerNorm.weight": norm},
                           {"architectures": ["BertModel"], "hidden_size": H, "vocab_size": V}),
        "nohead": _model_dir(d / "nohead", {"model.embed_tokens.weight": emb},
                             {**llama, "tie_word_embeddings": False}),
    }
    return d, dirs, emb, head


@pytest.mark.parametrize("kind, tensor", [("tied", "model.embed_tokens.weight"), ("untied_sharded", "lm_head.weight"),
                                          ("bert", "embeddings.word_embeddings.weight")])
def test_model_dir_finds_the_head(data, kind, tensor):
    d, dirs, emb, head = data
    p = fastgrad("--model", dirs[kind], "--input", d / "x.npy", "--target", d / "t.npy", "--json", "--check")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["shape"] == {"BT": BT, "H": H, "V": V} and r["dtype"] == "bfloat16"
    assert tensor in r["sources"]["weight"]
    assert r["check"]["passed"] is True
    assert "input cast from float32 to bfloat16" in r["notes"]


def test_model_dir_reference_result(data, tmp_path):
    """The tied head's gradient equals the public ops run directly (same inputs, same dtype)."""
    import fastgrad as fg

    d, dirs, emb, head = data
    out = tmp_path / "out"
    p = fastgrad("--model", dirs["tied"], "--input", d / "batch.safetensors", "--target", d / "batch.safetensors",
                 "--out", out, "--no-progress")
    assert p.returncode == 0, p.stderr
    got = ck.SafetensorsFile(str(out / "results.safetensors"))
    x = np.load(d / "x.npy").reshape(BT, H).astype(ml_dtypes.bfloat16)
    t = np.load(d / "t.npy").reshape(-1)
    f = fg.fused_linear_online_max_sum(x, emb, t, 0, V)
    loss, _ = fg.fused_cross_entropy_loss_with_max_sum(f.logits_max_local, f.sum_exp_logits_local,
                                                       f.predicted_logits_local)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(np.full(BT, 1 / BT, np.float32), x, emb, f.target_mask,
                                                     f.masked_target, logits_max=f.logits_max_local,
                                                     sum_exp_logits=f.sum_exp_logits_local)
    np.testing.assert_array_equal(np.asarray(got.load("grad_weight")).view(np.uint16), gw.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(got.load("grad_input")).view(np.uint16), gi.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(got.load("loss")), loss)
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["outputs"]["tensors"]) >= {"grad_input", "grad_weight", "loss", "logits_max", "sum_exp_logits"}
    safetensors_torch = pytest.importorskip("safetensors.torch")
    assert tuple(safetensors_torch.load_file(str(out / "results.safetensors"))["grad_weight"].shape) == (V, H)


def test_out_npy(data, tmp_path):
    d, dirs, emb, head = data
    p = fastgrad("--model", dirs["untied_sharded"], "--bt", 12, "--out", tmp_path, "--out-format", "npy", "--json")
    assert p.returncode == 0, p.stderr
    from fastgrad.compare import load_array

    gw = load_array(str(tmp_path / "grad_weight.npy"))
    assert gw.shape == (V, H) and gw.dtype == ml_dtypes.bfloat16
    assert load_array(str(tmp_path / "loss.npy")).shape == (12,)
    assert json.loads((tmp_path / "report.json").read_text())["shape"]["BT"] == 12


def test_model_dir_errors(data, tmp_path):
    d, dirs, emb, head = data
    for args, words in [
        (("--model", dirs["nohead"]), ("--model", "LM head", "--tensor")),
        (("--model", tmp_path / "missing"), ("--model", "no such directory")),
        (("--model", d), ("--model", "config.json")),
        (("--model", dirs["tied"], "--tensor", "nope"), ("--tensor", "model.embed_tokens.weight")),
        (("--model", dirs["tied"], "--input", d / "batch.safetensors:nope"), ("--input", "hidden_states")),
    ]:
        p = fastgrad(*args)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
        for w in words:
            assert w in p.stderr, (w, p.stderr)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{ not json")
    p = fastgrad("--model", tmp_path / "bad")
    assert p.returncode == 2 and "config.json" in p.stderr and "Traceback" not in p.stderr


def test_list_tensors(data):
    d, dirs, emb, head = data
    p = fastgrad("--list-tensors", dirs["untied_sharded"])
    assert p.returncode == 0, p.stderr
    assert "lm_head.weight\tBF16\t[300, 24]" in p.stdout and "model-00002-of-00002.safetensors" in p.stdout
    assert "LM head: lm_head.weight" in p.stderr
    p = fastgrad("--list-tensors", d / "batch.safetensors")
    assert p.returncode == 0 and "hidden_states\tF32\t[2, 10, 24]" in p.stdout


def test_check_fails_with_exit_1(tmp_path, monkeypatch, capsys):
    """--check exits 1 when the golden error exceeds the threshold (a corrupted result here)."""
    from fastgrad.cli import run

    real = run.golden_check

    def corrupted(fg, vp, x, w, t, grad, gmax, gsum, loss, gi, gw, *a):
        gw[:] = gw * 2                                   # the result under test is now wrong
        return real(fg, vp, x, w, t, grad, gmax, gsum, loss, gi, gw, *a)

    monkeypatch.setattr(run, "golden_check", corrupted)
    assert run.main(["--bt", "16", "--hidden", "8", "--vocab", "300", "--no-progress", "--check"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_safetensors_roundtrip(tmp_path):
    a = {"a": np.arange(6, dtype=np.float16).reshape(2, 3), "b": np.zeros((0, 4), np.float32),
         "c": np.array([1, 2], np.int64), "d": (np.arange(5) / 3).astype(ml_dtypes.bfloat16)}
    ck.save_safetensors(str(tmp_path / "r.safetensors"), a, {"k": "v"})
    f = ck.SafetensorsFile(str(tmp_path / "r.safetensors"))
    assert f.metadata == {"k": "v"}
    for k, v in a.items():
        got = f.load(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), v.view(np.uint8))
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    got = safetensors_numpy.load_file(str(tmp_path / "r.safetensors"))
    np.testing.assert_array_equal(got["a"], a["a"])
