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
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import kopf
from aiohttp import web

from singleton_operator import certs
from singleton_operator.groups import Groups
from singleton_operator.handlers import registry
from singleton_operator.metrics import OperatorMetrics
from singleton_operator.webhook import PATH as WEBHOOK_PATH
from singleton_operator.webhook import PodAdmission
from singleton_sidecar.backends.lease import LeaseBackend
from singleton_sidecar.config import Listen
from singleton_sidecar.core.elector import Elector
from singleton_sidecar.core.lock import Identity
from singleton_sidecar.core.status import ElectionStatus, Role
from singleton_sidecar.core.timings import BACKEND_DEFAULTS
from singleton_sidecar.kube import KubeClient, load_kube_config

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


def health_app(elector: Elector, metrics: OperatorMetrics) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        stalled = elector.clock.monotonic() - elector.last_progress
        limit = 2 * elector.timings.lease_duration + elector.timings.retry_period
        if stalled > limit:
            return web.Response(status=503, text=f"election loop stalled for {stalled:.1f}s\n")
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        return web.Response(text=f"{elector.status.role.value}\n")

    async def metrics_handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    return app


async def run_operator(config: OperatorConfig) -> int:
    client = KubeClient(load_kube_config(config.kubeconfig), user_agent="singleton-operator")
    metrics = OperatorMetrics()
    backend = LeaseBackend(client=client, namespace=config.lease_namespace, name=LEASE_NAME,
                           lease_duration=BACKEND_DEFAULTS["lease"].lease_duration)
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
    health = web.AppRunner(health_app(elector, metrics), access_log=None)
    await health.setup()
    await web.TCPSite(health, config.health_listen.host, config.health_listen.port).start()
    # Before the election: every replica answers the webhook, leading or not (webhook.py).
    webhook = await _start_webhook(config, client, metrics) if config.webhook else None
    election = asyncio.create_task(elector.run(), name="operator-election")
    exit_code = 0
    try:
        log.info("campaigning for lease %s/%s as %s", config.lease_namespace, LEASE_NAME, config.identity)
        if await _first(leading, stopping) is leading:
            log.info("leading: starting kopf (namespaces: %s)", ", ".join(config.namespaces) or "all")
            kopf_stopped.clear()
            try:
                exit_code = await _run_kopf_while_leading(config, client, metrics, lost, stopping)
            finally:
                kopf_stopped.set()
    finally:
        elector.request_drain()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(election, timeout=10)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if webhook is not None:
            await webhook.stop()
        await health.cleanup()
        await backend.close()
        await client.close()
    return exit_code


@dataclass
class RunningWebhook:
    runner: web.AppRunner
    certificate_checks: asyncio.Task[None]

    async def stop(self) -> None:
        self.certificate_checks.cancel()
        await asyncio.gather(self.certificate_checks, return_exceptions=True)
        await self.runner.cleanup()


async def _start_webhook(config: OperatorConfig, client: KubeClient, metrics: OperatorMetrics) -> RunningWebhook:
    """Serve the pod webhook with a certificate that is ready before the first request."""
    hook = config.webhook
    assert hook is not None
    source: certs.CertificateSource
    if hook.cert_dir is not None:
        source = certs.DirectorySource(Path(hook.cert_dir))
    else:
        names = [*certs.service_names(hook.service, config.lease_namespace), *hook.extra_names]
        source = certs.SecretSource(certs.SecretStore(client, config.lease_namespace, hook.secret, names),
                                    hook.configuration)
    serving = certs.ServingContext()
    await source.refresh(serving)
    readers = Groups(client=client, sidecar_image=config.sidecar_image, metrics=metrics,
                     sidecar_pull_policy=config.sidecar_pull_policy, image_pull_secrets=config.image_pull_secrets)
    admission = PodAdmission(client, readers.spec_of, metrics.admission_seconds.observe)
    runner = web.AppRunner(admission.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, hook.listen.host, hook.listen.port, ssl_context=serving.context).start()
    log.info("pod webhook serving listen=%s:%d path=%s", hook.listen.host, hook.listen.port, WEBHOOK_PATH)
    checks = asyncio.create_task(certs.keep_fresh(source, serving), name="webhook-certificate")
    return RunningWebhook(runner, checks)


async def _first(*events: asyncio.Event) -> asyncio.Event:
    waiters = {asyncio.create_task(e.wait()): e for e in events}
    done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return waiters[next(iter(done))]


async def _run_kopf_while_leading(config: OperatorConfig, client: KubeClient, metrics: OperatorMetrics,
                                  lost: asyncio.Event, stopping: asyncio.Event) -> int:
    groups = Groups(client=client, sidecar_image=config.sidecar_image, metrics=metrics,
                    sidecar_pull_policy=config.sidecar_pull_policy, image_pull_secrets=config.image_pull_secrets,
                    webhook_serving=config.webhook is not None, operator_namespace=config.lease_namespace)
    loop = asyncio.get_running_loop()
    stop_flag: asyncio.Future[None] = loop.create_future()
    ready_flag: asyncio.Future[None] = loop.create_future()
    kopf_task = asyncio.create_task(kopf.operator(
        registry=registry(client.config), memo=kopf.Memo(groups=groups), stop_flag=stop_flag,
        ready_flag=ready_flag, clusterwide=not config.namespaces, namespaces=list(config.namespaces),
        standalone=True,
    ), name="kopf")
    helpers = [asyncio.create_task(groups.run_refresher(), name="status-refresher"),
               asyncio.create_task(groups.run_periodic(config.namespaces), name="periodic-refresh")]
    try:
        await _first(_future_event(ready_flag), _done_event(kopf_task))
        # kopf installs its own SIGTERM handler; ours must decide the order of shutdown.
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        ended = await _first(lost, stopping, _done_event(kopf_task))
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
        log.error("kopf ended on its own: %s", kopf_task.exception() if not kopf_task.cancelled() else "cancelled")
        return 1
    finally:
        for task in (*helpers, kopf_task):
            task.cancel()
        await asyncio.gather(*helpers, kopf_task, return_exceptions=True)


def _future_event(future: asyncio.Future[None]) -> asyncio.Event:
    event = asyncio.Event()
    future.add_done_callback(lambda _f: event.set())
    return event


def _done_event(task: asyncio.Task[None]) -> asyncio.Event:
    event = asyncio.Event()
    task.add_done_callback(lambda _t: event.set())
    return event
