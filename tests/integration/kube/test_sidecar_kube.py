"""Three real sidecar processes, each playing a pod object in the real API server, with the
environment the downward API would give and a service account limited to the sidecar's Role:
leadership, annotations, labels, Events, failover, fencing, pod deletion, API server restart;
for the lease and both backends (and postgres, where the pod parts differ)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from singleton_election import contract
from singleton_testbed.harness.kubehelpers import create_pod, get_json, grant, service_account_kubeconfig
from singleton_testbed.harness.sidecars import (
    FAST_TIMINGS,
    SidecarProcess,
    leaders,
    one_leader,
    pause_leader_past_its_lease,
    wait_for,
    wait_serving,
)
from singleton_testbed.ledger import check_ledger
from tests.conftest import Cluster
from tests.support.paths import DATA

WORKER = str(DATA / "ledger_worker.py")
SIDECAR_ACCOUNT = "singleton-sidecar"


class PodSidecar(SidecarProcess):
    pod: str = ""
    namespace: str = ""


Factory = Callable[..., list[PodSidecar]]


@pytest.fixture
def group() -> str:
    return "g-" + uuid.uuid4().hex[:10]


@pytest.fixture
def sidecar_kubeconfig(cluster: Cluster, namespace: str, group: str, tmp_path: Path) -> Path:
    grant(cluster, namespace, SIDECAR_ACCOUNT, contract.sidecar_rbac_rules(group))
    return service_account_kubeconfig(cluster, namespace, SIDECAR_ACCOUNT, tmp_path / "sidecar.kubeconfig")


@pytest.fixture
def pod_sidecars(cluster: Cluster, namespace: str, group: str, pg_dsn: str, sidecar_kubeconfig: Path,  # noqa: PLR0917
                 tmp_path: Path) -> Iterator[Factory]:
    started: list[PodSidecar] = []

    def make(backend: str, count: int = 3, *, gated: bool = False,
             extra: dict[str, str] | None = None) -> list[PodSidecar]:
        new = []
        for _ in range(count):
            name = f"{group}-{len(started)}"
            pod = create_pod(cluster, namespace, name, labels={"app": group})
            env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": backend, "SINGLETON_NAMESPACE": namespace,
                   "SINGLETON_POD_NAME": name, "SINGLETON_POD_UID": pod["metadata"]["uid"],
                   "KUBECONFIG": str(sidecar_kubeconfig), "LEDGER_DSN": pg_dsn, **FAST_TIMINGS, **(extra or {})}
            if backend != "lease":
                env["SINGLETON_POSTGRES_DSN"] = pg_dsn
            sidecar = PodSidecar(name, env, tmp_path / f"{name}.log",
                                 command=[sys.executable, WORKER] if gated else [])
            sidecar.pod, sidecar.namespace = name, namespace
            started.append(sidecar)
            new.append(sidecar)
            sidecar.start()
        wait_serving(list(new))
        return new

    yield make
    for sidecar in started:
        sidecar.stop()
    cluster.kubectl("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", check=False)


def pod_view(cluster: Cluster, sidecar: PodSidecar) -> tuple[dict[str, str], dict[str, str], list[Any]]:
    pod = get_json(cluster, "pod", sidecar.pod, "-n", sidecar.namespace)
    metadata = pod["metadata"]
    return metadata.get("annotations") or {}, metadata.get("labels") or {}, pod["status"].get("conditions") or []


def pods_tell(cluster: Cluster, members: list[PodSidecar], leader: PodSidecar) -> bool:
    """Every pod's annotations and labels tell its sidecar's role (and the leader's token)."""
    doc = leader.leader_doc()
    if doc is None:
        return False
    for sidecar in members:
        annotations, labels, _ = pod_view(cluster, sidecar)
        leading = sidecar is leader
        role = "leader" if leading else "standby"
        checks = [
            annotations.get(contract.ANNOTATION_ROLE) == role,
            labels.get(contract.LABEL_ROLE) == role,
            annotations.get(contract.ANNOTATION_GROUP) == sidecar.env["SINGLETON_GROUP"],
            (annotations.get(contract.ANNOTATION_TOKEN) == str(doc["token"])) == leading,
            (contract.ANNOTATION_LEADER_SINCE in annotations) == leading,
            (annotations.get(contract.ANNOTATION_DELETION_COST) == contract.LEADER_DELETION_COST) == leading,
        ]
        if not all(checks):
            return False
    return True


def events_for(cluster: Cluster, sidecar: PodSidecar) -> list[str]:
    listing = get_json(cluster, "events", "-n", sidecar.namespace,
                       "--field-selector", f"involvedObject.name={sidecar.pod}")
    return [item["reason"] for item in listing["items"]]


@pytest.mark.parametrize("backend", ["lease", "both", "postgres"])
def test_one_leader_pods_annotated_and_labelled(cluster: Cluster, pod_sidecars: Factory, backend: str) -> None:
    members = pod_sidecars(backend, extra={"SINGLETON_READINESS_GATE": "true"})
    leader = one_leader(members)
    for sidecar in members:
        assert (sidecar.get("/readyz")[0] == 200) == (sidecar is leader)
        assert sidecar.get("/livez")[0] == 200
        assert sidecar.get("/candidate") == (200, "leader\n" if sidecar is leader else "standby\n")
    wait_for(lambda: pods_tell(cluster, members, leader), 10, "annotations and labels on every pod", 0.2)
    # A Service can select the leader by label.
    selected = get_json(cluster, "pods", "-n", leader.namespace, "-l",
                        f"{contract.LABEL_ROLE}=leader,{contract.LABEL_GROUP}={leader.env['SINGLETON_GROUP']}")
    assert [p["metadata"]["name"] for p in selected["items"]] == [leader.pod]
    # The readiness-gate condition follows the role.
    for sidecar in members:
        conditions = wait_for(lambda s=sidecar: [c for c in pod_view(cluster, s)[2]
                                                 if c["type"] == contract.CONDITION_LEADER], 5, "the condition")
        assert conditions[0]["status"] == ("True" if sidecar is leader else "False")
    wait_for(lambda: "LeaderElected" in events_for(cluster, leader), 5, "a LeaderElected event", 0.2)


@pytest.mark.parametrize("backend", ["lease", "both"])
def test_sigkill_failover_new_leader_annotated_tokens_increase(
    cluster: Cluster, pod_sidecars: Factory, backend: str
) -> None:
    members = pod_sidecars(backend)
    tokens = []
    for _ in range(2):
        alive = [s for s in members if s.alive()]
        leader = one_leader(alive)
        doc = leader.leader_doc()
        assert doc is not None
        tokens.append(doc["token"])
        leader.signal(signal.SIGKILL)
        started = time.monotonic()
        new = one_leader([s for s in alive if s is not leader], timeout=10)
        # A crashed holder's Lease must expire first: lease_duration (2 s here) plus a margin.
        assert time.monotonic() - started < 2 + 1.5
        rest = [s for s in alive if s is not leader]
        wait_for(lambda n=new, r=rest: pods_tell(cluster, r, n), 10, "the new leader's pod annotated", 0.2)
    doc = one_leader([s for s in members if s.alive()]).leader_doc()
    assert doc is not None
    tokens.append(doc["token"])
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


@pytest.mark.parametrize("backend", ["lease", "both"])
async def test_sigstop_past_the_lease_steps_down_and_is_fenced(
    pod_sidecars: Factory, group: str, pg_dsn: str, backend: str
) -> None:
    members = pod_sidecars(backend, gated=True)
    await pause_leader_past_its_lease(members, pg_dsn, group)


@pytest.mark.parametrize("backend", ["lease", "both", "postgres"])
async def test_pod_deletion_drains_releases_and_hands_over(
    cluster: Cluster, pod_sidecars: Factory, group: str, pg_dsn: str, backend: str
) -> None:
    members = pod_sidecars(backend, gated=True, extra={"SINGLETON_DRAIN_TIMEOUT": "10"})
    leader = await asyncio.to_thread(one_leader, members)
    await asyncio.sleep(0.5)
    cluster.kubectl("delete", "pod", leader.pod, "-n", leader.namespace, "--wait=false")
    started = time.monotonic()
    rest = [s for s in members if s is not leader]
    new = await asyncio.to_thread(one_leader, rest, 5)
    handover = time.monotonic() - started
    assert handover < 1.5, handover
    assert await asyncio.to_thread(leader.wait_exit, 10) == 0
    annotations = pod_view(cluster, leader)[0]
    assert annotations[contract.ANNOTATION_ROLE] == contract.ROLE_RELEASED
    await asyncio.to_thread(wait_for, lambda: pods_tell(cluster, rest, new), 10, "the new leader's pod", 0.2)
    await asyncio.sleep(0.3)
    report = await check_ledger(pg_dsn, group)
    assert not report.overlaps, report.overlaps
    assert not report.regressions
    # A drain waits for the app to exit before it releases: no two apps ever acted at once.
    assert report.acts_checked and not report.acting_overlaps, report.summary()
    assert not [item for item in report.lost_items if f"token {report.terms[-1][0]} " not in item]
    reasons = events_for(cluster, leader)
    assert "LeaderDraining" in reasons and "LeadershipReleased" in reasons


async def test_both_backend_steps_down_when_its_postgres_session_is_killed(
    pod_sidecars: Factory, group: str, namespace: str, pg_admin_dsn: str
) -> None:
    members = pod_sidecars("both", 2)
    leader = await asyncio.to_thread(one_leader, members)
    conn = await asyncpg.connect(pg_admin_dsn)
    try:
        pid = await conn.fetchval("SELECT holder_pid FROM singleton_leases WHERE group_name = $1",
                                  contract.lock_key(group, namespace))
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await conn.close()
    started = time.monotonic()
    await asyncio.to_thread(wait_for, lambda: not leader.ready() or None, 2, "the leader to step down")
    assert time.monotonic() - started < 0.5
    await asyncio.to_thread(one_leader, members, 10)


@pytest.mark.parametrize("backend", ["lease", "both"])
async def test_api_server_restart_never_gives_two_leaders(
    cluster: Cluster, pod_sidecars: Factory, group: str, pg_dsn: str, backend: str
) -> None:
    if cluster.control_plane is None:
        pytest.skip("needs the test bed's own API server")
    members = pod_sidecars(backend, gated=True)
    before = await asyncio.to_thread(one_leader, members)
    doc_before = before.leader_doc()
    assert doc_before is not None
    await asyncio.sleep(0.3)
    cluster.control_plane.restart_apiserver()  # main thread: servers die with the thread that started them
    after = await asyncio.to_thread(one_leader, members, 20)
    await asyncio.sleep(0.5)
    assert len(leaders(members)) == 1
    report = await check_ledger(pg_dsn, group)
    assert not report.overlaps, report.overlaps
    assert not report.regressions
    assert report.acts_checked and not report.acting_overlaps, report.summary()
    doc_after = after.leader_doc()
    assert doc_after is not None
    # Two outcomes, both right: the restart ends the term (no renewal got through within the
    # renew deadline) or it does not (the API server was back in time). A new term, on another
    # pod or on the same one again, has a new token and is a second term in the ledger; the same
    # term means the same pod and no other term ever wrote.
    if doc_after["token"] != doc_before["token"]:
        # The new term's worker writes once it has started (a Python process and a connection:
        # seconds on a loaded machine), so its first row is waited for, not assumed.
        deadline = time.monotonic() + 15
        while len(report.terms) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            report = await check_ledger(pg_dsn, group)
        assert len(report.terms) >= 2, report.summary()
        assert not report.overlaps and not report.acting_overlaps, report.summary()
    else:
        assert after is before and len(report.terms) == 1, report.summary()


def test_standby_pods_are_annotated_at_once_not_after_a_lock_wait(cluster: Cluster, pod_sidecars: Factory) -> None:
    """Default lease timings: a standby's first lock wait lasts a retry period (6 s); its
    pod must say "standby" long before that."""
    slow = {"SINGLETON_LEASE_DURATION": "9", "SINGLETON_RENEW_DEADLINE": "7.5", "SINGLETON_RETRY_PERIOD": "6"}
    members = pod_sidecars("lease", 2, extra=slow)
    started = time.monotonic()
    leader = one_leader(members)
    wait_for(lambda: pods_tell(cluster, members, leader), 10, "both pods annotated", 0.1)
    assert time.monotonic() - started < 2.0


async def test_drain_waits_for_the_main_container_to_stop(cluster: Cluster, pod_sidecars: Factory) -> None:
    """Cooperative apps stop on SIGTERM from the kubelet: the sidecar releases only once the
    pod shows the main container terminated (or the drain timeout passes)."""
    members = pod_sidecars("lease", 2, extra={"SINGLETON_DRAIN_WAIT_CONTAINER": "app",
                                              "SINGLETON_DRAIN_TIMEOUT": "20"})
    leader = await asyncio.to_thread(one_leader, members)
    other = next(s for s in members if s is not leader)
    cluster.kubectl("delete", "pod", leader.pod, "-n", leader.namespace, "--wait=false")
    await asyncio.to_thread(wait_for, lambda: (leader.leader_doc() or {}).get("role") == "draining", 5,
                            "the leader to drain")
    assert leader.get("/candidate")[0] == 503
    await asyncio.sleep(1.5)
    assert (leader.leader_doc() or {}).get("role") == "draining", "released before the app stopped"
    assert not other.ready()
    terminated = {"status": {"containerStatuses": [{
        "name": "app", "image": "example.invalid/app:1", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}}
    cluster.kubectl("patch", "pod", leader.pod, "-n", leader.namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps(terminated))
    started = time.monotonic()
    await asyncio.to_thread(one_leader, [other], 5)
    assert time.monotonic() - started < 1.0
    assert await asyncio.to_thread(leader.wait_exit, 10) == 0


async def test_a_native_sidecar_takes_the_kubelets_sigterm_during_deletion_as_the_main_container_stopped(
        cluster: Cluster, pod_sidecars: Factory) -> None:
    """A real kubelet publishes the main container's termination only after the whole pod has
    stopped, native sidecar included; but it sends a native sidecar SIGTERM only once the main
    containers have exited. During a deletion that SIGTERM ends the wait; without a deletion (a
    sidecar restarted alone by a failed liveness probe) it does not."""
    members = pod_sidecars("lease", 2, extra={"SINGLETON_DRAIN_WAIT_CONTAINER": "app",
                                              "SINGLETON_NATIVE_SIDECAR": "true", "SINGLETON_DRAIN_TIMEOUT": "20"})
    leader = await asyncio.to_thread(one_leader, members)
    other = next(s for s in members if s is not leader)
    # SIGTERM alone: the sidecar drains, and waits for the main container, which still runs.
    leader.signal_sidecar_only(signal.SIGTERM)
    await asyncio.to_thread(wait_for, lambda: (leader.leader_doc() or {}).get("role") == "draining", 5,
                            "the leader to drain")
    await asyncio.sleep(1.5)
    assert (leader.leader_doc() or {}).get("role") == "draining", "released on a SIGTERM without a deletion"
    assert not other.ready()
    # The deletion seen, then the kubelet's SIGTERM (sent once the main containers have exited).
    cluster.kubectl("delete", "pod", leader.pod, "-n", leader.namespace, "--wait=false")
    await asyncio.sleep(1.5)
    assert (leader.leader_doc() or {}).get("role") == "draining", "released before the kubelet's SIGTERM"
    started = time.monotonic()
    leader.signal_sidecar_only(signal.SIGTERM)
    await asyncio.to_thread(one_leader, [other], 5)
    assert time.monotonic() - started < 1.0
    assert await asyncio.to_thread(leader.wait_exit, 10) == 0


def sidecar_role(cluster: Cluster, namespace: str, rules: list[dict[str, list[str]]]) -> None:
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": SIDECAR_ACCOUNT, "namespace": namespace}, "rules": rules}
    cluster.apply(json.dumps(role), namespace=namespace)


async def test_a_term_is_released_only_once_the_pod_no_longer_shows_it_as_leader(
        cluster: Cluster, namespace: str, group: str, pod_sidecars: Factory) -> None:
    """The leader Service selects pods by their role label. A leader that cannot write its pod
    (cut off from the API server for writes: here its right to patch pods is taken away) keeps
    ``role=leader`` after its term: it says 503 on ``/candidate`` (the pods' readiness) so the
    endpoints drop it, and does not release, so no second pod leads while the label may still
    name it; the lock expires instead. Once the label is written, all is as before. It used to
    release at once, with both pods labelled leader and Ready."""
    members = pod_sidecars("lease", 2)
    leader = await asyncio.to_thread(one_leader, members)
    other = next(s for s in members if s is not leader)
    full = contract.sidecar_rbac_rules(group)
    sidecar_role(cluster, namespace, without_pod_writes(full))
    await asyncio.sleep(1.0)  # RBAC takes effect
    assert (await asyncio.to_thread(leader.control, "POST", "/step-down"))[0] == 202
    stepped_down = time.monotonic()
    await asyncio.to_thread(wait_for, lambda: leader.get("/candidate")[0] == 503, 3,
                            "the old leader to say it is not ready")
    assert "still labelled leader" in leader.get("/candidate")[1]
    assert pod_view(cluster, leader)[1][contract.LABEL_ROLE] == "leader"
    await asyncio.sleep(max(0.0, stepped_down + 1.2 - time.monotonic()))
    assert not other.ready(), "released while the old leader's pod was still labelled leader"
    sidecar_role(cluster, namespace, full)
    await asyncio.to_thread(wait_for, lambda: pod_view(cluster, leader)[1][contract.LABEL_ROLE] != "leader", 10,
                            "the old leader's label to be written", 0.2)
    await asyncio.to_thread(wait_for, lambda: leader.get("/candidate")[0] == 200, 5, "the old leader ready again")
    await asyncio.to_thread(one_leader, members, 10)


TERMINATED_APP = {"status": {"containerStatuses": [{
    "name": "app", "image": "example.invalid/app:1", "imageID": "", "ready": False, "restartCount": 0,
    "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}}


def without_pod_writes(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sidecar's RBAC rules with pods only readable: its label writes fail."""
    return [r for r in rules if r["resources"] != ["pods"]] + [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


async def wired_as_the_operator_wires_it_and_acting(pod_sidecars: Factory) -> tuple[Any, Any, int]:
    """Two pod sidecars wired as the operator wires them (native sidecar, main container
    ``app``), the leader's SDK app registered for its term: (leader, the other, the token)."""
    members = pod_sidecars("lease", 2, extra={"SINGLETON_DRAIN_WAIT_CONTAINER": "app",
                                              "SINGLETON_NATIVE_SIDECAR": "true", "SINGLETON_DRAIN_TIMEOUT": "20"})
    leader = await asyncio.to_thread(one_leader, members)
    other = next(s for s in members if s is not leader)
    token = (leader.leader_doc() or {})["token"]
    assert (await asyncio.to_thread(leader.control, "POST", f"/acting?token={token}"))[0] == 200
    return leader, other, token


@pytest.mark.parametrize("app_ends", ["says it stopped", "dies without a word"])
async def test_a_deleted_pods_term_ends_when_the_app_has_stopped_not_when_the_kubelet_says(
        cluster: Cluster, pod_sidecars: Factory, app_ends: str) -> None:
    """A pod deletion, wired as the operator wires it (native sidecar, main container ``app``),
    with an SDK app registered for the term. Its ``POST /stopped`` ends the term at once: the
    kubelet would tell the sidecar a second or more later (there is no kubelet here, so it never
    does); this used to wait for it. An app that dies without a word ends the term when its
    container shows terminated; this used to wait for the drain timeout."""
    leader, other, token = await wired_as_the_operator_wires_it_and_acting(pod_sidecars)
    cluster.kubectl("delete", "pod", leader.pod, "-n", leader.namespace, "--wait=false")
    await asyncio.to_thread(wait_for, lambda: (leader.leader_doc() or {}).get("role") == "draining", 5,
                            "the leader to drain")
    await asyncio.sleep(1.0)
    assert (leader.leader_doc() or {}).get("role") == "draining", "released before the app stopped"
    started = time.monotonic()
    if app_ends == "says it stopped":
        assert (await asyncio.to_thread(leader.control, "POST", f"/stopped?token={token}"))[0] == 200
    else:
        cluster.kubectl("patch", "pod", leader.pod, "-n", leader.namespace, "--subresource=status",
                        "--type=merge", "-p", json.dumps(TERMINATED_APP))
    await asyncio.to_thread(one_leader, [other], 5)
    assert time.monotonic() - started < 1.0
    assert await asyncio.to_thread(leader.wait_exit, 10) == 0


async def test_a_deleted_pod_releases_once_its_app_stopped_without_waiting_for_its_label(
        cluster: Cluster, namespace: str, group: str, pod_sidecars: Factory) -> None:
    """A pod being deleted is taken out of the Service's ready endpoints by the endpoints
    controller whatever its labels: its term is released once its app has stopped, even when
    the write of its role label cannot land (its right to patch pods taken away, as in
    ``test_a_term_is_released_only_once_the_pod_no_longer_shows_it_as_leader``, where a
    step-down of a pod that is not being deleted does wait). This wait used to add an API write
    to every deletion's handover."""
    leader, other, token = await wired_as_the_operator_wires_it_and_acting(pod_sidecars)
    full = contract.sidecar_rbac_rules(group)
    sidecar_role(cluster, namespace, without_pod_writes(full))
    await asyncio.sleep(1.0)  # RBAC takes effect
    cluster.kubectl("delete", "pod", leader.pod, "-n", leader.namespace, "--wait=false")
    await asyncio.to_thread(wait_for, lambda: (leader.leader_doc() or {}).get("role") == "draining", 5,
                            "the leader to drain")
    started = time.monotonic()
    assert (await asyncio.to_thread(leader.control, "POST", f"/stopped?token={token}"))[0] == 200
    await asyncio.to_thread(one_leader, [other], 5)
    assert time.monotonic() - started < 1.0
    assert pod_view(cluster, leader)[1][contract.LABEL_ROLE] == "leader", "the label was written after all"


async def test_a_deleted_pods_sidecar_leaves_the_api_server_to_the_handover_first(
        cluster: Cluster, pod_sidecars: Factory) -> None:
    """From its pod's deletion on, the sidecar writes nothing to its pod for
    ``podstatus.HANDOVER_FIRST`` (0.3 s): the release and the next leader's take go first. Then
    the pod shows the final status, nothing lost."""
    from singleton_sidecar.podstatus import HANDOVER_FIRST

    leader, other, token = await wired_as_the_operator_wires_it_and_acting(pod_sidecars)
    # Every change of the pod, with the time this process read it: the deletion, then the role label.
    role_path = "{.metadata.labels." + contract.LABEL_ROLE.replace(".", "\\.") + "}"
    watch = await asyncio.create_subprocess_exec(
        "kubectl", "get", "pod", leader.pod, "-n", leader.namespace, "-w", "-o",
        "jsonpath={.metadata.deletionTimestamp} " + role_path + "{\"\\n\"}", env=cluster.env,
        stdout=asyncio.subprocess.PIPE)
    seen: list[tuple[float, str]] = []

    async def follow() -> None:
        assert watch.stdout is not None
        async for line in watch.stdout:
            seen.append((time.monotonic(), line.decode().rstrip("\n")))

    reader = asyncio.create_task(follow())
    try:
        # The pod shows the leader's role before it is deleted (the label write may come after
        # the leader document this test waited for).
        await asyncio.to_thread(wait_for, lambda: seen and seen[-1][1] == " leader", 10,
                                "the pod to show the leader's role", 0.05)
        cluster.kubectl("delete", "pod", leader.pod, "-n", leader.namespace, "--wait=false")
        await asyncio.to_thread(wait_for, lambda: (leader.leader_doc() or {}).get("role") == "draining", 5,
                                "the leader to drain")
        assert (await asyncio.to_thread(leader.control, "POST", f"/stopped?token={token}"))[0] == 200
        await asyncio.to_thread(one_leader, [other], 5)
        await asyncio.to_thread(wait_for, lambda: any(line.endswith(" released") for _, line in seen), 10,
                                "the pod to show the released role", 0.05)
    finally:
        watch.terminate()
        await watch.wait()
        await reader
    deleted = next(i for i, (_, line) in enumerate(seen) if line.split(" ")[0])
    relabelled = next(at for at, line in seen[deleted:] if not line.endswith(" leader"))
    assert relabelled - seen[deleted][0] >= HANDOVER_FIRST - 0.1, seen  # the watch's own delivery jitter


async def test_a_handover_through_the_pod_cancels_the_sdk_body_before_the_lease_passes(
        cluster: Cluster, pod_sidecars: Factory) -> None:
    """``kubectl singleton handover``'s request on the leader's pod (the step-down annotation,
    read through the API server): the SDK's ``leadership()`` block is cancelled, and the Lease
    passes to the other pod only once the block has exited."""
    from singleton_sdk import LeaderClient, LeadershipLost
    from tests.integration.postgres.test_sdk import STEP_SECONDS, body_until_cancelled

    members = pod_sidecars("lease", 2)
    leader = await asyncio.to_thread(one_leader, members)
    standby = next(s for s in members if s is not leader)
    marks: dict[str, float] = {}
    async with LeaderClient(leader.url + "/leader", control_url=f"http://127.0.0.1:{leader.control_port}") as client:
        entered = asyncio.Event()

        async def app() -> None:
            async with client.leadership():
                entered.set()
                await body_until_cancelled(standby, marks, STEP_SECONDS)

        task = asyncio.create_task(app())
        await asyncio.wait_for(entered.wait(), 5)
        requested = time.monotonic()
        await asyncio.to_thread(cluster.kubectl, "annotate", "pod", leader.pod, "-n", leader.namespace,
                                f"{contract.ANNOTATION_STEP_DOWN}={uuid.uuid4().hex}", "--overwrite")
        with pytest.raises(LeadershipLost, match="is ending"):
            await asyncio.wait_for(task, 15)
    assert marks["cancelled"] - requested < 2.0
    await asyncio.to_thread(wait_for, standby.ready, 5, "the other pod to lead")
    assert time.monotonic() - marks["exited"] < 3.0
