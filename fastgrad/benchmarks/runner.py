"""Run benchmark cases into JSON rows (schema: ``docs/benchmarks.md``).

Rows of a case with ``memory=True`` (the FLCE family and the training step) run in a fresh
Python subprocess (spawned, nothing inherited but the environment) so that their peak RSS is
theirs alone: the child builds the inputs, then for each row makes one untimed call (the
libraries' one-time set-up stays out of the figure: a training loop's steady state), releases
the output cache and the free heap, resets the kernel's peak-RSS counter, records the RSS, times
one call, and reports the peak (``peak_rss_mib``) and the growth over that RSS
(``peak_rss_delta_mib``).  Every case's rows are then timed in interleaved rounds
(:func:`run_rows`).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Collection, Sequence

import numpy as np

from . import cases as C
from .machine import copy_bandwidth, gemm_runner, machine_id, machine_info, versions
from .report import SCHEMA  # noqa: F401  (re-exported: the schema the runner's reports carry)
from .timing import MIB, current_rss, peak_rss, reset_peak_rss, threads, time_fn, torch_module


def _spec_label(case, runner) -> str:
    return f"{runner.name}{('+' + runner.mode) if runner.mode else ''}"


def _row_base(case, runner, backend, n, note="") -> dict:
    mode = case.mode + (f"+{runner.mode}" if runner.mode else "")
    return {
        "op": case.op,
        "case": case.id,
        "shape": dict(case.shape),
        "shape_str": case.shape_str,
        "dtype": case.dtype,
        "mode": mode,
        "backend": backend,
        "kind": runner.kind,
        "runner": runner.name,
        "variant": runner.mode,
        "threads": n,
        "torch_threads": None,  # PyTorch's intra-op threads while the row ran (when imported)
        "status": "ok",
        "note": note,
        "time_median_s": None,
        "time_p20_s": None,
        "time_p80_s": None,
        "reps": 0,
        "time_samples_s": None,  # every timed call, in round order (run_rows)
        "warmup_s": None,
        "flops": case.flops or None,
        "bytes": case.bytes or None,
        "gflops": None,
        "gbps": None,
        "bound": case.bound,
        "bound_time_s": None,
        "fraction_of_bound": None,
        "fastgrad_speedup": None,
        "peak_rss_mib": None,
        "peak_rss_delta_mib": None,
        "rss_measured": None,
    }


def _callable(case, runner, backend, inp):
    if runner.kind == "bound":
        return gemm_runner(case.gemm)
    fn = runner.make(inp)
    if runner.kind != "fastgrad":
        return fn
    from ..backends import use_backend

    def run():
        with use_backend(backend):
            return fn()

    run.metrics = getattr(fn, "metrics", None)  # type: ignore[attr-defined]
    return run


def run_one(
    case: C.Case,
    runner: C.Runner,
    backend: str,
    inp: dict,
    n: int,
    repeat: int,
    budget_s: float,
    memory: bool = False,
) -> dict:
    """Time one row (in this process); with ``memory``, also its peak RSS."""
    row = _row_base(case, runner, backend, n)
    try:
        fn = _callable(case, runner, backend, inp)
        warm = 1
        if memory:
            # the steady state of a training loop: one untimed call first (libraries' one-time
            # set-up, Numba's cache loads), then the peak over the timed calls
            t0 = time.perf_counter()
            fn()
            first = time.perf_counter() - t0
            warm = 0
            ok = reset_peak_rss()
            base = current_rss()
        t = time_fn(fn, repeat, budget_s, warmup=warm)
        if memory:
            t.warmup_s = first
        if memory:
            peak = peak_rss()
            row["peak_rss_mib"] = peak / MIB
            row["peak_rss_delta_mib"] = max(0.0, peak - base) / MIB if ok else None
            row["rss_measured"] = "subprocess" if ok else "subprocess (peak since start)"
        row.update(t.as_dict())
        tm = sys.modules.get("torch")
        row["torch_threads"] = tm.get_num_threads() if tm is not None else None
        metrics = getattr(fn, "metrics", None)
        if metrics is not None:  # a runner's own figures (e.g. filtering's)
            extra = metrics()
            row["note"] = "; ".join(filter(None, [row["note"], extra.pop("note", "")]))
            row.update(extra)
        del fn
    except NotImplementedError as e:
        row.update(status="error", note=f"not implemented: {e}")
    except Exception as e:  # noqa: BLE001 - a failing row must not stop the report
        row.update(status="error", note=f"{type(e).__name__}: {e}"[:300])
        if os.environ.get("FASTGRAD_BENCH_DEBUG"):
            traceback.print_exc()
    return row


def run_rows(
    case: C.Case,
    specs: Sequence[tuple[int, str]],
    inp: dict,
    n: int,
    repeat: int,
    budget_s: float,
    memory: bool = False,
) -> list[dict]:
    """Time a case's rows (``specs``: [(runner index, backend), ...]) in interleaved rounds.

    Round 1 is :func:`run_one` with one timed call per row, row after row (its warm-up call and,
    with ``memory``, its peak RSS, each row's callable dropped before the next row's is made).
    Rounds 2 .. ``repeat`` take one timed call of every row that ran, after one more untimed call
    each, in the case's row order, reversed every other round; they stop after the round in
    which some row's timed calls reach ``budget_s`` in all.  A row's median and percentiles are
    over its calls of every round: a machine whose speed drifts over a run (a shared VM) slows
    every row of a round alike, so the ratios between rows hold where back-to-back repetitions of
    one row, then the next, would compare different moments.
    """
    rows = [run_one(case, case.runners[ri], b, inp, n, 1, budget_s, memory) for ri, b in specs]
    live = [k for k, r in enumerate(rows) if r["status"] == "ok" and r["reps"] >= 1]
    for k in live:
        rows[k]["time_samples_s"] = [rows[k]["time_median_s"]]
    if repeat <= 1 or not live:
        return rows
    samples = {k: [rows[k]["time_median_s"]] for k in live}
    fns = {}
    try:
        for k in live:  # one untimed call each: a callable made again starts cold
            ri, b = specs[k]
            fns[k] = _callable(case, case.runners[ri], b, inp)
            fns[k]()
        for r in range(1, repeat):
            for k in live if r % 2 == 0 else live[::-1]:
                t = time.perf_counter()
                fns[k]()
                samples[k].append(time.perf_counter() - t)
            if max(sum(v) for v in samples.values()) >= budget_s:
                break
    except Exception as e:  # noqa: BLE001 - keep the calls timed so far, say why the rounds stopped
        for k in live:
            rows[k]["note"] = "; ".join(
                filter(None, [rows[k]["note"], f"rounds stopped: {type(e).__name__}: {e}"[:200]])
            )
    fns.clear()
    for k in live:
        v = samples[k]
        rows[k].update(
            time_median_s=float(np.median(v)),
            time_p20_s=float(np.percentile(v, 20)),
            time_p80_s=float(np.percentile(v, 80)),
            reps=len(v),
            time_samples_s=[float(x) for x in v],
        )
    return rows


def _gemm_engines(has_torch: bool) -> dict:
    """The GEMM engine of the NumPy-level ops and of fastgrad.torch's training loss here."""
    from .. import _config
    from ..dtypes import BFLOAT16, FLOAT16
    from ..ops.plan import gemm_choice

    b, f = gemm_choice(BFLOAT16), gemm_choice(FLOAT16)
    kernels = [f"{n} operands: {c.describe()}" for n, c in (("bf16", b), ("fp16", f)) if c.exact is not None]
    suffix = f" ({'; '.join(kernels)})" if kernels else ""
    out = {"ops": _config.gemm_engine() + suffix}
    if has_torch:
        with _config.prefer_onednn():
            t = gemm_choice(BFLOAT16)
            logits = f" (bf16 logits: {t.describe()})" if t.logits16 else ""
            out["torch_loss"] = _config.gemm_engine() + logits
    return out


