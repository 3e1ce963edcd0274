"""The ``"cpu"`` backend: Numba kernels. Importing it registers every kernel module."""

from .. import kernels  # noqa: F401
