"""Hostile values for the settings (``fastgrad/_config.py``), the per-call options and the plan
API: every bad value is refused with 161002 (an ``AclnnParamError``, a ``ValueError``) naming
what was wrong, never read as the default nor by its truth value, never a bare Python error."""

from __future__ import annotations

import numpy as np
import pytest

import fastgrad as fg
from fastgrad import _config


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch):
    """These tests read the settings' defaults: the host's own FASTGRAD_* settings (the suite is
    also run with FASTGRAD_NATIVE_ISA=avx2) are set aside; a test that needs one sets it."""
    for var in ("FASTGRAD_NATIVE_ISA", "FASTGRAD_GEMM", "FASTGRAD_SOC_VERSION", "FASTGRAD_STRICT",
                "FASTGRAD_DETERMINISTIC", "FASTGRAD_BACKEND", "FASTGRAD_WORKSPACE_MB", "FASTGRAD_OUTPUT_CACHE_MB"):
        monkeypatch.delenv(var, raising=False)


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


#: sizes no variable may hold: Python-only literals, other scripts' digits, overflow
BAD_SIZES = ["1_000", "0x10", "1e400", "1e308", "nan", "inf", "-inf", "１２", "١٢", "²", "1,5", "12MB", "--1", "e5"]


@pytest.mark.parametrize("var", ["FASTGRAD_WORKSPACE_MB", "FASTGRAD_OUTPUT_CACHE_MB"])
def test_size_variables_take_only_plain_decimal_numbers(monkeypatch, var):
    """Found by fuzzing: ``float()`` read ``FASTGRAD_WORKSPACE_MB=1_000`` as 1000 and ``１２`` (full
    width) or ``١٢`` (Arabic-Indic) as 12, and ``1e308`` (finite MiB, infinite bytes) raised a bare
    ``OverflowError``; now each is 161002 naming the variable."""
    read = _config.workspace_budget if var == "FASTGRAD_WORKSPACE_MB" else _config.output_cache_env_limit
    for bad in BAD_SIZES:
        monkeypatch.setenv(var, bad)
        e = _refused(read, match=f"^{var}: expected a number of MiB")
        assert e.param == var and repr(bad) in str(e)
    for good, nbytes in (("64", 64 << 20), (" 1.5 ", 3 << 19), ("+2", 2 << 20), ("1e1", 10 << 20), (".5", 1 << 19)):
        monkeypatch.setenv(var, good)
        assert read() == nbytes
    monkeypatch.setenv(var, "\t ")  # blanks only: unset
    assert read() == (256 << 20 if var == "FASTGRAD_WORKSPACE_MB" else _config.OUTPUT_CACHE_DEFAULT_MB << 20)


def test_acl_device_takes_only_ascii_digits(monkeypatch):
    """Found by fuzzing: ``str.isdigit`` let ``FASTGRAD_ACL_DEVICE=²`` through to ``int()`` (a bare
    ``ValueError``) and read ``１`` (full width) as device 1; now 161002 naming the variable."""
    for bad in ("²", "１", "١", "-1", "+1", "0x1", "1.0", "npu0"):
        monkeypatch.setenv("FASTGRAD_ACL_DEVICE", bad)
        assert _refused(_config.acl_device_id, match="FASTGRAD_ACL_DEVICE").param == "FASTGRAD_ACL_DEVICE"
    monkeypatch.setenv("FASTGRAD_ACL_DEVICE", " 07 ")
    assert _config.acl_device_id() == 7


def test_numba_cache_variable_is_a_flag(monkeypatch):
    """Found by fuzzing: only ``0/false/no/off`` in lower case turned the cache off; ``FALSE``,
    ``Off`` and typos (``of``, ``disable``) silently kept it on.  Now case-insensitive like every
    flag, and any other value is 161002 naming the variable."""
    for off in ("0", "false", "FALSE", " Off ", "no"):
        monkeypatch.setenv("FASTGRAD_NUMBA_CACHE", off)
        assert _config.numba_cache_candidates() is None
    for on in ("1", "TRUE", " on ", "", "  "):
        monkeypatch.setenv("FASTGRAD_NUMBA_CACHE", on)
        assert _config.numba_cache_candidates()
    for bad in ("of", "disable", "2", "none"):
        monkeypatch.setenv("FASTGRAD_NUMBA_CACHE", bad)
        _refused(_config.numba_cache_candidates, match="FASTGRAD_NUMBA_CACHE")


