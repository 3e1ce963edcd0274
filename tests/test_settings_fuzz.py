"""Hostile values for the settings (``fastgrad/_config.py``), the per-call options and the plan
API: every bad value is refused with 161002 (an ``AclnnParamError``, a ``ValueError``) naming
what was wrong, never read as the default nor by its truth value, never a bare Python error."""

from __future__ import annotations

import numpy as np
import pytest

import fastgrad as fg
from fastgrad import _config


def _refused(fn, *args, match: str | None = None, **kw) -> fg.AclnnError:
    with pytest.raises(fg.AclnnParamError, match=match) as e:
        fn(*args, **kw)
    assert e.value.status == fg.ACLNN_ERR_PARAM_INVALID and isinstance(e.value, ValueError)
    return e.value


#: values a boolean setting must refuse: strings and numbers are not read by their truth value
NOT_BOOLS = ["false", "0", "", "no", 0, 1, 2, 0.0, 1.5, float("nan"), b"false", ["x"], object()]


@pytest.mark.parametrize("bad", NOT_BOOLS, ids=[f"{type(v).__name__}{i}" for i, v in enumerate(NOT_BOOLS)])
def test_boolean_setters_refuse_what_is_not_a_bool(bad):
    """Found by fuzzing: ``set_strict("false")`` turned strict mode on (``bool("false")``), and so
    did every context manager and ``Options(prefer_onednn="false")``; now 161002 naming the
    setter, the setting unchanged."""
    before = (fg.is_strict(), fg.is_deterministic())
    for setter in (fg.set_strict, fg.set_deterministic):
        _refused(setter, bad, match=f"{setter.__name__}: enabled: expected a bool")
    for ctx in (fg.strict, fg.deterministic):
        with pytest.raises(fg.AclnnParamError, match=f"{ctx.__name__}: enabled: expected a bool"):
            with ctx(bad):
                pass
    assert (fg.is_strict(), fg.is_deterministic()) == before
    _refused(fg.Options(prefer_onednn=bad).resolve, fg.settings(), match="options.prefer_onednn")


def test_boolean_setters_take_python_and_numpy_bools():
    for flag in (True, False, np.bool_(True), np.bool_(False)):
        try:
            fg.set_strict(flag)
            fg.set_deterministic(flag)
            assert fg.is_strict() is bool(flag) and fg.is_deterministic() is bool(flag)
        finally:
            fg.set_strict(None)
            fg.set_deterministic(None)
        with fg.strict(flag), fg.deterministic(flag):
            assert fg.is_strict() is bool(flag) and fg.is_deterministic() is bool(flag)
        assert fg.Options(prefer_onednn=flag).resolve(fg.settings()).prefer_onednn is bool(flag)


#: values a named setting (GEMM engine, ISA, SoC) must refuse
NOT_NAMES = [None, True, 1, 1.5, "", " ", "mkl", "BLAS2", "avx-3", "Ascend310P3", b"blas", ["blas"], np.str_("x")]


@pytest.mark.parametrize("bad", NOT_NAMES, ids=[f"{type(v).__name__}{i}" for i, v in enumerate(NOT_NAMES)])
def test_named_setters_refuse_with_161002(bad):
    """Found by fuzzing: ``set_gemm_engine``/``gemm``, ``set_soc_version``/``soc_version`` (and
    ``FASTGRAD_SOC_VERSION``) raised a bare ``ValueError`` (no status, no param), and ``gemm(None)``
    or ``set_gemm_engine(True)`` were read through ``str()`` ("none", "true"); now 161002 naming
    the setter and what it takes.  ``set_native_isa``'s context manager named ``set_native_isa``."""
    for fn, match in (
        (fg.set_gemm_engine, "set_gemm_engine: name: expected a gemm engine"),
        (fg.set_soc_version, "set_soc_version: name: expected one of Ascend910B"),
        (_config.set_native_isa, "set_native_isa: isa: expected auto, avx512 or avx2"),
    ):
        if bad is not None:  # None: back to the environment
            assert _refused(fn, bad, match=match).param in ("name", "isa")
    for ctx, match in (
        (fg.gemm, "gemm: name: expected a gemm engine"),
        (fg.soc_version, "soc_version: name: expected one of Ascend910B"),
        (_config.use_native_isa, "use_native_isa: isa: expected auto"),
    ):
        with pytest.raises(fg.AclnnParamError, match=match):
            with ctx(bad):
                pass
    assert (_config.gemm_setting(), fg.get_soc_version(), _config.native_isa()) == ("auto", "Ascend910B", "auto")


def test_named_settings_take_case_and_blanks():
    with fg.gemm(" BLAS "), fg.soc_version(" ascend950 "), _config.use_native_isa("AVX2\t"):
        s = fg.settings()
        assert (s.gemm, s.soc_version, s.native_isa) == ("blas", "ascend950", "avx2")


def test_soc_version_variable_is_refused_with_161002(monkeypatch):
    monkeypatch.setenv("FASTGRAD_SOC_VERSION", "Ascend310P3")
    e = _refused(fg.settings, match=r"^FASTGRAD_SOC_VERSION \(environment variable\): expected one of")
    assert "'Ascend310P3'" in str(e)
