"""What keeps the operator's requests few with hundreds of groups, against the real API server.

The periodic pass over every group (``Refresher.refresh_scope``): its requests do not grow with the
number of groups, it writes what a per-group refresh would, and it leaves a group marked by an
event to the event-driven refresher. Access reviews: an ``allowed`` is asked once per TTL."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from singleton_election import contract
from singleton_election.kube import KubeClient, KubeUnavailable, load_kube_config
from singleton_operator import groups as groups_module
from singleton_operator import reconcile as reconcile_module
from singleton_operator.groups import Reconciler
from singleton_operator.marks import RefreshMarks
from singleton_operator.metrics import OperatorMetrics
from singleton_operator.reconcile import ACCESS_REVIEW_TTL, ACCESS_REVIEWS_IN_FLIGHT, AccessReviews
from singleton_operator.refresher import RECONCILE_DEFER, Refresher
from singleton_testbed.harness.kubehelpers import get_json
from tests.conftest import Cluster
from tests.integration.kube.test_operator import play_ready, play_sidecar, service
from tests.integration.kube.test_watches import until

pytestmark = pytest.mark.usefixtures("singleton_crd")


class CountingClient(KubeClient):
    """A real client that also notes each request it makes (method, path), and runs
    ``before(method, path)`` first if set (to act in the middle of a pass)."""

    def __init__(self, kubeconfig: Path) -> None:
        super().__init__(load_kube_config(str(kubeconfig)), user_agent="singleton-operator-test")
        self.calls: list[tuple[str, str]] = []
        self.before: Callable[[str, str], None] | None = None

    async def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                      content_type: str = "application/json", timeout: float) -> dict[str, Any]:
        self.calls.append((method, path))
        if self.before is not None:
            self.before(method, path)
        return await super().request(method, path, body=body, params=params, content_type=content_type,
                                     timeout=timeout)

    async def write(self, method: str, path: str, *, body: Any, params: Mapping[str, str] | None = None,
                    content_type: str = "application/json", timeout: float) -> None:
        self.calls.append((method, path))
        await super().write(method, path, body=body, params=params, content_type=content_type, timeout=timeout)


@dataclass
class Groups:
    """The operator's reconciler and refresher, wired as runtime.py wires them."""

    client: CountingClient
    marks: RefreshMarks
    reconciler: Reconciler
    refresher: Refresher


@pytest.fixture
async def groups(cluster: Cluster) -> AsyncIterator[Groups]:
    client = CountingClient(cluster.kubeconfig)
    metrics, marks = OperatorMetrics(), RefreshMarks()
    reconciler = Reconciler(client=client, sidecar_image="example.invalid/sidecar:1", metrics=metrics, marks=marks)
    try:
        yield Groups(client, marks, reconciler, Refresher(client=client, metrics=metrics, reconciler=reconciler,
                                                          marks=marks))
    finally:
        await client.close()


def calls(groups: Groups) -> list[tuple[str, str]]:
    return groups.client.calls


def make_pod(cluster: Cluster, namespace: str, name: str, role: str, token: int | None) -> None:
    """A Ready pod ``<group>-<x>`` as its ReplicaSet, kubelet and sidecar would leave it (no
    operator runs here: the groups' Deployments are never made)."""
    group = name.rsplit("-", 1)[0]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {contract.LABEL_GROUP: group}},
        "spec": {"initContainers": [{"name": "singleton-sidecar", "image": "example.invalid/sidecar:1",
                                     "restartPolicy": "Always"}],
                 "containers": [{"name": "app", "image": "example.invalid/app:1"}]}}))
    play_ready(cluster, namespace, name)
    play_sidecar(cluster, namespace, name, role, token)


def leader_of(cluster: Cluster, namespace: str, name: str) -> Any:
    return (get_json(cluster, "singletonservice", name, "-n", namespace).get("status") or {}).get("leader")


