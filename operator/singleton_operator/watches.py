"""The operator's watches of its groups' pods and of the Deployments it made, filtered by label
selectors on the server. kopf filters labels on the client: its watch of pods lists and follows
every pod of the cluster (kopf PR #1311), so the operator's memory, CPU and events grew with the
cluster's pods instead of its own groups'. These watches keep no objects: each event only marks
its group for a status refresh (``RefreshMarks``), or has a deleted Deployment put back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from singleton_election import contract
from singleton_election.kube import KubeClient, KubeError, KubeGone
from singleton_operator.listing import GroupKey
from singleton_operator.marks import RefreshMarks
from singleton_operator.model.resources import LABEL_MANAGED_BY, MANAGED_BY

log = logging.getLogger(__name__)

LIST_TIMEOUT = 60.0  # seconds for one page of a listing
LIST_PAGE = 500  # objects per page of a listing (its memory is one page, not the cluster's)
WATCH_SECONDS = 300  # the server ends a watch after this; it resumes from the last version
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 30.0  # seconds between attempts after a failure

Handler = Callable[[str, dict[str, Any]], Awaitable[None]]
"""Called with each event's type (``ADDED``, ``MODIFIED``, ``DELETED``; ``LISTED`` for an
object of a listing, after a start or a gap in the watch) and the object."""


Known = dict[tuple[str, str], dict[str, Any]]
"""(namespace, name) -> the name and labels of each live object a watch has seen."""


class Repairer(Protocol):
    """What puts a group's deleted Deployment back (``groups.Reconciler``)."""

    async def repair(self, namespace: str, name: str) -> None: ...


@dataclass(frozen=True)
class Watched:
    """What one watch follows: a collection and the label selector the server applies."""

    name: str
    api: str  # "/api/v1" or "/apis/<group>/<version>"
    plural: str
    selector: str

    def path(self, namespace: str | None) -> str:
        if namespace is None:
            return f"{self.api}/{self.plural}"
        return f"{self.api}/namespaces/{namespace}/{self.plural}"


GROUP_PODS = Watched("group pods", "/api/v1", "pods", contract.LABEL_GROUP)
"""Every pod of a group carries the group label: the operator's own and adopted ones."""
OWN_DEPLOYMENTS = Watched("own deployments", "/apis/apps/v1", "deployments", f"{LABEL_MANAGED_BY}={MANAGED_BY}")


async def follow(client: KubeClient, watched: Watched, namespace: str | None, handler: Handler, *,
                 watch_seconds: float = WATCH_SECONDS) -> None:
    """List, then watch from the listing's version, for ever. A watch the server ends, or that
    fails (backing off), resumes from the last version it sent (bookmarks keep it fresh); an
    expired version (410) lists again, and an object the new listing lacks is handed over as
    ``DELETED``: it went while no watch ran. ``namespace`` None: the whole cluster. A handler's
    failure is logged and does not stop the watch."""
    path = watched.path(namespace)
    fields = {"watch": watched.name, "namespace": namespace or "*", "selector": watched.selector}
    known: Known = {}
    version: str | None = None
    backoff, expired_in_a_row = BACKOFF_FIRST, 0
    while True:
        try:
            if version is None:
                version = await _list(client, path, watched.selector, handler, fields=fields, known=known)
            params = {"labelSelector": watched.selector, "resourceVersion": version, "allowWatchBookmarks": "true"}
            async with aclosing(client.watch(path, params=params, timeout=watch_seconds)) as events:
                async for kind, obj in events:
                    version = obj.get("metadata", {}).get("resourceVersion") or version
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        _remember(known, kind, obj)
                        await _handle(handler, kind, obj, fields)
                    expired_in_a_row = 0
            backoff = BACKOFF_FIRST
        except KubeGone:
            expired_in_a_row += 1
            log.info("watch expired; listing again", extra={**fields, "in_a_row": expired_in_a_row})
            version = None
            if expired_in_a_row > 1:  # a server that keeps answering 410: not in a tight loop
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
        except KubeError as exc:
            log.warning("watch failed; trying again after a pause",
                        extra={**fields, "error": exc, "retry_seconds": backoff})
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def _remember(known: Known, kind: str, obj: dict[str, Any]) -> None:
    """Keep the name and labels of each live object (not the object: a few bytes each)."""
    if kind == "DELETED":
        known.pop(_key(obj), None)
        return
    meta = obj.get("metadata") or {}
    known[_key(obj)] = {"namespace": meta.get("namespace"), "name": meta.get("name"),
                        "labels": dict(meta.get("labels") or {})}


