"""The ``fastgrad`` command.

``fastgrad [options]``            the main job: large-vocabulary FLCE gradient (see ``run.py``)
``fastgrad bench [options]``      benchmark report (``bench.py``)
``fastgrad compare [options]``    Ascend accuracy standards on two outputs (``compare.py``)
``fastgrad golden OP [options]``  golden outputs through the float64 reference (``golden.py``)
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = ("bench", "compare", "golden", "run")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            mod = importlib.import_module(f"{__name__}.{argv[0]}")
            return int(mod.main(argv[1:]) or 0)
        from . import run

        return int(run.main(argv) or 0)
    except SystemExit as e:  # argparse: 0 for --help, 2 for bad usage
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
