"""Force-release of a group's lock, carried out by the operator inside the cluster.

``kubectl singleton release`` writes a request on the SingletonService (annotation
``release_request.RELEASE_REQUEST``: ``{"id": ..., "by": ...}``), never touching the database from the
laptop. The operator's leader, which already reads the group's Secret (to check its DSN) and
updates Leases, carries it out: it clears the Lease's holder (lease, both) and ends the
PostgreSQL holder's session (postgres, both) with the DSN from the group's Secret, records a
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
from singleton_election.backends.postgres_sql import Statements
from singleton_election.kube import KubeClient, KubeConflict, KubeError, KubeNotFound, event_body
from singleton_operator.reconcile import cr_path
from singleton_operator.release_request import RELEASE_RESULT, ReleaseRequest, pending_request
from singleton_operator.resources import MANAGED_BY

log = logging.getLogger(__name__)

CALL_TIMEOUT = 10.0
POSTGRES_TIMEOUT = 10.0
LEASE_ATTEMPTS = 3
# The operator's groups use the sidecar's default schema and table.
LEASES_SQL = Statements.build("public", "singleton_leases")


class ReleaseFailed(Exception):
    """The release could not be carried out; the message says why."""


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
            done.append(await release_lease(client, namespace, name))
        if backend in ("postgres", "both"):
            done.append(await release_postgres(client, body))
    except ReleaseFailed as exc:
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


async def release_lease(client: KubeClient, namespace: str, name: str) -> str:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
    for _ in range(LEASE_ATTEMPTS):
        try:
            lease = await client.request("GET", path, timeout=CALL_TIMEOUT)
        except KubeNotFound:
            return "no Lease to release"
        except KubeError as exc:
            raise ReleaseFailed(f"cannot read Lease {namespace}/{name}: {exc}") from None
        holder = (lease.get("spec") or {}).get("holderIdentity")
        if not holder:
            return "the Lease had no holder"
        lease["spec"]["holderIdentity"] = None
        try:
            # With the resourceVersion read above: a holder renewing meanwhile makes this a 409; read again.
            await client.request("PUT", path, body=lease, timeout=CALL_TIMEOUT)
        except KubeConflict:
            continue
        except KubeError as exc:
            raise ReleaseFailed(f"cannot update Lease {namespace}/{name}: {exc}") from None
        return f"cleared Lease holder {holder}"
    raise ReleaseFailed(f"Lease {namespace}/{name} changed {LEASE_ATTEMPTS} times while clearing it; try again")


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
        raise ReleaseFailed(f"cannot read {where}: {exc}") from None
    except KeyError:
        raise ReleaseFailed(f"{where} has no key {ref.get('key', 'dsn')!r}") from None
    dsn = base64.b64decode(encoded).decode(errors="replace").strip()
    try:
        # No statement cache: a pooled group's DSN may name a transaction pooler (PgBouncer).
        conn = await asyncpg.connect(dsn, timeout=POSTGRES_TIMEOUT, statement_cache_size=0)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__  # asyncpg's messages name no password
        raise ReleaseFailed(f"cannot connect with the DSN in {where}: {reason}") from None
    try:
        row = await conn.fetchrow(
            f"SELECT holder, holder_pid, extract(epoch FROM expires_at - now())::float8 AS expires_in"
            f" FROM {LEASES_SQL.leases} WHERE group_name = $1",
            contract.lock_key(metadata["name"], namespace), timeout=POSTGRES_TIMEOUT)
        if row is not None and row["holder"] is not None and row["holder_pid"] is None \
                and (row["expires_in"] or 0) > 0:
            # The pooled mode's term is a row with an expiry, held by no session: nothing to end.
            # Expiring it now would let a standby act while a live holder still acts until its
            # next renewal; it frees by itself within the lease, as a crashed holder's does.
            return (f"PostgreSQL holder {row['holder']} (pooled mode: no session to end) keeps its row until it "
                    f"expires, in {row['expires_in']:.1f}s; a standby takes over then")
        if row is None or row["holder_pid"] is None:
            return "no PostgreSQL holder"
        ended = await conn.fetchval(LEASES_SQL.terminate, row["holder_pid"], timeout=POSTGRES_TIMEOUT)
    except (asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
        raise ReleaseFailed(f"PostgreSQL: {type(exc).__name__}: {exc}") from None
    finally:
        await conn.close()
    if not ended:
        return f"the session of PostgreSQL holder {row['holder']} had ended already"
    return f"ended the PostgreSQL session of holder {row['holder']}"


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
