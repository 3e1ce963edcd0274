"""Train a tiny character-level LM on CPU with fastgrad's fused LM-head loss.

Two identical models (same initialization, same batches, same AdamW) are trained side by side:
one with ``F.cross_entropy(hidden @ W.T, y)`` on materialized logits, one with
``fastgrad.torch.linear_cross_entropy(hidden, W, y)``.  Their loss curves match step for step.

    python examples/train_tiny_lm.py [--steps 40 | --quick] [--dtype float32|bfloat16]

About 10-20 s for the default 40 steps on 2 cores; ``--quick`` (8 steps) a few seconds.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from tiny_lm import DTYPES, CharData, TinyLM, add_training_args, dtype_arg, training_args

import fastgrad as fg
import fastgrad.torch as ft


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(ap)
    ap.add_argument("--dtype", type=dtype_arg, default="float32",
                    help="dtype of the LM-head matmul: float32 | bfloat16 (aliases fp32, bf16; default float32)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch and fastgrad threads (tiny model: 1 is fastest; 0 = the default)")
    args = training_args(ap, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        fg.set_num_threads(args.threads)
    dt = DTYPES[args.dtype]

    data = CharData(args.seq_len, seed=args.seed)
    torch.manual_seed(args.seed)
    ref = TinyLM(data.vocab_size, args.dim, args.seq_len)
    fused = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    opt_fused = torch.optim.AdamW(fused.parameters(), lr=args.lr)
    print(f"corpus: {len(data.tokens)} characters, vocabulary {data.vocab_size}; "
          f"model {sum(p.numel() for p in ref.parameters())} parameters; LM head in {args.dtype}", flush=True)
    print(f"{'step':>8} {'F.cross_entropy':>16} {'fastgrad':>12} {'|diff|':>10}", flush=True)

    worst = 0.0
    t_ref = t_fused = 0.0
    for step in range(1, args.steps + 1):
        x, y = data.batch(args.batch)

        t0 = time.perf_counter()
        h = ref.hidden(x)
        logits = h.to(dt) @ ref.lm_head.to(dt).T                       # [B, T, V] materialized
        loss_ref = F.cross_entropy(logits.reshape(-1, data.vocab_size).float(), y.reshape(-1))
        opt_ref.zero_grad()
        loss_ref.backward()
        opt_ref.step()
        t1 = time.perf_counter()
        h = fused.hidden(x)
        loss_fused = ft.linear_cross_entropy(h.to(dt), fused.lm_head.to(dt), y)   # never [B,T,V]
        opt_fused.zero_grad()
        loss_fused.backward()
        opt_fused.step()
        t2 = time.perf_counter()
        t_ref += t1 - t0
        t_fused += t2 - t1

        diff = abs(loss_ref.item() - loss_fused.item())
        worst = max(worst, diff)
        print(f"step {step:3d} {loss_ref.item():16.6f} {loss_fused.item():12.6f} {diff:10.2e}", flush=True)

    drift = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), fused.parameters()))
    tol = 1e-3 if dt == torch.float32 else 5e-2
    verdict = "MATCH" if worst <= tol else "MISMATCH"
    print(f"max |loss diff| over {args.steps} steps: {worst:.2e} (tolerance {tol:g}) -> {verdict}; "
          f"max parameter difference at the end: {drift:.2e}")
    print(f"time: F.cross_entropy {t_ref:.2f} s, fastgrad {t_fused:.2f} s (tiny model; "
          f"the fused loss pays off at large vocabularies)")
    return 0 if verdict == "MATCH" else 1


if __name__ == "__main__":
    raise SystemExit(main())