async def test_a_pass_lists_each_kind_once_whatever_the_number_of_groups(
        cluster: Cluster, namespace: str, groups: Groups) -> None:
    names = [f"many-{i}" for i in range(6)]
    for i, name in enumerate(names):
        cluster.apply(service(name), namespace=namespace)
        make_pod(cluster, namespace, f"{name}-a", "leader", 10 + i)
        make_pod(cluster, namespace, f"{name}-b", "standby", None)

    await groups.refresher.refresh_scope(namespace)
    assert [leader_of(cluster, namespace, n) for n in names] == [f"{n}-a" for n in names]
    reads = [c for c in calls(groups) if c[0] == "GET"]
    assert reads == [("GET", f"/apis/singleton.dev/v1alpha1/namespaces/{namespace}/singletonservices"),
                     ("GET", f"/api/v1/namespaces/{namespace}/pods"),
                     ("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments")]
    assert sorted(p for m, p in calls(groups) if m == "PATCH") == sorted(
        f"/apis/singleton.dev/v1alpha1/namespaces/{namespace}/singletonservices/{n}/status" for n in names)

    # At rest nothing changed: three listings, no write; and a live refresh of a group finds
    # nothing to write either (the pass wrote what it would).
    calls(groups).clear()
    await groups.refresher.refresh_scope(namespace)
    assert [m for m, _ in calls(groups)] == ["GET", "GET", "GET"]
    await groups.refresher.refresh(namespace, "many-3")
    assert [m for m, _ in calls(groups)] == ["GET"] * 6

    # A leader change the pass finds: written, for that group only.
    play_sidecar(cluster, namespace, "many-2-a", "standby", None)
    play_sidecar(cluster, namespace, "many-2-b", "leader", 99)
    calls(groups).clear()
    await groups.refresher.refresh_scope(namespace)
    assert leader_of(cluster, namespace, "many-2") == "many-2-b"
    assert [p for m, p in calls(groups) if m == "PATCH"] == [
        f"/apis/singleton.dev/v1alpha1/namespaces/{namespace}/singletonservices/many-2/status"]


async def test_a_group_marked_by_an_event_is_left_to_the_refresher(
        cluster: Cluster, namespace: str, groups: Groups) -> None:
    for name in ("quiet", "marked"):
        cluster.apply(service(name), namespace=namespace)
        make_pod(cluster, namespace, f"{name}-a", "leader", 5)
    # An event marked the group after (say) the listing: the pass must not write what it listed.
    groups.marks.mark(namespace, "marked")
    await groups.refresher.refresh_scope(namespace)
    assert leader_of(cluster, namespace, "quiet") == "quiet-a"
    assert leader_of(cluster, namespace, "marked") is None
    # The refresher's turn (after the group's first reconcile: before it ends, a refresh of a
    # group without a status writes nothing, as the test below shows).
    await groups.reconciler.reconcile(get_json(cluster, "singletonservice", "marked", "-n", namespace), new=True)
    await groups.refresher.refresh(namespace, "marked")
    assert leader_of(cluster, namespace, "marked") == "marked-a"


async def test_an_adopted_groups_workload_comes_from_one_listing_of_its_kind(
        cluster: Cluster, namespace: str, groups: Groups) -> None:
    for name in ("adopts-a", "adopts-b"):
        cluster.apply(json.dumps({"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService",
                                  "metadata": {"name": name},
                                  "spec": {"workloadRef": {"kind": "Deployment", "name": f"{name}-app"}}}),
                      namespace=namespace)
    await groups.refresher.refresh_scope(namespace)
    # Neither workload exists: said on each group, as the per-group refresh says it.
    for name in ("adopts-a", "adopts-b"):
        status = get_json(cluster, "singletonservice", name, "-n", namespace)["status"]
        stalled = next(c for c in status["conditions"] if c["type"] == "Stalled")
        assert (stalled["status"], stalled["reason"]) == ("True", "WorkloadNotFound"), status
        assert f"Deployment {namespace}/{name}-app does not exist" in stalled["message"]
    reads = [p for m, p in calls(groups) if m == "GET"]
    assert reads.count(f"/apis/apps/v1/namespaces/{namespace}/deployments") == 2  # ours (labelled), theirs
    assert len(reads) == 4


REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


async def test_an_allowed_access_review_is_asked_once_per_ttl(cluster: Cluster, namespace: str) -> None:
    now = [1000.0]
    client = CountingClient(cluster.kubeconfig)
    try:
        access = AccessReviews(client, clock=lambda: now[0])
        assert await access.allowed(namespace, "apps", "deployments", "create")
        assert await access.allowed(namespace, "apps", "deployments", "create")
        assert await access.allowed(namespace, "apps", "deployments", "patch")  # another question: asked
        assert client.calls == [("POST", REVIEWS), ("POST", REVIEWS)]
        now[0] += ACCESS_REVIEW_TTL + 0.1
        assert await access.allowed(namespace, "apps", "deployments", "create")
        assert client.calls == [("POST", REVIEWS)] * 3
    finally:
        await client.close()


