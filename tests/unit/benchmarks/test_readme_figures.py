"""README's Figures block is the rendering of the committed ``benchmarks/figures.json`` (issue 35):
a figure changed by hand in README, or a document committed without ``--render``, fails here.
"""

from __future__ import annotations

import pytest
from benchmarks.figures import COMMITTED, README, RESULTS
from benchmarks.figures_model import load
from benchmarks.figures_render import RESULTS_BEGIN, RESULTS_END, readme_block, render, render_results


def test_readme_shows_the_committed_figures() -> None:
    if not COMMITTED.exists():
        pytest.skip("benchmarks/figures.json is not committed yet: no run of `make figures` has made README's "
                    "figures (issue 35); README's table is still the hand-written one")
    block = readme_block(README.read_text())
    assert block is not None, "README.md has no figures block: run `python -m benchmarks.figures --render`"
    assert block == render(load(COMMITTED)), (
        "README.md's figures block differs from the rendering of benchmarks/figures.json: run "
        "`python -m benchmarks.figures --render` (and change figures only by a run of `make figures`)")
    results = readme_block(RESULTS.read_text(), RESULTS_BEGIN, RESULTS_END)
    assert results == render_results(load(COMMITTED)), (
        "benchmarks/README.md's figures block differs from the rendering of benchmarks/figures.json: run "
        "`python -m benchmarks.figures --render`")
