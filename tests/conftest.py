"""Shared fixtures. Op-specific helpers live beside each op's test file."""

import os

import numpy as np
import pytest

os.environ.setdefault("FASTGRAD_BACKEND", "cpu")


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(autouse=True)
def _reset_fastgrad_state():
    """Each test starts on the default backend, strict mode off."""
    import fastgrad as fg

    yield
    fg.set_backend(None)
    fg.set_strict(None)


# Property tests explore a fixed, reproducible set of examples (CI must not depend on luck).
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("fastgrad", derandomize=True, deadline=None)
    _hyp_settings.load_profile("fastgrad")
except ImportError:  # pragma: no cover
    pass
