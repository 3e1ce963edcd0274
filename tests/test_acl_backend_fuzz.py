"""The "acl" backend under a misbehaving CANN runtime and misuse (the fake of tests/acl_fake).

Every step of an op call is made to fail in turn (the status, phase and message must reach the
``AclnnError``, and nothing may leak); set-up failing half-way, a device id out of range, a
fork after the runtime was initialised, an interrupt during a synchronisation, an op library
without the op, odd array layouts, 16-bit round trips and concurrent threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

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


# --------------------------------------------------------------------------- set-up failing half-way
def test_set_up_failing_after_set_device_does_not_set_it_twice(fake, rng):
    """aclrtCreateStream fails once: the retry must not call aclrtSetDevice again (each call takes
    a device reference; the one aclrtResetDevice at exit would leave the second behind)."""
    x = rand(rng, (2, 3), F32)
    fake.fail("aclrtCreateStream", 107002, 1)
    with pytest.raises(fg.AclnnError) as ei:
        _sl1(x)
    assert ei.value.status == 107002 and "aclrtCreateStream" in str(ei.value)
    _sl1(x)
    _sl1(x)
    names = [r["fn"] for r in fake.log()]
    assert names.count("aclrtSetDevice") == 1
    reset0 = fake.counter("reset_device")
    base.acl_runtime._reset_for_tests()                 # the exit-time teardown
    assert fake.counter("reset_device") == reset0 + 1
    assert [r["fn"] for r in fake.log()].count("aclrtSetDevice") == 1


def test_context_failure_leaves_no_half_set_up_stream(fake, rng):
    """aclrtGetCurrentContext fails once: the stream made just before is destroyed and the next
    call sets up again, so that the context is known and other threads bind it."""
    x = rand(rng, (2, 3), F32)
    s0, d0 = fake.counter("stream_create"), fake.counter("stream_destroy")
    fake.fail("aclrtGetCurrentContext", 107002, 1)
    with pytest.raises(fg.AclnnError) as ei:
        _sl1(x)
    assert ei.value.status == 107002 and "aclrtGetCurrentContext" in str(ei.value)
    assert fake.counter("stream_destroy") == d0 + 1        # not kept without its context
    _sl1(x)
    assert fake.counter("stream_create") == s0 + 2
    errors = []

    def work():
        try:
            _sl1(x)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert not errors
    sets = [r for r in fake.log() if r["fn"] == "aclrtSetCurrentContext"]
    assert len(sets) == 1                                  # the other thread bound the context


@pytest.mark.parametrize("value", ["1", "7", "4294967296", "4294967297"])
def test_device_id_out_of_range_is_refused_naming_the_variable(libdir, rng, value):
    """FASTGRAD_ACL_DEVICE beyond aclrtGetDeviceCount: 4294967296 went through aclrtSetDevice's
    int32_t as device 0 (the op ran on another NPU than asked), 1 or 7 failed with the runtime's
    107001 without naming the variable."""
    fk = fakeacl.Fake(libdir)
    with base.acl_env(libdir, FASTGRAD_ACL_DEVICE=value):
        fk.clear_log()
        with pytest.raises(fg.AclnnError) as ei:
            _sl1(rand(rng, (2, 3), F32))
        assert ei.value.status == 161002 and ei.value.param == "FASTGRAD_ACL_DEVICE"
        assert "FASTGRAD_ACL_DEVICE" in str(ei.value) and value in str(ei.value) and "below 1" in str(ei.value)
        assert "aclrtSetDevice" not in [r["fn"] for r in fk.log()]
    with base.acl_env(libdir, FASTGRAD_ACL_DEVICE="1", FAKE_ACL_DEVICE_COUNT="2"):
        fk.clear_log()
        _sl1(rand(rng, (2, 3), F32))
        assert [r["device"] for r in fk.log() if r["fn"] == "aclrtSetDevice"] == [1]


# --------------------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize("fail,interrupt", [
    (None, ("aclrtSynchronizeStream", 1)),            # while the op's own sync waits
    ((SL1, 561103), ("aclrtSynchronizeStream", 1)),   # while the error path's sync waits
    ((SL1, 561103), ("aclrtFree", 1)),                # during the release itself
    (None, ("aclrtFree", 2)),
])
def test_keyboard_interrupt_releases_everything(fake, rng, fail, interrupt):
    """Ctrl-C while a synchronisation (or a release) waits: KeyboardInterrupt reaches the caller,
    after every tensor, executor and allocation was released; out= untouched; the next call runs.
    (The error path's release stopped at the interrupt: 3 buffers and 4 tensors stayed.)"""
    x = rand(rng, (3, 4), F32)
    out = np.full((3, 4), 7.0, F32)
    n0 = fake.counter("interrupts")
    if fail:
        fake.fail(*fail)
    fake.interrupt(*interrupt)
    with pytest.raises(KeyboardInterrupt):
        _sl1(x, out)
    assert fake.counter("interrupts") == n0 + 1
    _assert_released(fake)
    if fail or interrupt[0] == "aclrtSynchronizeStream":
        assert (out == 7.0).all()
    np.testing.assert_allclose(_sl1(x), sl1_expected(np.ones_like(x), x, np.zeros_like(x), "none", 1.0), rtol=1e-6)


# --------------------------------------------------------------------------- copies back
@pytest.mark.parametrize("nth", [7, 8])
def test_a_failed_copy_back_leaves_every_output_untouched(fake, rng, nth):
    """Two outputs (loss, softmax): the second device-to-host copy failing had already written the
    first into the caller's array.  4 inputs + 2 outputs are 6 host-to-device copies; then 7, 8."""
    BT, V = 3, 5
    lmax, s, p = rand(rng, BT, F32), rand(rng, BT, F32, 1, 3), rand(rng, BT, F32, -1, 0)
    vpl = rand(rng, (BT, V), F32)
    loss, softmax = np.full(BT, 7.0, F32), np.full((BT, V), 7.0, F32)
    fake.fail("aclrtMemcpy", 507899, nth)
    with pytest.raises(fg.AclnnError) as ei:
        dispatch("fused_cross_entropy_loss_with_max_sum", "acl")(
            logits_max=lmax, sum_exp_logits=s, predicted_logits=p, vocab_parallel_logits=vpl, out=(loss, softmax))
    assert ei.value.status == 507899 and ei.value.phase == "run"
    assert (loss == 7.0).all() and (softmax == 7.0).all()
    d2h = [r for r in fake.log() if r["fn"] == "aclrtMemcpy" and r["kind"] == 2]
    assert len(d2h) == nth - 6
    _assert_released(fake)
    dispatch("fused_cross_entropy_loss_with_max_sum", "acl")(
        logits_max=lmax, sum_exp_logits=s, predicted_logits=p, vocab_parallel_logits=vpl, out=(loss, softmax))
    np.testing.assert_allclose(loss, np.log(s) - p, rtol=1e-6)
    np.testing.assert_allclose(softmax, np.exp(vpl - lmax[:, None]) / s[:, None], rtol=1e-6)


# --------------------------------------------------------------------------- fork
FORK_SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys
    sys.path.insert(0, os.path.join(os.environ["ROOT"], "tests"))
    from acl_fake import fakeacl
    fk = fakeacl.Fake(os.environ["FASTGRAD_ACL_LIB_DIR"])
    KEYS = ("stream_destroy", "reset_device", "finalize", "finalize_reference", "violations", "tensor_create")
    out = os.environ["OUT"]

    def report():  # registered first: runs last, after fastgrad's own exit hook
        with open(os.path.join(out, "exit-%d.json" % os.getpid()), "w") as f:
            json.dump({k: fk.counter(k) for k in KEYS}, f)

    atexit.register(report)
    import numpy as np
    import fastgrad as fg
    from fastgrad.backends import dispatch

    def op():
        o = np.zeros(3, np.float32)
        dispatch("smooth_l1_loss_backward", "acl")(grad_out=np.ones(3, np.float32), input=np.arange(3, dtype=np.float32),
                 target=np.ones(3, np.float32), reduction="none", beta=1.0, out=o)
        return o.tolist()

    op()
    pid = os.fork()
    if pid == 0:
        res = {"at_fork": {k: fk.counter(k) for k in KEYS}}
        try:
            res["op"] = op()
        except fg.AclnnError as e:
            res["error"] = [e.status, str(e)]
        res["reason"] = fg.available_backends(with_reasons=True)["acl"]
        fg.set_backend("auto")
        res["auto"] = fg.get_backend()
        with open(os.path.join(out, "child.json"), "w") as f:
            json.dump(res, f)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"child_pid": pid, "child_status": status, "parent": op()}))
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
def test_fork_after_init_refuses_the_child_and_leaves_the_parents_device_alone(libdir, tmp_path):
    """A fork after the runtime was initialised: the child ran ops on the parent's device,
    context and stream (undefined on CANN, which, like torch_npu, does not support a forked
    child), and its exit hook destroyed the parent's stream, reset its device and finalized acl."""
    env = dict(os.environ, FASTGRAD_ACL_LIB_DIR=libdir, OUT=str(tmp_path), ROOT=base.ROOT, PYTHONPATH=base.ROOT)
    r = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, env=env,
                       cwd=base.ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    parent = json.loads(r.stdout.strip().splitlines()[-1])
    assert parent["child_status"] == 0 and parent["parent"] == [-1.0, 0.0, 1.0]   # the parent still works
    child = json.loads((tmp_path / "child.json").read_text())
    assert "op" not in child, child
    status, msg = child["error"]
    assert status == 361001 and "fork" in msg and "spawn" in msg
    assert child["reason"] and "fork" in child["reason"] and child["auto"] == "cpu"
    child_exit = json.loads((tmp_path / f"exit-{parent['child_pid']}.json").read_text())
    assert child_exit == child["at_fork"]                      # no teardown call from the child
    parent_exit = [json.loads(p.read_text()) for p in tmp_path.glob("exit-*.json")
                   if p.name != f"exit-{parent['child_pid']}.json"]
    assert len(parent_exit) == 1 and parent_exit[0]["stream_destroy"] == 1 and parent_exit[0]["violations"] == 0