class Reviewer:
    """An API server that refuses every access review (a real one needs a refused account), or
    with ``answers=False`` takes them and never answers (a real one would, in time)."""

    def __init__(self, *, answers: bool = True) -> None:
        self.answers = answers
        self.asked = 0

    async def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        assert (method, path) == ("POST", REVIEWS)
        self.asked += 1
        if not self.answers:
            await asyncio.Event().wait()
        return {"status": {"allowed": False}}


async def test_a_refused_access_review_is_asked_again_at_once() -> None:
    client = Reviewer()
    access = AccessReviews(client, clock=lambda: 0.0)  # type: ignore[arg-type]
    assert not await access.allowed("ns", "", "services", "create")
    assert not await access.allowed("ns", "", "services", "create")
    assert client.asked == 2


async def test_a_group_deleted_during_a_pass_is_not_written(cluster: Cluster, namespace: str, groups: Groups) -> None:
    for name in ("stays", "goes"):
        cluster.apply(service(name), namespace=namespace)
        make_pod(cluster, namespace, f"{name}-a", "leader", 5)

    def delete_while_listing(method: str, path: str) -> None:
        if path.endswith("/pods"):  # after the SingletonServices were listed
            groups.reconciler.forget(namespace, "goes")  # what kopf's delete handler does

    groups.client.before = delete_while_listing
    await groups.refresher.refresh_scope(namespace)
    assert leader_of(cluster, namespace, "stays") == "stays-a"
    assert leader_of(cluster, namespace, "goes") is None
    assert not [p for m, p in calls(groups) if m == "PATCH" and "/goes" in p]


async def test_a_failed_listing_hands_the_known_groups_to_the_refresher(
        cluster: Cluster, namespace: str, groups: Groups) -> None:
    groups.reconciler.applied[(namespace, "known")] = 1
    groups.reconciler.applied[("elsewhere", "other")] = 1

    def refuse_pods(method: str, path: str) -> None:
        if path.endswith("/pods"):
            raise KubeUnavailable(0, "Timeout", "no answer")

    cluster.apply(service("known"), namespace=namespace)
    groups.client.before = refuse_pods
    with pytest.raises(KubeUnavailable):
        await groups.refresher.refresh_scope(namespace)
    assert groups.marks.marked() == {(namespace, "known")}  # what the refresher refreshes next


async def test_the_pass_leaves_a_re_adoption_to_the_live_refresh(
        cluster: Cluster, namespace: str, groups: Groups) -> None:
    """A workload whose group label is not what the group last applied: the listing may be old
    (the group deleted since, its workload given back), so the pass applies nothing."""
    cluster.kubectl("create", "deployment", "plain-app", "--image=example.invalid/app:1", "-n", namespace)
    cluster.apply(json.dumps({"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService",
                              "metadata": {"name": "adopts"},
                              "spec": {"workloadRef": {"kind": "Deployment", "name": "plain-app"}}}),
                  namespace=namespace)
    await groups.refresher.refresh_scope(namespace)
    assert [m for m, _ in calls(groups)] == ["GET"] * 4  # the lists; no apply, no status
    assert (namespace, "adopts") in groups.marks.marked()  # the live refresh decides


async def test_groups_reconciled_together_share_one_access_review(cluster: Cluster, namespace: str) -> None:
    """Sixteen groups of a namespace reconciled at once ask the same question at once: one
    review goes out and every one of them gets its answer."""
    client = CountingClient(cluster.kubeconfig)
    try:
        access = AccessReviews(client)
        answers = await asyncio.gather(*(access.allowed(namespace, "apps", "deployments", "create")
                                         for _ in range(16)))
        assert answers == [True] * 16
        assert client.calls == [("POST", REVIEWS)]
    finally:
        await client.close()


class InFlightClient(CountingClient):
    """A real client that notes the most requests it had in flight at once."""

    def __init__(self, kubeconfig: Path) -> None:
        super().__init__(kubeconfig)
        self.in_flight = self.most_in_flight = 0

    async def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)  # all that are let through are in flight together
            return await super().request(method, path, **kwargs)
        finally:
            self.in_flight -= 1


