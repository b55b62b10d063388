"""The operator's watches (``singleton_operator.watches``) against the real API server: only
the objects their label selectors name reach them, because the server filters (every list and
watch they send carries the selector), across the watch's own restarts, an expired version and a
failing handler."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import pytest
import pytest_asyncio

from singleton_election import contract
from singleton_election.kube import KubeClient, KubeError, KubeGone, KubeUnavailable, load_kube_config
from singleton_operator.marks import RefreshMarks
from singleton_operator.watches import GROUP_PODS, OWN_DEPLOYMENTS, follow, follow_own_deployments
from tests.conftest import Cluster

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(90)]

Seen = list[tuple[str, str]]  # (event type, pod name)


class RecordingClient(KubeClient):
    """Records the path and parameters of every request and watch. ``first_watch_fails``: the
    first watch waits for ``release`` (while no watch runs, as in a gap), then raises it."""

    def __init__(self, cluster: Cluster, *, first_watch_fails: KubeError | None = None) -> None:
        super().__init__(load_kube_config(str(cluster.kubeconfig)))
        self.calls: list[tuple[str, str, Mapping[str, str]]] = []
        self._failure = first_watch_fails
        self.release = asyncio.Event()
        if first_watch_fails is None:
            self.release.set()

    async def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((method, path, dict(kwargs.get("params") or {})))
        return await super().request(method, path, **kwargs)

    def watch(self, path: str, **kwargs: Any) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        self.calls.append(("WATCH", path, dict(kwargs.get("params") or {})))
        failure, self._failure = self._failure, None
        if failure is not None:
            return self._fail(failure)
        return super().watch(path, **kwargs)

    async def _fail(self, failure: KubeError) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        await self.release.wait()
        raise failure
        yield  # pragma: no cover  (a generator that raises at its first step)


GONE = KubeGone(410, "Expired", "too old resource version")


def pod(name: str, group: str | None) -> dict[str, Any]:
    labels = {"app": "foreign"} if group is None else {contract.LABEL_GROUP: group}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            # Never scheduled (no such node): an object in the API server, nothing runs.
            "spec": {"nodeName": "no-such-node", "containers": [{"name": "app", "image": "busybox"}]}}


def create(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input_text=json.dumps(obj))


@contextlib.asynccontextmanager
async def following(client: KubeClient, namespace: str, seen: Seen, *, fail_first: bool = False,
                    watch_seconds: float = 300) -> AsyncIterator[asyncio.Task[None]]:
    failed = not fail_first

    async def handler(kind: str, obj: dict[str, Any]) -> None:
        nonlocal failed
        if not failed:
            failed = True
            raise RuntimeError("a handler that fails once")
        seen.append((kind, obj["metadata"]["name"]))

    task = asyncio.create_task(follow(client, GROUP_PODS, namespace, handler, watch_seconds=watch_seconds))
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(probe: Any, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not probe():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest_asyncio.fixture(loop_scope="function")
async def client(cluster: Cluster) -> AsyncIterator[RecordingClient]:
    recording = RecordingClient(cluster)
    try:
        yield recording
    finally:
        await recording.close()


async def test_only_group_pods_reach_the_handler_because_the_server_filters(
        cluster: Cluster, namespace: str, client: RecordingClient) -> None:
    suffix = uuid.uuid4().hex[:4]
    create(cluster, namespace, pod(f"foreign-a-{suffix}", None))
    create(cluster, namespace, pod(f"group-a-{suffix}", "g1"))
    seen: Seen = []
    # A watch the server ends after 1 s: the events after it come through the next one.
    async with following(client, namespace, seen, watch_seconds=1):
        await until(lambda: ("LISTED", f"group-a-{suffix}") in seen, 10, "the listed group pod")
        create(cluster, namespace, pod(f"foreign-b-{suffix}", None))
        create(cluster, namespace, pod(f"group-b-{suffix}", "g2"))
        await until(lambda: ("ADDED", f"group-b-{suffix}") in seen, 10, "the new group pod")
        await asyncio.sleep(2.5)  # past the watch's end: it resumed from the last version
        # At once: a pod bound to a node waits for its kubelet to confirm a graceful deletion.
        cluster.kubectl("delete", "pod", f"group-a-{suffix}", "-n", namespace, "--grace-period=0", "--force")
        create(cluster, namespace, pod(f"group-c-{suffix}", "g3"))
        await until(lambda: ("DELETED", f"group-a-{suffix}") in seen and ("ADDED", f"group-c-{suffix}") in seen,
                    10, "the deletion and the pod after the watch's restart")
    assert not [name for _, name in seen if name.startswith("foreign")], seen
    assert [name for kind, name in seen if kind == "LISTED"] == [f"group-a-{suffix}"], seen  # one listing
    watches = [params for kind, _, params in client.calls if kind == "WATCH"]
    assert len(watches) >= 2, client.calls  # the first one ended and the next resumed
    assert all(params["labelSelector"] == contract.LABEL_GROUP for _, _, params in client.calls), client.calls
    assert all(params.get("allowWatchBookmarks") == "true" and params.get("resourceVersion")
               for params in watches), watches


async def test_an_expired_version_lists_again_and_a_failing_handler_does_not_stop_the_watch(
        cluster: Cluster, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    suffix = uuid.uuid4().hex[:4]
    create(cluster, namespace, pod(f"group-a-{suffix}", "g1"))
    seen: Seen = []
    caplog.set_level(logging.INFO, logger="singleton_operator.watches")
    recording = RecordingClient(cluster, first_watch_fails=GONE)
    try:
        async with following(recording, namespace, seen, fail_first=True):
            # The first listing's only event fails in the handler; the 410 lists again.
            recording.release.set()
            await until(lambda: ("LISTED", f"group-a-{suffix}") in seen, 10, "the second listing")
            create(cluster, namespace, pod(f"group-b-{suffix}", "g2"))
            await until(lambda: ("ADDED", f"group-b-{suffix}") in seen, 10, "an event after both")
    finally:
        await recording.close()
    assert [kind for kind, _, _ in recording.calls][:3] == ["GET", "WATCH", "GET"], recording.calls
    messages = [record.getMessage() for record in caplog.records]
    assert "handling a watch event failed" in messages and "watch expired; listing again" in messages, messages


async def test_a_listing_comes_in_pages(cluster: Cluster, namespace: str, client: RecordingClient,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("singleton_operator.watches.LIST_PAGE", 2)
    names = [f"group-{index}-{uuid.uuid4().hex[:4]}" for index in range(5)]
    for name in names:
        create(cluster, namespace, pod(name, "g"))
    seen: Seen = []
    async with following(client, namespace, seen):
        await until(lambda: len(seen) == 5, 10, "every pod of the listing")
    assert sorted(name for _, name in seen) == sorted(names)
    pages = [params for kind, _, params in client.calls if kind == "GET"]
    assert len(pages) == 3 and [bool(page.get("continue")) for page in pages] == [False, True, True], pages


async def test_a_failed_watch_resumes_from_its_version_without_listing_again(
        cluster: Cluster, namespace: str) -> None:
    suffix = uuid.uuid4().hex[:4]
    seen: Seen = []
    recording = RecordingClient(cluster, first_watch_fails=KubeUnavailable(0, "Unavailable", "connection reset"))
    try:
        async with following(recording, namespace, seen):
            await until(lambda: len(recording.calls) >= 2, 10, "the first watch")
            create(cluster, namespace, pod(f"group-a-{suffix}", "g1"))  # made while no watch runs
            recording.release.set()
            await until(lambda: ("ADDED", f"group-a-{suffix}") in seen, 10, "the pod, from the resumed watch")
    finally:
        await recording.close()
    (_, _, first), (_, _, second) = [call for call in recording.calls if call[0] == "WATCH"][:2]
    assert [kind for kind, _, _ in recording.calls][:3] == ["GET", "WATCH", "WATCH"], recording.calls
    assert second["resourceVersion"] == first["resourceVersion"]


class Repairs:
    """Stands in for the reconciler's repair: records each call; the first waits for ``go``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.go = asyncio.Event()

    async def repair(self, namespace: str, name: str) -> None:
        self.calls.append((namespace, name))
        if len(self.calls) == 1:
            await self.go.wait()