def test_backend_variable_is_read_like_the_others(monkeypatch):
    """Found by fuzzing: ``FASTGRAD_BACKEND="  "`` was taken as the backend ``"  "`` (every other
    variable holding only blanks is unset) and ``" Reference "`` stayed so in ``settings()``."""
    monkeypatch.setenv("FASTGRAD_BACKEND", "  ")
    assert fg.settings().backend == "cpu" and fg.get_backend() == "cpu"
    monkeypatch.setenv("FASTGRAD_BACKEND", " Reference ")
    assert fg.settings().backend == "reference" == fg.get_backend()


#: sizes in bytes no setter may take
BAD_BYTES = [True, False, 1.5, 1.0, float("nan"), float("inf"), "64", "", -1, np.float64(8.0), np.bool_(True), [8], object()]


@pytest.mark.parametrize("bad", BAD_BYTES, ids=[f"{type(v).__name__}{i}" for i, v in enumerate(BAD_BYTES)])
def test_byte_sizes_are_ints(bad):
    """Found by fuzzing: ``set_workspace_budget`` and ``workspace_floor`` passed their argument to
    ``int()``: ``set_workspace_budget(1.5)`` planned with 1 byte, ``(True)`` with 1, ``("64")``
    with 64, ``(-1)`` and ``(0)`` set a budget the plans never allow (FASTGRAD_WORKSPACE_MB,
    ``Options.workspace_bytes`` and ``fg.plan(budget_bytes=)`` take >= 1), and ``nan``, ``"x"`` or
    a list raised bare ``ValueError``/``TypeError``.  Now 161002 naming the setter, nothing set."""
    before = _config.workspace_budget_override()
    _refused(_config.set_workspace_budget, bad, match="set_workspace_budget: nbytes: expected an int >= 1")
    assert _config.workspace_budget_override() == before
    with pytest.raises(fg.AclnnParamError, match="workspace_floor: nbytes: expected an int >= 0"):
        with _config.workspace_floor(bad):
            pass
    _refused(fg.Options(workspace_bytes=bad).resolve, fg.settings(), match="options.workspace_bytes")


def test_byte_sizes_take_numpy_integers():
    """NumPy integers are integers, as ``fg.plan(budget_bytes=)`` and ``set_num_threads`` take them
    (``Options(workspace_bytes=np.int64(...))`` was refused)."""
    try:
        _config.set_workspace_budget(np.int64(4096))
        assert _config.workspace_budget() == 4096 and type(_config.workspace_budget_override()) is int
    finally:
        _config.set_workspace_budget(None)
    with _config.workspace_floor(np.int64(1 << 40)):
        assert _config.workspace_budget() == 1 << 40
    assert fg.Options(workspace_bytes=np.uint16(7)).resolve(fg.settings()).workspace_bytes == 7
    for zero in (0, np.int8(0)):
        _refused(_config.set_workspace_budget, zero)


def test_progress_takes_a_callable():
    """Found by fuzzing: ``fg.progress("bar")`` was taken, and the op called it after its first
    tile (``TypeError: 'str' object is not callable`` in the middle of the work); now 161002 at
    the ``with``."""
    for bad in ("bar", 1, True, [print]):
        with pytest.raises(fg.AclnnParamError, match="progress: callback: expected a callable"):
            with fg.progress(bad):
                pass
    assert fg.settings().progress is None


def test_num_threads_blocks_of_interleaved_asyncio_tasks_restore_the_count():
    """Found by fuzzing: two tasks of one event loop, ``A: with num_threads(1)``, then
    ``B: with num_threads(2)``, A ends, B ends — each block restored the count it found, so B put
    back A's 1 and the thread kept 1 thread after both (Numba's count is per OS thread, not per
    task).  Now, as the BLAS's count across Python threads: the newest open block's count while
    any is open, the count before the first when all have ended."""
    import asyncio

    if _config.max_threads() < 2:
        pytest.skip("needs two threads to tell the counts apart")
    events: list[tuple[str, int]] = []

    async def block(name: str, n: int, enter_after: float, leave_after: float) -> None:
        await asyncio.sleep(enter_after)
        with fg.num_threads(n):
            events.append((name + " in", fg.get_num_threads()))
            await asyncio.sleep(leave_after)
        events.append((name + " out", fg.get_num_threads()))

    async def main() -> None:
        # A enters, B enters, A leaves, B leaves
        await asyncio.gather(block("A", 1, 0.0, 0.05), block("B", 2, 0.02, 0.1))

    with fg.num_threads(2):
        asyncio.run(main())
        assert events == [("A in", 1), ("B in", 2), ("A out", 2), ("B out", 2)]
        events.clear()
        with fg.num_threads(1):  # the count before both is 1 now: B's 2 must not stay
            asyncio.run(main())
            assert events[-1] == ("B out", 1) and fg.get_num_threads() == 1
        assert fg.get_num_threads() == 2


