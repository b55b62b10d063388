"""The live terminal view and the summary, with ``rich``."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from demo.cluster import GROUP, NAMESPACE
from demo.ledger import Ledger
from demo.observe import Observer, Step, since_text
from singleton_election import contract

ROLE_STYLES = {contract.ROLE_LEADER: "bold green", contract.ROLE_STANDBY: "cyan",
               contract.ROLE_DRAINING: "yellow", contract.ROLE_RELEASED: "dim"}


def _pods(observer: Observer) -> Table:
    table = Table(title="pods (what each sidecar writes on its own pod)", title_justify="left", expand=True)
    for column in ("pod", "ready", "role", "token", "leader since", "sidecar restarts"):
        table.add_column(column)
    snapshot = observer.snapshot
    for pod in snapshot.pods if snapshot else ():
        state = "terminating" if pod.terminating else ("yes" if pod.ready else "no")
        role = Text(pod.role or "-", style=ROLE_STYLES.get(pod.role or "", ""))
        table.add_row(pod.name, state, role, "" if pod.token is None else str(pod.token), since_text(pod.since),
                      str(pod.sidecar_restarts))
    return table


def _status(observer: Observer) -> Panel:
    status = observer.snapshot.status if observer.snapshot else {}
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold")
    grid.add_column()
    for label, key in (("leader", "leader"), ("token", "token"), ("standbys", "readyStandbys"),
                       ("phase", "phase"), ("transitions", "transitions")):
        grid.add_row(label, str(status.get(key, "")))
    conditions = " ".join(f"{c['type']}={c['status']}" for c in status.get("conditions") or [])
    grid.add_row("conditions", conditions)
    return Panel(grid, title=f"SingletonService {NAMESPACE}/{GROUP} status (the operator)", title_align="left")


def _ledger(ledger: Ledger) -> Panel:
    table = Table.grid(padding=(0, 1))
    for _ in range(5):
        table.add_column()
    for write in ledger.recent[-6:]:
        table.add_row(write.at.astimezone().strftime("%H:%M:%S.%f")[:-3], write.pod, f"token {write.token}",
                      f"item {write.item}", write.phase)
    title = f"ledger: last writes (fenced; {ledger.report.rows} rows, {len(ledger.report.terms)} terms)"
    return Panel(table, title=title, title_align="left")


def _gap_text(gap: float) -> Text:
    if gap <= 0:
        return Text(f"OVERLAP {-gap * 1000:.0f} ms", style="bold red")
    return Text(f"{gap * 1000:.0f} ms", style="green")


def handovers_table(observer: Observer, title: str = "handovers (from the ledger)") -> Table:
    table = Table(title=title, title_justify="left", expand=True)
    for column in ("#", "cause", "from (token)", "to (token)", "no writer for", "new leader in status after"):
        table.add_column(column)
    steps = {step.new_token: step for step in observer.steps if step.new_token is not None}
    for number, handover in enumerate(observer.ledger.handovers(), start=1):
        step: Step | None = steps.get(handover.after.token)
        after = "" if step is None or step.status_seconds is None else f"{step.status_seconds:.2f} s"
        table.add_row(str(number), step.cause if step else observer.cause_of(handover.after.token),
                      f"{handover.before.pod} ({handover.before.token})",
                      f"{handover.after.pod} ({handover.after.token})", _gap_text(handover.gap), after)
    return table


def _log(observer: Observer, lines: int) -> Panel:
    text = Text()
    for event in observer.events[-lines:]:
        text.append(f"{event.elapsed:6.1f}s ", style="dim")
        text.append(event.text + "\n", style=event.style)
    return Panel(text, title="what happened", title_align="left")


def live_view(observer: Observer, height: int) -> RenderableType:
    minutes, seconds = divmod(int(observer.elapsed()), 60)
    header = Text.assemble(("singleton demo", "bold"), f"  group {GROUP} in namespace {NAMESPACE}, 3 replicas, "
                           f"backend postgres  {minutes}:{seconds:02d}\n", ("step: ", "bold"),
                           (observer.title, "bold magenta"))
    middle = Table.grid(expand=True)
    middle.add_column(ratio=1)
    middle.add_column(ratio=1)
    middle.add_row(_status(observer), _ledger(observer.ledger))
    log_lines = max(3, min(12, height - 33))
    return Group(header, _pods(observer), middle, handovers_table(observer), _log(observer, log_lines))


@dataclass(frozen=True)
class Verdict:
    handovers: int
    max_gap: float
    overlaps: int
    regressions: int
    stale_writes: int
    shared_tokens: int
    rows: int
    terms: int
    unfinished: int
    transitions: int
    seconds: float

    @classmethod
    def of(cls, observer: Observer, seconds: float) -> Verdict:
        report = observer.ledger.report
        status = observer.snapshot.status if observer.snapshot else {}
        return cls(handovers=len(report.handovers), max_gap=report.max_gap, overlaps=len(report.overlaps),
                   regressions=len(report.regressions), stale_writes=len(report.stale_accepted),
                   shared_tokens=len(report.shared_tokens), rows=report.rows, terms=len(report.terms),
                   unfinished=len(report.lost_at_handover), transitions=int(status.get("transitions", 0)),
                   seconds=seconds)

    @property
    def safe(self) -> bool:
        return not (self.overlaps or self.regressions or self.stale_writes or self.shared_tokens)

    def line(self) -> str:
        """One machine-readable line (tests read it)."""
        return (f"SUMMARY handovers={self.handovers} max_gap_s={self.max_gap:.3f} overlaps={self.overlaps} "
                f"regressions={self.regressions} stale_writes={self.stale_writes} "
                f"shared_tokens={self.shared_tokens} rows={self.rows} terms={self.terms} "
                f"status_transitions={self.transitions} seconds={self.seconds:.1f}")


def summary(observer: Observer, verdict: Verdict, *, with_handovers: bool = True) -> RenderableType:
    table = Table(title="summary", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_column(style="dim")

    def ok(value: int) -> Text:
        return Text(str(value), style="bold green" if value == 0 else "bold red")

    table.add_row("handovers", str(verdict.handovers), "new terms in the ledger, each a new leader's token")
    table.add_row("leader changes in the status", str(verdict.transitions), "SingletonService .status.transitions")
    table.add_row("max gap without a writer", f"{verdict.max_gap * 1000:.0f} ms",
                  "last write of one term to the first of the next (database clock)")
    table.add_row("overlaps", ok(verdict.overlaps), "two terms writing at once")
    table.add_row("token regressions", ok(verdict.regressions), "a lower token committed after a higher one")
    table.add_row("stale writes accepted", ok(verdict.stale_writes), "the fence refuses them")
    table.add_row("tokens shared by two pods", ok(verdict.shared_tokens), "")
    table.add_row("ledger rows", str(verdict.rows), f"{verdict.terms} terms")
    table.add_row("items cut short at a handover", str(verdict.unfinished),
                  "started by a leader that lost its term mid-item; the fence refused its late write")
    table.add_row("scripted part took", f"{verdict.seconds:.0f} s", "")
    return Group(handovers_table(observer, "handovers"), table) if with_handovers else table
