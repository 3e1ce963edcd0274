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
