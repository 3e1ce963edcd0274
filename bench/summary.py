"""Condense a `fastgrad bench` JSON report into the README's summary tables.

    python bench/summary.py bench/results/report.json > bench/results/summary.md

One line per case (the gradient-filtering sweep in a table of its own), headed by the machine:
CPU model, SIMD flags, cores, threads and the measured copy bandwidth.
"""

import json
import sys


def _t(r):
    s = r["time_median_s"]
    return f"{s * 1e3:.4g} ms" if s < 1 else f"{s:.3g} s"


def _mib(r):
    """Peak RSS of the row's process, and (+) its growth over the RSS before the row's first call."""
    d = r.get("peak_rss_delta_mib")
    return f"{r['peak_rss_mib']:.0f}" + (f" (+{d:.0f})" if d is not None else "")


def _pct(x):
    return "—" if x is None else f"{x:.1%}"


def _machine_line(rep):
    m = rep["machine"]
    bw = max(b.get("copy_gbps", 0.0) for b in rep["bounds"].values())
    simd = ", ".join(m.get("simd") or []) or "none detected"
    no512 = "" if any("avx512" in f for f in m.get("simd") or []) else "; no AVX-512"
    return (
        f"Measured {rep['created'][:10]} on {m['cpu']} (SIMD: {simd}{no512}), {m['cpus_physical']} cores, "
        f"{m['memory_gib']:.0f} GiB, {rep['settings']['threads'][0]} threads; bound = fp32 GEMMs through "
        f"NumPy's BLAS (FLCE family) or the bytes each op must move at the measured copy bandwidth "
        f"({bw:.1f} GB/s). Times are medians; ratios come from the same run."
        + (
            f" GEMM engine: {eng.get('ops')} for the NumPy-level ops, {eng.get('torch_loss', '—')} for "
            f"`fastgrad.torch.linear_cross_entropy` (`fastgrad.gemm_engine`)."
            if (eng := rep["settings"].get("gemm_engine"))
            else ""
        )
    )


def _cases(rep):
    cases: dict[str, dict] = {}
    for r in rep["rows"]:
        if r.get("status") != "ok":
            continue
        mode = r["mode"]
        if r.get("variant"):
            mode = mode.replace("+" + r["variant"], "")
        c = cases.setdefault(
            r["case"], {"op": r["op"], "shape": r["shape_str"], "dtype": r["dtype"], "mode": mode, "bound": r["bound"]}
        )
        if r["kind"] == "fastgrad":
            key = "fastgrad" + ("_" + r["variant"] if r.get("variant") else "")
        else:
            key = r["runner"]
        c[key] = r
    return cases


def _err(r):
    """`` (loss err 1.2e-06)`` for a train-step row (its loss against float64), else ``""``."""
    e = r.get("loss_err_fp64")
    return "" if e is None else f" (loss err {e:.1e})"


def _main_table(cases):
    print(
        "| op | shape, dtype, mode | fastgrad | with `out=` | fresh pages | of bound | PyTorch "
        "| speed-up vs PyTorch | peak RSS (+ over the inputs) fastgrad / PyTorch | other fastgrad rows |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in cases.values():
        fg = c.get("fastgrad")
        if fg is None or "filter_eps" in c["mode"]:
            continue
        fo, ff = c.get("fastgrad_out="), c.get("fastgrad_fresh-pages")
        base = [(k, v) for k, v in c.items() if isinstance(v, dict) and v.get("kind") == "baseline"]
        torch_rows = [(k, v) for k, v in base if not k.startswith("fastgrad")]
        # the same op in another configuration (fused, another GEMM engine): time, of bound, peak
        other = "; ".join(
            f"{k}: {_t(v)}{_err(v)}"
            + (f", {v['fraction_of_bound']:.0%} of bound" if v.get("fraction_of_bound") else "")
            + (f", {_mib(v)} MiB" if v.get("peak_rss_mib") else "")
            for k, v in base
            if k.startswith("fastgrad")
        )
        frac = f"{fg['fraction_of_bound']:.0%}" + (f" / {fo['fraction_of_bound']:.0%}" if fo else "")
        torch_s = "; ".join(f"{k}: {_t(v)}{_err(v)}" for k, v in torch_rows) or "—"
        sp = (
            "; ".join(
                f"{k}: {v['time_median_s'] / fg['time_median_s']:.2f}×"
                + (f" ({v['time_median_s'] / fo['time_median_s']:.2f}× with out=)" if fo else "")
                + (f" ({v['time_median_s'] / ff['time_median_s']:.2f}× on fresh pages)" if ff else "")
                for k, v in torch_rows
            )
            or "—"
        )
        mem = "—"
        if fg.get("peak_rss_mib"):
            others = [f"{k} {_mib(v)}" for k, v in torch_rows if v.get("peak_rss_mib")]
            mem = f"{_mib(fg)} MiB" + (" / " + ", ".join(others) + " MiB" if others else "")
        print(
            f"| {c['op']} | {c['shape']}, {c['dtype']}, {c['mode']} | {_t(fg)}{_err(fg)} | {_t(fo) if fo else '—'} | "
            f"{_t(ff) if ff else '—'} | {frac} | {torch_s} | {sp} | {mem} | {other or '—'} |"
        )


def _filter_table(cases):
    rows = [c for c in cases.values() if "filter_eps" in c["mode"] and "fastgrad" in c]
    if not rows:
        return
    print()
    print(
        "Gradient filtering (`filter_eps=\"auto\"`, bf16: 2⁻¹²) over the sparsity sweep — the filtered "
        "memory-saving grad against the same op dense and its bound, the three fp32 GEMMs; the filtered "
        "training step (`fastgrad.torch.linear_cross_entropy`, forward + backward) against the same step "
        "dense, PyTorch fp32 eager and ONE fp32 GEMM of the shape:"
    )
    print()
    print(
        "| case | shape | mean entropy | blocks skipped | filtered | dense | dense ÷ filtered "
        "| filtered ÷ bound | max error vs dense (of max) | PyTorch fp32 ÷ filtered |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in rows:
        fg, dense = c["fastgrad"], c.get("fastgrad-dense")
        label = c["mode"].split("filter_eps=auto", 1)[-1].strip()
        if c["op"] == "linear_cross_entropy":
            label = f"train step, {label}"
        bound = fg.get("bound_time_s")
        t32 = c.get("torch-fp32")
        print(
            f"| {label} | {c['shape']}, {c['dtype']} | {fg.get('mean_entropy', float('nan')):.2f} nats | "
            f"{_pct(fg.get('blocks_skipped_fraction'))} | {_t(fg)} | {_t(dense) if dense else '—'} | "
            + (f"{dense['time_median_s'] / fg['time_median_s']:.2f}×" if dense else "—")
            + " | "
            + (f"{fg['time_median_s'] / bound:.2f}" if bound else "—")
            + " | "
            + (f"{fg['max_rel_err_vs_dense']:.2g}" if "max_rel_err_vs_dense" in fg else "—")
            + " | "
            + (f"{t32['time_median_s'] / fg['time_median_s']:.2f}×" if t32 else "—")
            + " |"
        )


def main(path: str) -> None:
    rep = json.load(open(path))
    print(_machine_line(rep) + "\n")
    cases = _cases(rep)
    _main_table(cases)
    _filter_table(cases)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/report.json")
