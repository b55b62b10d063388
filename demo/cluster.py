"""Bringing the demo's cluster up and down, and the state file that remembers it.

Everything the demo starts outlives the ``make demo`` process (so the user can explore
the cluster afterwards) and is stopped by ``make demo-down``:

- the test bed on a real node (``python -m demo.bed serve``, see ``demo.bed``): PostgreSQL,
  etcd, kube-apiserver (advertising the node IP), kube-controller-manager, kube-scheduler and
  the real node ``singleton-node`` (containerd + runc + CNI bridge, kubelet, kube-proxy), into
  which the project's image, built with buildah and cached by content, is imported: the
  sidecars and the pollers run as containers of that image;
- the operator (``singleton-operator run``) as a host process, with the Helm chart's
  ServiceAccount, RBAC and admission policy, through a token of that ServiceAccount.

Each is started in a session of its own, with its pid and start time recorded in
``demo.json`` as soon as it runs, so ``down`` stops exactly these processes (a recycled pid
is never signalled) even after a failed or interrupted start.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from demo.bed import BED_FILE, IMAGE_FILE
from singleton_testbed import node as node_mod
from singleton_testbed.controlplane import wait_established
from singleton_testbed.images import missing_tools
from singleton_testbed.postgres import find_pg_bin
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
COLD_IMAGE = "about 2 min, once per change of the sources; cached by content"

Say = Callable[[str], None]


class DemoError(Exception):
    """Something the user must fix or look at; the message says what and where."""


def state_dir() -> Path:
    return Path(os.environ.get("SINGLETON_DEMO_STATE", str(DEFAULT_STATE))).expanduser().resolve()


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
    def node_work(self) -> Path | None:
        work = (self.data.get("node") or {}).get("work")
        return Path(work) if work else None

    def running(self) -> list[str]:
        """Names of the recorded processes that still run."""
        return [key for key in ("runner", "testbed", "operator")
                if (proc := self.proc(key)) is not None and proc.alive()]

    def exports(self) -> list[str]:
        lines = [f"export KUBECONFIG={self.data['kubeconfig']}"] if "kubeconfig" in self.data else []
        if "path_prefix" in self.data:
            lines.append(f"export PATH={self.data['path_prefix']}:{Path(sys.executable).parent}:$PATH")
        return lines


# --- prerequisites and the build -------------------------------------------------------------


def check_prerequisites() -> None:
    """What the real node, the image build and the test bed need: say everything that is missing
    before minutes of building, not after."""
    problems = []
    # The node's own binaries (kubelet, kube-proxy, pause) are built with the control plane:
    # placeholder paths let this check the machine alone; they are checked again once built.
    if reason := node_mod.unavailable_reason({name: Path("/") for name in ("kubelet", "kube-proxy", "pause")}):
        problems.append(f"the real node: {reason}")
    if missing := missing_tools():
        problems.append(f"the image is built with {' and '.join(missing)}: apt-get install {' '.join(missing)}")
    try:
        find_pg_bin()
    except FileNotFoundError as exc:
        problems.append(str(exc))
    if shutil.which("openssl") is None:
        problems.append("openssl is not on PATH (the test bed makes its certificates with it)")
    if problems:
        raise DemoError("make demo cannot run here:\n  - " + "\n  - ".join(problems))


def node_owner() -> int | None:
    """The pid of the live process that runs this machine's real node, if any (read from the
    node's state file, without touching its lock: there is one real node per machine)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        pid = int(json.loads((node_mod.RUN_DIR / "state.json").read_text())["pid"])
        if start_time(pid) is not None:
            return pid
    return None


class NodeBusy(DemoError):
    """Another real node runs on this machine (``make testbed-up``, the tests or another demo)."""

    def __init__(self, owner: int | None) -> None:
        who = f"pid {owner}" if owner is not None else f"see {node_mod.RUN_DIR / 'state.json'}"
        super().__init__(
            f"another real node runs on this machine ({who}); only one can (kube-proxy's iptables rules are "
            "machine-global). Stop it (`make testbed-down` if it is the test bed's, or wait for the tests to "
            "finish), then run `make demo` again.")


def _provided_binaries() -> bool:
    """Whether every test bed binary comes from the environment (no build needed)."""
    names = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "helm",
             "kubelet", "kube-proxy", "pause")
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    return all(os.environ.get("SINGLETON_TESTBED_" + n.upper().replace("-", "_"))
               or (assets and (Path(assets) / n).exists()) for n in names)


