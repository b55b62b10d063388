"""What a group's status is computed from, read three ways behind one small interface.

``LiveReads`` asks the API server about one group (three requests): what a refresh after an
event of that group uses. ``AppliedReads`` lists a new group's pods only, its Deployment being
what its first reconcile's apply answered: what that group's first refresh uses.
``Listing`` reads every group of a scope with one request per kind
(SingletonServices, their pods, the Deployments the operator made, and the adopted workloads'
kinds per namespace): what the periodic pass over all groups uses, so that an operator with
hundreds of idle groups makes a handful of requests per pass instead of three per group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from singleton_election import contract
from singleton_election.kube import KubeClient, KubeError, KubeForbidden
from singleton_operator.model.resources import LABEL_MANAGED_BY, MANAGED_BY
from singleton_operator.model.spec import GroupSpec, workload_ref
from singleton_operator.model.status import Observed
from singleton_operator.reconcile import (
    CALL_TIMEOUT,
    ReconcileProblem,
    get_or_none,
    list_pods,
    object_path,
    observe,
    observed_from,
    read_workload,
    workload_missing,
)

GroupKey = tuple[str, str]


class GroupReads(Protocol):
    async def workload(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The adopted workload (None for a template group); ``ReconcileProblem`` if it is
        missing or unreadable."""

    async def observed(self, spec: GroupSpec, problem: ReconcileProblem | None,
                       applied_generation: int | None) -> Observed:
        """The group's pods and workload now."""


@dataclass
class LiveReads:
    client: KubeClient

    async def workload(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return await read_workload(self.client, body)

    async def observed(self, spec: GroupSpec, problem: ReconcileProblem | None,
                       applied_generation: int | None) -> Observed:
        return await observe(self.client, spec, problem, applied_generation)


@dataclass
class AppliedReads:
    """A new template group whose first reconcile just applied it: its pods read now, its
    Deployment as that apply answered (``groups.FirstApplied``)."""

    client: KubeClient
    deployment: dict[str, Any]

    async def workload(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return None  # a template group adopts no workload

    async def observed(self, spec: GroupSpec, problem: ReconcileProblem | None,
                       applied_generation: int | None) -> Observed:
        return observed_from(await list_pods(self.client, spec), self.deployment, problem, applied_generation)


def _collection(namespace: str | None, group_version: str, plural: str) -> str:
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


def _key(obj: dict[str, Any]) -> GroupKey:
    return obj["metadata"]["namespace"], obj["metadata"]["name"]


@dataclass
class Listing:
    """One scope (a namespace, or every namespace) listed at one moment."""

    client: KubeClient
    bodies: list[dict[str, Any]]
    pods: dict[GroupKey, list[dict[str, Any]]]
    """By (namespace, group label)."""
    owned: dict[GroupKey, dict[str, Any]]
    """The Deployments the operator made, by (namespace, name)."""
    _workloads: dict[tuple[str, str], dict[str, dict[str, Any]]] = field(default_factory=dict)
    """Adopted workloads' kinds listed so far: (namespace, kind) -> name -> object."""
    _failed: dict[tuple[str, str], KubeError] = field(default_factory=dict)
    """(namespace, kind) whose listing failed in this pass."""

    @classmethod
    async def read(cls, client: KubeClient, namespace: str | None) -> Listing:
        async def items(path: str, selector: str | None = None) -> list[dict[str, Any]]:
            params = {"labelSelector": selector} if selector else None
            listing = await client.request("GET", path, params=params, timeout=CALL_TIMEOUT)
            return list(listing.get("items") or [])

        bodies = await items(_collection(namespace, f"{contract.API_GROUP}/{contract.API_VERSION}", contract.PLURAL))
        pods: dict[GroupKey, list[dict[str, Any]]] = {}
        owned: dict[GroupKey, dict[str, Any]] = {}
        if bodies:
            for pod in await items(_collection(namespace, "v1", "pods"), contract.LABEL_GROUP):
                group = pod["metadata"]["labels"][contract.LABEL_GROUP]
                pods.setdefault((pod["metadata"]["namespace"], group), []).append(pod)
            for deployment in await items(_collection(namespace, "apps/v1", "deployments"),
                                          f"{LABEL_MANAGED_BY}={MANAGED_BY}"):
                owned[_key(deployment)] = deployment
        return cls(client, bodies, pods, owned)

    async def _adopted(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        """One listing per namespace and kind, made when a group first needs it. Where the
        operator may read but not list that kind (RBAC made by hand), the one object is read."""
        key = (namespace, kind)
        if key not in self._workloads and key not in self._failed:
            try:
                listing = await self.client.request("GET", object_path("apps/v1", kind, namespace),
                                                    timeout=CALL_TIMEOUT)
                self._workloads[key] = {o["metadata"]["name"]: o for o in listing.get("items") or []}
            except KubeForbidden as exc:
                self._failed[key] = exc
            except KubeError as exc:
                self._failed[key] = exc  # not asked again by every group of the namespace
                raise
        failed = self._failed.get(key)
        if isinstance(failed, KubeForbidden):
            return await get_or_none(self.client, object_path("apps/v1", kind, namespace, name))
        if failed is not None:
            raise failed
        return self._workloads[key].get(name)

    async def workload(self, body: dict[str, Any]) -> dict[str, Any] | None:
        ref = workload_ref(body)
        if ref is None:
            return None
        namespace = body["metadata"]["namespace"]
        try:
            found = await self._adopted(namespace, ref.kind, ref.name)
        except KubeForbidden as exc:
            raise ReconcileProblem("RBACDenied",
                                   f"the operator may not read {ref.describe(namespace)}: {exc}") from None
        if found is None:
            raise workload_missing(ref, namespace)
        return found

    async def observed(self, spec: GroupSpec, problem: ReconcileProblem | None,
                       applied_generation: int | None) -> Observed:
        if spec.workload_ref is None:
            workload = self.owned.get((spec.namespace, spec.name))
        else:
            workload = await self._adopted(spec.namespace, spec.workload_ref.kind, spec.workload_ref.name)
        return observed_from(self.pods.get((spec.namespace, spec.name), []), workload, problem, applied_generation)


def scopes(namespaces: Iterable[str]) -> list[str | None]:
    """The namespaces to list, each on its own; None: the whole cluster in one listing."""
    return list(namespaces) or [None]
