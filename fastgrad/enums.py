"""The small vocabularies shared by every layer (one place each).

* :data:`REDUCTIONS` — the aclnn reduction integers and their PyTorch names
  (``0 = "none"``, ``1 = "mean"``, ``2 = "sum"``, as ``aclnnCrossEntropyLossGrad`` and
  ``aclnnSmoothL1LossBackward`` take them); :data:`REDUCTION_CODES` is the inverse.

The dtype vocabulary is :data:`fastgrad.dtypes.DTYPE_ALIASES` / :func:`fastgrad.dtypes.parse_dtype`;
the status codes are :mod:`fastgrad.errors`.
"""

REDUCTIONS: dict[int, str] = {0: "none", 1: "mean", 2: "sum"}
REDUCTION_CODES: dict[str, int] = {v: k for k, v in REDUCTIONS.items()}
