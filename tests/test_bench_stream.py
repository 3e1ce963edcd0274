"""`fastgrad bench` talks as it goes and keeps what finished: a line per row and per case (with
the time left), the JSON and Markdown written after every case, an interrupt leaving a report
marked partial; `--list` names the rows as the results do; `--headline` is the README's case."""

import json
import os
import signal
import subprocess
import sys

import pytest
from cli_helpers import fastgrad_inprocess

from fastgrad import benchmarks as B
from fastgrad.benchmarks import report as R

ARGS = ["bench", "--quick", "--ops", "ce,smooth_l1", "--no-torch", "--repeat", "1", "--budget", "0.05"]


def test_streams_a_line_per_row_and_per_case_and_writes_as_it_goes(tmp_path, monkeypatch):
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    seen = []
    real = R.save_text

    def save_text(text, path):  # what is on disk after each case
        real(text, path)
        seen.append((json.loads(js.read_text())["settings"]["cases_done"], text.count("\n| ")))

    monkeypatch.setattr(R, "save_text", save_text)
    r = fastgrad_inprocess(*ARGS, "--json", js, "--markdown", md)
    assert r.returncode == 0, r.stderr
    n = len(B.select(B.all_cases(True), ["ce", "smooth_l1"]))
    assert n >= 4
    lines = r.stderr.splitlines()
    done = [ln for ln in lines if "cases done" in ln]
    assert [ln.split("]")[0].strip() for ln in done] == [f"[{k}/{n}" for k in range(1, n + 1)]
    assert all("so far" in ln for ln in done) and all("left" in ln for ln in done[:-1])
    assert sum("fastgrad:cpu  thr=" in ln for ln in lines) >= n
    # written after every case, the rows growing; the last write is the complete report
    assert [k for k, _ in seen] == list(range(1, n + 1)) and [m for _, m in seen] == sorted(m for _, m in seen)
    rep = B.load(str(js))
    assert rep["settings"]["complete"] is True and rep["settings"]["cases_done"] == n
    assert "Partial" not in md.read_text()


def test_an_interrupt_keeps_the_cases_that_finished(tmp_path, monkeypatch):
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    real, calls = R.save_text, []

    def save_text(text, path):
        real(text, path)
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(R, "save_text", save_text)
    r = fastgrad_inprocess(*ARGS, "--json", js, "--markdown", md)
    assert r.returncode == 130
    assert "interrupted after 2 of" in r.stderr and str(js) in r.stderr
    rep = B.load(str(js))
    assert rep["settings"]["complete"] is False and rep["settings"]["cases_done"] == 2
    assert len({x["case"] for x in rep["rows"]}) == 2
    assert all(x["status"] == ("skipped" if x["backend"] == "torch" else "ok") for x in rep["rows"])
    assert "Partial: 2 of" in md.read_text()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.slow
def test_ctrl_c_on_a_real_run_leaves_a_partial_report(tmp_path):
    js = tmp_path / "r.json"
    # seven cases of ~0.3 s a row (~17 s in all, the first done after ~2 s): the run must not end
    # before the signal reaches it, however late this (busy) process reads the first case's line
    # (with ARGS' 4 cases of ~0.3 s it sometimes had, under a loaded CI: exit status 0)
    args = ["bench", "--quick", "--ops", "ce,smooth_l1,embedding,scaled", "--no-torch", "--repeat", "100000",
            "--budget", "0.3", "--json", str(js)]
    # the child takes SIGINT as a terminal's process does, whatever this process inherited: a test
    # run started in the background (`nohup ... &`: SIGINT ignored) made a child that ignored it —
    # Python installs its KeyboardInterrupt handler only where SIGINT is not ignored at startup
    p = subprocess.Popen([sys.executable, "-m", "fastgrad", *args], stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in p.stderr:
            if "[1/" in line and "cases done" in line:   # the first case finished and was written
                p.send_signal(signal.SIGINT)
                break
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, err
    rep = B.load(str(js))
    assert rep["settings"]["cases_done"] >= 1 and rep["rows"]


def test_list_names_the_rows_as_the_results_do(tmp_path):
    from fastgrad.cli.bench import row_labels

    case = B.select(B.all_cases(True), ["cross_entropy_loss_grad[mean]/fp32"])[0]
    listed = fastgrad_inprocess("bench", "--quick", "--list", "--ops", case.id).stdout
    labels = row_labels(case)
    assert "rows: " + ", ".join(labels) in listed and "--rows names: fastgrad, torch" in listed
    rep = B.run([case], repeat=1, budget_s=0.05, quick=True, use_torch=False)
    got = [R._label(x) for x in rep["rows"] if x["backend"] != "bound"]
    assert got == labels                  # the torch row too (skipped: --no-torch)
    assert len(set(got)) == len(got)      # no two rows of a case named alike


def test_headline_is_named_in_the_help_and_the_readme():
    from fastgrad.cli.bench import HEADLINE_CASE

    assert "--headline" in fastgrad_inprocess("bench", "-h").stdout
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    assert "fastgrad bench --headline" in readme
    assert [c.id for c in B.select(B.all_cases(False), [HEADLINE_CASE])] == [HEADLINE_CASE]
    r = fastgrad_inprocess("bench", "--headline", "--ops", "ce")
    assert r.returncode == 2 and "--headline" in r.stderr


def test_aclnn_names_select_bench_cases():
    r = fastgrad_inprocess("bench", "--quick", "--list", "--ops", "aclnnCrossEntropyLossGrad")
    ids = [ln for ln in r.stdout.splitlines() if not ln.startswith(" ")]
    assert ids and all(i.startswith("cross_entropy_loss_grad[") for i in ids)
