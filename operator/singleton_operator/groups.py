"""The operator's work per group, shared by the kopf handlers: reconcile on spec changes,
refresh the status whenever a pod or the Deployment of the group changes.

Status refreshes are coalesced per group (many pod events in a burst cost one refresh),
and run within ``REFRESH_DELAY`` of the event, well inside the 1 s the status promises.
Every ``PERIODIC_REFRESH`` a pass over all groups, from one listing per kind, catches what
an event missed: at rest the operator's requests do not grow with the number of groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from singleton_election.kube import KubeClient, KubeError, KubeNotFound
from singleton_operator.listing import GroupKey, GroupReads, Listing, LiveReads, scopes
from singleton_operator.metrics import OperatorMetrics
from singleton_operator.model.inject import is_injected
from singleton_operator.model.resources import (
    ANNOTATION_SIDECAR_CONFIG,
    adopted_by,
    sidecar_config_digest,
    uninjected_template,
)
from singleton_operator.model.spec import ConnectionCheck, GroupSpec, SpecError, WorkloadSpecError, read_spec
from singleton_operator.model.status import DatabaseCheck, find_leader, labelled_leaders
from singleton_operator.reconcile import (
    AccessReviews,
    ReconcileProblem,
    check_adoptable,
    check_not_a_group,
    check_postgres,
    cr_path,
    read_workload,
    reconcile,
    release,
    write_spec_error,
    write_status,
)

log = logging.getLogger(__name__)

REFRESH_DELAY = 0.05
RECONCILE_PARALLEL = 48
"""Groups reconciled at once (kopf starts one handler per object). Bounded: with 500 groups
created together and no bound, requests queued in the connection pool past their timeout, and
kopf retried those groups a minute later. Not fewer: each new group's RoleBinding waits up to
about 0.1 s inside the API server (its escalation check reads the namespace's bindings consistently
from the watch cache, which waits for etcd's next progress notice, asked every 100 ms), so 16
at once carried at most about 45 new groups a second on 2 cores with CPU to spare (500 created
at once: the last done after 11.3 s; 8.6 s with 48; 96 was no faster, and interleaved more)."""
RECONCILE_DEFER = 1.0
"""Seconds a refresh of a group waits for the reconcile in flight for it, which marks the group
again when it ends: refreshed in between, the status says the generation is not applied yet,
and is written again a moment later. Bounded, so that a slow reconcile does not hold back a
leader change in the status."""
RETRY_FIRST = 5.0
RETRY_MAX = 60.0
"""Seconds before work the API server failed (busy or away) is tried again: a reconcile (kopf's
retry) or the repair of a deleted object; doubling with each failure, up to the most."""


def retry_delay(failures: int) -> float:
    """Seconds to wait after ``failures`` (0: the first) failed tries in a row."""
    return min(RETRY_FIRST * (1 << min(failures, 8)), RETRY_MAX)
REFRESH_PARALLEL = 16
"""Groups refreshed at once: a burst (hundreds of groups created together) is not served one
group after another, nor with so many requests in flight that each waits on the others."""
PERIODIC_REFRESH = 30.0
CALL_TIMEOUT = 10.0

AdoptionState = tuple[str | None, str | None, str]
"""What an adopted workload's template carries for its group: the group label, the settings'
digest, and the service account its pods run as (the RoleBinding's subject)."""


def _uid(body: dict[str, Any]) -> str:
    return str(body["metadata"].get("uid", ""))


def adoption_state(workload: dict[str, Any]) -> AdoptionState:
    template = (workload.get("spec") or {}).get("template") or {}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    account = (template.get("spec") or {}).get("serviceAccountName") or "default"
    return adopted_by(workload), annotations.get(ANNOTATION_SIDECAR_CONFIG), account


def wanted_adoption(spec: GroupSpec) -> AdoptionState:
    account = (spec.template.get("spec") or {}).get("serviceAccountName") or "default"
    return spec.name, sidecar_config_digest(spec), account


@dataclass
class Groups:
    client: KubeClient
    sidecar_image: str
    metrics: OperatorMetrics
    sidecar_pull_policy: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    webhook_serving: bool = False
    """Whether this operator serves the pod webhook (adopted pods get their sidecar from it)."""
    operator_namespace: str | None = None
    postgres_connection_check: ConnectionCheck = "block"
    """--postgres-connection-check: for groups that do not set spec.postgres.connectionCheck."""
    problems: dict[GroupKey, ReconcileProblem] = field(default_factory=dict)
    adopted: dict[GroupKey, AdoptionState] = field(default_factory=dict)
    """Per adopting group, what its last reconcile left on the workload (``adoption_state``)."""
    applied: dict[GroupKey, int] = field(default_factory=dict)
    """The newest generation of each group whose objects were all applied (for observedGeneration)."""
    database: dict[GroupKey, DatabaseCheck] = field(default_factory=dict)
    """The last database check of each group with a database (its DatabaseReachable condition)."""
    _rechecks: dict[GroupKey, asyncio.Task[None]] = field(default_factory=dict)
    """Database checks tried again for groups applied with their database unreachable (warn)."""
    _readopted: dict[GroupKey, float] = field(default_factory=dict)
    _dirty: dict[GroupKey, None] = field(default_factory=dict)
    """The groups marked for a refresh, in the order they were first marked (served in it:
    in a burst, the groups created first get their status first)."""
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _refreshing: asyncio.Lock = field(default_factory=asyncio.Lock)
    _forgotten: set[GroupKey] = field(default_factory=set)
    """Groups deleted since the periodic pass began (its listing may still show them)."""
    _in_reconcile: set[GroupKey] = field(default_factory=set)
    """Groups whose reconcile runs now (their refresh waits: ``RECONCILE_DEFER``)."""
    _unreported: set[GroupKey] = field(default_factory=set)
    """Groups with no status yet whose first reconcile waits for its turn or runs. Not refreshed
    until it ends (which marks them): a refresh would read the group to write nothing
    (``refresh``). In a burst of 500 new groups, that was a wasted read for about a third of
    them: a reconcile outlasted ``RECONCILE_DEFER``, and pod events came while groups waited."""
    _uids: dict[GroupKey, str] = field(default_factory=dict)
    """The UID of the object each group's bookkeeping belongs to (its last reconcile's)."""
    _attempted: set[GroupKey] = field(default_factory=set)
    """Groups whose reconcile this process has run (to its end, well or not)."""
    _deferred_since: dict[GroupKey, float] = field(default_factory=dict)
    """When the refresh of a group in a reconcile was first put off."""

    def __post_init__(self) -> None:
        self.access = AccessReviews(self.client)
        self._reconciling = asyncio.Semaphore(RECONCILE_PARALLEL)

    def spec_of(self, body: dict[str, Any], workload: dict[str, Any] | None = None) -> GroupSpec:
        """The group's spec; ``workload`` is the adopted workload (``read_workload``), if any,
        read without what an earlier injection added to it."""
        if workload is not None:
            check_not_a_group(body, workload)
            template = (workload.get("spec") or {}).get("template") or {}
            workload = {**workload, "spec": {**(workload.get("spec") or {}),
                                             "template": uninjected_template(template)}}
        spec = read_spec(body, default_sidecar_image=self.sidecar_image, workload=workload,
                         default_connection_check=self.postgres_connection_check)
        return dataclasses.replace(spec, sidecar_pull_policy=self.sidecar_pull_policy,
                                   image_pull_secrets=self.image_pull_secrets)

    async def reconcile(self, body: dict[str, Any], *, new: bool = False) -> None:
        """Apply the group's objects; remember (and raise) a problem the user must fix.
        ``new``: its first reconcile since it was created (``reconcile.reconcile``)."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        # From before its turn: in a burst, most new groups wait for one.
        unreported = not body.get("status") and not (key in self._attempted and self._kept_for(body))
        if unreported:
            self._unreported.add(key)
        try:
            async with self._reconciling:
                await self._reconcile(body, new=new)
        finally:
            if unreported:
                self._unreported.discard(key)

    async def _reconcile(self, body: dict[str, Any], *, new: bool) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        self.metrics.reconciles.inc()
        self._begin(key, body)
        try:
            try:
                workload = await read_workload(self.client, body)
                spec = self.spec_of(body, workload)
            except WorkloadSpecError as exc:
                # The workload's owner may fix it without touching the group: retried.
                raise ReconcileProblem("InvalidWorkload", str(exc)) from None
            if workload is not None:
                await self._check_adoption(spec, workload)
            database = await reconcile(self.client, spec, self.access, new=new)
        except SpecError as exc:
            if self._kept_for(body):
                self.problems[key] = ReconcileProblem("InvalidSpec", str(exc))
            self.metrics.reconcile_failed(*key, "InvalidSpec")
            raise
        except ReconcileProblem as exc:
            if self._kept_for(body):
                self.problems[key] = exc
                if exc.database is not None:
                    self.database[key] = exc.database
            self.metrics.reconcile_failed(*key, exc.reason)
            log.warning("reconcile failed: %s", exc.message,
                        extra={"namespace": key[0], "group": key[1], "reason": exc.reason})
            raise
        finally:
            # An older object's reconcile ending after a newer one's began leaves its bookkeeping.
            if self._kept_for(body):
                self._in_reconcile.discard(key)
                self._attempted.add(key)
            self.mark(*key)
        if not self._kept_for(body):
            return
        self.problems.pop(key, None)
        self.applied[key] = spec.generation
        if workload is not None:
            self.adopted[key] = wanted_adoption(spec)
        self._database_checked(key, spec, database)

    def _database_checked(self, key: GroupKey, spec: GroupSpec, database: DatabaseCheck | None) -> None:
        """Keep the database check of a reconcile that applied the group."""
        if database is None:
            self.database.pop(key, None)
            return
        self.database[key] = database
        if database.reachable is False:  # applied all the same: connectionCheck warn
            self._rechecks[key] = asyncio.create_task(self._recheck(key, spec), name=f"recheck-{key[0]}/{key[1]}")

    async def _recheck(self, key: GroupKey, spec: GroupSpec) -> None:
        """Try the database check of a group applied without it again, backing off, until it
        passes: nothing else would turn its condition True (no reconcile follows one that
        succeeded). Ended by the group's next reconcile or its deletion."""
        failures = 0
        while True:
            await asyncio.sleep(retry_delay(failures))
            failures += 1
            database: DatabaseCheck | None
            try:
                database = await check_postgres(self.client, spec)
            except ReconcileProblem as exc:  # the Secret's problem, said by the condition
                database = exc.database
            except KubeError as exc:
                log.warning("database check failed; retrying",
                            extra={"namespace": key[0], "group": key[1], "error": exc})
                continue
            if database is not None:
                self.database[key] = database
                self.mark(*key)
            if database is not None and database.reachable:
                self._rechecks.pop(key, None)
                return

    def _stop_recheck(self, key: GroupKey) -> None:
        task = self._rechecks.pop(key, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        """Stop the work of this term: the database checks tried again, the access reviews."""
        rechecks = list(self._rechecks.values())
        self._rechecks.clear()
        for task in rechecks:
            task.cancel()
        await asyncio.gather(*rechecks, return_exceptions=True)
        await self.access.close()

    def _begin(self, key: GroupKey, body: dict[str, Any]) -> None:
        """The bookkeeping of a reconcile that starts."""
        uid = _uid(body)
        self._stop_recheck(key)  # this reconcile checks again
        if self._uids.get(key, uid) != uid:
            # Deleted and made again under its name, before kopf handled the old object's
            # DELETED event: what is kept under the name is the old object's.
            for kept in (self.applied, self.problems, self.adopted, self.database):
                kept.pop(key, None)
            self._attempted.discard(key)
        self._uids[key] = uid
        self._in_reconcile.add(key)

    async def _check_adoption(self, spec: GroupSpec, workload: dict[str, Any]) -> None:
        """Refuse an adoption whose pods would get no sidecar, or that another group holds."""
        assert spec.workload_ref is not None
        where = spec.workload_ref.describe(spec.namespace)
        template = (workload.get("spec") or {}).get("template") or {}
        if not is_injected(template.get("spec") or {}):
            if spec.namespace == self.operator_namespace:
                raise ReconcileProblem("OperatorNamespace", f"spec.workloadRef: {where} is in the operator's own "
                                       "namespace, which its webhook never sees (so that the operator's pods never "
                                       "wait for it); adopt workloads of other namespaces, or inject it with "
                                       "singletonctl inject")
            if not self.webhook_serving:
                raise ReconcileProblem("NoWebhook", f"spec.workloadRef: this operator serves no pod webhook "
                                       f"(--webhook-listen), so the pods of {where} would run without the sidecar; "
                                       "enable the webhook (the chart's webhook.enabled) or inject the workload with "
                                       "singletonctl inject")
        await check_adoptable(self.client, spec, workload)

    async def release(self, body: dict[str, Any]) -> None:
        """The group is being deleted: give its adopted workload back."""
        await release(self.client, body)

    async def repair(self, namespace: str, name: str) -> None:
        """Re-apply a group whose owned object vanished (if the group still exists). An API
        server busy or away is tried again, backing off, until the group is repaired or gone:
        kopf retries no event handler, and nothing else would bring the object back."""
        failures = 0
        while True:
            try:
                await self._repair_once(namespace, name)
                return
            except KubeError as exc:
                delay = retry_delay(failures)
                log.warning("re-applying a group whose object was deleted failed; retrying",
                            extra={"namespace": namespace, "group": name, "error": exc, "retry_seconds": delay})
            await asyncio.sleep(delay)
            failures += 1

    async def _repair_once(self, namespace: str, name: str) -> None:
        try:
            body = await self.client.request("GET", cr_path(namespace, name), timeout=CALL_TIMEOUT)
        except KubeNotFound:
            return
        if body["metadata"].get("deletionTimestamp"):
            return
        with contextlib.suppress(SpecError, ReconcileProblem):  # kept in self.problems: the status says it
            await self.reconcile(body)

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        """Drop what is kept for the group. ``uid``: only if it is still that object's (a group
        deleted and made again under its name may be reconciled before kopf's worker of the old
        object handles its DELETED event)."""
        if uid is not None and self._uids.get((namespace, name), uid) != uid:
            return
        self._uids.pop((namespace, name), None)
        self.problems.pop((namespace, name), None)
        self.adopted.pop((namespace, name), None)
        self._readopted.pop((namespace, name), None)
        self.applied.pop((namespace, name), None)
        self.database.pop((namespace, name), None)
        self._stop_recheck((namespace, name))
        self._dirty.pop((namespace, name), None)
        self._deferred_since.pop((namespace, name), None)
        self._attempted.discard((namespace, name))
        self._unreported.discard((namespace, name))
        self._forgotten.add((namespace, name))
        self.metrics.forget(namespace, name)

    def _kept_for(self, body: dict[str, Any]) -> bool:
        """Whether what is kept under the group's name (applied, problems) is this object's."""
        return self._uids.get((body["metadata"]["namespace"], body["metadata"]["name"])) == _uid(body)

    def marked(self) -> frozenset[GroupKey]:
        """The groups the refresher refreshes next."""
        return frozenset(self._dirty)

    def mark(self, namespace: str, name: str) -> None:
        """Refresh this group's status soon."""
        self._dirty.setdefault((namespace, name))
        self._wake.set()

    async def run_refresher(self) -> None:
        """Refresh the groups marked since the last round, up to ``REFRESH_PARALLEL`` at once."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(REFRESH_DELAY)
            self._wake.clear()
            async with self._refreshing:
                dirty = self._due()
                gate = asyncio.Semaphore(REFRESH_PARALLEL)
                failed = await asyncio.gather(*(self._refresh_marked(key, gate) for key in dirty))
            if any(failed):
                await asyncio.sleep(1.0)

    def _due(self) -> list[GroupKey]:
        """The marked groups to refresh now; those in a reconcile stay marked (and the
        refresher awake) for up to ``RECONCILE_DEFER``; those of ``_unreported`` not at all."""
        now, due, unborn = time.monotonic(), [], []
        for key in self._dirty:
            if key in self._unreported:
                unborn.append(key)
                self._deferred_since.pop(key, None)
                continue
            if key in self._in_reconcile and now - self._deferred_since.setdefault(key, now) < RECONCILE_DEFER:
                continue
            self._deferred_since.pop(key, None)
            due.append(key)
        for key in due + unborn:
            del self._dirty[key]
        if self._dirty:
            self._wake.set()
        return due

    async def _refresh_marked(self, key: GroupKey, gate: asyncio.Semaphore) -> bool:
        """Refresh one group; a failed one is marked again. Returns whether it failed."""
        async with gate:
            try:
                await self.refresh(*key)
                return False
            except KubeError as exc:
                log.warning("status refresh failed; retrying",
                            extra={"namespace": key[0], "group": key[1], "error": exc})
            except Exception:  # a bug must not end the refresher for the rest of the term
                log.exception("status refresh failed unexpectedly; retrying",
                              extra={"namespace": key[0], "group": key[1]})
            self.mark(*key)
            return True

    async def run_periodic(self, namespaces: tuple[str, ...], interval: float = PERIODIC_REFRESH) -> None:
        """Refresh every group now and then, as a safety net for missed events, from one
        listing per kind and scope (see listing.py), never one request per group."""
        while True:
            await asyncio.sleep(interval)
            for scope in scopes(namespaces):
                try:
                    await self.refresh_scope(scope)
                except KubeError as exc:
                    log.warning("periodic refresh: listing failed", extra={"namespace": scope, "error": exc})

    async def refresh_scope(self, namespace: str | None) -> None:
        """Every group of ``namespace`` (None: of the cluster) from one listing. Not beside the
        event-driven refresher: a listing older than a refresh it raced would write an older
        status back. A group marked since the listing is left to that refresher."""
        async with self._refreshing:
            self._forgotten.clear()
            try:
                listing = await Listing.read(self.client, namespace)
            except KubeError:
                # The safety net must not lapse while listing fails: the groups this operator
                # knows are refreshed one by one instead.
                for key in {*self.applied, *self.problems}:
                    if namespace is None or key[0] == namespace:
                        self.mark(*key)
                raise
            for body in listing.bodies:
                key = (body["metadata"]["namespace"], body["metadata"]["name"])
                if key in self._dirty or key in self._forgotten:
                    continue
                try:
                    await self._refresh(body, listing, live=False)
                except KubeError as exc:
                    log.warning("periodic refresh failed; retrying",
                                extra={"namespace": key[0], "group": key[1], "error": exc})
                    self.mark(*key)
                except Exception:  # a bug must not end the safety net for the rest of the term
                    log.exception("periodic refresh failed unexpectedly; retrying",
                                  extra={"namespace": key[0], "group": key[1]})
                    self.mark(*key)

    async def refresh(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        known = self._uids.get(key)
        try:
            body = await self.client.request("GET", cr_path(namespace, name), timeout=CALL_TIMEOUT)
        except KubeNotFound:
            # Unless a reconcile of the name began meanwhile: the 404 may be older than its
            # create, and forgetting would drop that reconcile's bookkeeping (no status then).
            if key not in self._in_reconcile and key not in self._unreported and self._uids.get(key) == known:
                self.forget(namespace, name)
            return
        if not body.get("status") and not ((namespace, name) in self._attempted and self._kept_for(body)):
            return  # a new group before the end of its first reconcile, which marks it again
        await self._refresh(body, LiveReads(self.client), live=True)

    async def _refresh(self, body: dict[str, Any], reads: GroupReads, *, live: bool) -> None:
        """Write the group's status from ``reads``. ``live``: the body was read just now; a
        listing's may be seconds old (the group since edited or deleted), so that path never
        reconciles: it leaves the group to the live refresher."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        if body["metadata"].get("deletionTimestamp"):
            return
        try:
            workload = await reads.workload(body)
            spec = self.spec_of(body, workload)
        except (SpecError, ReconcileProblem) as exc:
            # Admission refuses such specs; one an older CRD let through is reported as Stalled,
            # as is an adopted workload that is missing or that the group's rules refuse.
            reason = (exc.reason if isinstance(exc, ReconcileProblem)
                      else "InvalidWorkload" if isinstance(exc, WorkloadSpecError) else "InvalidSpec")
            if await write_spec_error(self.client, body, str(exc), reason):
                self.metrics.status_updates.inc()
            return
        key = (namespace, name)
        if not live and workload is not None and adoption_state(workload) != self.adopted.get(key):
            self.mark(*key)
            return
        if (workload is not None and adoption_state(workload) != self.adopted.get(key)
                and time.monotonic() - self._readopted.get(key, -PERIODIC_REFRESH) >= PERIODIC_REFRESH):
            # At most once per PERIODIC_REFRESH: a reconcile marks the group for a refresh, so
            # one that keeps failing would otherwise loop.
            self._readopted[key] = time.monotonic()
            # The workload changed under the group: re-created without the label (helm
            # uninstall and install, an orphaning delete), another account, or this operator
            # has not applied it yet. Applied again, so new pods keep getting the sidecar.
            with contextlib.suppress(SpecError, ReconcileProblem):  # kept in self.problems: the status says it
                await self.reconcile(body)
        # What was kept for this very object: one deleted and made again under its name, before
        # kopf handled the old one's DELETED event, has had nothing applied and no problem yet.
        kept = self._kept_for(body)
        observed = await reads.observed(spec, self.problems.get(key) if kept else None,
                                        self.applied.get(key) if kept else None)
        observed = dataclasses.replace(observed, database=self.database.get(key) if kept else None)
        leader_changes = self.metrics.leader_changes.labels(namespace, name)  # exported from 0 on
        if spec.replicas > 0:
            self.metrics.group_leaders.labels(namespace, name).set(labelled_leaders(observed.pods))
        else:  # scaled to zero: no leader is what was asked for, not an alert
            self.metrics.group_leaders.remove(namespace, name)
        if await write_status(self.client, spec, body.get("status") or {}, observed):
            self.metrics.status_updates.inc()
            # The same rule as write_status's LeaderChanged Event.
            leader = find_leader(observed.pods)
            if leader is not None and leader.pod != (body.get("status") or {}).get("leader"):
                leader_changes.inc()
