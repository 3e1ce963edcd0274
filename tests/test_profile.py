"""`fastgrad bench --from-profile`: msprof op_summary and torch_npu kernel_details files (tests/data/profile/,
headers as msprof 9ba1ac7 op_summary_assembler.cpp and torch_npu 9e73e70 _csv_headers.py write them)."""

import csv
import json
import os

import pytest
from cli_helpers import fastgrad_inprocess

from fastgrad.ascend import profile as P

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "profile")
OP_SUMMARY = os.path.join(DATA, "op_summary_20261125000000.csv")
KERNEL_DETAILS = os.path.join(DATA, "kernel_details.csv")
LEVEL0 = os.path.join(DATA, "kernel_details_level0.csv")

#: What each aclnn call of the files is (written from the files, not from fastgrad).
EXPECTED = [
    (
        "aclnnFusedLinearOnlineMaxSum",
        "fused_linear_online_max_sum",
        "forward",
        "bfloat16",
        {"BT": 64, "H": 32, "V": 256},
    ),
    (
        "aclnnFusedLinearCrossEntropyLossGrad",
        "fused_linear_cross_entropy_loss_grad",
        "memory-saving",
        "bfloat16",
        {"BT": 64, "H": 32, "V": 256},
    ),
    ("aclnnCrossEntropyLossGrad", "cross_entropy_loss_grad", "mean", "bfloat16", {"N": 128, "C": 512}),
    (
        "aclnnScaledMaskedSoftmaxBackward",
        "scaled_masked_softmax_backward",
        "broadcast-mask",
        "float16",
        {"B": 2, "N": 2, "S1": 64, "S2": 64},
    ),
    ("aclnnSmoothL1LossBackward", "smooth_l1_loss_backward", "mean", "bfloat16", {"n": 2048}),
    (
        "aclnnEmbeddingDenseBackward",
        "embedding_dense_backward",
        "dense",
        "bfloat16",
        {"tokens": 256, "num_weights": 1000, "D": 64},
    ),
]
DURATIONS_US = {  # the NPU time of each call: its rows' Task Duration(us) summed
    "aclnnFusedLinearOnlineMaxSum": 48.76,
    "aclnnFusedLinearCrossEntropyLossGrad": 97.41,
    "aclnnCrossEntropyLossGrad": 6.88,
    "aclnnScaledMaskedSoftmaxBackward": 9.54,
    "aclnnSmoothL1LossBackward": 4.10,
    "aclnnEmbeddingDenseBackward": 1.92 + 5.31 + 11.65 + 2.73,
}


def _raw_header(path):
    with open(path, newline="") as f:
        return next(csv.reader(f))


def test_headers_are_the_profilers():
    assert _raw_header(OP_SUMMARY)[:11] == [
        "Device_id",
        "Model ID",
        "Task ID",
        "Stream ID",
        "Op Name",
        "OP Type",
        "OP State",
        "Task Type",
        "Task Start Time(us)",
        "Task Duration(us)",
        "Task Wait Time(us)",
    ]
    assert _raw_header(KERNEL_DETAILS)[:9] == [
        "Step Id",
        "Device_id",
        "Name",
        "Type",
        "Accelerator Core",
        "Start Time(us)",
        "Duration(us)",
        "Wait Time(us)",
        "Block Num",
    ]
    assert "Input Shapes" not in _raw_header(LEVEL0)


@pytest.mark.parametrize("path,kind", [(OP_SUMMARY, "op_summary"), (KERNEL_DETAILS, "kernel_details")])
def test_read_group_and_match(path, kind):
    prof = P.read_profile(path)
    assert (prof.kind, prof.level, len(prof.rows)) == (kind, 1, 11)
    r0 = prof.rows[0]
    assert r0.start_us == pytest.approx(1764028800000000.0) and r0.duration_us == pytest.approx(35.12)
    assert r0.input_shapes == [[64, 32], [32, 256]] and r0.input_dtypes == ["bfloat16", "bfloat16"]
    assert prof.rows[4].input_shapes == [[], [128, 512], [128]]  # a scalar grad_loss is an empty entry
    groups = P.group_rows(prof.rows)
    assert [g.api for g in groups] == [
        "aclnnMm",
        "aclnnFusedLinearOnlineMaxSum",
        "aclnnFusedCrossEntropyLossWithMaxSum",
        "aclnnFusedLinearCrossEntropyLossGrad",
        "aclnnCrossEntropyLossGrad",
        "aclnnScaledMaskedSoftmaxBackward",
        "aclnnSmoothL1LossBackward",
        "aclnnEmbeddingDenseBackward",
    ]
    assert [r.type for r in groups[-1].rows] == ["Cast", "Sort", "EmbeddingDenseGradV2", "Cast"]
    matched = [(g.api, P.match_group(g)) for g in groups]
    got = [(api, m.op, m.mode, m.dtype, m.shape) for api, m in matched if not isinstance(m, str)]
    assert got == EXPECTED
    reasons = {api: m for api, m in matched if isinstance(m, str)}
    assert reasons["aclnnMm"] == "op type MatMulV2: not one of the seven ops"
    assert "no vocab_parallel_logits" in reasons["aclnnFusedCrossEntropyLossWithMaxSum"]
    for api, m in matched:
        if not isinstance(m, str):
            assert m.group.duration_us == pytest.approx(DURATIONS_US[api])


