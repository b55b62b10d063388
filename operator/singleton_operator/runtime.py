"""The operator process: one active replica at a time.

Every replica campaigns for the Lease ``singleton-operator`` in its own namespace with the
sidecar's own election core and lease backend. Only the leader runs kopf. On SIGTERM the
leader stops kopf, then releases the Lease, so a standby takes over in milliseconds; if
it loses the Lease it stops kopf at once and exits (the kubelet restarts it as a
standby), so two replicas never reconcile at the same time.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import signal
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import kopf
from aiohttp import web

from singleton_election.backends.lease import LeaseBackend
from singleton_election.core.elector import Elector
from singleton_election.core.lock import Identity
from singleton_election.core.status import ElectionStatus, Role
from singleton_election.core.timings import BACKEND_DEFAULTS
from singleton_election.kube import KubeClient, KubeConfig, KubeConfigError, KubeError, load_kube_config
from singleton_election.settings import Listen
from singleton_operator import certs
from singleton_operator.groups import Reconciler
from singleton_operator.handlers import registry
from singleton_operator.marks import RefreshMarks
from singleton_operator.metrics import OperatorMetrics
from singleton_operator.model.spec import ConnectionCheck
from singleton_operator.refresher import Refresher
from singleton_operator.watches import group_watches
from singleton_operator.webhook import PATH as WEBHOOK_PATH
from singleton_operator.webhook import PodAdmission

log = logging.getLogger(__name__)

LEASE_NAME = "singleton-operator"
EXIT_LOST_LEADERSHIP = 3
KOPF_STOP_GRACE = 2.0


@dataclass(frozen=True)
class WebhookConfig:
    listen: Listen
    service: str
    secret: str
    configuration: str | None = None
    cert_dir: str | None = None
    extra_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class OperatorConfig:
    identity: str
    lease_namespace: str
    namespaces: tuple[str, ...]
    sidecar_image: str
    health_listen: Listen
    kubeconfig: str | None = None
    sidecar_pull_policy: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    webhook: WebhookConfig | None = None
    postgres_connection_check: ConnectionCheck = "block"


def health_app(elector: Elector, metrics: OperatorMetrics,
               not_ready: Callable[[], str | None] = lambda: None) -> web.Application:
    """``not_ready`` says why the replica must not get traffic yet (its webhook not serving)."""
    async def healthz(_: web.Request) -> web.Response:
        stalled = elector.clock.monotonic() - elector.last_progress
        limit = 2 * elector.timings.lease_duration + elector.timings.retry_period
        if stalled > limit:
            return web.Response(status=503, text=f"election loop stalled for {stalled:.1f}s\n")
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if (reason := not_ready()) is not None:
            return web.Response(status=503, text=f"{reason}\n")
        return web.Response(text=f"{elector.status.role.value}\n")

    async def metrics_handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    return app


def kube_access(kubeconfig: str | None) -> tuple[KubeConfig, Callable[[], dt.datetime | None]]:
    """The operator's API credentials, and when they expire. In a pod (no kubeconfig given):
    its service account, read by the sidecar's small client as ever. Outside a pod: the
    official client's kubeconfig loader (exec plugins, auth providers, proxies), whose
    renewed token every request of ours and kopf's asks for (docs/operator.md)."""
    if kubeconfig is None and not os.environ.get("KUBECONFIG") and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return load_kube_config(None), lambda: None
    try:
        from singleton_operator.kubelogin import KubeLoginError, resolve  # the official client: outside a pod only
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "kubernetes":
            raise
        raise KubeConfigError("a kubeconfig outside a pod needs the official kubernetes client: "
                              "pip install 'kube-singleton[cli]'") from exc

    try:
        resolved = resolve(kubeconfig)
        return resolved.kube_config(), resolved.expiration
    except KubeLoginError as exc:
        raise KubeConfigError(str(exc)) from exc


