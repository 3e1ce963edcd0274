"""Write the figures the docs state from ONE benchmark report, so that they cannot disagree.

    python bench/readme_figures.py                  # rewrite the generated blocks
    python bench/readme_figures.py --check          # exit 1 when a block is out of date

Blocks (between ``<!-- figures:NAME:begin ... -->`` and ``<!-- figures:NAME:end -->``):

* ``README.md``, ``cpu``: what to expect on a CPU with AVX-512 BF16, from the report's rows of the
  Qwen2.5-0.5B head (the FLCE grad, the training step, the same step with the bf16 kernel and
  oneDNN off — the GEMMs an AVX2-only CPU runs) against PyTorch, and the machine it came from;
* ``docs/benchmarks.md``, ``report``: the whole report condensed (``bench/summary.py``).

The report is ``bench/results/report.json`` (``fastgrad bench --json bench/results/report.json
--plot bench/results --markdown bench/results/report.md`` on a quiet machine).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(ROOT, "bench", "results", "report.json")
HEAD = "BT=2048,H=896,V=151936"


def _rows(rep: dict, op: str, mode: str, dtype: str = "bfloat16") -> dict:
    """The ok rows of one case at the Qwen2.5 head, by backend (``cpu`` = fastgrad's default)."""
    return {
        r["backend"]: r
        for r in rep["rows"]
        if r.get("status") == "ok"
        and r["op"] == op
        and r["mode"] == mode
        and r["dtype"] == dtype
        and r["shape_str"] == HEAD
        and not r.get("variant")
    }


def _t(r: dict | None) -> str:
    if r is None:
        return "—"
    s = r["time_median_s"]
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def _mem(r: dict | None) -> str:
    return f"{r['peak_rss_mib']:.0f} MiB" if r and r.get("peak_rss_mib") else "—"


def _vs(fast: dict | None, other: dict | None) -> str:
    """``other``'s time in units of ``fast``'s, worded."""
    if not fast or not other:
        return ""
    x = other["time_median_s"] / fast["time_median_s"]
    return f" (fastgrad {x:.2f}× faster)" if x >= 1 else f" (fastgrad {1 / x:.2f}× slower)"


def cpu_block(rep: dict) -> str:
    m = rep["machine"]
    simd = set(m.get("simd") or [])
    cls = "AVX-512 BF16" if "avx512_bf16" in simd else ("AVX-512" if "avx512f" in simd else "AVX2")
    grad = _rows(rep, "fused_linear_cross_entropy_loss_grad", "memory-saving")
    step = _rows(rep, "linear_cross_entropy", "train-step")
    lines = [
        f"Measured {rep['created'][:10]} by `fastgrad bench` on {m['cpu']} ({cls}), "
        f"{m['cpus_physical']} cores, {rep['settings']['threads'][0]} threads; medians; peak RSS of the "
        "whole process (inputs included). At the Qwen2.5-0.5B LM head (BT 2048, H 896, V 151,936, bf16):",
        "",
        "| | fastgrad | PyTorch fp32 (eager, logits materialized) | PyTorch bf16 |",
        "|---|---|---|---|",
    ]
    if grad:
        f = grad.get("cpu")
        lines.append(
            f"| LM-head gradient (`fg.fused_linear_cross_entropy_loss_grad`, memory-saving; the core of the "
            f"`fastgrad` command) | {_t(f)}, {_mem(f)} | {_t(grad.get('torch-fp32'))}, "
            f"{_mem(grad.get('torch-fp32'))}{_vs(f, grad.get('torch-fp32'))} | {_t(grad.get('torch-bf16'))}, "
            f"{_mem(grad.get('torch-bf16'))}{_vs(f, grad.get('torch-bf16'))} |"
        )
    if step:
        f = step.get("cpu")
        lines.append(
            f"| training step (`fastgrad.torch.linear_cross_entropy`, forward + backward) | {_t(f)}, {_mem(f)} | "
            f"{_t(step.get('torch-fp32'))}, {_mem(step.get('torch-fp32'))}{_vs(f, step.get('torch-fp32'))} | "
            f"{_t(step.get('torch-bf16'))}, {_mem(step.get('torch-bf16'))}{_vs(f, step.get('torch-bf16'))} |"
        )
        fast = step.get("fastgrad-fast")
        if fast:
            lines.append(
                f"| the same step, `precision=\"fast\"` (opt-in) | {_t(fast)}, {_mem(fast)} | "
                f"{_vs(fast, step.get('torch-fp32')).strip(' ()')} | {_vs(fast, step.get('torch-bf16')).strip(' ()')} |"
            )
        blas = step.get("fastgrad-blas")
        if blas:
            lines.append(
                f"| the same step with the bf16 kernel and oneDNN off (`FASTGRAD_GEMM=blas`: the GEMMs an "
                f"AVX2-only CPU runs, on this CPU) | {_t(blas)}, {_mem(blas)} | "
                f"{_vs(blas, step.get('torch-fp32')).strip(' ()')} | "
                f"{_vs(blas, step.get('torch-bf16')).strip(' ()')} |"
            )
    return "\n".join(lines)


def report_block(rep_path: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        runpy.run_path(os.path.join(ROOT, "bench", "summary.py"), run_name="summary")["main"](rep_path)
    note = (
        "\n\nReading it: the FLCE family's bound is its fp32 GEMMs through NumPy's BLAS. Rows whose GEMMs run "
        "on fastgrad's exact-product bf16 kernel (bf16 operands on a CPU with AVX-512 BF16; fp16 operands on "
        "the fp32 AVX-512 kernel) can be faster than that bound, so their \"of bound\" figures above 100 % are "
        "real; for rows on BLAS, or the bandwidth-bound ops, a figure above 100 % is timing noise."
    )
    return buf.getvalue().rstrip() + note


def replace_block(text: str, name: str, body: str, source: str) -> str:
    pat = re.compile(rf"(<!-- figures:{name}:begin[^>]*-->\n)(.*?)(<!-- figures:{name}:end -->)", re.S)
    if not pat.search(text):
        raise SystemExit(f"no <!-- figures:{name}:begin --> ... <!-- figures:{name}:end --> block in {source}")
    return pat.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(3), text, count=1)


def generate(report: str = REPORT) -> dict[str, str]:
    """{path: the file's text with its blocks regenerated from ``report``}."""
    with open(report) as f:
        rep = json.load(f)
    out = {}
    for rel, name, body in (
        ("README.md", "cpu", cpu_block(rep)),
        (os.path.join("docs", "benchmarks.md"), "report", report_block(report)),
    ):
        path = os.path.join(ROOT, rel)
        with open(path, encoding="utf-8") as f:
            text = out.get(path, f.read())
        out[path] = replace_block(text, name, body, rel)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate the docs' figures from one bench report.")
    ap.add_argument("--report", default=REPORT, help="the report JSON (default bench/results/report.json)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a generated block is out of date")
    a = ap.parse_args(argv)
    stale = []
    for path, text in generate(a.report).items():
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                continue
        stale.append(os.path.relpath(path, ROOT))
        if not a.check:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    if a.check and stale:
        print("out of date (run python bench/readme_figures.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(stale)) if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
