"""Force-release of a group's lock, carried out by the operator inside the cluster.

``kubectl singleton release`` writes a request on the SingletonService (annotation
``release_request.RELEASE_REQUEST``: ``{"id": ..., "by": ...}``), never touching the database from the
laptop. The operator's leader, which already reads the group's Secret (to check its DSN) and
updates Leases, carries it out with the backends' own rules (``lease.force_release``: clears the
Lease's holder; ``postgres.force_release``: ends the PostgreSQL holder's session, or leaves a
pooled-mode row to expire) with the DSN from the group's Secret, records a
``LockReleased`` Event naming the requester, and answers on the same object (annotation
``release_request.RELEASE_RESULT``: the request's id, what was done, or the error) for the plugin to print.

The requester's name is what the plugin read from a SelfSubjectReview; anyone who may patch
the SingletonService may write a request, and the API server's audit log says who did.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
from typing import Any

import asyncpg

from singleton_election import contract
from singleton_election.backends import lease
from singleton_election.backends.postgres import session_mode as postgres
from singleton_election.backends.postgres.sql import Statements
from singleton_election.core.lock import ForceReleaseFailed
from singleton_election.kube import KubeClient, KubeError, KubeNotFound, event_body
from singleton_operator.model.resources import MANAGED_BY
from singleton_operator.reconcile import cr_path
from singleton_operator.release_request import RELEASE_RESULT, ReleaseRequest, pending_request

log = logging.getLogger(__name__)

CALL_TIMEOUT = 10.0
POSTGRES_TIMEOUT = 10.0
LEASE_ATTEMPTS = 3
# The operator's groups use the sidecar's default schema and table.
LEASES_SQL = Statements.build("public", "singleton_leases")


async def answer_pending(client: KubeClient, namespace: str, name: str) -> dict[str, Any] | None:
    """Carry out the group's unanswered release request, if any; returns the answer.

    Read afresh rather than from the watch event that woke us: kopf may hand a handler an
    event queued before our own answer was written, and a request carried out twice would
    clear the holder of the next term too."""
    try:
        body = await client.request("GET", cr_path(namespace, name), timeout=CALL_TIMEOUT)
    except KubeNotFound:
        return None
    request = pending_request(body)
    return None if request is None else await carry_out(client, body, request)


async def carry_out(client: KubeClient, body: dict[str, Any], request: ReleaseRequest) -> dict[str, Any]:
    """Release the group's lock, record the Event, write the answer; returns the answer."""
    metadata = body["metadata"]
    namespace, name = metadata["namespace"], metadata["name"]
    backend = (body.get("spec") or {}).get("backend", "lease")
    done: list[str] = []
    error: str | None = None
    try:
        if backend in ("lease", "both"):
            done.append(await lease.force_release(client, namespace, name, timeout=CALL_TIMEOUT,
                                                  attempts=LEASE_ATTEMPTS))
        if backend in ("postgres", "both"):
            done.append(await release_postgres(client, body))
    except ForceReleaseFailed as exc:
        error = str(exc)
    summary = "; ".join(done)
    if error is None:
        log.warning("lock force-released", extra={"namespace": namespace, "group": name, "by": request.by,
                                                  "request": request.id, "done": done})
        await _event(client, body, "LockReleased",
                     f"{request.by} force-released the lock with kubectl singleton: {summary}")
    else:
        log.error("lock release failed", extra={"namespace": namespace, "group": name, "by": request.by,
                                                "request": request.id, "done": done, "error": error})
        await _event(client, body, "LockReleaseFailed", f"release requested by {request.by} failed: {error}"
                     + (f" (done: {summary})" if done else ""), warning=True)
    answer = {"id": request.id, "by": request.by, "done": done, "error": error,
              "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")}
    await client.request("PATCH", cr_path(namespace, name),
                         body={"metadata": {"annotations": {RELEASE_RESULT: json.dumps(answer)}}},
                         content_type="application/merge-patch+json", timeout=CALL_TIMEOUT)
    return answer


async def release_postgres(client: KubeClient, body: dict[str, Any]) -> str:
    metadata = body["metadata"]
    namespace = metadata["namespace"]
    ref = ((body.get("spec") or {}).get("postgres") or {}).get("secretRef") or {}
    where = f"Secret {namespace}/{ref.get('name')}"
    try:
        secret = await client.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{ref.get('name')}",
                                      timeout=CALL_TIMEOUT)
        encoded = (secret.get("data") or {})[ref.get("key", "dsn")]
    except KubeError as exc:
        raise ForceReleaseFailed(f"cannot read {where}: {exc}") from None
    except KeyError:
        raise ForceReleaseFailed(f"{where} has no key {ref.get('key', 'dsn')!r}") from None
    dsn = base64.b64decode(encoded).decode(errors="replace").strip()
    try:
        # No statement cache: a pooled group's DSN may name a transaction pooler (PgBouncer).
        conn = await asyncpg.connect(dsn, timeout=POSTGRES_TIMEOUT, statement_cache_size=0)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__  # asyncpg's messages name no password
        raise ForceReleaseFailed(f"cannot connect with the DSN in {where}: {reason}") from None
    try:
        return await postgres.force_release(conn, contract.lock_key(metadata["name"], namespace), sql=LEASES_SQL,
                                            timeout=POSTGRES_TIMEOUT)
    finally:
        await conn.close()


async def _event(client: KubeClient, body: dict[str, Any], reason: str, message: str, *,
                 warning: bool = False) -> None:
    metadata = body["metadata"]
    involved = {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
                "namespace": metadata["namespace"], "name": metadata["name"], "uid": metadata["uid"]}
    event = event_body(involved, reason=reason, message=message, warning=warning,
                       component=f"{contract.API_GROUP}/{MANAGED_BY}", instance=MANAGED_BY)
    try:
        await client.request("POST", f"/api/v1/namespaces/{metadata['namespace']}/events", body=event,
                             timeout=CALL_TIMEOUT)
    except KubeError as exc:
        log.warning("event not recorded", extra={"namespace": metadata["namespace"], "group": metadata["name"],
                                                 "reason": reason, "error": exc})
