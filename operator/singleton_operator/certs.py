"""The webhook's TLS: a CA and a serving certificate the operator makes, keeps in a Secret,
renews, and serves without a restart.

Every operator replica serves the webhook, so all serve the same certificate: the first to
start creates the Secret (a replica that loses that race reads the winner's), each renews it
when a third of its life is left (one wins the update by ``resourceVersion``; the others read
it), and each reloads its ``ssl.SSLContext`` in place when the Secret's certificate changes.
The CA (ten years) goes into the MutatingWebhookConfiguration's ``caBundle``; deleting the
Secret makes a new CA, which the operator puts there too.

A year before the CA expires, a new CA takes over the signing: ``ca.crt`` then holds both
(the signer first) until the old one expires, so the certificate the old CA signed stays
trusted while replicas still serve it; the old CA's key is dropped at once, so it signs nothing
more. The serving certificate is renewed by its own rule (a third of its life left), by then
long after the new CA reached ``caBundle``; and each replica puts the CAs into ``caBundle``
before it loads a certificate, so the API server trusts a signer before it meets its work.

With cert-manager (``--webhook-cert-dir``, the chart's ``webhook.certManager``), the
certificate comes from a mounted Secret that cert-manager renews; the operator reloads the
files when they change and leaves ``caBundle`` to cert-manager's CA injector.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import ipaddress
import logging
import os
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from singleton_election.kube import KubeClient, KubeConflict, KubeError, KubeNotFound

log = logging.getLogger(__name__)

CA_LIFETIME = dt.timedelta(days=3650)
CA_RENEW_BEFORE = dt.timedelta(days=365)
CERT_LIFETIME = dt.timedelta(days=365)
RENEW_WHEN_LEFT = 1 / 3
CHECK_INTERVAL = 3600.0
DIRECTORY_POLL = 60.0
"""cert-manager's files are on a local volume: cheap to read, so polled every minute."""
RETRY_INTERVAL = 30.0
"""After a failed check: sooner than the next regular one, so a brief outage costs little."""
CALL_TIMEOUT = 10.0
CA_KEY = "ca.key"


@dataclass(frozen=True)
class Bundle:
    """PEM bytes of the CAs and of the serving certificate with its key. ``ca_cert`` holds one
    CA, or during a CA rotation two: the signer (whose key is ``ca_key``) first."""

    ca_cert: bytes
    ca_key: bytes
    cert: bytes
    key: bytes

    def as_secret_data(self) -> dict[str, str]:
        return {k: base64.b64encode(v).decode() for k, v in (("ca.crt", self.ca_cert), (CA_KEY, self.ca_key),
                                                                 ("tls.crt", self.cert), ("tls.key", self.key))}

    @classmethod
    def from_secret_data(cls, data: dict[str, str]) -> Bundle:
        raw = {k: base64.b64decode(v) for k, v in data.items()}
        return cls(ca_cert=raw["ca.crt"], ca_key=raw[CA_KEY], cert=raw["tls.crt"], key=raw["tls.key"])


def service_names(service: str, namespace: str) -> list[str]:
    """The names the API server may use for a webhook Service."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca(now: dt.datetime) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "singleton-operator webhook CA")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + CA_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue(ca_cert: bytes, ca_key: bytes, names: list[str], now: dt.datetime) -> tuple[bytes, bytes]:
    """A serving certificate for ``names`` (DNS names, or IP addresses) signed by the CA (the
    first of ``ca_cert``), never valid longer than that CA."""
    ca = x509.load_pem_x509_certificates(ca_cert)[0]
    signer = serialization.load_pem_private_key(ca_key, password=None)
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + CERT_LIFETIME, ca.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(signer, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def new_bundle(names: list[str], now: dt.datetime) -> Bundle:
    ca_cert, ca_key = new_ca(now)
    cert, key = issue(ca_cert, ca_key, names, now)
    return Bundle(ca_cert=ca_cert, ca_key=ca_key, cert=cert, key=key)


def _issuer(bundle: Bundle) -> x509.Certificate | None:
    """The CA of the bundle that signed its serving certificate."""
    cert = x509.load_pem_x509_certificate(bundle.cert)
    for ca in x509.load_pem_x509_certificates(bundle.ca_cert):
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return ca
    return None


def check(bundle: Bundle) -> None:
    """Raise ``ValueError`` unless the bundle can be served: each key is its certificate's (the
    CA key the signer's) and one of the CAs signed the serving certificate."""
    signer = x509.load_pem_x509_certificates(bundle.ca_cert)[0]
    cert = x509.load_pem_x509_certificate(bundle.cert)
    for pem, public in ((bundle.key, cert.public_key()), (bundle.ca_key, signer.public_key())):
        private = serialization.load_pem_private_key(pem, password=None)
        if not isinstance(private, ec.EllipticCurvePrivateKey) or private.public_key() != public:
            raise ValueError("a private key does not match its certificate")
    if _issuer(bundle) is None:
        raise ValueError("the serving certificate was signed by none of the CAs")


