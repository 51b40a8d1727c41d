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


def test_every_error_the_product_raises_on_purpose_has_one_root():
    """One exception tree: each layer's errors derive from its root, and the roots from StokerError."""
    import importlib
    import inspect
    import pkgutil

    from csi.failures import DriverError
    from fusecore.failures import StokerError
    from stoker_operator.failures import OperatorError

    roots = {"fusecore": StokerError, "csi": DriverError, "stoker_operator": OperatorError}
    strays = []
    for package, root in roots.items():
        module = importlib.import_module(package)
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            if info.name.endswith(("_pb2", "_pb2_grpc")) or info.name == "fusecore.__main__":
                continue
            for name, cls in inspect.getmembers(importlib.import_module(info.name), inspect.isclass):
                if cls.__module__ == info.name and issubclass(cls, BaseException) and not issubclass(cls, root):
                    strays.append(f"{info.name}.{name}")
    assert strays == [], f"errors outside their layer's root: {strays}"