# --------------------------------------------------------------------------- an older op library
@pytest.mark.parametrize("omit,missing", [("FAKE_OMIT_SMOOTH_L1", SL1 + "GetWorkspaceSize"),
                                          ("FAKE_OMIT_SMOOTH_L1_LAUNCH", SL1)])
def test_an_op_library_without_the_op(libdir, tmp_path, rng, omit, missing):
    """A toolkit whose op library lacks the op (or its launch): 361001 naming the symbol, before
    any device memory; the launch missing leaked the executor stage one had made (and queued a
    synchronisation for a launch that never happened).  The other ops still run."""
    d = fakeacl.build_op_library(libdir, str(tmp_path / "lib64"), omit)
    fk = fakeacl.Fake(libdir)
    with base.acl_env(d):
        assert base.acl.unavailable_reason() is None
        live = fk.counter("live_executor"), fk.counter("live_tensor"), fk.live_allocations()
        fk.clear_log()
        with pytest.raises(fg.AclnnError) as ei:
            _sl1(rand(rng, (2, 3), F32))
        assert ei.value.status == 361001 and f"symbol {missing} not found" in str(ei.value)
        names = [r["fn"] for r in fk.log()]
        assert "aclrtMalloc" not in names and "aclCreateTensor" not in names and SL1 + "GetWorkspaceSize" not in names
        assert (fk.counter("live_executor"), fk.counter("live_tensor"), fk.live_allocations()) == live
        out = np.zeros(3, F32)
        dispatch("scaled_masked_softmax_backward", "acl")(grad_output=np.ones((1, 3), F32), y=np.ones((1, 3), F32),
                                                          mask=np.zeros((1, 3), np.bool_), scale=1.0,
                                                          fix_triu_mask=False, out=out.reshape(1, 3))
        np.testing.assert_array_equal(out, [-2, -2, -2])


