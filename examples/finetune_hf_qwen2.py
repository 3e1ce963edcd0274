"""Fine-tune a small Qwen2 with and without fastgrad's LM-head loss, side by side.

The model is built from a transformers config (no download: hidden 256, 2 layers, a 32,768-word
vocabulary by default) and trained on real text — the Python standard library's docstrings, two
ASCII bytes per token — once with the LM-head loss through fastgrad (``fastgrad.torch.apply_to``)
and once without, each in a fresh process, printing the loss as it goes, then tokens/s and peak
memory of both.

    python examples/finetune_hf_qwen2.py --quick            # 6 steps of 128 tokens each: ~3 min on 2 cores
    python examples/finetune_hf_qwen2.py                    # 300 steps of 256 tokens each: ~50 min on 2 cores
    python examples/finetune_hf_qwen2.py --variant fastgrad # one of them, in this process

Needs ``pip install transformers`` besides torch.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_lm import DTYPES, dtype_arg, positive_int  # noqa: E402  (also puts the checkout on sys.path)


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
    model = Qwen2ForCausalLM(cfg).to(DTYPES[dtype]).train()
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
        losses.append(loss.detach().item())   # (float(loss) of a tensor that requires grad warns)
        toks += batch * seq
        if s % max(1, steps // 10) == 0 or s == steps - 1:
            print(f"[{variant}] step {s:4d} loss {losses[-1]:.4f}", flush=True)
    dt = time.perf_counter() - t0 if t0 else float("nan")
    return {"variant": variant, "final_loss": losses[-1], "tokens_per_s": toks / dt,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=["fastgrad", "pytorch"],
                   help="run only this variant, in this process (default: both, each in a fresh process)")
    p.add_argument("--steps", type=positive_int, default=300, help="optimizer steps per variant (default 300)")
    p.add_argument("--quick", action="store_true", help="6 steps of --seq 128 per variant: to see it run")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq", type=positive_int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--vocab", type=positive_int, default=32768,
                   help="vocabulary size of the generated config (default 32768; the LM head is [vocab, 256])")
    p.add_argument("--dtype", type=dtype_arg, default="float32",
                   help="model dtype: float32 | bfloat16 (aliases fp32, bf16; default float32)")
    a = p.parse_args()
    if a.quick:
        a.steps, a.seq = min(a.steps, 6), min(a.seq, 128)
    if a.variant:
        r = run(a.variant, a.steps, a.batch, a.seq, a.vocab, a.dtype)
        print("RESULT " + json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
        return
    res = []
    for v in ("pytorch", "fastgrad"):
        cmd = [sys.executable, __file__, "--variant", v] + [
            f"--{k}={getattr(a, k)}" for k in ("steps", "batch", "seq", "vocab", "dtype")]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:                    # stream the child's lines as they come
                if line.startswith("RESULT "):
                    res.append(json.loads(line.split("RESULT ", 1)[1]))
                else:
                    print(line, end="", flush=True)
        if proc.returncode:
            raise SystemExit(f"the {v} run failed (exit status {proc.returncode})")
    print(f"\n{'variant':10s} {'final loss':>10s} {'tokens/s':>10s} {'peak RSS MiB':>13s}")
    for r in res:
        print(f"{r['variant']:10s} {r['final_loss']:10.4f} {r['tokens_per_s']:10.0f} "
              f"{r['peak_rss_mib']:13.0f}")


if __name__ == "__main__":
    main()
