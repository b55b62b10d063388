"""Talking to the API server for one group: apply the owned objects, check its inputs,
observe its pods, write its status and Events.

Applies are server-side (one field manager, forced), so a reconcile is idempotent and
survives operator restarts: the API server merges, nothing is computed from a cache.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from singleton_election import contract
from singleton_election.kube import (
    KubeClient,
    KubeConflict,
    KubeError,
    KubeForbidden,
    KubeNotFound,
    KubeUnavailable,
    event_body,
)
from singleton_operator.model import resources
from singleton_operator.model.spec import GroupSpec, WorkloadRef, workload_ref
from singleton_operator.model.status import (
    DATABASE_REACHABLE,
    DatabaseCheck,
    Observed,
    compute_status,
    spec_error_status,
    status_changed,
)

log = logging.getLogger(__name__)

CALL_TIMEOUT = 10.0
POSTGRES_CHECK_TIMEOUT = 5.0

_PATHS = {
    ("v1", "ServiceAccount"): "/api/v1/namespaces/{ns}/serviceaccounts",
    ("v1", "Service"): "/api/v1/namespaces/{ns}/services",
    ("rbac.authorization.k8s.io/v1", "Role"): "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"):
        "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    ("apps/v1", "Deployment"): "/apis/apps/v1/namespaces/{ns}/deployments",
    ("apps/v1", "StatefulSet"): "/apis/apps/v1/namespaces/{ns}/statefulsets",
    ("policy/v1", "PodDisruptionBudget"): "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
}


class ReconcileProblem(Exception):
    """Something the user must fix; ``reason`` is a CamelCase word for conditions and Events.
    ``database``: the group's database check, when it was made before the problem was found."""

    def __init__(self, reason: str, message: str, database: DatabaseCheck | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.database = database


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    collection = _PATHS[(api_version, kind)].format(ns=namespace)
    return collection if name is None else f"{collection}/{name}"


def cr_path(namespace: str, name: str) -> str:
    return f"/apis/{contract.API_GROUP}/{contract.API_VERSION}/namespaces/{namespace}/{contract.PLURAL}/{name}"


APPLY = "application/apply-patch+yaml"
APPLY_PARAMS = {"fieldManager": resources.FIELD_MANAGER, "force": "true",
                # Strict: an unknown or duplicate field (a typo in the template) is refused,
                # never dropped (see is_refused_object for how it is refused).
                "fieldValidation": "Strict"}


def _path_of(obj: dict[str, Any]) -> str:
    return object_path(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])


async def apply(client: KubeClient, obj: dict[str, Any]) -> None:
    """Server-side apply ``obj``; its answer (the whole object) is not decoded."""
    await client.write("PATCH", _path_of(obj), body=obj, content_type=APPLY, params=APPLY_PARAMS,
                       timeout=CALL_TIMEOUT)


