"""CI smoke test of `fastgrad bench --quick` (not timed): every case runs, the JSON follows
the documented schema, rendering/comparison/plotting work."""

import json
import os

import pytest

from fastgrad import benchmarks as B
from fastgrad.cli import main as cli_main

ROW_KEYS = {"machine", "versions", "threads", "op", "case", "shape", "shape_str", "dtype", "mode",
            "backend", "kind", "runner", "variant", "status", "note", "time_median_s", "time_p20_s",
            "time_p80_s", "reps", "flops", "bytes", "gflops", "gbps", "bound", "bound_time_s",
            "fraction_of_bound", "fastgrad_speedup", "peak_rss_mib", "peak_rss_delta_mib", "rss_measured",
            "time_samples_s"}


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    path = d / "quick.json"
    md = d / "quick.md"
    rc = cli_main(["bench", "--quick", "--repeat", "1", "--budget", "1", "--json", str(path),
                   "--markdown", str(md), "-q"])
    assert rc == 0
    return d, B.load(str(path))


def test_quick_report_schema(quick_report):
    d, rep = quick_report
    assert rep["schema"] == B.SCHEMA
    for k in ("created", "machine", "machine_id", "versions", "settings", "bounds", "rows"):
        assert k in rep
    assert rep["settings"]["quick"] is True
    assert all(b["copy_gbps"] > 0 for b in rep["bounds"].values())
    cases = {c.id for c in B.all_cases(quick=True)}
    seen = {r["case"] for r in rep["rows"]}
    assert seen == cases                                   # every case has rows
    ops = {r["op"] for r in rep["rows"]}
    import fastgrad as fg
    public = {"fused_linear_online_max_sum", "fused_cross_entropy_loss_with_max_sum",
              "fused_linear_cross_entropy_loss_grad", "cross_entropy_loss_grad",
              "scaled_masked_softmax_backward", "smooth_l1_loss_backward", "embedding_dense_backward"}
    assert public <= ops and all(callable(getattr(fg, o)) for o in public)
    errors = []
    for r in rep["rows"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        if r["status"] == "error":          # "not implemented" included: every op is implemented
            errors.append(f"{r['case']} {r['backend']}: {r['note']}")
            continue
        if r["status"] == "skipped":
            assert "torch" in r["note"]
            continue
        assert r["status"] == "ok"
        assert r["time_median_s"] > 0 and r["time_p20_s"] <= r["time_median_s"] <= r["time_p80_s"]
        assert r["fraction_of_bound"] is not None and r["fraction_of_bound"] > 0
        if r["bound"] == "gemm":
            assert r["gflops"] > 0
        else:
            assert r["gbps"] > 0
        if r["kind"] != "bound" or r["bound"] == "gemm":
            assert r["reps"] >= 1
    assert not errors, errors
    # memory-measured cases ran in a subprocess with a peak RSS of their own
    mem = [r for r in rep["rows"] if r["status"] == "ok" and r["op"] == "fused_linear_cross_entropy_loss_grad"]
    assert mem and all(r["peak_rss_mib"] > 10 and r["rss_measured"].startswith("subprocess") for r in mem)
    assert (d / "quick.md").read_text().count("\n|") >= len(rep["rows"])


def test_render_compare_and_plot(quick_report, tmp_path, capsys):
    d, rep = quick_report
    path = str(d / "quick.json")
    # an "NPU host" report: the same cases on another machine and backend
    other = json.loads(json.dumps(rep))
    other["machine_id"] = "npu-host (Ascend 910B)"
    for r in other["rows"]:
        if r["kind"] == "fastgrad":
            r["backend"] = "acl"
    opath = tmp_path / "npu.json"
    opath.write_text(json.dumps(other))
    assert cli_main(["bench", "--from-json", path, "--compare", str(opath)]) == 0
    out = capsys.readouterr().out
    assert "side by side" in out and "npu-host (Ascend 910B)" in out and "fastgrad:acl" in out
    assert "B = npu-host" in out
    text = B.format_table(rep)
    assert "copy bandwidth" in text and "fused_linear_cross_entropy_loss_grad" in text
    pytest.importorskip("matplotlib")
    files = B.plot(rep, str(tmp_path / "plots"))
    assert files and all(f.endswith(".png") for f in files)


def test_bench_usage_errors(tmp_path, capsys):
    assert cli_main(["bench", "--ops", "no_such_op"]) == 2
    assert cli_main(["bench", "--backend", "no_such_backend", "--quick"]) == 2
    assert cli_main(["bench", "--threads", "x", "--quick"]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli_main(["bench", "--from-json", str(bad)]) == 2
    assert cli_main(["bench", "--quick", "--list", "--ops", "flce"]) == 0
    out = capsys.readouterr().out
    assert "memory-saving" in out and "high-performance" in out


def test_rows_selects_the_runners(tmp_path, capsys):
    """``--rows``: only the named runners run (an AVX2-only CPU skips PyTorch's emulated bf16 rows);
    a name no selected case has is one line, exit 2, before any work."""
    path = tmp_path / "rows.json"
    rc = cli_main(["bench", "--quick", "--ops", "linear_cross_entropy[train-step]/", "--rows", "fastgrad,bound",
                   "--no-subprocess", "--repeat", "1", "--budget", "1", "--json", str(path), "-q"])
    assert rc == 0
    rep = B.load(str(path))
    assert rep["rows"] and {r["runner"] for r in rep["rows"]} == {"fastgrad", "bound"}
    capsys.readouterr()
    assert cli_main(["bench", "--quick", "--ops", "smooth_l1", "--rows", "torch-bf16x"]) == 2
    err = capsys.readouterr().err
    assert "--rows" in err and "torch-bf16x" in err and len(err.strip().splitlines()) == 1


def test_ops_selects_a_full_case_id_only(capsys):
    """``--ops`` split at commas: a case id's own commas ("…/BT=2048,H=896,V=151936") do not make
    its pieces ("h=896") substrings that pick every case at that shape."""
    cases = B.all_cases(quick=False)
    for c in cases:
        assert [x.id for x in B.select(cases, c.id.split(","))] == [c.id]
        assert [x.id for x in B.select(cases, c.id.upper().split(","))] == [c.id]   # case-insensitive
    train = "linear_cross_entropy[train-step]/bf16/BT=2048,H=896,V=151936"
    flce = "fused_linear_cross_entropy_loss_grad[memory-saving]/bf16/BT=1024,H=896,V=32000"
    # two ids, and an id beside an alias and a substring
    assert [c.id for c in B.select(cases, (train + "," + flce).split(","))] == [flce, train]
    got = {c.id for c in B.select(cases, (train + ",smooth_l1,embedding_dense_backward[dense]/bf16").split(","))}
    assert got == {train, "smooth_l1_loss_backward[mean]/fp32/n=16777216",
                   "smooth_l1_loss_backward[mean]/bf16/n=16777216",
                   "embedding_dense_backward[dense]/bf16/tokens=8192,num_weights=32000,D=1024"}
    # the words of an id are still substrings on their own
    assert len(B.select(cases, ["h=896"])) > 1
    assert cli_main(["bench", "--ops", train, "--list"]) == 0
    out = capsys.readouterr().out
    assert [ln.split("    (")[0] for ln in out.splitlines() if not ln.startswith(" ")] == [train]


def test_full_cases_cover_the_issues():
    ids = [c.id for c in B.all_cases(quick=False)]
    want = ["fused_linear_cross_entropy_loss_grad[memory-saving]/bf16/BT=2048,H=896,V=151936",
            "fused_linear_cross_entropy_loss_grad[memory-saving]/bf16/BT=1024,H=896,V=32000",
            "fused_linear_cross_entropy_loss_grad[high-performance]/bf16/BT=2048,H=896,V=151936",
            "fused_linear_online_max_sum[forward]/bf16/BT=2048,H=896,V=151936",
            "cross_entropy_loss_grad[mean]/fp32/N=4096,C=32000",
            "cross_entropy_loss_grad[mean]/bf16/N=4096,C=32000",
            "scaled_masked_softmax_backward[broadcast-mask]/fp16/B=4,N=16,S1=512,S2=512",
            "smooth_l1_loss_backward[mean]/fp32/n=16777216",
            "smooth_l1_loss_backward[mean]/bf16/n=16777216",
            "embedding_dense_backward[dense]/fp32/tokens=8192,num_weights=32000,D=1024",
            "embedding_dense_backward[dense]/bf16/tokens=8192,num_weights=32000,D=1024",
            "linear_cross_entropy[train-step]/bf16/BT=2048,H=896,V=151936",
            "linear_cross_entropy[train-step filter_eps=auto entropy=2]/bf16/BT=2048,H=896,V=151936"]
    for w in want:
        assert w in ids, w
    flce = B.find_case(want[0], quick=False)
    assert [r.name for r in flce.runners] == ["fastgrad", "fastgrad-onednn", "torch-fp32", "torch-bf16", "bound"]
    step = B.find_case(want[-2], quick=False)
    assert [r.name for r in step.runners] == [
        "fastgrad", "fastgrad-fused", "fastgrad-recompute", "fastgrad-fast", "fastgrad-blas", "torch-fp32",
        "torch-bf16", "torch-lce", "torch-lce-bcs2048", "bound"]
    assert step.memory
    assert flce.memory and flce.gemm == [(2048, 896, 151936), (2048, 151936, 896), (151936, 2048, 896)]


def test_filter_sweep_cases_skip_what_they_claim():
    """The sparsity sweep's extremes, at a reduced shape (same construction): the adversarial
    "no-skip" case keeps every block (the filter's overhead alone), the uniform case (p = 1/V
    below 2⁻¹²) skips all but the targets' blocks; both give the dense result within the bound."""
    import numpy as np

    from fastgrad.benchmarks import cases as C

    ids = [c.id for c in B.all_cases(quick=False)]
    for label in ("entropy=0.5", "entropy=2", "entropy=4", "uniform", "no-skip"):
        assert any(f"filter_eps=auto {label}]" in i for i in ids), label
    for label, lo, hi in (("no-skip", 0.0, 0.0), (None, 0.9, 1.0)):
        inp = C._sparse_flce_inputs(320, 64, 20000, "bfloat16", label)
        gi, gw, plan = C._flce_grad(inp, **C._stats(inp), filter_eps="auto", return_plan=True)
        di, dw = C._flce_grad(inp, **C._stats(inp), filter_eps=None)
        frac = plan.blocks_skipped / plan.blocks_total
        assert lo <= frac <= hi, (label, frac)
        if label == "no-skip":  # nothing skipped: the dense path, bitwise
            assert np.array_equal(gi.view(np.uint16), di.view(np.uint16))
            assert np.array_equal(gw.view(np.uint16), dw.view(np.uint16))
            assert inp["mean_entropy"] > 5.0
        else:
            assert abs(inp["mean_entropy"] - np.log(20000)) < 1e-3


def test_the_avx2_train_step_script_runs_its_rows():
    """``bench/avx2_train_step.py`` (the issue-28 measurement an AVX2 user repeats) on the quick
    train-step case: every row it names exists in the case, and each one ran."""
    import runpy

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mod = runpy.run_path(os.path.join(root, "bench", "avx2_train_step.py"), run_name="avx2_train_step")
    from fastgrad.benchmarks import cases as C

    assert set(mod["ROWS"]) <= {r.name for r in C.find_case(mod["CASE"], False).runners}  # not built
    quick = "linear_cross_entropy[train-step]/bf16/BT=128,H=64,V=2048"
    best = mod["main"](quick, quick=True, rounds=1)
    have = {r.name for r in C.find_case(quick, True).runners}
    assert set(best) == (set(mod["ROWS"]) & have) | {"bound (3 fp32 sgemms)"} and "fastgrad" in best
    assert all(v > 0 for v in best.values())
