"""fg.compare / `fastgrad compare`: the Ascend accuracy standards on cases with known verdicts.

Every threshold is probed exactly at, just under and just over its limit.  Values are built
in float64 so the metrics are exact (powers of two); ``eps=0`` removes the 1e-7 of the
relative error where an exact "at the threshold" case needs it.
"""

import json
import math

import ml_dtypes
import numpy as np
import pytest

import fastgrad as fg
from fastgrad.cli import main as cli_main
from fastgrad.compare import load_array, save_array

BF16 = ml_dtypes.bfloat16
D = 2.0 ** -20          # a relative nudge far above float64 resolution, far below any threshold
SINGLE = [("float16", 2.0 ** -10), ("bfloat16", 2.0 ** -7), ("float32", 2.0 ** -13)]


def ones(n=1000):
    return np.ones(n, np.float64)


# ---------------------------------------------------------------------------- single ----

@pytest.mark.parametrize("dtype,t", SINGLE)
@pytest.mark.parametrize("factor,ok", [(1 - D, True), (1.0, False), (1 + D, False)])
def test_single_mere_threshold(dtype, t, factor, ok):
    g = ones(1)
    a = g + t * factor            # one element: MERE == MARE == t*factor (< 10t)
    r = fg.compare(a, g, dtype=dtype, eps=0)
    assert r.passed is ok and bool(r) is ok
    assert r.metrics["MERE"] == pytest.approx(t * factor, rel=1e-12)
    assert r.thresholds["MERE_lt"] == t and r.thresholds["MARE_lt"] == 10 * t
    assert (not r.failures) is ok


@pytest.mark.parametrize("dtype,t", SINGLE)
@pytest.mark.parametrize("factor,ok", [(1 - D, True), (1.0, False), (1 + D, False)])
def test_single_mare_threshold(dtype, t, factor, ok):
    g = ones(4096)
    a = g.copy()
    a[17] += 10 * t * factor      # MARE = 10t*factor, MERE = that / 4096 << t
    r = fg.compare(a, g, dtype=dtype, eps=0)
    assert r.metrics["MARE"] == pytest.approx(10 * t * factor, rel=1e-12)
    assert r.metrics["MERE"] < t
    assert r.passed is ok
    if not ok:
        assert any("MARE" in f for f in r.failures)


def test_single_default_eps_is_1e7():
    g = ones(1)
    a = g + 2.0 ** -10
    # |a-g|/(|g|+1e-7) is just under T: passes with the default eps, fails with eps=0
    assert fg.compare(a, g, dtype="fp16").passed
    assert not fg.compare(a, g, dtype="fp16", eps=0).passed
    # a zero golden: relative error = |a| / 1e-7
    r = fg.compare(np.array([1e-12]), np.array([0.0]), dtype="float16")
    assert r.metrics["MARE"] == pytest.approx(1e-5)


def test_single_dtype_inferred_from_actual_and_bf16_torch_inputs():
    torch = pytest.importorskip("torch")
    g = np.linspace(-3, 3, 301)
    a = torch.tensor(g, dtype=torch.bfloat16)          # bf16 rounding: rel err <= 2^-9
    r = fg.compare(a, g)
    assert r.dtype == "bfloat16" and r.passed
    assert 0 < r.metrics["MARE"] <= 2.0 ** -8
    # the same bf16 values judged with fp32 thresholds fail
    assert not fg.compare(a, g, dtype=torch.float32).passed
    # numpy bf16 / fp16 arrays
    assert fg.compare(g.astype(BF16), g).dtype == "bfloat16"
    assert fg.compare(g.astype(np.float16), g).dtype == "float16"


# ---------------------------------------------------------------------------- legacy ----

@pytest.mark.parametrize("dtype,loss,n", [("float16", 1e-3, 1000), ("bfloat16", 4e-3, 1000),
                                           ("float32", 1e-4, 10000)])
