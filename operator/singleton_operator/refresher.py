"""The status refresher: each group's status written from what its pods and workload say,
whenever a pod or the Deployment of the group changes (the kopf handlers and the reconciler
mark it: marks.py), and by a periodic pass over every group.

Status refreshes are coalesced per group (many pod events in a burst cost one refresh),
and start within ``REFRESH_DELAY`` of the event, well inside the 1 s the status promises:
each as soon as one of ``REFRESH_PARALLEL`` turns is free, not in rounds that wait for their
slowest refresh.
Every ``PERIODIC_REFRESH`` a pass over all groups, from one listing per kind, catches what
an event missed: at rest the operator's requests do not grow with the number of groups.
What the reconciler kept for each group (problems, applied generation, database check) goes
into its status; the refresher writes nothing the reconciler reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from singleton_election import contract
from singleton_election.kube import KubeClient, KubeConflict, KubeError, KubeInvalid, KubeNotFound
from singleton_operator.groups import CALL_TIMEOUT, Reconciler
from singleton_operator.listing import AppliedReads, GroupKey, GroupReads, Listing, LiveReads, scopes
from singleton_operator.marks import RefreshMarks
from singleton_operator.metrics import OperatorMetrics
from singleton_operator.model.spec import SpecError, WorkloadSpecError
from singleton_operator.model.status import deposed_leaders, find_leader, labelled_leaders
from singleton_operator.reconcile import ReconcileProblem, cr_path, write_spec_error, write_status

log = logging.getLogger(__name__)

REFRESH_DELAY = 0.05
REFRESH_PARALLEL = 16
"""Groups refreshed at once: a burst (hundreds of groups created together) is not served one
group after another, nor with so many requests in flight that each waits on the others."""
RETRY_AFTER = 1.0
"""Seconds before a group whose refresh failed is refreshed again (the API server busy or away)."""
PERIODIC_REFRESH = 30.0
RECONCILE_DEFER = 1.0
"""Seconds a refresh of a group waits for the reconcile in flight for it, which marks the group
again when it ends: refreshed in between, the status says the generation is not applied yet,
and is written again a moment later. Bounded, so that a slow reconcile does not hold back a
leader change in the status."""


@dataclass
class Refresher:
    """Writes the status of the groups ``marks`` holds, up to ``REFRESH_PARALLEL`` at once, and
    of every group now and then; from what ``reconciler`` kept for each."""

    client: KubeClient
    metrics: OperatorMetrics
    reconciler: Reconciler
    marks: RefreshMarks
    """Shared with the reconciler and the kopf handlers, which mark groups in it."""
    _refreshing: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a periodic pass, and by the event-driven refresher while it starts refreshes:
    a pass waits for those in flight to end, so the two never write at once."""
    _in_flight: dict[GroupKey, asyncio.Task[None]] = field(default_factory=dict)
    """The event-driven refreshes started and not ended (waiting for a turn, or running)."""
    _turns: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(REFRESH_PARALLEL))

    async def run_refresher(self) -> None:
        """Refresh each marked group, up to ``REFRESH_PARALLEL`` at once; a group marked again
        while its refresh runs is refreshed again after it."""
        try:
            while True:
                await self.marks.wake.wait()
                await asyncio.sleep(REFRESH_DELAY)
                self.marks.wake.clear()
                async with self._refreshing:
                    for key in self._due():
                        task = self._in_flight[key] = asyncio.create_task(self._refresh_marked(key),
                                                                          name=f"refresh-{key[0]}/{key[1]}")
                        # A callback, not the coroutine's finally: a task cancelled before it
                        # started never runs its coroutine.
                        task.add_done_callback(functools.partial(self._ended, key))
        finally:
            in_flight = list(self._in_flight.values())
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    def _ended(self, key: GroupKey, _task: asyncio.Task[None]) -> None:
        del self._in_flight[key]
        if key in self.marks.pending:
            self.marks.wake.set()  # marked again while in flight

    async def _drained(self) -> None:
        """Wait until no event-driven refresh is in flight (with ``_refreshing`` held: none starts)."""
        while self._in_flight:
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)

    def _due(self) -> list[GroupKey]:
        """The marked groups to refresh now; those in a reconcile stay marked (and the
        refresher awake) for up to ``RECONCILE_DEFER``; those awaiting their first reconcile not
        at all (its end marks them again); those whose refresh is in flight stay marked until
        it ends (which wakes the refresher)."""
        marks, reconciler = self.marks, self.reconciler
        now, due, unborn = time.monotonic(), [], []
        for key in marks.pending:
            if key in self._in_flight:
                continue
            if reconciler.awaiting_first_reconcile(key):
                unborn.append(key)
                marks.deferred_since.pop(key, None)
                continue
            if reconciler.reconciling(key) and now - marks.deferred_since.setdefault(key, now) < RECONCILE_DEFER:
                continue
            marks.deferred_since.pop(key, None)
            due.append(key)
        for key in due + unborn:
            del marks.pending[key]
        if any(key not in self._in_flight for key in marks.pending):
            marks.wake.set()
        return due

    async def _refresh_marked(self, key: GroupKey) -> None:
        """Refresh one group when its turn comes; a failed one is marked again after
        ``RETRY_AFTER`` (in flight until then: not refreshed again meanwhile)."""
        async with self._turns:
            try:
                await self.refresh(*key)
                return
            except KubeError as exc:
                log.warning("status refresh failed; retrying",
                            extra={"namespace": key[0], "group": key[1], "error": exc})
            except Exception:  # a bug must not end the refresher for the rest of the term
                log.exception("status refresh failed unexpectedly; retrying",
                              extra={"namespace": key[0], "group": key[1]})
        await asyncio.sleep(RETRY_AFTER)
        self.marks.mark(*key)

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
            await self._drained()
            self.marks.forgotten.clear()
            try:
                listing = await Listing.read(self.client, namespace)
            except KubeError:
                # The safety net must not lapse while listing fails: the groups this operator
                # knows are refreshed one by one instead.
                for key in {*self.reconciler.applied, *self.reconciler.problems}:
                    if namespace is None or key[0] == namespace:
                        self.marks.mark(*key)
                raise
            for body in listing.bodies:
                key = (body["metadata"]["namespace"], body["metadata"]["name"])
                if key in self.marks.pending or key in self.marks.forgotten:
                    continue
                try:
                    await self._refresh(body, listing, live=False)
                except KubeError as exc:
                    log.warning("periodic refresh failed; retrying",
                                extra={"namespace": key[0], "group": key[1], "error": exc})
                    self.marks.mark(*key)
                except Exception:  # a bug must not end the safety net for the rest of the term
                    log.exception("periodic refresh failed unexpectedly; retrying",
                                  extra={"namespace": key[0], "group": key[1]})
                    self.marks.mark(*key)

    async def refresh(self, namespace: str, name: str) -> None:
        """Write the group's status from what its objects say now."""
        key = (namespace, name)
        reconciler = self.reconciler
        first = reconciler.take_first_applied(key)
        if first is not None:
            try:
                await self._refresh(first.body, AppliedReads(self.client, first.deployment), live=True,
                                    same_object=True)
                return
            except (KubeInvalid, KubeNotFound):
                pass  # deleted (and made again under its name?) since: read it as any refresh does
        known = reconciler.uid_of(key)
        try:
            body = await self.client.request("GET", cr_path(namespace, name), timeout=CALL_TIMEOUT)
        except KubeNotFound:
            # Unless a reconcile of the name began meanwhile: the 404 may be older than its
            # create, and forgetting would drop that reconcile's bookkeeping (no status then).
            if (not reconciler.reconciling(key) and not reconciler.awaiting_first_reconcile(key)
                    and reconciler.uid_of(key) == known):
                reconciler.forget(namespace, name)
            return
        if not body.get("status") and not reconciler.has_reconciled(body):
            return  # a new group before the end of its first reconcile, which marks it again
        await self._refresh(body, LiveReads(self.client), live=True)

    async def _relabel_deposed(self, namespace: str, group: str, pods: list[dict[str, Any]]) -> None:
        """Take the leader label off pods whose term is over (``deposed_leaders``), so that the
        leader Service follows the leader at once. Conditional on the pod's resourceVersion: a
        sidecar that wrote its own status meanwhile is not overwritten. Its role annotation
        stays as its sidecar wrote it (the sidecar's own record); the sidecar corrects both
        when it reaches the API server again."""
        for deposed in deposed_leaders(pods):
            patch = {"metadata": {"resourceVersion": deposed.resource_version,
                                  "labels": {contract.LABEL_ROLE: contract.ROLE_STANDBY}}}
            try:
                await self.client.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{deposed.pod}", body=patch,
                                          content_type="application/merge-patch+json", timeout=CALL_TIMEOUT)
            except (KubeConflict, KubeNotFound):
                continue  # changed or gone since it was read: the next refresh sees it anew
            except KubeError as exc:
                log.warning("could not take the leader label off deposed pod %s/%s: %s", namespace, deposed.pod, exc,
                            extra={"namespace": namespace, "pod": deposed.pod, "token": deposed.token})
                self.marks.mark(namespace, group)  # tried again: a cut-off node's pod sends no more events
                continue
            self.metrics.deposed_relabelled.inc()
            log.info("took the leader label off %s/%s, whose term (token %s) is over", namespace, deposed.pod,
                     deposed.token, extra={"namespace": namespace, "pod": deposed.pod, "token": deposed.token})

    async def _refresh(self, body: dict[str, Any], reads: GroupReads, *, live: bool,
                       same_object: bool = False) -> None:
        """Write the group's status from ``reads``. ``live``: the body was read just now (or by
        a new group's first reconcile, which ended just now: ``same_object``, as the status is
        then written only to that very object); a listing's may be seconds old (the group since
        edited or deleted), so that path never reconciles: it leaves the group to the live
        refresher."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        reconciler = self.reconciler
        if body["metadata"].get("deletionTimestamp"):
            return
        try:
            workload = await reads.workload(body)
            spec = reconciler.spec_of(body, workload)
        except (SpecError, ReconcileProblem) as exc:
            # Admission refuses such specs; one an older CRD let through is reported as Stalled,
            # as is an adopted workload that is missing or that the group's rules refuse.
            reason = (exc.reason if isinstance(exc, ReconcileProblem)
                      else "InvalidWorkload" if isinstance(exc, WorkloadSpecError) else "InvalidSpec")
            if await write_spec_error(self.client, body, str(exc), reason):
                self.metrics.status_updates.inc()
            return
        key = (namespace, name)
        if not live and workload is not None and reconciler.adoption_changed(key, workload):
            self.marks.mark(*key)
            return
        if workload is not None:
            # An adopted workload changed under the group is applied again (at most so often).
            await reconciler.readopt(body, workload)
        # What was kept for this very object: one deleted and made again under its name, before
        # kopf handled the old one's DELETED event, has had nothing applied and no problem yet.
        kept = reconciler.kept_for(body)
        observed = await reads.observed(spec, reconciler.problems.get(key) if kept else None,
                                        reconciler.applied.get(key) if kept else None)
        observed = dataclasses.replace(observed, database=reconciler.database.get(key) if kept else None)
        if live:
            await self._relabel_deposed(namespace, name, observed.pods)
        leader_changes = self.metrics.leader_changes.labels(namespace, name)  # exported from 0 on
        if spec.replicas > 0:
            self.metrics.group_leaders.labels(namespace, name).set(labelled_leaders(observed.pods))
        else:  # scaled to zero: no leader is what was asked for, not an alert
            self.metrics.group_leaders.remove(namespace, name)
        if await write_status(self.client, spec, body.get("status") or {}, observed, same_object=same_object):
            self.metrics.status_updates.inc()
            # The same rule as write_status's LeaderChanged Event.
            leader = find_leader(observed.pods)
            if leader is not None and leader.pod != (body.get("status") or {}).get("leader"):
                leader_changes.inc()
