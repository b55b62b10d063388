"""Every figure of README's Figures section in one run, on this machine (``make figures``).

    sudo .venv/bin/python -m benchmarks.figures [--quick] [--only ROW ...] [--json PATH]   # measure
    .venv/bin/python -m benchmarks.figures --plan [--quick] [--only ROW ...]               # what it would run
    .venv/bin/python -m benchmarks.figures --check [--json PATH]                           # the goals
    .venv/bin/python -m benchmarks.figures --render [--json PATH]                          # README's block

Measuring runs the existing benchmark modules one after the other (``figures_rows.STEPS``: each
as ``python -m benchmarks.<module> ... --json``), turns their output into figures and writes one
document (``figures_model``): every figure with its scenario, setup, n, median, p99 and max, and
client-go's where the row compares; the machine (from ``/proc``), the commit, the date, the
whole run's duration and each step's beside its estimate. The real node's steps need root; without
it (or while another process holds the node) they are skipped and their rows say so.

Full mode is README's: its run counts fit ``BUDGET_SECONDS`` (40 min) on the 2-core machine.
``--quick`` runs every step with n of 1 or 2 and small sizes: a check that the whole chain runs,
not figures to quote. ``--only`` runs the steps the chosen rows come from (a step measures all of
its rows; the document keeps the chosen ones). The document goes to benchmarks/figures.json in a
full run of every row, else to build/ (``--json`` to choose): a partial or quick run never
replaces the committed figures by accident.

``--check`` prints every goal (``figures_goals``) and exits 1 when one is missed or could not be
checked; ``--render`` writes README's Figures block and benchmarks/README.md's every figure of
the run (``figures_render``) from the document.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.figures_goals import check, missed, unchecked
from benchmarks.figures_model import (
    FULL,
    QUICK,
    Document,
    Figure,
    StepRun,
    load,
    load_average,
    read_commit,
    read_machine,
    to_json,
)
from benchmarks.figures_render import (
    BEGIN,
    END,
    HEADING,
    RESULTS_BEGIN,
    RESULTS_END,
    RESULTS_HEADING,
    render,
    render_results,
    with_block,
)
from benchmarks.figures_rows import BUDGET_SECONDS, ROWS, Step, estimate, steps_for

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "benchmarks" / "figures.json"
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "README.md"
ROW_IDS = tuple(r.id for r in ROWS)
STEP_TIMEOUT_FACTOR = 3
"""A step is stopped after this many times its estimate (at least a minute's worth)."""
MODULE_PREFIX = ("python", "-m")
"""How a step's command starts in the document (run with this interpreter)."""


def default_json(mode: str, only: Sequence[str] | None) -> Path:
    """Where a run writes its document when ``--json`` is not given."""
    if mode == QUICK:
        return ROOT / "build" / "figures-quick.json"
    if only:
        return ROOT / "build" / "figures-only.json"
    return COMMITTED


def node_unavailable() -> str:
    """Why the real node cannot run here now ("" when it can)."""
    from singleton_testbed.binaries import find_all
    from singleton_testbed.node import busy_reason, unavailable_reason

    return unavailable_reason(find_all()) or busy_reason() or ""


def command_of(step: Step, mode: str, workdir: Path, node_reason: str) -> list[str]:
    """The step's module and arguments (``{workdir}`` filled in), for this mode and node."""
    arguments = [a.replace("{workdir}", str(workdir)) for a in step.arguments(mode)]
    if node_reason and step.without_node is not None:
        arguments += step.without_node
    return [*MODULE_PREFIX, step.module, *arguments]


def run_step(step: Step, mode: str, workdir: Path, node_reason: str) -> tuple[StepRun, list[Figure]]:
    """Run one step and parse its ``--json``; a step that cannot run or gives no figures is
    recorded, not raised: the other steps still run."""
    command = command_of(step, mode, workdir, node_reason)
    if step.needs_node and node_reason:
        print(f"[figures] {step.id}: skipped: {node_reason}", flush=True)
        return StepRun(step.id, command, 0.0, step.estimate(mode), "skipped", node_reason), []
    skipped_rows = dict.fromkeys(step.node_rows, node_reason) if node_reason and step.without_node else {}
    output = workdir / f"{step.id}.json"
    print(f"[figures] {step.id}: {' '.join(command)} (estimate {step.estimate(mode) / 60:.1f} min)", flush=True)
    started = time.monotonic()
    try:
        # Three times its estimate: a hung step must not hold the whole run (nor lose its other steps).
        code = subprocess.run([sys.executable, *command[1:], "--json", str(output)], cwd=ROOT, check=False,
                              timeout=STEP_TIMEOUT_FACTOR * max(step.estimate(mode), 60.0)).returncode
    except subprocess.TimeoutExpired:
        seconds = time.monotonic() - started
        return StepRun(step.id, command, seconds, step.estimate(mode), "failed",
                       f"timed out after {seconds / 60:.1f} min", None, skipped_rows), []
    seconds = time.monotonic() - started
    print(f"[figures] {step.id}: exit {code} after {seconds / 60:.1f} min", flush=True)
    record = StepRun(step.id, command, seconds, step.estimate(mode), "ok", "", code, skipped_rows)
    if not output.exists():
        return replace(record, status="failed", reason=f"exit {code}, no --json output"), []
    try:
        return record, step.parse(json.loads(output.read_text()), command[len(MODULE_PREFIX) + 1:])
    except Exception as exc:  # noqa: BLE001 - any parser error fails this step alone, with its reason
        return replace(record, status="failed", reason=f"its --json did not parse: {exc!r}"), []


def measure(mode: str, rows: Sequence[str]) -> Document:
    """Run the rows' steps, one after the other, into one document."""
    steps = steps_for(rows)
    load_before, begun, started = load_average(), datetime.now(UTC), time.monotonic()
    commit = read_commit(ROOT)
    node_reason = node_unavailable() if any(s.needs_node or s.node_rows for s in steps) else ""
    records: list[StepRun] = []
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="singleton-figures-") as folder:
        for step in steps:
            record, found = run_step(step, mode, Path(folder), node_reason)
            records.append(record)
            figures += [f for f in found if f.row in rows]
    return Document(mode=mode, machine=read_machine(load_before), commit=commit,
                    date=begun.isoformat(timespec="seconds"), seconds=time.monotonic() - started, rows=list(rows),
                    steps=records, figures=figures)


