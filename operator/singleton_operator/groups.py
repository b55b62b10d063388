"""The operator's work per group, shared by the kopf handlers: reconcile on spec changes,
refresh the status whenever a pod or the Deployment of the group changes.

Status refreshes are coalesced per group (many pod events in a burst cost one refresh),
and run within ``REFRESH_DELAY`` of the event, well inside the 1 s the status promises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from singleton_operator.metrics import OperatorMetrics
from singleton_operator.reconcile import (
    ReconcileProblem,
    cr_path,
    observe,
    read_workload,
    reconcile,
    release,
    write_spec_error,
    write_status,
)
from singleton_operator.spec import GroupSpec, SpecError, read_spec
from singleton_sidecar import contract
from singleton_sidecar.kube import KubeClient, KubeError, KubeNotFound

log = logging.getLogger(__name__)

REFRESH_DELAY = 0.05
PERIODIC_REFRESH = 30.0
CALL_TIMEOUT = 10.0

GroupKey = tuple[str, str]


@dataclass
class Groups:
    client: KubeClient
    sidecar_image: str
    metrics: OperatorMetrics
    sidecar_pull_policy: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    problems: dict[GroupKey, ReconcileProblem] = field(default_factory=dict)
    applied: dict[GroupKey, int] = field(default_factory=dict)
    """The newest generation of each group whose objects were all applied (for observedGeneration)."""
    _dirty: set[GroupKey] = field(default_factory=set)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def spec_of(self, body: dict[str, Any], workload: dict[str, Any] | None = None) -> GroupSpec:
        """The group's spec; ``workload`` is the adopted workload (``read_workload``), if any."""
        spec = read_spec(body, default_sidecar_image=self.sidecar_image, workload=workload)
        return dataclasses.replace(spec, sidecar_pull_policy=self.sidecar_pull_policy,
                                   image_pull_secrets=self.image_pull_secrets)

    async def reconcile(self, body: dict[str, Any]) -> None:
        """Apply the group's objects; remember (and raise) a problem the user must fix."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        self.metrics.reconciles.inc()
        try:
            workload = await read_workload(self.client, body)
        except ReconcileProblem as exc:
            self.problems[key] = exc
            self.mark(*key)
            self.metrics.reconcile_errors.inc()
            raise
        try:
            spec = self.spec_of(body, workload)
        except SpecError as exc:
            if workload is not None and "(in the adopted " in str(exc):
                # The workload's owner may fix it without touching the group: retried.
                problem = ReconcileProblem("InvalidWorkload", str(exc))
                self.problems[key] = problem
                self.mark(*key)
                self.metrics.reconcile_errors.inc()
                raise problem from None
            self.problems[key] = ReconcileProblem("InvalidSpec", str(exc))
            self.mark(*key)
            self.metrics.reconcile_errors.inc()
            raise
        try:
            await reconcile(self.client, spec)
        except ReconcileProblem as exc:
            self.problems[key] = exc
            self.metrics.reconcile_errors.inc()
            log.warning("group %s/%s: %s: %s", *key, exc.reason, exc.message)
            raise
        finally:
            self.mark(*key)
        self.problems.pop(key, None)
        self.applied[key] = spec.generation

    async def repair(self, namespace: str, name: str) -> None:
        """Re-apply a group whose owned object vanished (if the group still exists)."""
        try:
            body = await self.client.request("GET", cr_path(namespace, name), timeout=CALL_TIMEOUT)
        except KubeNotFound:
            return
        if body["metadata"].get("deletionTimestamp"):
            return
        try:
            await self.reconcile(body)
        except (SpecError, ReconcileProblem):
            return

    async def release(self, body: dict[str, Any]) -> None:
        """The group is being deleted: give its adopted workload back."""
        try:
            spec = self.spec_of(body, await read_workload(self.client, body))
        except (SpecError, ReconcileProblem) as exc:
            log.warning("group %s/%s: workload not released: %s", body["metadata"]["namespace"],
                        body["metadata"]["name"], exc)
            return
        await release(self.client, spec)

    def forget(self, namespace: str, name: str) -> None:
        self.problems.pop((namespace, name), None)
        self.applied.pop((namespace, name), None)
        self._dirty.discard((namespace, name))

    def mark(self, namespace: str, name: str) -> None:
        """Refresh this group's status soon."""
        self._dirty.add((namespace, name))
        self._wake.set()

    async def run_refresher(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(REFRESH_DELAY)
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            for key in dirty:
                try:
                    await self.refresh(*key)
                except KubeError as exc:
                    log.warning("group %s/%s: status refresh failed: %s; retrying", *key, exc)
                    self._dirty.add(key)
                    self._wake.set()
                    await asyncio.sleep(1.0)

    async def run_periodic(self, namespaces: tuple[str, ...], interval: float = PERIODIC_REFRESH) -> None:
        """Refresh every group now and then, as a safety net for missed events."""
        while True:
            await asyncio.sleep(interval)
            paths = [f"/apis/{contract.API_GROUP}/{contract.API_VERSION}/namespaces/{ns}/{contract.PLURAL}"
                     for ns in namespaces] or [f"/apis/{contract.API_GROUP}/{contract.API_VERSION}/{contract.PLURAL}"]
            for path in paths:
                try:
                    listing = await self.client.request("GET", path, timeout=CALL_TIMEOUT)
                except KubeError as exc:
                    log.warning("periodic refresh: listing %s failed: %s", path, exc)
                    continue
                for item in listing.get("items") or []:
                    self.mark(item["metadata"]["namespace"], item["metadata"]["name"])

    async def refresh(self, namespace: str, name: str) -> None:
        try:
            body = await self.client.request("GET", cr_path(namespace, name), timeout=CALL_TIMEOUT)
        except KubeNotFound:
            self.forget(namespace, name)
            return
        if body["metadata"].get("deletionTimestamp"):
            return
        try:
            spec = self.spec_of(body, await read_workload(self.client, body))
        except (SpecError, ReconcileProblem) as exc:
            # Admission refuses such specs; one an older CRD let through is reported as Stalled,
            # as is an adopted workload that is missing or that the group's rules refuse.
            if await write_spec_error(self.client, body, str(exc)):
                self.metrics.status_updates.inc()
            return
        observed = await observe(self.client, spec, self.problems.get((namespace, name)),
                                 self.applied.get((namespace, name)))
        if await write_status(self.client, spec, body.get("status") or {}, observed):
            self.metrics.status_updates.inc()
