"""Backend registry, strict-mode switch, and Numba caching in a read-only install."""

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fastgrad as fg


def test_available_backends_and_selection(monkeypatch):
    av = fg.available_backends()
    assert "cpu" in av and "reference" in av
    reasons = fg.available_backends(with_reasons=True)
    assert reasons["cpu"] is None and "acl" in reasons
    fg.set_backend("reference")
    assert fg.get_backend() == "reference"
    with fg.use_backend("cpu"):
        assert fg.get_backend() == "cpu"
    assert fg.get_backend() == "reference"
    fg.set_backend(None)
    monkeypatch.setenv("FASTGRAD_BACKEND", "reference")
    assert fg.get_backend() == "reference"
    monkeypatch.setenv("FASTGRAD_BACKEND", "auto")
    assert fg.get_backend() in ("cpu", "acl")
    if reasons["acl"] is not None:
        assert fg.get_backend() == "cpu"          # auto falls back silently
        with pytest.raises(fg.AclnnError) as e:   # explicit request raises
            fg.set_backend("acl")
        assert e.value.status == 361001 and "acl" in str(e.value)


def test_unknown_backend_from_environment_raises_361001(monkeypatch):
    monkeypatch.setenv("FASTGRAD_BACKEND", "tpu")
    with pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_online_max_sum(np.zeros((1, 1), np.float16), np.zeros((1, 1), np.float16),
                                       np.zeros(1, np.int64), 0, 1)
    assert e.value.status == 361001


def test_strict_switches(monkeypatch):
    assert not fg.is_strict()
    with fg.strict():
        assert fg.is_strict()
        with fg.strict(False):
            assert not fg.is_strict()
    monkeypatch.setenv("FASTGRAD_STRICT", "1")
    assert fg.is_strict()


def test_read_only_install_compiles_without_a_writable_package_dir(tmp_path):
    """Copy the package where its __pycache__ cannot be created (a file stands in its way, which
    stops root too) and NUMBA_CACHE_DIR points nowhere: import and a parallel kernel still work."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(fg.__file__)))
    dst = tmp_path / "site"
    shutil.copytree(os.path.join(src, "fastgrad"), dst / "fastgrad",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (dst / "fastgrad" / "__pycache__").write_text("not a directory")
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    env = dict(os.environ, PYTHONPATH=str(dst), NUMBA_CACHE_DIR=str(blocker / "numba"),
               HOME=str(blocker / "home"), XDG_CACHE_HOME=str(blocker / "xdg"), PYTHONDONTWRITEBYTECODE="1")
    code = f"DST = {str(dst)!r}\n" + textwrap.dedent("""
        import numpy as np, ml_dtypes, fastgrad as fg
        from fastgrad import _jit
        assert fg.__file__.startswith(DST), fg.__file__
        x = np.ones((3, 4), ml_dtypes.bfloat16); w = np.ones((5, 4), ml_dtypes.bfloat16)
        r = fg.fused_linear_online_max_sum(x, w, np.array([0, 1, 9]), 0, 5)
        assert float(r.logits_max_local[0]) == 4.0
        print("cache", _jit.CACHE)
    """)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    p2 = subprocess.run([sys.executable, "-c", code], env=dict(env, FASTGRAD_NUMBA_CACHE="0"),
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p2.returncode == 0 and "cache False" in p2.stdout, p2.stderr
