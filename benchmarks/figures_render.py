"""README's Figures section, rendered from a figures document: the table and the paragraphs under
it that are measurements (pooled mode, the operator, the fault campaign), between
``BEGIN`` and ``END``, stating the machine, the commit and the date of the run, each row's n and
what its setup leaves out, and each goal a row missed.

``python -m benchmarks.figures --render`` writes it into README.md from benchmarks/figures.json;
``tests/unit/benchmarks/test_readme_figures.py`` fails when README's block differs from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.figures_goals import BURST_RATIO, GoalResult, check
from benchmarks.figures_model import QUICK, Document, Fact, Figure, Setup, Stats, StepRun, duration, quantity
from benchmarks.figures_rows import BACKENDS, ROWS, Row, row

BEGIN = "<!-- figures:begin -->"
END = "<!-- figures:end -->"
RESULTS_BEGIN = "<!-- figures-results:begin -->"
RESULTS_END = "<!-- figures-results:end -->"
RESULTS_HEADING = "### The last run's every figure"
HEADING = "## Figures"
NOTICE = ("<!-- Written by `python -m benchmarks.figures --render` from benchmarks/figures.json: "
          "change that file (by a run of `make figures`), not this block. -->")
NOT_MEASURED = "not measured"
NO_FIGURES = "its steps ran but gave no figures for it (their output in the run's log says why)"
FAILED = "**FAIL** (its verdict, and what failed, are in benchmarks/figures.json)"


# --- numbers in words ------------------------------------------------------------------------------

def p99_median(stats: Stats) -> str:
    return f"{quantity(stats.p99, stats.unit)} ({quantity(stats.median, stats.unit)})"


def count(value: Fact) -> int:
    return int(value) if not isinstance(value, str) else 0


def number(value: Fact) -> float:
    return float(value) if not isinstance(value, str) else 0.0


# --- the whole block ------------------------------------------------------------------------------------

def render(document: Document) -> str:
    """The block, ``BEGIN`` to ``END`` inclusive, without a newline after ``END``."""
    goals = check(document)
    parts = [BEGIN, NOTICE, "", intro(document), "", table(document, goals)]
    for paragraph in (pooled(document, goals), operator(document, goals), campaign(document)):
        parts += ["", paragraph]
    parts.append(END)
    return "\n".join(parts)


def intro(document: Document) -> str:
    machine, commit = document.machine, document.commit
    dirty = " with changes not yet committed" if commit.dirty else ""
    quick = ("**Quick mode: n of 1 or 2 and small sizes, a check that every step runs, not figures to quote.** "
             if document.mode == QUICK else "")
    return (f"{quick}Measured in one run of `make figures` ({document.mode} mode, {document.seconds / 60:.0f} min) "
            f"on one machine: {machine.cpu}, {machine.cores} cores, {machine.memory_gib:g} GiB, Linux "
            f"{machine.kernel}, load average {machine.load_before:.2f} when the run began (everything runs on "
            f"these cores: servers, node, benchmark; a busier machine is slower), at commit "
            f"`{commit.sha[:12]}`{dirty} on {document.date[:10]}. Each cell: p99 (median), nearest rank, so the "
            f"p99 of fewer than 100 runs is their maximum; each row says its n and what its setup leaves out. "
            f"Every figure's setup and each step's command: [benchmarks/figures.json](benchmarks/figures.json); "
            f"the run itself: [benchmarks/README.md](benchmarks/README.md#every-figure-in-one-run-make-figures).")


# --- the table ------------------------------------------------------------------------------------------

def table(document: Document, goals: Sequence[GoalResult]) -> str:
    lines = ["| | postgres | lease | both | client-go, 15/10/2 s (ours in the same script) |", "|---|---|---|---|---|"]
    for entry in ROWS:
        if not entry.paragraph:
            lines.append(table_row(document, entry, goals))
    return "\n".join(lines)


def table_row(document: Document, entry: Row, goals: Sequence[GoalResult]) -> str:
    figures = {f.column: f for f in document.of_row(entry.id)}
    absent = why_absent(document, entry)
    cells = [cell(entry, column, figures, absent) for column in (*BACKENDS, "vs-clientgo")]
    label = f"{entry.label} ({entry.limits}; {sizes(entry, figures)})" + missed_text(entry.id, goals)
    if not figures:
        label = f"{entry.label} ({entry.limits}): {NOT_MEASURED}, {absent or NO_FIGURES}"
    return "| " + " | ".join([label, *cells]) + " |"


def cell(entry: Row, column: str, figures: dict[str, Figure], absent: str) -> str:
    if entry.cells == "both-leading":
        return both_leading_cell(column, figures.get("vs-clientgo"), entry)
    if column not in entry.columns:
        return ""
    figure = figures.get(column)
    if figure is None:
        return NOT_MEASURED if not absent else "-"
    if column == "vs-clientgo":
        return clientgo_cell(entry, figure)
    return value_cell(entry, figure.stats)


def value_cell(entry: Row, stats: Stats) -> str:
    if entry.cells == "rate":
        return quantity(stats.median, "")
    if entry.cells == "memory":
        return f"{quantity(stats.median, stats.unit)} ({quantity(stats.max, stats.unit)})"
    return p99_median(stats)


def clientgo_cell(entry: Row, figure: Figure) -> str:
    assert figure.counterpart is not None
    theirs, ours = figure.counterpart.stats, figure.stats
    if entry.cells == "rate":
        return f"{quantity(theirs.median, '')}; ours {quantity(ours.median, '')}"
    return f"{p99_median(theirs)}, n={theirs.n}; ours {p99_median(ours)}, n={ours.n}"


def both_leading_cell(column: str, figure: Figure | None, entry: Row) -> str:
    if column not in entry.columns:
        return ""
    if figure is None or figure.counterpart is None:
        return "-"
    stats, facts = (figure.stats, figure.facts) if column == "lease" else (
        figure.counterpart.stats, figure.counterpart.facts)
    return f"{count(facts.get('runs_both_leading', 0))} of {stats.n} ({duration(stats.p99)})"


def sizes(entry: Row, figures: dict[str, Figure]) -> str:
    """The row's n: one number when every cell has it, else per column; windows for rates."""
    if entry.cells == "rate":
        pods = sorted({number(f.facts.get("window_seconds", 0)) for c, f in figures.items() if c in BACKENDS})
        compared = figures.get("vs-clientgo")
        text = "one window each: " + " or ".join(f"{w:g} s" for w in pods) if pods else "no window"
        return text + (f"; client-go's comparison {number(compared.facts.get('window_seconds', 0)):g} s"
                       if compared is not None else "")
    if entry.cells == "both-leading":
        return "runs per peer in the cells"
    backends = [f.stats.n for column, f in figures.items() if column in BACKENDS]
    if entry.cells == "memory":
        return f"n={backends[0]} pods each" if len(set(backends)) == 1 else "pods: " + ", ".join(map(str, backends))
    if not backends:
        return "n in the cells"
    return f"n={backends[0]} each" if len(set(backends)) == 1 else "n=" + ", ".join(
        f"{column} {f.stats.n}" for column, f in figures.items() if column in BACKENDS)


