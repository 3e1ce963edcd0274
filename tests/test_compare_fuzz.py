"""fg.compare, `fastgrad compare`, the TTK plugin and `fastgrad ttk-plugin` under hostile input.

* The three standards against an independent element-by-element oracle written here from the
  documented formulas (fastgrad/compare.py's docstring; the CANN samples' ``verify_result.py``),
  in plain Python floats — NaN/±inf in either side, -0.0, subnormals, fp16/bf16/fp32, float64
  goldens (hypothesis).
* Byte order: a big-endian array or ``.npy`` is its element type (float32, not "neither
  float16/bfloat16/float32"); a ``.bin`` is written little-endian whatever the array's order; a
  big-endian ``.npy`` golden donates float32 (not ``>f4``) to a raw NPU dump beside it.
* A structured 2-byte ``.npy`` is not bfloat16; ``standard=`` is a string.
* float64 data beyond 1e150: RMSE does not overflow to a NaN ratio.
* `fastgrad compare`: ``--eps`` is refused by its flag before any file is read; ``--golden-dtype``
  / ``--reference-dtype`` that contradict a ``.npy`` are refused; integer outputs are equal by
  value across dtypes (uint64 2**64-1 is not int64 -1).
* TTK aclnn entries take the aclnn case file's columns TTK passes (``tensor_dtypes``,
  ``tensor_formats``, ``tensor_storage_shapes``, ``output_tensor_indexes``) as context;
  ``output_dtypes`` given as one string is the first output's dtype, not one per character.
* `fastgrad ttk-plugin --name` refuses names the plugin cannot be imported by (``fastgrad.py``
  shadows the package the plugin imports, ``json.py`` the standard library, ``my golden.py`` is
  no module name).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from cli_helpers import fastgrad_inprocess, one_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastgrad as fg
from fastgrad.compare import load_array, save_array
from fastgrad.errors import AclnnError

fastgrad = fastgrad_inprocess
BF16 = ml_dtypes.bfloat16
DTYPES = {"float16": np.float16, "bfloat16": BF16, "float32": np.float32}

# ---------------------------------------------------------------- the independent oracle ----
# Written from the documented formulas, element by element in Python floats.
T = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-13}
SMALL = {"float16": (2.0**-11, 2.0**-16), "bfloat16": (2.0**-8, 2.0**-16), "float32": (2.0**-14, 2.0**-30)}
LOSS = {"float16": 1e-3, "bfloat16": 4e-3, "float32": 1e-4}
U = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
LEVEL = {"L0": (10.0, 2.0, 2.0), "L1": (5.0, 1.5, 1.5), "L2": (2.0, 1.2, 1.2)}


def _floats(x) -> list[float]:
    return [float(v) for v in np.asarray(x).astype(np.float64).ravel()]


def _specials_match(a: list, g: list) -> bool:
    for x, y in zip(a, g):
        if math.isnan(x) or math.isnan(y):
            if not (math.isnan(x) and math.isnan(y)):
                return False
        elif math.isinf(x) or math.isinf(y):
            if x != y:
                return False
    return True


def _both_finite(a, g):
    return [(x, y) for x, y in zip(a, g) if math.isfinite(x) and math.isfinite(y)]


def oracle_single(actual, golden, name) -> bool:
    a, g = _floats(actual), _floats(golden)
    rel = [abs(x - y) / (abs(y) + 1e-7) for x, y in _both_finite(a, g)]
    mere = sum(rel) / len(rel) if rel else 0.0
    mare = max(rel) if rel else 0.0
    return _specials_match(a, g) and mere < T[name] and mare < 10 * T[name]


def oracle_legacy(actual, golden, name) -> bool:
    a, g = _floats(actual), _floats(golden)
    loss, n_atol, n_rtol = LOSS[name], 0, 0
    for x, y in _both_finite(a, g):
        n_atol += abs(x - y) > loss
        n_rtol += abs(x - y) / (max(abs(x), abs(y)) + 1e-9) > loss
    return _specials_match(a, g) and not (n_atol > loss * len(a) and n_rtol > loss * len(a))


def _double_metrics(x, g, name):
    thr, atol = SMALL[name]
    rel, diffs, errors = [], [], 0
    for v, y in _both_finite(x, g):
        diffs.append(v - y)
        if abs(y) < thr:
            errors += abs(v - y) > atol
        else:
            rel.append(abs(v - y) / (abs(y) + 1e-7))
    mare = max(rel) if rel else 0.0
    mere = sum(rel) / len(rel) if rel else 0.0
    rmse = math.hypot(*diffs) / math.sqrt(len(diffs)) if diffs else 0.0  # (hypot: no overflow)
    return mare, mere, rmse, errors


def oracle_double(actual, golden, reference, name, level="L0") -> bool:
    a, g, r = _floats(actual), _floats(golden), _floats(reference)
    ma, mr = _double_metrics(a, g, name), _double_metrics(r, g, name)
    fin_g = [y for y in g if math.isfinite(y)]
    rms_g = math.hypot(*fin_g) / math.sqrt(len(fin_g)) if fin_g else 0.0
    floors = (U[name], U[name], U[name] * rms_g)
    ok = _specials_match(a, g)
    for i, limit in enumerate(LEVEL[level]):
        if ma[i] == 0:
            ratio = 0.0
        else:
            den = mr[i] if mr[i] != 0 else floors[i]
            ratio = ma[i] / den if den > 0 else math.inf
        ok = ok and ratio <= limit
    return ok and ma[3] / max(mr[3], 1) <= 2.0


# ------------------------------------------------------------------ property: the standards ----
_VALUES = st.one_of(
    st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1e-45, -6e-8, 2.0**-14, 2.0**-12, float("nan"), float("inf"), float("-inf")]),
)


@st.composite
def _case(draw):
    name = draw(st.sampled_from(sorted(DTYPES)))
    n = draw(st.integers(0, 24))
    g = np.array(draw(st.lists(_VALUES, min_size=n, max_size=n)), np.float64)
    noise = draw(st.sampled_from([0.0, 1e-8, 1e-5, 1e-3, 1e-1]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    with np.errstate(invalid="ignore", over="ignore"):
        a = g * (1 + noise * rng.standard_normal(n))
        r = g * (1 + noise * rng.standard_normal(n))
    a[rng.random(n) < 0.05] = np.nan
    dt = DTYPES[name]
    gold = g if draw(st.booleans()) else g.astype(dt)
    return name, a.astype(dt), gold, r.astype(dt)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(_case(), st.sampled_from(["L0", "L1", "L2"]))
def test_the_standards_agree_with_the_oracle(case, level):
    name, a, g, r = case
    keep = [x.copy() for x in (a, g, r)]
    assert bool(fg.compare(a, g, standard="single")) == oracle_single(a, g, name)
    assert bool(fg.compare(a, g, standard="legacy")) == oracle_legacy(a, g, name)
    res = fg.compare(a, g, standard="double", reference=r, level=level)
    assert bool(res) == oracle_double(a, g, r, name, level)
    assert res.dtype == name
    for x, k in zip((a, g, r), keep):  # inputs are never modified
        assert x.tobytes() == k.tobytes()


# ------------------------------------------------------------------ byte order, dtypes ----
@pytest.mark.parametrize("order", [">", "<"])
@pytest.mark.parametrize("name, t", [("float32", np.float32), ("float16", np.float16)])
def test_an_array_of_either_byte_order_is_its_element_type(order, name, t):
    g = np.array([1.0, 2.0, 3.0, -0.5], t)
    a = g * np.array([1.0, 1.0 + 2.0**-9, 1.0, 1.0], t)  # one element off by 2^-9 (fp32: fails)
    res = fg.compare(a.astype(np.dtype(t).newbyteorder(order)), g.astype(np.dtype(t).newbyteorder(order)))
    assert res.dtype == name
    assert bool(res) == oracle_single(a, g, name)


def test_a_bin_is_written_little_endian_whatever_the_arrays_byte_order(tmp_path):
    a = np.array([1.5, -2.0, 3.25], ">f4")
    save_array(str(tmp_path / "x.bin"), a)
    raw = (tmp_path / "x.bin").read_bytes()
    assert raw == np.array([1.5, -2.0, 3.25], "<f4").tobytes()
    assert json.loads((tmp_path / "x.json").read_text()) == {"dtype": "float32", "shape": [3]}
    assert load_array(str(tmp_path / "x.bin")).tolist() == [1.5, -2.0, 3.25]
    assert a.dtype == np.dtype(">f4")  # the input is not modified


def test_a_big_endian_npy_is_read_in_the_hosts_order(tmp_path):
    np.save(tmp_path / "g.npy", np.array([[1.0, 2.0], [3.0, 4.0]], ">f4"))
    a = load_array(str(tmp_path / "g.npy"))
    assert a.dtype == np.float32 and a.dtype.isnative and a.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_a_structured_two_byte_npy_is_not_bfloat16(tmp_path):
    s = np.zeros(4, [("a", "u1"), ("b", "u1")])
    s["a"] = [0x80, 0x3F, 0x00, 0x40]  # the bytes of bf16 1.0 / 2.0 when misread
    np.save(tmp_path / "s.npy", s)
    assert load_array(str(tmp_path / "s.npy")).dtype.names == ("a", "b")
    with pytest.raises(AclnnError) as e:
        fg.compare(load_array(str(tmp_path / "s.npy")), np.ones(4, np.float32))
    assert e.value.status == 161002 and "actual" in str(e.value)


@pytest.mark.parametrize("standard", [np.array(["single"]), ["single"], None, 0])
def test_standard_must_be_a_string(standard):
    g = np.ones(3, np.float32)
    with pytest.raises(AclnnError) as e:
        fg.compare(g, g, standard=standard)
    assert e.value.status == 161002 and "standard" in str(e.value)


def test_float64_beyond_1e150_keeps_a_finite_rmse_ratio():
    g = np.zeros(4)
    a = np.full(4, 1e200)
    with np.errstate(all="raise"):  # and no overflow warning escapes
        res = fg.compare(a, g, dtype="float32", standard="double", reference=a.copy())
    assert res.metrics["RMSE"] == 1e200 and res.metrics["RMSE_ratio"] == 1.0
    assert bool(res) == oracle_double(a, g, a, "float32")
    tiny = np.full(4, 1e-200)  # and its squares do not underflow to a zero RMSE
    res = fg.compare(tiny, g, dtype="float32", standard="double", reference=g.copy())
    assert res.metrics["RMSE"] == 1e-200


# ------------------------------------------------------------------ `fastgrad compare` ----
@pytest.fixture
def files(tmp_path):
    g = np.linspace(0.5, 4.0, 8, dtype=np.float32)
    np.save(tmp_path / "g.npy", g)
    np.save(tmp_path / "gbe.npy", g.astype(">f4"))
    g.tofile(tmp_path / "npu.bin")  # a raw NPU dump: little-endian, no sidecar
    return tmp_path


def test_a_big_endian_npy_golden_gives_a_raw_dump_float32(files):
    p = fastgrad("compare", files / "npu.bin", files / "gbe.npy", "--json")
    assert p.returncode == 0, (p.stdout, p.stderr)
    res = json.loads(p.stdout)
    assert res["dtype"] == "float32" and res["metrics"]["max_abs_err"] == 0.0


@pytest.mark.parametrize("eps", ["nan", "-1", "inf", "1e999", "abc"])
def test_a_bad_eps_is_refused_by_its_flag_before_any_file_is_read(files, eps):
    # the files do not exist: the flag is judged first
    one_line(fastgrad("compare", files / "none.npy", files / "none2.npy", "--eps", eps), "--eps", repr(eps))


@pytest.mark.parametrize("flag", ["--golden-dtype", "--reference-dtype"])
def test_a_dump_dtype_flag_against_a_npy_is_refused(files, flag):
    extra = ["--standard", "double", "--reference", files / "g.npy"] if flag == "--reference-dtype" else []
    line = one_line(fastgrad("compare", files / "g.npy", files / "g.npy", *extra, flag, "fp64"), flag, "float32")
    assert "float64" in line
    p = fastgrad("compare", files / "g.npy", files / "g.npy", *extra, flag, "fp32")  # agreeing: fine
    assert p.returncode == 0, p.stderr


def test_a_dump_dtype_flag_against_a_pt_is_refused(files):
    torch = pytest.importorskip("torch")
    torch.save(torch.linspace(0.5, 4.0, 8, dtype=torch.bfloat16), files / "g16.pt")
    one_line(fastgrad("compare", files / "g16.pt", files / "g16.pt", "--golden-dtype", "fp32"),
             "--golden-dtype", "bfloat16", "float32")
    p = fastgrad("compare", files / "g16.pt", files / "g16.pt", "--golden-dtype", "bf16")
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("a, g, bad", [
    (np.array([2**64 - 1, 5], np.uint64), np.array([-1, 5], np.int64), 1),
    (np.array([2**63, 0], np.uint64), np.array([-(2**63), 0], np.int64), 1),
    (np.array([-1, 7], np.int8), np.array([-1, 7], np.int64), 0),
    (np.array([2**53 + 1], np.int64), np.array([2**53], np.int64), 1),
    (np.array([True, False]), np.array([1, 0], np.uint8), 0),
])
def test_integer_outputs_are_equal_by_value(tmp_path, a, g, bad):
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "g.npy", g)
    p = fastgrad("compare", tmp_path / "a.npy", tmp_path / "g.npy", "--json")
    expected = sum(int(x) != int(y) for x, y in zip(a.tolist(), g.tolist()))  # Python ints: exact
    assert expected == bad
    assert p.returncode == (1 if bad else 0), p.stderr
    assert json.loads(p.stdout)["metrics"]["mismatches"] == bad


# ------------------------------------------------------------------ TTK plugin ----
def _sl1_inputs():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(6).astype(np.float32)
    y = rng.standard_normal(6).astype(np.float32)
    d = rng.standard_normal(6).astype(np.float32)
    return d, x, y


def test_ttk_aclnn_entries_take_the_aclnn_case_columns_as_context():
    from fastgrad.ascend import ttk

    d, x, y = _sl1_inputs()
    out = np.zeros(6, np.float32)
    ctx = {
        "tensor_dtypes": ("float32", "float32", "float32", "float16"),
        "tensor_formats": ("ND",) * 4,
        "tensor_view_shapes": ((6,),) * 4,
        "tensor_storage_shapes": ((6,),) * 4,
        "output_tensor_indexes": (3,),
        "short_soc_version": "Ascend910B",
        "testcase_name": "sl1_ctx",
    }
    (r,) = ttk.aclnn_smooth_l1_loss_backward_golden(d, x, y, "none", 1.0, out, **ctx)
    with fg.soc_version("Ascend910B"):
        want = np.asarray(fg.smooth_l1_loss_backward(d, x, y, "none", 1.0)).astype(np.float16)
    assert r.dtype == np.float16  # the output's dtype: tensor_dtypes[output_tensor_indexes[0]]
    assert r.tobytes() == want.tobytes()
    with pytest.raises(AclnnError):  # a misspelt parameter is still refused
        ttk.aclnn_smooth_l1_loss_backward_golden(d, x, y, "none", 1.0, out, betaa=1.0)


@pytest.mark.parametrize("dt", ["float16", "float32"])
def test_ttk_output_dtypes_as_one_string_is_the_first_outputs(dt):
    from fastgrad.ascend import ttk

    d, x, y = _sl1_inputs()
    (r,) = ttk.smooth_l1_loss_grad_v2_golden(x, y, d, sigma=1.0, reduction="none", output_dtypes=dt)
    assert r.dtype == np.dtype(dt)


@pytest.mark.parametrize("name, words", [
    ("fastgrad.py", ("--name", "fastgrad.py")),
    ("numpy.py", ("--name", "numpy.py")),
    ("json.py", ("--name", "json.py")),
    ("ttk.py", ("--name", "ttk.py")),
    ("my golden.py", ("--name", "module name")),
    ("my-golden.py", ("--name", "module name")),
    ("class.py", ("--name", "module name")),
])
def test_ttk_plugin_refuses_a_name_it_cannot_be_imported_by(tmp_path, name, words):
    one_line(fastgrad("ttk-plugin", "--out", tmp_path / "p", "--name", name), *words)
    assert not (tmp_path / "p").exists()


def test_a_plugin_named_fastgrad_could_not_be_imported(tmp_path):
    # why fastgrad.py is refused: imported by its name (its folder on sys.path, as a plugin
    # folder is), the file is `fastgrad` and its own `from fastgrad.ascend.ttk import` fails
    from fastgrad.ascend.ttk import plugin_source

    (tmp_path / "fastgrad.py").write_text(plugin_source())
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import fastgrad"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode != 0 and "is not a package" in p.stderr
    p = fastgrad("ttk-plugin", "--out", tmp_path / "ok", "--name", "my_golden.py")
    assert p.returncode == 0, p.stderr
    code = f"import sys; sys.path.insert(0, {str(tmp_path / 'ok')!r}); import my_golden; print(len(my_golden.__golden__))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path / "ok", timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "2", p.stderr


# ------------------------------------------------------------------ ATK entry ----
def _emb_inputs():
    rng = np.random.default_rng(5)
    return rng.standard_normal((4, 3)).astype(np.float32), np.array([0, 2, 2, 1])


@pytest.mark.parametrize("api, extra, param", [
    ("aclnnEmbeddingDenseBackward", {"scaleGradByFreq": "False"}, "scaleGradByFreq"),
    ("aclnnScaledMaskedSoftmaxBackward", {"fixTriuMask": "False"}, "fixTriuMask"),
    ("aclnnFusedLinearOnlineMaxSum", {"vocabParallelLogitsOutFlag": "False"}, "vocabParallelLogitsOutFlag"),
])
def test_atk_a_string_for_a_bool_attribute_is_refused(api, extra, param):
    # bool("False") is True: the golden would silently be that of the other setting
    from fastgrad.ascend import atk_golden

    g, i = _emb_inputs()
    rng = np.random.default_rng(6)
    args = {
        "aclnnEmbeddingDenseBackward": dict(grad=g, indices=i, numWeights=3),
        "aclnnScaledMaskedSoftmaxBackward": dict(gradOutput=rng.random((1, 1, 2, 32)).astype(np.float16),
                                                 y=rng.random((1, 1, 2, 32)).astype(np.float16), scale=1.0),
        "aclnnFusedLinearOnlineMaxSum": dict(input=rng.random((8, 4)).astype(np.float16),
                                             weight=rng.random((6, 4)).astype(np.float16),
                                             target=np.arange(8) % 6, vocabStartIndex=0, vocabEndIndex=6),
    }[api]
    with pytest.raises(AclnnError) as e:
        atk_golden(api, **args, **extra)
    assert e.value.status == 161002 and param in str(e.value)


def test_atk_and_ttk_bool_attributes_read_bools_numbers_and_numpy_bools():
    from fastgrad.ascend import atk_golden, ttk

    g, i = _emb_inputs()
    want = {f: np.asarray(fg.embedding_dense_backward(g, i, 3, -1, f)) for f in (False, True)}
    assert not np.array_equal(want[False], want[True])  # the flag matters on these inputs
    for v, f in ((False, False), (np.bool_(True), True), (0, False), (1, True)):
        assert np.array_equal(atk_golden("aclnnEmbeddingDenseBackward", g, i, 3, -1, v), want[f])
        (r,) = ttk.embedding_dense_grad_golden(g, i, num_weights=3, scale_grad_by_freq=v)
        assert np.array_equal(r, want[f])
    with pytest.raises(AclnnError) as e:
        ttk.embedding_dense_grad_golden(g, i, num_weights=3, scale_grad_by_freq="False")
    assert "scale_grad_by_freq" in str(e.value)


@pytest.mark.parametrize("api, args, missing", [
    ("aclnnEmbeddingDenseBackward", "emb", "numWeights"),
    ("aclnnFusedLinearOnlineMaxSum", "flom", "vocabStartIndex"),
])
def test_atk_a_missing_attribute_without_default_is_161001(api, args, missing):
    from fastgrad.ascend import atk_golden

    g, i = _emb_inputs()
    rng = np.random.default_rng(7)
    kwargs = {
        "emb": dict(grad=g, indices=i),
        "flom": dict(input=rng.random((8, 4)).astype(np.float16), weight=rng.random((6, 4)).astype(np.float16),
                     target=np.arange(8) % 6, vocabEndIndex=6),
    }[args]
    with pytest.raises(AclnnError) as e:  # (was a bare KeyError)
        atk_golden(api, **kwargs)
    assert e.value.status == 161001 and missing in str(e.value)
