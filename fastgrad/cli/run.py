"""``fastgrad`` — the main job: a large-vocabulary LM-head gradient on a workstation.

Runs the companion forward (:func:`fastgrad.fused_linear_online_max_sum`, the shard statistics
combined with :func:`fastgrad.vocab_parallel.combine_shard_statistics`,
:func:`fastgrad.fused_cross_entropy_loss_with_max_sum`) and the fused linear cross-entropy
gradient (:func:`fastgrad.fused_linear_cross_entropy_loss_grad`) — public ops only — at a real
model's LM-head shape, by default Qwen2.5-0.5B's (V = 151,936, H = 896, BT = 2048, bf16), in
memory-saving mode.  Before any work it validates every flag, file and environment setting,
estimates the peak memory from the tile plan (refusing a job that does not fit) and checks
``--out`` (writable, room for the results).  It then reports as it goes, flushing each line (a
redirected stdout shows progress): the header, inputs and memory estimate; the time estimate
(the job's FLOPs over the BLAS rate measured on the spot; a job above ``CONFIRM_ABOVE_S`` asks,
or needs ``--yes``); one row per phase as it ends (time, the phase's peak RSS beside the
process's true peak, ``VmHWM``); then GFLOP/s, memory, and the error of N sampled rows and N
vocabulary rows against the float64 golden (the reference backend on row / vocabulary-row
subsets: no matrix is widened whole).  SIGINT/SIGTERM print the partial report.

Exit status: 0 done, 1 ``--check`` failed, 2 bad usage / file / shape / value / setting, a job
that does not fit or a failed write (after the report; partial files removed), 3 internal error
(``--debug`` shows tracebacks), 130/143 interrupted by SIGINT/SIGTERM.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np

from ..benchmarks.report import json_default
from ._common import CliError, enter_device, refuse_missing_kernel
from ._run_args import (  # noqa: F401  (re-exported)
    CONFIRM_ABOVE_S,
    DEFAULT,
    DEFAULT_SAMPLES,
    GOLDEN_CHUNK_BYTES,
    JIT_ALLOWANCE,
    OUT_SLACK_BYTES,
    PHASE_HEADER,
    RUN_DTYPES,
    MiB,
    PhaseMemory,
    Say,
    _dtype_arg,
    _filter_eps_arg,
    _int,
    _pos_float,
    _Version,
    build_parser,
    fmt_bytes,
    fmt_seconds,
    memory_limit_bytes,
    process_peak_bytes,
    rss_bytes,
)
from ._run_inputs import (  # noqa: F401  (re-exported)
    Job,
    _check_dir_writable,
    _float_matrix,
    _given,
    _materialize,
    _plan_dict,
    _plans,
    _prepare_out,
    _random_matrix,
    _remove_dir_if_empty,
    check_fits,
    check_out_files,
    check_out_space,
    check_settings,
    check_writable_file,
    estimate_memory,
    load_inputs,
    measure_blas_gflops,
    output_bytes,
    remove_made_dirs,
    resolve,
)
from ._run_report import (  # noqa: F401  (re-exported)
    _pct_of_blas,
    gemm_kernel,
    golden_check,
    list_tensors,
    print_report,
    print_summary,
    sample_indices,
    write_outputs,
)

_P = ParamSpec("_P")
_T = TypeVar("_T")

# ------------------------------------------------------------------ the job


class _Bar:
    """tqdm over the tiles of one op call, fed by ``fastgrad.progress``'s ``callback(done, total)``."""

    def __init__(self, desc: str, enabled: bool):
        self.desc, self.enabled, self.last = desc, enabled, 0
        self.bar: Any = None

    def __call__(self, done: int, total: int):
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit="tile", file=sys.stderr, leave=False)
        self.bar.update(done - self.last)
        self.last = done

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _warm(fg, dtype, filter_eps=None):
    """Compile the kernels on a tiny problem so the timings exclude compilation (strict mode off:
    the device would refuse shapes this small; the job itself runs under the user's setting)."""
    with fg.strict(False):
        _warm_calls(fg, dtype, filter_eps)


