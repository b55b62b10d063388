"""One container's runs within a pod: start, hooks and probes, exit, stop with a grace period.

Called by ``kubelet_pods``: each ``PodWorker`` has one ``ContainerRunner``, which decides
nothing about restarts (the worker does) but keeps each ``Container`` record true to its
process: Running when started, ``started``/``ready`` from the probes, Terminated (with what
is left of the container killed) the moment the main process exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from singleton_testbed.kubelet_api import KubeletApi, NodeSpec, now_rfc3339
from singleton_testbed.kubelet_probes import Probe, Prober, Target, run_handler
from singleton_testbed.kubelet_runtime import LaunchSpec, ProcessHandle, StartError, TaskSet, spawn_container
from singleton_testbed.kubelet_status import Container, PodFacts, Running, Terminated, exit_code_of
from singleton_testbed.netns import HostNetwork

log = logging.getLogger(__name__)


@dataclass
class NodeContext:
    """What every pod worker of one stand-in shares."""

    api: KubeletApi
    network: HostNetwork
    node: NodeSpec
    state_dir: Path
    api_host: str
    """Where pods reach the API server (``KUBERNETES_SERVICE_HOST``)."""
    api_port: int
    ca_data: bytes
    http: aiohttp.ClientSession
    path_env: str
    """``PATH`` of every container: images are ignored, commands come from the host."""


@dataclass
class PodScope:
    """The pod a runner works for: names for logs, shared facts, and the pod's stop signals."""

    namespace: str
    name: str
    uid: str
    facts: PodFacts
    tasks: TaskSet
    changed: Callable[[], None]
    """Tell the pod worker its status must be published."""
    grace: Callable[[], float]
    """The pod's ``terminationGracePeriodSeconds`` (for hooks, probes' kills, completed pods)."""
    kill_now: asyncio.Event
    """Set when the pod's deletion grace period is over: every wait gives up, SIGKILL follows."""
    deadline: Callable[[], float]
    """Loop time at which ``kill_now`` is set (when the pod is being stopped)."""