def test_high_performance_and_reduction_none_rows():
    row = P.KernelRow(
        2,
        "aclnnFusedLinearCrossEntropyLossGrad_X_X",
        "FusedLinearCrossEntropyLossGrad",
        "MIX_AIC",
        0.0,
        5.0,
        "",
        [[8], [8, 4], [300, 4], [1], [8], [8, 300]],
        ["float32", "float16"],
        [],
        [],
    )
    m = P.match_group(P.Group("aclnnFusedLinearCrossEntropyLossGrad", [row], row))
    assert (m.mode, m.dtype, m.shape) == ("high-performance", "float16", {"BT": 8, "H": 4, "V": 300})
    row = P.KernelRow(
        2,
        "aclnnCrossEntropyLossGrad_X_X",
        "CrossEntropyLossGrad",
        "AIV",
        0.0,
        1.0,
        "",
        [[16], [16, 10], [16]],
        ["float32", "float32", "int64"],
        [],
        [],
    )
    m = P.match_group(P.Group("aclnnCrossEntropyLossGrad", [row], row))
    assert isinstance(m, str) and "reduction 'none'" in m
    row = P.KernelRow(
        2,
        "aclnnEmbeddingDenseBackward_X_X",
        "EmbeddingDenseGrad",
        "AIV",
        0.0,
        1.0,
        "",
        [[16, 4], [16]],
        ["float32", "int64"],
        [],
        [],
    )
    m = P.match_group(P.Group("aclnnEmbeddingDenseBackward", [row], row))
    assert isinstance(m, str) and "Output Shapes" in m


def test_level0_is_reported_not_guessed(tmp_path):
    prof = P.read_profile(LEVEL0)
    assert prof.level == 0 and len(prof.rows) == 11
    with pytest.raises(P.ProfileError, match="level-0"):
        P.compare_profile(LEVEL0)
    r = fastgrad_inprocess("bench", "--from-profile", LEVEL0, "--json", tmp_path / "r.json")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stdout + r.stderr
    assert "level-0" in r.stderr and "--task-time=l1" in r.stderr and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("content", ["a,b,c\n1,2,3\n", ""])
def test_not_a_profile_is_one_line(tmp_path, content):
    p = tmp_path / "x.csv"
    p.write_text(content)
    r = fastgrad_inprocess("bench", "--from-profile", p)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "op_summary" in r.stderr
    r = fastgrad_inprocess("bench", "--from-profile", tmp_path / "missing.csv")
    assert r.returncode == 2 and "no such file" in r.stderr


