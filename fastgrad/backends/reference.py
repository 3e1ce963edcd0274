"""The ``"reference"`` backend: float64 NumPy golden. Importing it registers every golden."""

from .. import reference  # noqa: F401