async def run_operator(config: OperatorConfig) -> int:
    kube_config, expiration = kube_access(config.kubeconfig)
    client = KubeClient(kube_config, user_agent="singleton-operator")
    # The election's own connections: with hundreds of groups reconciling at once, the
    # groups' requests fill the shared pool, and a renewal queued behind them timed out until
    # the operator lost its Lease (measured: 500 groups created together).
    election_client = KubeClient(kube_config, user_agent="singleton-operator-election")
    metrics = OperatorMetrics()
    backend = LeaseBackend(client=election_client, namespace=config.lease_namespace, name=LEASE_NAME,
                           timings=BACKEND_DEFAULTS["lease"])
    # kopf is this elector's app: a term ends (and the Lease passes on) only once kopf has stopped.
    kopf_stopped = asyncio.Event()
    kopf_stopped.set()

    async def wait_kopf_stopped(_urgent: bool) -> None:
        await kopf_stopped.wait()

    elector = Elector(group=LEASE_NAME, identity=Identity(config.identity), backend=backend,
                      timings=BACKEND_DEFAULTS["lease"], wall_clock=time.time, stop_hook=wait_kopf_stopped,
                      stop_timeout=KOPF_STOP_GRACE + 2.0)
    leading, lost, stopping = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def on_status(status: ElectionStatus) -> None:
        metrics.is_leader.set(1 if status.role is Role.LEADER else 0)
        if status.role is Role.LEADER:
            leading.set()
        elif leading.is_set():
            lost.set()

    elector.add_listener(on_status)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    # Every replica answers the webhook, leading or not (webhook.py); not Ready until it does.
    webhook = PodWebhook(config, kube_config, metrics) if config.webhook else None
    health = web.AppRunner(health_app(elector, metrics, webhook.not_ready if webhook else lambda: None),
                           access_log=None)
    election: asyncio.Task[None] | None = None
    exit_code = 0
    try:
        if not await _serve_health(health, config.health_listen):
            return 1
        if webhook is not None:
            webhook.start()
        election = asyncio.create_task(elector.run(), name="operator-election")
        log.info("campaigning for the operator lease",
                 extra={"lease": f"{config.lease_namespace}/{LEASE_NAME}", "identity": config.identity})
        if await _first(leading, stopping) is leading:
            log.info("leading: starting kopf",
                     extra={"identity": config.identity, "role": "leader", "namespaces": list(config.namespaces)})
            kopf_stopped.clear()
            try:
                exit_code = await _run_kopf_while_leading(config, client, metrics, lost, stopping,
                                                          expiration=expiration)
            finally:
                kopf_stopped.set()
    finally:
        if election is not None:
            elector.request_drain()
            await _election_ended(election)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if webhook is not None:
            await webhook.stop()
        await health.cleanup()
        await backend.close()
        await election_client.close()
        await client.close()
    return exit_code


async def _serve_health(health: web.AppRunner, listen: Listen) -> bool:
    """Serve the health checks and metrics; False (logged in one line) when the address cannot
    be listened on: the port taken, or an address not of this host."""
    await health.setup()
    try:
        await web.TCPSite(health, listen.host, listen.port).start()
    except OSError as exc:
        log.error("cannot serve the health checks and metrics (--health-listen)",
                  extra={"listen": f"{listen.host}:{listen.port}", "error": exc.strerror or str(exc)})
        return False
    return True


class PodWebhook:
    """The pod webhook of this replica: its certificate first (retried until the API server
    gives it: a missing Secret permission or configuration must not stop the operator, whose
    template groups need no webhook), then the HTTPS server, then the certificate checks."""

    RETRY_FIRST = 1.0
    RETRY_MAX = 30.0

    def __init__(self, config: OperatorConfig, kube_config: KubeConfig, metrics: OperatorMetrics) -> None:
        assert config.webhook is not None
        self.hook = config.webhook
        # Connections of its own: an admission has 5 s and, timed out, refuses the pod
        # (failurePolicy Fail), so its reads must not queue in the pool behind a burst of reconciles.
        self.client = client = KubeClient(kube_config, user_agent="singleton-operator-webhook")
        self.source: certs.CertificateSource
        if self.hook.cert_dir is not None:
            self.source = certs.DirectorySource(Path(self.hook.cert_dir))
        else:
            names = [*certs.service_names(self.hook.service, config.lease_namespace), *self.hook.extra_names]
            self.source = certs.SecretSource(certs.SecretStore(client, config.lease_namespace, self.hook.secret, names),
                                             self.hook.configuration)
        # Only its spec reader (spec_of) is used: it never reconciles, so its marks are never served.
        readers = Reconciler(client=client, sidecar_image=config.sidecar_image, metrics=metrics, marks=RefreshMarks(),
                             sidecar_pull_policy=config.sidecar_pull_policy,
                             image_pull_secrets=config.image_pull_secrets)
        self.admission = PodAdmission(client, readers.spec_of, metrics.admission_seconds.observe)
        self.runner: web.AppRunner | None = None
        self.task: asyncio.Task[None] | None = None
        self.problem: str | None = "pod webhook: getting its certificate"

    def not_ready(self) -> str | None:
        return self.problem

    def start(self) -> None:
        self.task = asyncio.create_task(self._serve(), name="pod-webhook")

    async def _serve(self) -> None:
        serving = certs.ServingContext()
        delay = self.RETRY_FIRST
        while True:
            try:
                await self.source.refresh(serving)
                break
            except (KubeError, OSError, ssl.SSLError, ValueError, KeyError) as exc:
                self.problem = f"pod webhook: no certificate yet: {exc}"
                log.error("pod webhook certificate not ready", extra={"error": exc, "retry_seconds": delay})
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.RETRY_MAX)
        self.runner = web.AppRunner(self.admission.app(), access_log=None)
        await self.runner.setup()
        listen, delay = f"{self.hook.listen.host}:{self.hook.listen.port}", self.RETRY_FIRST
        while True:
            try:
                await web.TCPSite(self.runner, self.hook.listen.host, self.hook.listen.port,
                                  ssl_context=serving.context).start()
                break
            except OSError as exc:  # the port taken (another process, a replica's not yet gone)
                self.problem = f"pod webhook: cannot listen on {listen}: {exc.strerror or exc}"
                log.error("pod webhook cannot listen (--webhook-listen)",
                          extra={"listen": listen, "error": exc.strerror or str(exc), "retry_seconds": delay})
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.RETRY_MAX)
        self.problem = None
        log.info("pod webhook serving",
                 extra={"listen": f"{self.hook.listen.host}:{self.hook.listen.port}", "path": WEBHOOK_PATH})
        await certs.keep_fresh(self.source, serving)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.runner is not None:
            await self.runner.cleanup()
        await self.client.close()


