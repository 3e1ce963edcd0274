"""aclnn status codes and the exception every fastgrad op raises.

The codes are the ones the CANN ``aclnn`` first-stage APIs
(``aclnnXxxGetWorkspaceSize``) return; see ``docs/zh/context/aclnn返回码.md`` in
the CANN docs and the error tables of each operator's aclnn document
(``aclnnFusedLinearCrossEntropyLossGrad.md``, ``aclnnCrossEntropyLossGrad.md``, ...).

Messages read as Python's and PyTorch's do: the text first (``op: param: expected E, got G``),
the aclnn status after it in brackets; the code itself is ``.status``.
"""

from __future__ import annotations

from collections.abc import Iterable

ACLNN_SUCCESS = 0
#: A required input is ``None`` (nullptr).
ACLNN_ERR_PARAM_NULLPTR = 161001
#: A dtype, shape, value or attribute is out of the supported range.
ACLNN_ERR_PARAM_INVALID = 161002
#: The requested backend (platform) is unavailable, or the runtime failed.
ACLNN_ERR_RUNTIME_ERROR = 361001
#: what a hand-written op_api returns when its l0 op gives no result: a tiling failure or no kernel
#: for the SoC (e.g. ops-nn ``aclnn_fused_linear_cross_entropy_loss_grad.cpp:324``)
ACLNN_ERR_INNER_NULLPTR = 561103
#: a generated aclnn API whose op_host tiling fails (e.g. ``scaled_masked_softmax_grad_v2_tiling.cpp:130-132``)
ACLNN_ERR_INNER_TILING_ERROR = 561002

#: the two calls of an aclnn API, in order (:attr:`AclnnError.phase`)
PHASES = ("workspace", "run")

_NAMES = {
    ACLNN_ERR_PARAM_NULLPTR: "ACLNN_ERR_PARAM_NULLPTR",
    ACLNN_ERR_PARAM_INVALID: "ACLNN_ERR_PARAM_INVALID",
    ACLNN_ERR_RUNTIME_ERROR: "ACLNN_ERR_RUNTIME_ERROR",
    ACLNN_ERR_INNER_NULLPTR: "ACLNN_ERR_INNER_NULLPTR",
    ACLNN_ERR_INNER_TILING_ERROR: "ACLNN_ERR_INNER_TILING_ERROR",
}


class AclnnError(Exception):
    """An error with an aclnn status code.

    Catch it as ``fastgrad.AclnnError`` (every error fastgrad raises), or the way Python code
    catches bad arguments: constructing ``AclnnError(status, ...)`` gives an instance of the
    status code's subclass —

    ============  ===========================  ====================================
    status        class                        also a
    ============  ===========================  ====================================
    161001        :class:`AclnnNullptrError`   ``TypeError`` (a required argument is None)
    161002        :class:`AclnnParamError`     ``ValueError`` (a dtype, shape, value or
                                               attribute out of range)
    361001        :class:`AclnnRuntimeError`   ``RuntimeError`` (backend unavailable/failed)
    other         :class:`AclnnError`          (a code the device returned)
    ============  ===========================  ====================================

    Attributes
    ----------
    status : int
        The aclnn status code.
    param : str or None
        The offending parameter's name, when there is one (the first, when several are wrong).
    reasons : tuple of str
        Every reason found (a declaration check collects them all).
    phase : {"workspace", "run"}
        Which of the aclnn API's two calls fails on the device: ``"workspace"`` — the first
        call, ``aclnnXxxGetWorkspaceSize`` (the op_api's checks, a tiling refusal of a
        generated API), the default — or ``"run"`` — the second call, ``aclnnXxx`` (the
        launch; e.g. an l0 op that discards its launcher's status, docs/device_parity.md rows
        0a and 3f).  The ``"acl"`` backend tags the device's own errors by the call that
        returned them.
    """

    #: the default phase: the workspace-size call (``aclnnXxxGetWorkspaceSize``)
    phase: str = "workspace"

    def __new__(
        cls,
        status: int,
        message: str = "",
        param: str | None = None,
        reasons: Iterable[str] = (),
        phase: str = "workspace",
    ) -> AclnnError:
        if cls is AclnnError:
            cls = _BY_STATUS.get(int(status), AclnnError)
        return super().__new__(cls)

    def __init__(
        self,
        status: int,
        message: str = "",
        param: str | None = None,
        reasons: Iterable[str] = (),
        phase: str = "workspace",
    ):
        if phase not in PHASES:
            raise ValueError(f"AclnnError: phase: expected one of {PHASES}, got {phase!r}")
        self.status = int(status)
        self.param = param
        self.reasons = tuple(reasons) or (message,)
        self.message = message
        self.phase = phase
        super().__init__(status, message, param, self.reasons)

    def __str__(self) -> str:
        # the text first, as a PyTorch user reads errors; the code last (also in ``.status``)
        name = _NAMES.get(self.status, "ACLNN_ERR")
        return f"{self.message} [aclnn {self.status} {name}]"

    def __reduce__(self) -> tuple[type[AclnnError], tuple[int, str, str | None, tuple[str, ...], str]]:
        return (AclnnError, (self.status, self.message, self.param, self.reasons, self.phase))


class AclnnNullptrError(AclnnError, TypeError):
    """161001 ACLNN_ERR_PARAM_NULLPTR: a required input is None."""


class AclnnParamError(AclnnError, ValueError):
    """161002 ACLNN_ERR_PARAM_INVALID: a dtype, shape, value or attribute is out of range."""


class AclnnRuntimeError(AclnnError, RuntimeError):
    """361001 ACLNN_ERR_RUNTIME_ERROR: the backend is unavailable or the runtime failed."""


class InternalError(RuntimeError):
    """A broken internal invariant of fastgrad's kernels (a bug, never a user's input): an operand
    in a form its kernel does not take, a plan that contradicts its call, a buffer the plan did not
    list.  Not a ``ValueError``: code catching :class:`AclnnParamError` (a user's bad input) does
    not swallow it.  Every input the op layer accepts runs without it; one raised is a bug to report."""


class FallbackWarning(RuntimeWarning):
    """A setting asked for something this machine cannot run (the GEMM setting ``"onednn"`` where
    its accuracy probe fails, ``precision="fast"`` where no bf16 kernel runs its gradient); the
    call's plan records what runs instead (``GemmChoice.fallback``, ``TrainingPlan.fallback``) and
    the op warns once per distinct fallback per process.  Filter it like any warning."""


_BY_STATUS = {
    ACLNN_ERR_PARAM_NULLPTR: AclnnNullptrError,
    ACLNN_ERR_PARAM_INVALID: AclnnParamError,
    ACLNN_ERR_RUNTIME_ERROR: AclnnRuntimeError,
}


def null_error(param: str, op: str | None = None) -> AclnnError:
    """161001: required input ``param`` is None."""
    where = f"{op}: " if op else ""
    return AclnnError(ACLNN_ERR_PARAM_NULLPTR, f"{where}{param} is required but None was given", param)


def invalid(param: str, expected: str, got: object, op: str | None = None) -> AclnnError:
    """161002: ``param`` is out of range; the message says what was expected and given."""
    where = f"{op}: " if op else ""
    return AclnnError(ACLNN_ERR_PARAM_INVALID, f"{where}{param}: expected {expected}, got {got}", param)


def runtime_error(message: str, param: str | None = None) -> AclnnError:
    """361001: backend or runtime unavailable/failed."""
    return AclnnError(ACLNN_ERR_RUNTIME_ERROR, message, param)
