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
