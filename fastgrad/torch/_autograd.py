"""The once-differentiable guard of fastgrad's autograd Functions."""

from __future__ import annotations

import functools

import torch

from ..errors import runtime_error

__all__ = ["refuse_double_backward", "differentiable_once"]


def refuse_double_backward(op: str = "linear_cross_entropy") -> None:
    """Raise AclnnError 361001 (a ``RuntimeError``) when called in a backward with
    ``create_graph=True`` (grad mode is on in a backward only then) or one that a ``torch.func``
    transform differentiates again.

    fastgrad's backward returns gradients computed by its kernels, without a graph: under
    ``create_graph=True`` autograd would take their own derivative as zero — a Hessian of
    zeros, a gradient penalty off by its whole second-order term — so it is refused instead.
    (``torch.autograd.function.once_differentiable`` raises only when the incoming gradient
    itself requires grad, which ``hessian`` and gradient penalties do not pass.)
    """
    if _second_order():
        raise runtime_error(
            f"{op} is differentiable once (the derivative for {op}'s backward is not implemented): "
            "a backward with create_graph=True "
            "(torch.autograd.functional.hessian, a gradient penalty, gradgradcheck) is not supported; "
            "compute such terms on torch.nn.functional.cross_entropy(hidden @ weight.T, ...)",
            "create_graph",
        )


def _second_order() -> bool:
    """Whether this backward is itself being differentiated.  Outside ``torch.func``: grad mode
    is on in a backward only under ``create_graph=True``.  Inside ``torch.func`` transforms grad
    mode is always on; there the backward is differentiated again when another grad level or a
    forward-mode (jvp) level is on the transform stack (``grad(grad(f))``, ``hessian``,
    ``jacfwd(jacrev(f))``), not under one ``grad``/``vjp``/``jacrev`` (with ``vmap``)."""
    stack = torch._C._functorch.get_interpreter_stack() or []
    if not stack:
        return torch.is_grad_enabled()
    kinds = [i.key() for i in stack]
    T = torch._C._functorch.TransformType
    return T.Jvp in kinds or kinds.count(T.Grad) > 1


def differentiable_once(backward):
    """Decorator of an autograd Function's ``backward``: :func:`refuse_double_backward`, then the
    body under ``torch.no_grad()``."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        refuse_double_backward()
        with torch.no_grad():
            return backward(ctx, *grads)

    return wrapper