@pytest.mark.parametrize("path", [OP_SUMMARY, KERNEL_DETAILS])
def test_cli_report(tmp_path, path):
    pytest.importorskip("matplotlib")
    r = fastgrad_inprocess(
        "bench",
        "--from-profile",
        path,
        "--repeat",
        "1",
        "--budget",
        "1",
        "-q",
        "--json",
        tmp_path / "r.json",
        "--markdown",
        tmp_path / "r.md",
        "--plot",
        tmp_path / "png",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "r.json") as f:
        rep = json.load(f)
    assert rep["schema"] == "fastgrad-profile-compare/1" and rep["source"]["level"] == 1
    assert [(x["api"], x["op"], x["mode"], x["dtype"], x["shape"]) for x in rep["rows"]] == EXPECTED
    for x in rep["rows"]:
        assert x["npu_us"] == pytest.approx(DURATIONS_US[x["api"]])
        assert x["cpu_ms"] > 0 and x["cpu"]["reps"] == 1
        assert x["npu_rate"] == pytest.approx(x["work"] / (x["npu_us"] * 1e-6) / 1e9)
        assert x["cpu_rate"] == pytest.approx(x["work"] / (x["cpu_ms"] * 1e-3) / 1e9)
    flce = rep["rows"][1]
    assert flce["unit"] == "GFLOP/s" and flce["work"] == 3 * 2.0 * 64 * 32 * 256  # the 3 GEMMs of the grad
    sl1 = rep["rows"][4]
    assert sl1["unit"] == "GB/s" and sl1["work"] == 3 * 2048 * 2  # read x, t, write grad, bf16
    assert [u["types"] for u in rep["unmapped"]] == [["MatMulV2"], ["FusedCrossEntropyLossWithMaxSum"]]
    for e in EXPECTED:
        assert e[1] in r.stdout
    assert [u["family"] for u in rep["unmapped"]] == [False, True]  # MatMulV2 is no call of the seven
    assert "not mapped (1)" in r.stdout and "FusedCrossEntropyLossWithMaxSum" in r.stdout
    assert "other ops (not among the seven, not timed): 1 groups, 35.1 us — MatMulV2 x1 (35.1 us)" in r.stdout
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("| line | OP Type") and md.count("\n| ") == len(EXPECTED) and "Not mapped" in md
    assert "MatMulV2 x1" in md and "`aclnnMm_MatMulCommon_MatMulV2`" not in md
    assert os.path.getsize(tmp_path / "png" / "profile_compare.png") > 1000


def _op_summary_lines():
    with open(OP_SUMMARY, newline="") as f:
        return f.read().splitlines()


def test_several_devices_in_one_op_summary_are_not_one_call(tmp_path):
    """msprof writes every device into one op_summary, sorted by device then start time
    (op_summary_assembler.cpp CalculateWaitTime): device 0's last call and device 1's first call of
    the same aclnn API are neighbours, two calls of 4.1 us each, not one of 8.2 us."""
    lines = _op_summary_lines()
    (sl1,) = [x for x in lines if x.split(",")[4].startswith("aclnnSmoothL1LossBackward_")]
    assert sl1.startswith("0,")
    p = tmp_path / "op_summary_2dev.csv"
    p.write_text("\n".join([lines[0], sl1, "1" + sl1[1:]]) + "\n")
    groups = P.group_rows(P.read_profile(str(p)).rows)
    assert [(len(g.rows), g.duration_us) for g in groups] == [(1, pytest.approx(4.1)), (1, pytest.approx(4.1))]
    assert [g.rows[0].device for g in groups] == ["0", "1"]


@pytest.mark.parametrize("cell", ['"-1,512;-1"', '"128,N/A;128"', '"128,5x12;128"'])
def test_a_shape_cell_that_is_not_dimensions_is_that_rows_reason(tmp_path, cell):
    """A dynamic (-1) or mangled dimension in one row: that call is listed as not mapped with the
    reason, the other rows are still read (it was an internal error for the whole file)."""
    lines = _op_summary_lines()
    (ce,) = [x for x in lines if x.split(",")[4].startswith("aclnnCrossEntropyLossGrad_")]
    assert '";128,512;128"' in ce
    p = tmp_path / "op_summary_badshape.csv"
    p.write_text("\n".join([lines[0], ce.replace('";128,512;128"', cell), lines[1]]) + "\n")
    prof = P.read_profile(str(p))
    assert len(prof.rows) == 2 and prof.rows[1].input_shapes == [[64, 32], [32, 256]]
    m = P.match_group(P.group_rows(prof.rows)[0])
    assert isinstance(m, str) and m.startswith("CrossEntropyLossGrad: shape ") and "integers >= 0" in m


@pytest.mark.parametrize("case", ["gbk", "header_only"])
def test_unreadable_or_empty_file_is_one_line(tmp_path, case):
    lines = _op_summary_lines()
    p = tmp_path / "op_summary.csv"
    if case == "gbk":  # re-saved by a spreadsheet in a Chinese code page
        p.write_bytes("\n".join(lines[:2] + [lines[2].replace("aclnnFusedLinearOnlineMaxSum", "融合")]).encode("gbk"))
        want = "not UTF-8"
    else:
        p.write_text(lines[0] + "\n")
        want = "no rows"
    r = fastgrad_inprocess("bench", "--from-profile", p)
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("fastgrad bench: --from-profile")
    assert want in r.stderr


