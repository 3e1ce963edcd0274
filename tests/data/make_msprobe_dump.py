"""Make tests/data/msprobe_dump/: a real msprobe dump (task "tensor", level "L1") of one small step.

Run from the repository root (needs ``pip install mindstudio-probe``, CPU torch is enough)::

    python tests/data/make_msprobe_dump.py [OUT_DIR]     # default tests/data/msprobe_dump

The step uses, in bfloat16 and float32, the PyTorch functions msprobe hooks on its own
(``Functional.smooth_l1_loss``, ``Functional.embedding``, a masked softmax as
``Tensor.masked_fill`` + ``Torch.softmax``, and ``Functional.cross_entropy`` -- the trap: its
backward record holds the NLL node's gradient), and torch_npu's fused ops registered with
``PrecisionDebugger.register_custom_api(module, name, "NPU")`` as an NPU user registers them,
so that they appear as ``NPU.<name>``.

Without an NPU the registered module is :data:`STANDIN`, a stand-in for ``torch_npu`` written
here in plain PyTorch from the device's documented arithmetic (never from fastgrad, so the
comparison ``fastgrad golden --from-msprobe`` makes is between two independent computations):
every value is computed in float32 and rounded once to the output dtype, as the device does.

The dump is written to ``OUT_DIR/step0/proc<pid>/`` by msprobe and then moved to
``OUT_DIR/rank0/`` (the msprobe layout of a distributed run, ``step<N>/rank<R>/``, is the same
inside), and the absolute paths msprobe writes into ``dump.json`` and ``stack.json`` are made
relative, so the committed dump does not name this machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import types

import torch
import torch.nn.functional as F

#: Fill value of masked positions (the device's ScaledMaskedSoftmaxV2 and op-plugin's golden).
MASK_FILL = -10000.0


class _MaskedSoftmax(torch.autograd.Function):
    """``npu_scaled_masked_softmax`` and its backward, float32 inside, one rounding each."""

    @staticmethod
    def forward(ctx, x, mask, scale):
        z = (x.float() * scale).masked_fill(mask, MASK_FILL)
        y = torch.softmax(z, dim=-1).to(x.dtype)
        ctx.save_for_backward(y, mask)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, gy):
        y, mask = ctx.saved_tensors
        g, yf = gy.float(), y.float()
        gx = (g * yf - (g * yf).sum(dim=-1, keepdim=True) * yf) * ctx.scale
        return gx.masked_fill(mask, 0.0).to(y.dtype), None, None


def npu_scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False):
    assert not fixed_triu_mask
    return _MaskedSoftmax.apply(x, mask, float(scale))


class _CrossEntropy(torch.autograd.Function):
    """``npu_cross_entropy_loss`` (mean, no weight) and its backward (aclnnCrossEntropyLossGrad)."""

    @staticmethod
    def forward(ctx, x, target):
        xf = x.float()
        lp = xf - xf.max(dim=1, keepdim=True)[0]
        lp = lp - torch.log(torch.exp(lp).sum(dim=1, keepdim=True))
        loss = (-lp.gather(1, target[:, None]).sum() / x.shape[0]).reshape(1)
        log_prob = lp.to(x.dtype)
        ctx.save_for_backward(log_prob, target)
        ctx.mark_non_differentiable(log_prob)
        return loss.to(x.dtype), log_prob

    @staticmethod
    def backward(ctx, g, _):
        log_prob, target = ctx.saved_tensors
        p = torch.exp(log_prob.float())
        p[torch.arange(p.shape[0]), target] -= 1.0
        return (p * (g.float().reshape(()) / p.shape[0])).to(log_prob.dtype), None


def npu_cross_entropy_loss(input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    assert weight is None and reduction == "mean" and label_smoothing == 0.0
    loss, log_prob = _CrossEntropy.apply(input, target)
    return loss, log_prob, torch.empty(0, dtype=input.dtype), torch.empty(0, dtype=input.dtype)


def npu_fused_linear_online_max_sum(input, weight, target, vocab_start_index, vocab_end_index, return_logits=False):
    # the device's matmul writes the logits in the input dtype; max/exp/sum run in float32
    logits = (input.float() @ weight.float().T).to(input.dtype).float()
    m = logits.max(dim=1)[0]
    s = torch.exp(logits - m[:, None]).sum(dim=1)
    bits = (target < vocab_start_index) | (target >= vocab_end_index)
    mt = torch.where(bits, torch.zeros_like(target), target - vocab_start_index)
    pred = torch.where(bits, 0.0, logits.gather(1, mt[:, None])[:, 0] - m)
    n = (input.shape[0] + 7) // 8 * 8
    padded = torch.cat([bits, torch.full((n - bits.numel(),), vocab_start_index > 0)]).to(torch.uint8)
    packed = (padded.reshape(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(dim=1).to(torch.uint8)
    vpl = logits.to(input.dtype) if return_logits else torch.empty(0, dtype=input.dtype)
    return m, s, pred, packed, mt, vpl


def npu_fused_linear_cross_entropy_loss_with_max_sum_backward(
    grad,
    input,
    weight,
    target_mask,
    masked_target,
    label_smoothing=0.0,
    logits_max=None,
    sum_exp_logits=None,
    softmax=None,
):
    # memory-saving mode: fp32 logits, p = exp(l - max) / sum, -1 at the owned targets, times
    # grad, rounded to the input dtype before the two GEMMs (fp32 accumulation, one rounding)
    logits = input.float() @ weight.float().T
    p = torch.exp(logits - logits_max[:, None]) / sum_exp_logits[:, None]
    bits = ((target_mask[torch.arange(grad.shape[0]) // 8] >> (torch.arange(grad.shape[0]) % 8)) & 1).bool()
    rows = torch.nonzero(~bits)[:, 0]
    p[rows, masked_target[rows]] -= 1.0
    g = (p * grad[:, None]).to(input.dtype).float()
    return (g @ weight.float()).to(input.dtype), (g.T @ input.float()).to(input.dtype)


#: The stand-in for ``torch_npu`` (registered under the prefix "NPU").
STANDIN = types.ModuleType("torch_npu_standin")
for _f in (
    npu_scaled_masked_softmax,
    npu_cross_entropy_loss,
    npu_fused_linear_online_max_sum,
    npu_fused_linear_cross_entropy_loss_with_max_sum_backward,
):
    setattr(STANDIN, _f.__name__, _f)


#: The API names dumped (msprobe's "list": substrings of the API name); everything else the step
#: runs (Tensor.__add__, ...) is left out of the dump to keep it small.
DUMPED = ("smooth_l1_loss", "embedding", "softmax", "cross_entropy", "npu_")


def step(dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """One small training step's worth of the ops, in ``dtype``; returns the loss."""
    T, D, W = 12, 16, 20
    x = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    tgt = torch.randn(T, D, generator=g).to(dtype)
    sl1 = F.smooth_l1_loss(x, tgt, beta=0.5)

    emb = torch.randn(W, D, generator=g).to(dtype).requires_grad_()
    idx = torch.randint(0, W, (3, 5), generator=g)
    idx[0, :3] = 7  # a repeated row
    e = F.embedding(idx, emb)
    e_loss = (e.float() * torch.randn(e.shape, generator=g)).sum()

    scores = torch.randn(2, 2, 8, 32, generator=g).to(dtype).requires_grad_()
    mask = torch.rand(2, 1, 8, 32, generator=g) < 0.25
    y = torch.softmax(scores.masked_fill(mask, MASK_FILL), dim=-1)  # masked_fill + Torch.softmax
    y_npu = STANDIN.npu_scaled_masked_softmax(scores, mask, 0.125)  # NPU.npu_scaled_masked_softmax
    sm_loss = (y.float() * torch.randn(y.shape, generator=g)).sum() + (
        y_npu.float() * torch.randn(y.shape, generator=g)
    ).sum()

    logits = torch.randn(6, 40, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, 40, (6,), generator=g)
    ce = F.cross_entropy(logits, target)  # the trap: its backward record is the NLL node's
    ce_npu, _, _, _ = STANDIN.npu_cross_entropy_loss(logits, target)  # NPU.npu_cross_entropy_loss
    return sl1.float() + e_loss + sm_loss + ce.float() + ce_npu.float().sum()


