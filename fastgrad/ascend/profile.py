"""NPU profiles side by side: the seven ops' kernels of an msprof / torch_npu profile, timed on the CPU.

Two files are read, with the headers their writers use:

* msprof's ``op_summary_<timestamp>.csv`` (Ascend/msprof 9ba1ac7,
  ``analysis/csrc/application/summary/op_summary_assembler.cpp:36-66``): ``Device_id, Model ID,
  Task ID, Stream ID, Op Name, OP Type, OP State, Task Type, Task Start Time(us), Task
  Duration(us), Task Wait Time(us)``, then with ``--task-time=l1`` ``Block Num, Mix Block Num,
  HF32 Eligible, Input Shapes, Input Data Types, Input Formats, Output Shapes, Output Data
  Types, Output Formats, Context ID`` and the PMU columns.  Shapes are ``"4096,896;18992,896;4096"``
  (one ``;``-separated entry per input), dtypes GE names ``DT_BF16;FLOAT;INT64``
  (``analysis/csrc/domain/services/persistence/host/number_mapping.cpp``); msprof writes the
  start time with a trailing tab (``1717575960208020.758\\t``).
* the torch_npu profiler's ``ASCEND_PROFILER_OUTPUT/kernel_details.csv`` (Ascend/pytorch 9e73e70,
  ``torch_npu/profiler/analysis/prof_common_func/_csv_headers.py``, ``prof_view/_kernel_view_parser.py``):
  the same rows with the columns renamed (``Op Name`` → ``Name``, ``OP Type`` → ``Type``, ``Task
  Type`` → ``Accelerator Core``, ``Task Start Time(us)`` → ``Start Time(us)``, ``Task Duration(us)`` →
  ``Duration(us)``, ``Task Wait Time(us)`` → ``Wait Time(us)``), ``Step Id`` first when steps were
  marked, and the shape columns only when the level collected them.

A **level-0** file (no ``Input Shapes`` column, or only ``N/A`` there) cannot say which shapes
ran: :class:`ProfileError` says so instead of guessing.

One aclnn call may be several rows (``aclnnEmbeddingDenseBackward_Cast_Cast``,
``..._Sort_Sort``, ``..._EmbeddingDenseGradV2_EmbeddingDenseGradV2``, ``..._Cast_Cast``):
consecutive rows whose Op Name carries the same ``aclnn<Api>`` prefix form one group (calls of
one API back to back — an op profiled in a loop — are cut into their calls where the rows'
names repeat); the group's NPU time is the sum of its rows' durations, and the row whose OP
Type is one of :data:`OP_TYPES` names the fastgrad case (its input shapes and dtypes give the
case's shape).  A call of the seven ops that cannot be timed is listed as not mapped, with the
reason; groups of other op types are summed by type in one line (all of them in the JSON
report's ``unmapped``, ``family`` false).

The CPU side runs the fastgrad op of the matching :mod:`fastgrad.benchmarks.cases` case (the
cpu backend, the case's inputs at the profile's shapes) ``repeat`` times; the work (``flops`` of
the GEMMs, or the minimum ``bytes`` read and written) is the case's, so the GFLOP/s or GB/s of
both sides are computed from the same count.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the benchmark cases are imported on use
    from ..benchmarks.cases import Case

SCHEMA = "fastgrad-profile-compare/1"

#: Device op types (OP Type / Type column) → fastgrad op.
OP_TYPES = {
    "FusedLinearOnlineMaxSum": "fused_linear_online_max_sum",
    "FusedCrossEntropyLossWithMaxSum": "fused_cross_entropy_loss_with_max_sum",
    "FusedLinearCrossEntropyLossGrad": "fused_linear_cross_entropy_loss_grad",
    "CrossEntropyLossGrad": "cross_entropy_loss_grad",
    "ScaledMaskedSoftmaxGradV2": "scaled_masked_softmax_backward",
    "ScaledMaskedSoftmaxGrad": "scaled_masked_softmax_backward",
    "SmoothL1LossGradV2": "smooth_l1_loss_backward",
    "SmoothL1LossGrad": "smooth_l1_loss_backward",
    "EmbeddingDenseGrad": "embedding_dense_backward",
    "EmbeddingDenseGradV2": "embedding_dense_backward",
}

#: GE dtype names (msprof's number_mapping.cpp) → fastgrad's dtype names.
GE_DTYPES = {
    "FLOAT": "float32",
    "DT_FLOAT": "float32",
    "FLOAT16": "float16",
    "DT_FLOAT16": "float16",
    "DT_BF16": "bfloat16",
    "BF16": "bfloat16",
    "INT64": "int64",
    "INT32": "int32",
    "UINT8": "uint8",
    "BOOL": "bool",
    "INT8": "int8",
}

#: The two readers' column names → one vocabulary.
_COLUMNS = {
    "op_summary": {
        "name": "Op Name",
        "type": "OP Type",
        "core": "Task Type",
        "start": "Task Start Time(us)",
        "duration": "Task Duration(us)",
        "blocks": "Block Num",
    },
    "kernel_details": {
        "name": "Name",
        "type": "Type",
        "core": "Accelerator Core",
        "start": "Start Time(us)",
        "duration": "Duration(us)",
        "blocks": "Block Num",
    },
}
_SHAPE_COLUMNS = ("Input Shapes", "Input Data Types", "Output Shapes", "Output Data Types")


class ProfileError(ValueError):
    """The file is not a usable profile (the CLI reports it in one line, exit status 2)."""


@dataclass
class KernelRow:
    line: int
    name: str
    type: str
    core: str
    start_us: float | None
    duration_us: float
    blocks: str
    input_shapes: list
    input_dtypes: list
    output_shapes: list
    output_dtypes: list
    step: str = ""
    device: str = ""
    shape_error: str = ""  # why this row's shape cells are not usable ("" when they are)


@dataclass
class Profile:
    path: str
    kind: str  # "op_summary" | "kernel_details"
    level: int  # 0 (no shapes) or 1 (shapes)
    rows: list


@dataclass
class Group:
    """One aclnn call: its rows, the main row (a known op type) if any."""

    api: str
    rows: list
    main: KernelRow | None = None

    @property
    def duration_us(self) -> float:
        return sum(r.duration_us for r in self.rows)


@dataclass
class Match:
    """A group mapped to a fastgrad case."""

    group: Group
    op: str
    mode: str
    dtype: str
    shape: dict
    case: object = None
    notes: list = field(default_factory=list)


def _shape_list(text: str) -> list:
    """``"4096,896;18992,896;4096"`` → ``[[4096, 896], [18992, 896], [4096]]`` ('' → [] scalar).

    :class:`ValueError` for a dimension that is not an integer >= 0 (``-1``, ``N/A`` inside)."""
    text = (text or "").strip().strip('"')
    if not text or text.upper() == "N/A":
        return []
    out = []
    for part in text.split(";"):
        part = part.strip()
        dims = [d.strip() for d in part.split(",") if d.strip()] if part else []
        if not all(d.isdigit() for d in dims):
            raise ValueError(f"shape {part!r}: dimensions are integers >= 0")
        out.append([int(d) for d in dims])
    return out


def _dtype_list(text: str) -> list:
    text = (text or "").strip().strip('"')
    if not text or text.upper() == "N/A":
        return []
    return [GE_DTYPES.get(p.strip().upper(), p.strip()) for p in text.split(";")]


def _float(v: str) -> float | None:
    try:
        return float(str(v).strip())
    except ValueError:
        return None


def read_profile(path: str) -> Profile:
    """Read ``op_summary_*.csv`` or ``kernel_details.csv`` (the kind is told by the header)."""
    if not os.path.isfile(path):
        raise ProfileError(f"{path}: no such file")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
            reader.fieldnames = header
            raw = list(reader)
    except UnicodeDecodeError as e:  # msprof and torch_npu write UTF-8; a re-save in a local code page is not
        raise ProfileError(f"{path}: not UTF-8 text (byte {e.start}): save it as UTF-8 CSV") from None
    except csv.Error as e:
        raise ProfileError(f"{path}: not a readable CSV ({e})") from None
    if "OP Type" in header and "Task Duration(us)" in header:
        kind = "op_summary"
    elif "Type" in header and "Duration(us)" in header and "Name" in header:
        kind = "kernel_details"
    else:
        raise ProfileError(
            f"{path}: neither msprof's op_summary (OP Type, Task Duration(us), ...) nor torch_npu's "
            f"kernel_details.csv (Name, Type, Duration(us), ...); header: {', '.join(header[:8])}"
        )
    if not raw:
        raise ProfileError(f"{path}: a header and no rows: no kernel ran while it was collected")
    cols = _COLUMNS[kind]
    has_shapes = "Input Shapes" in header and any((r.get("Input Shapes") or "").strip() not in ("", "N/A") for r in raw)
    rows = []
    for i, r in enumerate(raw, start=2):
        dur = _float(r.get(cols["duration"], ""))
        if dur is None:
            continue  # msprof writes N/A for some HCCL rows
        shapes, bad = [], ""
        try:
            shapes = [_shape_list(r.get(c, "")) for c in ("Input Shapes", "Output Shapes")]
        except ValueError as e:
            shapes, bad = [[], []], f"{e} in its Input/Output Shapes"
        rows.append(
            KernelRow(
                i,
                (r.get(cols["name"]) or "").strip(),
                (r.get(cols["type"]) or "").strip(),
                (r.get(cols["core"]) or "").strip(),
                _float(r.get(cols["start"], "")),
                dur,
                (r.get(cols["blocks"]) or "").strip(),
                shapes[0],
                _dtype_list(r.get("Input Data Types", "")),
                shapes[1],
                _dtype_list(r.get("Output Data Types", "")),
                (r.get("Step Id") or "").strip(),
                (r.get("Device_id") or "").strip(),
                bad,
            )
        )
    return Profile(path, kind, 1 if has_shapes else 0, rows)


def check_level(prof: Profile) -> Profile:
    """``prof``, or :class:`ProfileError` for a level-0 file (no shapes: nothing is guessed)."""
    if prof.level == 0:
        raise ProfileError(
            f"{prof.path}: a level-0 profile (no Input Shapes): the shapes that ran are unknown; collect with "
            "`msprof --task-time=l1` or torch_npu's profiler_level=Level1"
        )
    return prof


_ACLNN = re.compile(r"^(aclnn[A-Za-z0-9]+)_")


def group_rows(rows: list) -> list:
    """Consecutive rows of one aclnn call (same ``aclnn<Api>_`` prefix, step and device) → :class:`Group`\\ s.

    msprof writes every device of a run into one op_summary, sorted by device then start time,
    so the last call of device 0 and the first of device 1 are neighbours: never one group.
    Calls of one API back to back (an op profiled in a loop) have the same names and no call id:
    a run of them is cut into calls by :func:`_split_calls`."""
    runs: list = []
    for r in rows:
        m = _ACLNN.match(r.name)
        api = m.group(1) if m else r.name
        last = runs[-1].rows[-1] if runs else None
        if m and last is not None and runs[-1].api == api and (last.step, last.device) == (r.step, r.device):
            runs[-1].rows.append(r)
        else:
            runs.append(Group(api, [r]))
    groups = [g for run in runs for g in _split_calls(run)]
    for g in groups:
        for r in g.rows:
            if r.type in OP_TYPES:
                g.main = r
                break
    return groups


def _split_calls(run: Group) -> list:
    """A run of one API's rows cut into its calls.  Each call launches the same kernels in the
    same order, so the rows' names repeat with the call's length: the shortest period that
    tiles the run is one call (``Cast, Sort, EmbeddingDenseGradV2, Cast`` twice: two calls of
    four rows).  When no period tiles it (a call whose launch differs), a call of the seven
    ops ends after each of its kernels' rows: each main kernel row ends a call, and the rows after
    the last one belong to the last call."""
    rows = run.rows
    names = [r.name for r in rows]
    n = len(rows)
    for p in range(1, n // 2 + 1):
        if n % p == 0 and names == names[:p] * (n // p):
            return [Group(run.api, rows[i : i + p]) for i in range(0, n, p)]
    mains = [i for i, r in enumerate(rows) if r.type in OP_TYPES]
    if len(mains) <= 1:
        return [run]
    cuts = [0] + [i + 1 for i in mains[:-1]] + [n]
    return [Group(run.api, rows[a:b]) for a, b in zip(cuts, cuts[1:])]


def _numel(shape) -> int:
    return int(math.prod(shape)) if shape else 1


def match_group(g: Group) -> Match | str:
    """The fastgrad case of a group, or the reason there is none (a string).

    A group that opens with a ``Cast`` of a 16-bit tensor (the aclnn call widened its input,
    ran the kernel in fp32 and cast back: embedding backward in bf16) is timed in that dtype.
    """
    m = _match_main(g)
    if isinstance(m, Match):
        lead = g.rows[0]
        if lead is not g.main and lead.type == "Cast" and lead.input_dtypes[:1] in (["bfloat16"], ["float16"]):
            if m.dtype != lead.input_dtypes[0]:
                m.notes.append(f"dtype {lead.input_dtypes[0]} from the leading Cast (kernel ran in {m.dtype})")
                m.dtype = lead.input_dtypes[0]
    return m


def _match_main(g: Group) -> Match | str:
    r = g.main
    if r is None:
        types = ", ".join(sorted({x.type for x in g.rows}))
        return f"op type {types}: not one of the seven ops"
    op = OP_TYPES[r.type]
    sh, dt = r.input_shapes, r.input_dtypes
    if r.shape_error:
        return f"{r.type}: {r.shape_error}"
    if not sh:
        return f"{r.type}: no Input Shapes on this row"

    def dtype_of(i):
        return dt[i] if i < len(dt) else ""

    if op == "fused_linear_online_max_sum":
        if len(sh) < 2 or len(sh[0]) != 2 or len(sh[1]) != 2:
            return f"{r.type}: expected input [BT,H], weight [V,H]; got {sh}"
        (BT, H), (V, _) = sh[0], sh[1]
        return Match(g, op, "forward", dtype_of(0), {"BT": BT, "H": H, "V": V})
    if op == "fused_linear_cross_entropy_loss_grad":
        if len(sh) < 3 or len(sh[1]) != 2 or len(sh[2]) != 2:
            return f"{r.type}: expected grad [BT], input [BT,H], weight [V,H], ...; got {sh}"
        (BT, H), (V, _) = sh[1], sh[2]
        hp = any(s == [BT, V] for s in sh[3:])
        return Match(g, op, "high-performance" if hp else "memory-saving", dtype_of(1), {"BT": BT, "H": H, "V": V})
    if op == "fused_cross_entropy_loss_with_max_sum":
        two_d = [s for s in sh if len(s) == 2]
        if not two_d:
            return f"{r.type}: no vocab_parallel_logits input (loss only): fastgrad's case times the softmax output"
        BT, V = two_d[-1]
        return Match(g, op, "softmax", dtype_of(sh.index(two_d[-1])), {"BT": BT, "V": V})
    if op == "cross_entropy_loss_grad":
        if len(sh) < 2 or len(sh[1]) != 2:
            return f"{r.type}: expected grad_loss, log_prob [N,C], target [N]; got {sh}"
        if sh[0] not in ([], [1]):
            return f"{r.type}: grad_loss of shape {sh[0]} (reduction 'none'): fastgrad's case is reduction 'mean'"
        N, C = sh[1]
        return Match(g, op, "mean", dtype_of(1), {"N": N, "C": C})
    if op == "scaled_masked_softmax_backward":
        if len(sh[0]) != 4:
            return f"{r.type}: expected y_grad [B,N,S1,S2]; got {sh}"
        B, N, S1, S2 = sh[0]
        return Match(g, op, "broadcast-mask", dtype_of(0), {"B": B, "N": N, "S1": S1, "S2": S2})
    if op == "smooth_l1_loss_backward":
        return Match(g, op, "mean", dtype_of(0), {"n": _numel(sh[0])})
    if op == "embedding_dense_backward":
        if not r.output_shapes or len(r.output_shapes[0]) != 2:
            return f"{r.type}: num_weights is read from the Output Shapes [num_weights, D]; none on this row"
        W, D = r.output_shapes[0]
        return Match(g, op, "dense", dtype_of(0), {"tokens": _numel(sh[0]) // max(D, 1), "num_weights": W, "D": D})
    return f"{r.type}: no fastgrad case"  # pragma: no cover - OP_TYPES and the branches agree


def make_case(m: Match) -> Case:
    """The :mod:`fastgrad.benchmarks.cases` case of a match (the profile's shape and dtype)."""
    from ..benchmarks import cases as C

    s, dt = m.shape, m.dtype
    if dt not in ("bfloat16", "float16", "float32"):
        raise ProfileError(f"dtype {dt!r}: fastgrad's cases run bfloat16, float16 or float32")
    if m.op in ("fused_linear_online_max_sum", "fused_linear_cross_entropy_loss_grad"):
        cases = C._flce_cases(s["BT"], s["H"], s["V"], dt, False)
        want = {"forward": "forward", "memory-saving": "memory-saving", "high-performance": "high-performance"}[m.mode]
        return next(c for c in cases if c.mode == want and c.op == m.op)
    if m.op == "fused_cross_entropy_loss_with_max_sum":
        return C._fce_case(s["BT"], s["V"], dt)
    if m.op == "cross_entropy_loss_grad":
        return C._ce_case(s["N"], s["C"], dt)
    if m.op == "scaled_masked_softmax_backward":
        return C._softmax_case(s["B"], s["N"], s["S1"], s["S2"], dt)
    if m.op == "smooth_l1_loss_backward":
        return C._smooth_l1_case(s["n"], dt)
    if m.op == "embedding_dense_backward":
        return C._embedding_case(s["tokens"], s["num_weights"], s["D"], dt)
    raise ProfileError(f"no case for {m.op}")  # pragma: no cover


def time_cpu(case: Case, repeat: int, budget_s: float) -> dict:
    """Median time of the case's fastgrad runner on the cpu backend (one warm-up call)."""
    import fastgrad as fg

    from ..benchmarks.timing import time_fn

    runner = next(r for r in case.runners if r.kind == "fastgrad" and not r.mode)
    inputs = case.build()
    fn = runner.make(inputs)

    def run():
        with fg.use_backend("cpu"):
            return fn()

    t = time_fn(run, repeat=repeat, budget_s=budget_s)
    return {"time_median_s": t.median_s, "time_p20_s": t.p20_s, "time_p80_s": t.p80_s, "reps": t.reps}


def _rate(work: float | None, seconds: float | None) -> float | None:
    if not work or not seconds:
        return None
    return work / seconds / 1e9


def compare_profile(
    path: str, repeat: int = 3, budget_s: float = 10.0, progress: Callable[[dict], object] | None = None
) -> dict:
    """The side-by-side report of one profile (schema :data:`SCHEMA`, see docs/ascend_workflow.md)."""
    from .. import __version__
    from ..benchmarks.machine import machine_info

    prof = check_level(read_profile(path))
    rows, unmapped = [], []
    for g in group_rows(prof.rows):
        m = match_group(g)
        if isinstance(m, str):
            unmapped.append(
                {
                    "line": g.rows[0].line,
                    "name": g.rows[0].name,
                    "types": sorted({r.type for r in g.rows}),
                    "npu_us": g.duration_us,
                    "reason": m,
                    "family": g.main is not None,  # a call of the seven ops (else another op's rows)
                }
            )
            continue
        try:
            case = make_case(m)
        except ProfileError as e:
            unmapped.append(
                {"line": g.rows[0].line, "name": g.rows[0].name, "types": [g.main.type], "npu_us": g.duration_us,
                 "reason": str(e), "family": True}
            )  # fmt: skip
            continue
        cpu = time_cpu(case, repeat, budget_s)
        main = g.main
        assert main is not None  # (a Match has a main row)
        kernel_us = main.duration_us
        bound = case.bound
        work = case.flops if bound == "gemm" else case.bytes
        unit = "GFLOP/s" if bound == "gemm" else "GB/s"
        row = {
            "line": main.line,
            "name": main.name,
            "op_type": main.type,
            "api": g.api,
            "group_rows": [{"line": r.line, "type": r.type, "npu_us": r.duration_us} for r in g.rows],
            "op": m.op,
            "case": case.id,
            "mode": m.mode,
            "dtype": m.dtype,
            "shape": m.shape,
            "input_shapes": main.input_shapes,
            "input_dtypes": main.input_dtypes,
            "npu_kernel_us": kernel_us,
            "npu_us": g.duration_us,
            "cpu_ms": cpu["time_median_s"] * 1e3,
            "cpu": cpu,
            "work": work,
            "unit": unit,
            "npu_rate": _rate(work, g.duration_us * 1e-6),
            "cpu_rate": _rate(work, cpu["time_median_s"]),
            "cpu_over_npu": cpu["time_median_s"] / (g.duration_us * 1e-6) if g.duration_us else None,
            "step": main.step,
            "notes": m.notes,
        }
        rows.append(row)
        if progress:
            progress(row)
    return {
        "schema": SCHEMA,
        "fastgrad": __version__,
        "source": {"path": os.path.abspath(path), "kind": prof.kind, "level": prof.level, "n_rows": len(prof.rows)},
        "machine": machine_info(),
        "repeat": repeat,
        "rows": rows,
        "unmapped": unmapped,
    }


def _g(x, fmt="{:.3g}") -> str:
    return "-" if x is None else fmt.format(x)


def _table_rows(report: dict) -> list:
    out = []
    for r in report["rows"]:
        out.append(
            [
                str(r["line"]),
                r["op_type"],
                r["op"],
                r["dtype"],
                ",".join(f"{k}={v}" for k, v in r["shape"].items()),
                _g(r["npu_us"], "{:.1f}"),
                _g(r["cpu_ms"], "{:.3f}"),
                f"{_g(r['npu_rate'])} {r['unit']}",
                f"{_g(r['cpu_rate'])} {r['unit']}",
                _g(r["cpu_over_npu"], "{:.1f}x"),
            ]
        )
    return out


def _split_unmapped(unmapped: list[dict]) -> tuple[list[dict], list[dict]]:
    """The not-mapped calls of the seven ops (listed one by one) and the other ops' groups
    (summed by op type: a training step's profile holds thousands).  A report written before
    ``family`` was recorded lists every group."""
    family = [u for u in unmapped if u.get("family", True)]
    return family, [u for u in unmapped if not u.get("family", True)]


def _others_line(others: list[dict], top: int = 6) -> str:
    """``other ops (not among the seven): N groups, T us — MatMulV2 x400 (1234.5 us), ...``."""
    by_type: dict[str, list[float]] = {}
    for u in others:
        key = "+".join(u["types"])
        by_type.setdefault(key, []).append(float(u["npu_us"] or 0.0))
    ranked = sorted(by_type.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    parts = [f"{k} x{len(v)} ({sum(v):.1f} us)" for k, v in ranked[:top]]
    if len(ranked) > top:
        parts.append(f"{len(ranked) - top} more types")
    total = sum(sum(v) for v in by_type.values())
    return (
        f"other ops (not among the seven, not timed): {len(others)} groups, {total:.1f} us — "
        + ", ".join(parts)
        + " (each in the JSON report's unmapped[])"
    )


_HEAD = ("line", "OP Type", "fastgrad op", "dtype", "shape", "NPU us", "CPU ms", "NPU rate", "CPU rate", "CPU/NPU")


def format_table(report: dict) -> str:
    data = _table_rows(report)
    w = [max([len(h)] + [len(d[i]) for d in data]) for i, h in enumerate(_HEAD)]
    src = report["source"]
    cpu = report["machine"].get("cpu", "")
    lines = [f"{src['kind']} {src['path']} (level {src['level']}, {src['n_rows']} rows); CPU: {cpu}"]
    lines.append("  ".join(h.ljust(x) for h, x in zip(_HEAD, w)))
    lines += ["  ".join(v.ljust(x) for v, x in zip(d, w)) for d in data]
    family, others = _split_unmapped(report["unmapped"])
    if family:
        lines.append(f"not mapped ({len(family)}):")
        lines += [f"  line {u['line']} {u['name']} ({', '.join(u['types'])}, {u['npu_us']:.1f} us): {u['reason']}"
                  for u in family]  # fmt: skip
    if others:
        lines.append(_others_line(others))
    lines.append("NPU us: the aclnn call's rows summed (kernel rows of one Op Name prefix); rates from the case's work")
    return "\n".join(lines)


def format_markdown(report: dict) -> str:
    lines = ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    lines += ["| " + " | ".join(d) + " |" for d in _table_rows(report)]
    family, others = _split_unmapped(report["unmapped"])
    if family:
        lines += ["", "Not mapped:", ""]
        lines += [f"- line {u['line']} `{u['name']}` ({', '.join(u['types'])}): {u['reason']}" for u in family]
    if others:
        lines += ["", _others_line(others)]
    return "\n".join(lines) + "\n"


def plot(report: dict, outdir: str) -> list:
    """One PNG: NPU and CPU time per mapped row (log scale); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = report["rows"]
    if not rows:
        return []
    os.makedirs(outdir, exist_ok=True)
    labels = [f"{r['op_type']}\n{r['dtype']} " + ",".join(map(str, r["shape"].values())) for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5))
    ax.bar([i - 0.2 for i in x], [r["npu_us"] for r in rows], 0.4, label="NPU (profile)")
    ax.bar([i + 0.2 for i in x], [r["cpu_ms"] * 1e3 for r in rows], 0.4, label="CPU (fastgrad)")
    ax.set_yscale("log")
    ax.set_ylabel("time (us)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.legend()
    ax.set_title(os.path.basename(report["source"]["path"]))
    fig.tight_layout()
    path = os.path.join(outdir, "profile_compare.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def save(report: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    return path


__all__ = [
    "SCHEMA",
    "OP_TYPES",
    "GE_DTYPES",
    "ProfileError",
    "read_profile",
    "check_level",
    "group_rows",
    "match_group",
    "make_case",
    "compare_profile",
    "format_table",
    "format_markdown",
    "plot",
    "save",
]
