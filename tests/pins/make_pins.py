"""Write the bitwise pins of the LM-head ops (tests/pins/lm_head_pins.json).

Run with the fastgrad whose results are to be pinned first on the import path, e.g. for the
commit the pins were taken from (6464144):

    git archive 6464144 | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python tests/pins/make_pins.py --merge

``--merge`` adds this machine's keys to the file (other machines' keys are kept): the native
kernels' keys hold on every CPU of the host class (``pin_cases.host_class``) with the ISA, the
BLAS keys only with the same OpenBLAS kernel and host class.  ``--only blas-`` pins the BLAS keys
alone (6464144 had no native kernel for an AVX2-only CPU: its "auto" ran BLAS there).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent))

import pin_cases  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "lm_head_pins.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--merge", action="store_true", help="keep the keys already in the file")
    ap.add_argument("--source", default="6464144", help="the commit whose results these are")
    ap.add_argument("--isa", default="", help="the native kernel's ISA setting (fastgrad._config.set_native_isa)")
    ap.add_argument("--only", default="", help="pin only the keys starting with this (e.g. 'blas-')")
    a = ap.parse_args()
    import fastgrad

    if a.isa:  # e.g. "avx2": on an AVX2-only CPU "auto" keeps BLAS, the native keys need the kernel
        from fastgrad import _config

        _config.set_native_isa(a.isa)
    data = json.loads(OUT.read_text()) if a.merge and OUT.exists() else {"pins": {}}
    data["source"] = a.source
    data["fastgrad_path"] = "(see --source)"
    for key, cases in pin_cases.machine_keys().items():
        if not key.startswith(a.only):
            continue
        entry = data["pins"].setdefault(key, {})
        for name in cases:
            entry[name] = pin_cases.digest(name, key)
        stale = data.get("stale", {}).get("names", {})
        if key in stale:  # re-pinned here: no longer stale
            stale[key] = [n for n in stale[key] if n not in cases]
            if not stale[key]:
                del stale[key]
        data.setdefault("sources", {})[key] = a.source
        print(key, len(cases), "cases", file=sys.stderr)
    print("fastgrad from", fastgrad.__file__, file=sys.stderr)
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
