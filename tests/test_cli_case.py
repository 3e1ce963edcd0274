"""``fastgrad case``: one command writes a device test case (inputs + golden as .bin/.json sidecars,
a manifest); the golden is reproduced from the .bin files alone through ``fastgrad golden`` and
``fastgrad compare`` (no --dtype/--shape); the case's golden agrees with the float64 oracles of
tests/naive.py (written from the contract); a SoC without the kernel is refused."""

import json
import os
import re
import types

import naive as N
import numpy as np
import pytest
from cli_helpers import fastgrad_inprocess

#: small shapes of each op (dimension names as `fastgrad case -h` gives them)
SHAPES = {
    "aclnnFusedLinearOnlineMaxSum": "24,16,300",
    "aclnnFusedCrossEntropyLossWithMaxSum": "24,16,300",
    "aclnnFusedLinearCrossEntropyLossGrad": "24,16,300",
    "aclnnCrossEntropyLossGrad": "16,40",
    "aclnnScaledMaskedSoftmaxBackward": "2,3,8,16",
    "aclnnSmoothL1LossBackward": "6,20",
    "aclnnEmbeddingDenseBackward": "40,25,8",
}
FUSED_LINEAR = ("aclnnFusedLinearOnlineMaxSum", "aclnnFusedLinearCrossEntropyLossGrad")
GRID = [
    (op, dt, soc)
    for op in SHAPES
    for dt in ("float16", "bfloat16")
    for soc in ("Ascend910B", "Ascend950")
    if not (soc == "Ascend950" and op in FUSED_LINEAR)
]


def _bin(path):
    from fastgrad.compare import load_array

    return load_array(str(path))


def _case(tmp_path, op, dt, soc, *extra):
    from fastgrad.cli._common import ACLNN_OF

    out = tmp_path / "case"
    r = fastgrad_inprocess("case", op, "--shape", SHAPES.get(op) or SHAPES[ACLNN_OF[op]], "--dtype", dt, "--soc-version", soc, "--seed", 3,
                           "--out", out, *extra)
    assert r.returncode == 0, r.stderr
    return out, json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("op,dt,soc", GRID, ids=lambda x: str(x))
def test_case_reproduces_its_golden_from_the_bin_files(tmp_path, op, dt, soc):
    out, man = _case(tmp_path, op, dt, soc)
    assert man["aclnn"] == op and man["soc_version"] == soc and man["soc_profile"] == soc
    assert man["strict"] is False and man["seed"] == 3 and man["dtype"] == dt
    assert man["command"].startswith("fastgrad case " + op) and man["fastgrad"]
    # every input and every output: .bin + .json sidecar + .npy, the sidecar right
    for folder, entries in (("inputs", man["inputs"]), ("golden", man["outputs"])):
        assert entries
        for name, m in entries.items():
            side = json.loads((out / folder / f"{name}.json").read_text())
            assert side == {"dtype": m["dtype"], "shape": m["shape"]}
            a, b = _bin(out / folder / f"{name}.bin"), _bin(out / folder / f"{name}.npy")
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    floating = [n for n, m in man["outputs"].items() if m["dtype"] in ("float16", "bfloat16", "float32")]
    assert floating
    # the golden again, from the .bin inputs alone (sidecars), on the golden and on the cpu kernels
    for backend in ("reference", "cpu"):
        again = tmp_path / backend
        r = fastgrad_inprocess("golden", op, "--inputs", out / "inputs", "--out", again, "--format", "bin",
                               "--soc-version", soc, "--backend", backend)
        assert r.returncode == 0, r.stderr
        got = json.loads((again / "manifest.json").read_text())
        assert got["soc_version"] == soc and got["strict"] is False
        for name, m in man["outputs"].items():
            if name in floating:
                # a raw dump without a sidecar, as the NPU writes it: compare takes the golden's
                raw = tmp_path / f"npu_{backend}_{name}.bin"
                raw.write_bytes((again / f"{name}.bin").read_bytes())
                r = fastgrad_inprocess("compare", raw, out / "golden" / f"{name}.bin")
                assert r.returncode == 0, (name, backend, r.stdout, r.stderr)
                assert r.stdout.startswith("PASS") and f"dtype={m['dtype']}" in r.stdout
                if backend == "reference":  # the golden is deterministic: the same bits
                    assert (again / f"{name}.bin").read_bytes() == (out / "golden" / f"{name}.bin").read_bytes()
            else:  # integer outputs (target_mask, masked_target): equal
                assert np.array_equal(_bin(again / f"{name}.bin"), _bin(out / "golden" / f"{name}.bin"))


