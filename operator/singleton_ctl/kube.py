"""The plugin's API access: the project's one request client (``singleton_election.kube``, the
sidecar's and the operator's), driven synchronously (``singleton_election.kube_blocking``),
with objects as plain JSON dicts, and its errors turned into one line for the user.

The kubeconfig is read by ``singleton_operator.kubelogin``, with the official ``kubernetes``
package's loader (contexts, exec credential plugins, OIDC and other auth providers,
``proxy-url``, ``HTTPS_PROXY``/``NO_PROXY``); it renews an expiring credential before a request.
The requests are ours: one client, one set of errors and timeouts for the whole project.
"""

from __future__ import annotations

from singleton_election.kube import KubeConfigError, KubeError, KubeForbidden
from singleton_operator.kubelogin import ConfigException, KubeLoginError, loader_errors

CLUSTER_ERRORS = (KubeError, KubeConfigError, KubeLoginError, ConfigException, OSError)
"""What talking to the cluster may raise; ``error_line`` turns each into one line."""


def status_message(exc: KubeError) -> str:
    """``<status> <reason>: <message>``, the message from the server's ``Status`` when it sent one."""
    return " ".join(f"{exc.status} {exc.reason}: {exc.message}".split())


def error_line(exc: BaseException) -> str | None:
    """The one-line message for an API or kubeconfig error, None for anything else."""
    if isinstance(exc, KubeForbidden):
        return f"forbidden: {status_message(exc)} (ask for the RBAC this command needs)"
    if isinstance(exc, KubeError) and exc.status == 401:
        failed = loader_errors()
        cause = f" (the credential plugin said: {failed[-1]})" if failed else ""
        return f"unauthorized: the API server did not accept the kubeconfig's credentials{cause}"
    if isinstance(exc, KubeError) and exc.status == 0:  # no HTTP answer: refused, unreachable, timed out
        return "cannot reach the API server: " + " ".join(exc.message.split())
    if isinstance(exc, KubeError):
        return f"the API server said: {status_message(exc)}"
    if isinstance(exc, KubeLoginError | ConfigException | KubeConfigError):
        return "kubeconfig: " + " ".join(str(exc).split())
    return None
