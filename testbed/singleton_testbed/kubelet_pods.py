"""One pod on the stand-in kubelet, from sandbox to final deletion: ``PodWorker``.

Called by ``kubelet`` (one worker per pod bound to the node). The life of a pod:

1. sandbox: a network namespace with the pod's IP (``netns``), or the host network;
2. volumes written under the pod's state folder (``kubelet_spec``);
3. init containers in order, each must exit 0; native sidecars (init containers with
   ``restartPolicy: Always``) are started and kept running, the next one starts once the
   sidecar has *started* (its startup probe passed, or it runs and has none), as in Kubernetes;
4. regular containers, restarted per the pod's ``restartPolicy`` with a short back-off; probes
   (``kubelet_probes``) set ``started``/``ready``, a failed liveness probe restarts;
5. termination on ``deletionTimestamp``: preStop hooks and SIGTERM for the regular containers,
   then the sidecars in reverse order, SIGKILL for whatever still runs when the grace period
   ends; a terminal status, then the pod is deleted for good (grace 0, uid precondition).

Status goes out through ``pods/status`` as a strategic-merge patch each time it changes
(``kubelet_status`` builds it), so readiness changes reach the API within milliseconds.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from singleton_sidecar.kube import KubeConflict, KubeError, KubeNotFound
from singleton_testbed.kubelet_api import now_rfc3339
from singleton_testbed.kubelet_containers import ContainerRunner, NodeContext, PodScope
from singleton_testbed.kubelet_runtime import LaunchSpec, Mount, TaskSet
from singleton_testbed.kubelet_spec import (
    ConfigError,
    VolumeBuilder,
    base_env,
    container_argv,
    container_env,
    container_mounts,
    hosts_file,
)
from singleton_testbed.kubelet_status import (
    ConditionClock,
    Container,
    PodFacts,
    Terminated,
    Waiting,
    pod_phase,
    pod_status,
)
from singleton_testbed.netns import NetworkError, Sandbox, delete_sandbox

log = logging.getLogger(__name__)

Obj = dict[str, Any]
T = TypeVar("T")
BACKOFF_START = 0.25
BACKOFF_MAX = 5.0
BACKOFF_RESET_AFTER = 10.0
"""A container that ran this long before it exited starts over with the shortest back-off."""
GONE_GRACE = 2.0
"""Grace for containers of a pod whose API object vanished (force deletion)."""


class StopMode(enum.Enum):
    DELETE = "delete"
    """The pod was deleted through the API: hooks, grace period, final status, then remove it."""
    GONE = "gone"
    """The API object is gone already: stop quickly, tell nobody."""
    SHUTDOWN = "shutdown"
    """The stand-in stops: kill everything now, leave the API alone."""


_RANK = {StopMode.DELETE: 0, StopMode.GONE: 1, StopMode.SHUTDOWN: 2}
"""A stop request can only make the stop harsher."""


class PodWorker:
    """Runs one pod; ``update``/``gone``/``shutdown`` feed it, ``run`` is its whole life."""

    def __init__(self, pod: Obj, ctx: NodeContext) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        self.pod, self.ctx = pod, ctx
        self.uid, self.namespace, self.name = str(meta["uid"]), str(meta["namespace"]), str(meta["name"])
        self.dir = ctx.state_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid}"
        self._hosts = self.dir / "etc-hosts"
        self.containers = [
            *(Container(spec=c, kind="sidecar" if c.get("restartPolicy") == "Always" else "init",
                        log_path=self.log_path(c["name"])) for c in spec.get("initContainers") or []),
            *(Container(spec=c, kind="regular", log_path=self.log_path(c["name"])) for c in spec["containers"]),
        ]
        self._adopt_restart_counts(pod.get("status") or {})
        self.facts = PodFacts(restart_policy=spec.get("restartPolicy", "Always"), host_ip=ctx.node.host_ip,
                              start_time=(pod.get("status") or {}).get("startTime") or now_rfc3339())
        self.sandbox: Sandbox | None = None
        self.volumes: dict[str, Path] = {}
        self.tasks = TaskSet(f"pod {self.namespace}/{self.name}")
        self._sandbox_job: asyncio.Future[Sandbox] | None = None
        self._clock = ConditionClock()
        self._dirty = asyncio.Event()
        self._published: Obj | None = None
        self._publish_lock = asyncio.Lock()
        self._stop_requested = asyncio.Event()
        self._kill_now = asyncio.Event()
        self._kill_timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._completed = False
        self.mode: StopMode | None = None
        scope = PodScope(namespace=self.namespace, name=self.name, uid=self.uid, facts=self.facts, tasks=self.tasks,
                         changed=self.changed, grace=self._grace, kill_now=self._kill_now,
                         deadline=lambda: self._deadline)
        self.runner = ContainerRunner(scope, ctx.http)

    def __repr__(self) -> str:
        return f"<PodWorker {self.namespace}/{self.name} uid={self.uid} ip={self.facts.pod_ip} mode={self.mode}>"

    def log_path(self, container: str) -> Path:
        return self.dir / "logs" / f"{container}.log"

    def _adopt_restart_counts(self, status: Obj) -> None:
        """A pod that ran before the stand-in (re)started: its containers restart, and count it."""
        seen_before = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
        previous = {s["name"]: s for s in seen_before}
        for c in self.containers:
            if seen := previous.get(c.name):
                c.restart_count = int(seen.get("restartCount", 0)) + (1 if seen.get("containerID") else 0)

    # --- inputs ---------------------------------------------------------------------------

    def update(self, pod: Obj) -> None:
        """A newer version of the pod from the watch."""
        gates_before = _gate_conditions(self.pod)
        self.pod = pod
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            self._request_stop(StopMode.DELETE, float(meta.get("deletionGracePeriodSeconds", 30)))
        if _gate_conditions(pod) != gates_before:
            self.changed()

    def gone(self) -> None:
        """The API object was deleted (force deletion, or our own final delete)."""
        self._request_stop(StopMode.GONE, GONE_GRACE)

    def shutdown(self) -> None:
        self._request_stop(StopMode.SHUTDOWN, 0.0)

    def _request_stop(self, mode: StopMode, grace: float) -> None:
        if self.mode is None or _RANK[mode] > _RANK[self.mode]:
            self.mode = mode
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, grace)
        if not self._stop_requested.is_set() or deadline < self._deadline:
            # The deadline only ever moves closer (kubectl delete --grace-period=1 on a terminating pod).
            self._deadline = deadline
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            self._kill_timer = loop.call_at(deadline, self._kill_now.set)
        self._stop_requested.set()

    def changed(self) -> None:
        self._dirty.set()

    # --- the whole life ---------------------------------------------------------------------

    async def run(self) -> None:
        publisher = self.tasks.spawn(self._publish_loop(), "status")
        self.tasks.spawn(self._live(), "lifecycle")
        await self._stop_requested.wait()
        log.info("stopping pod=%s/%s mode=%s", self.namespace, self.name, self.mode and self.mode.value)
        await self.tasks.close(keep=publisher)  # the processes live on: _terminate stops them in order
        try:
            await self._terminate()
            await self._teardown()
            if self.mode is StopMode.DELETE:
                for c in self.containers:
                    c.done = True
                await self._publish_final()
                await self.ctx.api.delete_pod(self.pod)
        finally:
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            await self.tasks.close()
            log.info("pod finished pod=%s/%s", self.namespace, self.name)

    async def _live(self) -> None:
        await self._retry("sandbox", self._create_sandbox, "ContainerCreating")
        self.volumes = await self._retry("volumes", self._build_volumes, "ContainerCreating")
        if await self._initialize():
            self.facts.initialized = True
            self.changed()
            regular = [c for c in self.containers if c.kind == "regular"]
            await asyncio.gather(*(self.tasks.spawn(self._supervise(c), f"container {c.name}") for c in regular))
        log.info("pod completed pod=%s/%s phase=%s", self.namespace, self.name,
                 pod_phase(self.containers, self.facts))
        self._completed = True  # sidecars stop now and stay stopped
        until = asyncio.get_running_loop().time() + self._grace()
        for c in reversed([c for c in self.containers if c.kind == "sidecar"]):
            await self.runner.stop(c, pre_stop=True, until=until)
        await self._teardown()

    async def _create_sandbox(self) -> None:
        if self.pod["spec"].get("hostNetwork"):
            self.facts.pod_ip = self.ctx.node.host_ip
        else:
            ip = self.ctx.network.allocate_ip()
            self._sandbox_job = asyncio.ensure_future(asyncio.to_thread(self.ctx.network.create_sandbox, ip))
            try:
                # Shielded: a stop must not abandon a half-made namespace; _teardown awaits the job.
                self.sandbox = await asyncio.shield(self._sandbox_job)
            except NetworkError:
                self.ctx.network.release_ip(ip)
                raise
            self.facts.pod_ip = ip
        self.facts.sandbox_ready = True
        self.changed()

    async def _build_volumes(self) -> dict[str, Path]:
        builder = VolumeBuilder(self._pod_view(), self.ctx.api, root=self.dir / "volumes", ca_data=self.ctx.ca_data,
                                allocatable=self.ctx.node.capacity)
        volumes = await builder.build()
        self._hosts.write_text(hosts_file(self.pod, pod_ip=self.facts.pod_ip, api_host=self.ctx.api_host))
        return volumes

    async def _retry(self, what: str, step: Callable[[], Awaitable[T]], reason: str,
                     container: Container | None = None) -> T:
        """Run ``step`` until it works; meanwhile the containers (or one) wait with ``reason``."""
        delay = 0.5
        while True:
            try:
                return await step()
            except (ConfigError, KubeError, NetworkError) as exc:
                log.warning("pod=%s/%s %s: %s", self.namespace, self.name, what, exc)
                for c in [container] if container else self.containers:
                    c.state = Waiting(reason, str(exc))
                self.changed()
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)

    async def _initialize(self) -> bool:
        """Init containers in order; False when one failed for good (restartPolicy Never)."""
        for c in self.containers:
            if c.kind == "sidecar":
                self.tasks.spawn(self._supervise(c), f"sidecar {c.name}")
                await c.started_event.wait()
            elif c.kind == "init" and not await self._run_init(c):
                self.facts.init_failed = True
                self.changed()
                return False
        return True

    async def _run_init(self, c: Container) -> bool:
        failures = 0
        while True:
            if await self._run_once(c) == 0:
                c.done, c.ready = True, True
                self.changed()
                return True
            if self.facts.restart_policy == "Never":
                c.done = True
                return False
            failures += 1
            await self._back_off(c, failures)

    async def _supervise(self, c: Container) -> None:
        """Run a regular or sidecar container, restarting it as the policy says."""
        loop, failures = asyncio.get_running_loop(), 0
        while True:
            began = loop.time()
            code = await self._run_once(c)
            policy = "Always" if c.kind == "sidecar" else self.facts.restart_policy
            restart = policy == "Always" or (policy == "OnFailure" and code != 0)
            if self._completed or not restart:
                c.done = True
                self.changed()
                return
            failures = 1 if loop.time() - began > BACKOFF_RESET_AFTER else failures + 1
            await self._back_off(c, failures)

    async def _back_off(self, c: Container, failures: int) -> None:
        delay = min(BACKOFF_START * 2 ** (failures - 1), BACKOFF_MAX)
        if isinstance(c.state, Terminated):
            c.last_state = c.state
        c.state = Waiting("CrashLoopBackOff", f"back-off {delay:g}s restarting failed container={c.name} "
                          f"pod={self.name}_{self.namespace}({self.uid})")
        self.changed()
        await asyncio.sleep(delay)
        c.restart_count += 1

    async def _launch_spec(self, c: Container) -> LaunchSpec:
        view = self._pod_view()
        base = base_env(self.pod, path=self.ctx.path_env, api_host=self.ctx.api_host, api_port=self.ctx.api_port)
        env = await container_env(view, c.spec, self.ctx.api, base=base, allocatable=self.ctx.node.capacity)
        mounts = container_mounts(c.spec, self.volumes, env)
        if not any(m.target == "/etc/hosts" for m in mounts):
            mounts.append(Mount(source=self._hosts, target="/etc/hosts", read_only=True))
        return LaunchSpec(argv=container_argv(c.spec, env), env=env, log_path=c.log_path, hostname=self.name,
                          working_dir=c.spec.get("workingDir"), netns=self.sandbox.netns_path if self.sandbox else None,
                          mounts=tuple(mounts))

    async def _run_once(self, c: Container) -> int:
        launch = await self._retry(f"container {c.name}", lambda: self._launch_spec(c),
                                   "CreateContainerConfigError", c)
        return await self.runner.run_once(c, launch)

    def _grace(self) -> float:
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    def _pod_view(self) -> Obj:
        """The pod with the addresses we know, for the downward API (our patch may not be back yet)."""
        ips = {"hostIP": self.facts.host_ip, "hostIPs": [{"ip": self.facts.host_ip}]}
        if self.facts.pod_ip:
            ips.update(podIP=self.facts.pod_ip, podIPs=[{"ip": self.facts.pod_ip}])
        return {**self.pod, "status": {**(self.pod.get("status") or {}), **ips}}

    # --- stopping -------------------------------------------------------------------------

    async def _terminate(self) -> None:
        """Regular (and running init) containers together, then sidecars in reverse order."""
        hooks = self.mode is not StopMode.SHUTDOWN
        first = [c for c in self.containers if c.kind != "sidecar"]
        await asyncio.gather(*(self.runner.stop(c, pre_stop=hooks) for c in first))
        for c in reversed([c for c in self.containers if c.kind == "sidecar"]):
            await self.runner.stop(c, pre_stop=hooks)

    async def _teardown(self) -> None:
        """Free the network and the volumes (logs stay for the tests to read)."""
        for c in self.containers:
            if c.process is not None:
                c.process.kill_tree()
        if self._sandbox_job is not None:
            job, self._sandbox_job = self._sandbox_job, None
            try:
                self.sandbox = await job
            except NetworkError:
                self.sandbox = None
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await asyncio.to_thread(delete_sandbox, sandbox)
            self.ctx.network.release_ip(sandbox.ip)
        self.facts.sandbox_ready = False
        await asyncio.to_thread(shutil.rmtree, self.dir / "volumes", True)
        self.changed()

    # --- status ---------------------------------------------------------------------------

    def status(self) -> Obj:
        return pod_status(self.pod, self.containers, self.facts, self._clock, now_rfc3339())

    async def _publish(self) -> None:
        async with self._publish_lock:
            status = self.status()
            if status != self._published:
                await self.ctx.api.patch_pod_status(self.pod, status)
                self._published = status

    async def _publish_loop(self) -> None:
        while self.mode in (None, StopMode.DELETE):
            await self._dirty.wait()
            self._dirty.clear()
            if self.mode not in (None, StopMode.DELETE):
                return
            try:
                await self._publish()
            except (KubeNotFound, KubeConflict):
                return  # the pod is gone (or replaced); the watch tells the rest
            except KubeError as exc:
                log.warning("status update failed pod=%s/%s: %s", self.namespace, self.name, exc)
                await asyncio.sleep(0.5)
                self._dirty.set()

    async def _publish_final(self) -> None:
        try:
            await self._publish()
        except KubeError as exc:
            log.warning("final status update failed pod=%s/%s: %s", self.namespace, self.name, exc)

    # --- what tests see and do --------------------------------------------------------------

    def info(self) -> Obj:
        return {
            "namespace": self.namespace, "name": self.name, "uid": self.uid, "ip": self.facts.pod_ip,
            "netns": self.sandbox.name if self.sandbox else None, "phase": pod_phase(self.containers, self.facts),
            "terminating": self.mode is not None,
            "containers": [{"name": c.name, "kind": c.kind, "pid": c.process.pid if c.process else None,
                            "state": next(iter(c.state.to_api())), "restartCount": c.restart_count,
                            "ready": c.ready, "started": c.started, "log": str(c.log_path)} for c in self.containers],
        }

    def signal(self, container: str, signum: int) -> None:
        """Signal a container's process group (SIGKILL, SIGSTOP, SIGCONT…)."""
        c = next((c for c in self.containers if c.name == container), None)
        if c is None or c.process is None:
            raise LookupError(f"container {container!r} of pod {self.namespace}/{self.name} is not running")
        c.process.signal_group(signum)


def _gate_conditions(pod: Obj) -> list[Obj]:
    gates = {g["conditionType"] for g in pod["spec"].get("readinessGates") or []}
    return [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") in gates]


