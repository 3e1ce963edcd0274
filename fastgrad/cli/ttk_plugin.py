"""``fastgrad ttk-plugin``: write fastgrad's TTK golden plugin as a file of its own.

Usage::

    fastgrad ttk-plugin --out DIR [--name golden.py] [--force]
    python3 -m ttk kernel -i cases.csv --plugin DIR

The file holds the literal ``__golden__`` table TTK reads (kernel and aclnn entry points of the
seven ops) and imports the functions it names from :mod:`fastgrad.ascend.ttk`, so the plugin
follows the installed fastgrad.  ``DIR`` is created when missing; an existing file is kept unless
``--force``.  ``--name`` is a module name that shadows nothing the plugin or TTK imports (not
``fastgrad.py``, ``numpy.py``, ``json.py`` …).  Exit status 0, or 2 (one line on stderr) for a bad
name, a bad directory or an existing file.
"""

from __future__ import annotations

import keyword
import pathlib
import sys

from ._common import CliError, OneLineParser

#: module names a plugin file must not take: fastgrad (which the plugin imports), what fastgrad
#: imports, and TTK's own package (the standard library's names are refused too)
SHADOWED = frozenset(
    {"fastgrad", "numpy", "ml_dtypes", "numba", "llvmlite", "threadpoolctl", "psutil", "tqdm", "torch", "ttk"}
)


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="fastgrad ttk-plugin", description="Write fastgrad's TTK golden plugin file.")
    p.add_argument("--out", required=True, metavar="DIR", help="the plugin directory (TTK's --plugin)")
    p.add_argument("--name", default="golden.py", help="the file name (default golden.py, as ops-nn's tests/assets)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    name = args.name
    if not name.endswith(".py") or "/" in name or "\\" in name or name.startswith("."):
        raise CliError("--name", "a Python file name like golden.py", repr(name))
    stem = name[: -len(".py")]
    if not stem.isidentifier() or keyword.iskeyword(stem):
        raise CliError("--name", "a Python module name (letters, digits, _) with .py, like golden.py", repr(name))
    if stem in SHADOWED or stem in sys.stdlib_module_names:
        # the plugin imported by its name would be that module, or hide it from fastgrad and TTK
        raise CliError("--name", "a file name no module the plugin or TTK imports has, like golden.py", repr(name))
    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError("--out", "a directory", f"the file {str(out)!r}")
    target = out / name
    if target.exists() and not args.force:
        raise CliError("--out", f"a directory without {name} (or --force)", f"existing {str(target)!r}")
    from ..ascend.ttk import plugin_source

    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        target.write_text(plugin_source())
    except OSError as e:
        if created:
            try:
                out.rmdir()
            except OSError:
                pass
        raise CliError(
            "--out", "a directory where the plugin file can be written", repr(str(out)), hint=e.strerror or str(e)
        ) from None
    print(f"wrote {target} (TTK: python3 -m ttk kernel -i CASES.csv --plugin {out})")
    return 0