async def _list(client: KubeClient, path: str, selector: str, handler: Handler, *, fields: dict[str, Any],
                known: Known) -> str:
    """Hand every object of the listing to ``handler`` (``LISTED``), page by page, then each
    object ``known`` from before that the listing lacks (``DELETED``, with the name and labels
    known of it); returns the listing's resource version, where the watch starts."""
    params = {"labelSelector": selector, "limit": str(LIST_PAGE)}
    listed: Known = {}
    while True:
        page = await client.request("GET", path, params=params, timeout=LIST_TIMEOUT)
        for obj in page.get("items") or []:
            _remember(listed, "LISTED", obj)
            await _handle(handler, "LISTED", obj, fields)
        meta = page.get("metadata") or {}
        if not meta.get("continue"):
            break
        params = {**params, "continue": str(meta["continue"])}
    gone = [known[key] for key in known.keys() - listed.keys()]
    known.clear()
    known.update(listed)
    for metadata in gone:
        await _handle(handler, "DELETED", {"metadata": metadata}, fields)
    return str(meta.get("resourceVersion", ""))


async def _handle(handler: Handler, kind: str, obj: dict[str, Any], fields: dict[str, Any]) -> None:
    try:
        await handler(kind, obj)
    except Exception:
        meta = obj.get("metadata") or {}
        log.exception("handling a watch event failed",
                      extra={**fields, "event": kind, "object": f"{meta.get('namespace')}/{meta.get('name')}"})


def group_watches(client: KubeClient, namespaces: tuple[str, ...], marks: RefreshMarks,
                  reconciler: Repairer) -> list[asyncio.Task[None]]:
    """The watches of a leading operator, one per collection and watched namespace (one for the
    cluster when ``namespaces`` is empty): a group pod's event marks its group; an event of a
    Deployment the operator made marks its group (the same name), and its deletion by someone
    else while its group lives has it put back."""

    async def pod_changed(_kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        group, namespace = (meta.get("labels") or {}).get(contract.LABEL_GROUP), meta.get("namespace")
        if group and namespace:
            marks.mark(namespace, group)

    scopes: tuple[str | None, ...] = namespaces or (None,)
    tasks = [asyncio.create_task(follow(client, GROUP_PODS, scope, pod_changed),
                                 name=f"watch group pods in {scope or 'the cluster'}") for scope in scopes]
    tasks += [asyncio.create_task(follow_own_deployments(client, scope, marks, reconciler),
                                  name=f"watch own deployments in {scope or 'the cluster'}") for scope in scopes]
    return tasks


class DeploymentRepairs:
    """Deleted Deployments put back, each group's in one task at a time (a repair retries until
    the API server answers: the watch goes on meanwhile). A deletion seen while its group's
    repair runs has the repair run again once it ends: it may have re-applied the Deployment
    before that deletion."""

    def __init__(self, reconciler: Repairer) -> None:
        self._reconciler = reconciler
        self._running: dict[GroupKey, asyncio.Task[None]] = {}
        self._again: set[GroupKey] = set()

    def deleted(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key in self._running:
            self._again.add(key)
            return
        task = asyncio.create_task(self._repair(key), name=f"repair {namespace}/{name}")
        self._running[key] = task
        task.add_done_callback(lambda done: self._ended(key, done))

    async def _repair(self, key: GroupKey) -> None:
        while True:
            self._again.discard(key)
            await self._reconciler.repair(*key)
            if key not in self._again:
                return

    def _ended(self, key: GroupKey, task: asyncio.Task[None]) -> None:
        self._running.pop(key, None)
        self._again.discard(key)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("putting a deleted Deployment back failed", exc_info=exc,
                      extra={"namespace": key[0], "group": key[1]})

    async def close(self) -> None:
        running = list(self._running.values())
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def follow_own_deployments(client: KubeClient, scope: str | None, marks: RefreshMarks,
                                 reconciler: Repairer, *, watch_seconds: float = WATCH_SECONDS) -> None:
    """Mark the group of each event of a Deployment the operator made; put a deleted one back."""
    repairs = DeploymentRepairs(reconciler)

    async def changed(kind: str, deployment: dict[str, Any]) -> None:
        meta = deployment.get("metadata") or {}
        namespace, name = meta.get("namespace"), meta.get("name")
        if not namespace or not name:
            return
        marks.mark(namespace, name)
        if kind == "DELETED":
            repairs.deleted(namespace, name)

    try:
        await follow(client, OWN_DEPLOYMENTS, scope, changed, watch_seconds=watch_seconds)
    finally:
        await repairs.close()
