"""The pieces every subcommand of the ``fastgrad`` command shares: exit statuses, the one-line
user error, the one-line argument parser, the Markdown writer (imported by the subcommands and
re-exported by ``fastgrad.cli``; importing nothing of the command itself, so no subcommand
imports the package that dispatches to it)."""

from __future__ import annotations

import argparse

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


def write_markdown(path: str, text: str) -> None:
    """Write a report's Markdown table to ``path`` (its folder made if missing) and say so."""
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")