def test_legacy_failing_fraction(dtype, loss, n):
    limit = int(round(loss * n))      # at most this many elements may fail
    g = ones(n)
    for k, ok in ((limit - 1, True), (limit, True), (limit + 1, False)):
        a = g.copy()
        a[:k] += 0.05                 # fails both atol and rtol
        r = fg.compare(a, g, dtype=dtype, standard="legacy")
        assert r.metrics["rtol_failures"] == k and r.metrics["atol_failures"] == k
        assert r.passed is ok, (k, r)
    assert r.thresholds == {"rtol": loss, "atol": loss, "max_fail_fraction": loss, "minimum": 1e-9}


def test_legacy_counts_rtol_and_atol_separately():
    """verify_result.py fails only when BOTH failure counts exceed size*loss."""
    g = ones(1000)
    g[:10] = 1e-4          # tiny goldens: fail rtol only
    g[10:20] = 1000.0      # large goldens: fail atol only
    a = g.copy()
    a[:10] *= 2            # diff 1e-4 <= atol, rel 0.5 > rtol
    a[10:20] += 0.5        # diff 0.5 > atol, rel 5e-4 <= rtol
    r = fg.compare(a, g, dtype="float16", standard="legacy")
    assert r.metrics["rtol_failures"] == 10 and r.metrics["atol_failures"] == 10
    assert not r.passed
    b = g.copy()
    b[:10] *= 2            # only rtol failures: 10 > 1 but atol failures 0 -> pass
    r = fg.compare(b, g, dtype="float16", standard="legacy")
    assert r.metrics["rtol_failures"] == 10 and r.metrics["atol_failures"] == 0 and r.passed
    c = g.copy()
    c[10:20] += 0.5        # only atol failures -> pass
    assert fg.compare(c, g, dtype="float16", standard="legacy").passed


def test_legacy_element_limits_are_strict():
    g = np.full(10, 0.5)
    a = g + 2.0 ** -10     # diff 2^-10 ~ 9.8e-4 <= 1e-3 (atol ok); rel ~ 1.95e-3 > 1e-3
    r = fg.compare(a, g, dtype="float16", standard="legacy")
    assert r.metrics["atol_failures"] == 0 and r.metrics["rtol_failures"] == 10 and r.passed


# ---------------------------------------------------------------------------- double ----

E = 2.0 ** -10


def _double(a, g, ref, level="L0", dtype="float16"):
    return fg.compare(a, g, dtype=dtype, standard="double", reference=ref, level=level, eps=0)


@pytest.mark.parametrize("factor,ok", [(1 - D, True), (1.0, True), (1 + D, False)])
def test_double_mare_and_rmse_ratio_limits(factor, ok):
    # reference: 25 elements off by E; actual: one element off by 10E*factor
    # -> MARE ratio 10*factor, RMSE ratio 2*factor, MERE ratio 0.4*factor
    g = ones(100)
    ref = g.copy()
    ref[:25] += E
    a = g.copy()
    a[50] += 10 * E * factor
    r = _double(a, g, ref)
    assert r.metrics["MARE_ratio"] == pytest.approx(10 * factor, rel=1e-12)
    assert r.metrics["RMSE_ratio"] == pytest.approx(2 * factor, rel=1e-12)
    assert r.metrics["MERE_ratio"] == pytest.approx(0.4 * factor, rel=1e-12)
    assert r.passed is ok
    assert r.achieved_level == ("L0" if ok else None)
    assert r.reference_metrics["MARE"] == E


@pytest.mark.parametrize("k,ok", [(19, True), (20, True), (21, False)])
def test_double_mere_ratio_limit(k, ok):
    # reference: 10 elements off by E; actual: k elements off by E -> MERE ratio k/10
    g = ones(100)
    ref = g.copy()
    ref[:10] += E
    a = g.copy()
    a[:k] += E
    r = _double(a, g, ref)
    assert r.metrics["MERE_ratio"] == pytest.approx(k / 10, rel=1e-12)
    assert r.metrics["MARE_ratio"] == 1.0
    assert r.passed is ok


