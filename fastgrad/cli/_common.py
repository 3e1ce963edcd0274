"""The pieces every subcommand of the ``fastgrad`` command shares: exit statuses, the one-line
user error, the one-line argument parser, the Markdown writer (imported by the subcommands and
re-exported by ``fastgrad.cli``; importing nothing of the command itself, so no subcommand
imports the package that dispatches to it)."""

from __future__ import annotations

import argparse
import os

#: Exit statuses.
EXIT_OK, EXIT_FAILED_CHECK, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class CliError(Exception):
    """A user error: bad flag, file, shape or value.  Printed as one line, exit status 2.

    ``CliError(flag, expected, given)`` words the message ``flag: expected E, got G``;
    ``CliError(message)`` takes it as is.
    """

    def __init__(self, flag: str, expected: str | None = None, given=None, *, hint: str = ""):
        self.flag = flag
        if expected is None:
            msg = flag
        else:
            msg = f"{flag}: expected {expected}, got {given}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line on stderr and exits with status 2."""

    def error(self, message: str):  # type: ignore[override]
        message = " ".join(str(message).split())
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see `{self.prog} -h`)\n")


def stdout_to_devnull() -> None:
    """Point stdout at /dev/null after its reader left (a closed pipe): the interpreter's last
    flush then raises no second BrokenPipeError."""
    import os
    import sys

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def print_or_pipe_closed(text: str) -> None:
    """Print ``text`` (flushed); a reader that left before it (``| head -1``, ``| true``) is no
    error: the rest goes to /dev/null and the command keeps its exit status (a verdict's 1)."""
    import sys

    try:
        print(text, flush=True)
    except BrokenPipeError:
        stdout_to_devnull()
    else:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            stdout_to_devnull()


def write_markdown(path: str, text: str) -> None:
    """Write a report's Markdown table to ``path`` (its folder made if missing) and say so."""
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")


#: Every subcommand of ``fastgrad``, as ``fastgrad -h`` lists them.
SUBCOMMAND_HELP = (
    ("case OP --shape DIMS --dtype DT --out DIR", "write a device test case: inputs + golden as .bin/.json, manifest"),
    ("golden OP --inputs DIR --out DIR", "golden outputs of an op from input files (float64 reference)"),
    ("golden --from-msprobe RANK_DIR --out DIR", "recompute and judge an msprobe dump's calls of the seven ops"),
    ("compare ACTUAL GOLDEN", "Ascend accuracy standards (single / double benchmark, legacy)"),
    ("bench [--headline|--quick]", "benchmark report against PyTorch and the machine's bounds"),
    ("bench --from-profile CSV", "an NPU profile's kernels beside the CPU on the same shapes"),
    ("ttk-plugin --out DIR", "write fastgrad's TTK golden plugin file"),
)


def subcommand_epilog() -> str:
    width = max(len(u) for u, _ in SUBCOMMAND_HELP)
    lines = [f"  fastgrad {u:<{width}}  {h}" for u, h in SUBCOMMAND_HELP]
    return "subcommands (`fastgrad SUBCOMMAND -h` for each):\n" + "\n".join(lines)


#: The seven ops by their aclnn names (``fastgrad/ops/<op>.py``'s ``DECL.aclnn``; kept here so that
#: ``fastgrad -h`` and the parsers need no import of the ops; ``tests/test_cli_case.py`` checks it).
ACLNN_NAMES = {
    "aclnnFusedLinearOnlineMaxSum": "fused_linear_online_max_sum",
    "aclnnFusedCrossEntropyLossWithMaxSum": "fused_cross_entropy_loss_with_max_sum",
    "aclnnFusedLinearCrossEntropyLossGrad": "fused_linear_cross_entropy_loss_grad",
    "aclnnCrossEntropyLossGrad": "cross_entropy_loss_grad",
    "aclnnScaledMaskedSoftmaxBackward": "scaled_masked_softmax_backward",
    "aclnnSmoothL1LossBackward": "smooth_l1_loss_backward",
    "aclnnEmbeddingDenseBackward": "embedding_dense_backward",
}
OP_NAMES = tuple(ACLNN_NAMES.values())
#: the aclnn name of each op
ACLNN_OF = {v: k for k, v in ACLNN_NAMES.items()}