async def test_access_reviews_in_flight_are_bounded_across_namespaces(cluster: Cluster) -> None:
    """Answers are shared within a namespace only: new groups in many namespaces ask many
    questions at once, and no more than ACCESS_REVIEWS_IN_FLIGHT go out together (the rest
    would queue for the client's connections, their timeouts running)."""
    client = InFlightClient(cluster.kubeconfig)
    try:
        access = AccessReviews(client)
        questions = [(f"team-{i:02d}", "apps", "deployments", verb) for i in range(30) for verb in ("create", "patch")]
        assert await asyncio.gather(*(access.allowed(*q) for q in questions)) == [True] * len(questions)
        assert client.calls == [("POST", REVIEWS)] * len(questions)
        assert client.most_in_flight == ACCESS_REVIEWS_IN_FLIGHT
    finally:
        await client.close()


async def test_a_review_waiting_too_long_for_its_turn_fails_as_a_busy_api_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A review queued behind the ones in flight gives up after CALL_TIMEOUT as a request would
    (KubeUnavailable: the reconcile is retried later), and close() cancels those in flight."""
    monkeypatch.setattr(reconcile_module, "CALL_TIMEOUT", 0.3)
    client = Reviewer(answers=False)
    access = AccessReviews(client)  # type: ignore[arg-type]
    in_flight = [asyncio.create_task(access.allowed(f"team-{i:02d}", "", "services", "create"))
                 for i in range(ACCESS_REVIEWS_IN_FLIGHT)]
    await asyncio.sleep(0.05)
    assert client.asked == ACCESS_REVIEWS_IN_FLIGHT
    with pytest.raises(KubeUnavailable, match=rf"waited 0\.3 s for one of {ACCESS_REVIEWS_IN_FLIGHT} turns"):
        await access.allowed("team-late", "", "services", "create")
    assert client.asked == ACCESS_REVIEWS_IN_FLIGHT  # the late one never went out
    await access.close()
    for task in in_flight:
        with pytest.raises(asyncio.CancelledError):
            await task
    client.answers = True  # every turn was given back: the next review goes out at once
    assert not await asyncio.wait_for(access.allowed("team-after", "", "services", "create"), timeout=1)
    assert client.asked == ACCESS_REVIEWS_IN_FLIGHT + 1


async def test_a_deleted_deployment_is_put_back_after_the_api_server_failed_the_first_try(
        cluster: Cluster, namespace: str, groups: Groups, monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf retries no event handler: the repair of a deleted Deployment retries by itself."""
    monkeypatch.setattr(groups_module, "RETRY_FIRST", 0.1)
    cluster.apply(service("mended"), namespace=namespace)
    await groups.reconciler.reconcile(get_json(cluster, "singletonservice", "mended", "-n", namespace), new=True)
    cluster.kubectl("delete", "deployment", "mended", "-n", namespace)
    failed: list[str] = []

    def fail_first_read(method: str, path: str) -> None:
        if method == "GET" and path.endswith("/singletonservices/mended") and not failed:
            failed.append(path)
            raise KubeUnavailable(0, "Timeout", "no answer")

    groups.client.before = fail_first_read
    await asyncio.wait_for(groups.reconciler.repair(namespace, "mended"), timeout=30)
    assert failed
    assert get_json(cluster, "deployment", "mended", "-n", namespace)["metadata"]["labels"][contract.LABEL_GROUP] \
        == "mended"


async def test_a_new_group_gets_its_first_status_once_its_first_reconcile_ended(
    cluster: Cluster, namespace: str, groups: Groups
) -> None:
    """A refresh of a group just created, before its first reconcile ended (a pod event marks
    it first), writes nothing: the status would say "not applied yet" and be written again a
    moment later. The reconcile's end marks it, and that refresh writes it, applied."""
    cluster.apply(service("fresh"), namespace=namespace)
    make_pod(cluster, namespace, "fresh-a", "leader", 3)
    await groups.refresher.refresh(namespace, "fresh")
    assert not [p for m, p in calls(groups) if m == "PATCH" and p.endswith("/status")]
    assert leader_of(cluster, namespace, "fresh") is None
    await groups.reconciler.reconcile(get_json(cluster, "singletonservice", "fresh", "-n", namespace), new=True)
    assert groups.marks.marked() == {(namespace, "fresh")}
    calls(groups).clear()
    await groups.refresher.refresh(namespace, "fresh")
    body = get_json(cluster, "singletonservice", "fresh", "-n", namespace)
    assert body["status"]["leader"] == "fresh-a"
    assert body["status"]["observedGeneration"] == body["metadata"]["generation"]
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert ready["message"] != "creating the workload"  # the Deployment as its apply answered
    # From what the reconcile had in hand: the group and its Deployment are not read again.
    assert [c for c in calls(groups) if c[0] == "GET"] == [("GET", f"/api/v1/namespaces/{namespace}/pods")]
    # Once: the next refresh reads them as any refresh does.
    calls(groups).clear()
    await groups.refresher.refresh(namespace, "fresh")
    assert sorted(p for m, p in calls(groups) if m == "GET") == [
        f"/api/v1/namespaces/{namespace}/pods", f"/apis/apps/v1/namespaces/{namespace}/deployments/fresh",
        f"/apis/singleton.dev/v1alpha1/namespaces/{namespace}/singletonservices/fresh"]