@pytest.mark.parametrize("level,mare", [("L0", 10.0), ("L1", 5.0), ("L2", 2.0)])
def test_double_levels(level, mare):
    g = ones(400)
    ref = g.copy()
    ref[:100] += E                  # lots of reference error: only MARE ratio is binding
    for factor, ok in ((1.0, True), (1 + D, False)):
        a = g.copy()
        a[200] += mare * E * factor
        r = _double(a, g, ref, level=level)
        assert r.passed is ok, (level, factor, r)
        assert r.thresholds["MARE_ratio_max"] == mare
    # L1 requirement met -> achieved L1 even when only L0 was asked for
    a = g.copy()
    a[200] += 5 * E
    r = _double(a, g, ref, level="L0")
    assert r.passed and r.achieved_level == "L1"
    assert not _double(a, g, ref, level="L2").passed


def test_double_small_value_domain():
    small = 2.0 ** -12                          # < 2^-11: small-value domain for fp16
    g = np.concatenate([ones(100), np.full(100, small)])
    ref = g.copy()
    ref[100] += 2.0 ** -15                      # one small-value error (> 2^-16)
    # errors of exactly 2^-16 are not errors; just over are
    a = g.copy()
    a[100:110] += 2.0 ** -16
    r = _double(a, g, ref)
    assert r.metrics["small_errors"] == 0 and r.metrics["n_small"] == 100
    for k, ok in ((1, True), (2, True), (3, False)):
        a = g.copy()
        a[100:100 + k] += 2.0 ** -16 * (1 + D)
        r = _double(a, g, ref)
        assert r.metrics["small_errors"] == k
        assert r.metrics["small_error_ratio"] == k
        assert r.passed is ok
    # small-value elements do not enter MARE/MERE even with a huge relative error
    a = g.copy()
    a[150] = small + 2.0 ** -17                 # relative error 0.5, absolute below the limit
    r = _double(a, g, ref)
    assert r.metrics["MARE"] == 0 and r.metrics["small_errors"] == 0 and r.passed
    # |golden| == 2^-11 is not small: it is judged by relative error
    g2 = np.full(10, 2.0 ** -11)
    a2 = g2 * (1 + 0.5)
    r = _double(a2, g2, g2.copy())
    assert r.metrics["n_small"] == 0 and r.metrics["MARE"] == 0.5


def test_double_zero_reference_floors():
    # reference bit-identical to golden: its metrics are 0 and get floored
    g = ones(1000)
    u = 2.0 ** -11
    for factor, ok in ((1.0, True), (1 + D, False)):
        a = g.copy()
        a[3] += 10 * u * factor
        r = _double(a, g, g.copy())
        assert r.metrics["MARE_ratio"] == pytest.approx(10 * factor)
        assert r.passed is ok
    # small-value error count floored at 1: 2 errors pass, 3 fail against an exact reference
    gs = np.concatenate([ones(50), np.full(50, 2.0 ** -13)])
    ref = gs.copy()
    ref[:10] += E                   # the reference errs on normal values only
    for k, ok in ((2, True), (3, False)):
        a = gs.copy()
        a[50:50 + k] += 2.0 ** -15
        r = _double(a, gs, ref)
        assert r.reference_metrics["small_errors"] == 0 and r.metrics["small_error_ratio"] == k
        assert r.passed is ok
    # a perfect actual has ratio 0 whatever the reference
    r = _double(g.copy(), g, g.copy())
    assert r.passed and r.achieved_level == "L2" and r.metrics["MARE_ratio"] == 0


