"""Logging in as people do on managed clusters, against the test bed's real API server:
kubectl singleton and the operator (outside a pod) with a kubeconfig whose user is an exec
credential plugin (tests/data/exec_credential.sh hands out ServiceAccount tokens), a failing
plugin, --context, an HTTPS proxy, and kubectl finding the plugin on PATH."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from singleton_testbed.harness.kubehelpers import get_json, grant
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.harness.sidecars import wait_for
from tests.conftest import Cluster
from tests.integration.kube.test_ctl import BIN, ctl
from tests.support.connectproxy import ConnectProxy
from tests.support.paths import DATA

HELPER = DATA / "exec_credential.sh"
READER_RULES = [{"apiGroups": ["singleton.dev"], "resources": ["singletonservices"], "verbs": ["get", "list"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]


def exec_kubeconfig(cluster: Cluster, path: Path, *, token_file: Path, namespace: str,
                    calls_file: Path | None = None, expires: str | None = None) -> Path:
    """The cluster's kubeconfig with a user whose credentials come from the exec helper."""
    config = json.loads(cluster.kubectl("config", "view", "--minify", "--raw", "-o", "json").stdout)
    env = [{"name": "TOKEN_FILE", "value": str(token_file)}]
    env += [{"name": "CALLS_FILE", "value": str(calls_file)}] if calls_file else []
    env += [{"name": "EXPIRES", "value": expires}] if expires else []
    config["users"] = [{"name": "exec-user", "user": {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": str(HELPER), "env": env,
        "interactiveMode": "Never"}}}]
    for context in config["contexts"]:
        context["context"] |= {"user": "exec-user", "namespace": namespace}
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def calls(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture
def crd_group(cluster: Cluster, singleton_crd: Path, namespace: str) -> str:
    name = "g-" + uuid.uuid4().hex[:8]
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": name},
            "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "x"}]}}}}
    cluster.apply(json.dumps(body), namespace=namespace)
    return name


@pytest.fixture
def reader_token(cluster: Cluster, namespace: str, tmp_path: Path) -> Path:
    """A file holding a token of ServiceAccount ``reader``, which may read groups in the namespace."""
    grant(cluster, namespace, "reader", READER_RULES)
    token_file = tmp_path / "token"
    token_file.write_text(cluster.kubectl("create", "token", "reader", "-n", namespace).stdout.strip())
    return token_file


def test_the_plugin_logs_in_through_an_exec_credential_plugin(cluster: Cluster, namespace: str, crd_group: str,
                                                             reader_token: Path, tmp_path: Path) -> None:
    calls_file = tmp_path / "calls"
    kubeconfig = exec_kubeconfig(cluster, tmp_path / "exec.kubeconfig", token_file=reader_token,
                                 namespace=namespace, calls_file=calls_file)
    # No -n: the context's namespace.
    listing = ctl(cluster, "status", "-o", "json", kubeconfig=kubeconfig)
    assert listing.returncode == 0, listing.stderr
    assert [v["name"] for v in json.loads(listing.stdout)] == [crd_group]
    assert calls(calls_file) >= 1
    as_yaml = ctl(cluster, "status", crd_group, "-o", "yaml", kubeconfig=kubeconfig)
    assert as_yaml.returncode == 0 and yaml.safe_load(as_yaml.stdout)[0]["name"] == crd_group, as_yaml.stderr
    # The API server saw the helper's token: the ServiceAccount may not list other namespaces.
    denied = ctl(cluster, "status", "-A", kubeconfig=kubeconfig)
    assert denied.returncode == 1
    assert denied.stderr.startswith("kubectl singleton: error: forbidden: 403 Forbidden: singletonservices."
                                    f"singleton.dev is forbidden: User \"system:serviceaccount:{namespace}:reader\""
                                    ), denied.stderr
    assert len(denied.stderr.strip().splitlines()) == 1


def test_a_failing_exec_plugin_is_one_clear_line(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    missing = tmp_path / "no-token"
    kubeconfig = exec_kubeconfig(cluster, tmp_path / "exec.kubeconfig", token_file=missing, namespace=namespace)
    context = yaml.safe_load(kubeconfig.read_text())["current-context"]
    result = ctl(cluster, "status", kubeconfig=kubeconfig)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"kubectl singleton: error: kubeconfig: context {context!r}: exec credential plugin '{HELPER}' gave no "
        f"credentials: exec: process returned 1. exec_credential.sh: login refused: no token at {missing}")


def test_context_selects_the_cluster_user_and_namespace(cluster: Cluster, namespace: str, crd_group: str,
                                                       reader_token: Path, tmp_path: Path) -> None:
    config = yaml.safe_load(exec_kubeconfig(cluster, tmp_path / "exec.kubeconfig", token_file=reader_token,
                                            namespace=namespace).read_text())
    good = config["contexts"][0]
    config["clusters"].append({"name": "dead", "cluster": {**config["clusters"][0]["cluster"],
                                                           "server": "https://127.0.0.1:1"}})
    config["contexts"] = [{"name": "dead", "context": {"cluster": "dead", "user": "exec-user"}},
                          {"name": "good", "context": good["context"]}]
    config["current-context"] = "dead"
    kubeconfig = tmp_path / "two.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    dead = ctl(cluster, "status", kubeconfig=kubeconfig)
    assert dead.returncode == 1 and dead.stderr.startswith("kubectl singleton: error: cannot reach the API server")
    for args in (["--context", "good", "status", "-o", "json"], ["status", "--context", "good", "-o", "json"]):
        chosen = ctl(cluster, *args, kubeconfig=kubeconfig)
        assert chosen.returncode == 0, chosen.stderr
        assert [v["namespace"] for v in json.loads(chosen.stdout)] == [namespace]
    unknown = ctl(cluster, "--context", "nope", "status", kubeconfig=kubeconfig)
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == (f"kubectl singleton: error: kubeconfig: --context: no context 'nope' in "
                                      f"{kubeconfig}")


def test_https_proxy_and_no_proxy_are_honoured(cluster: Cluster, namespace: str, crd_group: str,
                                              proxy: ConnectProxy) -> None:
    server = yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    no_proxy_env = {"NO_PROXY": "", "no_proxy": ""}
    through = ctl(cluster, "status", "-n", namespace, "-o", "json",
                  env={"HTTPS_PROXY": proxy.url, "https_proxy": proxy.url, **no_proxy_env})
    assert through.returncode == 0, through.stderr
    assert [v["name"] for v in json.loads(through.stdout)] == [crd_group]
    assert proxy.targets and all(t == server.removeprefix("https://") for t in proxy.targets), proxy.targets
    seen = len(proxy.targets)
    host = server.removeprefix("https://").rpartition(":")[0].strip("[]")
    bypassed = ctl(cluster, "status", "-n", namespace,
                   env={"HTTPS_PROXY": proxy.url, "https_proxy": proxy.url, "NO_PROXY": host, "no_proxy": host})
    assert bypassed.returncode == 0, bypassed.stderr
    assert len(proxy.targets) == seen
    dead = ctl(cluster, "status", "-n", namespace,
               env={"HTTPS_PROXY": "http://127.0.0.1:1", "https_proxy": "http://127.0.0.1:1", **no_proxy_env})
    assert dead.returncode == 1 and dead.stderr.startswith("kubectl singleton: error: cannot reach the API server")
    assert len(dead.stderr.strip().splitlines()) == 1, dead.stderr


def test_kubectl_runs_the_plugin_from_path(cluster: Cluster, namespace: str, crd_group: str) -> None:
    env = {**cluster.env, "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")])}
    plugins = subprocess.run(["kubectl", "plugin", "list", "--name-only"], capture_output=True, text=True, env=env,
                             check=False, timeout=30)
    assert "kubectl-singleton" in plugins.stdout.split(), plugins.stdout + plugins.stderr
    result = subprocess.run(["kubectl", "singleton", "status", crd_group, "-n", namespace, "-o", "json"],
                            capture_output=True, text=True, env=env, check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0]["name"] == crd_group
    usage = subprocess.run(["kubectl", "singleton", "--help"], capture_output=True, text=True, env=env, check=False,
                           timeout=60)
    assert usage.stdout.startswith("usage: kubectl singleton "), usage.stdout