async def apply_and_read(client: KubeClient, obj: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply ``obj``; returns the object as the API server made it."""
    return await client.request("PATCH", _path_of(obj), body=obj, content_type=APPLY, params=APPLY_PARAMS,
                                timeout=CALL_TIMEOUT)


TYPED_PATCH_ERROR = "failed to create typed patch object"


def is_refused_object(exc: KubeError) -> bool:
    """Whether the API server refused the object itself (so retrying cannot help): 422 for an
    invalid value; 400 for what strict field validation finds; and a 500 whose message says
    the apply patch does not fit the type's schema, which is how kube-apiserver (1.34) answers
    an unknown field (a typo) or a wrongly typed value in a server-side apply, whatever
    fieldValidation says."""
    return exc.status in (400, 422) or (exc.status == 500 and TYPED_PATCH_ERROR in exc.message)


async def delete_if_owned(client: KubeClient, api_version: str, kind: str, spec: GroupSpec, name: str) -> None:
    """Delete the group's own object of this name (one the group no longer wants). An object
    of the same name that the group does not own (a user's own PodDisruptionBudget named as
    the group, say) is left alone."""
    path = object_path(api_version, kind, spec.namespace, name)
    try:
        obj = await client.request("GET", path, timeout=CALL_TIMEOUT)
    except KubeNotFound:
        return
    metadata = obj.get("metadata") or {}
    if not any(ref.get("uid") == spec.uid for ref in metadata.get("ownerReferences") or []):
        log.info("not deleting an object the group does not own",
                 extra={"namespace": spec.namespace, "group": spec.name, "kind": kind, "object": name})
        return
    # Only that very object: one deleted and re-created by someone else since the read stays.
    options = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": metadata.get("uid")}}
    try:
        await client.request("DELETE", path, body=options, timeout=CALL_TIMEOUT)
    except (KubeNotFound, KubeConflict):
        return


_DSN_PASSWORD = re.compile(r"(://[^:/@]*:)[^@]*@")


def _redact(text: str) -> str:
    return _DSN_PASSWORD.sub(r"\1***@", text)


async def check_postgres(client: KubeClient, spec: GroupSpec) -> DatabaseCheck:
    """The Secret exists, holds the key, and its DSN reaches PostgreSQL. A problem with the
    Secret is raised whatever ``spec.postgres.connectionCheck`` says (the pods could not start
    without it); the connection's outcome is returned, not tried with ``skip``."""
    assert spec.postgres_secret is not None
    where = f"Secret {spec.namespace}/{spec.postgres_secret}"

    def secret_problem(reason: str, message: str) -> ReconcileProblem:
        return ReconcileProblem(reason, message, DatabaseCheck(False, reason, f"not checked: {message}"))

    try:
        secret = await client.request("GET", f"/api/v1/namespaces/{spec.namespace}/secrets/{spec.postgres_secret}",
                                      timeout=CALL_TIMEOUT)
    except KubeNotFound:
        raise secret_problem("SecretNotFound", f"{where} (spec.postgres.secretRef.name) does not exist") from None
    except KubeForbidden as exc:
        raise secret_problem("RBACDenied", f"the operator may not read {where}: {exc}") from None
    data = secret.get("data") or {}
    if spec.postgres_secret_key not in data:
        keys = ", ".join(sorted(data)) or "none"
        raise secret_problem("SecretKeyMissing", f"{where} has no key {spec.postgres_secret_key!r} "
                             f"(spec.postgres.secretRef.key); its keys: {keys}")
    dsn = base64.b64decode(data[spec.postgres_secret_key]).decode(errors="replace").strip()
    if not dsn.startswith(("postgres://", "postgresql://")):
        raise secret_problem("InvalidDSN", f"{where} key {spec.postgres_secret_key!r} is not a postgres:// or "
                             "postgresql:// URL")
    if spec.postgres_connection_check == "skip":
        # Said as "connectionCheck": it may come from the operator's --postgres-connection-check.
        return DatabaseCheck(None, "CheckSkipped", f"not checked (connectionCheck skip); the DSN in {where} is only "
                             "used by the group's pods")
    try:
        conn = await asyncpg.connect(dsn, timeout=POSTGRES_CHECK_TIMEOUT)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
        return DatabaseCheck(False, "PostgresUnreachable", f"cannot connect with the DSN in {where}: "
                             f"{type(exc).__name__}: {_redact(str(exc))}")
    await conn.close()
    return DatabaseCheck(True, "Connected", f"the operator connected with the DSN in {where}")


ACCESS_REVIEW_TTL = 60.0
"""How long an ``allowed`` answer of a SelfSubjectAccessReview is taken as still true."""

ACCESS_REVIEWS_IN_FLIGHT = 16
"""Access reviews sent at once, whatever the namespaces: answers are shared per namespace only,
and each reconcile asks about ten, so 48 new groups in 48 namespaces would otherwise queue
about 480 requests on the client's 100 connections, where time queued counts against each
request's timeout. A review waits for its turn at most ``CALL_TIMEOUT``, as for an answer."""


@dataclass
class AccessReviews:
    """SelfSubjectAccessReview answers, an ``allowed`` kept for ``ACCESS_REVIEW_TTL``: every
    group of a namespace asks the same ten questions, which made them nearly half of the
    operator's requests when hundreds of groups were created together. A refusal is never
    kept (a grant is seen at the next retry); a permission revoked within the TTL is still
    met by the apply's own refusal (RBACDenied), at worst after part of the objects."""

    client: KubeClient
    clock: Callable[[], float] = time.monotonic
    _allowed_until: dict[tuple[str, str, str, str], float] = field(default_factory=dict)
    _asking: dict[tuple[str, str, str, str], asyncio.Task[bool]] = field(default_factory=dict)
    """Questions in flight: the groups reconciled at once ask the same ones together (148
    reviews for 500 groups created together, instead of 10), so they share one answer."""
    _sending: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(ACCESS_REVIEWS_IN_FLIGHT),
                                        repr=False, compare=False)

    async def allowed(self, namespace: str, group: str, resource: str, verb: str) -> bool:
        key = (namespace, group, resource, verb)
        if self._allowed_until.get(key, 0.0) > self.clock():
            return True
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.create_task(self._ask(key))
            asking.add_done_callback(lambda task: self._asked(key, task))
        # Shielded: a waiter cancelled (its reconcile ended) does not cancel the others' answer.
        return await asyncio.shield(asking)

    async def close(self) -> None:
        """Cancel the reviews in flight (their reconciles have stopped: kopf is stopping)."""
        asking = list(self._asking.values())
        for task in asking:
            task.cancel()
        await asyncio.gather(*asking, return_exceptions=True)

    def _asked(self, key: tuple[str, str, str, str], task: asyncio.Task[bool]) -> None:
        self._asking.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here too: every waiter may have been cancelled meanwhile

    async def _ask(self, key: tuple[str, str, str, str]) -> bool:
        namespace, group, resource, verb = key
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                  "spec": {"resourceAttributes": {"namespace": namespace, "group": group,
                                                  "resource": resource, "verb": verb}}}
        try:
            async with asyncio.timeout(CALL_TIMEOUT):
                await self._sending.acquire()
        except TimeoutError:
            # As a request timed out: the reconcile is retried as for a busy API server.
            raise KubeUnavailable(0, "Timeout", f"access review ({verb} {resource} in {namespace}) waited "
                                  f"{CALL_TIMEOUT:g} s for one of {ACCESS_REVIEWS_IN_FLIGHT} turns") from None
        try:
            answer = await self.client.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                                               body=review, timeout=CALL_TIMEOUT)
        finally:
            self._sending.release()
        allowed = bool((answer.get("status") or {}).get("allowed"))
        if allowed:
            self._allowed_until[key] = self.clock() + ACCESS_REVIEW_TTL
        return allowed