async def test_a_new_groups_first_status_is_read_live_after_another_reconcile(
    cluster: Cluster, namespace: str, groups: Groups
) -> None:
    """What a new group's first reconcile left is older than a later reconcile's group (an edit
    since): the refresh after that one reads the group, and its status says the newest generation."""
    cluster.apply(service("edited"), namespace=namespace)
    make_pod(cluster, namespace, "edited-a", "leader", 4)
    first = get_json(cluster, "singletonservice", "edited", "-n", namespace)
    await groups.reconciler.reconcile(first, new=True)
    cluster.kubectl("patch", "singletonservice", "edited", "-n", namespace, "--type=merge",
                    "-p", '{"spec": {"replicas": 3}}')
    edited = get_json(cluster, "singletonservice", "edited", "-n", namespace)
    await groups.reconciler.reconcile(edited)
    calls(groups).clear()
    await groups.refresher.refresh(namespace, "edited")
    assert ("GET", f"/apis/singleton.dev/v1alpha1/namespaces/{namespace}/singletonservices/edited") in calls(groups)
    status = get_json(cluster, "singletonservice", "edited", "-n", namespace)["status"]
    assert (status["leader"], status["observedGeneration"]) == ("edited-a", edited["metadata"]["generation"])


def test_a_group_in_a_reconcile_is_refreshed_after_it_or_within_the_bound(
    groups: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr("singleton_operator.refresher.time.monotonic", lambda: now[0])
    groups.reconciler._in_reconcile.add(("ns", "busy"))
    groups.marks.mark("ns", "busy")
    groups.marks.mark("ns", "idle")
    assert groups.refresher._due() == [("ns", "idle")]
    assert groups.marks.marked() == {("ns", "busy")}  # still marked, the refresher kept awake
    now[0] += RECONCILE_DEFER / 2
    assert groups.refresher._due() == []
    now[0] += RECONCILE_DEFER
    assert groups.refresher._due() == [("ns", "busy")]  # a slow reconcile holds it back no longer
    assert groups.marks.marked() == frozenset()


async def test_a_new_group_is_refreshed_only_once_its_first_reconcile_has_ended(
    groups: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before that, its refresh would read it to write nothing (in a burst, a wasted read for
    about half the new groups). A group with a status, in its first reconcile of this process
    (after a restart), is only held back: its refresh may carry a leader change."""
    release = asyncio.Event()

    async def slow(client: KubeClient, spec: Any, access: Any, *, new: bool = False) -> reconcile_module.Applied:
        await release.wait()
        return reconcile_module.Applied(database=None, workload=None)

    monkeypatch.setattr("singleton_operator.groups.reconcile", slow)

    def body(name: str, status: dict[str, Any] | None) -> dict[str, Any]:
        obj: dict[str, Any] = json.loads(service(name))
        obj["metadata"].update(namespace="ns", uid=f"uid-{name}", generation=1)
        return {**obj, "status": status} if status else obj

    groups.reconciler._reconciling = asyncio.Semaphore(2)  # "queued" waits for its turn
    reconciles = [asyncio.create_task(groups.reconciler.reconcile(body("fresh", None), new=True)),
                  asyncio.create_task(groups.reconciler.reconcile(body("known", {"leader": "known-a"}))),
                  asyncio.create_task(groups.reconciler.reconcile(body("queued", None), new=True))]
    await asyncio.sleep(0.05)
    assert groups.reconciler._in_reconcile == {("ns", "fresh"), ("ns", "known")}
    for name in ("fresh", "known", "queued"):
        groups.marks.mark("ns", name)  # a pod or Deployment event meanwhile
    assert groups.refresher._due() == []
    assert groups.marks.marked() == {("ns", "known")}  # held back, not dropped
    release.set()
    await asyncio.gather(*reconciles)
    assert not groups.reconciler._unreported
    # "known" kept its place; the others were marked again by their reconciles' end.
    assert groups.refresher._due() == [("ns", "known"), ("ns", "fresh"), ("ns", "queued")]


async def test_a_refresh_answered_404_before_its_group_was_made_keeps_the_groups_bookkeeping(
    cluster: Cluster, namespace: str, groups: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod event marks a group before its SingletonService exists; the refresh's read says
    404, and its answer is handled once the new group's reconcile has begun. Forgetting the
    name then dropped that reconcile's bookkeeping: the group got no status until its next
    reconcile."""
    answered, go_on = asyncio.Event(), asyncio.Event()
    real = groups.client.request

    async def late_404(method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        if method == "GET" and path.endswith("/singletonservices/late"):
            try:
                return await real(method, path, **kwargs)
            finally:
                answered.set()
                await go_on.wait()
        return await real(method, path, **kwargs)

    monkeypatch.setattr(groups.client, "request", late_404)
    refresh = asyncio.create_task(groups.refresher.refresh(namespace, "late"))
    await answered.wait()  # "not found": the group is not made yet
    cluster.apply(service("late"), namespace=namespace)
    make_pod(cluster, namespace, "late-a", "leader", 1)
    body = get_json(cluster, "singletonservice", "late", "-n", namespace)
    reconcile = asyncio.create_task(groups.reconciler.reconcile(body, new=True))
    await asyncio.sleep(0.05)  # it has begun
    go_on.set()
    await refresh
    await reconcile
    assert groups.reconciler.applied[(namespace, "late")] == body["metadata"]["generation"]
    await groups.refresher.refresh(namespace, "late")
    status = get_json(cluster, "singletonservice", "late", "-n", namespace)["status"]
    assert (status["leader"], status["observedGeneration"]) == ("late-a", body["metadata"]["generation"])


def test_marked_groups_are_refreshed_in_the_order_they_were_first_marked(groups: Groups) -> None:
    """In a burst the groups created first get their status first."""
    for name in ("c", "a", "b", "a", "c"):
        groups.marks.mark("ns", name)
    assert groups.refresher._due() == [("ns", "c"), ("ns", "a"), ("ns", "b")]


async def test_the_deletion_of_an_older_object_of_the_same_name_keeps_the_new_groups_bookkeeping(
    cluster: Cluster, namespace: str, groups: Groups
) -> None:
    """A group deleted and made again under its name: kopf's worker of the old object may
    handle its DELETED event after the new one's first reconcile. Forgetting by name alone
    dropped the new group's bookkeeping; only the UID's own is forgotten."""
    cluster.apply(service("again"), namespace=namespace)
    body = get_json(cluster, "singletonservice", "again", "-n", namespace)
    await groups.reconciler.reconcile(body, new=True)
    groups.reconciler.forget(namespace, "again", uid="the-deleted-objects-uid")
    assert groups.reconciler.applied[(namespace, "again")] == body["metadata"]["generation"]
    groups.reconciler.forget(namespace, "again", uid=body["metadata"]["uid"])
    assert (namespace, "again") not in groups.reconciler.applied


async def test_a_group_made_again_under_its_name_gets_its_status_after_its_own_reconcile(
    cluster: Cluster, namespace: str, groups: Groups
) -> None:
    """Deleted and created again before kopf handled the old object's DELETED event: what the
    operator kept for the old object (attempted, applied) is not the new one's."""
    cluster.apply(service("again"), namespace=namespace)
    make_pod(cluster, namespace, "again-a", "leader", 2)
    await groups.reconciler.reconcile(get_json(cluster, "singletonservice", "again", "-n", namespace), new=True)
    cluster.kubectl("delete", "singletonservice", "again", "-n", namespace, "--wait=true")
    cluster.apply(service("again"), namespace=namespace)
    await groups.refresher.refresh(namespace, "again")
    assert "status" not in get_json(cluster, "singletonservice", "again", "-n", namespace)
    body = get_json(cluster, "singletonservice", "again", "-n", namespace)
    during: list[int | None] = []  # at each of the reconcile's requests
    groups.client.before = lambda method, path: during.append(groups.reconciler.applied.get((namespace, "again")))
    await groups.reconciler.reconcile(body, new=True)
    assert during and set(during) == {None}
    await groups.refresher.refresh(namespace, "again")
    status = get_json(cluster, "singletonservice", "again", "-n", namespace)["status"]
    assert (status["leader"], status["observedGeneration"]) == ("again-a", body["metadata"]["generation"])


async def test_an_older_objects_reconcile_ending_late_leaves_the_new_ones_bookkeeping(
    groups: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf runs one worker per object: the deleted object's reconcile may end after the one of
    the object made again under its name has begun."""
    release_old = asyncio.Event()

    async def slow_for_the_old(client: KubeClient, spec: Any, access: Any, *,
                               new: bool = False) -> reconcile_module.Applied:
        if spec.uid == "old":
            await release_old.wait()
        return reconcile_module.Applied(database=None, workload=None)

    monkeypatch.setattr("singleton_operator.groups.reconcile", slow_for_the_old)

    def body(uid: str, generation: int) -> dict[str, Any]:
        obj: dict[str, Any] = json.loads(service("late"))
        obj["metadata"].update(namespace="ns", uid=uid, generation=generation)
        return obj

    old = asyncio.create_task(groups.reconciler.reconcile(body("old", 4)))
    await asyncio.sleep(0.05)
    assert ("ns", "late") in groups.reconciler._in_reconcile
    await groups.reconciler.reconcile(body("new", 1), new=True)
    release_old.set()
    await old
    assert groups.reconciler.applied[("ns", "late")] == 1
    assert ("ns", "late") in groups.reconciler._attempted and ("ns", "late") not in groups.reconciler._in_reconcile


async def test_refreshes_start_as_turns_free_and_a_group_marked_during_its_own_waits_for_it(
    groups: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No rounds: a group marked while a slow refresh runs is refreshed at once beside it; the
    slow group, marked again meanwhile, is refreshed again only after its refresh ended. A
    periodic pass waits for the refreshes in flight (a listing older than a refresh would
    write an older status back)."""
    started: list[str] = []
    slow_may_end = asyncio.Event()

    async def refresh(namespace: str, name: str) -> None:
        started.append(name)
        if name == "slow":
            await slow_may_end.wait()

    listed: list[list[str]] = []

    async def read(client: KubeClient, namespace: str | None) -> Any:
        listed.append(list(started))
        raise KubeUnavailable(503, "ServiceUnavailable", "a listing that fails, after noting when it began")

    monkeypatch.setattr(groups.refresher, "refresh", refresh)
    monkeypatch.setattr("singleton_operator.refresher.Listing.read", read)
    runner = asyncio.create_task(groups.refresher.run_refresher())
    try:
        groups.marks.mark("ns", "slow")
        await until(lambda: started == ["slow"], 5, "the slow refresh")
        groups.marks.mark("ns", "slow")
        groups.marks.mark("ns", "fast")
        await until(lambda: started == ["slow", "fast"], 5, "the fast refresh beside it")
        periodic = asyncio.create_task(groups.refresher.refresh_scope("ns"))
        await asyncio.sleep(0.2)
        assert started == ["slow", "fast"]  # the slow one not again while it runs
        assert not listed  # the pass waits for it
        slow_may_end.set()
        with pytest.raises(KubeUnavailable):
            await periodic
        assert listed == [["slow", "fast"]]
        await until(lambda: started == ["slow", "fast", "slow"], 5, "the slow group's second refresh")
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    assert not groups.refresher._in_flight


async def test_refreshes_waiting_for_a_turn_end_with_the_refresher(groups: Groups) -> None:
    """The refresher's end (a term's) cancels the refreshes in flight and forgets them, so that a
    periodic pass never waits on them."""
    groups.refresher._turns = asyncio.Semaphore(0)  # no turn ever frees
    runner = asyncio.create_task(groups.refresher.run_refresher())
    groups.marks.mark("ns", "a")
    groups.marks.mark("ns", "b")
    await until(lambda: len(groups.refresher._in_flight) == 2, 5, "both refreshes in flight")
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    assert not groups.refresher._in_flight
    async with asyncio.timeout(1):
        await groups.refresher._drained()
