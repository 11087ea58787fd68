"""The repository passes ruff with the settings in pyproject.toml (the version is pinned in the test extra, so
a new ruff release cannot fail a clean checkout)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=REPO, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
