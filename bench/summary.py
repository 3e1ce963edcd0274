"""Condense a `fastgrad bench` JSON report into the README's summary table (one line per case).

    python bench/summary.py bench/results/report.json > bench/results/summary.md
"""

import json
import sys


def main(path: str) -> None:
    rep = json.load(open(path))
    cases: dict[str, dict] = {}
    for r in rep["rows"]:
        if r.get("status") != "ok":
            continue
        c = cases.setdefault(r["case"], {"op": r["op"], "shape": r["shape_str"], "dtype": r["dtype"],
                                         "mode": r["mode"].replace("+out=", ""), "bound": r["bound"]})
        key = r["runner"] if r["kind"] != "fastgrad" else ("fastgrad_out" if r.get("variant") else "fastgrad")
        c[key] = r
    bw = max(b.get("copy_gbps", 0.0) for b in rep["bounds"].values())
    print(f"Measured {rep['created'][:10]} on {rep['machine_id']}, {rep['settings']['threads'][0]} threads; "
          f"bound = fp32 GEMMs through NumPy's BLAS (FLCE family) or the bytes each op must move at the "
          f"measured copy bandwidth ({bw:.1f} GB/s). "
          f"Times are medians; ratios come from the same run.\n")
    print("| op | shape, dtype, mode | fastgrad | with `out=` | of bound | PyTorch | speed-up vs PyTorch "
          "| peak RSS fastgrad / PyTorch |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cases.values():
        fg = c.get("fastgrad")
        if fg is None:
            continue
        fo = c.get("fastgrad_out")
        torch_rows = [(k, v) for k, v in c.items() if isinstance(v, dict) and v.get("kind") == "baseline"]
        t = lambda r: f"{r['time_median_s'] * 1e3:.4g} ms" if r["time_median_s"] < 1 else f"{r['time_median_s']:.3g} s"
        frac = f"{fg['fraction_of_bound']:.0%}"
        if fo:
            frac += f" / {fo['fraction_of_bound']:.0%}"
        torch_s = "; ".join(f"{k}: {t(v)}" for k, v in torch_rows) or "—"
        sp = "; ".join(f"{k}: {v['time_median_s'] / fg['time_median_s']:.2f}×"
                       + (f" ({v['time_median_s'] / fo['time_median_s']:.2f}× with out=)" if fo else "")
                       for k, v in torch_rows) or "—"
        mem = "—"
        if fg.get("peak_rss_mib"):
            others = [f"{k} {v['peak_rss_mib']:.0f}" for k, v in torch_rows if v.get("peak_rss_mib")]
            mem = f"{fg['peak_rss_mib']:.0f} MiB" + (" / " + ", ".join(others) + " MiB" if others else "")
        print(f"| {c['op']} | {c['shape']}, {c['dtype']}, {c['mode']} | {t(fg)} | {t(fo) if fo else '—'} | "
              f"{frac} | {torch_s} | {sp} | {mem} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/report.json")
