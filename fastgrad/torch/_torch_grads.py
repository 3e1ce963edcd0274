"""The training loss's gradients and tangents in chunked torch ops, for a *batch* of cotangents or
tangents (``torch.autograd.grad(..., is_grads_batched=True)``, gradcheck's batched checks,
``torch.func.jacrev``, batched forward-mode AD), which the kernels cannot take: from the saved
``lse`` (and ``μ``), ``[BT, 2048]`` vocabulary chunks at a time, never ``[BT, V]``
(:class:`fastgrad.torch.functional.LinearCrossEntropyFunction`'s backward and jvp)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import runtime_error

_T_CHUNK = 2048  # vocabulary columns per chunk of the torch computations (never [BT, V])


def _torch_coef(st, h, weight, bias, ce_weight, t, lse, z_mean, c, cz, ch, v0, v1):
    """``dloss/dL`` of the vocabulary columns ``[v0, v1)`` of this shard, in torch, from the saved
    ``lse`` (and ``μ``): ``a·p_v - b·[v=t] - e·w_v`` (+ the entropy's ``ch·p_v·(μ - z_v)``) through
    the temperature and softcap (:func:`fastgrad.linear_cross_entropy`'s formula); ``c``, ``cz``,
    ``ch`` the rows' coefficients of the cross-entropy, z-loss and entropy terms (they may be a
    batch under ``vmap``)."""
    cfg = st.cfg
    cdt = lse.dtype
    X = h.detach().to(cdt)
    W = weight.detach()[v0:v1].to(cdt)
    L = X @ W.T
    if bias is not None:
        L = L + bias.detach()[v0:v1].to(cdt)
    T, cap = cfg["temperature"], cfg["softcap"]
    if cap is not None:
        th = torch.tanh(L / cap)
        z = cap * th / T
        dz = (1 - th * th) / T
    else:
        z = L / T
        dz = None if T == 1.0 else 1.0 / T
    p = torch.exp(z - lse[:, None])
    eps, V, start = cfg["label_smoothing"], cfg["V"], cfg["start"]
    valid = t != cfg["ignore_index"]
    tl = torch.where(valid, t.long(), torch.zeros_like(t.long()))
    if ce_weight is None:
        wt = valid.to(cdt)
        wsum = float(V)
        wv = None
    else:
        cw = ce_weight.to(cdt)
        wt = torch.where(valid, cw[tl], torch.zeros((), dtype=cdt))
        wsum = cw.sum()
        wv = cw[start + v0 : start + v1]
    a = c * ((1 - eps) * wt + eps * wsum / V) + cz * 2 * cfg["lse_square_scale"] * lse * valid
    u = a.unsqueeze(-1) * p
    cols = torch.arange(start + v0, start + v1)
    onehot = (tl[:, None] == cols[None, :]) & valid[:, None]
    u = u - (c * (1 - eps) * wt).unsqueeze(-1) * onehot.to(cdt)
    if eps:
        e = c * eps / V
        u = u - e.unsqueeze(-1) * (1.0 if wv is None else wv)
    if ch is not None:
        u = u + ch.unsqueeze(-1) * p * (z_mean[:, None] - z)
    return u if dz is None else u * dz


def _row_coefs(st, t, lse, ce_weight, grad_loss, grad_entropy):
    """The rows' coefficients ``(c, cz, ch)`` of the cross-entropy, z-loss and entropy terms
    for the upstream gradients (each a batch under ``vmap``; 0 on ignored rows)."""
    cfg = st.cfg
    cdt = lse.dtype
    valid = (t != cfg["ignore_index"]).to(cdt)
    red = cfg["reduction"]
    if red == "mean":
        n = valid.sum()
        tl = torch.where(t != cfg["ignore_index"], t.long(), torch.zeros_like(t.long()))
        wsum = n if ce_weight is None else (ce_weight.to(cdt)[tl] * valid).sum()
        norm_ce, norm_z = 1 / wsum, 1 / n
    else:
        norm_ce = norm_z = 1.0

    def row(g, norm):
        if g is None:
            return None
        g = g.to(cdt)
        if red != "none":
            g = g.unsqueeze(-1)
        return g * valid * norm

    zero = torch.zeros((), dtype=cdt)
    c = row(grad_loss, norm_ce) if grad_loss is not None else zero * valid
    cz = row(grad_loss, norm_z) if grad_loss is not None else zero * valid
    return c, cz, row(grad_entropy, norm_z)


def torch_grads(st, need, grad_loss, grad_entropy, h, weight, bias, ce_weight, t, lse, z_mean):
    """The recompute in chunked torch ops (a batch of cotangents): ``grad_input = Σ_c G_c·W_c``,
    ``grad_weight[c] = G_cᵀ·X``, ``grad_bias[c] = Σ_r G_c`` with ``G_c = dloss/dL`` of the chunk
    (:func:`_torch_coef`), never ``[BT, V]``."""
    if st.cfg["group"] is not None:
        raise runtime_error(
            "linear_cross_entropy: batched gradients (is_grads_batched, vmap of the backward) are not "
            "supported with a process_group (vocabulary parallelism)",
            "process_group",
        )
    c, cz, ch = _row_coefs(st, t, lse, ce_weight, grad_loss, grad_entropy)
    K = weight.shape[0]
    cdt = lse.dtype
    X = h.detach().to(cdt)
    gi = None
    gws, gbs = [], []
    for v0 in range(0, K, _T_CHUNK):
        v1 = min(K, v0 + _T_CHUNK)
        G = _torch_coef(st, h, weight, bias, ce_weight, t, lse, z_mean, c, cz, ch, v0, v1)
        if need[0]:
            part = G @ weight.detach()[v0:v1].to(cdt)
            gi = part if gi is None else gi + part
        if need[1]:
            gws.append(G.transpose(-1, -2) @ X)
        if need[2] and bias is not None:
            gbs.append(G.sum(-2))
    return (
        None if gi is None else gi.to(h.dtype),
        torch.cat(gws, -2).to(weight.dtype) if gws else None,
        torch.cat(gbs, -1).to(bias.dtype) if gbs else None,
    )


def torch_tangent(st, th, tw, tb, h, weight, bias, ce_weight, t, lse, z_mean):
    """Forward-mode AD in chunked torch ops (a batch of tangents): ``losṡ_r = Σ_c Σ_v
    G_c ⊙ (Ẋ·W_cᵀ + X·Ẇ_cᵀ + ḃ_c)`` at a unit cotangent, never ``[BT, V]``."""
    cfg = st.cfg
    if cfg["group"] is not None:
        raise runtime_error(
            "linear_cross_entropy: batched forward-mode AD is not supported with a process_group "
            "(vocabulary parallelism)",
            "process_group",
        )
    cdt = lse.dtype
    BT = h.shape[0]
    none = cfg["reduction"] == "none"
    one = torch.ones(BT if none else (), dtype=cdt)
    X = h.detach().to(cdt)
    K = weight.shape[0]

    def tangent(c, cz, ch):
        acc: Any = torch.zeros(BT, dtype=cdt)
        for v0 in range(0, K, _T_CHUNK):
            v1 = min(K, v0 + _T_CHUNK)
            G = _torch_coef(st, h, weight, bias, ce_weight, t, lse, z_mean, c, cz, ch, v0, v1)
            Ld = None
            if th is not None:
                Ld = th.to(cdt) @ weight.detach()[v0:v1].to(cdt).T
            if tw is not None:
                d = X @ tw[v0:v1].to(cdt).transpose(-1, -2)
                Ld = d if Ld is None else Ld + d
            if tb is not None:
                d = tb[v0:v1].to(cdt).unsqueeze(0)
                Ld = d if Ld is None else Ld + d
            acc = acc + (G * Ld).sum(-1)
        return acc if none else acc.sum(-1)

    c, cz, _ = _row_coefs(st, t, lse, ce_weight, one, None)
    loss_t = tangent(c, cz, None)
    ent_t = None
    if cfg["return_entropy"]:
        c0, cz0, ch = _row_coefs(st, t, lse, ce_weight, None, one)
        ent_t = tangent(c0, cz0, ch)
    return loss_t, ent_t
