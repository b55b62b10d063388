"""The webhook's certificate (``singleton_operator.certs``): made, shared through a Secret of the
real API server, renewed, put into a real MutatingWebhookConfiguration's caBundle, and
served by a live TLS server that picks up a renewed certificate without a restart."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import json
import socket
import ssl
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from singleton_election.kube import KubeClient, load_kube_config
from singleton_operator import certs
from singleton_operator.runtime import WebhookConfig
from singleton_testbed.harness.kubehelpers import get_json
from singleton_testbed.procs import free_port
from tests.conftest import Cluster

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


async def test_the_ca_goes_into_every_webhook_of_the_configuration(cluster: Cluster,
                                                                    webhook_configuration: str) -> None:
    bundle = certs.new_bundle(NAMES, NOW)
    async with KubeClient(load_kube_config(str(cluster.kubeconfig))) as client:
        assert await certs.patch_ca_bundle(client, webhook_configuration, bundle.ca_cert) is True
        assert await certs.patch_ca_bundle(client, webhook_configuration, bundle.ca_cert) is False
    assert ca_bundles(cluster, webhook_configuration) == [bundle.ca_cert] * 2


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


def cas_of(pem: bytes) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(pem)


def test_the_ca_is_rotated_a_year_before_it_expires_and_the_old_one_kept_until_it_does() -> None:
    first = certs.new_bundle(NAMES, NOW)
    ca_end = cas_of(first.ca_cert)[0].not_valid_after_utc
    # A serving certificate issued a month before the CA is due, as a renewal would.
    cert, key = certs.issue(first.ca_cert, first.ca_key, NAMES, ca_end - certs.CA_RENEW_BEFORE - dt.timedelta(days=30))
    current = certs.Bundle(ca_cert=first.ca_cert, ca_key=first.ca_key, cert=cert, key=key)
    assert not certs.renewal_due(current, NAMES, ca_end - certs.CA_RENEW_BEFORE - dt.timedelta(days=1))

    due = ca_end - certs.CA_RENEW_BEFORE + dt.timedelta(days=1)
    assert certs.renewal_due(current, NAMES, due)
    rotated = certs.renewed(current, NAMES, due)
    certs.check(rotated)
    new_ca, old_ca = cas_of(rotated.ca_cert)
    assert old_ca == cas_of(first.ca_cert)[0] and new_ca != old_ca and rotated.ca_key != first.ca_key
    assert new_ca.not_valid_after_utc - due >= certs.CA_LIFETIME - dt.timedelta(minutes=5)
    # The serving certificate was not due: it stays (the API server trusts the new CA first).
    assert rotated.cert == current.cert
    assert not certs.renewal_due(rotated, NAMES, due + dt.timedelta(days=1))

    # Its own renewal comes from the new CA, while the old CA is still in the bundle.
    later = ca_end - dt.timedelta(days=100)
    assert certs.renewal_due(rotated, NAMES, later)
    served = certs.renewed(rotated, NAMES, later)
    x509.load_pem_x509_certificate(served.cert).verify_directly_issued_by(new_ca)
    assert cas_of(served.ca_cert) == [new_ca, old_ca] and served.ca_key == rotated.ca_key

    # The old CA expired: it goes, and nothing else changes.
    after = ca_end + dt.timedelta(days=1)
    assert certs.renewal_due(served, NAMES, after)
    pruned = certs.renewed(served, NAMES, after)
    assert cas_of(pruned.ca_cert) == [new_ca]
    assert (pruned.cert, pruned.key, pruned.ca_key) == (served.cert, served.key, served.ca_key)
    assert not certs.renewal_due(pruned, NAMES, after)


def test_a_serving_certificate_never_outlives_its_ca() -> None:
    bundle = certs.new_bundle(NAMES, NOW)
    ca_end = cas_of(bundle.ca_cert)[0].not_valid_after_utc
    cert, _key = certs.issue(bundle.ca_cert, bundle.ca_key, NAMES, ca_end - dt.timedelta(days=100))
    assert x509.load_pem_x509_certificate(cert).not_valid_after_utc == ca_end


def test_a_bundle_whose_parts_do_not_belong_together_is_refused() -> None:
    bundle = certs.new_bundle(NAMES, NOW)
    certs.check(bundle)
    other = certs.new_bundle(NAMES, NOW)
    with pytest.raises(ValueError, match="private key"):
        certs.check(dataclasses.replace(bundle, key=other.key))
    with pytest.raises(ValueError, match="private key"):
        certs.check(dataclasses.replace(bundle, ca_key=other.ca_key))
    with pytest.raises(ValueError, match="none of the CAs"):
        certs.check(dataclasses.replace(bundle, cert=other.cert, key=other.key))


class Clock:
    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture
def webhook_configuration(cluster: Cluster) -> Iterator[str]:
    """A real MutatingWebhookConfiguration with two webhooks that match nothing (and would be
    ignored if they did), deleted after the test."""
    name = "singleton-certs-" + uuid.uuid4().hex[:6]
    hook = {"admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Ignore",
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
            "namespaceSelector": {"matchLabels": {"singleton.dev/matches": "nothing"}},
            "clientConfig": {"url": "https://127.0.0.1:1/mutate-pods"}}
    cluster.apply(json.dumps({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                              "metadata": {"name": name},
                              "webhooks": [{**hook, "name": "a.singleton.dev"}, {**hook, "name": "b.singleton.dev"}]}))
    yield name
    cluster.kubectl("delete", "mutatingwebhookconfiguration", name, "--ignore-not-found")


def ca_bundles(cluster: Cluster, configuration: str) -> list[bytes]:
    webhooks = get_json(cluster, "mutatingwebhookconfiguration", configuration)["webhooks"]
    return [base64.b64decode(w["clientConfig"]["caBundle"]) for w in webhooks]


async def serve(context: ssl.SSLContext) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    return runner, port


def same_certificate(a: bytes, b: bytes) -> bool:
    return x509.load_pem_x509_certificate(a) == x509.load_pem_x509_certificate(b)


async def test_the_secret_s_renewals_reach_a_live_server_and_the_configuration(
        cluster: Cluster, namespace: str, webhook_configuration: str) -> None:
    """The operator's own path, as each replica runs it: the Secret, the caBundle, the server."""
    real_now = dt.datetime.now(dt.UTC)  # a client checks the dates
    clock = Clock(real_now - dt.timedelta(days=250))  # a certificate with 115 of its 365 days left now
    async with KubeClient(load_kube_config(str(cluster.kubeconfig))) as client:
        source = certs.SecretSource(certs.SecretStore(client, namespace, "hook-tls", NAMES, clock=clock),
                                    webhook_configuration)
        serving = certs.ServingContext()
        await source.refresh(serving)
        first = await source.store.ensure()
        assert ca_bundles(cluster, webhook_configuration) == [first.ca_cert] * 2
        runner, port = await serve(serving.context)
        try:
            served = await asyncio.to_thread(served_certificate, port, first.ca_cert)
            assert same_certificate(served, first.cert)

            # A third of its life left: the next check renews it, and the running server serves the new one.
            clock.now = real_now
            await source.refresh(serving)
            second = await source.store.ensure()
            assert second.cert != first.cert and second.ca_cert == first.ca_cert
            served = await asyncio.to_thread(served_certificate, port, first.ca_cert)
            assert same_certificate(served, second.cert)

            # A failed load (a mismatched pair) leaves the server serving what it served.
            with pytest.raises(ssl.SSLError):
                serving.load(first.cert, second.key)
            served = await asyncio.to_thread(served_certificate, port, first.ca_cert)
            assert same_certificate(served, second.cert)

            # Another Secret whose CA is within a year of its end (and whose certificate is long
            # expired): a new CA signs the new certificate, both CAs reach the configuration.
            clock.now = real_now - certs.CA_LIFETIME + dt.timedelta(days=300)
            old = certs.SecretSource(certs.SecretStore(client, namespace, "old-tls", NAMES, clock=clock),
                                     webhook_configuration)
            aged = await old.store.ensure()
            clock.now = real_now
            await old.refresh(serving)
            rotated = await old.store.ensure()
            new_ca, old_ca = cas_of(rotated.ca_cert)
            assert old_ca == cas_of(aged.ca_cert)[0] and new_ca != old_ca
            assert ca_bundles(cluster, webhook_configuration) == [rotated.ca_cert] * 2
            served = await asyncio.to_thread(served_certificate, port, new_ca.public_bytes(Encoding.PEM))
            assert same_certificate(served, rotated.cert)
            # The old CA alone no longer vouches for what is served.
            with pytest.raises(ssl.SSLCertVerificationError):
                await asyncio.to_thread(served_certificate, port, aged.ca_cert)
        finally:
            await runner.cleanup()


