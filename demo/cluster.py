"""Bringing the demo's cluster up and down, and the state file that remembers it.

Everything the demo starts outlives the ``make demo`` process (so the user can explore
the cluster afterwards) and is stopped by ``make demo-down``:

- the test bed (``singleton-testbed up`` with ``SINGLETON_TESTBED_STATE`` in our state
  folder): PostgreSQL, etcd, kube-apiserver, kube-controller-manager, kube-scheduler;
- a kubelet stand-in (``python -m singleton_testbed.kubelet``) for node ``singleton-demo``:
  pods run as local processes in network namespaces (root only);
- the operator (``singleton-operator run``) with the Helm chart's ServiceAccount, RBAC and
  admission policy, through a token of that ServiceAccount.

Each is started in a session of its own, with its pid and start time recorded in
``demo.json`` as soon as it runs, so ``down`` stops exactly these processes (a recycled pid
is never signalled) even after a failed or interrupted start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from singleton_testbed.controlplane import wait_established
from singleton_testbed.netns import DEFAULT_NETWORK, HostNetwork, netns_supported
from singleton_testbed.postgres import PostgresInfo, find_pg_bin
from singleton_testbed.procs import free_port

REPO = Path(__file__).resolve().parent.parent
MANIFEST = Path(__file__).resolve().parent / "feed-poller.yaml"
CRD = REPO / "crds" / "singleton.dev_singletonservices.yaml"
CHART = REPO / "charts" / "singleton"
BUILD_SCRIPT = REPO / "testbed" / "build.sh"
DEFAULT_STATE = Path.home() / ".cache" / "singleton" / "run" / "demo"
NAMESPACE = "feeds"
GROUP = "feed-poller"
SECRET = "feed-db"
RELEASE = "singleton"
RELEASE_NAMESPACE = "singleton-system"
OPERATOR_ACCOUNT = "singleton-operator"  # the chart's "<fullname>-operator" for release "singleton"
KUBE_VERSION = "1.34.4"  # the test bed's; its helm assumes v1.20 unless told
TOKEN_HOURS = 48  # the test bed's certificates are valid for 2 days
COLD_BUILD = "about 6 min on 2 cores, once; later starts take seconds"

Say = Callable[[str], None]


class DemoError(Exception):
    """Something the user must fix or look at; the message says what and where."""


def state_dir() -> Path:
    return Path(os.environ.get("SINGLETON_DEMO_STATE", str(DEFAULT_STATE))).expanduser().resolve()


def node_name(folder: Path) -> str:
    """``singleton-demo``, or with a suffix for another state folder (tests), so two demos
    on one host never claim the same node in the shared pod network."""
    if folder == DEFAULT_STATE.expanduser().resolve():
        return "singleton-demo"
    return "singleton-demo-" + hashlib.sha256(str(folder).encode()).hexdigest()[:6]


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks: with the pid it names one process for good."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclasses.dataclass(frozen=True)
class Proc:
    """A process we started: pid and start time."""

    pid: int
    start: str

    @classmethod
    def of(cls, pid: int) -> Proc:
        return cls(pid, start_time(pid) or "")

    def alive(self) -> bool:
        return bool(self.start) and start_time(self.pid) == self.start

    def signal(self, signum: int, *, group: bool = False) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)

    def stop(self, timeout: float, *, group: bool = False) -> bool:
        """SIGTERM, wait, then SIGKILL. True when it stopped on SIGTERM."""
        self.signal(signal.SIGTERM, group=group)
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not self.alive():
            return True
        self.signal(signal.SIGKILL, group=group)
        deadline = time.monotonic() + 5
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return False


class State:
    """``demo.json`` in the state folder: what runs, and where its files are."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / "demo.json"
        self.data: dict[str, Any] = {}

    @classmethod
    def load(cls, folder: Path) -> State:
        state = cls(folder)
        with contextlib.suppress(OSError, ValueError):
            state.data = json.loads(state.path.read_text())
        return state

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.path)

    def set(self, **values: Any) -> None:
        self.data.update(values)
        self.save()

    def proc(self, key: str) -> Proc | None:
        entry = self.data.get(key)
        if not isinstance(entry, dict) or "pid" not in entry:
            return None
        return Proc(int(entry["pid"]), str(entry.get("start", "")))

    @property
    def testbed_state(self) -> Path:
        return self.folder / "testbed"

    @property
    def kubelet_dir(self) -> Path:
        return self.folder / "kubelet"

    def running(self) -> list[str]:
        """Names of the recorded processes that still run."""
        return [key for key in ("runner", "testbed", "kubelet", "operator")
                if (proc := self.proc(key)) is not None and proc.alive()]

    def exports(self) -> list[str]:
        lines = [f"export KUBECONFIG={self.data['kubeconfig']}"] if "kubeconfig" in self.data else []
        if "path_prefix" in self.data:
            lines.append(f"export PATH={self.data['path_prefix']}:{Path(sys.executable).parent}:$PATH")
        return lines


