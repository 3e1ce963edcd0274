"""The docs' figures come from one benchmark report: the generated blocks of README.md and
docs/benchmarks.md match what ``bench/readme_figures.py`` makes from bench/results/report.json,
and the README's snippets run and print."""

import os
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generated_figures_are_up_to_date():
    gen = runpy.run_path(os.path.join(ROOT, "bench", "readme_figures.py"), run_name="figures")
    for path, text in gen["generate"]().items():
        with open(path, encoding="utf-8") as f:
            assert f.read() == text, f"{path} is out of date: run python bench/readme_figures.py"


def _python_blocks():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    blocks = text.split("```python\n")[1:]
    return [b.split("```", 1)[0] for b in blocks]


@pytest.mark.parametrize("i", range(2))
def test_readme_python_snippets_run_and_print(i, tmp_path):
    blocks = _python_blocks()
    assert len(blocks) == 2
    if "torch" in blocks[i].split("\n", 1)[0]:
        pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-c", blocks[i]], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "loss" in p.stdout and "grad_" in p.stdout
    assert os.listdir(tmp_path) == []                    # nothing left behind


def test_typed_package():
    """py.typed ships with the package (PEP 561) and mypy checks the bodies of untyped functions."""
    import tomllib

    assert os.path.exists(os.path.join(ROOT, "fastgrad", "py.typed"))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)
    assert "py.typed" in cfg["tool"]["setuptools"]["package-data"]["fastgrad"]
    assert cfg["tool"]["mypy"]["check_untyped_defs"] is True