def fused_linear(g: torch.Generator) -> None:
    """The vocabulary-parallel pair as verl calls it: forward statistics, then the grad op."""
    BT, H, V = 12, 32, 48
    x = torch.randn(BT, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(torch.bfloat16)
    target = torch.randint(0, 2 * V, (BT,), generator=g)  # about half the rows on another shard
    m, s, _pred, tm, mt, _ = STANDIN.npu_fused_linear_online_max_sum(x, w, target, 0, V)
    grad = torch.full((BT,), 1.0 / BT)
    STANDIN.npu_fused_linear_cross_entropy_loss_with_max_sum_backward(grad, x, w, tm, mt, 0.0, m, s)


def _relativize(dump_dir: str, absolute: str) -> None:
    """Drop this machine's paths from dump.json / stack.json / construct.json."""
    for name in ("dump.json", "stack.json", "construct.json"):
        p = os.path.join(dump_dir, name)
        if not os.path.exists(p):
            continue
        with open(p) as f:
            text = f.read()
        text = text.replace(absolute, ".")
        text = re.sub(r"File [^,\"]*/site-packages/", "File <site-packages>/", text)
        text = re.sub(r"File [^,\"]*/(tests/data/make_msprobe_dump\.py)", r"File \1", text)
        with open(p, "w") as f:
            f.write(text)
    with open(os.path.join(dump_dir, "dump.json")) as f:
        d = json.load(f)
    d["dump_data_dir"] = "./dump_tensor_data"
    with open(os.path.join(dump_dir, "dump.json"), "w") as f:
        json.dump(d, f, indent=1)


def main(out: str) -> str:
    from msprobe.pytorch import PrecisionDebugger

    tmp = tempfile.mkdtemp(prefix="msprobe_dump_")
    config = os.path.join(tmp, "config.json")
    with open(config, "w") as f:  # msprobe's config; "list" keeps the APIs whose name holds one of these
        json.dump(
            {
                "task": "tensor",
                "dump_path": tmp,
                "rank": [],
                "step": [],
                "level": "L1",
                "tensor": {"scope": [], "list": list(DUMPED), "data_mode": ["all"]},
            },
            f,
        )
    dbg = PrecisionDebugger(config_path=config, task="tensor", level="L1", dump_path=tmp)
    for name in (
        "npu_scaled_masked_softmax",
        "npu_cross_entropy_loss",
        "npu_fused_linear_online_max_sum",
        "npu_fused_linear_cross_entropy_loss_with_max_sum_backward",
    ):
        PrecisionDebugger.register_custom_api(STANDIN, name, "NPU")
    g = torch.Generator().manual_seed(27)
    dbg.start()
    loss = step(torch.bfloat16, g) + step(torch.float32, g)
    loss.backward()
    fused_linear(g)
    dbg.stop()
    dbg.step()
    (proc,) = [os.path.join(tmp, "step0", d) for d in os.listdir(os.path.join(tmp, "step0"))]
    os.remove(config)
    _relativize(proc, proc)
    rank = os.path.join(out, "rank0")
    if os.path.exists(rank):
        shutil.rmtree(rank)
    os.makedirs(out, exist_ok=True)
    shutil.move(proc, rank)
    shutil.rmtree(tmp)
    return rank


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    print(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "msprobe_dump")))
