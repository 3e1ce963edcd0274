"""Shared fixtures. Op-specific helpers live beside each op's test file."""

import os

import numpy as np
import pytest

os.environ.setdefault("FASTGRAD_BACKEND", "cpu")

# pytest-xdist's workers share the cores: an OpenMP thread that spin-waits after its parallel
# region (libgomp's default; Numba's threading layer and PyTorch share the runtime) holds the
# core another worker's threads need.  Measured on 2 cores: two processes running
# tests/test_ascend_plugins.py's ATK files at once took 45 s each, 23 s with PASSIVE (alone:
# 7.5 s either way); tests/test_cann_cases.py with -n 2: 48 -> 30 s of CPU.  Set here, before
# any test imports numba or torch (libgomp reads it when it loads); the tests' subprocesses
# inherit it; an explicit setting is kept.  No result depends on it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(autouse=True)
def _reset_fastgrad_state():
    """Each test starts on the default backend, strict mode off."""
    import fastgrad as fg

    yield
    fg.set_backend(None)
    fg.set_strict(None)


# Property tests explore a fixed, reproducible set of examples (CI must not depend on luck).
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("fastgrad", derandomize=True, deadline=None)
    _hyp_settings.load_profile("fastgrad")
except ImportError:  # pragma: no cover
    pass


# ------------------------------------------------------------------------------------------------
# The fast default suite and the slow tests (`-m slow`; CI runs both: `-m "not extended"`; the
# ported peer suites at their full-size shapes are `-m extended`, run on request).
#
# The tests below each took seconds to a minute on 2 cores (`pytest --durations=60`): subprocesses
# that import torch and fastgrad afresh (torchrun, forked children, `python -O`, the bench's memory
# subprocess), Hugging Face / TRL training runs, the ATK/TTK case files of the largest ops, the
# README's snippets, the bench's quick run. They are marked here, by node id, so that each test
# file keeps its own content; `pyproject.toml`'s addopts deselects them by default.  Nothing is
# skipped: CI runs them all.
SLOW_TESTS = (
    "tests/test_bitwise_pins.py::test_the_avx2_hosts_pins_under_their_codegen",
    "tests/test_torch_hf.py::test_trainer_patched_equals_unpatched",
    "tests/test_torch_hf.py::test_patched_step_peak_rss_smaller_by_logits",
    "tests/test_torch_hf.py::test_torch_compile",
    "tests/test_torch_distributed.py::test_vocab_parallel_matches_single_process",
    "tests/test_torch_distributed.py::test_torchrun_example_matches_single_process",
    "tests/test_trl.py::test_sft_trainer_trains_through_fastgrad",
    "tests/test_torch_threads.py::test_first_fastgrad_call_keeps_torch_threads",
    "tests/test_torch_linear_cross_entropy.py::test_tiny_lm_example_runs",
    "tests/test_torch_bench_rows.py::test_torch_rows_in_the_memory_subprocess_run_at_the_asked_thread_count",
    "tests/test_torch_nn.py::test_equals_torch_on_its_keyword_grid",
    "tests/test_hf_points.py::test_compile_whole_model_one_break",
    "tests/test_msprobe.py::test_a_fresh_msprobe_dump_maps_the_same",
    "tests/test_msprobe.py::test_msprobe_compare_against_the_bench_dump",
    "tests/test_ascend_plugins.py::test_atk_golden_on_the_atk_case_files",
    "tests/test_ascend_plugins.py::test_ttk_plugin_on_the_ttk_case_files",
    "tests/test_cann_cases.py::test_atk_case[atk_aclnnScaledMaskedSoftmaxBackward-",
    "tests/test_fork_safety.py::test_lm_head_ops_run_in_a_forked_child",
    "tests/test_optimize_flag.py::test_lm_head_ops_under_python_O_equal_the_normal_run",
    "tests/test_backends_and_packaging.py::test_read_only_install_compiles_without_a_writable_package_dir",
    "tests/test_cli_run.py::test_process_peak_is_the_jobs_own_not_its_parents",
    "tests/test_cli_run.py::test_memory_report_is_the_process_peak",
    "tests/test_cli_docs.py::test_readme_python_snippets_run_and_print",
    "tests/test_bench_smoke.py::test_quick_report_schema",
    "tests/test_bench_smoke.py::test_render_compare_and_plot",
    "tests/test_bench_stream.py::test_ctrl_c_on_a_real_run_leaves_a_partial_report",
    # PyTorch's own test battery of F.linear_cross_entropy against fastgrad's drop-in: minutes
    "tests/test_torch_dropin_upstream.py::test_module_gradients_sampled",
    "tests/test_torch_dropin_upstream.py::test_module_forward",
    "tests/test_torch_dropin_upstream.py::test_forward_mode_AD",
    "tests/test_torch_dropin_upstream.py::test_fn_grad",
    "tests/test_torch_dropin_upstream.py::test_output_dtype_is_pytorchs",
)


