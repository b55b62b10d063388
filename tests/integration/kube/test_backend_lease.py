"""LeaseBackend against the real API server of the test session."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from singleton_election.backends.lease import NEWCOMER_DEFERENCE, LeaseBackend, micro_time
from singleton_election.backends.lease import force_release as lease_force_release
from singleton_election.contract import (
    ANNOTATION_TOKEN,
    LABEL_GROUP,
    LEASE_ANNOTATION_RELEASED,
    LEASE_ANNOTATION_TOKEN,
    sidecar_rbac_rules,
)
from singleton_election.core.lock import BackendUnavailable, Identity, LockRecord, Term, Token
from singleton_election.kube import KubeClient, KubeConfig, KubeError, KubeGone, KubeUnavailable, load_kube_config
from singleton_testbed.harness.kubehelpers import grant, service_account_kubeconfig
from tests.conftest import Cluster
from tests.support.backend_timings import timings_for

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(60)]

GROUP = "group-a"
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")

Factory = Callable[..., LeaseBackend]


class CountingClient(KubeClient):
    """A KubeClient that records every request and every watch it starts."""

    def __init__(self, config: KubeConfig) -> None:
        super().__init__(config)
        self.requests: list[tuple[str, str, Mapping[str, str] | None]] = []
        self.watches = 0

    async def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        self.requests.append((method, path, kwargs.get("params")))
        return await super().request(method, path, **kwargs)

    def watch(self, path: str, **kwargs: Any) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        self.watches += 1
        return super().watch(path, **kwargs)


@pytest_asyncio.fixture(loop_scope="function")
async def kube(cluster: Cluster) -> AsyncIterator[CountingClient]:
    client = CountingClient(load_kube_config(str(cluster.kubeconfig)))
    async with client:
        yield client


@pytest_asyncio.fixture(loop_scope="function")
async def make_backend(kube: CountingClient, namespace: str) -> AsyncIterator[Factory]:
    """Backends on the group's Lease (one shared client unless given); all closed at the end."""
    created: list[LeaseBackend] = []

    def make(**kwargs: Any) -> LeaseBackend:
        options: dict[str, Any] = {"client": kube, "namespace": namespace, "name": GROUP, "timings": timings_for(10.0)}
        options.update(kwargs)
        backend = LeaseBackend(**options)
        created.append(backend)
        return backend

    yield make
    for backend in created:
        await backend.close()
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("lease-watch")]


async def acquired(backend: LeaseBackend, identity: str, timeout: float = 5.0) -> Term:
    result = await backend.acquire(Identity(identity), timeout=timeout)
    assert isinstance(result, Term), result
    return result


def an_hour_behind() -> float:
    return time.time() - 3600


def record_losses(backend: LeaseBackend) -> tuple[list[str], asyncio.Event]:
    """The reasons of the backend's losses, and an event set at the first."""
    losses: list[str] = []
    lost = asyncio.Event()

    def on_loss(reason: str) -> None:
        losses.append(reason)
        lost.set()

    backend.set_loss_callback(on_loss)
    return losses, lost