def build_binaries(say: Say, heartbeat: Callable[[str], None], *, every: float = 15.0) -> None:
    """Run ``testbed/build.sh`` (it builds only what is missing), relaying its progress and
    saying every ``every`` seconds what it is still doing, so a cold build never looks stuck."""
    if _provided_binaries():
        say("test bed binaries: taken from the environment (KUBEBUILDER_ASSETS / SINGLETON_TESTBED_*)")
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
                    say(f"building the control plane and the node's kubelet and kube-proxy from Go modules "
                        f"({COLD_BUILD})")
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
        hint = "" if shutil.which("go") else ("\n(no `go` on PATH: testbed/build.sh fetches the pinned Go from the Go "
                                              "module proxy; what it said is above)")
        raise DemoError("testbed/build.sh failed:\n" + "\n".join(tail) + hint)
    folder = output.strip().splitlines()[-1] if output.strip() else "?"
    if current:
        say(f"control plane built in {int(time.monotonic() - started)} s into {folder}")
    else:
        say(f"control plane and node binaries: cached in {folder}")


# --- the pieces ------------------------------------------------------------------------------


def _env(state: State) -> dict[str, str]:
    env = dict(os.environ)
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


# --- the test bed on a real node, and the image ----------------------------------------------


def start_bed(state: State) -> None:
    """Start ``python -m demo.bed serve`` (see ``demo.bed``) in the background; it reports in
    ``bed.json``. It starts at once, so that it comes up while the image builds."""
    (state.folder / BED_FILE).unlink(missing_ok=True)
    (state.folder / IMAGE_FILE).unlink(missing_ok=True)
    proc = _spawn([sys.executable, "-m", "demo.bed", "serve", str(state.folder)], state.folder / "bed.log",
                  _env(state))
    state.set(testbed={"pid": proc.pid, "start": proc.start})


class BedWatcher:
    """Follows ``bed.json``: says each new phase, fails when the bed failed or exited."""

    def __init__(self, state: State, say: Say) -> None:
        self.state = state
        self.say = say
        self.phase = ""
        self.doc: dict[str, Any] = {}

    def poll(self) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            self.doc = json.loads((self.state.folder / BED_FILE).read_text())
        # Recorded as soon as they exist, so that `down` finds them even if the bed is killed.
        for key in ("node", "workdirs"):
            if key in self.doc and key not in self.state.data:
                self.state.set(**{key: self.doc[key]})
        phase = str(self.doc.get("phase") or "")
        if phase and phase != self.phase and phase not in ("ready", "stopped"):
            self.say(f"  test bed: {phase}")
        self.phase = phase
        proc = self.state.proc("testbed")
        if self.doc.get("error") or (proc is not None and not proc.alive()):
            if self.doc.get("busy"):
                raise NodeBusy(node_owner())
            error = self.doc.get("error") or "it exited"
            raise DemoError(f"the test bed did not start: {error}\nsee {self.state.folder / 'bed.log'}")
        return self.doc


class ImageBuild:
    """The project's image, built with buildah (``singleton_testbed.images``: cached by content,
    so this takes a second unless the sources changed) by a subprocess whose progress is
    relayed. Started first thing: a cold build (mmdebstrap's and pip's downloads, dpkg) then
    overlaps the Go build, which keeps both cores busy only part of the time."""

    def __init__(self, state: State, say: Say) -> None:
        self.state = state
        self.say = say
        self.started = time.monotonic()
        self.building: list[str] = []
        self.tail: list[str] = []
        # Its progress goes to a file, not a pipe: if we stop early (a failed Go build, ^C of the
        # live view aside), the build finishes on its own and fills the cache, never cut short
        # by a broken pipe halfway through a buildah step.
        self.log = state.folder / "image.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "demo.bed", "image"], stdout=subprocess.PIPE,
                                         stderr=log, text=True, stdin=subprocess.DEVNULL, env=_env(state), cwd=REPO)
        self.reader = threading.Thread(target=self._relay, daemon=True)
        self.reader.start()

    def _lines(self) -> Iterator[str]:
        """The log's lines as they come, until the build has ended and all are read."""
        partial = ""
        with open(self.log, errors="replace") as log:
            while True:
                done = self.proc.poll() is not None
                partial += log.readline()
                if partial.endswith("\n") or (done and partial):
                    yield partial
                    partial = ""
                elif done:
                    return
                else:
                    time.sleep(0.2)  # at the end of what was written so far (maybe mid-line)

    def _relay(self) -> None:
        for raw in self._lines():
            line = raw.rstrip()
            self.tail[:] = [*self.tail[-19:], line]
            if line.startswith("[image] "):
                if not self.building:
                    self.say(f"building the project's image with buildah ({COLD_IMAGE})")
                self.building[:] = [line.removeprefix("[image] ")]
                self.say("  " + self.building[0])

    def finish(self, heartbeat: Say, bed: BedWatcher, *, every: float = 15.0) -> None:
        """Wait for the build (following the bed meanwhile) and hand the archive to the bed
        (``image.json``), which imports it into the node."""
        last_beat = time.monotonic()
        while self.proc.poll() is None:
            time.sleep(0.2)
            bed.poll()
            now = time.monotonic()
            if self.building and now - last_beat >= every:
                last_beat = now
                elapsed = int(now - self.started)
                heartbeat(f"  ... still building the image: {elapsed // 60}m{elapsed % 60:02d}s so far")
        self.reader.join(5)
        assert self.proc.stdout is not None
        output = self.proc.stdout.read().strip().splitlines()
        if self.proc.returncode != 0 or not output:
            raise DemoError("the image build failed:\n" + "\n".join(self.tail) + f"\n(all of it: {self.log})")
        image = json.loads(output[-1])
        seconds = time.monotonic() - self.started
        self.say(f"image {image['reference']}: " + (f"built in {seconds:.0f} s" if self.building else "cached")
                 + f" ({Path(image['archive']).name})")
        tmp = self.state.folder / (IMAGE_FILE + ".tmp")
        tmp.write_text(json.dumps(image))
        tmp.replace(self.state.folder / IMAGE_FILE)