def missed_text(row_id: str, goals: Sequence[GoalResult]) -> str:
    misses = [g for g in goals if g.row == row_id and not g.met]
    return "".join(f" **Goal missed** ({g.goal}): {g.detail}." for g in misses)


def why_absent(document: Document, entry: Row) -> str:
    """Why the row has no figures from some of its steps ("" when every step ran it)."""
    if entry.id not in document.rows:
        return "not in this run (`--only`)"
    reasons = []
    for record in document.steps:
        if record.id not in entry.steps:
            continue
        if entry.id in record.skipped_rows:
            reasons.append(record.skipped_rows[entry.id])
        elif record.status != "ok":
            reasons.append(step_failure(record))
    return "; ".join(reasons)


def step_failure(record: StepRun) -> str:
    return f"{record.id} {record.status}: {record.reason}"


# --- the paragraphs -------------------------------------------------------------------------------------

def unmeasured(document: Document, row_id: str) -> str:
    entry = row(row_id)
    return f"{entry.label[0].upper()}{entry.label[1:]}: {NOT_MEASURED}, {why_absent(document, entry) or NO_FIGURES}."


def pooled(document: Document, goals: Sequence[GoalResult]) -> str:
    renew, failover = document.figure("pooled.renew"), document.figure("pooled.failover")
    if renew is None or failover is None:
        return unmeasured(document, "pooled")
    facts = failover.facts
    return (f"With `postgres.mode: pooled`, {count(facts['groups']):,} groups of {count(facts['replicas'])} share one "
            f"PostgreSQL (`max_connections` 100) through PgBouncer on {count(facts['pool_size'])} server connections "
            f"(host processes: each candidate is the sidecar's backend and election core, {count(facts['workers'])} "
            f"processes hold them all; {count(facts['runs'])} run(s)): renewals at rest p99 {p99_median(renew.stats)}, "
            f"n={renew.stats.n:,}; a crashed leader replaced within p99 {p99_median(failover.stats)}, max "
            f"{duration(failover.stats.max)}, n={failover.stats.n} leaders killed at once; "
            f"{count(facts['leaderless_groups'])} groups left without a leader. The candidates took "
            f"{100 * number(facts['candidates_cpu_share']):.0f} % of the {count(facts['cores'])} cores at rest."
            + missed_text("pooled", goals))


