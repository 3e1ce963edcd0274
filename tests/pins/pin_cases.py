"""The LM-head cases whose bits are pinned (tests/test_bitwise_pins.py, tests/pins/make_pins.py).

A key names the engine the GEMMs ran on and what their bits depend on:

* ``native-bf16dot``: bf16 operands of the NumPy-level online max-sum and FLCE grad on "auto" —
  every GEMM on the native kernel (pinned from the AVX-512 BF16 ``vdpbf16ps`` kernel of 6464144;
  its AVX-512F and AVX2 FMA variants sum in the same order, so the same bits on every CPU with
  AVX2 + FMA, checked under each ISA setting the machine runs).
* ``native-f32fma``: fp16 operands of the same ops on "auto" — every GEMM on the fp32-FMA kernel
  (AVX-512F or AVX2 + FMA: the same order, the same bits).
* ``blas-<OpenBLAS kernel>-<version>``: everything on ``fg.gemm("blas")`` (fp32, bf16, fp16 and
  the training op): OpenBLAS's sgemm bits depend on its kernel for the CPU and its version.

Inputs come from a fixed seed; shapes cross the kernels' tile edges (row blocks, 64-column spans,
vocabulary chunks, k-passes of 256 pairs).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16

#: (BT, H, V): rows crossing 6-row register tiles, H crossing a 512-element k-pass, V crossing
#: 64-column spans and a 2048-column vocabulary chunk
SHAPE = (67, 600, 4133)


def _openblas_key() -> str | None:
    from threadpoolctl import threadpool_info

    # NumPy's OpenBLAS (the one its matmul calls): SciPy's, loaded beside it by a test's imports,
    # can come first in the list (seen: a worker keyed "blas-Haswell-0.3.30", SciPy's)
    libs = [i for i in threadpool_info() if i.get("internal_api") == "openblas"]
    libs.sort(key=lambda i: "numpy" not in str(i.get("filepath", "")))
    return f"blas-{libs[0].get('architecture')}-{libs[0].get('version')}" if libs else None


@functools.cache
def host_class() -> str:
    """The vector width Numba compiles this process's ``reassoc`` reductions at: the element-wise
    passes' row sums (``kernels/_vmath.py``: ``row_sum_exp``, the training op's row sums) are
    vectorized by LLVM for the host CPU, so their fp32 sums — and every bit that follows from
    them — are per host class.  Read from the code LLVM makes for such a sum (the same flags):

    * ``"avx512"``: 512-bit vectors (``zmm``): AMD Zen 4 / Zen 5;
    * ``"avx512-ymm"``: an AVX-512 CPU that LLVM tunes for 256-bit vectors (Intel Xeon,
      Skylake-SP to Emerald Rapids: ``prefer-vector-width=256``); with 32 vector registers its
      sums are interleaved otherwise than AVX2's (seen on an Emerald Rapids Xeon: its bits match
      neither other class, and under ``NUMBA_CPU_NAME=znver4`` they match ``"avx512"``'s);
    * ``"avx2"``: AVX2 + FMA, 256-bit vectors, 16 registers (Zen 3, Intel client CPUs).

    Under ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` the class is the one Numba compiles for
    (:func:`avx2_host_env`: an AVX-512 machine computing as a Zen 3)."""
    import numba
    from llvmlite import binding as llvm

    @numba.njit(fastmath={"nsz", "contract", "afn", "reassoc"})
    def _row_sum(r):
        acc = np.float32(0)
        for j in range(r.shape[0]):
            acc += r[j]
        return acc

    _row_sum(np.ones(64, np.float32))
    asm = "".join(_row_sum.inspect_asm().values())
    if "zmm" in asm:
        return "avx512"
    feats = numba.config.CPU_FEATURES  # NUMBA_CPU_FEATURES: the code is made for these, not the host's
    avx512 = "+avx512f" in feats.split(",") if feats else llvm.get_host_cpu_features().get("avx512f", False)
    return "avx512-ymm" if avx512 else "avx2"


def _has(*flags: str) -> bool:
    """The CPU has every flag (``/proc/cpuinfo``; read here, not through fastgrad, so the pins
    can be made with an older fastgrad on the path)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    have = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            break
    return all(f in have for f in flags)


def avx2_host_env(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with the settings under which this x86-64 machine computes as a Zen 3 (AVX2 +
    FMA; the ``@host-avx2`` keys): Numba's code for ``znver3`` with every AVX-512 / AMX feature
    off, OpenBLAS's Haswell kernel (its DYNAMIC_ARCH builds: NumPy's wheels), the native kernels'
    AVX2 variants.  Checked on a Zen 4 against pins a Zen 3 made (tests/pins/lm_head_pins.json,
    ``sources``)."""
    from llvmlite import binding as llvm

    feats = llvm.get_host_cpu_features()
    for k in list(feats):
        if k.startswith(("avx512", "amx", "avx10", "evex512")):
            feats[k] = False
    env = dict(environ)
    env.update(
        NUMBA_CPU_NAME="znver3",
        NUMBA_CPU_FEATURES=feats.flatten(),
        OPENBLAS_CORETYPE="Haswell",
        FASTGRAD_NATIVE_ISA="avx2",
    )
    return env


def machine_keys() -> dict[str, list[str]]:
    """The keys this machine can check, each with its case names (``KEY@host-<class>``)."""
    keys: dict[str, list[str]] = {}
    host = f"@host-{host_class()}"
    if _has("avx2", "fma") or _has("avx512f"):
        keys["native-bf16dot" + host] = [n for n in CASES if n.endswith("/bf16")]
        keys["native-f32fma" + host] = [n for n in CASES if n.endswith("/fp16")]
    blas = _openblas_key()
    if blas is not None:
        keys[blas + host] = list(CASES) + list(TRAINING_CASES)
    return keys


def _inputs(dtype, seed: int = 0):
    BT, H, V = SHAPE
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H), dtype=np.float32).astype(dtype)
    w = (rng.standard_normal((V, H), dtype=np.float32) * 0.05).astype(dtype)
    t = rng.integers(0, V, BT).astype(np.int64)
    t[::7] = -100  # ignored rows (the training op); the aclnn ops mask them through target_mask
    return x, w, t


def _flce(dtype, mode: str):
    import fastgrad as fg

    x, w, t = _inputs(dtype)
    BT, H, V = SHAPE
    t = np.where(t < 0, 0, t)
    s = fg.fused_linear_online_max_sum(x, w, t, 0, V, return_logits=(mode == "hp"))
    tm, mt = s.target_mask, s.masked_target
    grad = np.full(BT, 1.0 / BT, np.float32)
    if mode == "hp":
        m = np.asarray(s.logits_max_local, np.float32)[:, None]
        lg = np.asarray(s.vocab_parallel_logits).astype(np.float32)
        sm = (np.exp(lg - m) / np.asarray(s.sum_exp_logits_local, np.float32)[:, None]).astype(np.float32)
        out = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, tm, mt, softmax=sm)
    else:
        kw = {"filter_eps": "auto"} if mode == "filtered" else {}
        ls = 0.1 if mode == "smoothing" else 0.0
        out = fg.fused_linear_cross_entropy_loss_grad(
            grad,
            x,
            w,
            tm,
            mt,
            label_smoothing=ls,
            logits_max=s.logits_max_local,
            sum_exp_logits=s.sum_exp_logits_local,
            **kw,
        )
    return {"grad_input": out[0], "grad_weight": out[1]}


def _online(dtype, shard: bool):
    import fastgrad as fg

    x, w, t = _inputs(dtype)
    V = SHAPE[2]
    t = np.where(t < 0, 0, t)
    if shard:  # the second half of a 2-way vocabulary split: rows of w are [V//2, V)
        lo = V // 2
        s = fg.fused_linear_online_max_sum(x, w[lo:], t, lo, V, return_logits=True)
    else:
        s = fg.fused_linear_online_max_sum(x, w, t, 0, V)
    return {k: v for k, v in s._asdict().items() if v is not None}


def _training(dtype, features: str):
    import fastgrad as fg

    x, w, t = _inputs(dtype)
    kw = {}
    if features == "features":
        kw = dict(softcap=30.0, lse_square_scale=1e-4, label_smoothing=0.1)
    r = fg.linear_cross_entropy(x, w, t, return_grad=True, **kw)
    return {"loss": r.loss, "lse": r.lse, "grad_input": r.grad_input, "grad_weight": r.grad_weight}


CASES = {}
for _dt, _nm in ((np.float32, "fp32"), (BF16, "bf16"), (np.float16, "fp16")):
    CASES[f"online_max_sum/full/{_nm}"] = (lambda dt: lambda: _online(dt, False))(_dt)
    CASES[f"online_max_sum/shard/{_nm}"] = (lambda dt: lambda: _online(dt, True))(_dt)
    for _mode in ("memory_saving", "smoothing", "filtered", "hp"):
        CASES[f"flce_grad/{_mode}/{_nm}"] = (lambda dt, m: lambda: _flce(dt, m))(_dt, _mode)
TRAINING_CASES = {}
for _dt, _nm in ((np.float32, "fp32"), (BF16, "bf16")):
    for _f in ("plain", "features"):
        TRAINING_CASES[f"linear_cross_entropy/{_f}/{_nm}"] = (lambda dt, f: lambda: _training(dt, f))(_dt, _f)


def _engine(key: str):
    import fastgrad as fg

    return fg.gemm("blas") if key.startswith("blas-") else fg.gemm("auto")


def digest(name: str, key: str) -> dict[str, str]:
    """sha256 (first 20 hex digits) of each output's bytes, computed on the key's engine."""
    fn = CASES.get(name) or TRAINING_CASES[name]
    with _engine(key) if key else contextlib.nullcontext():
        outs = fn()
    res = {}
    for k, v in sorted(outs.items()):
        a = np.ascontiguousarray(np.asarray(v))
        res[k] = f"{a.dtype.str}{list(a.shape)}:" + hashlib.sha256(a.tobytes()).hexdigest()[:20]
    return res