def print_plan(mode: str, rows: Sequence[str]) -> None:
    for step in steps_for(rows):
        needs = " (root, the real node)" if step.needs_node else ""
        print(f"{step.id:<9} {step.estimate(mode) / 60:5.1f} min{needs}: "
              + " ".join(command_of(step, mode, Path("WORKDIR"), "")))
    budget = f" (budget {BUDGET_SECONDS / 60:.0f} min)" if mode == FULL else ""
    print(f"estimated {estimate(rows, mode) / 60:.1f} min in all{budget}")


def print_goals(document: Document) -> int:
    """Every goal, met or missed, and the rows a goal could not be checked on; 1 when any was
    missed or could not be checked."""
    results = check(document)
    for result in results:
        print(f"{'met   ' if result.met else 'MISSED'} {result.figure}: {result.goal}: {result.detail}")
    gaps = unchecked(document)
    for row_id in gaps:
        print(f"NOT CHECKED {row_id}: its figures are not in the document")
    return 1 if missed(results) or gaps else 0


def render_readme(document: Document, readme: Path = README, results: Path = RESULTS) -> list[Path]:
    """Write the document's blocks into README (its Figures) and benchmarks/README.md (every
    figure of the run); the files that changed."""
    # Both made before either is written: a file without its markers leaves the other unchanged too.
    updates = {}
    for path, block, markers in ((readme, render(document), (BEGIN, END, HEADING)),
                                 (results, render_results(document), (RESULTS_BEGIN, RESULTS_END, RESULTS_HEADING))):
        text = path.read_text()
        if (updated := with_block(text, block, *markers)) != text:
            updates[path] = updated
    for path, updated in updates.items():
        path.write_text(updated)
    return list(updates)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="check the goals of a document (exit 1: one missed)")
    action.add_argument("--render", action="store_true",
                        help="write README's Figures block and benchmarks/README.md's figures from a document")
    action.add_argument("--plan", action="store_true", help="print the steps, their commands and estimates")
    parser.add_argument("--quick", action="store_true", help="every step with small n: a check, not figures")
    parser.add_argument("--only", nargs="+", choices=ROW_IDS, metavar="ROW",
                        help=f"only the steps of these rows: {', '.join(ROW_IDS)}")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help=f"the document (default {COMMITTED.relative_to(ROOT)}; a quick or --only run writes "
                             "build/figures-quick.json or build/figures-only.json)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mode = QUICK if args.quick else FULL
    rows = list(args.only) if args.only else list(ROW_IDS)
    if args.plan:
        print_plan(mode, rows)
        return 0
    if args.check or args.render:
        document = load(args.json or COMMITTED)
        if args.check:
            return print_goals(document)
        changed = render_readme(document)
        print("rewritten: " + ", ".join(str(p.relative_to(ROOT)) for p in changed) if changed else
              "README.md and benchmarks/README.md already up to date")
        return 0
    document = measure(mode, rows)
    incomplete = [r.id for r in document.steps if r.status != "ok" or r.skipped_rows]
    path = args.json or default_json(mode, args.only)
    if path == COMMITTED and incomplete:
        # The committed figures are replaced by a whole run only: a step skipped or failed here
        # would leave README's rows without their figures.
        path = ROOT / "build" / "figures-incomplete.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(document))
    print(f"[figures] {len(document.figures)} figures in {document.seconds / 60:.1f} min "
          f"(estimated {estimate(rows, mode) / 60:.1f}): {path}")
    for record in document.steps:
        print(f"  {record.id:<9} {record.status:<7} {record.seconds / 60:5.1f} min (estimate "
              f"{record.estimate_seconds / 60:.1f}) {record.reason}")
    print_goals(document)  # a missed goal is a finding of the run, not its failure: --check fails on it
    if incomplete:
        print(f"[figures] steps not ok: {', '.join(incomplete)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