def ca_renewal_due(bundle: Bundle, now: dt.datetime) -> bool:
    """Whether the signing CA is within ``CA_RENEW_BEFORE`` of its end, or an older CA of the
    bundle has expired (and is to go)."""
    cas = x509.load_pem_x509_certificates(bundle.ca_cert)
    return cas[0].not_valid_after_utc - now <= CA_RENEW_BEFORE or any(ca.not_valid_after_utc <= now for ca in cas)


def renewal_due(bundle: Bundle, names: list[str], now: dt.datetime) -> bool:
    """Whether anything of the bundle is due: the CA (``ca_renewal_due``), or the serving
    certificate (a third of its life or less left, a name missing, or its CA gone)."""
    return ca_renewal_due(bundle, now) or _serving_due(bundle, names, now)


def _serving_due(bundle: Bundle, names: list[str], now: dt.datetime) -> bool:
    cert = x509.load_pem_x509_certificate(bundle.cert)
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    if cert.not_valid_after_utc - now <= life * RENEW_WHEN_LEFT or _issuer(bundle) is None:
        return True
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    present = {str(n) for n in sans.get_values_for_type(x509.DNSName)}
    present |= {str(n) for n in sans.get_values_for_type(x509.IPAddress)}
    return not set(names) <= present


def renewed(bundle: Bundle, names: list[str], now: dt.datetime) -> Bundle:
    """The bundle with what is due made anew. A new CA signs from now on, the old one stays
    beside it until it expires; the serving certificate is renewed only if due itself."""
    ca_cert, ca_key = bundle.ca_cert, bundle.ca_key
    if ca_renewal_due(bundle, now):
        cas = x509.load_pem_x509_certificates(bundle.ca_cert)
        kept = b"".join(ca.public_bytes(serialization.Encoding.PEM) for ca in cas if ca.not_valid_after_utc > now)
        if cas[0].not_valid_after_utc - now <= CA_RENEW_BEFORE:
            signer, ca_key = new_ca(now)
            ca_cert = signer + kept
        else:
            ca_cert = kept  # only an expired older CA goes; the signer is first still
    result = Bundle(ca_cert=ca_cert, ca_key=ca_key, cert=bundle.cert, key=bundle.key)
    if _serving_due(result, names, now):
        cert, key = issue(ca_cert, ca_key, names, now)
        result = Bundle(ca_cert=ca_cert, ca_key=ca_key, cert=cert, key=key)
    return result


@dataclass
class SecretStore:
    """The bundle in a Secret of the operator's namespace, shared by its replicas."""

    client: KubeClient
    namespace: str
    name: str
    names: list[str]
    clock: Callable[[], dt.datetime] = field(default=lambda: dt.datetime.now(dt.UTC))
    """Now, for the renewal rules; tests move it."""

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/secrets/{self.name}"

    async def ensure(self, now: dt.datetime | None = None) -> Bundle:
        """The current bundle: created if there is none, renewed if due."""
        now = now or self.clock()
        for _ in range(5):
            try:
                secret = await self.client.request("GET", self.path, timeout=CALL_TIMEOUT)
            except KubeNotFound:
                bundle = new_bundle(self.names, now)
                body = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                        "metadata": {"name": self.name, "namespace": self.namespace,
                                     "labels": {"app.kubernetes.io/managed-by": "singleton-operator"}},
                        "data": bundle.as_secret_data()}
                try:
                    await self.client.request("POST", f"/api/v1/namespaces/{self.namespace}/secrets", body=body,
                                              timeout=CALL_TIMEOUT)
                except KubeConflict:
                    continue  # another replica made it first: use theirs
                log.info("webhook certificate created", extra={"secret": f"{self.namespace}/{self.name}"})
                return bundle
            try:
                bundle = Bundle.from_secret_data(secret.get("data") or {})
                check(bundle)
                due = renewal_due(bundle, self.names, now)
            except (KeyError, ValueError, TypeError) as exc:
                # Not ours, or damaged: made anew (the caBundle follows).
                log.warning("webhook certificate unreadable: making a new one",
                            extra={"secret": f"{self.namespace}/{self.name}", "error": exc})
                bundle, due = new_bundle(self.names, now), False
                if not await self._replace(secret, bundle):
                    continue
                return bundle
            if not due:
                return bundle
            fresh = renewed(bundle, self.names, now)
            if await self._replace(secret, fresh):
                log.info("webhook certificate renewed",
                         extra={"secret": f"{self.namespace}/{self.name}", "new_ca": fresh.ca_key != bundle.ca_key})
                return fresh
        raise KubeConflict(409, "Conflict", f"Secret {self.namespace}/{self.name} kept changing while it was renewed")

    async def _replace(self, secret: dict[str, Any], bundle: Bundle) -> bool:
        """Write ``bundle`` if the Secret is still the one read (False if another replica won):
        the PUT carries the ``resourceVersion`` read."""
        try:
            await self.client.request("PUT", self.path, body={**secret, "data": bundle.as_secret_data()},
                                      timeout=CALL_TIMEOUT)
        except KubeConflict:
            return False
        return True