async def test_the_check_loop_survives_failures_and_picks_up_a_renewal(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    first = certs.new_bundle(NAMES, now)
    folder = tmp_path / "mounted"
    folder.mkdir()
    (folder / "tls.crt").write_bytes(first.cert)
    (folder / "tls.key").write_bytes(first.key)
    source = certs.DirectorySource(folder, interval=0.05)
    serving = certs.ServingContext()
    await source.refresh(serving)
    fingerprint = serving.fingerprint
    loop = asyncio.create_task(certs.keep_fresh(source, serving))
    try:
        # Half a renewal on disk (the certificate without its key), then a missing file: logged, not fatal.
        second = certs.renewed(first, NAMES, now + dt.timedelta(days=300))
        (folder / "tls.crt").write_bytes(second.cert)
        await asyncio.sleep(0.3)
        assert serving.fingerprint == fingerprint and not loop.done()
        (folder / "tls.key").unlink()
        await asyncio.sleep(0.3)
        assert serving.fingerprint == fingerprint and not loop.done()
        (folder / "tls.key").write_bytes(second.key)
        for _ in range(100):
            if serving.fingerprint != fingerprint:
                break
            await asyncio.sleep(0.05)
        assert serving.fingerprint != fingerprint and not loop.done()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


def test_the_webhook_flags_are_read_and_bad_ones_refused_naming_the_flag(tmp_path: Path) -> None:
    from singleton_election.settings import ConfigError
    from singleton_operator.cli import load, parser

    def webhook(*argv: str, environ: dict[str, str] | None = None) -> WebhookConfig | None:
        return load(parser().parse_args(["run", *argv]), environ or {}).webhook

    assert webhook() is None  # off unless asked (the chart asks)
    config = webhook("--webhook-listen", "0.0.0.0:9443", "--webhook-config", "demo-singleton-operator",
                     "--webhook-extra-name", "127.0.0.1", "--webhook-extra-name", "hook.example.org")
    assert config is not None
    assert (config.listen.host, config.listen.port, config.service, config.secret, config.configuration,
            config.cert_dir, config.extra_names) == (
        "0.0.0.0", 9443, "singleton-operator-webhook", "singleton-operator-webhook-tls", "demo-singleton-operator",
        None, ("127.0.0.1", "hook.example.org"))
    from_env = webhook(environ={"SINGLETON_WEBHOOK_LISTEN": "127.0.0.1:8443", "SINGLETON_WEBHOOK_SERVICE": "hook",
                                "SINGLETON_WEBHOOK_SECRET": "hook.tls", "SINGLETON_WEBHOOK_CERT_DIR": str(tmp_path)})
    assert from_env is not None
    assert (from_env.listen.port, from_env.service, from_env.secret, from_env.cert_dir) == (
        8443, "hook", "hook.tls", str(tmp_path))

    listen = ["--webhook-listen", "0.0.0.0:9443"]
    for argv, refusal in [
        (["--webhook-listen", "0.0.0.0:99999"], r"^--webhook-listen \(SINGLETON_WEBHOOK_LISTEN\)"),
        ([*listen, "--webhook-service", "hook.svc"], r"^--webhook-service \(SINGLETON_WEBHOOK_SERVICE\): 'hook.svc'"),
        ([*listen, "--webhook-secret", "Hook_TLS"], r"^--webhook-secret \(SINGLETON_WEBHOOK_SECRET\): 'Hook_TLS'"),
        ([*listen, "--webhook-config", "x_y"], r"^--webhook-config \(SINGLETON_WEBHOOK_CONFIG\): 'x_y'"),
        ([*listen, "--webhook-cert-dir", str(tmp_path / "none")],
         r"^--webhook-cert-dir \(SINGLETON_WEBHOOK_CERT_DIR\)"),
        ([*listen, "--webhook-extra-name", "*.example.org"], r"^--webhook-extra-name: '\*.example.org'"),
        ([*listen, "--webhook-extra-name", "300.1.1.1:80"], r"^--webhook-extra-name: '300.1.1.1:80'"),
        (["--webhook-config", "hook"], r"^--webhook-config: the webhook is off without --webhook-listen"),
        ([*listen, "--webhook-cert-dir", str(tmp_path), "--webhook-secret", "x"],
         r"^--webhook-secret: not used with --webhook-cert-dir"),
    ]:
        with pytest.raises(ConfigError, match=refusal):
            webhook(*argv)


def test_a_bad_webhook_flag_exits_2_with_one_line() -> None:
    result = subprocess.run([sys.executable, "-m", "singleton_operator.cli", "run", "--webhook-listen", "0.0.0.0:9443",
                             "--webhook-extra-name", "bad name"], capture_output=True, text=True, timeout=30,
                            check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "singleton-operator: error: --webhook-extra-name: 'bad name' is neither a DNS name nor an IP address"]
