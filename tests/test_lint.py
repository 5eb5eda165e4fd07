"""The tree passes ruff with the project's rule set (pyproject.toml, [tool.ruff.lint]):
pyflakes' findings (unused or undefined names, redefinitions), syntax errors, mutable
default arguments and useless expressions."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [exe]


def test_ruff_is_clean():
    res = subprocess.run([*_ruff(), "check", "--output-format", "concise", "clattn", "tests",
                          "tools", "examples"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