#: short names (as ``fastgrad bench --ops`` takes them)
SHORT_NAMES = {
    "flce": "fused_linear_cross_entropy_loss_grad",
    "flce_grad": "fused_linear_cross_entropy_loss_grad",
    "floms": "fused_linear_online_max_sum",
    "fce": "fused_cross_entropy_loss_with_max_sum",
    "ce": "cross_entropy_loss_grad",
    "ce_grad": "cross_entropy_loss_grad",
    "softmax": "scaled_masked_softmax_backward",
    "smooth_l1": "smooth_l1_loss_backward",
    "embedding": "embedding_dense_backward",
}


def resolve_op(name: str) -> str | None:
    """fastgrad's op name for ``name``: the op name itself, its aclnn name (``aclnnCrossEntropyLossGrad``,
    case-insensitive, the ``aclnn`` prefix optional) or a short name (:data:`SHORT_NAMES`); None
    when it names none of the seven ops."""
    key = name.strip()
    if key in OP_NAMES:
        return key
    if key.lower() in SHORT_NAMES:
        return SHORT_NAMES[key.lower()]
    low = key.lower().replace("_", "")
    for aclnn, op in ACLNN_NAMES.items():
        if low in (aclnn.lower(), aclnn.lower()[len("aclnn") :], op.replace("_", "")):
            return op
    return None


def op_choices() -> str:
    """The op names a command accepts, for its help and its errors."""
    return ", ".join(f"{op} ({ACLNN_OF[op]})" for op in OP_NAMES)


#: The SoC profiles (``fastgrad/soc.py``; the names only, so the parser imports nothing heavy).
SOC_CHOICES = (
    "Ascend910B (Atlas A2, the default), Ascend910_93 (A3), Ascend950, or a finer CANN name such as Ascend910B3"
)


def add_device_options(p, strict: bool = True) -> None:
    """``--soc-version NAME`` and (``strict``) ``--strict`` / ``--no-strict``: the device a golden follows."""
    p.add_argument(
        "--soc-version",
        metavar="NAME",
        help=f"SoC whose kernels the golden follows: {SOC_CHOICES} (default: FASTGRAD_SOC_VERSION, else Ascend910B)",
    )
    if not strict:
        return
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--strict",
        dest="strict",
        action="store_const",
        const=True,
        default=None,
        help="reject exactly what the SoC's op_api and tiling reject, with their status codes "
        "(default: FASTGRAD_STRICT)",
    )
    g.add_argument("--no-strict", dest="strict", action="store_const", const=False, help="strict mode off")


def enter_device(stack, args) -> dict:
    """Enter ``args.soc_version`` / ``args.strict`` on ``stack`` (a ``contextlib.ExitStack``); returns
    what a manifest records: ``{"soc_version": the name in force, "soc_profile": its profile,
    "strict": strict mode}``.  A SoC fastgrad has no profile for is a :class:`CliError`."""
    import fastgrad as fg

    from .. import _config
    from ..soc import profile_name

    if getattr(args, "soc_version", None):
        try:
            stack.enter_context(fg.soc_version(args.soc_version))
        except ValueError:
            raise CliError("--soc-version", SOC_CHOICES, repr(args.soc_version)) from None
    if getattr(args, "strict", None) is not None:
        stack.enter_context(fg.strict(args.strict))
    try:
        soc = _config.get_soc_version()
    except ValueError as e:
        raise CliError(" ".join(str(e).split())) from None  # (the error names FASTGRAD_SOC_VERSION)
    out = {"soc_version": soc, "soc_profile": profile_name(soc), "strict": bool(_config.is_strict())}
    det = getattr(_config, "is_deterministic", None)  # the device's deterministic-mode kernels
    if det is not None:
        out["deterministic"] = bool(det())
    return out


def refuse_missing_kernel(op: str, soc: str, flag: str = "--soc-version") -> None:
    """One line (exit 2) when SoC ``soc`` has no kernel for ``op`` (the fused linear ops on Ascend950:
    ops-nn's ``op_host/config`` holds ascend910b and ascend910_93 binaries only)."""
    from ..soc import SOC_VERSIONS, get_profile

    if (
        op in ("fused_linear_online_max_sum", "fused_linear_cross_entropy_loss_grad")
        and not get_profile(soc).fused_linear_ops
    ):
        have = ", ".join(s for s in SOC_VERSIONS if get_profile(s).fused_linear_ops)
        raise CliError(
            flag,
            f"a SoC with a kernel of {ACLNN_OF[op]} ({have})",
            soc,
            hint="ops-nn's op_host/config of the op holds ascend910b and ascend910_93 binaries only",
        )


