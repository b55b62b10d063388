"""The webhook's certificate (``singleton_operator.certs``): made, shared through a Secret of the
real API server, renewed, put into a real MutatingWebhookConfiguration's caBundle, and
served by a live TLS server that picks up a renewed certificate without a restart."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import socket
import ssl
import uuid
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509

from singleton_operator import certs
from singleton_sidecar.kube import KubeClient, load_kube_config
from singleton_testbed.procs import free_port
from tests.conftest import Cluster
from tests.kubehelpers import get_json

NOW = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)
NAMES = [*certs.service_names("hook", "ops"), "127.0.0.1"]


def names_of(cert_pem: bytes) -> set[str]:
    sans = x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return {str(n) for n in sans.value.get_values_for_type(x509.DNSName)} | {
        str(n) for n in sans.value.get_values_for_type(x509.IPAddress)}


def test_a_bundle_names_the_service_and_is_signed_by_its_ca() -> None:
    bundle = certs.new_bundle(NAMES, NOW)
    assert names_of(bundle.cert) == {"hook", "hook.ops", "hook.ops.svc", "hook.ops.svc.cluster.local", "127.0.0.1"}
    cert, ca = x509.load_pem_x509_certificate(bundle.cert), x509.load_pem_x509_certificate(bundle.ca_cert)
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.not_valid_after_utc - NOW == certs.CERT_LIFETIME
    assert certs.Bundle.from_secret_data(bundle.as_secret_data()) == bundle


def test_renewal_is_due_with_a_third_of_the_life_left_or_a_name_missing() -> None:
    bundle = certs.new_bundle(NAMES, NOW)
    assert not certs.renewal_due(bundle, NAMES, NOW)
    two_thirds = NOW - dt.timedelta(minutes=5) + certs.CERT_LIFETIME * 2 / 3
    assert not certs.renewal_due(bundle, NAMES, two_thirds - dt.timedelta(hours=1))
    assert certs.renewal_due(bundle, NAMES, two_thirds + dt.timedelta(hours=1))
    assert certs.renewal_due(bundle, [*NAMES, "hook.other.svc"], NOW)
    renewed = certs.renewed(bundle, NAMES, NOW + dt.timedelta(days=300))
    assert renewed.ca_cert == bundle.ca_cert and renewed.cert != bundle.cert
    x509.load_pem_x509_certificate(renewed.cert).verify_directly_issued_by(
        x509.load_pem_x509_certificate(bundle.ca_cert))


async def test_replicas_share_one_secret_and_renew_it_once(cluster: Cluster, namespace: str) -> None:
    config = load_kube_config(str(cluster.kubeconfig))
    async with KubeClient(config) as first, KubeClient(config) as second:
        stores = [certs.SecretStore(client, namespace, "hook-tls", NAMES) for client in (first, second)]
        made = await asyncio.gather(*(store.ensure(NOW) for store in stores))
        assert made[0] == made[1], "two replicas starting at once serve different certificates"
        secret = get_json(cluster, "secret", "hook-tls", "-n", namespace)
        assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"ca.crt", "ca.key", "tls.crt",
                                                                                  "tls.key"}
        assert await stores[1].ensure(NOW + dt.timedelta(days=10)) == made[0]
        late = NOW + dt.timedelta(days=300)
        renewed = await asyncio.gather(*(store.ensure(late) for store in stores))
        assert renewed[0] == renewed[1] and renewed[0].cert != made[0].cert
        assert renewed[0].ca_cert == made[0].ca_cert
        # Damaged (not ours): made anew rather than served broken.
        cluster.kubectl("patch", "secret", "hook-tls", "-n", namespace, "--type=merge", "-p",
                        json.dumps({"data": {"tls.crt": base64.b64encode(b"junk").decode()}}))
        fresh = await stores[0].ensure(late)
        assert fresh.ca_cert != made[0].ca_cert and names_of(fresh.cert) == set(NAMES)


async def test_the_ca_goes_into_every_webhook_of_the_configuration(cluster: Cluster, namespace: str) -> None:
    name = "singleton-certs-" + uuid.uuid4().hex[:6]
    hook = {"admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Ignore",
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
            "namespaceSelector": {"matchLabels": {"singleton.dev/matches": "nothing"}},
            "clientConfig": {"url": "https://127.0.0.1:1/mutate-pods"}}
    configuration = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                     "metadata": {"name": name},
                     "webhooks": [{**hook, "name": "a.singleton.dev"}, {**hook, "name": "b.singleton.dev"}]}
    cluster.apply(json.dumps(configuration))
    try:
        bundle = certs.new_bundle(NAMES, NOW)
        async with KubeClient(load_kube_config(str(cluster.kubeconfig))) as client:
            assert await certs.patch_ca_bundle(client, name, bundle.ca_cert) is True
            assert await certs.patch_ca_bundle(client, name, bundle.ca_cert) is False
        webhooks = get_json(cluster, "mutatingwebhookconfiguration", name)["webhooks"]
        assert [base64.b64decode(w["clientConfig"]["caBundle"]) for w in webhooks] == [bundle.ca_cert] * 2
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", name, "--ignore-not-found")


def served_certificate(port: int, ca: bytes) -> bytes:
    """The certificate the server presents, verified against ``ca`` for the name 127.0.0.1."""
    context = ssl.create_default_context(cadata=ca.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return ssl.DER_cert_to_PEM_cert(der).encode()


async def ok(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_a_renewed_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)  # a client checks the dates
    first = certs.new_bundle(NAMES, now)
    folder = tmp_path / "mounted"
    folder.mkdir()
    (folder / "tls.crt").write_bytes(first.cert)
    (folder / "tls.key").write_bytes(first.key)
    source = certs.DirectorySource(folder)
    serving = certs.ServingContext()
    await source.refresh(serving)
    app = web.Application()
    app.router.add_get("/", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=serving.context).start()
    try:
        served = await asyncio.to_thread(served_certificate, port, first.ca_cert)
        assert x509.load_pem_x509_certificate(served) == x509.load_pem_x509_certificate(first.cert)
        # cert-manager renews the mounted Secret: the next check loads it, the server runs on.
        second = certs.renewed(first, NAMES, now)
        (folder / "tls.crt").write_bytes(second.cert)
        (folder / "tls.key").write_bytes(second.key)
        await source.refresh(serving)
        served = await asyncio.to_thread(served_certificate, port, first.ca_cert)
        assert x509.load_pem_x509_certificate(served) == x509.load_pem_x509_certificate(second.cert)
        # A client that trusts another CA is refused.
        other = certs.new_bundle(NAMES, now)
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.to_thread(served_certificate, port, other.ca_cert)
    finally:
        await runner.cleanup()