def _load_dir(folder):
    return {f[:-4]: _bin(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".bin")}


@pytest.mark.parametrize("op", list(SHAPES))
def test_case_golden_matches_the_float64_oracle(tmp_path, op):
    """The case's inputs are consistent (the chain ran) and its golden is the contract's (910B)."""
    out, man = _case(tmp_path, op, "bfloat16", "Ascend910B")
    inp, gold, attrs = _load_dir(out / "inputs"), _load_dir(out / "golden"), man["attrs"]
    fn = man["op"]
    if fn == "fused_linear_online_max_sum":
        got = types.SimpleNamespace(**gold, vocab_parallel_logits=None)
        N.check_fused_linear_online_max_sum(got, inp["input"], inp["weight"], inp["target"], **attrs)
    elif fn == "fused_cross_entropy_loss_with_max_sum":
        N.check_fused_cross_entropy_loss_with_max_sum(gold["loss"], gold["softmax"], **inp, **attrs)
        # the chain: the statistics are the online max-sum's of chain/ inputs
        up = _load_dir(out / "chain" / "fused_linear_online_max_sum" / "inputs")
        ref = N.fused_linear_online_max_sum(up["input"], up["weight"], up["target"], 0, up["weight"].shape[0])
        np.testing.assert_allclose(inp["logits_max"], ref["logits_max_local"], rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(inp["sum_exp_logits"], ref["sum_exp_logits_local"], rtol=2e-2)
    elif fn == "fused_linear_cross_entropy_loss_grad":
        N.check_fused_linear_cross_entropy_loss_grad((gold["grad_input"], gold["grad_weight"]), **inp, **attrs)
        ref = N.fused_linear_online_max_sum(inp["input"], inp["weight"], _load_dir(
            out / "chain" / "fused_linear_online_max_sum" / "inputs")["target"], 0, inp["weight"].shape[0])
        np.testing.assert_allclose(inp["logits_max"], ref["logits_max_local"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(inp["sum_exp_logits"], ref["sum_exp_logits_local"], rtol=1e-4)
        np.testing.assert_allclose(inp["grad"], 1.0 / inp["input"].shape[0])
    elif fn == "cross_entropy_loss_grad":
        N.check_cross_entropy_loss_grad(gold["x_grad"], **inp, **attrs)
    elif fn == "scaled_masked_softmax_backward":
        N.check_scaled_masked_softmax_backward(gold["out"], **inp, **attrs)
    elif fn == "smooth_l1_loss_backward":
        N.check_smooth_l1_loss_backward(gold["grad_input"], **inp, **attrs, tbe=True)
    elif fn == "embedding_dense_backward":
        N.check_embedding_dense_backward(gold["out"], **inp, **attrs)


def test_high_performance_mode_takes_the_softmax(tmp_path):
    out, man = _case(tmp_path, "fused_linear_cross_entropy_loss_grad", "bfloat16", "Ascend910B",
                     "--mode", "high-performance")
    assert "softmax" in man["inputs"] and "logits_max" not in man["inputs"] and man["mode"] == "high-performance"
    inp, gold = _load_dir(out / "inputs"), _load_dir(out / "golden")
    N.check_fused_linear_cross_entropy_loss_grad((gold["grad_input"], gold["grad_weight"]), **inp)
    assert [c["op"] for c in man["chain"]] == ["fused_linear_online_max_sum", "fused_cross_entropy_loss_with_max_sum"]


@pytest.mark.parametrize("op", FUSED_LINEAR)
def test_a_soc_without_the_kernel_is_refused_in_one_line(tmp_path, op):
    for cmd in (["case", op, "--shape", "8,8,64", "--dtype", "bf16", "--out", tmp_path / "c"],
                ["golden", op, "--inputs", tmp_path, "--out", tmp_path / "g"]):
        r = fastgrad_inprocess(*cmd, "--soc-version", "Ascend950")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Ascend950" in r.stderr and "Ascend910B" in r.stderr and op in r.stderr
    assert not (tmp_path / "c").exists() and not (tmp_path / "g").exists()


def test_strict_and_soc_are_recorded_and_applied(tmp_path):
    # strict mode on the 910B: label smoothing of the CE grad is refused there (its kernel never writes)
    r = fastgrad_inprocess("case", "ce", "--shape", "4,8", "--dtype", "fp16", "--out", tmp_path / "a", "--strict",
                           "--attr", "label_smoothing=0.1")
    assert r.returncode == 2 and "label_smoothing" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    out, man = _case(tmp_path, "cross_entropy_loss_grad", "float16", "Ascend950", "--strict", "--attr",
                     "label_smoothing=0.1")
    assert man["strict"] is True and man["attrs"]["label_smoothing"] == 0.1
    # a finer CANN name is kept, with its profile
    r = fastgrad_inprocess("case", "smooth_l1_loss_backward", "--shape", "4", "--dtype", "bf16",
                           "--soc-version", "Ascend910B3", "--out", tmp_path / "b")
    man = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert r.returncode == 0 and man["soc_version"] == "Ascend910B3" and man["soc_profile"] == "Ascend910B"
    # the SoC changes the golden where the kernels differ (smooth L1: TBE vs the arch35 DAG)
    a = _case(tmp_path / "x", "aclnnSmoothL1LossBackward", "float32", "Ascend910B")[0]
    b = _case(tmp_path / "y", "aclnnSmoothL1LossBackward", "float32", "Ascend950")[0]
    assert (a / "inputs" / "input.bin").read_bytes() == (b / "inputs" / "input.bin").read_bytes()
    assert (a / "golden" / "grad_input.bin").read_bytes() != (b / "golden" / "grad_input.bin").read_bytes()


@pytest.mark.parametrize("argv,flag", [
    (["case", "nosuchop", "--shape", "2,3", "--dtype", "bf16"], "OP"),
    (["case", "ce", "--shape", "2,3,4", "--dtype", "bf16"], "--shape"),
    (["case", "ce", "--shape", "2,0", "--dtype", "bf16"], "--shape"),
    (["case", "ce", "--shape", "2,3", "--dtype", "int8"], "--dtype"),
    (["case", "ce", "--shape", "2,3", "--dtype", "bf16", "--soc-version", "Ascend310P"], "--soc-version"),
    (["case", "ce", "--shape", "2,3", "--dtype", "bf16", "--attr", "nosuch=1"], "--attr"),
    (["case", "ce", "--shape", "2,3", "--dtype", "bf16", "--mode", "high-performance"], "--mode"),
    (["golden", "nosuchop", "--inputs", "."], "OP"),
])
def test_bad_usage_is_one_line(tmp_path, argv, flag):
    r = fastgrad_inprocess(*argv, "--out", tmp_path / "o")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and flag in r.stderr, r.stderr


def test_out_must_be_new_or_empty(tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("keep")
    r = fastgrad_inprocess("case", "ce", "--shape", "2,3", "--dtype", "bf16", "--out", tmp_path / "o")
    assert r.returncode == 2 and "--force" in r.stderr and (tmp_path / "o" / "x").read_text() == "keep"


def test_aclnn_names_match_the_declarations():
    import fastgrad as fg
    from fastgrad.cli._common import ACLNN_NAMES, resolve_op

    for aclnn, op in ACLNN_NAMES.items():
        decl = __import__(f"fastgrad.ops.{op}", fromlist=["DECL"]).DECL
        assert decl.aclnn == aclnn and callable(getattr(fg, op))
        assert resolve_op(aclnn) == resolve_op(aclnn.lower()) == resolve_op(aclnn[5:]) == resolve_op(op) == op
    assert resolve_op("nosuch") is None


def test_golden_raw_bin_without_sidecar_says_what_is_missing(tmp_path):
    out, man = _case(tmp_path, "cross_entropy_loss_grad", "bfloat16", "Ascend910B")
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in ("grad_loss", "log_prob", "target"):
        (raw / f"{name}.bin").write_bytes((out / "inputs" / f"{name}.bin").read_bytes())
    r = fastgrad_inprocess("golden", "aclnnCrossEntropyLossGrad", "--inputs", raw, "--out", tmp_path / "g")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "grad_loss.json" in r.stderr and "--dtype grad_loss=" in r.stderr and "rejected" not in r.stderr
    dims = man["inputs"]["log_prob"]["shape"]
    r = fastgrad_inprocess("golden", "aclnnCrossEntropyLossGrad", "--inputs", raw, "--out", tmp_path / "g",
                           "--dtype", "grad_loss=bf16", "--shape", "grad_loss=", "--dtype", "log_prob=bf16",
                           "--shape", f"log_prob={dims[0]},{dims[1]}", "--dtype", "target=int64", "--format", "bin")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "g" / "x_grad.bin").read_bytes() == (out / "golden" / "x_grad.bin").read_bytes()


def test_compare_without_any_sidecar_says_how(tmp_path):
    a = tmp_path / "a.bin"
    np.zeros(4, np.float16).tofile(a)
    r = fastgrad_inprocess("compare", a, a)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--dtype" in r.stderr and "a.json" in r.stderr and "sidecar" in r.stderr


def test_help_lists_every_option_and_subcommand():
    from fastgrad.cli import SUBCOMMANDS

    top = fastgrad_inprocess("-h").stdout
    for sub in SUBCOMMANDS:
        if sub != "run":
            assert f"fastgrad {sub}" in top, sub
    golden = fastgrad_inprocess("golden", "-h").stdout
    for opt in ("--from-msprobe", "--bench-dump", "--soc-version", "--strict", "--dtype", "--shape", "--format"):
        assert opt in golden, opt
    case = fastgrad_inprocess("case", "-h").stdout
    for opt in ("--shape", "--dtype", "--soc-version", "--strict", "--seed", "--out", "aclnnCrossEntropyLossGrad"):
        assert opt in case, opt


def test_settings_page_lists_every_variable():
    """docs/settings.md names every environment variable fastgrad/_config.py reads."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = open(os.path.join(root, "fastgrad", "_config.py")).read()
    doc = open(os.path.join(root, "docs", "settings.md")).read()
    names = set(re.findall(r"\"((?:FASTGRAD|NUMBA|ASCEND)_[A-Z_0-9]+)\"", src))
    assert {"FASTGRAD_STRICT", "FASTGRAD_SOC_VERSION", "FASTGRAD_BACKEND"} <= names
    missing = sorted(n for n in names if f"`{n}" not in doc)
    assert not missing, f"docs/settings.md lacks {missing}"


def test_the_main_job_takes_the_soc_and_records_it(tmp_path):
    r = fastgrad_inprocess("--soc-version", "Ascend950", "--bt", 8, "--hidden", 8, "--vocab", 64)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Ascend950" in r.stderr
    r = fastgrad_inprocess("--soc-version", "Ascend910_93", "--bt", 16, "--hidden", 8, "--vocab", 64,
                           "--json", "--no-progress")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["soc_version"] == "Ascend910_93" and rep["strict"] is False


def test_help_and_version_import_no_numba():
    """`fastgrad -h`, `--version` and every subcommand's `-h` need none of the kernels: the command's
    own modules import no Numba before parsing (with the package's root import made lazy, they
    are instant; here the root `fastgrad/__init__.py` is bypassed to check the command alone)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for argv in (["--version"], ["-h"], ["case", "-h"], ["golden", "-h"], ["compare", "-h"], ["bench", "-h"],
                 ["ttk-plugin", "-h"]):
        code = (
            "import sys, types, io, contextlib\n"
            f"pkg = types.ModuleType('fastgrad'); pkg.__path__ = [{os.path.join(root, 'fastgrad')!r}]\n"
            "sys.modules['fastgrad'] = pkg\n"
            "import fastgrad.cli\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    rc = fastgrad.cli.main({argv!r})\n"
            "assert rc == 0 and out.getvalue(), rc\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite', 'torch')))\n"
        )
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == "[]", (argv, p.stdout[:300])