def test_double_per_dtype_small_values():
    cases = {"bfloat16": (2.0 ** -8, 2.0 ** -16), "float32": (2.0 ** -14, 2.0 ** -30),
             "float16": (2.0 ** -11, 2.0 ** -16)}
    for dtype, (thr, atol) in cases.items():
        g = np.array([thr / 2, thr / 2, thr])
        a = g + np.array([atol, atol * (1 + D), 0.0])
        r = _double(a, g, g.copy(), dtype=dtype)
        assert r.metrics["n_small"] == 2 and r.metrics["small_errors"] == 1, dtype
        assert r.thresholds["small_value"] == thr and r.thresholds["small_value_atol"] == atol


def test_double_requires_reference():
    with pytest.raises(fg.AclnnError) as e:
        fg.compare(ones(3), ones(3), dtype="float16", standard="double")
    assert e.value.status == 161001


# ----------------------------------------------------------------------- inf / NaN ----

@pytest.mark.parametrize("standard", ["single", "double", "legacy"])
def test_special_values_must_match(standard):
    g = np.array([1.0, np.nan, np.inf, -np.inf, 2.0])
    kw = dict(dtype="float32", standard=standard, reference=g.copy())
    r = fg.compare(g.copy(), g, **kw)
    assert r.passed and r.metrics["special_mismatch"] == 0
    assert math.isfinite(r.metrics["MARE" if standard != "legacy" else "max_rel_err"])
    bad = [
        np.array([1.0, 1.0, np.inf, -np.inf, 2.0]),       # NaN missing
        np.array([np.nan, np.nan, np.inf, -np.inf, 2.0]),  # extra NaN
        np.array([1.0, np.nan, -np.inf, -np.inf, 2.0]),   # wrong-sign inf
        np.array([1.0, np.nan, np.nan, -np.inf, 2.0]),    # NaN instead of inf
        np.array([1.0, np.nan, np.inf, -np.inf, np.inf]),  # inf where golden finite
    ]
    for a in bad:
        r = fg.compare(a, g, **kw)
        assert not r.passed and r.metrics["special_mismatch"] == 1, a
        assert any("inf/NaN" in f for f in r.failures)


def test_special_value_mismatch_location_reported():
    g = np.zeros((3, 4))
    a = g.copy()
    a[2, 1] = np.nan
    r = fg.compare(a, g, dtype="float16")
    assert r.metrics["first_special_mismatch"] == [[2, 1]]


# -------------------------------------------------------------------------- errors ----

def test_bad_arguments():
    g = ones(4)
    cases = [
        (lambda: fg.compare(g, g, dtype="float16", standard="triple"), 161002),
        (lambda: fg.compare(g, ones(5), dtype="float16"), 161002),
        (lambda: fg.compare(g, g), 161002),                       # float64 without dtype=
        (lambda: fg.compare(g, g, dtype="int32"), 161002),
        (lambda: fg.compare(None, g, dtype="float16"), 161001),
        (lambda: fg.compare(g, None, dtype="float16"), 161001),
        (lambda: fg.compare(g, g, dtype="float16", standard="double", reference=g, level="L3"), 161002),
        (lambda: fg.compare(g, g, dtype="float16", standard="double", reference=ones(3)), 161002),
        # found by fuzzing: builtins errors for these
        (lambda: fg.compare(g, g, dtype="float16", eps=None), 161002),
        (lambda: fg.compare(g, g, dtype="float16", eps="x"), 161002),
        (lambda: fg.compare(g, g, dtype="float16", eps=float("inf")), 161002),
        (lambda: fg.compare(g, g, dtype="float16", eps=True), 161002),
    ]
    for fn, status in cases:
        with pytest.raises(fg.AclnnError) as e:
            fn()
        assert e.value.status == status


@pytest.mark.parametrize("standard", ["single", "double"])
def test_an_exact_match_passes_with_eps_zero(standard):
    """Found by fuzzing: ``eps=0`` (validated, allowed) made an exact match at a zero golden 0/0 —
    MERE NaN and a failed verdict.  An exact element's relative error is 0; a non-zero error over
    a zero golden stays infinite (fails)."""
    g = np.array([0.0, 1.0, -2.5, 3e-3], np.float32)
    kw = {"reference": g.copy()} if standard == "double" else {}
    r = fg.compare(g.copy(), g, eps=0.0, standard=standard, **kw)
    assert r.passed, r
    a = g.copy()
    a[0] = 1e-30
    assert not fg.compare(a, g, eps=0.0, standard="single").passed