# --- prerequisites and the build -------------------------------------------------------------


def check_prerequisites() -> None:
    """Root and `ip netns` (the stand-in), PostgreSQL server binaries, openssl: say which is missing."""
    problems = []
    if reason := netns_supported():
        problems.append(f"pods run in network namespaces: {reason}")
    try:
        find_pg_bin()
    except FileNotFoundError as exc:
        problems.append(str(exc))
    if shutil.which("openssl") is None:
        problems.append("openssl is not on PATH (the test bed makes its certificates with it)")
    if problems:
        raise DemoError("make demo cannot run here:\n  - " + "\n  - ".join(problems))


def _provided_binaries() -> bool:
    """Whether every control plane binary comes from the environment (no build needed)."""
    names = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "helm")
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    return all(os.environ.get("SINGLETON_TESTBED_" + n.upper().replace("-", "_"))
               or (assets and (Path(assets) / n).exists()) for n in names)


def build_binaries(say: Say, heartbeat: Callable[[str], None], *, every: float = 15.0) -> None:
    """Run ``testbed/build.sh`` (it builds only what is missing), relaying its progress and
    saying every ``every`` seconds what it is still doing, so a cold build never looks stuck."""
    if _provided_binaries():
        say("control plane binaries: taken from the environment (KUBEBUILDER_ASSETS / SINGLETON_TESTBED_*)")
        return
    proc = subprocess.Popen(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stderr is not None
    current: list[str] = []
    downloads = [0]
    tail: list[str] = []
    started = time.monotonic()

    def relay(stream: Any) -> None:
        for raw in stream:
            line = raw.rstrip()
            tail[:] = [*tail[-19:], line]
            if line.startswith("[testbed-build] building "):
                name = line.split()[2]
                if not current:
                    say(f"building the control plane from Go modules ({COLD_BUILD})")
                current[:] = [name]
                say(f"  building {name} ...")
            elif line.startswith("[testbed-build] built "):
                say("  " + line.removeprefix("[testbed-build] "))
            elif line.startswith("go: downloading"):
                downloads[0] += 1

    reader = threading.Thread(target=relay, args=(proc.stderr,), daemon=True)
    reader.start()
    last_beat = started
    while proc.poll() is None:
        time.sleep(0.2)
        now = time.monotonic()
        if current and now - last_beat >= every:
            last_beat = now
            elapsed = int(now - started)
            fetched = f", {downloads[0]} Go modules downloaded" if downloads[0] else ""
            heartbeat(f"  ... still building {current[0]}: {elapsed // 60}m{elapsed % 60:02d}s so far{fetched}")
    reader.join(5)
    output = proc.stdout.read()
    if proc.returncode != 0:
        hint = "" if shutil.which("go") else "\n(no `go` on PATH: Go >= 1.24 builds the control plane once)"
        raise DemoError("testbed/build.sh failed:\n" + "\n".join(tail) + hint)
    folder = output.strip().splitlines()[-1] if output.strip() else "?"
    if current:
        say(f"control plane built in {int(time.monotonic() - started)} s into {folder}")
    else:
        say(f"control plane binaries: cached in {folder}")


# --- the pieces ------------------------------------------------------------------------------


def _env(state: State) -> dict[str, str]:
    env = {**os.environ, "SINGLETON_TESTBED_STATE": str(state.testbed_state)}
    if "kubeconfig" in state.data:
        env["KUBECONFIG"] = state.data["kubeconfig"]
        env["PATH"] = os.pathsep.join([state.data["path_prefix"], str(Path(sys.executable).parent), env["PATH"]])
    return env


def kubectl(state: State, *args: str, input_text: str | None = None, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    binary = str(Path(state.data["path_prefix"]) / "kubectl")
    result = subprocess.run([binary, *args], input=input_text, capture_output=True, text=True, env=_env(state),
                            check=False, timeout=timeout)
    if check and result.returncode != 0:
        raise DemoError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def start_testbed(state: State) -> None:
    """``singleton-testbed up`` in our own state folder: its own servers on free ports."""
    state.testbed_state.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sys.executable, "-m", "singleton_testbed.cli", "up"], env=_env(state),
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False, timeout=300)
    with open(state.folder / "demo.log", "a") as log:
        log.write(result.stdout + result.stderr)
    testbed_file = state.testbed_state / "testbed.json"
    try:
        info = json.loads(testbed_file.read_text())
    except (OSError, ValueError):
        raise DemoError(f"the test bed did not start:\n{result.stderr.strip()}\n"
                        f"see {state.testbed_state / 'testbed.log'}") from None
    state.set(testbed={"pid": int(info["pid"]), "start": start_time(int(info["pid"])) or ""},
              kubeconfig=info["KUBECONFIG"], dsn=info["SINGLETON_TEST_DSN"],
              admin_dsn=info["SINGLETON_TEST_ADMIN_DSN"], path_prefix=info["PATH_PREFIX"])


