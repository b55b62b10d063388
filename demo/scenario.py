"""The scripted part: wait for one leader, kill its sidecar, delete the leader pod, roll out
a spec change; each time wait for the new leader and for the group to settle again."""

from __future__ import annotations

import asyncio
import json
import shlex
import signal
import time
from collections.abc import Awaitable, Callable

from demo.cluster import GROUP, NAMESPACE, State, kubectl
from demo.observe import Observer, PodRow, Snapshot, Step
from singleton_testbed import node_pods

REPLICAS = 3
SIDECAR = "singleton-sidecar"


def _leader(snapshot: Snapshot) -> PodRow | None:
    return snapshot.settled(REPLICAS)


class Scenario:
    def __init__(self, observer: Observer, state: State, *, pause: float) -> None:
        self.observer = observer
        self.state = state
        self.pause = pause

    def _say_command(self, command: str) -> None:
        self.observer.event("$ " + command, "bold blue")

    async def _kubectl(self, *args: str) -> None:
        self._say_command("kubectl " + shlex.join(args))
        await asyncio.to_thread(kubectl, self.state, *args)

    async def settle(self, what: str, timeout: float = 90) -> PodRow:
        """One ready leader, the standbys ready, the status in agreement, and the leader's app
        writing (so every fault hits a term that has acted, and shows in the ledger)."""
        ledger = self.observer.ledger

        def writing_leader(snapshot: Snapshot) -> PodRow | None:
            leader = _leader(snapshot)
            return leader if leader is not None and leader.token in ledger.spans else None

        return await self.observer.wait_for(writing_leader, timeout, what)

    async def run(self) -> None:
        observer = self.observer
        observer.title = f"waiting for {REPLICAS} pods: one leader, {REPLICAS - 1} standbys"
        leader = await self.settle(f"{REPLICAS} ready pods with one leader", timeout=120)
        observer.event(f"settled: {leader.name} leads with token {leader.token}; {REPLICAS - 1} standbys ready",
                       "bold green")
        await asyncio.sleep(self.pause)
        # The kubelet restarts a killed sidecar in its pod, and that incarnation takes its own
        # term over at once (its pod's app is the only one that can act): the same pod may lead.
        await self.handover("1/3 kill the leader's sidecar (SIGKILL)", self._kill_sidecar, same_pod_may_lead=True)
        await asyncio.sleep(self.pause)
        await self.handover("2/3 delete the leader pod", self._delete_pod)
        await asyncio.sleep(self.pause)
        await self.rollout("3/3 roll out a spec change")
        observer.title = "done: reading the last ledger rows"
        await asyncio.sleep(1.0)

    async def handover(self, cause: str, act: Callable[[PodRow], Awaitable[None]], *,
                       same_pod_may_lead: bool = False) -> None:
        """``act`` on the settled leader, then wait for a newer term in the status: on another
        pod, or (``same_pod_may_lead``) on any."""
        observer = self.observer
        observer.title = cause
        leader = await self.settle("the group to settle")
        step = Step(cause, old_leader=leader.name, old_token=leader.token)
        observer.steps.append(step)
        started = time.monotonic()
        await act(leader)

        def new_leader(snapshot: Snapshot) -> tuple[str, int] | None:
            status = snapshot.status
            name, token = status.get("leader"), status.get("token")
            if name and (same_pod_may_lead or name != leader.name) and isinstance(token, int) \
                    and token > (leader.token or 0):
                return name, token
            return None

        step.new_leader, step.new_token = await observer.wait_for(new_leader, 30, "a new term in the status")
        step.status_seconds = time.monotonic() - started
        whose = ("its restarted sidecar took over its own term" if step.new_leader == leader.name
                 else "a new leader")
        observer.event(f"{step.new_leader} leads with token {step.new_token} ({whose}), in the status "
                       f"{step.status_seconds:.2f} s after the action", "bold green")
        settled = await self.settle("the group to settle again")
        observer.event(f"settled: {settled.name} leads, {REPLICAS - 1} standbys ready", "green")

    async def _kill_sidecar(self, leader: PodRow) -> None:
        self._say_command(f"kill -KILL <processes of container {SIDECAR} in pod {leader.name}>   "
                          "# found in its cgroup on the node; the pod stays, the kubelet restarts the sidecar")
        doc = await asyncio.to_thread(kubectl, self.state, "-n", NAMESPACE, "get", "pod", leader.name, "-o", "json")
        pod = json.loads(doc.stdout)
        pids = await asyncio.to_thread(node_pods.signal_container, pod, SIDECAR, signal.SIGKILL)
        self.observer.event(f"SIGKILL sent to {len(pids)} process(es) of {SIDECAR} (host pids "
                            f"{', '.join(map(str, pids))})", "dim")

    async def _delete_pod(self, leader: PodRow) -> None:
        await self._kubectl("-n", NAMESPACE, "delete", "pod", leader.name, "--wait=false")

    async def rollout(self, cause: str) -> None:
        observer = self.observer
        observer.title = cause
        leader = await self.settle("the group to settle")
        snapshot = observer.snapshot
        assert snapshot is not None
        before = {pod.name for pod in snapshot.pods}
        step = Step(cause, old_leader=leader.name, old_token=leader.token)
        observer.steps.append(step)
        patch = [{"op": "replace", "path": f"/spec/template/spec/containers/0/env/{await self._item_env()}/value",
                  "value": "0.05"}]
        await self._kubectl("-n", NAMESPACE, "patch", "sgl", GROUP, "--type=json", "-p", json.dumps(patch))
        observer.event("the Deployment replaces one pod at a time; the leader's pod goes last (deletion cost)",
                       "dim")

        def leader_leaving(snapshot: Snapshot) -> bool:
            pod = snapshot.pod(leader.name)
            return pod is None or pod.terminating

        await observer.wait_for(leader_leaving, 150, "the old leader's pod to be deleted by the rollout")
        leaving = time.monotonic()

        def new_leader(snapshot: Snapshot) -> tuple[str, int] | None:
            name, token = snapshot.status.get("leader"), snapshot.status.get("token")
            if name and name not in before and isinstance(token, int):
                return name, token
            return None

        step.new_leader, step.new_token = await observer.wait_for(new_leader, 30, "a new pod to lead")
        step.status_seconds = time.monotonic() - leaving
        observer.event(f"new leader {step.new_leader} (token {step.new_token}), a pod of the new revision",
                       "bold green")

        def rolled(snapshot: Snapshot) -> PodRow | None:
            settled = snapshot.settled(REPLICAS)
            if settled is None or {pod.name for pod in snapshot.live_pods()} & before:
                return None
            return settled

        done = await observer.wait_for(rolled, 120, "the rollout to finish")
        observer.event(f"rollout done: {REPLICAS} new pods, {done.name} leads; one handover", "green")

    async def _item_env(self) -> int:
        """Index of SAMPLE_ITEM_SECONDS in the poller's env (the spec change slows its items)."""
        doc = await asyncio.to_thread(kubectl, self.state, "-n", NAMESPACE, "get", "sgl", GROUP, "-o", "json")
        env = json.loads(doc.stdout)["spec"]["template"]["spec"]["containers"][0].get("env") or []
        for index, entry in enumerate(env):
            if entry.get("name") == "SAMPLE_ITEM_SECONDS":
                return index
        raise RuntimeError("demo/feed-poller.yaml sets no SAMPLE_ITEM_SECONDS")
