"""Cut Cross-Entropy's own tests, run on fastgrad.

Ported from apple/ml-cross-entropy at commit d42911f9b1a1f98289bb601c35c8151562603d74:

* ``tests/test_cce_loss_forward.py::test_loss_forward`` (its ``_loss`` reference);
* ``tests/test_cce_loss_backward.py::test_loss_backward`` (its ``_grads`` reference) and
  ``test_loss_partials``;
* ``tests/test_cce_lse.py::test_lse`` (its ``_lse`` reference);
* ``tests/test_compute_z_loss.py::test_compute_z_loss`` (the z-loss term the backward test adds);
* ``cut_cross_entropy/utils.py``: ``softcapping``, ``compute_z_loss``; ``IGNORE_INDEX = -100``.

CCE's rule is kept: with ``gt`` the reference in fp32 on the same (dtype-rounded) values and
``ref`` the reference computed in the input dtype, fastgrad's error against ``gt`` must be at most
``ref``'s error plus ``error_tol`` (per dtype, as in each file), element by element.

The mapping to fastgrad's API (docs/torch.md):

* CCE's ``impl`` — ``"cce"`` (``filter_eps="auto"``, CCE's default) and ``"cce_exact"`` (no
  filtering) — are fastgrad's ``filter_eps="auto"`` and ``filter_eps=None`` (the forward has no
  filter: one run); CCE's ``"torch_compile"`` is CCE's own torch fallback, not a fastgrad path.
* ``shift``, ``softcap``, ``bias``, ``reduction``, ``ignore_index`` are fastgrad's keywords of
  the same names and meanings.
* ``return_lse=True`` + ``compute_z_loss(lse, targets, shift)`` (CCE's z-loss: the mean of
  ``lse²`` over the non-ignored tokens, added to the loss) is fastgrad's ``lse_square_scale``:
  ``"mean"``: ``lse_square_scale=1``; ``"sum"`` (the test divides by the valid count):
  ``lse_square_scale=1``, the sum divided likewise; ``"none"`` (the test takes ``.mean()`` over
  all positions): ``lse_square_scale = n_positions / n_valid``, so the per-token z-loss averaged
  over all positions is CCE's mean over the valid ones.
* ``test_lse``: the log-sum-exp is the op's output (``fastgrad.linear_cross_entropy(...).lse``,
  the kernel under ``fastgrad.torch.linear_cross_entropy``; the torch function keeps it for its
  backward but does not return it).
* CCE's backward test divides the ``"sum"`` loss by the valid count of the *unshifted* targets on
  its own side and of the shifted ones in its reference; the port uses the shifted count (the
  loss's own tokens) on both sides.

The tests run on the CPU (CCE's need CUDA); the shapes are CCE's own.  The backward grid's
``(256, 512, 128)`` and ``(252, 507, 128)`` rows are ``@pytest.mark.extended``; the default run
covers every flag combination on CCE's oddest shape ``(252, 507, 123)``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402

IGNORE_INDEX = -100
# the peers' own full-size shapes: `pytest -m extended` (minutes; not in CI — the same test
# bodies run in the default suite at the scaled shapes above)
extended = pytest.mark.extended


def softcapping(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(logits / softcap) * softcap


def compute_z_loss(lse, targets=None, shift=False, ignore_index=IGNORE_INDEX, reduction="mean"):
    """CCE's ``cut_cross_entropy/utils.py::compute_z_loss``."""
    z_loss = lse.pow(2)
    if targets is not None:
        shift = int(shift)
        if shift != 0:
            targets = targets[..., shift:]
        is_not_ignore_index = targets != ignore_index
        z_loss = torch.where(is_not_ignore_index, z_loss, 0.0)
        if reduction == "mean":
            z_loss *= z_loss.numel() / is_not_ignore_index.count_nonzero().type_as(z_loss)
    if reduction == "mean":
        z_loss = z_loss.mean()
    elif reduction == "sum":
        z_loss = z_loss.sum()
    return z_loss


