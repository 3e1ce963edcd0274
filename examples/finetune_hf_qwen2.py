"""Fine-tune a small Qwen2 (built from a transformers config, no download) on real text — the
Python standard library's docstrings, two ASCII bytes per token — with the LM-head loss through
fastgrad (``fastgrad.torch.apply_to``) and without, printing loss, tokens/s and peak memory.

    python examples/finetune_hf_qwen2.py --steps 300            # both variants, fresh processes
    python examples/finetune_hf_qwen2.py --variant fastgrad     # one of them
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import subprocess
import sys
import time


def text_ids(n: int) -> list[int]:
    import collections  # noqa: E401
    import functools
    import itertools
    import json as j
    import os
    import re
    import textwrap
    mods = (os, j, re, collections, functools, itertools, textwrap, inspect, subprocess)
    docs = "\n\n".join(inspect.getdoc(getattr(m, a)) or "" for m in mods for a in dir(m)
                       if not a.startswith("_"))
    b = [c & 127 for c in docs.encode()]
    ids = [b[i] * 128 + b[i + 1] for i in range(0, len(b) - 1, 2)]
    return (ids * (n // len(ids) + 1))[:n]


def run(variant: str, steps: int, batch: int, seq: int, vocab: int, dtype: str) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import fastgrad.torch as ft

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=seq, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)).train()
    if variant == "fastgrad":
        ft.apply_to(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ids = torch.tensor(text_ids(batch * seq * steps)).reshape(steps, batch, seq)
    losses, t0, toks = [], None, 0
    for s in range(steps):
        if s == 1:                      # step 0 compiles the kernels
            t0, toks = time.perf_counter(), 0
        loss = model(input_ids=ids[s], labels=ids[s]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        toks += batch * seq
        if s % max(1, steps // 10) == 0 or s == steps - 1:
            print(f"[{variant}] step {s:4d} loss {losses[-1]:.4f}", flush=True)
    dt = time.perf_counter() - t0 if t0 else float("nan")
    return {"variant": variant, "final_loss": losses[-1], "tokens_per_s": toks / dt,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=["fastgrad", "pytorch"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    if a.variant:
        r = run(a.variant, a.steps, a.batch, a.seq, a.vocab, a.dtype)
        print("RESULT " + json.dumps({k: v for k, v in r.items() if k != "losses"}))
        return
    res = []
    for v in ("pytorch", "fastgrad"):
        out = subprocess.run([sys.executable, __file__, "--variant", v] +
                             [f"--{k}={getattr(a, k)}" for k in ("steps", "batch", "seq", "vocab", "dtype")],
                             capture_output=True, text=True, check=True).stdout
        print(out, end="")
        res.append(json.loads(out.split("RESULT ", 1)[1]))
    print(f"\n{'variant':10s} {'final loss':>10s} {'tokens/s':>10s} {'peak RSS MiB':>13s}")
    for r in res:
        print(f"{r['variant']:10s} {r['final_loss']:10.4f} {r['tokens_per_s']:10.0f} "
              f"{r['peak_rss_mib']:13.0f}")


if __name__ == "__main__":
    main()