def test_a_block_that_raises_restores_every_setting():
    before = fg.settings()
    with pytest.raises(KeyError):
        with fg.strict(), fg.deterministic(), fg.gemm("blas"), fg.soc_version("Ascend950"):
            with _config.use_native_isa("avx2"), fg.num_threads(1), fg.progress(print):
                raise KeyError
    assert fg.settings() == before


def test_training_loss_options_refuse_look_alikes():
    """Found by fuzzing ``fastgrad.torch.LinearCrossEntropyOptions``: ``precision=np.array(["fast"])``
    was taken (the array equals "fast" element-wise; the loss then ran "fast", and the options were
    unhashable), ``filter_eps=np.array([0.1, 0.2])`` raised NumPy's bare "truth value is
    ambiguous", ``accum_dtype=torch.int64`` or ``torch.bool`` was taken (refused only at the
    call), and ``preset(["fast"])`` raised ``TypeError: unhashable type``.  Now each is 161002
    naming the field (``options`` for the preset)."""
    torch = pytest.importorskip("torch")
    from fastgrad.torch import LinearCrossEntropyOptions as Opts

    for field, bad in (
        ("precision", np.array(["fast"])),
        ("schedule", np.array(["fused"])),
        ("engine", np.array(["blas"])),
        ("precision", b"fast"),
        ("filter_eps", np.array([0.1, 0.2])),
        ("filter_eps", np.array(["auto"])),
        ("accum_dtype", torch.int64),
        ("accum_dtype", torch.bool),
        ("accum_dtype", torch.complex64),
    ):
        e = _refused(Opts, **{field: bad}, match=f"LinearCrossEntropyOptions: {field}: expected")
        assert e.param == field
    for bad in (["fast"], {"fast": 1}, None, 1, "Fast", " fast", "low-memory"):
        _refused(Opts.preset, bad, match="LinearCrossEntropyOptions: options: expected a preset name")
    # what they take
    o = Opts(precision=np.str_("fast"), accum_dtype=torch.float32, filter_eps=np.float32(0.5))
    assert o.precision == "fast" and hash(o) == hash(Opts(precision="fast", accum_dtype=torch.float32, filter_eps=0.5))
    assert Opts.preset("low_memory") == Opts(schedule="recompute")


@pytest.mark.parametrize("name", [1, None, ["cpu"], b"cpu"])
def test_a_backend_name_that_is_no_string_is_161002(name):
    """Found by fuzzing: fg.set_backend(1), use_backend(None) and use_backend(["cpu"]) raised a bare
    AttributeError ('int' object has no attribute 'strip')."""
    setters = [fg.use_backend] + ([fg.set_backend] if name is not None else [])  # set_backend(None): the env's
    for setter in setters:
        with pytest.raises(fg.AclnnError) as e:
            if setter is fg.use_backend:
                with setter(name):
                    pass
            else:
                setter(name)
        assert (e.value.status, e.value.param) == (161002, "backend") and isinstance(e.value, ValueError)
    assert fg.get_backend() == "cpu"


def test_an_unknown_backend_in_the_environment_names_the_variable(monkeypatch):
    """An unknown FASTGRAD_BACKEND said 'unknown backend' naming no variable.  It stays 361001,
    as every unknown backend (tests/test_backends_and_packaging.py pins it), and now names the
    variable (param too); a name given in code is not blamed on the variable."""
    monkeypatch.setenv("FASTGRAD_BACKEND", " CPUU ")
    with pytest.raises(fg.AclnnError) as e:
        fg.get_backend()
    assert (e.value.status, e.value.param) == (361001, "FASTGRAD_BACKEND") and "'cpuu'" in str(e.value)
    assert str(e.value).startswith("FASTGRAD_BACKEND (environment variable): unknown backend")
    with pytest.raises(fg.AclnnError) as e:
        fg.set_backend("tpu")
    assert (e.value.status, e.value.param) == (361001, "backend") and "FASTGRAD_BACKEND" not in str(e.value)