async def check_access(access: AccessReviews, spec: GroupSpec, objects: list[dict[str, Any]]) -> None:
    """Ask the API server (SelfSubjectAccessReview) whether we may create and patch every
    object we are about to apply, so a missing permission creates nothing at all."""
    wanted = sorted({(o["apiVersion"].rpartition("/")[0], _PATHS[(o["apiVersion"], o["kind"])].rsplit("/", 1)[1],
                      verb) for o in objects for verb in (("patch",) if _is_adopted(spec, o) else ("create", "patch"))})
    results = await asyncio.gather(*(access.allowed(spec.namespace, *item) for item in wanted))
    missing = [f"{verb} {resource}{'.' + group if group else ''}"
               for (group, resource, verb), ok in zip(wanted, results, strict=True) if not ok]
    if missing:
        raise ReconcileProblem("RBACDenied", f"the operator may not {', '.join(missing)} in namespace "
                               f"{spec.namespace}; nothing was created (grant it, e.g. with the chart's ClusterRole)")


def _is_adopted(spec: GroupSpec, obj: dict[str, Any]) -> bool:
    """Whether ``obj`` is the adopted workload (patched, never created)."""
    ref = spec.workload_ref
    return ref is not None and obj["kind"] == ref.kind and obj["metadata"]["name"] == ref.name