def deployment(name: str, *, ours: bool = True) -> dict[str, Any]:
    """A Deployment (no controller runs here: no pods); ``ours``: labelled as the operator's."""
    labels = {"app.kubernetes.io/managed-by": "singleton-operator" if ours else "helm"}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "app", "image": "busybox"}]}}}}


async def test_a_deployment_deleted_again_during_its_repair_is_repaired_again(
        cluster: Cluster, namespace: str, client: RecordingClient) -> None:
    name = f"group-{uuid.uuid4().hex[:4]}"
    create(cluster, namespace, deployment(name))
    create(cluster, namespace, deployment(f"foreign-{name}", ours=False))
    marks, repairs = RefreshMarks(), Repairs()
    task = asyncio.create_task(follow_own_deployments(client, namespace, marks, repairs))
    try:
        await until(lambda: (namespace, name) in marks.pending, 10, "the listed Deployment's group marked")
        cluster.kubectl("delete", "deployment", name, "-n", namespace)
        await until(lambda: len(repairs.calls) == 1, 10, "the repair")
        create(cluster, namespace, deployment(name))  # as the repair would; then deleted again
        cluster.kubectl("delete", "deployment", name, "-n", namespace)
        await asyncio.sleep(1)  # the second DELETED arrives while the first repair runs
        assert len(repairs.calls) == 1
        repairs.go.set()
        await until(lambda: len(repairs.calls) == 2, 10, "the repair again")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert repairs.calls == [(namespace, name)] * 2
    assert (namespace, f"foreign-{name}") not in marks.pending  # not the operator's: not selected


async def test_a_deployment_deleted_while_no_watch_ran_is_repaired_after_the_next_listing(
        cluster: Cluster, namespace: str) -> None:
    name = f"group-{uuid.uuid4().hex[:4]}"
    create(cluster, namespace, deployment(name))
    marks, repairs = RefreshMarks(), Repairs()
    repairs.go.set()
    recording = RecordingClient(cluster, first_watch_fails=GONE)
    task = asyncio.create_task(follow_own_deployments(recording, namespace, marks, repairs))
    try:
        await until(lambda: len(recording.calls) >= 2, 10, "the listing and the first watch")
        cluster.kubectl("delete", "deployment", name, "-n", namespace)  # no DELETED event will tell
        recording.release.set()  # 410: the next listing lacks it
        await until(lambda: repairs.calls == [(namespace, name)], 10, "the repair")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await recording.close()
    assert [kind for kind, _, _ in recording.calls][:3] == ["GET", "WATCH", "GET"], recording.calls


def test_the_watches_select_the_group_pods_and_the_operators_own_deployments() -> None:
    assert OWN_DEPLOYMENTS.selector == "app.kubernetes.io/managed-by=singleton-operator"
    assert OWN_DEPLOYMENTS.path("ns") == "/apis/apps/v1/namespaces/ns/deployments"
    assert GROUP_PODS.path(None) == "/api/v1/pods"