def test_empty_and_result_serialisation():
    e = np.zeros((0, 3), np.float16)
    for std in ("single", "legacy"):
        assert fg.compare(e, e, standard=std).passed
    assert fg.compare(e, e, standard="double", reference=e).passed
    r = fg.compare(ones(4).astype(np.float32) * 1.5, ones(4), standard="double",
                   reference=ones(4).astype(np.float32))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["passed"] is False and d["standard"] == "double" and d["failures"]
    assert "FAIL" in r.summary()


# ------------------------------------------------------------------------ files / CLI ----

def test_bin_and_npy_io(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4).astype(BF16)
    x.tofile(tmp_path / "raw.bin")
    y = load_array(str(tmp_path / "raw.bin"), "bf16", "3,4")
    assert y.dtype == BF16 and y.shape == (3, 4) and np.array_equal(y.view(np.uint16), x.view(np.uint16))
    save_array(str(tmp_path / "s.bin"), x)          # writes s.json sidecar
    z = load_array(str(tmp_path / "s.bin"))
    assert z.dtype == BF16 and z.shape == (3, 4)
    save_array(str(tmp_path / "n.npy"), x)           # numpy stores bf16 as |V2
    assert load_array(str(tmp_path / "n.npy")).dtype == BF16
    with pytest.raises(fg.AclnnError):
        load_array(str(tmp_path / "raw.bin"))        # no dtype, no sidecar
    with pytest.raises(fg.AclnnError):
        load_array(str(tmp_path / "raw.bin"), "float32", (5,))