class ContainerRunner:
    def __init__(self, scope: PodScope, http: aiohttp.ClientSession) -> None:
        self.scope = scope
        self.http = http
        self._probe_tasks: dict[str, asyncio.Task[None]] = {}

    def __repr__(self) -> str:
        return f"<ContainerRunner {self.scope.namespace}/{self.scope.name} probing={sorted(self._probe_tasks)}>"

    def _log(self, message: str, c: Container, *args: object, level: int = logging.INFO) -> None:
        log.log(level, message + " pod=%s/%s container=%s", *args, self.scope.namespace, self.scope.name, c.name)

    async def run_once(self, c: Container, launch: LaunchSpec) -> int:
        """Start the container and wait for its exit code (128 when it could not start)."""
        scope = self.scope
        try:
            handle = spawn_container(launch)
        except StartError as exc:
            self._log("cannot start: %s", c, exc, level=logging.WARNING)
            c.state = Terminated(128, "StartError", "", now_rfc3339(), message=str(exc))
            scope.changed()
            return 128
        c.process, c.env = handle, launch.env
        c.new_container_id(scope.uid)
        c.state = Running(now_rfc3339())
        handle.exit_future.add_done_callback(lambda done: self._record_exit(c, handle, done.result()))
        started_at = asyncio.get_running_loop().time()
        self._probe_tasks[c.name] = scope.tasks.spawn(self._after_start(c, handle, started_at), f"probes {c.name}")
        self._log("container started pid=%d", c, handle.pid)
        scope.changed()
        return exit_code_of(await handle.wait())[0]

    def _record_exit(self, c: Container, handle: ProcessHandle, returncode: int) -> None:
        """The container's main process ended: kill what is left of it, report it terminated."""
        if c.process is not handle:
            return
        handle.kill_tree()
        c.process, c.ready, c.started = None, False, False
        c.started_event.clear()
        if (probes := self._probe_tasks.pop(c.name, None)) is not None:
            probes.cancel()
        code, signum = exit_code_of(returncode)
        started = c.state.started_at if isinstance(c.state, Running) else ""
        c.state = Terminated(code, "Completed" if code == 0 else "Error", started, now_rfc3339(),
                             c.container_id, signum)
        self._log("container exited code=%d", c, code)
        self.scope.changed()

    def _target(self, c: Container, handle: ProcessHandle) -> Target:
        return Target(pod_ip=self.scope.facts.pod_ip, pid=handle.pid, container=c.spec, env=c.env, http=self.http)

    async def _after_start(self, c: Container, handle: ProcessHandle, started_at: float) -> None:
        """postStart, then the startup probe, then liveness and readiness for the container's life."""
        target = self._target(c, handle)
        if (hook := (c.spec.get("lifecycle") or {}).get("postStart")) is not None:
            ok, why = await run_handler(hook, target, self.scope.grace())
            if not ok:
                self._log("postStart hook failed: %s", c, why, level=logging.WARNING)
                await self.stop(c, handle=handle, pre_stop=True, until=_after(self.scope.grace()))
                return
        startup = Probe.parse(c.spec.get("startupProbe"))
        if startup is not None and not await Prober("startup", startup, target, started_at).until_started():
            await self._probe_kill(c, handle, startup, "startup")
            return
        c.started = True
        c.started_event.set()
        readiness, liveness = Probe.parse(c.spec.get("readinessProbe")), Probe.parse(c.spec.get("livenessProbe"))
        c.ready = c.kind != "init" and readiness is None
        self.scope.changed()
        async with asyncio.TaskGroup() as group:
            if readiness is not None:
                group.create_task(Prober("readiness", readiness, target, started_at).watch(
                    False, lambda ok, _: self._set_ready(c, ok)))
            if liveness is not None:
                group.create_task(self._liveness(c, handle, liveness, target, started_at))

    def _set_ready(self, c: Container, ready: bool) -> None:
        c.ready = ready
        self.scope.changed()

    async def _liveness(self, c: Container, handle: ProcessHandle, probe: Probe, target: Target,
                        started_at: float) -> None:
        failed = asyncio.Event()

        def on_change(ok: bool, _why: str) -> None:
            if not ok:
                failed.set()

        await first_of(Prober("liveness", probe, target, started_at).watch(True, on_change), failed.wait())
        await self._probe_kill(c, handle, probe, "liveness")

    async def _probe_kill(self, c: Container, handle: ProcessHandle, probe: Probe, kind: str) -> None:
        self._log("%s probe failed, restarting", c, kind)
        grace = probe.termination_grace if probe.termination_grace is not None else self.scope.grace()
        await self.stop(c, handle=handle, pre_stop=True, until=_after(grace))

    async def stop(self, c: Container, *, pre_stop: bool, until: float | None = None,
                   handle: ProcessHandle | None = None) -> None:
        """preStop (within the grace period), SIGTERM to the main process, SIGKILL to all at the end.
        The end is ``until``, or the pod's deadline (``kill_now``) when the pod is being stopped."""
        handle = handle or c.process
        if handle is None or handle.exited:
            return
        hook = (c.spec.get("lifecycle") or {}).get("preStop")
        if pre_stop and hook is not None:
            end = until if until is not None else self.scope.deadline()
            await self._until_killed(self._pre_stop(c, handle, hook, max(end - _after(0), 0.0)), until)
        handle.signal(signal.SIGTERM)
        await self._until_killed(handle.wait(), until)
        if not handle.exited:
            self._log("grace period over, killing", c)
            handle.kill_tree()
            await handle.wait()

    async def _pre_stop(self, c: Container, handle: ProcessHandle, hook: dict[str, object], timeout: float) -> None:
        ok, why = await run_handler(hook, self._target(c, handle), timeout)
        if ok:
            self._log("preStop hook done", c)
        else:
            self._log("preStop hook failed: %s", c, why, level=logging.WARNING)

    async def _until_killed(self, work: Awaitable[object], until: float | None) -> None:
        """Wait for ``work`` until ``until`` passes or the pod's grace period ends."""
        timeout = None if until is None else max(0.0, until - _after(0))
        await first_of(work, self.scope.kill_now.wait(), timeout=timeout)


def _after(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def first_of(*works: Awaitable[object], timeout: float | None = None) -> None:
    """Wait until the first of ``works`` finishes (or ``timeout``); cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
