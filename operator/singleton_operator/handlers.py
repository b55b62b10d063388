"""kopf handlers of the groups: thin, they hand every event to the ``Reconciler`` (found in
kopf's ``memo``). The groups' pods and Deployments are watched by ``watches.py``, with label
selectors on the server, which kopf does not make."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

import kopf

from singleton_election import contract
from singleton_election.kube import KubeConfig, KubeError
from singleton_operator.groups import RETRY_FIRST, Reconciler, retry_delay
from singleton_operator.kopf_state import MemoryDiffBaseStorage, MemoryProgressStorage
from singleton_operator.model.spec import SpecError
from singleton_operator.reconcile import ReconcileProblem
from singleton_operator.release import answer_pending
from singleton_operator.release_request import RELEASE_REQUEST, pending_request


def registry(kube_config: KubeConfig,
             expiration: Callable[[], dt.datetime | None] = lambda: None) -> kopf.OperatorRegistry:
    """A fresh registry with our handlers (one per operator instance, for tests too).
    ``expiration`` says when the credentials expire (an exec plugin's token), if known."""
    reg = kopf.OperatorRegistry()

    @kopf.on.login(registry=reg)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # The same credentials as our own client; called again by kopf on a 401 and once
        # they expire, so a rotated service-account token is re-read and an exec plugin's
        # token renewed (the token first: asking for it renews it, and its expiry with it).
        token = kube_config.bearer_token()
        return kopf.ConnectionInfo(
            server=kube_config.server, ca_data=kube_config.ca_data, insecure=kube_config.insecure,
            token=token, certificate_path=kube_config.client_cert_file,
            private_key_path=kube_config.client_key_file, default_namespace=kube_config.namespace,
            proxy_url=kube_config.proxy, expiration=expiration())
    resource = (contract.API_GROUP, contract.API_VERSION, contract.PLURAL)
    # kopf's state in memory, not in annotations: a write of every group less (kopf_state.py).
    prefix = f"operator.{contract.API_GROUP}"
    progress, diffbase = MemoryProgressStorage(prefix=prefix), MemoryDiffBaseStorage(prefix=prefix)

    @kopf.on.startup(registry=reg)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = progress
        settings.persistence.diffbase_storage = diffbase
        settings.persistence.finalizer = f"{prefix}/finalizer"
        settings.peering.standalone = True  # one active replica: our own Lease election
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 30

    @kopf.on.resume(*resource, registry=reg)
    @kopf.on.create(*resource, registry=reg)
    # Any change of the essence (spec, labels, annotations; never status): the owned objects
    # carry the group's labels and the annotations it names.
    @kopf.on.update(*resource, registry=reg)
    async def reconcile(body: kopf.Body, memo: Any, retry: int, reason: str, **_: Any) -> None:
        reconciler: Reconciler = memo["reconciler"]
        # kopf keeps no state across operator processes, so to a new one every group is a
        # create: only a group without a status was never reconciled. (A retried create may
        # follow an attempt that applied objects an edit since unwants.)
        new = reason == kopf.Reason.CREATE and retry == 0 and not body.get("status")
        try:
            await reconciler.reconcile(dict(body), new=new)
        except SpecError as exc:
            raise kopf.PermanentError(str(exc)) from exc
        except ReconcileProblem as exc:
            # The user may fix it at any time (create the Secret, grant RBAC): try again.
            raise kopf.TemporaryError(f"{exc.reason}: {exc.message}", delay=RETRY_FIRST) from exc
        except KubeError as exc:
            # The API server busy or away (timeouts, 429, 5xx, a conflict): soon again, not
            # after kopf's default minute for an unexpected error; backing off to that minute.
            raise kopf.TemporaryError(f"{type(exc).__name__}: {exc}", delay=retry_delay(retry)) from exc

    @kopf.on.event(*resource, registry=reg, when=lambda event, **_: event.get("type") == "DELETED")
    async def gone(uid: str | None, namespace: str | None, name: str, memo: Any, **_: Any) -> None:
        # Owned objects go with their owner (ownerReferences); forget our bookkeeping and
        # kopf's. On the DELETED event: a delete handler runs only while a finalizer holds it.
        if uid:
            progress.forget(uid)
            diffbase.forget(uid)
        if namespace:
            memo["reconciler"].forget(namespace, name, uid=uid)

    # Not optional for adopting groups: kopf keeps its finalizer on them until the adopted
    # workload is given back (the group label off its template), so a deleted group never
    # leaves a workload whose new pods the webhook would refuse to run without a group.
    @kopf.on.delete(*resource, registry=reg, when=lambda spec, **_: bool(spec.get("workloadRef")))
    async def give_back(body: kopf.Body, memo: Any, **_: Any) -> None:
        await memo["reconciler"].release(dict(body))

    # `kubectl singleton release` asks on the object; the answer goes on it too (release.py).
    @kopf.on.event(*resource, annotations={RELEASE_REQUEST: kopf.PRESENT}, registry=reg)
    async def release_requested(event: kopf.RawEvent, body: kopf.Body, name: str, namespace: str | None,
                                memo: Any, **_: Any) -> None:
        if namespace and event.get("type") != "DELETED" and pending_request(dict(body)) is not None:
            await answer_pending(memo["reconciler"].client, namespace, name)

    return reg