# --------------------------------------------------------------- spawned memory worker ----


def _child_main():
    """Entry point of the spawned subprocess: JSON job list on stdin, JSON rows on stdout.

    Each job is one case: its inputs are built, its rows run (peak RSS reset before each),
    and its inputs dropped before the next job.
    """
    spec = json.loads(sys.stdin.read())
    for job in spec["jobs"]:
        rows = []
        try:
            case = C.find_case(job["case"], spec["quick"])
            if case.needs_torch or any(case.runners[ri].needs_torch for ri, _ in job["rows"]):
                torch_module()  # imported before threads(): its thread count is set only once imported
            # what the imports made (torch's are millions of objects) out of the collector's reach:
            # each row's reset_peak_rss() collects only what came after (0.27 s → ms per row)
            gc.collect()
            gc.freeze()
            with threads(spec["threads"]):
                inp: dict | None  # dropped (None) before the next job's inputs are built
                inp = case.build()
                specs = [(ri, backend) for ri, backend in job["rows"]]
                rows = run_rows(case, specs, inp, spec["threads"], spec["repeat"], spec["budget"], memory=True)
                inp = None
            result = {"ok": True, "rows": rows}
        except Exception as e:  # noqa: BLE001
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "rows": rows}
        # one line per job, as soon as it is done: the parent reports each case while the next runs
        sys.stdout.write("\n" + _MARK + json.dumps(result) + "\n")
        sys.stdout.flush()