def _warm_calls(fg, dtype, filter_eps=None):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4)).astype(dtype)
    w = rng.standard_normal((5, 4)).astype(dtype)
    t = np.array([0, 1, 4])
    r = fg.fused_linear_online_max_sum(x, w, t, 0, 5, return_logits=True)
    _, sm = fg.fused_cross_entropy_loss_with_max_sum(
        r.logits_max_local,
        r.sum_exp_logits_local,
        r.predicted_logits_local,
        vocab_parallel_logits=r.vocab_parallel_logits,
    )
    fg.fused_linear_cross_entropy_loss_grad(
        np.ones(3, np.float32),
        x,
        w,
        r.target_mask,
        r.masked_target,
        logits_max=r.logits_max_local,
        sum_exp_logits=r.sum_exp_logits_local,
    )
    fg.fused_linear_cross_entropy_loss_grad(np.ones(3, np.float32), x, w, r.target_mask, r.masked_target, softmax=sm)
    if filter_eps is not None:  # the filtered path (flags, gathered products), every block but the targets'
        fg.fused_linear_cross_entropy_loss_grad(
            np.ones(3, np.float32),
            x,
            w,
            r.target_mask,
            r.masked_target,
            logits_max=r.logits_max_local,
            sum_exp_logits=r.sum_exp_logits_local,
            filter_eps=1.0,
        )


#: The phase table's column heads (the rows are printed as each phase ends).


class Phases:
    """Times each phase and samples its RSS; prints its row of the report as it ends (once the
    table is open: rows that end before are printed when it opens)."""

    def __init__(self, say: Say | None = None):
        self.time: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.process_peak: dict[str, int] = {}
        self.current: tuple[str, float] | None = None  # the phase running now and its start
        self.say = say
        self.table_open = False

    def open_table(self) -> None:
        self.table_open = True
        if self.say is not None:
            self.say(PHASE_HEADER)
            for name in self.time:
                self._row(name)

    def _row(self, name: str) -> None:
        if self.say is not None:
            self.say(
                f"    {name:<16} {self.time[name]:8.3f} s  {fmt_bytes(self.peak[name]):>12}   "
                f"{fmt_bytes(self.process_peak[name]):>12}"
            )

    def run(self, name: str, fn: Callable[_P, _T], *a: _P.args, **kw: _P.kwargs) -> _T:
        self.current = (name, time.perf_counter())
        with PhaseMemory() as pm:
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.time[name] = time.perf_counter() - t0
        self.current = None
        self.peak[name] = pm.peak
        # VmHWM is read from per-CPU-batched RSS counters and can dip by a few pages between
        # two reads; the high-water mark itself never goes down: the running maximum
        self.process_peak[name] = max(process_peak_bytes(), *self.process_peak.values(), 0)
        if self.table_open:
            self._row(name)
        return out


def job_flops(job: Job) -> dict[str, float]:
    """The job's floating-point operations: the GEMMs of the forward and the backward, and the
    float64 golden check's (sampled rows against every vocabulary row, sampled vocabulary rows
    against every row)."""
    BT, H, V = job.BT, job.H, job.V
    hp, shards, n = job.args.mode == "high-performance", job.args.shards, job.args.samples
    # memory-saving: mm0 (recomputed logits) + mm1 + mm2; high-performance: mm1 + mm2 (+ the
    # logits recomputed per shard when there are several)
    bwd = (6.0 if not hp else (4.0 if shards == 1 else 6.0)) * BT * V * H
    return {"forward": 2.0 * BT * V * H, "backward": bwd, "golden_check": 8.0 * n * V * H + 6.0 * BT * n * H}


#: Rates the time estimate assumes beside the measured BLAS rate: random numbers generated, and
#: elements widened to float64 by the golden check, per second (conservative, 1 core).
GENERATE_PER_S = 1e8
WIDEN_PER_S = 2e8
#: Loading the compiled kernels from Numba's cache (the compile_warmup phase on a warm cache).
KERNEL_LOAD_S = 1.0


def estimate_seconds(job: Job, blas_gflops: float) -> tuple[float, str]:
    """Time the job should take, from its FLOPs over the BLAS rate measured on the spot (the
    golden check's float64 GEMMs at half of it), plus data generation and the golden check's
    widening of the weight.  Numba's compilation on a first run is not included."""
    f = job_flops(job)
    rate = max(blas_gflops, 1e-3) * 1e9
    gemm = f["forward"] + f["backward"]
    secs = gemm / rate + f["golden_check"] / (rate / 2)
    gen = (job.V * job.H if job.w_src is None else 0) + (job.BT * job.H if job.x_src is None else 0)
    secs += gen / GENERATE_PER_S
    if job.args.samples:
        secs += job.V * job.H / WIDEN_PER_S
    secs += KERNEL_LOAD_S
    detail = f"{gemm / 1e12:.3g} TFLOP of GEMMs at the fp32 BLAS rate measured now, {blas_gflops:.3g} GFLOP/s"
    kern = gemm_kernel(job.dtype)
    if kern != "BLAS sgemm":
        detail += f"; this CPU runs them on the {kern.split(' (')[0]}, usually faster"
    extra = (["generating the data"] if gen else []) + (["the float64 golden check"] if job.args.samples else [])
    if extra:
        detail += "; plus " + " and ".join(extra)
    return secs, detail + "; a first run also compiles the kernels"