def parse_sizes(text: str, flag: str, expected: str, minimum: int = 0) -> tuple[int, ...]:
    """Comma-separated sizes (``2,3,4``; ``x`` separates too) as a tuple, parsed as ``fastgrad
    compare`` parses a shape (``compare._parse_shape``): a :class:`CliError` naming ``flag`` for
    an empty item (``16,,32``, a leading or trailing comma), a size that is not an integer >=
    ``minimum``, or sizes whose product does not fit int64."""
    from ..compare import _parse_shape
    from ..errors import AclnnError

    try:
        dims = _parse_shape(text) or ()
    except AclnnError:
        raise CliError(flag, expected, repr(text)) from None
    if any(d < minimum for d in dims):
        raise CliError(flag, expected, repr(text))
    return dims


def _missing_dirs(path: str) -> list[str]:
    """The directories of ``path`` (itself included) that do not exist yet, deepest first."""
    made = []
    d = os.path.abspath(path)
    while not os.path.exists(d) and os.path.dirname(d) != d:
        made.append(d)
        d = os.path.dirname(d)
    return made


def probe_write(d: str) -> OSError | None:
    """None when a file can be created in the directory ``d``, else the error (os.access says yes
    to root on a read-only mount: a file is made and removed)."""
    probe = os.path.join(d, f".fastgrad-write-test-{os.getpid()}")
    try:
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        return e
    return None


def _remove_dir_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _prepare_out(path: str) -> bool:
    """Check ``--out`` before any work: a directory (created when missing) where a file can be
    created.  Returns True when this call created it (removed again if the job never writes)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError("--out", "a directory (created when missing)", repr(path), hint="an existing file")
    made = _missing_dirs(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        for d in made:  # the parents made before the failure
            _remove_dir_if_empty(d)
        raise CliError("--out", "a directory that can be created", repr(path), hint=e.strerror or str(e)) from None
    refused = probe_write(path)
    if refused is not None:
        for d in made:
            _remove_dir_if_empty(d)
        raise CliError("--out", "a writable directory", repr(path), hint=refused.strerror or str(refused))
    return bool(made)


class OutputFolder:
    """The files a command writes under its ``--out``, removed again when it fails (any exception,
    Ctrl-C included), with the folder when the command created it: a failed command leaves
    nothing behind.  An ``OSError`` while writing (a full disk) becomes one line naming ``--out``
    and the file::

        with OutputFolder(args.out, created) as out:
            out.add(path)          # before writing path
            ...
    """

    def __init__(self, path: str, created: bool, flag: str = "--out", made: list[str] | None = None):
        self.path, self.created, self.flag = path, created, flag
        self.made = list(made or [])  # the folders made for path (itself and parents), deepest first
        self.files: list[str] = []
        self.current: str | None = None

    @classmethod
    def prepared(cls, path: str, flag: str = "--out") -> OutputFolder:
        """``path`` checked before any work (a writable directory, created with its parents when
        missing: :func:`_prepare_out`), as the folder that removes on failure what the
        command wrote there and every folder it made for it."""
        made = _missing_dirs(path)
        created = _prepare_out(path)
        return cls(path, created, flag, made if created else [])

    def add(self, *paths: str) -> None:
        """Record ``paths`` before writing them (the first is the file named when a write fails)."""
        self.files.extend(paths)
        self.current = paths[0] if paths else None

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, et, e, tb) -> None:
        if et is None:
            return
        self.discard()
        if isinstance(e, OSError) and not isinstance(e, CliError):
            name = e.filename or self.current
            where = f"writing {name}: " if name else ""
            raise CliError(
                self.flag,
                "a directory with room for the files (what this run wrote there is removed)",
                f"{self.path!r}",
                hint=f"{where}{e.strerror or ' '.join(str(e).split())}",
            ) from None

    def discard(self) -> None:
        """Remove what was written, the folders made for it that are now empty, and ``path`` when
        this command created it and it is empty."""
        import os

        top = os.path.abspath(self.path)
        for f in reversed(self.files):
            try:
                os.remove(f)
            except OSError:
                pass
        for d in sorted({os.path.abspath(os.path.dirname(f)) for f in self.files}, key=len, reverse=True):
            while d.startswith(top + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)
        for d in self.made or ([self.path] if self.created else []):  # deepest first, while empty
            try:
                os.rmdir(d)
            except OSError:
                break