_MARK = "@@FASTGRAD-BENCH@@"


def run_in_subprocess(
    jobs: Sequence[tuple[C.Case, Sequence[tuple[int, str]]]],
    n: int,
    repeat: int,
    budget_s: float,
    quick: bool,
    timeout: float | None = None,
    on_job: Callable[[int, list[dict]], object] | None = None,
) -> list[list[dict]]:
    """Run ``jobs`` ([(case, [(runner index, backend), ...]), ...]) in one fresh interpreter;
    returns one list of rows per job.  ``on_job(k, rows)`` is called as each job's rows arrive
    (the child writes one line per job), so a caller can report a case while the next one runs."""
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    payload = json.dumps(
        {
            "jobs": [{"case": c.id, "rows": specs} for c, specs in jobs],
            "quick": quick,
            "threads": n,
            "repeat": repeat,
            "budget": budget_s,
        }
    )
    cmd = [sys.executable, "-c", "from fastgrad.benchmarks.runner import _child_main; _child_main()"]

    def failed(c, specs, note):
        return [dict(_row_base(c, c.runners[ri], b, n), status="error", note=note[:300]) for ri, b in specs]

    results: list = []

    def take(res) -> None:
        c, specs = jobs[len(results)]
        rows = res["rows"]
        if not res["ok"]:
            for ri, b in specs[len(rows) :]:
                rows.append(dict(_row_base(c, c.runners[ri], b, n), status="error", note=res["error"]))
        results.append(rows)
        if on_job is not None:
            on_job(len(results) - 1, rows)

    import tempfile
    import threading

    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        timer, fired = None, threading.Event()
        if timeout is not None:

            def kill() -> None:
                fired.set()
                p.kill()

            timer = threading.Timer(timeout, kill)
            timer.start()
        try:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(payload)
            p.stdin.close()
            for line in p.stdout:
                if line.startswith(_MARK) and len(results) < len(jobs):
                    take(json.loads(line[len(_MARK) :]))
            p.wait()
        except BaseException:  # Ctrl-C: the child goes with the parent
            p.kill()
            p.wait()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if len(results) < len(jobs):
            if fired.is_set():
                note = "subprocess timed out"
            else:
                err.seek(0)
                last = err.read().strip().splitlines()[-1:] or [f"exit status {p.returncode}"]
                note = f"subprocess failed: {last[0]}"
            for c, specs in jobs[len(results) :]:
                results.append(failed(c, specs, note))
                if on_job is not None:
                    on_job(len(results) - 1, results[-1])
    return results


