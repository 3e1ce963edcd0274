"""Report I/O and rendering: JSON (schema ``fastgrad-bench/1``), text table, Markdown table,
side-by-side comparison with another machine's JSON, and one PNG per op (matplotlib)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

#: the report's schema (``docs/benchmarks.md``)
SCHEMA = "fastgrad-bench/1"


def save(report: dict, path: str) -> str:
    """Write ``report`` to ``path`` whole or not at all (a temporary file renamed over it): a run
    that saves after every case and is interrupted leaves the last complete save."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, default=json_default)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def save_text(text: str, path: str) -> str:
    """Write ``text`` to ``path`` whole or not at all (as :func:`save`)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def json_default(o: object) -> object:
    """``json`` fallback: NumPy scalars as Python numbers, anything else as its ``str``."""
    import numpy as np

    return o.item() if isinstance(o, np.generic) else str(o)


def load(path: str) -> dict:
    """Read a report; raises ValueError when it is not a fastgrad bench report."""
    with open(path) as f:
        rep = json.load(f)
    if (
        not isinstance(rep, dict)
        or not str(rep.get("schema", "")).startswith("fastgrad-bench/")
        or not isinstance(rep.get("rows"), list)
    ):
        raise ValueError(f"{path}: not a fastgrad bench report (schema {SCHEMA!r} expected)")
    return rep


# ----------------------------------------------------------------------------- tables ----


def _ms(t):
    return "-" if t is None else (f"{t * 1e3:.3g}" if t * 1e3 < 100 else f"{t * 1e3:.0f}")


def _num(x, fmt="{:.3g}"):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return fmt.format(x)


#: A row above this fraction of its bound is flagged: a bound-limited op cannot beat its bound,
#: so such a figure is timing noise, cache residency or a bound measured low.
NOISE_FRACTION = 1.0
NOISE_MARK = "*"
NOISE_NOTE = (
    "* above 100 % of the bound, which is not physically possible for an op limited by it: "
    "timing noise, data resident in cache, or a bound measured low. Read it as noise."
)


def _pct(x):
    if x is None:
        return "-"
    return f"{100 * x:.0f}%" + (NOISE_MARK if x > NOISE_FRACTION else "")


def _any_noise(rows) -> bool:
    return any((r.get("fraction_of_bound") or 0) > NOISE_FRACTION for r in rows if r.get("status") == "ok")


def _label(r):
    return (
        r["backend"]
        if r["kind"] != "fastgrad"
        else (f"fastgrad:{r['backend']}" + (f" ({r['variant']})" if r.get("variant") else ""))
    )


def relative_words(r: dict[str, Any]) -> str:
    """The row's time against fastgrad:cpu, worded as a speed-up or a slow-down.

    ``fastgrad_speedup`` is ``t_row / t_fastgrad:cpu``: for a baseline row (PyTorch) that is how
    many times faster fastgrad is; for another fastgrad row (``out=``, another backend, or another
    configuration such as ``fastgrad-onednn``) how many times slower that row is than fastgrad:cpu.
    """
    s = r.get("fastgrad_speedup")
    if s is None or not (s > 0) or r["kind"] == "fastgrad" and not r.get("variant") and r["backend"] == "cpu":
        return "-"
    if r["kind"] != "fastgrad" and str(r.get("backend", "")).startswith("fastgrad-"):
        # another fastgrad configuration (fastgrad-onednn, fastgrad-fast, ...): the row itself
        # against the default, not "fastgrad N x slower" (which reads as the default's slow-down)
        return f"{s:.2f}x slower" if s >= 1 else f"{1 / s:.2f}x faster"
    if r["kind"] != "fastgrad":
        return f"fastgrad {s:.2f}x faster" if s >= 1 else f"fastgrad {1 / s:.2f}x slower"
    return f"{s:.2f}x slower" if s >= 1 else f"{1 / s:.2f}x faster"


_speedup = relative_words


def _groups(rows):
    out: dict = {}
    order: list = []
    for r in rows:
        key = (r["case"], r["threads"])
        if key not in out:
            out[key] = []
            order.append(key)
        out[key].append(r)
    return [(k, out[k]) for k in order]


COLUMNS = ("backend", "median ms", "p20-p80 ms", "GFLOP/s", "GB/s", "of bound", "vs fastgrad:cpu", "peak MiB")


def _cells(r):
    if r["status"] != "ok":
        return [_label(r), r["status"], r.get("note", "")[:60], "", "", "", "", ""]
    p = f"{_ms(r['time_p20_s'])}-{_ms(r['time_p80_s'])}" if r.get("reps") else "(derived)"
    peak = (
        "-"
        if r.get("peak_rss_mib") is None
        else (
            f"{r['peak_rss_mib']:.0f}"
            + (f" (+{r['peak_rss_delta_mib']:.0f})" if r.get("peak_rss_delta_mib") is not None else "")
        )
    )
    return [
        _label(r),
        _ms(r["time_median_s"]),
        p,
        _num(r.get("gflops")),
        _num(r.get("gbps")),
        _pct(r.get("fraction_of_bound")),
        _speedup(r),
        peak,
    ]


def _loss_err(r) -> str:
    """The train-step rows' loss error against float64 (absolute, nats), or ``-``."""
    e = r.get("loss_err_fp64")
    return "-" if e is None else f"{e:.2e}"


