"""The one-way dependencies of the design, checked mechanically with import-linter."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_hold():
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    assert lint, "import-linter is a test dependency"
    result = subprocess.run([lint, os.path.join(ROOT, "pyproject.toml")], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "KEPT" in result.stdout and "BROKEN" not in result.stdout


def test_mypy_finds_nothing():
    """Type check (pyproject's [tool.mypy]: the product packages, the generated gRPC modules aside)."""
    mypy = shutil.which("mypy", path=os.path.dirname(sys.executable)) or shutil.which("mypy")
    assert mypy, "mypy is a test dependency"
    result = subprocess.run([mypy, "--no-incremental", "--no-error-summary"], cwd=ROOT, capture_output=True,
                            text=True)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode == 0 and not errors, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_finds_nothing():
    """Lint (pyproject's [tool.ruff]): unused or undefined names, mutable defaults, bare excepts."""
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency"
    result = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