def confirm(job: Job, est_s: float, say: Say) -> None:
    """Jobs estimated above ``CONFIRM_ABOVE_S`` run with ``--yes``, or when the user says yes on
    a terminal; without a terminal to ask they are refused (one line, exit 2), never left
    hanging on a prompt."""
    if est_s <= CONFIRM_ABOVE_S or job.args.yes:
        return
    what = f"the job is estimated at about {fmt_seconds(est_s)} (over {CONFIRM_ABOVE_S / 60:.0f} min)"
    stdin = sys.stdin
    if stdin is None or not stdin.isatty():
        raise CliError(f"{what}: pass --yes to run it (stdin is not a terminal to ask on), or use a smaller shape")
    print(f"fastgrad: {what}. Run it? [y/N] ", end="", file=sys.stderr, flush=True)
    answer = stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise Declined()


class Declined(Exception):
    """The user answered no to the confirmation."""


class Stopped(BaseException):
    """SIGTERM (or SIGINT) arrived: unwind to the partial report."""

    def __init__(self, signame: str, code: int):
        super().__init__(signame)
        self.signame, self.code = signame, code


def _on_signal(signum, frame):
    import signal

    raise Stopped(signal.Signals(signum).name, 128 + signum)


def header(job: Job, threads: int, say: Say) -> None:
    """The report's first lines, before any work: the job, its inputs, the memory estimate."""
    from .._version import __version__

    args, est = job.args, job.estimate
    say(
        f"fastgrad {__version__}: LM-head gradient, BT={job.BT} H={job.H} V={job.V} {job.dtype} "
        f"mode={args.mode} shards={args.shards} threads={threads}"
    )
    src = job.sources
    say(f"  inputs: weight {src['weight']}; input {src['input']}; target {src['target']}")
    for note in job.notes:
        say(f"  note: {note}")
    say(
        f"  memory estimated from the plan before allocating: {fmt_bytes(est['total_bytes'])} "
        f"(limit {fmt_bytes(est['limit_bytes'])}, {est['limit_source']}); backward tiles "
        f"{est['plan_backward']['bt_tile']}x{est['plan_backward']['v_tile']}, scratch "
        f"{fmt_bytes(est['plan_backward']['workspace_bytes'])}"
        + (f"; --out needs {fmt_bytes(output_bytes(job))}" if args.out is not None else "")
    )


