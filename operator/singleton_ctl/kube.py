"""The plugin's API access: the official ``kubernetes`` client, synchronous, with objects as
plain JSON dicts (``Api.request``), and its errors turned into one line for the user.

Credentials come from ``singleton_operator.kubelogin`` (kubeconfig contexts, exec credential
plugins, OIDC and other auth providers, ``HTTPS_PROXY``/``NO_PROXY`` or a cluster's
``proxy-url``), all handled by the official client's loader and REST client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import urllib3
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from singleton_operator.kubelogin import ConfigException, KubeLoginError, Resolved, loader_errors

CALL_TIMEOUT = 10.0


class Api:
    """One API client; ``request`` is one call returning the decoded JSON object."""

    def __init__(self, resolved: Resolved, *, user_agent: str) -> None:
        self.resolved = resolved
        self.client = ApiClient(configuration=resolved.configuration)
        self.client.user_agent = user_agent

    def close(self) -> None:
        self.client.close()  # type: ignore[no-untyped-call]

    def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                content_type: str = "application/json", timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        serialized = self.client.param_serialize(method, path, query_params=list((params or {}).items()),
                                                 header_params=headers, body=body, auth_settings=["BearerToken"])
        response = self.client.call_api(*serialized, _request_timeout=timeout)
        payload = response.read()  # type: ignore[no-untyped-call]
        if response.status >= 400:
            # Raises the status's ApiException subclass (NotFoundException, ForbiddenException, ...).
            ApiException.from_response(http_resp=response, body=payload.decode("utf-8", "replace"), data=None)
        doc = json.loads(payload)
        if not isinstance(doc, dict):
            raise ApiException(status=response.status, reason="BadResponse",
                               body=f"not a JSON object: {payload[:200]!r}")
        return doc


CLUSTER_ERRORS = (ApiException, KubeLoginError, ConfigException, urllib3.exceptions.HTTPError, OSError)
"""What talking to the cluster may raise; ``error_line`` turns each into one line."""


def status_message(exc: ApiException) -> str:
    """``<status> <reason>: <message>``, the message from the server's ``Status`` when it sent one."""
    reason, message = str(exc.reason or ""), str(exc.body or "")[:1000]
    try:
        doc = json.loads(exc.body or "")
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("kind") == "Status":
        reason = str(doc.get("reason") or reason)
        message = str(doc.get("message") or message)
    return " ".join(f"{exc.status} {reason}: {message}".split())


def error_line(exc: BaseException) -> str | None:
    """The one-line message for an API or kubeconfig error, None for anything else."""
    if isinstance(exc, ApiException):
        if exc.status == 403:
            return f"forbidden: {status_message(exc)} (ask for the RBAC this command needs)"
        if exc.status == 401:
            failed = loader_errors()
            cause = f" (the credential plugin said: {failed[-1]})" if failed else ""
            return f"unauthorized: the API server did not accept the kubeconfig's credentials{cause}"
        return f"the API server said: {status_message(exc)}"
    if isinstance(exc, KubeLoginError | ConfigException):
        return "kubeconfig: " + " ".join(str(exc).split())
    if isinstance(exc, urllib3.exceptions.HTTPError):
        reason = getattr(exc, "reason", None) or exc
        return "cannot reach the API server: " + " ".join(str(reason).split())
    return None
