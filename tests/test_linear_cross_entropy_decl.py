"""The training loss is a declaration on the generic path (issue 26): ``ops/linear_cross_entropy.DECL``
is an ``OpDef``, every call goes through ``_opdef.execute``, its bad arguments are reported as
the aclnn ops' are (every reason in one ``AclnnError``, nothing computed, inputs untouched), strict
mode's refusals are its ``device_limits``, and the ``"reference"`` backend runs its float64
golden while ``"acl"`` (no such op on the device) falls back to the cpu kernel, with one warning.
"""

import numpy as np
import pytest
import torch
from common import BF16

import fastgrad as fg
from fastgrad.backends import _BACKENDS
from fastgrad.ops import _opdef
from fastgrad.ops import linear_cross_entropy as lce


def _data(BT=12, H=8, V=40, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H)).astype(dtype)
    w = rng.standard_normal((V, H)).astype(dtype)
    t = rng.integers(0, V, BT)
    t[3] = -100
    return x, w, t


def test_the_op_is_a_declaration_run_by_execute(monkeypatch):
    assert isinstance(lce.DECL, _opdef.OpDef) and lce.DECL.name == "linear_cross_entropy"
    assert lce.DECL.plan is not None and lce.DECL.kernel_args is not None
    seen = []
    real = _opdef.execute

    def spy(op, args, out=None, options=None):
        seen.append(op.name)
        return real(op, args, out, options)

    monkeypatch.setattr(lce, "execute", spy)
    x, w, t = _data()
    r = fg.linear_cross_entropy(x, w, t, return_grad=True)
    assert seen == ["linear_cross_entropy"]
    # an independent float64 oracle of the mean loss
    z = x.astype(np.float64) @ w.astype(np.float64).T
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    keep = t != -100
    want = (lse[keep] - z[keep, t[keep]]).mean()
    assert abs(float(r.loss) - want) < 1e-5 * max(1.0, abs(want))


def test_every_reason_in_one_error_and_nothing_computed(monkeypatch):
    x, w, t = _data()
    monkeypatch.setitem(
        _BACKENDS["cpu"].impls, "linear_cross_entropy", lambda **k: pytest.fail("the kernel ran on bad arguments")
    )
    x0, w0, t0 = x.copy(), w.copy(), t.copy()
    with pytest.raises(fg.AclnnError) as e:
        fg.linear_cross_entropy(x, w, t, label_smoothing=1.5, temperature=0.0, precision="quick", reduction="avg")
    err = e.value
    assert err.status == 161002 and isinstance(err, ValueError)
    params = {r.split(":", 1)[0] for r in err.reasons}
    assert {"label_smoothing", "precision", "reduction"} <= params, err.reasons
    assert err.param == "reduction"  # the first, in the declaration's order (reduction, label_smoothing, ...)
    # the relations run once the arguments parse: temperature and return_grad together
    with pytest.raises(fg.AclnnError) as e:
        fg.linear_cross_entropy(x, w, t, temperature=0.0, return_grad="yes", softcap=-1.0)
    assert {r.split(":", 1)[0] for r in e.value.reasons} == {"temperature", "return_grad", "softcap"}
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(w, w0)
    np.testing.assert_array_equal(t, t0)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"input": None}, "input"),
        ({"target": None}, "target"),
    ],
)
def test_a_missing_input_is_161001(kw, param):
    x, w, t = _data()
    args = {"input": x, "weight": w, "target": t} | kw
    with pytest.raises(fg.AclnnError) as e:
        fg.linear_cross_entropy(**args)
    assert e.value.status == 161001 and e.value.param == param and isinstance(e.value, TypeError)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"weight": np.zeros((40, 9), np.float32)}, "weight"),
        ({"weight": np.zeros((40, 8), np.float64)}, "weight"),
        ({"target": np.zeros(11, np.int64)}, "target"),
        ({"target": np.zeros(12, np.float32)}, "target"),
        ({"bias": np.zeros(39, np.float32)}, "bias"),
        ({"ce_weight": np.ones(41, np.float32)}, "ce_weight"),
        ({"vocab_start_index": 5}, "vocab_start_index"),
        ({"vocab_size": 30}, "vocab_start_index"),
        ({"accum_dtype": np.float16}, "accum_dtype"),
        ({"accum_dtype": "not a dtype"}, "accum_dtype"),
        ({"combine": 3}, "combine"),
        ({"filter_eps": 2.0}, "filter_eps"),
        ({"return_entropy": 1}, "return_entropy"),
        ({"return_grad": True, "grad_output": np.ones(3)}, "grad_output"),
        ({"return_grad": True, "lse": np.zeros(5)}, "lse"),
        ({"return_grad": True, "lse": np.zeros(12), "grad_entropy": 1.0}, "z_mean"),
        ({"return_grad": True, "filter_eps": "auto", "grad_entropy": 1.0}, "filter_eps"),
        ({"target": np.full(12, 40)}, "target"),
    ],
)
def test_each_bad_argument_is_161002_naming_it(kw, param):
    x, w, t = _data()
    args = {"input": x, "weight": w, "target": t} | kw
    with pytest.raises(fg.AclnnError) as e:
        fg.linear_cross_entropy(**args)
    assert e.value.status == 161002 and e.value.param == param, (e.value.param, e.value.reasons)


def test_strict_mode_refuses_what_the_device_has_not():
    x, w, t = _data()
    with fg.strict():
        for kw, param in (({"filter_eps": "auto"}, "filter_eps"), ({"precision": "fast"}, "precision")):
            with pytest.raises(fg.AclnnError) as e:
                fg.linear_cross_entropy(x, w, t, return_grad=True, **kw)
            assert e.value.status == 161002 and e.value.param == param and "strict mode" in str(e.value)
        fg.linear_cross_entropy(x, w, t, return_grad=True)  # the rest runs


def test_numpy_and_torch_mixed_are_refused_and_torch_comes_back_as_torch():
    x, w, t = _data(dtype=BF16)
    with pytest.raises(fg.AclnnError) as e:
        fg.linear_cross_entropy(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16), w, t)
    assert e.value.status == 161002
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    wt = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    r = fg.linear_cross_entropy(xt, wt, torch.from_numpy(t), return_grad=True)
    assert isinstance(r.loss, torch.Tensor) and isinstance(r.grad_weight, torch.Tensor)
    n = fg.linear_cross_entropy(x, w, t, return_grad=True)
    np.testing.assert_array_equal(r.grad_weight.numpy(), n.grad_weight)