def desired_objects(spec: GroupSpec) -> list[dict[str, Any]]:
    if spec.workload_ref is None:
        objects = [resources.service_account(spec), resources.role(spec), resources.role_binding(spec),
                   resources.deployment(spec)]
    else:
        # The RBAC first: the sidecars of the rollout the label starts need it from their start.
        objects = [resources.role(spec), resources.role_binding(spec), resources.adoption(spec)]
    for optional in (resources.leader_service(spec), resources.pod_disruption_budget(spec)):
        if optional is not None:
            objects.append(optional)
    return objects


@dataclass(frozen=True)
class Applied:
    """What a reconcile that applied every object leaves."""

    database: DatabaseCheck | None
    """The group's database check (None without a database)."""
    workload: dict[str, Any] | None
    """A template group's Deployment as the API server answered its apply (None for an
    adopting group): what its first status is computed from, without reading it again."""


async def reconcile(client: KubeClient, spec: GroupSpec, access: AccessReviews | None = None, *,
                    new: bool = False) -> Applied:
    """Make the owned objects match ``spec``. Inputs are checked first and nothing is
    applied while one is wrong: a new group gets no pods stuck on a missing Secret, and a
    running one keeps its pods (they hold their DSN) until the problem is fixed. A database
    the operator cannot reach blocks too, unless ``spec.postgres.connectionCheck`` says warn
    (or skip): only the app's pods may be able to reach it (a proxy sidecar on localhost, a
    database-side rule). ``new``: the group's first reconcile since its creation, so nothing
    can be owned by it yet and there is nothing to delete (a request less per unwanted object
    for each group created). A ``ReconcileProblem`` raised after the database check carries it."""
    database = await check_postgres(client, spec) if spec.uses_postgres else None
    try:
        workload = await _check_and_apply(client, spec, access, new=new, database=database)
    except ReconcileProblem as exc:
        exc.database = exc.database or database
        raise
    return Applied(database, workload)


async def _check_and_apply(client: KubeClient, spec: GroupSpec, access: AccessReviews | None, *, new: bool,
                           database: DatabaseCheck | None) -> dict[str, Any] | None:
    """Apply the objects; returns a template group's Deployment as applied."""
    if database is not None and database.reachable is False and spec.postgres_connection_check == "block":
        raise ReconcileProblem(database.reason, database.message)
    objects = desired_objects(spec)
    await check_access(access or AccessReviews(client), spec, objects)
    current = "the workload"
    workload = None
    try:
        for obj in objects:
            current = f"{obj['kind']} {obj['metadata']['name']}"
            if spec.workload_ref is None and obj["kind"] == "Deployment":
                workload = await apply_and_read(client, obj)
            else:
                await apply(client, obj)
        if resources.leader_service(spec) is None and not new:
            await delete_if_owned(client, "v1", "Service", spec, resources.leader_service_name(spec))
        if resources.pod_disruption_budget(spec) is None and not new:
            await delete_if_owned(client, "policy/v1", "PodDisruptionBudget", spec, spec.name)
    except KubeForbidden as exc:
        raise ReconcileProblem("RBACDenied", f"the operator was refused: {exc}") from None
    except KubeError as exc:
        if is_refused_object(exc):
            raise ReconcileProblem("InvalidTemplate", f"the API server refused {current}: {exc.message}") from None
        raise
    return workload


async def observe(client: KubeClient, spec: GroupSpec, problem: ReconcileProblem | None = None,
                  applied_generation: int | None = None) -> Observed:
    pods, deployment = await asyncio.gather(list_pods(client, spec), get_or_none(client, workload_path(spec)))
    return observed_from(pods, deployment, problem, applied_generation)