def run_job(job: Job, ph: Phases | None = None, blas: float | None = None) -> tuple[dict, dict]:
    """Run the job's phases (``ph`` prints their rows as they end); returns (report, tensors to
    save).  ``blas``: the BLAS rate already measured (else measured here)."""
    import fastgrad as fg
    from fastgrad import vocab_parallel as vp

    from .._config import max_threads

    args = job.args
    threads = args.threads or max_threads()
    show = not args.no_progress and not args.json and sys.stderr.isatty()
    ph = ph if ph is not None else Phases()
    rss_start = rss_bytes()
    if not job.estimate:
        check_fits(job)
    if blas is None:
        blas = ph.run("blas_measure", measure_blas_gflops, job.BT, job.H, threads)
    x, w, t, grad = ph.run("load_inputs", load_inputs, job)
    BT, H, V = job.BT, job.H, job.V
    bounds, shards, hp = job.bounds, args.shards, args.mode == "high-performance"
    ph.run("compile_warmup", _warm, fg, x.dtype, args.filter_eps)
    rss_before = rss_bytes()

    # ---- forward: each shard's online max/sum, combined as the caller's all-reduce would
    def forward():
        outs = []
        for k in range(shards):
            a, b = bounds[k], bounds[k + 1]
            bar = _Bar(f"forward shard {k + 1}/{shards}", show)
            with fg.progress(bar):
                r = fg.fused_linear_online_max_sum(x, w[a:b], t, a, b, return_logits=hp and shards == 1)
            bar.close()
            outs.append(r)
        gmax, gsum, gpred = vp.combine_shard_statistics(
            [r.logits_max_local for r in outs],
            [r.sum_exp_logits_local for r in outs],
            [r.predicted_logits_local for r in outs],
            [~vp.unpack_target_mask(r.target_mask, BT) for r in outs],
        )
        loss, _ = fg.fused_cross_entropy_loss_with_max_sum(gmax, gsum, gpred)
        return outs, gmax, gsum, gpred, loss

    fwd, gmax, gsum, gpred, loss = ph.run("forward", forward)

    # ---- backward: each shard's FLCE grad with the global statistics
    filt: dict[str, Any] = {"blocks_total": 0, "blocks_skipped": 0, "filter_eps": None}

    def backward():
        gw = np.empty((V, H), x.dtype)
        if shards == 1:
            gi = np.empty((BT, H), x.dtype)
        else:
            gi_acc = np.zeros((BT, H), np.float32)
            gi_k = np.empty((BT, H), np.float32)  # the unrounded accumulator (fp32 out= extension)
        for k in range(shards):
            a, b = bounds[k], bounds[k + 1]
            r = fwd[k]
            kw = {}
            if hp:
                logits = r.vocab_parallel_logits
                if logits is None:  # several shards: recompute this shard's logits only
                    again = fg.fused_linear_online_max_sum(x, w[a:b], t, a, b, return_logits=True)
                    logits = again.vocab_parallel_logits
                    del again
                fwd[k] = r._replace(vocab_parallel_logits=None)
                _, kw["softmax"] = fg.fused_cross_entropy_loss_with_max_sum(
                    gmax, gsum, gpred, vocab_parallel_logits=logits
                )
                del logits
            else:
                kw = dict(logits_max=gmax, sum_exp_logits=gsum)
                if args.filter_eps is not None:
                    kw.update(filter_eps=args.filter_eps, return_plan=True)
            bar = _Bar(f"grad shard {k + 1}/{shards}", show)
            with fg.progress(bar):
                got = fg.fused_linear_cross_entropy_loss_grad(
                    grad, x, w[a:b], r.target_mask, r.masked_target, out=(gi if shards == 1 else gi_k, gw[a:b]), **kw
                )
            bar.close()
            if args.filter_eps is not None:
                plan = got[2]
                filt["filter_eps"] = plan.filter_eps
                filt["blocks_total"] += plan.blocks_total
                filt["blocks_skipped"] += plan.blocks_skipped
            kw.clear()
            if shards > 1:
                gi_acc += gi_k  # the caller's all-reduce of grad_input
        if shards > 1:
            del gi_k
            gi = gi_acc.astype(x.dtype)
        return gi, gw

    grad_input, grad_weight = ph.run("backward", backward)

    # ---- sampled check against the float64 golden
    golden = None
    if args.samples:
        golden = ph.run(
            "golden_check",
            golden_check,
            fg,
            vp,
            x,
            w,
            t,
            grad,
            gmax,
            gsum,
            loss,
            grad_input,
            grad_weight,
            fwd,
            bounds,
            args.samples,
            args.seed,
        )

    phases = ph.time
    flops = job_flops(job)
    flop_fwd, flop_bwd = flops["forward"], flops["backward"]
    gf_f = flop_fwd / phases["forward"] / 1e9
    gf_b = flop_bwd / phases["backward"] / 1e9
    io_bytes = x.nbytes + w.nbytes + grad_input.nbytes + grad_weight.nbytes
    est = job.estimate
    res = {
        "fastgrad": fg.__version__,
        **getattr(args, "device", {}),
        "shape": {"BT": BT, "H": H, "V": V},
        "dtype": str(x.dtype),
        "mode": args.mode,
        "shards": shards,
        "threads": threads,
        "sources": job.sources,
        "notes": job.notes,
        "phases_s": {k: round(v, 4) for k, v in phases.items()},
        "gflops": {"forward": gf_f, "backward": gf_b, "blas_fp32_measured": blas},
        "fraction_of_blas": {"forward": gf_f / blas, "backward": gf_b / blas},
        "memory": {
            "rss_start_bytes": rss_start,
            "rss_before_bytes": rss_before,
            "phase_peak_rss_bytes": dict(ph.peak),
            "process_peak_rss_bytes_after_phase": dict(ph.process_peak),
            "peak_rss_forward_bytes": ph.peak["forward"],
            "peak_rss_backward_bytes": ph.peak["backward"],
            "process_peak_rss_bytes": process_peak_bytes(),
            "inputs_outputs_bytes": io_bytes,
            "estimate": est,
            "logits_fp32_bytes_avoided": 0 if hp else 4 * BT * V,
            "logits_and_softmax_bytes_held": (BT * (-(-V // shards)) * (x.dtype.itemsize + 4)) if hp else 0,
        },
        "loss_mean": float(np.mean(loss, dtype=np.float64)),
        "gemm_kernel": gemm_kernel(x.dtype),
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
        },
    }
    if args.filter_eps is not None:
        res["filter"] = dict(filt, fraction_skipped=filt["blocks_skipped"] / max(filt["blocks_total"], 1))
    if golden is not None:
        res["max_error_vs_golden"] = golden["errors"]
        res["check"] = golden["check"]
    tensors = {
        "grad_input": grad_input,
        "grad_weight": grad_weight,
        "loss": loss,
        "logits_max": gmax,
        "sum_exp_logits": gsum,
        "predicted_logits": gpred,
        "target": t,
    }
    return res, tensors


def main(argv: list[str] | None = None) -> int:
    """The command.  Order: validate every flag and file (exit 2), apply the settings, estimate
    memory (exit 2 when it does not fit) and check ``--out`` (writable, room for the results),
    print the header, measure the BLAS rate and print the time estimate, ask when the job is
    long (``--yes``), then run the phases, printing each row as it ends; SIGINT/SIGTERM print
    the partial report (exit 130/143); a failed write prints the report, removes the partial
    files and exits 2."""
    import contextlib

    args = build_parser().parse_args(argv)
    if args.list_tensors is not None:
        return list_tensors(args.list_tensors)
    with contextlib.ExitStack() as stack:
        # the SoC and strict mode the ops follow (--soc-version / --strict, else the environment)
        args.device = enter_device(stack, args)
        refuse_missing_kernel("fused_linear_cross_entropy_loss_grad", args.device["soc_version"])
        job = resolve(args)
        try:
            return _main(job)
        finally:
            if job.out_created:  # nothing written (refused, interrupted, failed): leave no empty dir,
                remove_made_dirs(job)  # nor the parents made for it


def _interrupted(e: BaseException, ph: Phases, say: Say, what: str) -> int:
    """The partial report of a job stopped by SIGINT/SIGTERM; returns 130/143."""
    signame, code = (e.signame, e.code) if isinstance(e, Stopped) else ("SIGINT", 130)
    cur = ph.current
    where = f"during {cur[0]} after {time.perf_counter() - cur[1]:.1f} s" if cur else "between phases"
    say(
        f"  interrupted by {signame} {where}; phases done: {', '.join(ph.time) or 'none'}; "
        f"process peak RSS {fmt_bytes(process_peak_bytes())}; {what}"
    )
    print(f"fastgrad: interrupted by {signame} (partial report above)", file=sys.stderr)
    return code


def _main(job: Job) -> int:
    import signal

    in_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _on_signal) if in_main else None
    try:
        return _job(job)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _job(job: Job) -> int:
    import fastgrad as fg

    from .. import _config, tiling
    from .._config import max_threads

    args = job.args
    say = Say(sys.stderr if args.json else sys.stdout)
    threads = args.threads or max_threads()
    old_threads, old_budget = fg.get_num_threads(), _config.workspace_budget_override()
    fg.set_num_threads(threads)
    if args.workspace_mb is not None:
        tiling.set_workspace_budget(int(args.workspace_mb * MiB))
    ph = Phases(say)
    try:
        check_fits(job)
        check_out_space(job)
        check_out_files(job)
        header(job, threads, say)
        blas = ph.run("blas_measure", measure_blas_gflops, job.BT, job.H, threads)
        est_s, detail = estimate_seconds(job, blas)
        say(f"  time estimated: about {fmt_seconds(est_s)} ({detail})")
        confirm(job, est_s, say)
        ph.open_table()
        res, tensors = run_job(job, ph, blas)
        res["time_estimate_s"] = est_s
    except Declined:
        print("fastgrad: not run (answered no)", file=sys.stderr)
        return 130
    except (Stopped, KeyboardInterrupt) as e:
        return _interrupted(e, ph, say, "no results written")
    finally:
        fg.set_num_threads(old_threads)
        tiling.set_workspace_budget(old_budget)
    failed = None
    if args.out is not None:
        try:
            ph.current = ("write_outputs", time.perf_counter())
            write_outputs(args.out, args.out_format, tensors, res)
            ph.current = None
            job.out_created = False
        except OSError as e:
            failed = e
            res["outputs_error"] = f"{e.filename or args.out}: {e.strerror or e}"
        except (Stopped, KeyboardInterrupt) as e:
            print_summary(res, say)
            return _interrupted(e, ph, say, "partial files removed")
    if args.json:
        print(json.dumps(res, indent=2, default=json_default), flush=True)
    else:
        print_summary(res, say)
    if failed is not None:
        name = failed.filename or args.out
        print(
            f"fastgrad: --out: could not write {name!r}: {failed.strerror or failed} "
            "(the report is above; partial files removed)",
            file=sys.stderr,
        )
        return 2
    if args.check and not res["check"]["passed"]:
        return 1
    return 0
