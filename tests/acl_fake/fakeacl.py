"""Build and drive the fake CANN runtime (``fake_acl.c``) for the acl backend's ABI tests."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "fake_acl.c")
#: The one prototype table (vendored CANN header text) the backend parses; the fake is compiled
#: against it, so a fake definition that disagrees with a binding fails to build.
PROTO_DIR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "fastgrad", "backends")
PROTO_HEADER = os.path.join(PROTO_DIR, "aclnn_prototypes.h")
SONAME_PREFIX = "libfastgrad_fake_"


def compiler() -> str | None:
    """The system C compiler (``$CC``, cc, gcc, clang) or None."""
    for c in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def build(dest: str) -> str:
    """Compile libascendcl.so, libnnopbase.so and libopapi.so into ``dest``; returns ``dest``.

    libnnopbase and libopapi link against libascendcl (which holds the shared state), found
    next to them through ``$ORIGIN``, as in a real toolkit's lib64.
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    os.makedirs(dest, exist_ok=True)
    common = [cc, "-shared", "-fPIC", "-O1", "-std=gnu11", "-Wall", "-Werror=implicit-function-declaration",
              "-fvisibility=hidden", "-I" + PROTO_DIR, SOURCE]
    rpath = "-Wl,-rpath,$ORIGIN"
    # Sonames of their own (with symlinks so $ORIGIN resolves them): once loaded, the fake
    # must never satisfy a later dlopen("libascendcl.so") by bare name in the same process.
    steps = [
        ("libascendcl.so", "FAKE_PART_ACL", []),
        ("libnnopbase.so", "FAKE_PART_NNOPBASE", ["-L" + dest, "-l:libascendcl.so", rpath]),
        ("libopapi.so", "FAKE_PART_OPAPI", ["-L" + dest, "-l:libnnopbase.so", "-l:libascendcl.so", rpath]),
    ]
    for name, part, extra in steps:
        soname = SONAME_PREFIX + name
        out = os.path.join(dest, name)
        r = subprocess.run(common + ["-D" + part, "-Wl,-soname," + soname, "-o", out] + extra + ["-lm"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiling the fake runtime failed:\n{r.stderr}")
        link = os.path.join(dest, soname)
        if not os.path.lexists(link):
            os.symlink(name, link)
    return dest


def build_op_library(libdir: str, dest: str, *defines: str) -> str:
    """A toolkit in ``dest`` whose op library (``libopapi_nn.so``) is the fake's built with
    ``defines`` (e.g. ``FAKE_OMIT_SMOOTH_L1``: an older CANN without that op); its runtime is the
    one of ``libdir`` (symlinked: the same loaded state).  Returns ``dest``."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    os.makedirs(dest, exist_ok=True)
    for name in ("libascendcl.so", "libnnopbase.so"):
        if not os.path.lexists(os.path.join(dest, name)):
            os.symlink(os.path.join(libdir, name), os.path.join(dest, name))
    tag = "_".join(d.lower() for d in defines) or "plain"
    cmd = [cc, "-shared", "-fPIC", "-O1", "-std=gnu11", "-fvisibility=hidden", "-I" + PROTO_DIR, SOURCE,
           "-DFAKE_PART_OPAPI", *("-D" + d for d in defines), f"-Wl,-soname,{SONAME_PREFIX}{tag}_libopapi_nn.so",
           "-o", os.path.join(dest, "libopapi_nn.so"), "-L" + libdir, "-l:libnnopbase.so", "-l:libascendcl.so",
           "-Wl,-rpath," + libdir, "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"compiling the fake op library failed:\n{r.stderr}")
    return dest


_BUILT: str | None = None


def build_once(tmp_path_factory) -> str:
    """The one build of the fake for this process (every test module's ``libdir`` fixture): a
    second copy, with the same sonames, would be wired to the first one's state by the loader."""
    global _BUILT
    if _BUILT is None or not os.path.isfile(os.path.join(_BUILT, "libascendcl.so")):
        _BUILT = build(str(tmp_path_factory.mktemp("fake_cann") / "lib64"))
    return _BUILT


class Fake:
    """The fake's query/control API (``fake_*`` in libascendcl.so), through ctypes.

    Opening the same path the backend opened returns the same handle, hence the same state.
    """

    def __init__(self, libdir: str):
        self.libdir = libdir
        mode = os.RTLD_GLOBAL | os.RTLD_NOW
        self.lib = ctypes.CDLL(os.path.join(libdir, "libascendcl.so"), mode=mode)
        L = self.lib
        L.fake_log_json.restype = ctypes.c_char_p
        L.fake_last_violation.restype = ctypes.c_char_p
        L.fake_counter.restype = ctypes.c_int64
        L.fake_counter.argtypes = [ctypes.c_char_p]
        L.fake_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        L.fake_interrupt.argtypes = [ctypes.c_char_p, ctypes.c_int]
        L.fake_set_workspace.argtypes = [ctypes.c_uint64]
        L.fake_live_allocations.restype = ctypes.c_int64
        L.aclInit.argtypes = [ctypes.c_char_p]
        L.aclFinalize.argtypes = []
        L.fake_refcount.restype = ctypes.c_uint64

    def log(self) -> list[dict]:
        return json.loads(self.lib.fake_log_json().decode())

    def clear_log(self) -> None:
        self.lib.fake_clear_log()

    def counter(self, name: str) -> int:
        return int(self.lib.fake_counter(name.encode()))

    def counters(self, *names: str) -> dict:
        return {n: self.counter(n) for n in names}

    def live_allocations(self) -> int:
        return int(self.lib.fake_live_allocations())

    def violation(self) -> str:
        v = self.lib.fake_last_violation()
        return v.decode() if v else ""

    def fail(self, fn: str | None, code: int = 0, nth: int = 1) -> None:
        self.lib.fake_fail(fn.encode() if fn else None, int(code), int(nth))

    def interrupt(self, fn: str | None, nth: int = 1) -> None:
        """SIGINT (Ctrl-C) during the nth next call of ``fn``: KeyboardInterrupt when it returns."""
        self.lib.fake_interrupt(fn.encode() if fn else None, int(nth))

    def refcount(self) -> int:
        return int(self.lib.fake_refcount())

    def set_workspace(self, n: int) -> None:
        self.lib.fake_set_workspace(int(n))