def pod_dsn(host_dsn: str) -> str:
    """The DSN pods use: the same server at the pod network's PostgreSQL address."""
    url = urlsplit(host_dsn)
    info = PostgresInfo(host=DEFAULT_NETWORK.postgres_ip, port=url.port or 5432, superuser="postgres")
    return info.dsn


def _chart_objects(state: State) -> list[dict[str, Any]]:
    helm = str(Path(state.data["path_prefix"]) / "helm")
    shown = [f"--show-only=templates/{name}.yaml" for name in
             ("serviceaccount", "clusterrole", "role", "admission-policy")]
    result = subprocess.run([helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
                             "--kube-version", KUBE_VERSION, *shown], capture_output=True, text=True,
                            env=_env(state), check=False, timeout=60)
    if result.returncode != 0:
        raise DemoError(f"helm template failed: {result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def prepare_cluster(state: State, say: Say) -> None:
    """CRD, namespaces, the chart's RBAC and admission policy, the database Secret."""
    say(f"$ kubectl apply --server-side -f crds/{CRD.name}")
    kubectl(state, "apply", "--server-side", "--field-manager=singleton-demo", "-f", str(CRD))
    try:
        wait_established(lambda *args, check: kubectl(state, *args, check=check), "crd/singletonservices.singleton.dev")
    except RuntimeError as exc:
        raise DemoError(str(exc)) from exc
    for namespace in (RELEASE_NAMESPACE, NAMESPACE):
        kubectl(state, "create", "namespace", namespace)
    say(f"$ helm template {RELEASE} charts/singleton -n {RELEASE_NAMESPACE} --show-only ... | kubectl apply -f -"
        "   # the operator's ServiceAccount, RBAC and the sidecars' admission policy")
    objects = _chart_objects(state)
    kubectl(state, "apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    dsn = pod_dsn(state.data["dsn"])
    say(f"$ kubectl -n {NAMESPACE} create secret generic {SECRET} --from-literal=dsn="
        + dsn.replace(urlsplit(dsn).password or "", "***"))
    kubectl(state, "-n", NAMESPACE, "create", "secret", "generic", SECRET, f"--from-literal=dsn={dsn}")


def _spawn(argv: list[str], log_path: Path, env: dict[str, str]) -> Proc:
    """A process in a session of its own that outlives us (no parent-death signal)."""
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True)
    return Proc.of(popen.pid)


def start_kubelet(state: State, timeout: float = 60) -> None:
    node = node_name(state.folder)
    folder = state.kubelet_dir
    folder.mkdir(parents=True, exist_ok=True)
    control = folder / "control.json"
    control.unlink(missing_ok=True)
    proc = _spawn([sys.executable, "-m", "singleton_testbed.kubelet", "--kubeconfig", state.data["kubeconfig"],
                   "--node", node, "--state-dir", str(folder), "--log-format", "text"],
                  state.folder / "kubelet.log", _env(state))
    state.set(kubelet={"pid": proc.pid, "start": proc.start, "node": node})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise DemoError(f"the kubelet stand-in exited; see {state.folder / 'kubelet.log'}")
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(control.read_text())
            if doc.get("pid") == proc.pid:
                state.set(kubelet={"pid": proc.pid, "start": proc.start, "node": node, "url": doc["url"],
                                   "subnet": _claimed_subnet(node)})
                return
        time.sleep(0.1)
    raise DemoError(f"the kubelet stand-in did not start in {timeout:g} s; see {state.folder / 'kubelet.log'}")


def _claims_dir() -> Path:
    return DEFAULT_NETWORK.state_root / DEFAULT_NETWORK.prefix / "claims"


def _claimed_subnet(node: str) -> int | None:
    """The /24 of the shared pod network our stand-in claimed (its namespaces are named after it)."""
    with contextlib.suppress(OSError):
        for path in _claims_dir().iterdir():
            with contextlib.suppress(OSError, ValueError):
                if path.name.isdigit() and json.loads(path.read_text()).get("node") == node:
                    return int(path.name)
    return None


def netns_prefix(subnet: int) -> str:
    """Names of the namespaces (and host veths) of the pods in that /24: ``sgltb-N-``."""
    return f"{DEFAULT_NETWORK.prefix}-{subnet}-"


def operator_kubeconfig(state: State) -> Path:
    """The admin kubeconfig's cluster with a token of the chart's operator ServiceAccount."""
    token = kubectl(state, "create", "token", OPERATOR_ACCOUNT, "-n", RELEASE_NAMESPACE,
                    f"--duration={TOKEN_HOURS}h").stdout.strip()
    config = yaml.safe_load(Path(state.data["kubeconfig"]).read_text())
    config["users"] = [{"name": OPERATOR_ACCOUNT, "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"] |= {"user": OPERATOR_ACCOUNT, "namespace": RELEASE_NAMESPACE}
    path = state.folder / "operator.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def start_operator(state: State, timeout: float = 60) -> None:
    kubeconfig = operator_kubeconfig(state)
    port = free_port()
    argv = [sys.executable, "-m", "singleton_operator.cli", "run", "--kubeconfig", str(kubeconfig),
            "--lease-namespace", RELEASE_NAMESPACE, "--namespace", NAMESPACE, "--identity", "singleton-demo",
            "--health-listen", f"127.0.0.1:{port}", "--log-format", "text"]
    proc = _spawn(argv, state.folder / "operator.log", _env(state))
    state.set(operator={"pid": proc.pid, "start": proc.start, "health": f"http://127.0.0.1:{port}"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise DemoError(f"the operator exited; see {state.folder / 'operator.log'}")
        with contextlib.suppress(urllib.error.URLError, OSError), \
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            if resp.read().decode().strip() == "leader":
                return
        time.sleep(0.2)
    raise DemoError(f"the operator did not lead in {timeout:g} s; see {state.folder / 'operator.log'}")


def apply_group(state: State, say: Say) -> None:
    say(f"$ kubectl apply -n {NAMESPACE} -f demo/{MANIFEST.name}")
    kubectl(state, "apply", "-n", NAMESPACE, "-f", str(MANIFEST))


# --- down ------------------------------------------------------------------------------------


def _leftover_sandboxes(subnet: int) -> Iterator[str]:
    prefix = netns_prefix(subnet)
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    yield from (name for name in names if name.startswith(prefix))


def down(folder: Path, say: Say) -> int:
    """Stop what the state file names, newest first, and remove the state folder."""
    state = State.load(folder)
    if not state.data and not folder.exists():
        say("no demo is running")
        return 0
    runner = state.proc("runner")
    if runner is not None and runner.pid != os.getpid() and runner.alive():
        say(f"stopping the demo program (pid {runner.pid})")
        runner.stop(10)
    operator = state.proc("operator")
    if operator is not None and operator.alive():
        say(f"stopping the operator (pid {operator.pid})")
        operator.stop(30, group=True)
    kubelet = state.proc("kubelet")
    if kubelet is not None and kubelet.alive():
        say(f"stopping the kubelet stand-in (pid {kubelet.pid}): its pods, its node, its network namespaces")
        if not kubelet.stop(40):
            say("  it did not stop in time; killed it")
    subnet = (state.data.get("kubelet") or {}).get("subnet")
    if isinstance(subnet, int) and (leftovers := list(_leftover_sandboxes(subnet))):
        say(f"removing {len(leftovers)} leftover network namespaces")
        network = HostNetwork(DEFAULT_NETWORK, node_name(folder), subnet_index=subnet)
        network.teardown()
    testbed = state.proc("testbed")
    if testbed is not None and testbed.alive():
        say(f"stopping the test bed (pid {testbed.pid}): control plane and PostgreSQL")
        subprocess.run([sys.executable, "-m", "singleton_testbed.cli", "down"], env=_env(state),
                       capture_output=True, text=True, check=False, timeout=90)
        if testbed.alive():
            testbed.stop(30)
    shutil.rmtree(folder, ignore_errors=True)
    say("the demo is stopped and its files are removed")
    return 0
