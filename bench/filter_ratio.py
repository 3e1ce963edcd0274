"""Gradient filtering's speed-up: the FLCE grad (bf16, memory-saving) dense ÷ ``filter_eps="auto"``
on the bench's LLM-like inputs of a given mean entropy (``fastgrad.benchmarks.cases.
_sparse_flce_inputs``), one process, a warm-up call each, best of N (the CPU time of the process
on one thread, wall time on more)::

    python bench/filter_ratio.py --threads 1,2 --shape 1024,896,32000 --entropy 2
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--shape", default="1024,896,32000", help="BT,H,V")
    ap.add_argument("--entropy", type=float, default=2.0, help="the inputs' mean entropy (nats)")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    import fastgrad as fg
    from fastgrad.benchmarks import cases

    BT, H, V = (int(v) for v in a.shape.split(","))
    inp = cases._sparse_flce_inputs(BT, H, V, "bfloat16", a.entropy)
    st = {k: inp[k] for k in ("logits_max", "sum_exp_logits")}
    args = (inp["grad"], inp["input"], inp["weight"], inp["target_mask"], inp["masked_target"])

    def dense() -> None:
        fg.fused_linear_cross_entropy_loss_grad(*args, **st)

    def filtered():
        return fg.fused_linear_cross_entropy_loss_grad(*args, **st, filter_eps="auto", return_plan=True)

    plan = filtered()[-1]
    print(
        f"(BT, H, V) = {(BT, H, V)}, entropy {inp['mean_entropy']:.2f} nats: "
        f"{plan.blocks_skipped}/{plan.blocks_total} blocks skipped"
    )
    for n in (int(t) for t in a.threads.split(",")):
        fg.set_num_threads(n)
        clock = time.process_time if n == 1 else time.perf_counter

        def best(f) -> float:
            f()
            b = float("inf")
            for _ in range(a.repeat):
                t0 = clock()
                f()
                b = min(b, clock() - t0)
            return b

        d, f = best(dense), best(filtered)
        print(f"threads {n}: dense {d:.3f} s, filtered {f:.3f} s: dense / filtered {d / f:.2f}x")


if __name__ == "__main__":
    main()