#: Flag grids of the ported peer suites sampled in the default run and CI: of each test function's
#: parametrizations (in collection order) every k-th runs there, the others carry the ``extended``
#: marker (``pytest -m extended`` runs them; every parametrization runs under one of the two).
SAMPLED = {
    "tests/test_torch_cce_upstream.py::test_loss_backward": 4,
    "tests/test_torch_cce_upstream.py::test_loss_forward": 2,
    "tests/test_torch_liger_upstream.py::test_flce_correctness": 2,
    "tests/test_torch_liger_upstream.py::test_flce_correctness_with_forward_only": 2,
    "tests/test_torch_liger_upstream.py::test_ce_correctness_with_weight_with_other_params": 2,
    "tests/test_torch_liger_upstream.py::test_ce_correctness_with_forward_only": 2,
    "tests/test_torch_liger_upstream.py::test_flce_correctness_with_token_accuracy": 2,
    "tests/test_torch_liger_upstream.py::test_flce_correctness_with_predicted_tokens": 2,
    "tests/test_torch_liger_upstream.py::test_flce_correctness_functional": 2,
    "tests/test_torch_liger_upstream.py::test_ce_correctness_with_z_loss": 2,
    "tests/test_torch_liger_upstream.py::test_ce_correctness_with_z_loss_with_other_params": 2,
}


def _is_slow(nodeid: str) -> bool:
    return nodeid.startswith(SLOW_TESTS) or any(nodeid.split("[")[0] == s for s in SLOW_TESTS)


def _shares_module_state(item) -> bool:
    """A test that uses a module-, class- or session-scoped fixture of its module (computed once)."""
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info is not None else ():
        for d in defs:
            if d.scope in ("module", "class", "package") and d.baseid:
                return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the slow tests (before `-m` selects); run the files holding them first, so that with
    pytest-xdist the long tests start early and short ones fill the end (no minutes-long tail);
    keep the tests that share a module-scoped fixture on one worker (`--dist loadgroup`)."""
    slow_files = set()
    seen: dict[str, int] = {}
    for item in items:
        fn = item.nodeid.split("[")[0]
        k = SAMPLED.get(fn)
        if k is not None and "[" in item.nodeid and not item.get_closest_marker("extended"):
            i = seen[fn] = seen.get(fn, -1) + 1
            if i % k:
                item.add_marker(pytest.mark.extended)
    for item in items:
        if _is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
            slow_files.add(item.nodeid.split("::")[0])
    items.sort(key=lambda it: it.nodeid.split("::")[0] not in slow_files)  # stable: order kept within
    for item in items:
        if _shares_module_state(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    _xdist_group_suffix(config, items)


def _xdist_group_suffix(config, items) -> None:
    """``--dist loadgroup`` schedules by a suffix ``@group`` that pytest-xdist appends to each
    marked item's nodeid (xdist/remote.py: ``item._nodeid = ...``).  From pytest 9.2 the nodeid
    is ``str(item._id)``, which that assignment no longer changes: every test was scheduled on
    its own and a module-scoped fixture ran once per worker (tests/test_bench_smoke.py's bench
    run twice, 14-27 s each).  Done here where that is so; where xdist's own assignment works
    (``_nodeid`` an attribute of the item) this does nothing."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")
        }
        if not names or "_nodeid" in vars(item) or not hasattr(type(getattr(item, "_id", None)), "parse"):
            continue
        item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(sorted(names))}")
