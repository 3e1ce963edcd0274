"""aclnn status codes and the exception every fastgrad op raises.

The codes are the ones the CANN ``aclnn`` first-stage APIs
(``aclnnXxxGetWorkspaceSize``) return; see ``docs/zh/context/aclnn返回码.md`` in
the CANN docs and the error tables of the seed documents.
"""

from __future__ import annotations

ACLNN_SUCCESS = 0
#: A required input is ``None`` (nullptr).
ACLNN_ERR_PARAM_NULLPTR = 161001
#: A dtype, shape, value or attribute is out of the supported range.
ACLNN_ERR_PARAM_INVALID = 161002
#: The requested backend (platform) is unavailable, or the runtime failed.
ACLNN_ERR_RUNTIME_ERROR = 361001

_NAMES = {
    ACLNN_ERR_PARAM_NULLPTR: "ACLNN_ERR_PARAM_NULLPTR",
    ACLNN_ERR_PARAM_INVALID: "ACLNN_ERR_PARAM_INVALID",
    ACLNN_ERR_RUNTIME_ERROR: "ACLNN_ERR_RUNTIME_ERROR",
}


class AclnnError(Exception):
    """An error with an aclnn status code.

    Attributes
    ----------
    status : int
        The aclnn status code (161001, 161002, 361001, or a code returned by the device).
    param : str or None
        The offending parameter's name, when there is one.
    """

    def __init__(self, status: int, message: str, param: str | None = None):
        self.status = int(status)
        self.param = param
        name = _NAMES.get(self.status, "ACLNN_ERR")
        super().__init__(f"[{self.status} {name}] {message}")


def null_error(param: str, op: str | None = None) -> AclnnError:
    """161001: required input ``param`` is None."""
    where = f"{op}: " if op else ""
    return AclnnError(ACLNN_ERR_PARAM_NULLPTR,
                      f"{where}{param} is required but None was given", param)


def invalid(param: str, expected: str, got, op: str | None = None) -> AclnnError:
    """161002: ``param`` is out of range; the message says what was expected and given."""
    where = f"{op}: " if op else ""
    return AclnnError(ACLNN_ERR_PARAM_INVALID,
                      f"{where}{param}: expected {expected}, got {got}", param)


def runtime_error(message: str, param: str | None = None) -> AclnnError:
    """361001: backend or runtime unavailable/failed."""
    return AclnnError(ACLNN_ERR_RUNTIME_ERROR, message, param)