def _has_loss_err(rows) -> bool:
    return any(r.get("loss_err_fp64") is not None for r in rows)


def format_table(report: dict) -> str:
    """Plain-text table, one block per case and thread count."""
    lines = [
        f"fastgrad bench — {report.get('machine_id', '?')}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items() if v),
    ]
    for n, b in report.get("bounds", {}).items():
        lines.append(f"copy bandwidth ({n} threads): {b['copy_gbps']:.1f} GB/s")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    widths = [26, 10, 16, 9, 8, 9, 24, 14]
    for (_case, n), rows in _groups(report["rows"]):
        r0 = rows[0]
        lines.append("")
        lines.append(
            f"{r0['op']} [{r0['mode'].split('+')[0]}] {r0['dtype']} {r0['shape_str']}  threads={n}  bound={r0['bound']}"
        )
        err = _has_loss_err(rows)
        lines.append("  " + "".join(c.ljust(w) for c, w in zip(COLUMNS, widths)) + ("loss err vs fp64" if err else ""))
        for r in rows:
            extra = _loss_err(r) if err and r["status"] == "ok" else ""
            lines.append("  " + "".join(str(c).ljust(w) for c, w in zip(_cells(r), widths)) + extra)
    if _any_noise(report["rows"]):
        lines += ["", NOISE_NOTE]
    return "\n".join(lines)


def partial_note(report: dict) -> str:
    """ "Partial: ..." for a report written before its run finished (``settings.complete`` False), else ""."""
    st = report.get("settings") or {}
    if st.get("complete", True):
        return ""
    return (
        f"Partial: {st.get('cases_done', '?')} of {st.get('cases_total', '?')} cases "
        "(written as the run went; it was interrupted or is still running)"
    )


def format_markdown(report: dict) -> str:
    """A Markdown table of every row (for README / bench/results)."""
    head = [
        "op",
        "shape",
        "dtype",
        "mode",
        "backend",
        "threads",
        "median ms",
        "GFLOP/s",
        "GB/s",
        "% of bound",
        "vs fastgrad:cpu",
        "peak RSS MiB",
    ]
    err = _has_loss_err(report["rows"])
    if err:
        head.append("loss err vs fp64")
    out = [
        f"Machine: {report.get('machine_id', '?')}  ",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items() if v) + "  ",
    ]
    for n, b in report.get("bounds", {}).items():
        out.append(f"Copy bandwidth ({n} threads): {b['copy_gbps']:.1f} GB/s  ")
    partial = partial_note(report)
    if partial:
        out.append(partial + "  ")
    out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        if r["status"] != "ok":
            cells = [
                r["op"],
                r["shape_str"],
                r["dtype"],
                r["mode"],
                _label(r),
                str(r["threads"]),
                r["status"] + ": " + r.get("note", "")[:50],
                "",
                "",
                "",
                "",
                "",
            ]
        else:
            c = _cells(r)
            cells = [
                r["op"],
                r["shape_str"],
                r["dtype"],
                r["mode"],
                c[0],
                str(r["threads"]),
                c[1],
                c[3],
                c[4],
                c[5],
                c[6],
                c[7],
            ]
        if err:
            cells.append(_loss_err(r) if r["status"] == "ok" else "")
        out.append("| " + " | ".join(x.replace("|", "/") for x in cells) + " |")
    if _any_noise(report["rows"]):
        out += ["", "\\" + NOISE_NOTE]
    return "\n".join(out) + "\n"


