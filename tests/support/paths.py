"""Where things are, for tests in any folder."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository's root (``tests/support/`` is two levels below it)."""
DATA = REPO_ROOT / "tests" / "data"
"""The tests' apps, charts and scripts (also in the test apps' image, ``singleton_testbed.apps_image``)."""