def operator(document: Document, goals: Sequence[GoalResult]) -> str:
    return f"{burst(document, goals)} {at_rest(document)}"


def burst(document: Document, goals: Sequence[GoalResult]) -> str:
    figures = sorted(document.of_row("burst"), key=lambda f: int(f.column))
    if not figures:
        return unmeasured(document, "burst")
    sizes_text = "; ".join(
        f"{f.column}: {p99_median(f.stats)} against {p99_median(f.counterpart.stats)}, "
        f"ratio {number(f.facts['ratio_p99']):.2f}" for f in figures if f.counterpart is not None)
    misses = [g for g in goals if g.row == "burst" and not g.met]
    verdict = ("met at every size" if not misses else
               "**missed** at " + ", ".join(g.figure.split(".", 1)[1] for g in misses) + " groups")
    return (f"The operator's burst (host processes: etcd, kube-apiserver and the operator with the chart's RBAC, no "
            f"node; the benchmark makes each group's pods Ready beforehand): SingletonServices created at once, "
            f"each one's create → its status naming its leader, p99 (median) of the operator against the floor's, "
            f"a stand-in making only the writes a new group needs, timed in the same run "
            f"({count(figures[0].facts['runs'])} run(s) per size, n = its groups): {sizes_text}. Goal, p99 ≤ "
            f"{BURST_RATIO:g} times the floor's: {verdict}.")


def at_rest(document: Document) -> str:
    requests, cpu, rss = (document.figure(f"operator-rest.{k}") for k in ("requests", "cpu", "rss"))
    if requests is None or cpu is None or rss is None:
        return unmeasured(document, "operator-rest")
    window = number(requests.facts["window_seconds"])
    text = (f"At rest carrying {count(rss.facts['groups'])} groups (one window of {window:g} s), the "
            f"operator makes {quantity(requests.stats.median, '')} API requests/s in all, uses "
            f"{quantity(cpu.stats.median, '%')} of a core and holds {quantity(rss.stats.median, 'MB')}")
    one_more, change = document.figure("operator-rest.one-more"), document.figure("operator-rest.change")
    if one_more is not None:
        text += (f"; a group created beside them has its leader in its status after p99 {p99_median(one_more.stats)},"
                 f" n={one_more.stats.n}")
    if change is not None:
        text += f"; a leader change shows in its status after p99 {p99_median(change.stats)}, n={change.stats.n}"
    return text + "."


def campaign(document: Document) -> str:
    figure = document.figure("campaign.all")
    if figure is None:
        return unmeasured(document, "campaign")
    facts = figure.facts
    caught = count(facts["caught_mid_act"])
    kinds = str(facts["kinds"]).replace(" ", ", ")
    head = (f"A seeded campaign of {count(facts['faults'])} faults on the real node ({kinds}; "
            f"backends {figure.setup.backend}; timings {figure.setup.timings}; seed {facts['seed']}, "
            f"{number(facts['seconds']) / 60:.0f} min) found **{count(facts['acting_overlaps'])} times two apps acting "
            f"at once**, judged by the apps' own log of every act, which no fence hides; "
            f"{recovered(count(facts['unrecovered']))} (failover p99 {p99_median(figure.stats)}, "
            f"max {duration(figure.stats.max)}); {count(facts['fenced_overlaps'])} fenced overlaps, "
            f"{count(facts['regressions'])} regressions, {count(facts['stale_accepted'])} stale writes accepted: "
            f"{'PASS' if count(facts['verdict_ok']) else FAILED}.")
    excuse = (f" What that count excuses, and only a fence refuses: an act a whole-pod freeze (every process stopped "
              f"at once) caught mid-act finishes when the pod thaws, possibly after the successor began; this run had "
              f"{caught} such acts in {count(facts['inflight_through_freeze'])} of {count(facts['freezes'])} freezes")
    if caught:
        excuse += (f", the latest ending {duration(number(facts['caught_latest_after_successor_seconds']))} after "
                   f"the successor's first act; {count(facts['caught_refused'])} refused by the fence, "
                   f"{count(facts['caught_written'])} written")
    return head + excuse + "."