SHAPES_FWD = [(256, 512, 128), (252, 507, 128), (252, 507, 123)]
SHAPES_BWD = [
    pytest.param((256, 512, 128), marks=extended, id="256x512x128"),
    pytest.param((252, 507, 128), marks=extended, id="252x507x128"),
    pytest.param((252, 507, 123), id="252x507x123"),
]


def _inputs(shape, dtype, has_bias, bias_scale, invalids):
    torch.manual_seed(0)
    N, V, D = shape
    e = torch.randn((N, D), dtype=dtype) / (D**0.5)
    c = torch.randn((V, D), dtype=dtype)
    c[0 : min(N, V) // 2] = e[0 : min(N, V) // 2]
    bias = torch.randn(V, dtype=dtype) * bias_scale if has_bias else None
    targets = torch.randint(0, V, size=(N,))
    if invalids:
        inds = torch.randperm(len(targets))[0 : int(0.2 * len(targets))]
        targets[inds] = IGNORE_INDEX
    return e, c, bias, targets


# ---------------------------------------------------------------------------------------------
# tests/test_cce_loss_forward.py
# ---------------------------------------------------------------------------------------------


def _loss(e, c, targets, bias, softcap, shift):
    N, T = targets.size()
    if shift != 0:
        e = e[:, :-shift]
        targets = targets[:, shift:]
        T = T - shift
    e = e.flatten(0, -2)
    targets = targets.flatten()
    logits = e @ c.T
    if bias is not None:
        logits += bias
    if softcap is not None:
        logits = softcapping(logits, softcap)
    loss = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return loss.view(N, T)


@pytest.mark.parametrize("dtype,error_tol", [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("shift", [0, 2])
@pytest.mark.parametrize("invalids", [False, True])
@pytest.mark.parametrize("shape", SHAPES_FWD)
def test_loss_forward(dtype, error_tol, softcap, has_bias, shift, invalids, shape):
    e, c, bias, targets = _inputs(shape, dtype, has_bias, 0.01, invalids)
    D = shape[2]
    e = e.view(4, -1, D)
    targets = targets.view(e.size()[0:-1])
    gt = _loss(e.float(), c.float(), targets, bias.float() if bias is not None else None, softcap, shift)
    ref = _loss(e, c, targets, bias, softcap, shift)
    cce_loss = ft.linear_cross_entropy(e, c, targets, bias=bias, softcap=softcap, shift=shift, reduction="none")
    assert cce_loss.shape == gt.shape
    expected_error = (gt - ref).abs()
    cce_error = (gt - cce_loss).abs()
    assert (cce_error <= (expected_error + error_tol)).all(), f"{(cce_error - expected_error).relu().max()=}"


# ---------------------------------------------------------------------------------------------
# tests/test_cce_loss_backward.py
# ---------------------------------------------------------------------------------------------


def _grads(e, c, targets, bias, softcap, shift, reduction, z_loss, fp32=False):
    orig_e, orig_c, orig_bias = e, c, bias
    if bias is not None:
        bias.grad = None
    e.grad = c.grad = None
    N, T = targets.size()
    if shift:
        e = e[:, :-1]
        targets = targets[:, 1:]
        T = T - 1
    e = e.flatten(0, -2)
    targets = targets.flatten()
    if fp32:
        e = e.float()
        c = c.float()
        bias = bias.float() if bias is not None else None
    logits = e @ c.T
    if bias is not None:
        logits += bias
    if softcap is not None:
        logits = softcapping(logits, softcap)
    loss = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    if reduction == "sum":
        loss = loss / (targets != IGNORE_INDEX).count_nonzero()
    loss = loss.mean()
    if z_loss:
        lse = torch.logsumexp(logits.float(), dim=-1)
        loss = loss + compute_z_loss(lse, targets)
    loss.backward()
    out = [orig_e.grad.detach().clone(), orig_c.grad.detach().clone()]
    if bias is not None:
        out.append(orig_bias.grad.detach().clone())
    return tuple(out)


def _fastgrad_loss(e, c, targets, bias, softcap, shift, reduction, z_loss, filter_eps):
    """CCE's call and post-processing in fastgrad's terms (module docstring)."""
    kept = targets[:, int(shift):]
    n_valid = (kept != IGNORE_INDEX).count_nonzero()
    scale = 0.0
    if z_loss:
        scale = 1.0 if reduction != "none" else kept.numel() / max(int(n_valid), 1)
    loss = ft.linear_cross_entropy(e, c, targets, bias=bias, softcap=softcap, shift=shift, reduction=reduction,
                                   lse_square_scale=scale, filter_eps=filter_eps)
    if reduction == "sum":
        loss = loss / n_valid
    return loss.mean()


@pytest.mark.parametrize("impl", ["cce", "cce_exact"])
@pytest.mark.parametrize("dtype,error_tol", [(torch.float32, 5e-4), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("invalids", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("z_loss", [True, False])
@pytest.mark.parametrize("shape", SHAPES_BWD)
def test_loss_backward(impl, dtype, error_tol, softcap, has_bias, shift, invalids, reduction, z_loss, shape):
    e, c, bias, targets = _inputs(shape, dtype, has_bias, 0.02, invalids)
    D = shape[2]
    e = e.view(4, -1, D)
    targets = targets.view(e.size()[0:-1])
    if bias is not None:
        bias.requires_grad_(True)
    e.requires_grad_(True)
    c.requires_grad_(True)

    gt = _grads(e, c, targets, bias, softcap, shift, reduction, z_loss, fp32=True)
    ref = _grads(e, c, targets, bias, softcap, shift, reduction, z_loss)

    e.grad = c.grad = None
    if bias is not None:
        bias.grad = None
    loss = _fastgrad_loss(e, c, targets, bias, softcap, shift, reduction, z_loss,
                          "auto" if impl == "cce" else None)
    loss.backward()
    assert e.grad is not None and c.grad is not None
    cce = (e.grad, c.grad) if bias is None else (e.grad, c.grad, bias.grad)

    expected_error = tuple((vgt - vref).abs().flatten() for vgt, vref in zip(gt, ref, strict=True))
    cce_error = tuple((vgt - vcce).abs().flatten() for vgt, vcce in zip(gt, cce, strict=True))
    for i in range(len(expected_error)):
        if not (cce_error[i] <= (expected_error[i] + error_tol)).all():
            errors = (cce_error[i] - expected_error[i]).relu()
            k = int(errors.argmax())
            raise AssertionError(
                f"{i=}, {errors.max()=}, {cce[i].flatten()[k]=}, {gt[i].flatten()[k]=}, {ref[i].flatten()[k]=}"
            )


@pytest.mark.parametrize("compute_de,compute_dc,compute_dbias", [(True, False, True), (False, True, False),
                                                                 (False, False, True)])
def test_loss_partials(compute_de, compute_dc, compute_dbias):
    torch.manual_seed(0)
    dtype = torch.bfloat16
    N, V, D = (256, 512, 128)
    e = torch.randn((N, D), dtype=dtype) / (D**0.5)
    c = torch.randn((V, D), dtype=dtype)
    bias = torch.randn(V, dtype=dtype) * 0.01
    c[0 : min(N, V) // 2] = e[0 : min(N, V) // 2]
    targets = torch.randint(0, V, size=(N,))
    e = e.view(4, -1, D)
    targets = targets.view(e.size()[0:-1])
    e.requires_grad_(compute_de)
    c.requires_grad_(compute_dc)
    bias.requires_grad_(compute_dbias)
    loss = ft.linear_cross_entropy(e, c, targets, bias=bias, reduction="mean")
    loss.backward()
    assert (e.grad is not None) == compute_de
    assert (c.grad is not None) == compute_dc
    assert (bias.grad is not None) == compute_dbias


# ---------------------------------------------------------------------------------------------
# tests/test_cce_lse.py
# ---------------------------------------------------------------------------------------------


def _lse(e, c, bias, softcap):
    logits = e @ c.T
    if bias is not None:
        logits += bias
    if softcap is not None:
        logits = softcapping(logits, softcap)
    return torch.logsumexp(logits.float(), dim=-1)


def _np(x):
    if x is None:
        return None
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("shape", [(256, 512, 128), (255, 507, 128), (255, 507, 123)])
def test_lse(dtype, softcap, has_bias, shape):
    e, c, bias, _ = _inputs(shape, dtype, has_bias, 0.02, False)
    gt = _lse(e.float(), c.float(), bias.float() if bias is not None else None, softcap)
    ref = _lse(e, c, bias, softcap)
    target = torch.zeros(shape[0], dtype=torch.int64)
    res = fg.linear_cross_entropy(_np(e), _np(c), target.numpy(), _np(bias), softcap=softcap, reduction="none")
    cce_lse = torch.from_numpy(np.asarray(res.lse))
    assert cce_lse.shape == gt.shape
    expected_error = (gt - ref).abs()
    cce_error = (gt - cce_lse).abs()
    assert (cce_error <= (expected_error + 1e-5)).all(), f"{(cce_error - expected_error).relu().max()=}"


# ---------------------------------------------------------------------------------------------
# tests/test_compute_z_loss.py — the z-loss of fastgrad's lse_square_scale, CCE's expected sums
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("invalids", [False, True])
def test_compute_z_loss(reduction, invalids, shift):
    """CCE feeds ``lse = 1..10`` to ``compute_z_loss``.  Here the same log-sum-exps come out of
    fastgrad's loss — hidden ``[10, 1]`` rows ``h_i`` and a two-word head ``[[1], [-1]]`` so that
    ``lse_i = log(e^{h_i} + e^{-h_i})`` is solved for ``h_i`` to give ``lse_i = i`` — and its
    ``return_z_loss`` output (``lse_square_scale = 1``) must be CCE's expected value."""
    lse = torch.arange(1, 11, dtype=torch.float64)
    h = torch.acosh(torch.exp(lse) / 2).unsqueeze(-1)  # e^h + e^-h = 2 cosh h = e^lse
    w = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    if invalids:
        targets = torch.full((lse.size(0) + int(shift),), IGNORE_INDEX, dtype=torch.int64)
        targets[3] = 1
        targets[5] = 1
    else:
        targets = torch.zeros(lse.size(0) + int(shift), dtype=torch.int64)
    hidden = torch.cat([h, torch.zeros(int(shift), 1, dtype=torch.float64)]) if shift else h
    out = ft.linear_cross_entropy(hidden, w, targets, reduction=reduction, shift=shift, lse_square_scale=1.0,
                                  return_z_loss=True)
    z_loss = out.z_loss
    if reduction == "none":
        assert z_loss.shape == lse.shape
    else:
        assert z_loss.shape == torch.Size([])
    if reduction == "mean":
        z_loss = z_loss * (lse.numel() if not invalids else 2)
    z_loss = z_loss.sum()
    # CCE's own helper on the same lse agrees, and both equal CCE's closed form
    cce = compute_z_loss(lse, targets=targets if invalids else None, shift=shift, reduction=reduction)
    if reduction == "mean":
        cce = cce * (lse.numel() if not invalids else 2)
    if not invalids:
        expected_z_loss = sum(i**2 for i in range(1, 11))
    else:
        expected_z_loss = (4 - int(shift)) ** 2 + (6 - int(shift)) ** 2
    assert torch.isclose(cce.sum(), torch.as_tensor(expected_z_loss, dtype=torch.float64))
    assert torch.isclose(z_loss, torch.as_tensor(expected_z_loss, dtype=torch.float64))
