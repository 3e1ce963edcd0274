"""The once-differentiable guard of fastgrad's autograd Functions."""

from __future__ import annotations

import functools

import torch

from ..errors import runtime_error

__all__ = ["refuse_double_backward", "differentiable_once"]


def refuse_double_backward(op: str = "linear_cross_entropy") -> None:
    """Raise AclnnError 361001 (a ``RuntimeError``) when called in a backward with
    ``create_graph=True`` (grad mode is on in a backward only then).

    fastgrad's backward returns gradients computed by its kernels, without a graph: under
    ``create_graph=True`` autograd would take their own derivative as zero — a Hessian of
    zeros, a gradient penalty off by its whole second-order term — so it is refused instead.
    (``torch.autograd.function.once_differentiable`` raises only when the incoming gradient
    itself requires grad, which ``hessian`` and gradient penalties do not pass.)
    """
    if torch.is_grad_enabled():
        raise runtime_error(
            f"{op} is differentiable once: a backward with create_graph=True "
            "(torch.autograd.functional.hessian, a gradient penalty, gradgradcheck) is not supported; "
            "compute such terms on torch.nn.functional.cross_entropy(hidden @ weight.T, ...)",
            "create_graph",
        )


def differentiable_once(backward):
    """Decorator of an autograd Function's ``backward``: :func:`refuse_double_backward`, then the
    body under ``torch.no_grad()``."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        refuse_double_backward()
        with torch.no_grad():
            return backward(ctx, *grads)

    return wrapper