# --- benchmarks/README.md: every figure of the run ---------------------------------------------------

def render_results(document: Document) -> str:
    """benchmarks/README.md's block, ``RESULTS_BEGIN`` to ``RESULTS_END``: the run (machine,
    commit, date, each step's command and time) and every figure with its setup and facts."""
    machine = document.machine
    parts = [RESULTS_BEGIN, NOTICE.replace("README.md", "benchmarks/README.md"), "",
             f"{document.mode.capitalize()} mode, {document.date[:10]}, commit `{document.commit.sha[:12]}`"
             f"{' with changes not yet committed' if document.commit.dirty else ''}: {machine.cpu}, "
             f"{machine.cores} cores, {machine.memory_gib:g} GiB, Linux {machine.kernel}, load average "
             f"{machine.load_before:.2f} before and {machine.load_after:.2f} after; "
             f"{document.seconds / 60:.1f} min in all.", "",
             "| step | command | minutes (estimate) | status |", "|---|---|---|---|"]
    parts += [f"| {r.id} | `{' '.join(r.command)}` | {r.seconds / 60:.1f} ({r.estimate_seconds / 60:.1f}) | "
              f"{r.status}{': ' + r.reason if r.reason else ''} |" for r in document.steps]
    parts += ["", "| figure | scenario | setup | n | median | p99 | max | facts |", "|---|---|---|---|---|---|---|---|"]
    for figure in document.figures:
        parts.append(figure_line(figure.id, figure.scenario, setup_text(figure.setup), figure.stats, figure.facts))
        if figure.counterpart is not None:
            theirs = figure.counterpart
            parts.append(figure_line(f"{figure.id}, {theirs.peer}", theirs.setup, "", theirs.stats, theirs.facts))
    parts.append(RESULTS_END)
    return "\n".join(parts)


def setup_text(setup: Setup) -> str:
    named = [f"{label} {value}" for label, value in (("gate", setup.gate), ("backend", setup.backend),
                                                     ("timings", setup.timings)) if value and value != "-"]
    return "; ".join([setup.where, ", ".join(named), setup.details] if named else [setup.where, setup.details])


def figure_line(name: str, scenario: str, setup: str, stats: Stats, facts: dict[str, Fact]) -> str:
    cells = [name, scenario, setup, str(stats.n), quantity(stats.median, stats.unit), quantity(stats.p99, stats.unit),
             quantity(stats.max, stats.unit),
             ", ".join(f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}"
                       for key, value in facts.items())]
    return "| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |"


def recovered(unrecovered: int) -> str:
    return "every fault was followed by a ready leader" if not unrecovered else \
        f"**{unrecovered} faults left no ready leader**"


# --- README ---------------------------------------------------------------------------------------------

def readme_block(text: str, begin: str = BEGIN, end: str = END) -> str | None:
    """The block, ``begin`` to ``end`` inclusive, or None when the text has none."""
    start = text.find(begin)
    stop = text.find(end, start)
    if start < 0 or stop < 0:
        return None
    return text[start:stop + len(end)]


def with_block(text: str, block: str, begin: str = BEGIN, end: str = END, heading: str = HEADING) -> str:
    """The text with ``block`` in place of its block; without one, in place of the body of its
    ``heading`` section (the heading kept, up to the next heading of its level or higher).
    ValueError without either."""
    current = readme_block(text, begin, end)
    if current is not None:
        return text.replace(current, block, 1)
    at = text.find(f"\n{heading}\n")
    if at < 0:
        raise ValueError(f"the file has neither {begin} ... {end} nor a '{heading}' section")
    body = at + len(heading) + 2
    level = heading.split(" ", 1)[0]
    following = min((i for i in (text.find(f"\n{'#' * n} ", body) for n in range(1, len(level) + 1)) if i >= 0),
                    default=-1)
    rest = text[following:] if following >= 0 else "\n"
    return f"{text[:body]}\n{block}\n{rest}"
