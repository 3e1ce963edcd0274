"""Honest benchmark reports: impossible fractions flagged as noise, slow-downs worded as such,
--compare names its files."""

import json
import subprocess
import sys

from fastgrad.benchmarks import report as R


def _row(**kw):
    r = {"case": "c", "op": "op", "shape_str": "n=1", "dtype": "float32", "mode": "m", "threads": 2,
         "status": "ok", "kind": "fastgrad", "backend": "cpu", "variant": None, "bound": "bytes",
         "time_median_s": 1.0, "time_p20_s": 0.9, "time_p80_s": 1.1, "reps": 3, "gflops": None, "gbps": 1.0,
         "fraction_of_bound": 0.5, "fastgrad_speedup": 1.0, "peak_rss_mib": None}
    r.update(kw)
    return r


def _report(rows, machine="vm"):
    return {"schema": "fastgrad-bench/1", "machine_id": machine, "versions": {}, "bounds": {}, "notes": [],
            "rows": rows}


def test_slowdowns_and_speedups_are_worded():
    assert R.relative_words(_row(kind="baseline", backend="torch", fastgrad_speedup=7.85)) == "fastgrad 7.85x faster"
    assert R.relative_words(_row(kind="baseline", backend="torch", fastgrad_speedup=0.5)) == "fastgrad 2.00x slower"
    assert R.relative_words(_row(backend="reference", fastgrad_speedup=24.71)) == "24.71x slower"
    assert R.relative_words(_row(variant="out=", fastgrad_speedup=0.5)) == "2.00x faster"
    assert R.relative_words(_row()) == "-"


def test_impossible_fraction_flagged_as_noise():
    rep = _report([_row(), _row(variant="out=", fraction_of_bound=6.71, time_median_s=0.1)])
    text = R.format_table(rep)
    assert "671%*" in text and "not physically possible" in text and "noise" in text
    md = R.format_markdown(rep)
    assert "671%*" in md and "noise" in md
    assert "not physically possible" not in R.format_table(_report([_row()]))


def test_compare_names_its_files(tmp_path):
    a = _report([_row()], machine="vm")
    b = _report([_row(time_median_s=2.0)], machine="vm")
    text = R.format_compare(a, b, "a.json", "b.json")
    assert "A = vm, from a.json" in text and "B = vm, from b.json" in text
    assert "2x slower than A:fastgrad:cpu" in text
    R.save(a, str(tmp_path / "a.json"))
    R.save(b, str(tmp_path / "b.json"))
    p = subprocess.run([sys.executable, "-m", "fastgrad", "bench", "--from-json", str(tmp_path / "a.json"),
                        "--compare", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"A = vm, from {tmp_path / 'a.json'}" in p.stdout and f"B = vm, from {tmp_path / 'b.json'}" in p.stdout
    assert json.loads((tmp_path / "a.json").read_text())["machine_id"] == "vm"
