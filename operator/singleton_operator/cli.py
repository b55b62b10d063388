"""``singleton-operator``: run the SingletonService operator.

    singleton-operator run [--namespace NS ...] [--health-listen HOST:PORT] [--sidecar-image IMAGE]

Settings: flags, then environment variables, then defaults. A bad setting exits with
status 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import re
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, cast

from singleton_election.early_stop import stop_on_sigterm_until_started
from singleton_election.kube import KubeConfigError
from singleton_election.logs import setup_logging
from singleton_election.settings import ConfigError, Listen, parse_listen
from singleton_operator import kopf_logs
from singleton_operator.model.spec import CONNECTION_CHECKS, ConnectionCheck

if TYPE_CHECKING:
    from singleton_operator.runtime import OperatorConfig, WebhookConfig

PROG = "singleton-operator"
DEFAULT_WEBHOOK_SERVICE = "singleton-operator-webhook"
DEFAULT_WEBHOOK_SECRET = "singleton-operator-webhook-tls"
DEFAULT_SIDECAR_IMAGE = "ghcr.io/singleton-dev/singleton:0.1.0"
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog=PROG, description="The singleton operator: reconciles SingletonServices.")
    sub = top.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="run the operator (one active replica; the others stand by)")
    run.add_argument("--namespace", action="append", default=None, metavar="NS",
                     help="watch only this namespace (repeatable; default: all) [SINGLETON_WATCH_NAMESPACES, "
                          "comma-separated]")
    run.add_argument("--health-listen", default=None, metavar="HOST:PORT",
                     help="/healthz /readyz /metrics (default 0.0.0.0:8080) [SINGLETON_OPERATOR_HEALTH_LISTEN]")
    run.add_argument("--sidecar-image", default=None, metavar="IMAGE",
                     help=f"sidecar image injected into workloads (default {DEFAULT_SIDECAR_IMAGE}) "
                          "[SINGLETON_SIDECAR_IMAGE]")
    run.add_argument("--sidecar-image-pull-policy", default=None, choices=PULL_POLICIES,
                     help="imagePullPolicy of the sidecar container in every group's pods (default: unset, "
                          "Kubernetes' default for the image) [SINGLETON_SIDECAR_IMAGE_PULL_POLICY]")
    run.add_argument("--sidecar-image-pull-secret", action="append", default=None, metavar="SECRET",
                     help="a Secret (in each group's namespace) added to every group's pods' imagePullSecrets, "
                          "for the sidecar's image (repeatable) [SINGLETON_SIDECAR_IMAGE_PULL_SECRETS, "
                          "comma-separated]")
    run.add_argument("--postgres-connection-check", default=None, choices=CONNECTION_CHECKS,
                     help="for groups that do not set spec.postgres.connectionCheck: whether the operator's own "
                          "connection to their database blocks them when it fails (default block), only warns, or "
                          "is not tried [SINGLETON_POSTGRES_CONNECTION_CHECK]")
    run.add_argument("--lease-namespace", default=None, metavar="NS",
                     help="namespace of the operator's own Lease (default: its own namespace) "
                          "[SINGLETON_OPERATOR_NAMESPACE]")
    run.add_argument("--identity", default=None, help="election identity (default: pod name + nonce) "
                                                      "[SINGLETON_OPERATOR_POD_NAME]")
    run.add_argument("--kubeconfig", default=None, help="kubeconfig outside a pod [KUBECONFIG]")
    hook = run.add_argument_group("pod webhook", "the mutating webhook that adds the sidecar to adopted workloads' "
                                                 "pods (docs/adoption.md); served by every replica")
    hook.add_argument("--webhook-listen", default=None, metavar="HOST:PORT",
                      help="serve the webhook (HTTPS) here; off when unset (the chart: 0.0.0.0:<webhook.port>) "
                           "[SINGLETON_WEBHOOK_LISTEN]")
    hook.add_argument("--webhook-service", default=None, metavar="NAME",
                      help=f"the webhook's Service, named in its certificate (default {DEFAULT_WEBHOOK_SERVICE}) "
                           "[SINGLETON_WEBHOOK_SERVICE]")
    hook.add_argument("--webhook-secret", default=None, metavar="NAME",
                      help="Secret (in the operator's namespace) holding the certificate the operator makes "
                           f"(default {DEFAULT_WEBHOOK_SECRET}) [SINGLETON_WEBHOOK_SECRET]")
    hook.add_argument("--webhook-config", default=None, metavar="NAME",
                      help="MutatingWebhookConfiguration whose caBundle the operator keeps (none when unset) "
                           "[SINGLETON_WEBHOOK_CONFIG]")
    hook.add_argument("--webhook-cert-dir", default=None, metavar="DIR",
                      help="read tls.crt and tls.key from here instead (cert-manager), polled each minute, reloaded "
                           "when they change "
                           "[SINGLETON_WEBHOOK_CERT_DIR]")
    hook.add_argument("--webhook-extra-name", action="append", default=None, metavar="NAME",
                      help="another DNS name or IP address for the certificate (repeatable)")
    run.add_argument("--log-format", default=None, choices=["json", "text"], help="default json")
    run.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"], help="default info")
    return top


def load(args: argparse.Namespace, environ: Mapping[str, str]) -> OperatorConfig:
    from singleton_operator.runtime import OperatorConfig  # kopf and aiohttp: after the early SIGTERM handler

    namespaces = args.namespace or [n for n in environ.get("SINGLETON_WATCH_NAMESPACES", "").split(",") if n]
    for namespace in namespaces:
        if not _DNS1123.match(namespace):
            raise ConfigError(f"--namespace (SINGLETON_WATCH_NAMESPACES): {namespace!r} is not a namespace name")
    lease_namespace = args.lease_namespace or environ.get("SINGLETON_OPERATOR_NAMESPACE") or "default"
    if not _DNS1123.match(lease_namespace):
        raise ConfigError(f"--lease-namespace (SINGLETON_OPERATOR_NAMESPACE): {lease_namespace!r} is not a "
                          "namespace name")
    listen_text = args.health_listen or environ.get("SINGLETON_OPERATOR_HEALTH_LISTEN")
    listen = parse_listen("--health-listen (SINGLETON_OPERATOR_HEALTH_LISTEN)", listen_text) if listen_text else Listen(
        "0.0.0.0", 8080)
    pull_policy = args.sidecar_image_pull_policy or environ.get("SINGLETON_SIDECAR_IMAGE_PULL_POLICY") or None
    if pull_policy is not None and pull_policy not in PULL_POLICIES:
        raise ConfigError(f"--sidecar-image-pull-policy (SINGLETON_SIDECAR_IMAGE_PULL_POLICY): must be Always, "
                          f"IfNotPresent or Never, got {pull_policy!r}")
    pull_secrets = args.sidecar_image_pull_secret or [
        s.strip() for s in environ.get("SINGLETON_SIDECAR_IMAGE_PULL_SECRETS", "").split(",") if s.strip()]
    for secret in pull_secrets:
        if len(secret) > 253 or not _DNS1123_SUBDOMAIN.match(secret):
            raise ConfigError(f"--sidecar-image-pull-secret (SINGLETON_SIDECAR_IMAGE_PULL_SECRETS): {secret!r} is "
                              "not a Secret name")
    connection_check = (args.postgres_connection_check or environ.get("SINGLETON_POSTGRES_CONNECTION_CHECK")
                        or "block")
    if connection_check not in CONNECTION_CHECKS:
        raise ConfigError(f"--postgres-connection-check (SINGLETON_POSTGRES_CONNECTION_CHECK): must be block, warn "
                          f"or skip, got {connection_check!r}")
    base = args.identity or environ.get("SINGLETON_OPERATOR_POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    webhook = _webhook(args, environ)
    return OperatorConfig(
        webhook=webhook,
        identity=f"{base}/{uuid.uuid4().hex[:8]}",
        lease_namespace=lease_namespace,
        namespaces=tuple(namespaces),
        sidecar_image=args.sidecar_image or environ.get("SINGLETON_SIDECAR_IMAGE") or DEFAULT_SIDECAR_IMAGE,
        health_listen=listen,
        kubeconfig=args.kubeconfig,
        sidecar_pull_policy=pull_policy,
        image_pull_secrets=tuple(dict.fromkeys(pull_secrets)),
        postgres_connection_check=cast("ConnectionCheck", connection_check),
    )


def _webhook(args: argparse.Namespace, environ: Mapping[str, str]) -> WebhookConfig | None:
    from singleton_operator.runtime import WebhookConfig

    listen_text = args.webhook_listen or environ.get("SINGLETON_WEBHOOK_LISTEN")
    if not listen_text:
        given = [flag for flag, value in (("--webhook-service", args.webhook_service),
                                          ("--webhook-secret", args.webhook_secret),
                                          ("--webhook-config", args.webhook_config),
                                          ("--webhook-cert-dir", args.webhook_cert_dir),
                                          ("--webhook-extra-name", args.webhook_extra_name)) if value]
        if given:
            raise ConfigError(f"{given[0]}: the webhook is off without --webhook-listen (SINGLETON_WEBHOOK_LISTEN)")
        return None
    listen = parse_listen("--webhook-listen (SINGLETON_WEBHOOK_LISTEN)", listen_text)
    service = args.webhook_service or environ.get("SINGLETON_WEBHOOK_SERVICE") or DEFAULT_WEBHOOK_SERVICE
    if not _DNS1123.match(service) or len(service) > 63:
        raise ConfigError(f"--webhook-service (SINGLETON_WEBHOOK_SERVICE): {service!r} is not a Service name "
                          "(a DNS-1123 label)")
    secret = args.webhook_secret or environ.get("SINGLETON_WEBHOOK_SECRET") or DEFAULT_WEBHOOK_SECRET
    configuration = args.webhook_config or environ.get("SINGLETON_WEBHOOK_CONFIG") or None
    # Secrets and MutatingWebhookConfigurations are named by DNS-1123 subdomains (dots allowed).
    for flag, value in (("--webhook-secret (SINGLETON_WEBHOOK_SECRET)", secret),
                        ("--webhook-config (SINGLETON_WEBHOOK_CONFIG)", configuration or "")):
        if value and (not _DNS1123_SUBDOMAIN.match(value) or len(value) > 253):
            raise ConfigError(f"{flag}: {value!r} is not an object name (a DNS-1123 subdomain)")
    cert_dir = args.webhook_cert_dir or environ.get("SINGLETON_WEBHOOK_CERT_DIR") or None
    if cert_dir is not None and not os.path.isdir(cert_dir):
        raise ConfigError(f"--webhook-cert-dir (SINGLETON_WEBHOOK_CERT_DIR): {cert_dir!r} is not a folder")
    if cert_dir is not None and (args.webhook_secret or args.webhook_config):
        # cert-manager makes the certificate and its CA injector fills caBundle: these would be ignored.
        flag = "--webhook-secret" if args.webhook_secret else "--webhook-config"
        raise ConfigError(f"{flag}: not used with --webhook-cert-dir (cert-manager keeps the certificate and "
                          "caBundle)")
    extra_names = tuple(args.webhook_extra_name or ())
    for name in extra_names:
        # Checked here, not when the certificate is made: a bad name then would stop the start with a traceback.
        try:
            ipaddress.ip_address(name)
        except ValueError:
            if not _DNS1123_SUBDOMAIN.match(name) or len(name) > 253:
                raise ConfigError(f"--webhook-extra-name: {name!r} is neither a DNS name nor an IP address") from None
    return WebhookConfig(listen=listen, service=service, secret=secret, configuration=configuration,
                         cert_dir=cert_dir, extra_names=extra_names)


def main(argv: Sequence[str] | None = None) -> int:
    stop_on_sigterm_until_started(PROG)
    args = parser().parse_args(argv)
    try:
        config = load(args, os.environ)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_format or os.environ.get("SINGLETON_LOG_FORMAT", "json"),  # type: ignore[arg-type]
                  getattr(logging, (args.log_level or "info").upper()))
    kopf_logs.install()
    from singleton_operator.runtime import run_operator

    try:
        return asyncio.run(run_operator(config))
    except KubeConfigError as exc:  # a kubeconfig that gives no credentials: one line, as for bad settings
        print(f"{PROG}: error: kubeconfig: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