def _deployment_exists(cluster: Cluster, namespace: str, name: str) -> bool:
    return cluster.kubectl("get", "deployment", name, "-n", namespace, check=False).returncode == 0


def _apply_group(cluster: Cluster, namespace: str, name: str) -> None:
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": name},
            "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "x"}]}}}}
    cluster.apply(json.dumps(body), namespace=namespace)


def _token_bound_to_secret(cluster: Cluster, namespace: str, account: str, secret: str) -> str:
    cluster.kubectl("create", "secret", "generic", secret, "-n", namespace)
    return str(cluster.kubectl("create", "token", account, "-n", namespace, "--bound-object-kind", "Secret",
                               "--bound-object-name", secret).stdout.strip())


def _accepted(cluster: Cluster, token: str, namespace: str) -> bool:
    result = cluster.kubectl("--token", token, "get", "singletonservices", "-n", namespace, check=False)
    return result.returncode == 0


@pytest.mark.usefixtures("singleton_crd")
def test_the_operator_logs_in_through_exec_and_renews_the_token(cluster: Cluster, namespace: str,
                                                                tmp_path: Path) -> None:
    """The operator outside a pod, its kubeconfig's user an exec plugin whose token expires:
    after the token it started with is revoked, it goes on with the one the plugin now gives."""
    account, binding = "op-exec", f"op-exec-{namespace}"
    cluster.kubectl("create", "serviceaccount", account, "-n", namespace)
    cluster.kubectl("create", "clusterrolebinding", binding, "--clusterrole=cluster-admin",
                    f"--serviceaccount={namespace}:{account}")
    op: OperatorProcess | None = None
    try:
        first = _token_bound_to_secret(cluster, namespace, account, "first-login")
        second = _token_bound_to_secret(cluster, namespace, account, "second-login")
        token_file, calls_file = tmp_path / "token", tmp_path / "calls"
        token_file.write_text(first)
        # Within the loader's five minutes of skew: every request asks the plugin again.
        expires = (dt.datetime.now(dt.UTC) + dt.timedelta(minutes=4)).strftime("%Y-%m-%dT%H:%M:%SZ")
        kubeconfig = exec_kubeconfig(cluster, tmp_path / "op.kubeconfig", token_file=token_file,
                                     namespace=namespace, calls_file=calls_file, expires=expires)
        op = OperatorProcess(kubeconfig, namespace, tmp_path / "op.log",
                             extra_args=["--namespace", namespace]).start()
        wait_for(lambda: op.role() == "leader", 30, "the operator to lead", 0.1)
        _apply_group(cluster, namespace, "before")
        wait_for(lambda: _deployment_exists(cluster, namespace, "before"), 30, "the first group reconciled", 0.2)
        # Revoke the first token (its Secret goes) and let the plugin hand out the second.
        token_file.write_text(second)
        cluster.kubectl("delete", "secret", "first-login", "-n", namespace)
        wait_for(lambda: not _accepted(cluster, first, namespace), 10, "the first token to be refused", 0.2)
        assert _accepted(cluster, second, namespace)
        called = calls(calls_file)
        _apply_group(cluster, namespace, "after")
        wait_for(lambda: _deployment_exists(cluster, namespace, "after"), 60, "the second group reconciled", 0.2)
        assert calls(calls_file) > called
        assert op.alive() and op.role() == "leader", op.log()[-3000:]
        lease: dict[str, Any] = get_json(cluster, "lease", "singleton-operator", "-n", namespace)
        assert lease["spec"]["holderIdentity"].startswith("op/")
    finally:
        if op is not None:
            op.stop()
        cluster.kubectl("delete", "clusterrolebinding", binding, "--ignore-not-found", check=False)