async def _election_ended(election: asyncio.Task[None]) -> None:
    """Wait up to 10 s for the draining election (then cancelled); whatever ended it, the
    caller's clean-up runs next."""
    try:
        await asyncio.wait_for(election, timeout=10)
    except (asyncio.CancelledError, TimeoutError):
        pass
    except Exception:
        log.exception("the operator's election ended with an error")


async def _first(*events: asyncio.Event) -> asyncio.Event:
    waiters = {asyncio.create_task(e.wait()): e for e in events}
    done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return waiters[next(iter(done))]


async def _run_kopf_while_leading(config: OperatorConfig, client: KubeClient, metrics: OperatorMetrics,
                                  lost: asyncio.Event, stopping: asyncio.Event, *,
                                  expiration: Callable[[], dt.datetime | None]) -> int:
    # The reconciler marks the groups it reconciled, the watches those whose pods changed;
    # the refresher writes their status from what the reconciler kept.
    marks = RefreshMarks()
    reconciler = Reconciler(client=client, sidecar_image=config.sidecar_image, metrics=metrics, marks=marks,
                            sidecar_pull_policy=config.sidecar_pull_policy,
                            image_pull_secrets=config.image_pull_secrets,
                            webhook_serving=config.webhook is not None, operator_namespace=config.lease_namespace,
                            postgres_connection_check=config.postgres_connection_check)
    refresher = Refresher(client=client, metrics=metrics, reconciler=reconciler, marks=marks)
    watch_client = KubeClient(client.config, user_agent="singleton-operator-watches")
    loop = asyncio.get_running_loop()
    stop_flag: asyncio.Future[None] = loop.create_future()
    ready_flag: asyncio.Future[None] = loop.create_future()
    kopf_task = asyncio.create_task(kopf.operator(
        registry=registry(client.config, expiration), memo=kopf.Memo(reconciler=reconciler),
        stop_flag=stop_flag, ready_flag=ready_flag, clusterwide=not config.namespaces,
        namespaces=list(config.namespaces), standalone=True,
    ), name="kopf")
    helpers = [asyncio.create_task(refresher.run_refresher(), name="status-refresher"),
               asyncio.create_task(refresher.run_periodic(config.namespaces), name="periodic-refresh"),
               # A client of their own: each watch holds a connection for minutes, which would
               # leave the reconciler fewer of the client's (two per watched namespace).
               *group_watches(watch_client, config.namespaces, marks, reconciler)]
    try:
        await _first(_future_event(ready_flag), _done_event(kopf_task))
        # kopf installs its own SIGTERM handler; ours must decide the order of shutdown.
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        helpers_ended = [_done_event(task) for task in helpers]
        ended = await _first(lost, stopping, _done_event(kopf_task), *helpers_ended)
        if ended in helpers_ended:
            # The status refreshers and the watches catch every error; one that ended is a bug:
            # the replica exits (and the standby takes over) rather than lead with stale statuses.
            task = helpers[helpers_ended.index(ended)]
            log.error("a status task ended", extra={"task": task.get_name(),
                                                    "error": task.exception() if not task.cancelled() else "cancelled"})
            return 1
        if ended is lost:
            log.error("lost the operator lease: stopping kopf at once and exiting")
            return EXIT_LOST_LEADERSHIP
        if ended is stopping:
            log.info("stopping: kopf first, then the lease is released")
            stop_flag.set_result(None)
            # Handlers are idempotent: a short grace, then cancel whatever still runs.
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(kopf_task), timeout=KOPF_STOP_GRACE)
            return 0
        log.error("kopf ended on its own",
                  extra={"error": kopf_task.exception() if not kopf_task.cancelled() else "cancelled"})
        return 1
    finally:
        for task in (*helpers, kopf_task):
            task.cancel()
        await asyncio.gather(*helpers, kopf_task, return_exceptions=True)
        await reconciler.close()
        await watch_client.close()


def _future_event(future: asyncio.Future[None]) -> asyncio.Event:
    event = asyncio.Event()
    future.add_done_callback(lambda _f: event.set())
    return event


def _done_event(task: asyncio.Task[None]) -> asyncio.Event:
    event = asyncio.Event()
    task.add_done_callback(lambda _t: event.set())
    return event
