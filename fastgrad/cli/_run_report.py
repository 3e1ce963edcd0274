"""The main job's golden check (sampled rows against float64) and its outputs and report (``fastgrad/cli/run.py``)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from ..benchmarks.report import json_default
from . import checkpoint as ck
from ._run_args import (
    GOLDEN_CHUNK_BYTES,
    PHASE_HEADER,
    Say,
    fmt_bytes,
    fmt_seconds,
)

# ------------------------------------------------------------------ golden check (sampled)


def sample_indices(rng, n: int, k: int, first) -> np.ndarray:
    """``k`` distinct indices in ``[0, n)`` (``k <= n``), sorted: the ones in ``first`` (in their
    order, duplicates dropped) before random ones."""
    extra = rng.choice(n, size=min(n, k + len(first)), replace=False)
    picked = list(dict.fromkeys(int(i) for i in (*first, *extra)))[:k]
    return np.array(sorted(picked), dtype=np.int64)


def golden_check(fg, vp, x, w, t, grad, gmax, gsum, loss, grad_input, grad_weight, fwd, bounds, samples, seed):
    """float64 golden on ``samples`` sampled rows and ``samples`` sampled vocabulary rows
    (the first and last of each among them) through the reference backend.

    * rows ``R``: the statistics and loss from the reference forward over vocabulary chunks
      (combined as the all-reduce), and ``grad_input[R]`` = the sum over vocabulary chunks of the
      reference FLCE grad on ``(input[R], weight[chunk])`` (fp32, unrounded), rounded once;
    * vocabulary rows ``C``: ``grad_weight[C]`` = the reference FLCE grad on ``(input, weight[C])``
      with ``masked_target`` remapped into ``C`` and ``target_mask`` set where the target is
      outside ``C``.
    The FLCE grad goldens take fastgrad's global statistics as inputs (they are the op's
    inputs); the statistics are checked on their own.  At most ``GOLDEN_CHUNK_BYTES`` of the
    weight is widened at a time.
    """
    BT, H = x.shape
    V = w.shape[0]
    dt = x.dtype
    rng = np.random.default_rng(seed + 1)
    rows = sample_indices(rng, BT, samples, [0, BT - 1])
    cols = sample_indices(rng, V, samples, [0, V - 1, *t[rows[: max(1, samples // 2)]]])
    xr, tr, gr = np.ascontiguousarray(x[rows]), t[rows], grad[rows]
    chunk = max(256, GOLDEN_CHUNK_BYTES // (8 * H))
    n = len(rows)
    stats: tuple[list, list, list, list] = ([], [], [], [])
    gi64 = np.zeros((n, H))
    with fg.use_backend("reference"):
        parts = []
        for c0 in range(0, V, chunk):
            c1 = min(c0 + chunk, V)
            r = fg.fused_linear_online_max_sum(xr, w[c0:c1], tr, c0, c1)
            parts.append((c0, c1, r.target_mask, r.masked_target))
            stats[0].append(r.logits_max_local)
            stats[1].append(r.sum_exp_logits_local)
            stats[2].append(r.predicted_logits_local)
            stats[3].append(~vp.unpack_target_mask(r.target_mask, n))
        m_g, s_g, p_g = vp.combine_shard_statistics(*stats)
        loss_g, _ = fg.fused_cross_entropy_loss_with_max_sum(m_g, s_g, p_g)
        for c0, c1, tm, mt in parts:
            gi_c = np.empty((n, H), np.float32) if dt != np.float32 else np.empty((n, H), dt)
            gw_c = np.empty((c1 - c0, H), dt)
            fg.fused_linear_cross_entropy_loss_grad(
                gr, xr, w[c0:c1], tm, mt, logits_max=gmax[rows], sum_exp_logits=gsum[rows], out=(gi_c, gw_c)
            )
            gi64 += gi_c
        gi_g = gi64.astype(np.float32).astype(dt)
        # vocabulary rows C: weight[C] as a "shard" whose column j is vocabulary row cols[j]
        pos = np.searchsorted(cols, t)
        inside = (pos < len(cols)) & (cols[np.minimum(pos, len(cols) - 1)] == t)
        tm_c = vp.pack_target_mask(~inside)
        mt_c = np.where(inside, pos, 0).astype(np.int64)
        gi_tmp = np.empty((BT, H), dt)
        gw_g = np.empty((len(cols), H), dt)
        fg.fused_linear_cross_entropy_loss_grad(
            grad, x, np.ascontiguousarray(w[cols]), tm_c, mt_c, logits_max=gmax, sum_exp_logits=gsum, out=(gi_tmp, gw_g)
        )
        del gi_tmp
    a_gi, a_gw = grad_input[rows], grad_weight[cols]

    def absmax(a, b):
        return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))

    def rel(a, b):
        b = np.asarray(b, np.float64)
        return absmax(a, b) / (float(np.max(np.abs(b))) or 1.0)

    errors = {
        "rows_sampled": int(n),
        "vocab_rows_sampled": int(len(cols)),
        "loss_abs": absmax(loss[rows], loss_g),
        "logits_max_abs": absmax(gmax[rows], m_g),
        "sum_exp_logits_rel": rel(gsum[rows], s_g),
        "grad_input_abs": absmax(a_gi, gi_g),
        "grad_input_rel_to_max": rel(a_gi, gi_g),
        "grad_weight_abs": absmax(a_gw, gw_g),
        "grad_weight_rel_to_max": rel(a_gw, gw_g),
    }
    verdicts = {}
    for name, a, g, d in (
        ("grad_input", a_gi, gi_g, dt),
        ("grad_weight", a_gw, gw_g, dt),
        ("loss", loss[rows], loss_g, np.float32),
    ):
        c = fg.compare(a, g, dtype=d, standard="single")
        verdicts[name] = {
            "passed": bool(c.passed),
            "dtype": c.dtype,
            "metrics": c.to_dict()["metrics"],
            "thresholds": c.to_dict()["thresholds"],
            "failures": list(c.failures),
        }
    check = {
        "standard": "single (Ascend single benchmark: MERE < T, MARE < 10 T)",
        "passed": all(v["passed"] for v in verdicts.values()),
        "outputs": verdicts,
    }
    return {"errors": errors, "check": check}


# ------------------------------------------------------------------ output


def write_outputs(out_dir: str, fmt: str, tensors: dict, report: dict) -> list[str]:
    """Write the tensors and ``report.json`` into ``out_dir``.  Each file is written as
    ``NAME.part`` and renamed when complete; when a write fails (a full disk) every file of
    this call, partial or complete, is removed and the ``OSError`` propagates."""
    written: list[str] = []

    def part(path: str) -> str:
        written.append(path + ".part")
        return path + ".part"

    def done(path: str) -> None:
        os.replace(path + ".part", path)
        written[-1] = path

    files = []
    try:
        if fmt == "safetensors":
            meta = {
                "fastgrad": report["fastgrad"],
                "dtype": report["dtype"],
                "mode": report["mode"],
                "shape": json.dumps(report["shape"]),
            }
            path = os.path.join(out_dir, "results.safetensors")
            written.append(path + ".part")  # save_safetensors writes PATH.part, then renames
            ck.save_safetensors(path, tensors, meta)
            written[-1] = path
            files.append(path)
        else:
            for name, a in tensors.items():
                path = os.path.join(out_dir, name + ".npy")
                with open(part(path), "wb") as fb:
                    np.save(fb, a, allow_pickle=False)
                done(path)
                files.append(path)
        report["outputs"] = {
            "dir": out_dir,
            "files": [os.path.basename(f) for f in files] + ["report.json"],
            "tensors": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in tensors.items()},
        }
        path = os.path.join(out_dir, "report.json")
        with open(part(path), "w") as f:
            json.dump(report, f, indent=1, default=json_default)
            f.write("\n")
        done(path)
        files.append(path)
    except BaseException:
        report.pop("outputs", None)
        for w in written:
            try:
                os.remove(w)
            except OSError:
                pass
        raise
    return files


def gemm_kernel(dtype: np.dtype) -> str:
    """What the NumPy-level fused linear ops run their GEMMs on for ``dtype`` here."""
    import fastgrad

    return fastgrad.gemm_choice(dtype).describe()


def _pct_of_blas(f: float, kernel: str = "BLAS sgemm") -> str:
    s = f"{f:.0%} of BLAS"
    if f > 1.05 and kernel != "BLAS sgemm":
        s += f"; the {kernel.split(' (')[0]} beats fp32 BLAS"
    elif f > 1.05:
        s += ", above the measured BLAS rate: timing noise on a shared machine"
    return s


def print_report(r: dict, say: Say | None = None) -> None:
    """The whole report at once (the command prints it as it goes: :func:`header`, the phase
    rows, :func:`print_summary`)."""
    say = say or Say()
    s = r["shape"]
    say(
        f"fastgrad {r['fastgrad']}: LM-head gradient, BT={s['BT']} H={s['H']} V={s['V']} {r['dtype']} "
        f"mode={r['mode']} shards={r['shards']} threads={r['threads']}"
    )
    say(f"  inputs: weight {r['sources']['weight']}; input {r['sources']['input']}; target {r['sources']['target']}")
    for note in r.get("notes", []):
        say(f"  note: {note}")
    m = r["memory"]
    est = m["estimate"]
    say(
        f"  memory estimated from the plan before allocating: {fmt_bytes(est['total_bytes'])} "
        f"(limit {fmt_bytes(est['limit_bytes'])}, {est['limit_source']}); backward tiles "
        f"{est['plan_backward']['bt_tile']}x{est['plan_backward']['v_tile']}, scratch "
        f"{fmt_bytes(est['plan_backward']['workspace_bytes'])}"
    )
    say(PHASE_HEADER)
    for k, v in r["phases_s"].items():
        say(
            f"    {k:<16} {v:8.3f} s  {fmt_bytes(m['phase_peak_rss_bytes'][k]):>12}   "
            f"{fmt_bytes(m['process_peak_rss_bytes_after_phase'][k]):>12}"
        )
    print_summary(r, say)


def print_summary(r: dict, say: Say | None = None) -> None:
    """The report's lines after the phase table: rates, memory, filtering, golden errors, loss."""
    say = say or Say()
    m = r["memory"]
    est = m["estimate"]
    g = r["gflops"]
    fb = r["fraction_of_blas"]
    kern = r.get("gemm_kernel", "BLAS sgemm")
    say(
        f"  GFLOP/s: forward {g['forward']:.1f} ({_pct_of_blas(fb['forward'], kern)}), backward "
        f"{g['backward']:.1f} ({_pct_of_blas(fb['backward'], kern)}); BLAS fp32 GEMM measured now: "
        f"{g['blas_fp32_measured']:.1f}; GEMMs on: {kern}"
    )
    if "time_estimate_s" in r:
        total = sum(r["phases_s"].values())
        say(f"  time: {fmt_seconds(total)} in the phases (estimated {fmt_seconds(r['time_estimate_s'])})")
    if r["mode"] == "memory-saving":
        held = f"the [BT, V] fp32 logits it never held: {fmt_bytes(m['logits_fp32_bytes_avoided'])}"
    else:
        held = (
            f"high-performance mode held a shard's [BT, V] logits and fp32 softmax: "
            f"{fmt_bytes(m['logits_and_softmax_bytes_held'])}"
        )
    say(
        f"  memory: process peak {fmt_bytes(m['process_peak_rss_bytes'])} (estimate "
        f"{fmt_bytes(est['total_bytes'])}; inputs+outputs {fmt_bytes(m['inputs_outputs_bytes'])}, "
        f"process before the phases {fmt_bytes(m['rss_before_bytes'])}); {held}"
    )
    if "filter" in r:
        f = r["filter"]
        say(
            f"  gradient filtering: filter_eps {f['filter_eps']:.3g}, {f['blocks_skipped']} of "
            f"{f['blocks_total']} blocks skipped ({f['fraction_skipped']:.1%})"
        )
    if "max_error_vs_golden" in r:
        e = r["max_error_vs_golden"]
        say(
            f"  vs float64 golden ({e['rows_sampled']} rows, {e['vocab_rows_sampled']} vocab rows): "
            f"loss {e['loss_abs']:.2e}, grad_input {e['grad_input_abs']:.2e} "
            f"({e['grad_input_rel_to_max']:.2e} of max), grad_weight {e['grad_weight_abs']:.2e} "
            f"({e['grad_weight_rel_to_max']:.2e} of max)"
        )
        c = r["check"]
        parts = []
        for name, v in c["outputs"].items():
            mt = v["metrics"]
            parts.append(
                f"{name} {'pass' if v['passed'] else 'FAIL'} (MERE {mt.get('MERE', 0):.2e}, "
                f"MARE {mt.get('MARE', 0):.2e}, {v['dtype']})"
            )
        say(f"  Ascend single benchmark: {'PASS' if c['passed'] else 'FAIL'}: " + "; ".join(parts))
    say(f"  mean loss {r['loss_mean']:.6f}")
    if "outputs" in r:
        say(f"  wrote {', '.join(os.path.join(r['outputs']['dir'], f) for f in r['outputs']['files'])}")


def list_tensors(path: str) -> int:
    if os.path.isdir(path):
        md = ck.open_model_dir(path, "--list-tensors")
        infos = list(md.tensors.values())
    else:
        infos = list(ck.SafetensorsFile(path, "--list-tensors").tensors.values())
        md = None
    for i in infos:
        print(f"{i.name}\t{i.dtype}\t{list(i.shape)}\t{os.path.basename(i.file)}")
    if md is not None:
        head = md.head or (
            f"several ({', '.join(md.candidates)}): name one with --tensor"
            if md.candidates
            else "none found (name it with --tensor)"
        )
        print(f"# LM head: {head}{' (tied input embedding)' if md.tied else ''}", file=sys.stderr)
    return 0
