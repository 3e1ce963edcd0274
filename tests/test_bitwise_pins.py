"""The LM-head ops give the same bits as commit 6464144 (tests/pins/lm_head_pins.json).

The pins were computed by that commit's code (tests/pins/make_pins.py: how to redo it); each key
names the engine and what its bits depend on (tests/pins/pin_cases.py), and the host class
(``@host-avx512`` / ``@host-avx512-ymm`` / ``@host-avx2``: the vector width LLVM compiles the
element-wise passes' ``reassoc`` row sums at — 512-bit on Zen 4/5, 256-bit with 32 registers on
Intel's AVX-512 Xeons, 256-bit with 16 on AVX2 CPUs — so the last bits of ``sum_exp`` and everything
after it differ between classes; ``pin_cases.host_class`` reads it from the code LLVM makes).
The native kernels' keys hold on every CPU of the host class with the ISA; the BLAS keys only where
OpenBLAS runs the same kernel, so on a machine whose OpenBLAS kernel has no pin those cases are
reported as skipped with the kernel's name.  Each key's source commit is in the file
(``sources``): 6464144, except the AVX2 hosts' native keys (6464144 had no AVX2 native kernel) and
the BLAS keys of OpenBLAS's Haswell kernel (the AVX2 CPUs' BLAS), whose bits follow the GEMM grid
(an output element's sum depends on the call's rows and columns there): their FLCE-grad and
training-loss cases were re-pinned when ``grad_input``'s grid changed (aef0135), the AVX2 host's
as a Zen 3 computes, on a Zen 4 (the key's ``sources`` entry says how).  An AVX-512 machine also
checks the AVX2 hosts' keys that way, in a child process (the last test here).
A refactor of the LM-head engine must keep every pin (a deliberate change of results re-pins with
the commit named in the file).  A deliberate change that a machine here could not re-pin for every
host class lists those keys' cases under ``stale`` with the reason and the command that re-pins
them; they are reported as skipped with that reason (never compared with the old bits).
"""

import json
import os
import pathlib
import platform
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent / "pins"
sys.path.insert(0, str(HERE))

import pin_cases  # noqa: E402

_FILE = json.loads((HERE / "lm_head_pins.json").read_text())
PINS = _FILE["pins"]
STALE = _FILE.get("stale", {}).get("names", {})
STALE_REASON = _FILE.get("stale", {}).get("reason", "")
KEYS = pin_cases.machine_keys()


def _isas(key: str) -> list[str]:
    """The native ISA settings a key is checked under (every one this machine runs)."""
    if key.startswith("native-"):
        from common import native_isas

        return native_isas()
    return ["auto"]


PARAMS = [(k, n, isa) for k, names in KEYS.items() for n in names for isa in _isas(k)]


def test_this_machine_checks_some_pins():
    # every x86-64 CI machine checks at least the BLAS or the native pins; say which
    checked = [k for k in KEYS if k in PINS]
    if not checked:
        pytest.skip(f"no pins for this machine's keys {sorted(KEYS)} (pinned: {sorted(PINS)})")
    assert all(len(PINS[k]) + len(STALE.get(k, ())) >= len(KEYS[k]) for k in checked)


@pytest.mark.parametrize("key,name,isa", PARAMS, ids=[f"{k}:{n}:{i}" for k, n, i in PARAMS])
def test_pinned_bits(key, name, isa):
    from fastgrad import _config

    if key not in PINS:
        pytest.skip(f"no pin for {key} (pinned: {sorted(PINS)})")
    if name in STALE.get(key, ()):
        pytest.skip(f"{key}:{name} is stale: {STALE_REASON}")
    _config.set_native_isa(isa)
    try:
        assert pin_cases.digest(name, key) == PINS[key][name]
    finally:
        _config.set_native_isa(None)


def test_the_avx2_hosts_pins_under_their_codegen():
    """An AVX-512 x86-64 machine checks the AVX2 hosts' pins too, computing as a Zen 3
    (``pin_cases.avx2_host_env``: Numba's code for ``znver3`` without AVX-512, OpenBLAS's Haswell
    kernel, the native AVX2 variants), in a child process: a change of their bits shows on the
    machines CI runs on, not only on an AVX2-only one (ddc6586 changed 12 of them unseen)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not pin_cases._has("avx512f"):
        pytest.skip("not an AVX-512 x86-64 machine: an AVX2 host checks its own pins in test_pinned_bits")
    env = pin_cases.avx2_host_env(os.environ)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__, "-k", "test_pinned_bits"],
        env=env, cwd=HERE.parent.parent, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    passed = re.search(r"(\d+) passed", out)
    # the native AVX2 keys at least (12 cases under each ISA setting); the BLAS key where NumPy's
    # OpenBLAS is the pinned build
    assert passed is not None and int(passed.group(1)) >= 12, out[-2000:]