# The official client is the package's `cli` extra: the image leaves it out (126 MB installed).
# Hiding it (None in sys.modules) is how a venv without the extra looks to the import system.
_WITHOUT_THE_CLIENT = "import sys; sys.modules['kubernetes'] = None; sys.argv[0] = {argv0!r}; {code}"


@pytest.mark.parametrize("argv0", ["kubectl-singleton", "singletonctl"])
def test_the_plugin_without_the_cli_extra_says_how_to_install_it(argv0: str) -> None:
    code = "from singleton_ctl.entry import main; sys.argv[1:] = ['status', '-A']; sys.exit(main())"
    result = subprocess.run([str(BIN / "python"), "-c", _WITHOUT_THE_CLIENT.format(argv0=argv0, code=code)],
                            capture_output=True, text=True, timeout=60, check=False)
    prog = "singletonctl" if argv0 == "singletonctl" else "kubectl singleton"
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (f"{prog}: error: needs the official kubernetes client: "
                             "pip install 'kube-singleton[cli]'\n")


def test_the_operator_with_a_kubeconfig_but_without_the_cli_extra_says_how_to_install_it(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    code = f"from singleton_operator.cli import main; sys.exit(main(['run', '--kubeconfig', {str(kubeconfig)!r}]))"
    result = subprocess.run(
        [str(BIN / "python"), "-c", _WITHOUT_THE_CLIENT.format(argv0="singleton-operator", code=code)],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "singleton-operator: error: kubeconfig: a kubeconfig outside a pod needs the official kubernetes client: "
        "pip install 'kube-singleton[cli]'")


def test_the_operator_refuses_an_https_proxy_in_one_line(cluster: Cluster) -> None:
    """Its own client reaches the API server only through an http:// proxy's CONNECT tunnel."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "HTTPS_PROXY": "https://proxy.corp:3128",
           "NO_PROXY": "", "no_proxy": ""}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    result = subprocess.run([str(BIN / "singleton-operator"), "run"], capture_output=True, text=True, env=env,
                            timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "singleton-operator: error: kubeconfig: proxy 'https://proxy.corp:3128': only http:// proxies are supported "
        "(the connection to the API server is TLS inside the proxy's tunnel)")


class _Configuration:
    """The official client's Configuration as far as Resolved asks it: a refresh hook that
    hands out a new token whenever it is called."""

    def __init__(self) -> None:
        self.calls = 0

    def get_api_key_with_prefix(self, key: str) -> str:
        assert key == "BearerToken"
        self.calls += 1
        return f"Bearer token-{self.calls}"


class _Loader:
    pass


def test_a_token_the_loader_never_renews_is_asked_for_once() -> None:
    """The refresh hook rebuilds the loader's configuration on every call, and renews only a
    token with an expiry: one without is kept; one with is asked for every time (so kopf,
    logging in again on a 401, gets what the loader has now)."""
    from singleton_operator.kubelogin import Resolved

    static = _Configuration()
    resolved = Resolved(configuration=static, namespace="default", context="test", loader=_Loader())
    assert [resolved.bearer_token() for _ in range(3)] == ["token-1"] * 3
    assert static.calls == 1

    expiring, loader = _Configuration(), _Loader()
    loader.expiry = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=4)  # type: ignore[attr-defined]
    resolved = Resolved(configuration=expiring, namespace="default", context="test", loader=loader)
    assert [resolved.bearer_token() for _ in range(3)] == ["token-1", "token-2", "token-3"]

    in_a_pod = _Configuration()  # the official client re-reads the projected token file itself
    resolved = Resolved(configuration=in_a_pod, namespace="default", context=None)
    assert [resolved.bearer_token() for _ in range(2)] == ["token-1", "token-2"]


def test_the_official_loaders_hook_runs_once_for_a_static_token(tmp_path: Path) -> None:
    """The same against the official client's own loader (a client upgrade that renewed such
    tokens differently would show here)."""
    from singleton_operator.kubelogin import resolve

    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"token": "static-token"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    resolved = resolve(str(path))
    hook = resolved.configuration.refresh_api_key_hook
    ran: list[None] = []

    def counting(configuration: Any) -> None:
        ran.append(None)
        hook(configuration)

    resolved.configuration.refresh_api_key_hook = counting
    assert [resolved.bearer_token() for _ in range(3)] == ["static-token"] * 3
    assert len(ran) == 1