def wait_bed(state: State, bed: BedWatcher, timeout: float = 300) -> None:
    """Until the bed says ``ready`` (the node Ready, the image imported); then remember what
    it started: the kubeconfig, the DSNs, the node, the image."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = bed.poll()
        if doc.get("ready"):
            state.set(kubeconfig=doc["kubeconfig"], dsn=doc["dsn"], admin_dsn=doc["admin_dsn"],
                      pod_dsn=doc["pod_dsn"], path_prefix=doc["path_prefix"], node=doc["node"],
                      image=doc["image"], workdirs=doc.get("workdirs", []))
            return
        time.sleep(0.2)
    raise DemoError(f"the test bed did not come up in {timeout:g} s; see {state.folder / 'bed.log'}")


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
    dsn = state.data["pod_dsn"]  # PostgreSQL at the node IP, which pods reach over the CNI bridge
    say(f"$ kubectl -n {NAMESPACE} create secret generic {SECRET} --from-literal=dsn="
        + dsn.replace(urlsplit(dsn).password or "", "***"))
    kubectl(state, "-n", NAMESPACE, "create", "secret", "generic", SECRET, f"--from-literal=dsn={dsn}")


def _spawn(argv: list[str], log_path: Path, env: dict[str, str]) -> Proc:
    """A process in a session of its own that outlives us (no parent-death signal)."""
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True, cwd=REPO)  # `-m demo...` resolves from the repository
    return Proc.of(popen.pid)


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
    """The operator as a host process, not in the cluster. Why: the demo is about the group's
    handovers, which happen between the sidecars in the node's containers (from the image),
    and the operator only writes objects and status; on the host it is ready in a second (no
    pod to schedule, pull or probe), its log is a file beside the demo's others, and the
    faults on the node can never hit it. It still acts as it would in the cluster: through the
    API server, with a token of the chart's ServiceAccount (so with the chart's RBAC only), and
    it injects the very image the pods run (``--sidecar-image``). Its in-cluster install from
    the same image is the chart's (README, "Install")."""
    kubeconfig = operator_kubeconfig(state)
    port = free_port()
    argv = [sys.executable, "-m", "singleton_operator.cli", "run", "--kubeconfig", str(kubeconfig),
            "--lease-namespace", RELEASE_NAMESPACE, "--namespace", NAMESPACE, "--identity", "singleton-demo",
            "--health-listen", f"127.0.0.1:{port}", "--log-format", "text",
            "--sidecar-image", state.data["image"]["reference"]]
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


def _stop_bed(state: State, say: Say) -> None:
    """SIGTERM the bed: it stops the node (``Node.stop`` leaves nothing behind), the control
    plane and PostgreSQL. If it was killed or does not stop, remove what it left: the node's
    leftovers (only when the node's state file names our node's folder: another node's are
    not ours to touch) and the servers' folders."""
    bed = state.proc("testbed")
    if bed is not None and bed.alive():
        say(f"stopping the test bed (pid {bed.pid}): the real node and its pods, the control plane, PostgreSQL")
        if not bed.stop(150):
            say("  it did not stop in time; killed it")
    work = state.node_work
    if work is not None and work.exists():
        with contextlib.suppress(OSError, ValueError):
            recorded = json.loads((node_mod.RUN_DIR / "state.json").read_text()).get("work")
            if recorded == str(work) and node_mod.cleanup_stale():
                say(f"removed what the killed node left behind ({work})")
        if work.exists() and not any(work.iterdir()):
            work.rmdir()  # made by Node() before the node failed to start (e.g. busy)
    for folder in state.data.get("workdirs") or []:
        if Path(folder).exists():
            shutil.rmtree(folder, ignore_errors=True)


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
    _stop_bed(state, say)
    shutil.rmtree(folder, ignore_errors=True)
    say("the demo is stopped and its files are removed")
    return 0
