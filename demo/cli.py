"""``python -m demo run|down|env``: the commands behind ``make demo`` and ``make demo-down``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
from rich.console import Console
from rich.live import Live
from rich.text import Text

from demo import cluster
from demo.cluster import GROUP, NAMESPACE, DemoError, NodeBusy, State
from demo.observe import Event, Observer
from demo.render import Verdict, live_view, summary
from demo.scenario import Scenario
from singleton_election.kube import KubeClient, load_kube_config


class Output:
    """Live (a terminal) or plain log lines (``--no-live``, or stdout is not a terminal)."""

    def __init__(self, live: bool) -> None:
        self.live = live
        self.console = Console() if live else Console(width=160, no_color=True, highlight=False)
        self.started = time.monotonic()

    def say(self, text: str, style: str = "") -> None:
        if self.live:
            self.console.print(Text(text, style=style))
        else:
            print(f"[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    @contextlib.contextmanager
    def working(self, text: str) -> Iterator[Callable[[str], None]]:
        """A slow step: a spinner with updatable text (live), or a line and heartbeats (plain)."""
        if not self.live:
            self.say(text)
            yield self.say
            return
        with self.console.status(Text(text)) as status:
            yield lambda update: status.update(Text(update))


def _tail(path: os.PathLike[str] | str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return ""


def _logs(state: State) -> list[Path]:
    """The logs worth a look when the start failed: ours, then the node's (while it exists)."""
    paths = [state.folder / "operator.log", state.folder / "bed.log"]
    if state.node_work is not None:
        paths += [state.node_work / "kubelet.log", state.node_work / "containerd.log"]
    return paths


def bring_up(state: State, out: Output) -> None:
    image = cluster.ImageBuild(state, out.say)  # in the background from now on (minutes when cold)
    with out.working("checking the test bed's binaries (testbed/build.sh builds what is missing)") as update:
        cluster.build_binaries(out.say, update)
    with out.working("starting PostgreSQL, etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the "
                     "real node (containerd, kubelet, kube-proxy)") as update:
        cluster.start_bed(state)
        bed = cluster.BedWatcher(state, out.say)
        image.finish(update, bed)  # the bed comes up meanwhile, and imports the image once built
        cluster.wait_bed(state, bed)
    node, imported = state.data["node"], state.data["image"]
    out.say(f"test bed up: KUBECONFIG={state.data['kubeconfig']}")
    out.say(f"node {node['name']} is Ready (containerd + runc, pods in {node['pod_cidr']}); {imported['reference']} "
            f"imported in {imported['import_seconds']:.0f} s; pods reach the API server and PostgreSQL at {node['ip']}")
    cluster.prepare_cluster(state, out.say)
    with out.working("starting the operator with the chart's RBAC (singleton-operator run, on this host)"):
        cluster.start_operator(state)
    out.say(f"operator leads (log: {state.folder / 'operator.log'})")
    cluster.apply_group(state, out.say)


async def show(state: State, out: Output, pause: float) -> Verdict:
    client = KubeClient(load_kube_config(state.data["kubeconfig"]), user_agent="singleton-demo")
    conn = await asyncpg.connect(state.data["dsn"])
    observer = Observer(client, conn)
    live: Live | None = None
    if out.live:
        live = Live(console=out.console, auto_refresh=False, transient=False)

        def tick() -> None:
            assert live is not None
            live.update(live_view(observer, out.console.size.height), refresh=True)

        observer.on_tick = tick
    else:
        def plain(event: Event) -> None:
            print(f"[{event.elapsed + observer.started - out.started:6.1f}s] {event.text}", flush=True)

        observer.on_event = plain
    started = time.monotonic()
    watcher = asyncio.create_task(observer.run(), name="observer")
    try:
        with live if live is not None else contextlib.nullcontext():
            await Scenario(observer, state, pause=pause).run()
            await observer.tick()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        verdict = Verdict.of(observer, time.monotonic() - started)
        # Live: the last frame, left on the screen, already shows the handovers.
        out.console.print(summary(observer, verdict, with_handovers=live is None))
        print(verdict.line(), flush=True)
        await conn.close()
        await client.close()
    return verdict


def run(args: argparse.Namespace) -> int:
    out = Output(live=not args.no_live and sys.stdout.isatty())
    folder = cluster.state_dir()
    try:
        cluster.check_prerequisites()
    except DemoError as exc:
        out.say(str(exc), "bold red")
        return 2
    previous = State.load(folder)
    if previous.running():
        out.say(f"a demo is already running ({', '.join(previous.running())}); stopping it first")
        cluster.down(folder, out.say)
    elif folder.exists():
        cluster.down(folder, lambda _text: None)  # leftovers of an earlier run
    if (owner := cluster.node_owner()) is not None:  # checked again by the node itself (its lock)
        out.say(str(NodeBusy(owner)), "bold red")
        return 4
    state = State(folder)
    state.set(runner={"pid": os.getpid(), "start": cluster.start_time(os.getpid()) or ""}, namespace=NAMESPACE,
              group=GROUP)
    pause = args.pause if args.pause is not None else (5.0 if out.live else 1.0)
    try:
        bring_up(state, out)
        verdict = asyncio.run(show(state, out, pause))
    except KeyboardInterrupt:
        out.say("interrupted; what runs keeps running", "yellow")
        verdict = None
    except NodeBusy as exc:
        out.say(str(exc), "bold red")
        cluster.down(folder, lambda _text: None)  # nothing of ours is worth a look
        return 4
    except (DemoError, TimeoutError, OSError, asyncpg.PostgresError) as exc:
        out.say(f"the demo failed: {exc}", "bold red")
        for path in _logs(state):
            if tail := _tail(path):
                out.say(f"--- last lines of {path}:\n{tail}")
        out.say("what started keeps running for a look; `make demo-down` stops it and removes its files")
        return 1
    finally:
        state.set(runner=None)
    exports = "\n".join("  " + line for line in state.exports())
    out.say(f"""
The cluster keeps running. To explore it:
{exports}
  kubectl get sgl -n {NAMESPACE}
  kubectl get pods -n {NAMESPACE} -L singleton.dev/role
  kubectl describe sgl {GROUP} -n {NAMESPACE}
  psql "{state.data.get('dsn', '')}" -c 'SELECT token, count(*) FROM ledger GROUP BY token ORDER BY token'
Logs: {folder}/{{operator,bed}}.log, the node's in {state.node_work}/{{kubelet,containerd}}.log, and
  kubectl logs -n {NAMESPACE} <pod> -c poller      # or -c singleton-sidecar
Stop everything: make demo-down""")
    if verdict is not None and not verdict.safe:
        out.say("the ledger shows an overlap or a stale write: that is a bug; please report it", "bold red")
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="start the demo (make demo)")
    run_parser.add_argument("--no-live", action="store_true",
                            help="plain log lines instead of the live view (the default when stdout is not a TTY)")
    run_parser.add_argument("--pause", type=float, default=None,
                            help="seconds between the scripted steps (default 5 live, 1 plain)")
    commands.add_parser("down", help="stop everything and remove the demo's files (make demo-down)")
    commands.add_parser("env", help="print the exports for the running demo's cluster")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args)
    if args.command == "down":
        return cluster.down(cluster.state_dir(), lambda text: print(text, flush=True))
    state = State.load(cluster.state_dir())
    if not state.running():
        print("no demo is running; start one with `make demo`", file=sys.stderr)
        return 1
    print("\n".join(state.exports()))
    return 0
