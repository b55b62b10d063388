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
from singleton_election.kube import KubeClient, KubeGone, load_kube_config
from singleton_operator.watches import GROUP_PODS, OWN_DEPLOYMENTS, follow
from tests.conftest import Cluster

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(90)]

Seen = list[tuple[str, str]]  # (event type, pod name)


class RecordingClient(KubeClient):
    """Records the path and parameters of every request and watch; ``gone_once`` makes the first
    watch answer 410 Gone, as the server does for a version it no longer keeps."""

    def __init__(self, cluster: Cluster, *, gone_once: bool = False) -> None:
        super().__init__(load_kube_config(str(cluster.kubeconfig)))
        self.calls: list[tuple[str, str, Mapping[str, str]]] = []
        self._gone_once = gone_once

    async def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((method, path, dict(kwargs.get("params") or {})))
        return await super().request(method, path, **kwargs)

    def watch(self, path: str, **kwargs: Any) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        self.calls.append(("WATCH", path, dict(kwargs.get("params") or {})))
        if self._gone_once:
            self._gone_once = False
            return _gone(path)
        return super().watch(path, **kwargs)


async def _gone(path: str) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
    raise KubeGone(410, "Expired", f"watch {path}: too old resource version")
    yield  # pragma: no cover  (a generator that raises at its first step)


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
    recording = RecordingClient(cluster, gone_once=True)
    try:
        async with following(recording, namespace, seen, fail_first=True):
            # The first listing's only event fails in the handler; the 410 lists again.
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


def test_the_deployment_watch_selects_the_operators_own() -> None:
    assert OWN_DEPLOYMENTS.selector == "app.kubernetes.io/managed-by=singleton-operator"
    assert OWN_DEPLOYMENTS.path("ns") == "/apis/apps/v1/namespaces/ns/deployments"
    assert GROUP_PODS.path(None) == "/api/v1/pods"