# --------------------------------------------------------------------------- libraries
@pytest.mark.parametrize("broken", ["libopapi.so", "libnnopbase.so"])
def test_a_library_found_but_not_loadable_is_named_with_the_loaders_error(libdir, tmp_path, broken):
    """An op library (or libnnopbase.so) that is there but does not load (a dependency missing
    because set_env.sh was not sourced, a wrong architecture): the reason said only "no aclnn op
    library found" (or "lack aclCreateTensor, aclDestroyTensor"), hiding the file and the cause."""
    d = tmp_path / "lib64"
    d.mkdir()
    for name in ("libascendcl.so", "libnnopbase.so", "libopapi.so"):
        if name == broken:
            (d / name).write_text("not an ELF file")
        else:
            os.symlink(os.path.join(libdir, name), d / name)
    import ctypes

    with pytest.raises(OSError) as loader:
        ctypes.CDLL(str(d / broken))
    with base.acl_env(str(d)):
        reason = base.acl.unavailable_reason()
        assert reason is not None and "not loadable" in reason
        assert str(d / broken) in reason and str(loader.value) in reason       # the loader's own words


# --------------------------------------------------------------------------- layouts, 16-bit, threads
def _views(rng, dtype):
    b = rand(rng, (4, 6, 5), dtype, -0.9, 0.9)
    yield b[1, 2, 3]                                   # 0-d (a NumPy scalar made an array below)
    yield np.asarray(b[1, 2, 3])
    yield b[:0]
    yield b[:, :0, ::-1]                               # empty, negative stride
    yield b.transpose(2, 0, 1)
    yield b[:, ::-1]
    yield b[::2, 1:5, ::2]
    yield b[:1, :, 2:3]                                # size-1 dims
    yield b[:, 3:4, :].transpose(1, 2, 0)
    yield np.broadcast_to(b[0, 0], (3, 5))
    yield b[..., 1:4].swapaxes(0, 2)
    for _ in range(20):                                # random slices and permutations
        sl = tuple(slice(int(rng.integers(0, n)), None, int(rng.choice([1, 2, -1, -2]))) for n in b.shape)
        yield b[sl].transpose(rng.permutation(3))


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_views_reach_the_device_as_described(fake, rng, dtype):
    """Every view of an input: what aclCreateTensor receives (dims, strides, storage) describes
    the bytes copied, and the device computes on the right elements."""
    for x in _views(rng, dtype):
        x = np.asarray(x)
        fake.clear_log()
        out = _sl1(x)
        want = np.clip(x.astype(np.float64), -1, 1)          # |x| < 1: d/beta = x exactly
        np.testing.assert_array_equal(out.astype(np.float64), want.astype(dtype).astype(np.float64))
        one = [r for r in fake.log() if r["fn"] == SL1 + "GetWorkspaceSize"][0]
        rec = creates(fake.log())[one["tensors"]["self"]]
        assert rec["dims"] == list(x.shape) and rec["dtype"] == base.ACL[dtype.name] and rec["format"] == 2
        if x.size == 0:
            assert rec["data"] == 0
            continue
        h2d = [r for r in fake.log() if r["fn"] == "aclrtMemcpy" and r["dst"] == rec["data"]]
        assert h2d[0]["count"] == int(np.prod(rec["storage"])) * dtype.itemsize
        assert all(s > 0 for s in rec["strides"])
        # the furthest element the view reaches lies inside the storage
        assert sum((n - 1) * s for n, s in zip(rec["dims"], rec["strides"])) < int(np.prod(rec["storage"]))


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_16_bit_values_round_trip_bit_exact(fake, dtype):
    """Every finite 16-bit value of magnitude below 1 (subnormals and -0 included) goes to the
    device and back unchanged (smooth L1 with beta 1, target 0 and grad 1 is the identity there)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    x = bits.view(dtype)
    x = x[np.isfinite(x.astype(np.float32)) & (np.abs(x.astype(np.float32)) < 1)]
    out = _sl1(x)
    np.testing.assert_array_equal(out.view(np.uint16), x.view(np.uint16))


def test_calls_from_several_threads_at_once(fake, rng):
    xs = [rand(rng, (5, 7), F32, -0.9, 0.9) for _ in range(4)]
    errors, results = [], {}
    start = threading.Barrier(len(xs))

    def work(k):
        try:
            start.wait()
            results[k] = [_sl1(xs[k]) for _ in range(5)]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ths = [threading.Thread(target=work, args=(k,)) for k in range(len(xs))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not errors
    for k, x in enumerate(xs):
        for out in results[k]:
            np.testing.assert_array_equal(out, x)
    names = [r["fn"] for r in fake.log()]
    assert names.count("aclrtSetDevice") == 1 and names.count("aclrtCreateStream") == 1
    assert names.count("aclrtSetCurrentContext") == len(xs) - 1       # each other thread binds once