# ------------------------------------------------------------------------------ driver ----


def run(
    cases: Sequence[C.Case],
    backends: Sequence[str] = ("cpu",),
    thread_counts: Sequence[int | None] = (None,),
    repeat: int = 5,
    budget_s: float = 30.0,
    quick: bool = False,
    use_torch: bool = True,
    memory: bool = True,
    progress: Callable[[dict], object] | None = None,
    copy_bytes: int | None = None,
    only_rows: Collection[str] | None = None,
    on_case: Callable[[dict, int, int], object] | None = None,
    on_case_start: Callable[[C.Case, int, int], object] | None = None,
) -> dict:
    """Run ``cases`` and return the report dict (see ``docs/benchmarks.md`` for the schema).

    ``only_rows``: runner names to run (e.g. ``{"fastgrad", "bound", "torch-fp32"}``); None: all.  A
    case's other runners are left out of the report (on an AVX2-only CPU PyTorch's bf16 eager
    rows take minutes per step).

    ``backends``: fastgrad backends, one row each per fastgrad runner; ``thread_counts``: the
    thread settings (None: the default); ``memory=False`` runs memory cases in-process
    without peak RSS.  ``progress(row)`` is called after each row; ``on_case(report, done,
    total)`` after each case with the report so far, ``on_case_start(case, k, total)`` as case ``k``
    (1-based) starts (``settings.complete`` False until the last
    case: a caller writes it as it grows, so an interrupted run keeps what finished).  Cases run
    in the given order; with ``memory``, each memory case in a fresh subprocess (in quick mode
    one subprocess for all of them, reporting each as it finishes).
    """
    from .timing import default_threads

    info, vers = machine_info(), versions()
    mid = machine_id(info)
    has_torch = use_torch and torch_module() is not None
    torch_note = None if has_torch else ("torch disabled (--no-torch)" if not use_torch else "torch not installed")
    rows: list = []
    bounds: dict = {}
    t_start = time.time()
    if copy_bytes is None:
        copy_bytes = (64 if quick else 512) * 2**20
    settings: dict = {
        "quick": quick,
        "repeat": repeat,
        "budget_s": budget_s,
        "threads": [int(n) if n is not None else default_threads() for n in thread_counts],
        "backends": list(backends),
        "torch": has_torch,
        "memory_subprocess": memory,
        "gemm_engine": _gemm_engines(has_torch),
        "complete": False,
        "cases_done": 0,
        "cases_total": len(cases) * len(thread_counts),
    }
    report: dict = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_s": 0.0,
        "machine": info,
        "machine_id": mid,
        "versions": vers,
        "settings": settings,
        "bounds": bounds,
        "notes": [torch_note] if torch_note else [],
        "rows": rows,
    }
    total = len(cases) * len(thread_counts)
    done = 0

    def finish_case(case, case_rows, skipped, nthr, bw) -> None:
        nonlocal done
        if case.bound == "copy" and bw is not None:
            br = _row_base(
                case,
                C.Runner("bound", "bound", None),
                "bound",
                nthr,
                note="bytes at the measured copy bandwidth",
            )
            br.update(time_median_s=case.bytes / (bw["gbps"] * 1e9), reps=0)
            br["time_p20_s"] = br["time_p80_s"] = br["time_median_s"]
            case_rows.append(br)
        _derive(case_rows)
        for r in case_rows + skipped:
            r["machine"] = mid
            r["versions"] = vers
            rows.append(r)
            if progress:
                progress(r)
        done += 1
        report["elapsed_s"] = time.time() - t_start
        settings["cases_done"] = done
        if on_case:
            on_case(report, done, total)

    for n in thread_counts:
        nthr = int(n) if n is not None else default_threads()
        with threads(nthr):
            bw = None
            if any(c.bound == "copy" for c in cases):
                bw = copy_bandwidth(copy_bytes, repeat=3 if quick else 7)
                bounds[str(nthr)] = {
                    "copy_gbps": bw["gbps"],
                    "copy_bytes": bw["bytes"],
                    "copy_numba_gbps": bw["numba_gbps"],
                    "copy_numpy_gbps": bw["numpy_gbps"],
                }
            planned = []
            for case in cases:
                specs, skipped = [], []
                for ri, r in enumerate(case.runners):
                    if only_rows is not None and r.name not in only_rows:
                        continue
                    if (r.needs_torch or case.needs_torch) and not has_torch:
                        for b in backends if r.kind == "fastgrad" else [r.name]:
                            sk = _row_base(case, r, b, nthr, note=f"skipped: {torch_note}")
                            sk["status"] = "skipped"
                            skipped.append(sk)
                        continue
                    if r.kind == "fastgrad":
                        specs += [(ri, b) for b in backends]
                    else:
                        specs.append((ri, r.name))
                planned.append((case, specs, skipped))
            mem = [(c, sp, sk) for c, sp, sk in planned if c.memory and memory and sp]
            if quick and mem:  # one subprocess for all of them, each case reported as it arrives
                jobs = [(c, sp) for c, sp, _ in mem]

                def arrived(k, rws, mem=mem, nthr=nthr, bw=bw):
                    finish_case(mem[k][0], rws, mem[k][2], nthr, bw)
                    if on_case_start and k + 1 < len(mem):  # the subprocess goes on with the next
                        on_case_start(mem[k + 1][0], done + 1, total)

                if on_case_start:
                    on_case_start(mem[0][0], done + 1, total)
                run_in_subprocess(jobs, nthr, repeat, budget_s, quick, on_job=arrived)
            in_quick_group = {id(c) for c, _, _ in mem} if quick else set()
            for case, specs, skipped in planned:
                if id(case) in in_quick_group:
                    continue
                case_rows: list = []
                if on_case_start:
                    on_case_start(case, done + 1, total)
                if case.memory and memory and specs:
                    case_rows = run_in_subprocess([(case, specs)], nthr, repeat, budget_s, quick)[0]
                elif specs:
                    err = None
                    try:
                        inp = case.build()
                    except Exception as e:  # noqa: BLE001
                        inp, err = None, f"building inputs failed: {type(e).__name__}: {e}"
                    if inp is None:
                        for ri, b in specs:
                            case_rows.append(dict(_row_base(case, case.runners[ri], b, nthr), status="error", note=err))
                    else:
                        case_rows = run_rows(case, specs, inp, nthr, repeat, budget_s)
                    inp = None
                finish_case(case, case_rows, skipped, nthr, bw)
    report["elapsed_s"] = time.time() - t_start
    settings["complete"] = True
    return report


def _derive(rows: list) -> None:
    """Fill GFLOP/s, GB/s, bound time, fraction of the bound and fastgrad speed-ups."""
    bound = next((r for r in rows if r["backend"] == "bound" and r["time_median_s"]), None)
    ref = next(
        (
            r
            for r in rows
            if r["kind"] == "fastgrad" and r["backend"] == "cpu" and not r["variant"] and r["time_median_s"]
        ),
        None,
    )
    for r in rows:
        t = r["time_median_s"]
        if not t:
            continue
        if r["flops"]:
            r["gflops"] = r["flops"] / t / 1e9
        if r["bytes"]:
            r["gbps"] = r["bytes"] / t / 1e9
        if bound is not None:
            r["bound_time_s"] = bound["time_median_s"]
            r["fraction_of_bound"] = bound["time_median_s"] / t
        if ref is not None and r is not ref and r["backend"] != "bound":
            r["fastgrad_speedup"] = t / ref["time_median_s"]