def stale_lease(*, token: int) -> str:
    """A free Lease of the group carrying ``token``, as an earlier lease era's last release left it."""
    annotations = {LEASE_ANNOTATION_TOKEN: str(token), LEASE_ANNOTATION_RELEASED: str(token)}
    return json.dumps({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                       "metadata": {"name": GROUP, "annotations": annotations},
                       "spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "leaseTransitions": 3}})


async def create_pod(client: KubeClient, namespace: str, name: str, *, group: str, token: str) -> None:
    """A pod of ``group`` (never scheduled) carrying ``token`` as the sidecar annotates a leader."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": {LABEL_GROUP: group}, "annotations": {ANNOTATION_TOKEN: token}},
           "spec": {"containers": [{"name": "app", "image": "example.invalid/app:1"}]}}
    await client.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=pod, timeout=10)


def lease_json(cluster: Cluster, namespace: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(cluster.kubectl("get", "lease", GROUP, "-n", namespace, "-o", "json").stdout)
    return doc


async def test_first_acquire_creates_the_lease(cluster: Cluster, namespace: str, make_backend: Factory) -> None:
    backend = make_backend(timings=timings_for(7.5))
    assert backend.name == "lease"
    assert await backend.observe(timeout=5) == LockRecord(holder=None, token=None, version="")
    term = await acquired(backend, "pod-a")
    assert term.identity == "pod-a" and term.token >= 1 and term.version
    assert abs(term.token - time.time() * 1000) < 60_000  # a fresh Lease starts from wall-clock milliseconds
    lease = lease_json(cluster, namespace)
    spec = lease["spec"]
    assert spec["holderIdentity"] == "pod-a"
    assert spec["leaseDurationSeconds"] == 8
    assert spec["leaseTransitions"] == 0
    assert MICRO_TIME.match(spec["acquireTime"]) and MICRO_TIME.match(spec["renewTime"])
    assert lease["metadata"]["annotations"][LEASE_ANNOTATION_TOKEN] == str(term.token)
    assert lease["metadata"]["resourceVersion"] == term.version
    table = cluster.kubectl("get", "lease", "-n", namespace).stdout
    assert re.search(rf"^{GROUP}\s+pod-a\s", table, re.MULTILINE), table
    assert await backend.observe(timeout=5) == LockRecord(holder=Identity("pod-a"), token=term.token,
                                                          version=term.version)


async def test_renew_extends_and_release_frees(cluster: Cluster, namespace: str, make_backend: Factory) -> None:
    backend = make_backend()
    term = await acquired(backend, "pod-a")
    before = time.monotonic()
    renewed = await backend.renew(term, timeout=5)
    assert renewed is not None and renewed.token == term.token and renewed.version != term.version
    assert before <= renewed.written_at <= time.monotonic()
    assert lease_json(cluster, namespace)["spec"]["renewTime"] > lease_json(cluster, namespace)["spec"]["acquireTime"]
    await backend.release(renewed, timeout=5)
    lease = lease_json(cluster, namespace)
    assert not lease["spec"].get("holderIdentity")
    assert lease["spec"]["leaseDurationSeconds"] == 1
    assert lease["metadata"]["annotations"][LEASE_ANNOTATION_TOKEN] == str(term.token)
    assert (await backend.observe(timeout=5)).holder is None
    await backend.release(renewed, timeout=5)  # idempotent
    assert await backend.renew(renewed, timeout=5) is None


async def test_no_acquire_while_the_holder_renews(make_backend: Factory) -> None:
    holder, standby = make_backend(timings=timings_for(1.0)), make_backend(timings=timings_for(1.0))
    term = await acquired(holder, "pod-a")

    async def keep_renewing() -> None:
        current: Term | None = term
        while current is not None:
            await asyncio.sleep(0.25)
            current = await holder.renew(current, timeout=1)

    renewer = asyncio.create_task(keep_renewing())
    try:
        result = await standby.acquire(Identity("pod-b"), timeout=2.5)  # 2.5 lease durations
    finally:
        renewer.cancel()
        await asyncio.gather(renewer, return_exceptions=True)
    assert isinstance(result, LockRecord)
    assert (result.holder, result.token) == ("pod-a", term.token)


async def test_release_wakes_a_blocked_standby_at_once(
    cluster: Cluster, namespace: str, make_backend: Factory
) -> None:
    holder, standby = make_backend(), make_backend()
    term = await acquired(holder, "pod-a")
    waiting = asyncio.create_task(standby.acquire(Identity("pod-b"), timeout=10))
    await asyncio.sleep(0.5)  # the standby is blocked on the watch
    assert not waiting.done()
    started, now_ms = time.monotonic(), int(time.time() * 1000)
    await holder.release(term, timeout=5)
    result = await waiting
    elapsed = time.monotonic() - started
    assert isinstance(result, Term) and result.identity == "pod-b"
    # Without the watch the standby would wake at the Lease's expiry, 10 s on: a bound ten times
    # below that proves the wake-up and holds on a loaded machine (the speed is benchmarked, not tested).
    assert elapsed < 1.0, f"handover took {elapsed:.3f}s"
    assert result.token >= now_ms > term.token  # the clock moved on: the token follows it
    spec = lease_json(cluster, namespace)["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("pod-b", 1)


async def test_a_silent_holder_expires_after_the_lease_duration(make_backend: Factory) -> None:
    holder, standby = make_backend(timings=timings_for(1.0)), make_backend(timings=timings_for(1.0))
    losses, lost = record_losses(holder)
    term = await acquired(holder, "pod-a")
    result = await standby.acquire(Identity("pod-b"), timeout=5)
    waited = time.monotonic() - term.written_at
    assert isinstance(result, Term) and result.token > term.token
    assert 1.0 <= waited < 1.6, f"took over after {waited:.3f}s"
    async with asyncio.timeout(2):
        await lost.wait()
    assert "pod-b" in losses[0] and str(result.token) in losses[0]
    assert await holder.renew(term, timeout=5) is None
    await holder.release(term, timeout=5)  # not ours: nothing happens
    assert (await standby.observe(timeout=5)).holder == "pod-b"
    assert await standby.renew(result, timeout=5) is not None


async def test_expiry_counts_from_local_observation_not_renew_time(
    cluster: Cluster, namespace: str, make_backend: Factory
) -> None:
    """A renewTime far in the past does not make a freshly observed Lease expired."""
    holder = make_backend(timings=timings_for(1.0), wall_clock=lambda: time.time() - 3600)
    term = await acquired(holder, "pod-a")
    assert lease_json(cluster, namespace)["spec"]["renewTime"] < micro_time(time.time() - 3000)
    standby = make_backend(timings=timings_for(1.0))
    started = time.monotonic()
    assert isinstance(await standby.acquire(Identity("pod-b"), timeout=0.6), LockRecord)
    result = await standby.acquire(Identity("pod-b"), timeout=5)
    assert isinstance(result, Term) and result.token > term.token
    assert time.monotonic() - started >= 1.0


async def test_loss_callback_when_the_lease_is_deleted(
    cluster: Cluster, namespace: str, make_backend: Factory
) -> None:
    backend = make_backend(timings=timings_for(1.0))
    losses, lost = record_losses(backend)
    term = await acquired(backend, "pod-a")
    await asyncio.sleep(0.2)
    assert losses == []  # our own writes are no loss
    cluster.kubectl("delete", "lease", GROUP, "-n", namespace)
    async with asyncio.timeout(3):
        await lost.wait()
    assert losses == ["the Lease was deleted"]
    assert await backend.renew(term, timeout=5) is None
    again = await acquired(backend, "pod-a")  # once its own term has expired, as for anyone
    assert again.token > term.token  # a re-created Lease restarts from the wall clock, above the old tokens


async def test_concurrent_candidates_get_exactly_one_term(make_backend: Factory) -> None:
    for round_ in range(2):  # first on a missing Lease (POST races), then on a released one (PUT races)
        backends = [make_backend() for _ in range(5)]
        results = await asyncio.gather(
            *(b.acquire(Identity(f"pod-{round_}-{i}"), timeout=5) for i, b in enumerate(backends)))
        terms = [r for r in results if isinstance(r, Term)]
        assert len(terms) == 1, results
        for result in results:
            if isinstance(result, LockRecord):
                assert (result.holder, result.token) == (terms[0].identity, terms[0].token)
        winner = backends[results.index(terms[0])]
        await winner.release(terms[0], timeout=5)


async def test_conflicts_from_a_stale_version_never_raise(
    cluster: Cluster, namespace: str, make_backend: Factory
) -> None:
    backend = make_backend()
    term = await acquired(backend, "pod-a")
    cluster.kubectl("annotate", "lease", GROUP, "-n", namespace, "example.com/touched=yes")
    renewed = await backend.renew(term, timeout=5)  # 409, re-read: still ours, so renewed
    assert renewed is not None and renewed.token == term.token and renewed.version != term.version
    assert lease_json(cluster, namespace)["metadata"]["annotations"]["example.com/touched"] == "yes"
    stale = Term(identity=term.identity, token=term.token, version="1", written_at=0.0)
    again = await backend.renew(stale, timeout=5)
    assert again is not None and again.token == term.token
    impostor = Term(identity=Identity("pod-x"), token=Token(term.token - 1), version=again.version)
    assert await backend.renew(impostor, timeout=5) is None
    await backend.release(impostor, timeout=5)
    assert (await backend.observe(timeout=5)).holder == "pod-a"


async def test_tokens_strictly_increase_over_many_terms(
    cluster: Cluster, namespace: str, make_backend: Factory
) -> None:
    """Three candidates, two with clocks hours behind, the Lease deleted every fourth term:
    every token is above the last one and at least its issuer's clock."""
    offsets = [0.0, -3600.0, -7200.0]
    backends = [make_backend(wall_clock=lambda offset=offset: time.time() + offset) for offset in offsets]
    tokens: list[int] = []
    for i in range(12):
        if i % 4 == 3:
            cluster.kubectl("delete", "lease", GROUP, "-n", namespace)
        floor = int((time.time() + offsets[i % 3]) * 1000)
        term = await acquired(backends[i % 3], f"pod-{i}")
        assert term.token >= floor
        tokens.append(term.token)
        await backends[i % 3].release(term, timeout=5)
    assert tokens == sorted(set(tokens)), tokens
    # after the last deletion, the candidate two hours behind continued from what it had seen
    assert tokens[-1] == tokens[-2] + 1
    assert lease_json(cluster, namespace)["spec"]["leaseTransitions"] == 0  # re-created at i = 11


async def test_a_stale_lease_restarts_from_the_clock(cluster: Cluster, namespace: str, make_backend: Factory) -> None:
    """A Lease left from an earlier lease era (the group ran on postgres since) issues no
    token + 1: the tokens used meanwhile were taken from a clock."""
    cluster.apply(stale_lease(token=5), namespace=namespace)
    backend = make_backend()
    assert (await backend.observe(timeout=5)).token == 5
    before = int(time.time() * 1000)
    term = await acquired(backend, "pod-a")
    assert before <= term.token <= int(time.time() * 1000)
    assert lease_json(cluster, namespace)["metadata"]["annotations"][LEASE_ANNOTATION_TOKEN] == str(term.token)


async def test_a_recreated_lease_stays_above_every_token_seen(
    cluster: Cluster, namespace: str, make_backend: Factory
) -> None:
    """A deleted Lease re-created by a candidate whose clock is an hour behind: its token is
    above the last one, both for the candidate that issued it and one that only watched."""
    offset = [0.0]
    taker = make_backend(wall_clock=lambda: time.time() + offset[0])
    watcher = make_backend(wall_clock=lambda: time.time() - 3600)
    watcher.follow()
    first = await acquired(taker, "pod-a")
    assert first.token >= (time.time() - 60) * 1000  # the real clock
    await taker.release(first, timeout=5)
    cluster.kubectl("delete", "lease", GROUP, "-n", namespace)
    offset[0] = -3600.0
    second = await acquired(taker, "pod-a")
    assert second.token == first.token + 1  # the clock says an hour less: the high-water mark decides
    seen = await watcher.acquire(Identity("pod-b"), timeout=0.3)
    assert isinstance(seen, LockRecord) and (seen.holder, seen.token) == ("pod-a", second.token)
    await taker.release(second, timeout=5)
    cluster.kubectl("delete", "lease", GROUP, "-n", namespace)
    third = await acquired(watcher, "pod-b")
    assert third.token == second.token + 1


async def test_a_fresh_process_counts_the_tokens_on_the_groups_pods(
    cluster: Cluster, namespace: str, kube: CountingClient, make_backend: Factory
) -> None:
    """With the Lease deleted, a new candidate whose clock is an hour behind continues above
    the token on the leader's pod; once no pod carries it, the token goes down (the gap the
    module docstring owns up to)."""
    term = await acquired(make_backend(), "pod-a")
    await create_pod(kube, namespace, "pod-a", group=GROUP, token=str(term.token))  # as the sidecar writes it
    await create_pod(kube, namespace, "pod-b", group=GROUP, token="not-a-number")
    await create_pod(kube, namespace, "other", group="group-b", token=str(term.token + 10**9))
    cluster.kubectl("delete", "lease", GROUP, "-n", namespace)
    kube.requests.clear()
    # pod-a says it leads and nothing here saw the Lease go: the lease duration is waited first.
    started = time.monotonic()
    fresh = await acquired(make_backend(wall_clock=an_hour_behind, timings=timings_for(1.0)), "pod-c")
    assert time.monotonic() - started >= 1.0
    assert fresh.token == term.token + 1  # above pod-a's token; group-b's pod does not count
    pod_lists = [r for r in kube.requests if r[1] == f"/api/v1/namespaces/{namespace}/pods"]
    assert 1 <= len(pod_lists) <= 2  # before the wait, and again before the write
    assert all(r == ("GET", pod_lists[0][1], {"labelSelector": f"singleton.dev/group={GROUP}"}) for r in pod_lists)

    cluster.kubectl("annotate", "pod", "pod-a", "-n", namespace, f"{ANNOTATION_TOKEN}-")  # pod-a stood down
    cluster.kubectl("delete", "lease", GROUP, "-n", namespace)
    started = time.monotonic()
    lower = await acquired(make_backend(wall_clock=an_hour_behind), "pod-d")
    assert time.monotonic() - started < 1.0, "no pod claims the group: a new group's first term is not delayed"
    assert lower.token < term.token


async def test_the_first_term_counts_the_pods_tokens_under_an_existing_lease(
    cluster: Cluster, namespace: str, kube: CountingClient, make_backend: Factory
) -> None:
    """Just switched from postgres, whose clock is ahead: the first term above a stale Lease
    continues above the postgres leader's token on its pod. Later terms list no pods."""
    pg_token = int(time.time() * 1000) + 3_600_000
    await create_pod(kube, namespace, "pg-leader", group=GROUP, token=str(pg_token))
    cluster.apply(stale_lease(token=5), namespace=namespace)
    backend = make_backend()
    term = await acquired(backend, "pod-a")
    assert term.token == pg_token + 1
    await backend.release(term, timeout=5)
    kube.requests.clear()
    again = await acquired(backend, "pod-a")
    assert again.token == term.token + 1
    assert not [r for r in kube.requests if r[1].endswith("/pods")], kube.requests


async def test_pod_tokens_need_the_right_to_list_pods(
    cluster: Cluster, namespace: str, make_backend: Factory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sidecar's RBAC lets it read the pods' tokens; without the right to list pods the
    failure is logged and the token follows the clock."""
    lease_rules = [rule for rule in sidecar_rbac_rules(GROUP) if rule["resources"] == ["leases"]]
    grant(cluster, namespace, "leases-only", lease_rules)
    grant(cluster, namespace, "sidecar", sidecar_rbac_rules(GROUP))
    pod_token = int(time.time() * 1000) + 3_600_000
    async with KubeClient(load_kube_config(str(cluster.kubeconfig))) as admin:
        await create_pod(admin, namespace, "leader", group=GROUP, token=str(pod_token))
    limited = load_kube_config(str(service_account_kubeconfig(cluster, namespace, "leases-only", tmp_path / "l")))
    sidecar = load_kube_config(str(service_account_kubeconfig(cluster, namespace, "sidecar", tmp_path / "s")))
    async with KubeClient(limited) as client:
        backend = make_backend(client=client, timings=timings_for(1.0))  # no pods read: no Lease is waited for
        before = int(time.time() * 1000)
        with caplog.at_level(logging.WARNING, logger="singleton_election.backends.lease"):
            term = await acquired(backend, "pod-a")
            await backend.release(term, timeout=5)
            again = await acquired(backend, "pod-a")  # the Lease exists: no second try
        await backend.close()  # before its client
    assert before <= term.token < again.token < pod_token
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "pods" in r.getMessage()]
    # The read refused, the wait it makes (nothing says no pod leads), the read again before the write.
    assert len(warnings) == 3, [r.getMessage() for r in warnings]
    assert "or the pods could not be read" in warnings[1].getMessage()
    del warnings[1]
    assert all("cannot read the tokens on the group's pods" in w.getMessage() for w in warnings)
    assert "403" in str(warnings[0].__dict__["error"]), warnings[0].__dict__  # the refusal: the error field
    cluster.kubectl("delete", "lease", GROUP, "-n", namespace)
    async with KubeClient(sidecar) as client:
        backend = make_backend(client=client, timings=timings_for(1.0))  # the leader pod's token: waited for
        term = await acquired(backend, "pod-b")
        await backend.close()
    assert term.token == pod_token + 1


async def test_a_standby_watches_instead_of_polling(kube: CountingClient, make_backend: Factory) -> None:
    holder = make_backend(timings=timings_for(30.0))
    standby = make_backend(timings=timings_for(30.0))
    await acquired(holder, "pod-a")
    assert isinstance(await standby.acquire(Identity("pod-b"), timeout=0.5), LockRecord)
    kube.requests.clear()
    watches = kube.watches
    started = time.monotonic()
    while time.monotonic() - started < 2.0:  # an elector's standby loop
        assert isinstance(await standby.acquire(Identity("pod-b"), timeout=0.5), LockRecord)
    assert len(kube.requests) <= 1, kube.requests
    assert kube.watches == watches >= 2  # one watch per backend, still open


async def test_an_unreachable_server_is_backend_unavailable(make_backend: Factory) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with KubeClient(KubeConfig(server=f"https://127.0.0.1:{port}", token="t")) as client:
        backend = make_backend(client=client)
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            await backend.acquire(Identity("pod-a"), timeout=1)
        with pytest.raises(BackendUnavailable):
            await backend.renew(Term(identity=Identity("pod-a"), token=Token(5), version="9"), timeout=1)
        with pytest.raises(BackendUnavailable):
            await backend.observe(timeout=1)
        assert time.monotonic() - started < 3
        await backend.close()


def test_rejects_bad_arguments() -> None:
    client = KubeClient(KubeConfig(server="https://example.invalid"))
    with pytest.raises(ValueError, match="must not be empty"):
        LeaseBackend(client=client, namespace="ns", name="", timings=timings_for(1.0))


class FlakyClient(CountingClient):
    """Its first watches fail with the given errors (410 Gone, a dropped connection)."""

    def __init__(self, config: KubeConfig, failures: list[KubeError]) -> None:
        super().__init__(config)
        self.failures = failures

    def watch(self, path: str, **kwargs: Any) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        if not self.failures:
            return super().watch(path, **kwargs)
        self.watches += 1
        error = self.failures.pop(0)

        async def failing() -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
            raise error
            yield  # an async generator

        return failing()


async def test_the_watch_recovers_from_gone_and_transport_errors(cluster: Cluster, make_backend: Factory) -> None:
    failures: list[KubeError] = [KubeGone(410, "Expired", "too old"), KubeUnavailable(0, "Unreachable", "reset")]
    flaky = FlakyClient(load_kube_config(str(cluster.kubeconfig)), failures)
    async with flaky:
        holder, standby = make_backend(), make_backend(client=flaky)
        term = await acquired(holder, "pod-a")
        waiting = asyncio.create_task(standby.acquire(Identity("pod-b"), timeout=10))
        await asyncio.sleep(0.8)  # two failed watches, a 0.2 s backoff, then a working one
        assert not failures and flaky.watches == 3
        lists = [r for r in flaky.requests if r[2] is not None and "fieldSelector" in r[2]]
        assert len(lists) == 3  # listed again after each failure
        started = time.monotonic()
        await holder.release(term, timeout=5)
        result = await waiting
        assert isinstance(result, Term) and time.monotonic() - started < 0.15
        await standby.close()


async def test_a_restarted_sole_candidate_takes_over_from_its_own_predecessor_at_once(
    make_backend: Factory,
) -> None:
    """The kubelet restarted the sidecar container: the Lease still names its earlier
    incarnation (same pod name and UID, another nonce), which never released. The new
    incarnation, its pod's sole candidate, takes it at once; a candidate of another pod, or
    one not declared sole in its pod, still waits the lease out."""
    prefix = "poller-7d9c-x2x4q/0a1b2c3d/"
    dead = make_backend(timings=timings_for(3.0))
    old = await acquired(dead, prefix + "11111111")
    await dead.close()  # SIGKILL: no release

    other_pod = make_backend(timings=timings_for(3.0), predecessor_prefix="poller-7d9c-zzzzz/99999999/")
    not_sole = make_backend(timings=timings_for(3.0))
    for standby, identity in ((other_pod, "poller-7d9c-zzzzz/99999999/22222222"),
                              (not_sole, prefix + "33333333")):
        assert isinstance(await standby.acquire(Identity(identity), timeout=0.5), LockRecord)

    restarted = make_backend(timings=timings_for(3.0), predecessor_prefix=prefix)
    started = time.monotonic()
    term = await acquired(restarted, prefix + "44444444")
    assert time.monotonic() - started < 1.5  # not the 3 s lease
    assert term.token > old.token and term.acting_from <= time.monotonic()
    assert (await other_pod.observe(timeout=5)).holder == prefix + "44444444"


@pytest.mark.parametrize("clear", ["forced release", "deletion"])
async def test_a_lease_cleared_by_others_is_taken_only_once_its_term_has_expired(
    cluster: Cluster, namespace: str, make_backend: Factory, clear: str
) -> None:
    """``kubectl singleton release`` (the holder cleared, as the operator and the runbook's
    patch do) or ``kubectl delete lease`` say nothing of whether the holder's app stopped: a
    watching standby takes over only when the last renewal it saw would have expired. It
    used to take the Lease at once, while the old leader acted on until it noticed."""
    holder, standby = make_backend(timings=timings_for(2.0)), make_backend(timings=timings_for(2.0))
    term = await acquired(holder, "pod-a")
    standby.follow()
    await asyncio.sleep(0.5)
    renewed = await holder.renew(term, timeout=5)
    assert renewed is not None
    renewed_at = time.monotonic()
    waiting = asyncio.create_task(standby.acquire(Identity("pod-b"), timeout=6))
    await asyncio.sleep(0.3)
    if clear == "deletion":
        cluster.kubectl("delete", "lease", GROUP, "-n", namespace)
    else:
        cluster.kubectl("patch", "lease", GROUP, "-n", namespace, "--type=merge",
                        "-p", '{"spec":{"holderIdentity":null}}')
    result = await waiting
    took_over = time.monotonic() - renewed_at
    assert isinstance(result, Term) and result.token > term.token
    assert took_over >= 2.0, f"taken {took_over:.2f}s after the last renewal, before the term expired"
    assert took_over < 3.0, f"taken {took_over:.2f}s after the last renewal: waited longer than the expiry"


async def test_a_release_by_its_holder_is_marked_and_taken_at_once(
    cluster: Cluster, namespace: str, make_backend: Factory
) -> None:
    holder = make_backend()
    term = await acquired(holder, "pod-a")
    await holder.release(term, timeout=5)
    annotations = lease_json(cluster, namespace)["metadata"]["annotations"]
    assert annotations[LEASE_ANNOTATION_RELEASED] == annotations[LEASE_ANNOTATION_TOKEN] == str(term.token)
    started = time.monotonic()
    fresh = await acquired(make_backend(), "pod-b")  # a process that saw nothing before: after its deference
    assert time.monotonic() - started < NEWCOMER_DEFERENCE + 0.5
    assert LEASE_ANNOTATION_RELEASED not in lease_json(cluster, namespace)["metadata"]["annotations"]
    assert fresh.token > term.token


@pytest.mark.parametrize("newcomer_arrives", ["before the release", "after the release"])
async def test_a_warm_standby_wins_a_released_lease_over_a_newcomer(
    cluster: Cluster, namespace: str, make_backend: Factory, newcomer_arrives: str
) -> None:
    """A pod deletion: the leader releases while a standby has followed the Lease for long
    (its app is up) and the replacement pod's fresh sidecar campaigns too, even first. The
    standby gets the Lease; the newcomer, deferring for NEWCOMER_DEFERENCE after its first
    look, finds it taken. It used to take the Lease at once, with its app not even started."""
    holder, warm, newcomer = make_backend(), make_backend(), make_backend()
    term = await acquired(holder, "pod-a")
    warm.follow()
    await asyncio.sleep(NEWCOMER_DEFERENCE + 0.3)  # the standby is warm
    if newcomer_arrives == "after the release":
        await holder.release(term, timeout=5)
    released_at = time.monotonic()
    late = asyncio.create_task(newcomer.acquire(Identity("pod-c"), timeout=NEWCOMER_DEFERENCE + 1.0))
    await asyncio.sleep(0.1)  # the newcomer's acquire is called first
    early = asyncio.create_task(warm.acquire(Identity("pod-b"), timeout=5))
    if newcomer_arrives == "before the release":
        await asyncio.sleep(0.05)  # both wait on their watches
        assert not late.done() and not early.done()
        released_at = time.monotonic()
        await holder.release(term, timeout=5)
    won = await early
    assert isinstance(won, Term) and won.identity == "pod-b", won
    assert time.monotonic() - released_at < NEWCOMER_DEFERENCE, "the warm standby deferred"
    lost = await late
    assert isinstance(lost, LockRecord), lost
    assert (lost.holder, lost.token) == ("pod-b", won.token)
    spec = lease_json(cluster, namespace)["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("pod-b", 1)


async def test_a_newcomer_alone_takes_a_released_lease_after_its_deference(make_backend: Factory) -> None:
    """Nobody else campaigns: the newcomer takes the released Lease once NEWCOMER_DEFERENCE has
    passed since its first look, not before, and not much later."""
    holder = make_backend()
    term = await acquired(holder, "pod-a")
    await holder.release(term, timeout=5)
    newcomer = make_backend()
    started = time.monotonic()
    early = await newcomer.acquire(Identity("pod-c"), timeout=NEWCOMER_DEFERENCE * 0.6)
    assert isinstance(early, LockRecord), early  # not before the deference
    assert (early.holder, early.token) == (None, term.token)
    taken = await acquired(newcomer, "pod-c")
    took = time.monotonic() - started
    assert NEWCOMER_DEFERENCE <= took < NEWCOMER_DEFERENCE + 0.5, f"took {took:.3f}s"
    assert taken.token > term.token


async def test_a_newcomer_creates_a_new_groups_lease_at_once(make_backend: Factory) -> None:
    """No Lease, no pod of the group: a new group's first leader is not delayed by the deference."""
    started = time.monotonic()
    term = await acquired(make_backend(), "pod-a")
    took = time.monotonic() - started
    assert took < NEWCOMER_DEFERENCE, f"took {took:.3f}s: deferred as if the Lease had been released"
    assert term.identity == "pod-a"


async def test_a_force_release_clears_the_holder_without_the_released_mark(kube: CountingClient, namespace: str,
                                                                          make_backend: Factory) -> None:
    """``kubectl singleton release``'s Lease step, as the operator carries it out."""
    assert await lease_force_release(kube, namespace, GROUP, timeout=5) == "no Lease to release"
    term = await make_backend().acquire(Identity("a"), timeout=5)
    assert isinstance(term, Term)
    assert await lease_force_release(kube, namespace, GROUP, timeout=5) == "cleared Lease holder a"
    lease = await kube.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{GROUP}",
                               timeout=5)
    assert lease["spec"].get("holderIdentity") is None
    assert LEASE_ANNOTATION_RELEASED not in (lease["metadata"].get("annotations") or {})
    assert await lease_force_release(kube, namespace, GROUP, timeout=5) == "the Lease had no holder"