@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
def test_destinations_are_checked_before_the_cpu_runs(tmp_path, flag):
    """--json/--markdown naming a directory, --plot naming a file: one line naming the flag, exit 2,
    before any CPU timing (it failed after timing every row, naming no flag)."""
    bad = tmp_path / "a_file.txt"
    bad.write_text("keep")
    target = bad if flag == "--plot" else tmp_path
    r = fastgrad_inprocess("bench", "--from-profile", KERNEL_DETAILS, "--repeat", "1", flag, target)
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(f"fastgrad bench: {flag}")
    assert "CPU" not in r.stdout and "line " not in r.stderr and bad.read_text() == "keep"


def test_a_training_steps_other_ops_are_summed_by_type_not_listed(tmp_path):
    """Found by fuzzing: every group outside the seven ops was one line of "not mapped", so a
    training step's profile (thousands of MatMul, HCCL, Cast rows) flooded the terminal.  Now the
    seven ops' not-mapped calls are listed one by one and the other ops are one line, summed by
    op type (all of them still in the JSON report's ``unmapped``)."""
    lines = _op_summary_lines()
    (mm,) = [x for x in lines if x.split(",")[5] == "MatMulV2"]
    (ce,) = [x for x in lines if x.split(",")[4].startswith("aclnnCrossEntropyLossGrad_")]
    other = [mm.replace(",100,", f",{1000 + i},") for i in range(300)]
    other += [mm.replace("aclnnMm_MatMulCommon_MatMulV2,MatMulV2", "HcomAllReduce_1,HcomAllReduce") for _ in range(40)]
    p = tmp_path / "op_summary_step.csv"
    p.write_text("\n".join([lines[0], *other, ce.replace('";128,512;128"', '"-1,512;-1"')]) + "\n")
    r = fastgrad_inprocess(
        "bench", "--from-profile", p, "--repeat", "1", "--budget", "1", "-q", "--json", tmp_path / "r.json"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "r.json") as f:
        rep = json.load(f)
    assert len(rep["unmapped"]) == 341 and sum(not u["family"] for u in rep["unmapped"]) == 340
    assert len(r.stdout.splitlines()) < 12, r.stdout
    assert "not mapped (1):" in r.stdout and "CrossEntropyLossGrad: shape" in r.stdout
    assert "other ops (not among the seven, not timed): 340 groups" in r.stdout
    assert "MatMulV2 x300 (10536.0 us), HcomAllReduce x40 (1404.8 us)" in r.stdout


def test_back_to_back_calls_of_one_api_are_separate_calls(tmp_path):
    """Found by fuzzing: an op profiled in a loop gives rows of the same names back to back (msprof
    has no call id); they were one group — three 4.1 us smooth-L1 calls reported as one 12.3 us
    call, two embedding backwards as one call of eight rows.  A run now splits into its calls."""
    lines = _op_summary_lines()

    def rows_of(api):
        return [x for x in lines if x.split(",")[4].startswith(api + "_")]

    sl1, emb = rows_of("aclnnSmoothL1LossBackward"), rows_of("aclnnEmbeddingDenseBackward")
    assert (len(sl1), len(emb)) == (1, 4)
    p = tmp_path / "op_summary_loop.csv"
    p.write_text("\n".join([lines[0], *(sl1 * 3), *(emb * 2)]) + "\n")
    groups = P.group_rows(P.read_profile(str(p)).rows)
    assert [(g.api, len(g.rows)) for g in groups] == [("aclnnSmoothL1LossBackward", 1)] * 3 + [
        ("aclnnEmbeddingDenseBackward", 4)
    ] * 2
    assert [g.duration_us for g in groups] == pytest.approx(
        [4.10] * 3 + [DURATIONS_US["aclnnEmbeddingDenseBackward"]] * 2
    )
    assert all(isinstance(P.match_group(g), P.Match) for g in groups)
    # a run that no period tiles (the first call launched one row more): each main kernel row ends a call
    q = tmp_path / "op_summary_ragged.csv"
    q.write_text("\n".join([lines[0], *emb[:3], *emb]) + "\n")
    groups = P.group_rows(P.read_profile(str(q)).rows)
    assert [[r.type for r in g.rows] for g in groups] == [
        ["Cast", "Sort", "EmbeddingDenseGradV2"],
        ["Cast", "Sort", "EmbeddingDenseGradV2", "Cast"],
    ]