async def list_pods(client: KubeClient, spec: GroupSpec) -> list[dict[str, Any]]:
    """The group's pods now."""
    selector = ",".join(f"{k}={v}" for k, v in resources.selector_labels(spec).items())
    pods = await client.request("GET", f"/api/v1/namespaces/{spec.namespace}/pods",
                                params={"labelSelector": selector}, timeout=CALL_TIMEOUT)
    return list(pods.get("items") or [])


def observed_from(pods: list[dict[str, Any]], workload: dict[str, Any] | None, problem: ReconcileProblem | None,
                  applied_generation: int | None) -> Observed:
    return Observed(pods=pods, deployment=workload, problem=problem.message if problem else None,
                    problem_reason=problem.reason if problem else "ReconcileFailed",
                    applied_generation=applied_generation)


def workload_path(spec: GroupSpec) -> str:
    """The group's workload: the Deployment the operator made, or the one it adopted."""
    if spec.workload_ref is None:
        return object_path("apps/v1", "Deployment", spec.namespace, spec.name)
    return object_path("apps/v1", spec.workload_ref.kind, spec.namespace, spec.workload_ref.name)


async def read_workload(client: KubeClient, body: dict[str, Any]) -> dict[str, Any] | None:
    """The workload a SingletonService adopts (None for a template group)."""
    ref = workload_ref(body)
    if ref is None:
        return None
    namespace = body["metadata"]["namespace"]
    try:
        return await client.request("GET", object_path("apps/v1", ref.kind, namespace, ref.name),
                                    timeout=CALL_TIMEOUT)
    except KubeNotFound:
        raise workload_missing(ref, namespace) from None
    except KubeForbidden as exc:
        raise ReconcileProblem("RBACDenied", f"the operator may not read {ref.describe(namespace)}: {exc}") from None


def workload_missing(ref: WorkloadRef, namespace: str) -> ReconcileProblem:
    return ReconcileProblem("WorkloadNotFound", f"spec.workloadRef: {ref.describe(namespace)} does not exist "
                            "(the group adopts it once it does)")


async def release(client: KubeClient, body: dict[str, Any]) -> None:
    """Give an adopted workload back: the group label leaves its template (a rollout without
    the sidecar follows). Needs only ``spec.workloadRef``, so a group whose spec or workload
    now breaks a rule is given back too. Nothing to do if the workload is gone or adopted by
    another group since."""
    ref = workload_ref(body)
    if ref is None:
        return
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    # Read first: an apply to a workload that is gone would try to create one.
    workload = await get_or_none(client, object_path("apps/v1", ref.kind, namespace, ref.name))
    if workload is not None and resources.adopted_by(workload) in (name, None):
        await apply(client, resources.release_adoption(namespace, ref))


def check_not_a_group(body: dict[str, Any], workload: dict[str, Any]) -> None:
    """Refuse the Deployment the operator makes for a template group."""
    ref = workload_ref(body)
    assert ref is not None
    metadata = workload.get("metadata") or {}
    owners = [o for o in metadata.get("ownerReferences") or [] if o.get("kind") == contract.KIND]
    if owners or (metadata.get("labels") or {}).get(resources.LABEL_MANAGED_BY) == resources.MANAGED_BY:
        owner = owners[0]["name"] if owners else "another group"
        raise ReconcileProblem("WorkloadIsAGroup", f"spec.workloadRef: {ref.describe(body['metadata']['namespace'])} "
                               f"is the workload the operator makes for SingletonService {owner}; adopt a workload "
                               "of your own")


