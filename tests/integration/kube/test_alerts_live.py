"""The shipped alerts fire for real: a Prometheus server (built from Go modules,
testbed/build-prometheus.sh) scrapes a group of real sidecars (host processes on the session's
PostgreSQL) and evaluates the chart's rendered rules while the group's lock is stuck.

The fault is the runbook's stuck lock: the leader's sidecar is paused (SIGSTOP), so its
PostgreSQL session keeps the lock while nothing renews it. With a lease of 20 s the standbys
wait that long behind it before they end its session and take over: long enough for the
alerts, whose `for` is shortened through the chart's values as a user would.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from singleton_testbed.binaries import find_prometheus
from singleton_testbed.harness.sidecars import FAST_TIMINGS, SidecarProcess, one_leader, wait_for
from singleton_testbed.procs import Process, free_port, wait_until
from tests.integration.kube.test_alerts import shipped_rules
from tests.integration.kube.test_chart import needs_helm
from tests.support.monitoring import COLD_BUILD

NAMESPACE = "feeds"
# Short `for`s from values, the way a user shortens them: the scrape and evaluation run each second.
FOR = {"SingletonNoLeader": "2s", "SingletonStuckLock": "4s", "SingletonTwoLeaders": "2s"}

Obj = dict[str, Any]


class Prometheus:
    def __init__(self, process: Process, port: int) -> None:
        self.process, self.port = process, port
        self.seen: set[tuple[str, str]] = set()

    def get(self, path: str) -> Obj:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as response:
            body: Obj = json.load(response)
        return body

    def firing(self) -> set[tuple[str, str]]:
        """(alertname, group) of the alerts firing now; each answer is kept in ``seen``."""
        alerts = self.get("/api/v1/alerts")["data"]["alerts"]
        now = {(a["labels"]["alertname"], a["labels"].get("group", "")) for a in alerts if a["state"] == "firing"}
        self.seen |= now
        return now

    def describe(self, group: str) -> str:
        """What Prometheus has of the group now (for a failure's message)."""
        lines = []
        for query in (f"singleton_is_leader{{group=%22{group}%22}}", f"singleton_lock_held{{group=%22{group}%22}}",
                      "up", "ALERTS"):
            result = self.get(f"/api/v1/query?query={query}")["data"]["result"]
            lines.append(f"{query}: " + ", ".join(f"{r['metric']} {r['value'][1]}" for r in result))
        return "\n".join(lines)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False


def sidecar(name: str, group: str, dsn: str, tmp_path: Path) -> SidecarProcess:
    env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres", "SINGLETON_POSTGRES_DSN": dsn,
           "SINGLETON_IDENTITY": f"{name}-{uuid.uuid4().hex[:6]}", **FAST_TIMINGS, "SINGLETON_LEASE_DURATION": "20"}
    return SidecarProcess(name, env, tmp_path / f"{name}.log")


@pytest.fixture
def started() -> Iterator[list[SidecarProcess]]:
    processes: list[SidecarProcess] = []
    yield processes
    for process in processes:
        process.stop()


@contextlib.contextmanager
def prometheus_scraping(sidecars: list[SidecarProcess], rules: Obj, folder: Path) -> Iterator[Prometheus]:
    folder.mkdir()
    (folder / "alerts.yaml").write_text(yaml.safe_dump(rules))
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "500ms", "evaluation_interval": "1s"},
        "rule_files": ["alerts.yaml"],
        # What the chart's PodMonitor adds to each target: the pod's namespace and name.
        "scrape_configs": [{"job_name": "sidecars", "static_configs": [
            {"targets": [f"127.0.0.1:{s.port}"], "labels": {"namespace": NAMESPACE, "pod": s.name}}
            for s in sidecars]}],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = Process("prometheus", [str(find_prometheus("prometheus")), "--config.file=prometheus.yml",
                                     f"--storage.tsdb.path={folder / 'data'}",
                                     f"--web.listen-address=127.0.0.1:{port}"],
                      log_path=folder / "prometheus.log", cwd=folder)
    process.start()
    try:
        server = Prometheus(process, port)
        wait_until(server.ready, timeout=60, what="Prometheus to be ready", proc=process)
        yield server
    finally:
        process.stop()


@COLD_BUILD
@needs_helm
def test_stuck_lock_and_no_leader_fire_on_real_sidecars_and_clear(
    pg_dsn: str, tmp_path: Path, started: list[SidecarProcess]
) -> None:
    group = "g-" + uuid.uuid4().hex[:8]
    leader = sidecar("c0", group, pg_dsn, tmp_path)
    started.append(leader.start())
    one_leader([leader])
    standbys = [sidecar(f"c{i}", group, pg_dsn, tmp_path) for i in (1, 2)]
    started.extend(s.start() for s in standbys)
    rules = shipped_rules(tmp_path, {"prometheusRule": {"for": FOR}})
    with prometheus_scraping([leader, *standbys], rules, tmp_path / "prometheus") as server:
        # Healthy: every target scraped, one leader; nothing fires.
        query = f"/api/v1/query?query=count(singleton_lock_held{{group=%22{group}%22}})"
        wait_for(lambda: [r["value"][1] for r in server.get(query)["data"]["result"]] == ["3"] and not server.firing(),
                 30, "the three sidecars scraped, no alert", 0.5)
        leader.signal(signal.SIGSTOP)
        try:
            try:
                wait_for(lambda: {("SingletonNoLeader", group), ("SingletonStuckLock", group)} <= server.firing(), 60,
                         "SingletonNoLeader and SingletonStuckLock to fire", 0.5)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{server.describe(group)}") from None
            # Really stuck: the standbys still wait behind the paused holder.
            assert not [s.name for s in standbys if (s.leader_doc() or {}).get("isLeader")]
            # Once the lease has expired, a standby ends the holder's session and takes over: the alerts clear.
            wait_for(lambda: not server.firing(), 60, "the alerts to clear after a standby took over", 0.5)
            one_leader(standbys)
        finally:
            leader.signal(signal.SIGCONT)
        assert server.seen == {("SingletonNoLeader", group), ("SingletonStuckLock", group)}
        print(f"alerts fired and cleared; logs in {tmp_path}", file=sys.stderr)