def test_cli_compare_exit_codes(tmp_path, capsys):
    g = np.linspace(-2, 2, 1000).astype(np.float16)
    np.save(tmp_path / "g.npy", g)
    np.save(tmp_path / "ok.npy", g)
    bad = g.copy()
    bad[::3] = bad[::3] * np.float16(1.1)
    np.save(tmp_path / "bad.npy", bad)
    assert cli_main(["compare", str(tmp_path / "ok.npy"), str(tmp_path / "g.npy")]) == 0
    assert "PASS" in capsys.readouterr().out
    assert cli_main(["compare", str(tmp_path / "bad.npy"), str(tmp_path / "g.npy")]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert cli_main(["compare", str(tmp_path / "bad.npy"), str(tmp_path / "g.npy"),
                     "--standard", "legacy", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["standard"] == "legacy"
    # raw .bin dumps (an aclnn sample program's output) beside an fp32 golden
    bf = np.linspace(-1, 1, 64).astype(np.float32)
    bf.astype(BF16).tofile(tmp_path / "out.bin")
    bf.tofile(tmp_path / "golden.bin")
    args = ["compare", str(tmp_path / "out.bin"), str(tmp_path / "golden.bin"),
            "--dtype", "bfloat16", "--golden-dtype", "float32", "--shape", "8,8"]
    assert cli_main(args) == 0
    assert cli_main(args[:-2] + ["--shape", "7,7"]) == 2      # wrong shape
    assert cli_main(["compare", str(tmp_path / "out.bin"), str(tmp_path / "golden.bin")]) == 2
    # double benchmark through the CLI
    np.save(tmp_path / "ref.npy", g)
    assert cli_main(["compare", str(tmp_path / "ok.npy"), str(tmp_path / "g.npy"),
                     "--standard", "double", "--reference", str(tmp_path / "ref.npy")]) == 0
    assert cli_main(["compare", str(tmp_path / "ok.npy"), str(tmp_path / "g.npy"),
                     "--standard", "double"]) == 2
    assert cli_main(["compare", "--bogus"]) == 2
    capsys.readouterr()


# ------------------------------------------------------------- .pt files, named standards ----

def test_pt_files(tmp_path, capsys):
    """.pt (an msprobe dump's tensor, an NPU output saved with torch.save) read on the CPU, weights only."""
    torch = pytest.importorskip("torch")
    g = np.linspace(-3, 3, 96).astype(np.float32)
    torch.save(torch.from_numpy(g).to(torch.bfloat16).reshape(8, 12), tmp_path / "out.pt")
    a = load_array(str(tmp_path / "out.pt"))
    assert a.dtype == BF16 and a.shape == (8, 12)
    np.testing.assert_array_equal(a.astype(np.float32).ravel(), g.astype(BF16).astype(np.float32))
    assert load_array(str(tmp_path / "out.pt"), shape="96").shape == (96,)
    np.save(tmp_path / "g.npy", g.reshape(8, 12))
    assert cli_main(["compare", str(tmp_path / "out.pt"), str(tmp_path / "g.npy")]) == 0
    out = capsys.readouterr().out
    assert "dtype=bfloat16" in out and "follows: ATK single benchmark" in out
    # an fp32 .pt 5 % off fails; --dtype describes raw files only, a .pt carries its own
    torch.save(torch.from_numpy(g * 1.05).reshape(8, 12), tmp_path / "off.pt")
    assert cli_main(["compare", str(tmp_path / "off.pt"), str(tmp_path / "g.npy"), "--dtype", "bf16"]) == 1
    capsys.readouterr()
    # not one tensor, or not weights only: a clear error, exit 2, nothing executed
    torch.save({"a": torch.ones(2)}, tmp_path / "dict.pt")
    with pytest.raises(fg.AclnnParamError, match="one tensor"):
        load_array(str(tmp_path / "dict.pt"))
    assert cli_main(["compare", str(tmp_path / "dict.pt"), str(tmp_path / "g.npy")]) == 2
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(fg.AclnnParamError, match=r"\.pt file"):
        load_array(str(tmp_path / "junk.pt"))
    capsys.readouterr()


@pytest.mark.parametrize("standard,words", [("single", "ATK single benchmark"), ("double", "ATK double benchmark"),
                                            ("legacy", "verify_result.py")])
def test_each_result_names_the_standard_it_follows(standard, words):
    g = np.linspace(1, 2, 50)
    r = fg.compare(g, g, dtype="float32", standard=standard, reference=g if standard == "double" else None)
    assert words in r.follows and r.to_dict()["follows"] == r.follows
    assert r.summary().splitlines()[1] == f"  follows: {r.follows}"


def test_msprobe_benchmark_constants_are_msprobes():
    """The documented differences from msprobe's acc_check 'benchmark' standard, against msprobe itself."""
    from fastgrad.compare import LEVELS, MSPROBE_BENCHMARK, SMALL_VALUE
    pytest.importorskip("msprobe")
    torch = pytest.importorskip("torch")
    from msprobe.core.common.const import CompareConst
    from msprobe.pytorch.api_accuracy_checker.precision_standard.standard_config import StandardConfig as S

    for np_dt, t_dt in ((np.dtype(np.float16), torch.float16), (np.dtype(BF16), torch.bfloat16),
                        (np.dtype(np.float32), torch.float32)):
        assert MSPROBE_BENCHMARK[np_dt] == (S._small_value[t_dt], S._benchmark_small_value_atol[t_dt])
        assert MSPROBE_BENCHMARK[np_dt] != SMALL_VALUE[np_dt]       # where ATK's double benchmark differs
    for lv, (mare, mere, rmse) in LEVELS.items():                     # where they agree
        assert S.get_benchmark_ratio_threshold(CompareConst.MAX_REL_ERR, level=lv) == mare
        assert S.get_benchmark_ratio_threshold(CompareConst.MEAN_REL_ERR, level=lv) == mere
        assert S.get_benchmark_ratio_threshold(CompareConst.RMSE, level=lv) == rmse
