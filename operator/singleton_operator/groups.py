"""The operator's reconciler: each group's objects applied on spec changes (kopf's handlers
hand it every create, update and resume), an adopted workload checked and given back, an owned
object deleted by someone else put back, the group's database checked (and checked again while
it is unreachable), and what each reconcile left (problems, applied generation, adoption,
database check) kept for the refresher (refresher.py), which writes the status from it.
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
from singleton_operator.listing import GroupKey
from singleton_operator.marks import RefreshMarks
from singleton_operator.metrics import OperatorMetrics
from singleton_operator.model.inject import is_injected
from singleton_operator.model.resources import (
    ANNOTATION_SIDECAR_CONFIG,
    adopted_by,
    sidecar_config_digest,
    uninjected_template,
)
from singleton_operator.model.spec import ConnectionCheck, GroupSpec, SpecError, WorkloadSpecError, read_spec
from singleton_operator.model.status import DatabaseCheck
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
)

log = logging.getLogger(__name__)

RECONCILE_PARALLEL = 48
"""Groups reconciled at once (kopf starts one handler per object). Bounded: with 500 groups
created together and no bound, requests queued in the connection pool past their timeout, and
kopf retried those groups a minute later. Not fewer: each new group's RoleBinding waits up to
about 0.1 s inside the API server (its escalation check reads the namespace's bindings consistently
from the watch cache, which waits for etcd's next progress notice, asked every 100 ms), so 16
at once carried at most about 45 new groups a second on 2 cores with CPU to spare (500 created
at once: the last done after 11.3 s; 8.6 s with 48; 96 was no faster, and interleaved more)."""
RETRY_FIRST = 5.0
RETRY_MAX = 60.0
"""Seconds before work the API server failed (busy or away) is tried again: a reconcile (kopf's
retry) or the repair of a deleted object; doubling with each failure, up to the most."""


def retry_delay(failures: int) -> float:
    """Seconds to wait after ``failures`` (0: the first) failed tries in a row."""
    return min(RETRY_FIRST * (1 << min(failures, 8)), RETRY_MAX)


CALL_TIMEOUT = 10.0
READOPT_INTERVAL = 30.0
"""Seconds between two reconciles of a group that a refresh asks for because its adopted workload
changed under it (``Reconciler.readopt``): a reconcile marks the group for a refresh, so one that
keeps failing would otherwise loop."""

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


@dataclass(frozen=True)
class FirstApplied:
    """What a new template group's first reconcile leaves for its first status: the group as that
    reconcile read it (no status yet: nothing else writes one before that refresh) and its
    Deployment as the apply answered. Two reads of each new group fewer: in a burst of new groups
    the API server's CPU is what every group waits for."""

    body: dict[str, Any]
    deployment: dict[str, Any]


@dataclass
class Reconciler:
    """Reconciles groups, at most ``RECONCILE_PARALLEL`` at once, and keeps what each reconcile
    left for the refresher (which reads it through the methods below)."""

    client: KubeClient
    sidecar_image: str
    metrics: OperatorMetrics
    marks: RefreshMarks
    """Where a group whose reconcile ended is marked for a refresh (shared with the refresher)."""
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
    """When a refresh last had each group reconciled again (``readopt``)."""
    _in_reconcile: set[GroupKey] = field(default_factory=set)
    """Groups whose reconcile runs now (their refresh waits: refresher.RECONCILE_DEFER)."""
    _unreported: set[GroupKey] = field(default_factory=set)
    """Groups with no status yet whose first reconcile waits for its turn or runs. Not refreshed
    until it ends (which marks them): a refresh would read the group to write nothing
    (``Refresher.refresh``). In a burst of 500 new groups, that was a wasted read for about a third of
    them: a reconcile outlasted ``RECONCILE_DEFER``, and pod events came while groups waited."""
    _uids: dict[GroupKey, str] = field(default_factory=dict)
    """The UID of the object each group's bookkeeping belongs to (its last reconcile's)."""
    _attempted: set[GroupKey] = field(default_factory=set)
    """Groups whose reconcile this process has run (to its end, well or not)."""
    _first_applied: dict[GroupKey, FirstApplied] = field(default_factory=dict)
    """New template groups whose first reconcile applied them, until their first refresh takes
    what it left (``take_first_applied``)."""

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
        unreported = not body.get("status") and not self.has_reconciled(body)
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
            applied = await reconcile(self.client, spec, self.access, new=new)
        except SpecError as exc:
            if self.kept_for(body):
                self.problems[key] = ReconcileProblem("InvalidSpec", str(exc))
            self.metrics.reconcile_failed(*key, "InvalidSpec")
            raise
        except ReconcileProblem as exc:
            if self.kept_for(body):
                self.problems[key] = exc
                if exc.database is not None:
                    self.database[key] = exc.database
            self.metrics.reconcile_failed(*key, exc.reason)
            log.warning("reconcile failed: %s", exc.message,
                        extra={"namespace": key[0], "group": key[1], "reason": exc.reason})
            raise
        finally:
            # An older object's reconcile ending after a newer one's began leaves its bookkeeping.
            if self.kept_for(body):
                self._in_reconcile.discard(key)
                self._attempted.add(key)
            self.marks.mark(*key)
        if not self.kept_for(body):
            return
        self.problems.pop(key, None)
        self.applied[key] = spec.generation
        if workload is not None:
            self.adopted[key] = wanted_adoption(spec)
        if new and applied.workload is not None and not body.get("status"):
            self._first_applied[key] = FirstApplied(body, applied.workload)
        self._database_checked(key, spec, applied.database)

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
                self.marks.mark(*key)
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
        self._first_applied.pop(key, None)  # its body is older than this reconcile's

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
        self._attempted.discard((namespace, name))
        self._unreported.discard((namespace, name))
        self._first_applied.pop((namespace, name), None)
        self.marks.forget((namespace, name))
        self.metrics.forget(namespace, name)

    def kept_for(self, body: dict[str, Any]) -> bool:
        """Whether what is kept under the group's name (applied, problems) is this object's."""
        return self._uids.get((body["metadata"]["namespace"], body["metadata"]["name"])) == _uid(body)

    def has_reconciled(self, body: dict[str, Any]) -> bool:
        """Whether this process has run this very object's reconcile (to its end, well or not)."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        return key in self._attempted and self.kept_for(body)

    def take_first_applied(self, key: GroupKey) -> FirstApplied | None:
        """What the group's first reconcile left for its first status, once (None: read it live)."""
        first = self._first_applied.pop(key, None)
        return first if first is not None and self.kept_for(first.body) else None

    def reconciling(self, key: GroupKey) -> bool:
        """Whether the group's reconcile runs now."""
        return key in self._in_reconcile

    def awaiting_first_reconcile(self, key: GroupKey) -> bool:
        """Whether the group has no status yet and its first reconcile waits for its turn or runs."""
        return key in self._unreported

    def uid_of(self, key: GroupKey) -> str | None:
        """The UID of the object the group's bookkeeping belongs to, if any."""
        return self._uids.get(key)

    def adoption_changed(self, key: GroupKey, workload: dict[str, Any]) -> bool:
        """Whether the adopted workload no longer carries what the group's last reconcile left on it."""
        return adoption_state(workload) != self.adopted.get(key)

    async def readopt(self, body: dict[str, Any], workload: dict[str, Any]) -> None:
        """Reconcile again a group whose adopted workload changed under it, at most once per
        ``READOPT_INTERVAL``: re-created without the label (helm uninstall and install, an
        orphaning delete), another account, or this operator has not applied it yet. Applied
        again, so new pods keep getting the sidecar."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if not self.adoption_changed(key, workload):
            return
        if time.monotonic() - self._readopted.get(key, -READOPT_INTERVAL) < READOPT_INTERVAL:
            return
        self._readopted[key] = time.monotonic()
        with contextlib.suppress(SpecError, ReconcileProblem):  # kept in self.problems: the status says it
            await self.reconcile(body)
