"""Vocabulary-parallel training of the tiny LM over torch.distributed (gloo, CPU).

    torchrun --nproc_per_node 2 examples/train_tiny_lm_vocab_parallel.py [--steps 40 | --quick]

About 20-40 s for the default 40 steps with 2 ranks on 2 cores; ``--quick`` (8 steps) ~10 s.

Every rank holds the whole (tiny) body, replicated with the same initialization and batches, and
a ``[V_k, D]`` shard of the LM head (rank order; uneven when V % world != 0).  The loss is
``fastgrad.torch.LinearCrossEntropyLoss(process_group=WORLD)``: each rank computes its shard's
row max / sum-exp / target logit with fastgrad's fused kernels, the statistics are all-reduced,
and in the backward ``grad_hidden`` is all-reduced, so the body gets identical gradients on every
rank and each rank updates its own LM-head rows.

Rank 0 also trains the single-process model (full LM head, same initialization) side by side and
prints both loss curves; at the end the gathered LM-head shards are compared with the
single-process weight.  Exit status 1 if they do not match.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from tiny_lm import CharData, TinyLM, add_training_args, training_args

import fastgrad as fg
import fastgrad.torch as ft


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(ap)
    args = training_args(ap, argv)

    dist.init_process_group("gloo")                     # env:// rendezvous set up by torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    fg.set_num_threads(1)

    data = CharData(args.seq_len, seed=args.seed)       # same batches on every rank
    torch.manual_seed(args.seed)
    full = TinyLM(data.vocab_size, args.dim, args.seq_len)
    model = copy.deepcopy(full)
    model.lm_head = nn.Parameter(ft.shard_weight(full.lm_head.detach(), rank, world).clone())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = ft.LinearCrossEntropyLoss(process_group=dist.group.WORLD)   # layout gathered once

    single = copy.deepcopy(full) if rank == 0 else None
    opt_single = torch.optim.AdamW(single.parameters(), lr=args.lr) if rank == 0 else None
    sizes = ft.split_vocab(data.vocab_size, world)
    if rank == 0:
        print(f"world {world}: vocabulary {data.vocab_size} split {sizes} over the ranks", flush=True)
        print(f"{'step':>8} {'vocab-parallel':>15} {'single-process':>15} {'|diff|':>10}", flush=True)

    worst = 0.0
    for step in range(1, args.steps + 1):
        x, y = data.batch(args.batch)
        loss = loss_fn(model.hidden(x), model.lm_head, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            loss1 = ft.linear_cross_entropy(single.hidden(x), single.lm_head, y)
            opt_single.zero_grad()
            loss1.backward()
            opt_single.step()
            diff = abs(loss.item() - loss1.item())
            worst = max(worst, diff)
            print(f"step {step:3d} {loss.item():15.6f} {loss1.item():15.6f} {diff:10.2e}",
                  flush=True)

    # every rank must hold the same body; the shards together must be the single-process head
    body = torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters()
                      if n != "lm_head"])
    body0 = body.clone()
    dist.broadcast(body0, src=0)
    spread = torch.tensor([(body - body0).abs().max().item()])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    shards = [None] * world
    dist.all_gather_object(shards, model.lm_head.detach())
    ok = True
    if rank == 0:
        head = torch.cat(shards)
        head_diff = (head - single.lm_head.detach()).abs().max().item()
        body1 = torch.cat([p.detach().reshape(-1) for n, p in single.named_parameters()
                           if n != "lm_head"])
        body_diff = (body - body1).abs().max().item()
        ok = worst <= 1e-3 and spread.item() == 0.0
        print(f"max |loss diff| over {args.steps} steps: {worst:.2e}; body identical on all ranks: "
              f"{spread.item() == 0.0}; vs single process: LM head {head_diff:.2e}, "
              f"body {body_diff:.2e} -> {'MATCH' if ok else 'MISMATCH'}", flush=True)
    flag = torch.tensor([0 if ok else 1])
    dist.broadcast(flag, src=0)
    dist.barrier()  # no rank tears gloo down while a peer's last collective is in flight
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    raise SystemExit(main())
