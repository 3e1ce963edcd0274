"""Shared pieces of the examples: a real-text corpus shipped with Python, a tiny causal LM.

The corpus is the Zen of Python (``this.py``, stored ROT13 in the standard library) followed by
the docstrings of a few standard-library modules, tokenized by character.
"""

from __future__ import annotations

import codecs
import difflib
import inspect
import json
import os
import string
import sys
import textwrap

import torch
import torch.nn as nn

# make `import fastgrad` work from a source checkout without installing it
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def corpus() -> str:
    """Real text shipped with Python: the Zen of Python plus some stdlib docstrings."""
    import importlib.util

    spec = importlib.util.find_spec("this")
    src = open(spec.origin, encoding="utf-8").read()
    rot13 = src.split('s = """', 1)[1].split('"""', 1)[0]
    zen = codecs.decode(rot13, "rot13")
    docs = [inspect.getdoc(m) or "" for m in (textwrap, difflib, json, string)]
    return "\n\n".join([zen] + docs)


class CharData:
    """Character-level tokens of :func:`corpus` and a deterministic batch sampler."""

    def __init__(self, seq_len: int = 64, seed: int = 0):
        text = corpus()
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([index[c] for c in text], dtype=torch.int64)
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int):
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (batch_size,),
                               generator=self.gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        seq = self.tokens[idx]
        return seq[:, :-1], seq[:, 1:]          # inputs, next-character targets


class TinyLM(nn.Module):
    """Embedding + one pre-norm causal Transformer layer + final norm; the LM head is a bare
    ``[V, D]`` weight so that the loss can be fused (``hidden @ lm_head.T``)."""

    def __init__(self, vocab_size: int, dim: int = 64, seq_len: int = 64, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0,
                                                batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Parameter(torch.randn(vocab_size, dim) * dim ** -0.5)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        h = self.embed(x) + self.pos[:T]
        h = self.block(h, src_mask=self.mask[:T, :T], is_causal=True)
        return self.norm(h)                     # [B, T, D]


#: The dtypes the examples take (``--dtype``), as the ``fastgrad`` command spells them.
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def dtype_arg(s: str) -> str:
    """``--dtype``: float32 | bfloat16 (aliases fp32, bf16), returned as the full name."""
    import argparse

    key = s.strip().lower()
    if key not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected float32 or bfloat16 (aliases fp32, bf16), got {s!r}")
    return "float32" if DTYPES[key] == torch.float32 else "bfloat16"


def positive_int(s: str) -> int:
    import argparse

    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {s!r}")
    return v


def add_training_args(ap) -> None:
    """The arguments both training examples take (same defaults: same run)."""
    ap.add_argument("--steps", type=positive_int, default=40, help="training steps (default 40)")
    ap.add_argument("--quick", action="store_true", help="8 steps: a few seconds, to see it run")
    ap.add_argument("--batch", type=positive_int, default=16, help="sequences per step (default 16)")
    ap.add_argument("--seq-len", type=positive_int, default=64, help="characters per sequence (default 64)")
    ap.add_argument("--dim", type=positive_int, default=64, help="model width (default 64)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initialization and the batches (default 0)")


def training_args(ap, argv=None):
    """Parse, applying ``--quick``."""
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 8)
    return args