def format_compare(this: dict, other: dict, this_name: str | None = None, other_name: str | None = None) -> str:
    """Both reports side by side, per case (op, shape, dtype, mode): each row's median time and
    its ratio to this report's fastgrad:cpu row of the case, worded as faster / slower.

    ``this_name`` / ``other_name`` name the two sides (the report files, or "this run"); the
    machine id of each follows, so two reports from the same machine are still told apart."""

    def key(r):
        return (r["op"], r["shape_str"], r["dtype"], r["mode"].split("+")[0])

    a_id = f"{this.get('machine_id', '?')}, from {this_name or 'this run'}"
    b_id = f"{other.get('machine_id', '?')}, from {other_name or 'another report'}"
    groups: dict = {}
    order: list = []
    for tag, rep in (("A", this), ("B", other)):
        for r in rep["rows"]:
            k = key(r)
            if k not in groups:
                groups[k] = []
                order.append(k)
            groups[k].append((tag, r))
    lines = [f"A = {a_id}", f"B = {b_id}", ""]
    for k in order:
        items = groups[k]
        ref = next(
            (
                r
                for t, r in items
                if t == "A"
                and r["kind"] == "fastgrad"
                and r["backend"] == "cpu"
                and not r.get("variant")
                and r.get("time_median_s")
            ),
            None,
        )
        lines.append(f"{k[0]} [{k[3]}] {k[2]} {k[1]}")
        for tag, r in items:
            t = r.get("time_median_s")
            ratio = ""
            if t and ref and r is not ref:
                q = t / ref["time_median_s"]
                ratio = f"{q:.3g}x slower than A:fastgrad:cpu" if q >= 1 else f"{1 / q:.3g}x faster than A:fastgrad:cpu"
            status = "" if r["status"] == "ok" else f"{r['status']}: {r.get('note', '')[:50]}"
            lines.append(
                f"  {tag}  {_label(r) + ' mode=' + r['mode']:<48} thr={r['threads']:<3} "
                f"{_ms(t):>9} ms  {_pct(r.get('fraction_of_bound')):>6} of bound  {ratio}{status}"
            )
        lines.append("")
    if _any_noise(this["rows"]) or _any_noise(other["rows"]):
        lines.append(NOISE_NOTE)
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots ----


def _tick(r: dict) -> str:
    """A case's x label, wrapped to ~16 characters a line so that neighbouring labels never overlap
    (a case id's shape and mode run to 60 characters)."""
    import textwrap

    parts = [r["dtype"], r["shape_str"].replace(",", ", "), r["mode"].split("+")[0], f"thr={r['threads']}"]
    return "\n".join(line for p in parts for line in textwrap.wrap(p, 16))


def plot(report: dict, outdir: str) -> list:
    """One PNG per op: achieved throughput of each row beside the bound. Needs matplotlib
    (the ``plot`` extra); returns the files written ([] with a note when it is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return []
    os.makedirs(outdir, exist_ok=True)
    files = []
    by_op: dict = {}
    for r in report["rows"]:
        if r["status"] == "ok" and r.get("time_median_s"):
            by_op.setdefault(r["op"], []).append(r)
    for op, rows in by_op.items():
        gemm = rows[0]["bound"] == "gemm"
        metric, unit = ("gflops", "GFLOP/s") if gemm else ("gbps", "GB/s")
        cases = []
        for r in rows:
            c = _tick(r)
            if c not in cases:
                cases.append(c)
        labels = []
        for r in rows:
            lab = _label(r) if r["backend"] != "bound" else "bound"
            if r.get("variant") and r["kind"] == "fastgrad":
                lab = _label(r)
            if lab not in labels:
                labels.append(lab)
        fig, ax = plt.subplots(figsize=(max(6, 1.9 * len(cases) + 2), 5))
        width = 0.8 / max(1, len(labels))
        for j, lab in enumerate(labels):
            xs, ys = [], []
            for r in rows:
                lr = _label(r) if r["backend"] != "bound" else "bound"
                if lr != lab or r.get(metric) is None:
                    continue
                c = _tick(r)
                xs.append(cases.index(c) + (j - (len(labels) - 1) / 2) * width)
                ys.append(r[metric])
            if xs:
                kw: dict[str, Any] = (
                    {"hatch": "//", "edgecolor": "black", "facecolor": "none"} if lab == "bound" else {}
                )
                ax.bar(xs, ys, width, label=lab, **kw)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, fontsize=7)
        ax.set_ylabel(f"achieved {unit}")
        ax.set_title(
            f"{op} — achieved vs bound ({'fp32 GEMM' if gemm else 'copy bandwidth'})\n{report.get('machine_id', '')}",
            fontsize=9,
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(outdir, f"{op}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files
