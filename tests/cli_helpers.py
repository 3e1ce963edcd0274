"""Running the ``fastgrad`` command in tests: in this process (fast) or as a subprocess."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys


def fastgrad_subprocess(*args, timeout=300) -> subprocess.CompletedProcess:
    """``python -m fastgrad ARGS`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "fastgrad", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def fastgrad_inprocess(*args) -> subprocess.CompletedProcess:
    """The command's entry point in this process (``fastgrad.cli.main``, as ``python -m fastgrad``
    calls it), stdout/stderr captured, the thread count restored afterwards."""
    import numba

    from fastgrad import set_num_threads
    from fastgrad.cli import main

    out, err = io.StringIO(), io.StringIO()
    threads = numba.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([str(a) for a in args])
    finally:
        set_num_threads(threads)
    return subprocess.CompletedProcess(["fastgrad", *map(str, args)], rc, out.getvalue(), err.getvalue())


def one_line(p: subprocess.CompletedProcess, *words: str, rc: int = 2) -> str:
    """The command's answer to a user's mistake: exit status ``rc`` (2), exactly one line on
    stderr holding every one of ``words``, no traceback nor "internal error"; the line."""
    assert p.returncode == rc, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]
