"""The sidecar process: builds the parts from a validated config, runs them under one
owner, and shuts them down in order.

Order at shutdown (SIGTERM, pod deletion, or a drain request): the elector drains, stops
the app and only then releases; then the gate's task is stopped, the pod's final status written, the HTTP servers
closed, the backend and the API client closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from singleton_election import contract
from singleton_election.core.elector import Elector
from singleton_election.core.identity import make_identity, pod_prefix
from singleton_election.core.lock import BackendMisconfigured, LockBackend
from singleton_election.httpclient import use_small_tls_buffers
from singleton_sidecar.config import SidecarConfig, describe
from singleton_sidecar.gates import CooperativeGate, ExecGate, FileGate, Gate
from singleton_sidecar.gates.exec_gate import become_subreaper
from singleton_sidecar.http import control_server, probe_server
from singleton_sidecar.metrics import SidecarMetrics

if TYPE_CHECKING:
    # Imported where used, and only when the configuration needs them (the sidecar's memory,
    # docs/benchmarks: "Sidecar footprint"): the Kubernetes client and the pod reporter when
    # the sidecar uses the API, each backend (asyncpg for PostgreSQL) when it is the one chosen.
    from singleton_election.backends.lease import LeaseBackend
    from singleton_election.kube import KubeClient
    from singleton_sidecar.podstatus import PodReporter

log = logging.getLogger(__name__)

FINAL_STATUS_TIMEOUT = 3.0
KEEPER_SLACK = 0.25
"""Seconds for the sidecar to hear its session ended, for the keeper to kill and the kernel to end the group."""
STOP_SLACK = 2.0
"""Seconds beyond the kill grace that a gate may take to confirm the app stopped (reaping,
gate.sh's polling) before the elector gives up on releasing and lets the lock expire."""


def build_backend(config: SidecarConfig, kube: KubeClient | None) -> LockBackend:
    """The one place that chooses the backend. Each backend's module is imported only when
    that backend is built: a lease sidecar never loads asyncpg."""
    timings = config.timings
    # Set only for the group's sole candidate in its pod, whose identity the sidecar made.
    predecessor_prefix = (pod_prefix(config.pod_name, config.pod_uid)
                          if config.sole_candidate_in_pod and config.pod_name else None)

    def postgres() -> LockBackend:
        assert config.postgres_dsn is not None
        if config.postgres_mode == "pooled":
            from singleton_election.backends.postgres.pooled_mode import PooledPostgresBackend

            # No session ends with a crashed holder here: a takeover waits for the row's expiry,
            # by which the old app's own deadline has stopped it, so no stop bound is recorded.
            return PooledPostgresBackend(group=config.lock_key, dsn=config.postgres_dsn, timings=timings,
                                         predecessor_prefix=predecessor_prefix)
        from singleton_election.backends.postgres.session_mode import PostgresBackend

        # The exec gate's keeper kills the app's group as soon as the sidecar dies, and at once
        # when the sidecar hears its lock is gone: a takeover after this holder's session ended
        # waits that long, not the whole lease.
        stop_bound = KEEPER_SLACK if config.exec_command else None
        return PostgresBackend(group=config.lock_key, dsn=config.postgres_dsn, timings=timings,
                               stop_bound=stop_bound, predecessor_prefix=predecessor_prefix)

    def lease() -> LeaseBackend:
        from singleton_election.backends.lease import LeaseBackend

        assert kube is not None and config.namespace is not None
        return LeaseBackend(client=kube, namespace=config.namespace, name=config.group, timings=timings,
                            predecessor_prefix=predecessor_prefix)

    if config.backend == "postgres":
        return postgres()
    if config.backend == "lease":
        return lease()
    from singleton_election.backends.both import BothBackend

    return BothBackend(postgres=postgres(), lease=lease())


class Sidecar:
    def __init__(self, config: SidecarConfig, *, wall_clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.wall_clock = wall_clock
        self.identity = config.identity or make_identity(
            pod_name=config.pod_name, pod_uid=config.pod_uid, hostname=socket.gethostname(), pid=os.getpid())
        self._stop = asyncio.Event()
        self._sigterm_during_deletion = asyncio.Event()
        self._sigterm_tasks: set[asyncio.Future[None]] = set()

    def __repr__(self) -> str:
        return f"<Sidecar group={self.config.group} identity={self.identity}>"

    def _drain_hook(self, gate: Gate,
                    reporter: PodReporter | None) -> Callable[[bool], Awaitable[None]]:
        drain_url = self.config.drain_url
        wait_container = self.config.drain_wait_container

        async def drain(final: bool) -> None:
            drained = drain_url is None or await self._ask_app_to_drain(drain_url)
            if final and wait_container is not None and reporter is not None:
                # Only when the pod goes away (on a step-down the main container keeps running).
                await self._wait_gate_or_main_container(gate, reporter, wait_container)
                return
            await gate.wait_stopped()
            if not drained and not gate.sees_the_app:
                # Nothing else can tell us the app has finished: the drain timeout decides.
                await asyncio.Event().wait()

        return drain

    @staticmethod
    def _stop_hook(gate: Gate, reporter: PodReporter | None) -> Callable[[bool], Awaitable[None]]:
        """The stop step: the app has stopped, and (in a pod) the pod's role label no longer says
        leader, so the leader Service cannot send a request to two pods (a pod being deleted
        does not wait: ``PodReporter.labelled_leader_unduly``). The elector
        bounds the wait (``stop_timeout``): a label not written by then (the API server
        unreachable) means no release, and the lock expires by itself; meanwhile ``/candidate``
        says 503, so the pod's readiness takes it out of the endpoints."""
        async def stop(urgent: bool) -> None:
            await gate.stop(urgent)
            if reporter is not None and reporter.labelled_leader_unduly:
                log.info("the app has stopped; waiting for the pod's label to stop saying leader before releasing")
                await reporter.wait_unlabelled()

        return stop

    async def _wait_gate_or_main_container(self, gate: Gate, reporter: PodReporter, name: str) -> None:
        """The pod is going away: the term ends on the gate's word that the app stopped (gate.sh's
        acknowledgement, the SDK's ``POST /stopped``), a second or more before the kubelet tells
        (it signals a native sidecar only after noticing the main container's exit); or on the
        main container's end, for an app that died without a word (its processes are all gone
        with it) or that the gate cannot see."""
        said = asyncio.ensure_future(gate.wait_stopped())
        ended = asyncio.ensure_future(self._wait_main_container_stopped(reporter, name))
        try:
            done, _ = await asyncio.wait({said, ended}, return_when=asyncio.FIRST_COMPLETED)
            if said in done:
                said.result()
                if gate.sees_the_app:
                    log.info("draining: the gate says the app has stopped; not waiting for the kubelet")
                    return
                log.info("draining: waiting for the main container to stop", extra={"container": name})
            await ended  # a failure is no proof that the app stopped: it propagates
            gate.on_app_container_ended()
        finally:
            for wait in (said, ended):
                wait.cancel()
            await asyncio.gather(said, ended, return_exceptions=True)

    async def _wait_main_container_stopped(self, reporter: PodReporter, name: str) -> None:
        """Until the pod shows container ``name`` terminated or, for a native sidecar, until the
        kubelet's SIGTERM arrives while the pod is being deleted: it stops a pod's native sidecars
        only once the main containers have exited, and publishes their states only afterwards.
        (A SIGTERM without a deletion, such as a failed liveness probe restarting the sidecar
        alone, says nothing about the main container.)"""
        waits: list[asyncio.Future[object]] = [asyncio.ensure_future(reporter.wait_container_stopped(name))]
        if self.config.native_sidecar:
            waits.append(asyncio.ensure_future(self._sigterm_during_deletion.wait()))
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            await next(iter(done))
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    def _on_sigterm(self, elector: Elector, reporter: PodReporter | None) -> None:
        if reporter is not None and self.config.native_sidecar:
            # Judged now, from the pod as it is after the signal: a deletion seen later does not
            # make an earlier SIGTERM (a liveness restart) the kubelet's stop of a deleted pod.
            task = asyncio.ensure_future(self._judge_sigterm(reporter))
            self._sigterm_tasks.add(task)
            task.add_done_callback(self._sigterm_tasks.discard)
        elector.request_drain()

    async def _judge_sigterm(self, reporter: PodReporter) -> None:
        if await reporter.being_deleted():
            log.info("draining: SIGTERM during the pod's deletion: the main containers have exited")
            self._sigterm_during_deletion.set()
        else:
            log.info("draining: SIGTERM while the pod is not being deleted: waiting for the main container")

    @staticmethod
    async def _ask_app_to_drain(drain_url: str) -> bool:
        """POST the drain hook; True on a 2xx answer (the app has drained). A refused
        connection (the app closed its listener on SIGTERM) or an error answer does not end
        the drain: the gate and the main container are still waited for."""
        from singleton_election.httpclient import HttpClient, split_url  # only sidecars with a drain hook

        base, target = split_url(drain_url)
        try:
            async with HttpClient(base, user_agent="singleton-sidecar") as client:
                response, _ = await client.request("POST", target)
            if response.status < 300:
                return True
            log.warning("drain hook answered an error; waiting for the app to stop",
                        extra={"url": drain_url, "status": response.status})
        except (OSError, ValueError) as exc:  # refused, reset, TLS, a malformed answer (HttpTransportError)
            log.warning("drain hook failed; waiting for the app to stop", extra={"url": drain_url, "error": exc})
        return False

    def _make_gate(self, request_step_down: Callable[[str], None]) -> Gate:
        config = self.config
        if config.exec_command:
            become_subreaper()
            return ExecGate(config.exec_command, kill_grace=config.kill_grace,
                            env={contract.ENV_GROUP: config.group, contract.ENV_FENCE_KEY: config.lock_key})
        if config.gate_dir is not None:
            gate = FileGate(config.gate_dir, kill_grace=config.kill_grace,
                            on_app_stopping=lambda: request_step_down("the main container is stopping"))
            gate.install()
            return gate
        return CooperativeGate()

    async def run(self) -> int:
        config = self.config
        log.info("starting", extra={"identity": self.identity, **describe(config)})
        use_small_tls_buffers()  # before any connection (API server, PostgreSQL): 1 MB less at rest
        needs_kube = config.backend in ("lease", "both") or config.in_kubernetes
        kube: KubeClient | None = None
        if needs_kube:
            from singleton_election.kube import KubeClient, load_kube_config

            kube = KubeClient(load_kube_config(config.kubeconfig))
        backend = build_backend(config, kube)
        metrics = SidecarMetrics(config.group, backend.name)
        elector: Elector
        gate = self._make_gate(lambda reason: elector.request_step_down(reason))  # noqa: PLW0108 - bound below
        reporter: PodReporter | None = None
        if config.in_kubernetes and kube is not None:
            from singleton_sidecar.podstatus import PodReporter

            assert config.namespace is not None and config.pod_name is not None
            reporter = PodReporter(kube, namespace=config.namespace, pod_name=config.pod_name,
                                   readiness_gate=config.readiness_gate,
                                   on_deleting=lambda: elector.request_drain(),  # noqa: PLW0108 - bound below
                                   on_step_down=lambda reason: elector.request_step_down(reason),  # noqa: PLW0108
                                   on_hold=lambda seconds: elector.request_hold(seconds))  # noqa: PLW0108
        elector = Elector(group=config.group, identity=self.identity, backend=backend, timings=config.timings,
                          wall_clock=self.wall_clock, drain_hook=self._drain_hook(gate, reporter),
                          drain_timeout=config.drain_timeout, stop_hook=self._stop_hook(gate, reporter),
                          stop_timeout=config.kill_grace + STOP_SLACK, on_renew=metrics.on_renew,
                          on_app_stopped=metrics.on_app_stopped)
        elector.add_listener(metrics.on_status)
        elector.add_listener(gate.on_status)
        elector.add_deadline_listener(gate.on_deadline)
        if reporter is not None:
            elector.add_listener(reporter.on_status)
            # Now, so a standby's pod says "standby" before its first lock wait ends.
            reporter.on_status(elector.status)

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm, elector, reporter)
        loop.add_signal_handler(signal.SIGINT, elector.request_drain)
        probe = probe_server(elector, metrics, fence_key=config.lock_key,
                             labelled_leader_unduly=None if reporter is None
                             else lambda: reporter.labelled_leader_unduly)
        acks = gate if isinstance(gate, CooperativeGate) else None
        control = control_server(elector, fence_key=config.lock_key, acks=acks)
        try:
            await probe.start(config.listen.host, config.listen.port)
            await control.start(config.control_listen.host, config.control_listen.port)
            log.info("serving probes and control",
                     extra={"listen": str(config.listen), "control_listen": str(config.control_listen)})
            try:
                await self._run_parts(elector, gate, reporter)
            except* BackendMisconfigured as group:
                # Not retried: the CLI exits 2 with the message (what to change).
                raise group.exceptions[0] from None
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
            for task in list(self._sigterm_tasks):
                task.cancel()
            await asyncio.gather(*self._sigterm_tasks, return_exceptions=True)
            await control.close()
            await probe.close()
            await backend.close()
            if kube is not None:
                await kube.close()
        log.info("stopped", extra={"group": config.group, "identity": self.identity})
        return 0

    async def _run_parts(self, elector: Elector, gate: Gate,
                         reporter: PodReporter | None) -> None:
        """The elector runs until released; the helpers run as long as it does."""
        async with asyncio.TaskGroup() as group:
            helpers = [group.create_task(gate.run(), name="gate")]
            if reporter is not None:
                helpers.append(group.create_task(reporter.run(), name="pod-reporter"))
                helpers.append(group.create_task(reporter.watch_pod(), name="pod-watch"))
            await group.create_task(elector.run(), name="elector")
            if reporter is not None:
                # Let the final "released" status reach the pod before we go.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(FINAL_STATUS_TIMEOUT):
                        while reporter.pending:  # noqa: ASYNC110 - a short, bounded flush
                            await asyncio.sleep(0.02)
            for task in helpers:
                task.cancel()
