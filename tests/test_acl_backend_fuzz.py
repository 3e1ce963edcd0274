"""The "acl" backend under a misbehaving CANN runtime and misuse (the fake of tests/acl_fake).

Every step of an op call is made to fail in turn (the status, phase and message must reach the
``AclnnError``, and nothing may leak); set-up failing half-way, a device id out of range, a
fork after the runtime was initialised, an interrupt during a synchronisation, an op library
without the op, odd array layouts, 16-bit round trips and concurrent threads.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_acl_backend as base  # noqa: E402
from acl_fake import fakeacl  # noqa: E402
from test_acl_backend import creates, rand, sl1_expected  # noqa: E402

import fastgrad as fg  # noqa: E402
from fastgrad.backends import dispatch  # noqa: E402

libdir, fake = base.libdir, base.fake  # the fake runtime's fixtures

pytestmark = pytest.mark.skipif(fakeacl.compiler() is None,
                                reason="no C compiler: cannot build the fake CANN runtime")

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
SL1 = "aclnnSmoothL1LossBackward"


def _sl1(x, out=None):
    out = np.full(x.shape, 7.0, x.dtype) if out is None else out
    dispatch("smooth_l1_loss_backward", "acl")(grad_out=np.ones(x.shape, x.dtype), input=x,
                                               target=np.zeros(x.shape, x.dtype), reduction="none", beta=1.0, out=out)
    return out


def _assert_released(fk):
    log = fk.log()
    made = [h for h in creates(log) if h]
    assert sorted(r["tensor"] for r in log if r["fn"] == "aclDestroyTensor") == sorted(made)
    mallocs = [r["ptr"] for r in log if r["fn"] == "aclrtMalloc" and r["ret"] == 0]
    assert sorted(r["ptr"] for r in log if r["fn"] == "aclrtFree") == sorted(mallocs)
    assert fk.counter("live_tensor") == 0 and fk.counter("live_executor") == 0 and fk.live_allocations() == 0


# --------------------------------------------------------------------------- every step fails
# smooth_l1 (none): gradOut, self, target, gradInput -> 4 mallocs + 4 H2D, the workspace 5th malloc,
# the D2H copy the 5th memcpy.  (function, nth call, status, phase, what the message names)
STEPS = [
    ("aclrtMalloc", 1, 207001, "workspace", "aclrtMalloc (gradOut, 48 bytes)"),
    ("aclrtMalloc", 2, 207001, "workspace", "aclrtMalloc (self, 48 bytes)"),
    ("aclrtMalloc", 4, 207001, "workspace", "aclrtMalloc (gradInput, 48 bytes)"),
    ("aclrtMemcpy", 3, 507899, "workspace", "aclrtMemcpy (target, host to device, 48 bytes)"),
    ("aclCreateTensor", 2, 1, "workspace", "aclCreateTensor (self) returned nullptr"),
    (SL1 + "GetWorkspaceSize", 1, 161002, "workspace", SL1 + "GetWorkspaceSize returned 161002"),
    ("aclrtMalloc", 5, 207001, "run", "aclrtMalloc (workspace, 4096 bytes)"),
    (SL1, 1, 561103, "run", SL1 + " returned 561103"),
    ("aclrtSynchronizeStream", 1, 507011, "run", "aclrtSynchronizeStream returned 507011"),
    ("aclrtMemcpy", 5, 507899, "run", "aclrtMemcpy (gradInput, device to host, 48 bytes)"),
]


@pytest.mark.parametrize("fn,nth,code,phase,what", STEPS)
def test_each_step_failing_names_op_operand_status_and_phase(fake, rng, fn, nth, code, phase, what):
    """The device's status, the call's phase (anything after a successful first call is "run":
    an asynchronous launch error surfaces at the synchronisation), the aclnn API and the operand
    concerned, and aclGetRecentErrMsg's text; every resource released, the next call fine."""
    x = rand(rng, (3, 4), F32)
    out = np.full((3, 4), 7.0, F32)
    fake.fail(fn, code, nth)
    with pytest.raises(fg.AclnnError) as ei:
        _sl1(x, out)
    e = ei.value
    assert e.status == (361001 if fn == "aclCreateTensor" else code)
    assert e.phase == phase
    msg = str(e)
    assert msg.startswith(SL1 + ": " if not what.startswith(SL1) else SL1), msg
    assert what in msg and f"injected failure in {fn}" in msg
    assert (out == 7.0).all()
    _assert_released(fake)
    np.testing.assert_allclose(_sl1(x), sl1_expected(np.ones_like(x), x, np.zeros_like(x), "none", 1.0), rtol=1e-6)


def test_a_dtype_without_acl_type_is_refused_by_name_before_device_memory(fake):
    x = np.ones((2, 3), F32)
    with pytest.raises(fg.AclnnError) as ei:
        dispatch("smooth_l1_loss_backward", "acl")(grad_out=x, input=x.astype(np.complex64), target=x,
                                                   reduction="none", beta=1.0, out=np.zeros((2, 3), F32))
    assert ei.value.status == 161002 and ei.value.param == "self"
    assert str(ei.value).startswith(SL1 + ": self: dtype complex64")
    # gradOut (the operand before it) was copied; self took no device memory
    assert [r["size"] for r in fake.log() if r["fn"] == "aclrtMalloc"] == [24]
