"""The ``fastgrad`` command.

``fastgrad [options]``            the main job: large-vocabulary FLCE gradient (see ``run.py``)
``fastgrad case OP [options]``    a device test case: inputs + golden as .bin/.json, manifest (``case.py``)
``fastgrad golden OP [options]``  golden outputs through the float64 reference (``golden.py``;
                                  ``--from-msprobe``: ``msprobe.py``)
``fastgrad compare [options]``    Ascend accuracy standards on two outputs (``compare.py``)
``fastgrad bench [options]``      benchmark report (``bench.py``; ``--from-profile``: ``profile.py``)
``fastgrad ttk-plugin --out DIR``  write the TTK golden plugin file (``ttk_plugin.py``)

``fastgrad -h`` lists them all (``_common.SUBCOMMAND_HELP``); an op is named by fastgrad's name or
its aclnn name (``_common.resolve_op``).

Error convention, for every subcommand: a bad flag, file, shape or value prints **one line** on
stderr (``fastgrad: --flag: expected ..., got ...``) and exits with status 2, without a
traceback; ``--debug`` (anywhere on the command line) adds the traceback.  Exit status 1 is
reserved for a verdict (``--check``, ``compare``), 3 for an internal error, 130 for Ctrl-C
(143 for SIGTERM; the main job prints its partial report first).  Invalid environment
settings (``FASTGRAD_WORKSPACE_MB=abc``, ``FASTGRAD_GEMM=mkl``) are user errors too (exit 2).
"""

from __future__ import annotations

import importlib
import sys

from ._common import (  # noqa: F401 - the command's shared pieces, re-exported
    EXIT_FAILED_CHECK,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    stdout_to_devnull,
)

SUBCOMMANDS = ("bench", "case", "compare", "golden", "run", "ttk-plugin")


_SHAPE = "try a smaller shape"
#: what a MemoryError's line advises, by the command that raised it: the flags that command has
_MEMORY_ADVICE = {
    "fastgrad": "try a smaller --workspace-mb, more --shards or a smaller shape",
    "fastgrad run": "try a smaller --workspace-mb, more --shards or a smaller shape",
    "fastgrad golden": "the float64 reference holds every output in float64: try a smaller shape",
    "fastgrad case": "try a smaller --shape",
    "fastgrad bench": "try --quick or fewer --ops",
}


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    prog = "fastgrad"
    try:
        if argv and argv[0] in SUBCOMMANDS:
            prog = f"fastgrad {argv[0]}"
            mod = importlib.import_module(f"{__name__}.{argv[0].replace('-', '_')}")
            return int(mod.main(argv[1:]) or 0)
        from . import run

        return int(run.main(argv) or 0)
    except SystemExit as e:  # argparse: 0 for --help/--version, 2 for bad usage (already printed)
        if isinstance(e.code, str):
            print(_one_line(e.code), file=sys.stderr)
            return EXIT_USAGE
        return EXIT_OK if e.code is None else int(e.code)
    except BrokenPipeError:  # `fastgrad --list-tensors CKPT | head`: the reader left, say nothing
        # (a verdict's status survives the closed pipe where it is printed: print_or_pipe_closed)
        stdout_to_devnull()
        return EXIT_OK
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into exit statuses
        from ..errors import AclnnError

        if debug:
            import traceback

            traceback.print_exc()
        if isinstance(e, CliError):
            print(f"{prog}: {_one_line(e)}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(e, AclnnError):
            print(f"{prog}: {_one_line(e)}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(e, MemoryError):
            said = f": {_one_line(e)}" if str(e) else ""
            print(f"{prog}: out of memory{said} ({_MEMORY_ADVICE.get(prog, _SHAPE)})", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(e, OSError):
            where = f" {e.filename!r}" if getattr(e, "filename", None) else ""
            print(f"{prog}: cannot use{where}: {e.strerror or _one_line(e)}", file=sys.stderr)
            return EXIT_USAGE
        print(
            f"{prog}: internal error: {type(e).__name__}: {_one_line(e)}"
            + ("" if debug else " (run with --debug for the traceback)"),
            file=sys.stderr,
        )
        return EXIT_INTERNAL
