"""Imports run one way (engine -> runner -> step -> models / kernels): import-linter's layers
contract in pyproject.toml, checked on the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def lint(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports on the packages of `tree`, in a process of its own (it finds them on its path)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([sys.executable, "-c", LINT], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def test_imports_run_one_way():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout


def test_an_import_against_the_layers_is_caught(tmp_path):
    for name in ("jaxrunner", "pallas_kernels"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert lint(tmp_path).returncode == 0
    step = tmp_path / "jaxrunner" / "runner" / "step.py"
    step.write_text("from jaxrunner.runner.input_batch import RequestTable  # a layer above\n" + step.read_text())
    done = lint(tmp_path)
    assert done.returncode == 1 and "jaxrunner.runner.step -> jaxrunner.runner.input_batch" in done.stdout