async def patch_ca_bundle(client: KubeClient, configuration: str, ca_cert: bytes) -> bool:
    """Put the CA into every webhook of the MutatingWebhookConfiguration; whether it changed."""
    path = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{configuration}"
    current = await client.request("GET", path, timeout=CALL_TIMEOUT)
    wanted = base64.b64encode(ca_cert).decode()
    webhooks = current.get("webhooks") or []
    if all((w.get("clientConfig") or {}).get("caBundle") == wanted for w in webhooks):
        return False
    patch = [{"op": "replace" if "caBundle" in (w.get("clientConfig") or {}) else "add",
              "path": f"/webhooks/{index}/clientConfig/caBundle", "value": wanted}
             for index, w in enumerate(webhooks)]
    # The test op makes the patch fail (and the next check retry) if the list changed meanwhile.
    patch.insert(0, {"op": "test", "path": "/metadata/resourceVersion",
                     "value": current["metadata"]["resourceVersion"]})
    await client.request("PATCH", path, body=patch, content_type="application/json-patch+json",
                         timeout=CALL_TIMEOUT)
    log.info("webhook caBundle set", extra={"configuration": configuration})
    return True


class ServingContext:
    """An SSL context for the webhook server whose certificate can be replaced while it serves:
    ``load_cert_chain`` on the same context applies to every later handshake."""

    def __init__(self) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.fingerprint = ""

    def load(self, cert: bytes, key: bytes) -> bool:
        """Serve ``cert`` from now on; whether it differs from the one served. Raises
        ``ssl.SSLError`` (and the context serves on as before) if the pair does not load."""
        fingerprint = hashlib.sha256(cert + key).hexdigest()
        if fingerprint == self.fingerprint:
            return False
        # The ssl module loads only from files: a private folder, removed at once.
        with tempfile.TemporaryDirectory(prefix="singleton-webhook-") as folder:
            cert_file, key_file = Path(folder, "tls.crt"), Path(folder, "tls.key")
            for path, data in ((cert_file, cert), (key_file, key)):
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(descriptor, "wb") as out:
                    out.write(data)
            # A failed load_cert_chain leaves a context with the new certificate and no key, which
            # fails every handshake: a throwaway context proves the pair first.
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_file, key_file)
            self.context.load_cert_chain(cert_file, key_file)
        self.fingerprint = fingerprint
        return True


@dataclass
class SecretSource:
    """Certificates the operator makes (the default)."""

    store: SecretStore
    configuration: str | None
    interval: float = CHECK_INTERVAL

    async def refresh(self, serving: ServingContext) -> None:
        bundle = await self.store.ensure()
        # The CAs first: the API server must trust a new signer before this replica serves its work.
        # Should that fail, the certificate served meanwhile is valid still (renewal comes with a
        # third of its life left), and the next check, RETRY_INTERVAL later, tries both again.
        if self.configuration:
            await patch_ca_bundle(self.store.client, self.configuration, bundle.ca_cert)
        if serving.load(bundle.cert, bundle.key):
            log.info("webhook serving certificate loaded",
                     extra={"secret": f"{self.store.namespace}/{self.store.name}"})


@dataclass
class DirectorySource:
    """Certificates cert-manager writes into a mounted Secret (``tls.crt``, ``tls.key``)."""

    folder: Path
    interval: float = DIRECTORY_POLL

    async def refresh(self, serving: ServingContext) -> None:
        cert = (self.folder / "tls.crt").read_bytes()
        key = (self.folder / "tls.key").read_bytes()
        if serving.load(cert, key):
            log.info("webhook serving certificate loaded", extra={"folder": str(self.folder)})


CertificateSource = SecretSource | DirectorySource


async def keep_fresh(source: CertificateSource, serving: ServingContext, interval: float | None = None) -> None:
    """Check the certificate every ``interval`` seconds (the source's own by default); errors are
    logged and retried sooner (``RETRY_INTERVAL``), never raised: the server keeps the certificate
    it has meanwhile."""
    regular = source.interval if interval is None else interval
    wait = regular
    while True:
        await asyncio.sleep(wait)
        try:
            await source.refresh(serving)
        except (KubeError, OSError, ssl.SSLError, ValueError, KeyError, TypeError) as exc:
            # KeyError, TypeError: an object of an unexpected shape (a hand-edited configuration).
            wait = min(regular, RETRY_INTERVAL)
            log.warning("webhook certificate check failed; retrying", extra={"error": exc, "retry_seconds": wait})
        else:
            wait = regular