async def check_adoptable(client: KubeClient, spec: GroupSpec, workload: dict[str, Any]) -> None:
    """Refuse a workload another live group adopts: two groups' labels would flip its template
    between them, each flip a rollout, and each group's pods would elect a leader of their own."""
    assert spec.workload_ref is not None
    where = spec.workload_ref.describe(spec.namespace)
    other = resources.adopted_by(workload)
    if other is None or other == spec.name:
        return
    if await get_or_none(client, cr_path(spec.namespace, other)) is not None:
        raise ReconcileProblem("WorkloadAdoptedByAnother", f"spec.workloadRef: {where} is adopted by SingletonService "
                               f"{other} already (its pod template's label {contract.LABEL_GROUP}={other}); a "
                               "workload belongs to one group")


async def get_or_none(client: KubeClient, path: str) -> dict[str, Any] | None:
    try:
        return await client.request("GET", path, timeout=CALL_TIMEOUT)
    except KubeNotFound:
        return None


async def write_status(client: KubeClient, spec: GroupSpec, current: dict[str, Any], observed: Observed, *,
                       same_object: bool = False) -> bool:
    """Patch ``.status`` if it changed; post an Event when the leader changed. Returns
    whether anything was written. ``same_object``: only if the group is still the object
    ``spec`` was read from (its UID), else ``KubeInvalid``: ``current`` was not read just now,
    and the group may have been deleted and made again under its name since."""
    new = compute_status(spec, observed, current)
    if not status_changed(current, new):
        return False
    path = cr_path(spec.namespace, spec.name) + "/status"
    if same_object:
        # A JSON patch's test is checked against the stored object: a mismatch writes nothing (422).
        await client.write("PATCH", path, body=[{"op": "test", "path": "/metadata/uid", "value": spec.uid},
                                                {"op": "add", "path": "/status", "value": new}],
                           content_type="application/json-patch+json", timeout=CALL_TIMEOUT)
    else:
        await client.write("PATCH", path, body={"status": new}, content_type="application/merge-patch+json",
                           timeout=CALL_TIMEOUT)
    if new["leader"] is not None and new["leader"] != current.get("leader"):
        was = current.get("leader")
        message = (f"pod {new['leader']} leads with token {new['token']}"
                   + (f" (was {was})" if was else ""))
        await post_event(client, spec, "LeaderChanged", message)
    if new["phase"] == "Failed" and current.get("phase") != "Failed":
        await post_event(client, spec, observed.problem_reason, new["message"], warning=True)
    database, was = _find_condition(new, DATABASE_REACHABLE), _find_condition(current, DATABASE_REACHABLE)
    if (database is not None and database["status"] == "False" and (was or {}).get("status") != "False"
            and observed.problem is None):
        # Warn: the group runs, so no Failed Event says it (with block, that Event does).
        await post_event(client, spec, database["reason"], database["message"], warning=True)
    return True


def _find_condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


async def write_spec_error(client: KubeClient, body: dict[str, Any], message: str,
                           reason: str = "InvalidSpec") -> bool:
    """Report a group the operator cannot read (its spec, or its adopted workload) as Stalled
    with ``reason``. Returns whether anything was written."""
    metadata = body["metadata"]
    current = body.get("status") or {}
    new = spec_error_status(int(metadata.get("generation", 0)), reason, message, current)
    if not status_changed(current, new):
        return False
    await client.request("PATCH", cr_path(metadata["namespace"], metadata["name"]) + "/status",
                         body={"status": new}, content_type="application/merge-patch+json", timeout=CALL_TIMEOUT)
    return True


async def post_event(client: KubeClient, spec: GroupSpec, reason: str, message: str, *,
                     warning: bool = False) -> None:
    involved = {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
                "namespace": spec.namespace, "name": spec.name, "uid": spec.uid}
    event = event_body(involved, reason=reason, message=message, warning=warning,
                       component=f"{contract.API_GROUP}/{resources.MANAGED_BY}", instance=resources.MANAGED_BY)
    try:
        await client.request("POST", f"/api/v1/namespaces/{spec.namespace}/events", body=event,
                             timeout=CALL_TIMEOUT)
    except KubeError as exc:
        log.warning("event not recorded",
                    extra={"namespace": spec.namespace, "group": spec.name, "reason": reason, "error": exc})
