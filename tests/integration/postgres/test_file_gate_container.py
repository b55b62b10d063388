"""The file gate as the operator wires it: ``gate.sh`` is PID 1 of the main container, so the
whole container is the app. Apps that detach a worker (each idiom of ``tests/data/acting_app.py``)
are stopped whole before the next leader acts; a process that entered the container from
outside (``kubectl exec``, an exec probe) is neither stopped nor waited for. A PID namespace
of its own (``unshare --pid --mount-proc``) stands in for the container; real sidecars, real
PostgreSQL, and the acts as the apps record them (no fence involved).

Each detached-worker test failed on the gate.sh before this (it signalled and waited for the
app's process group only, and the worker acted on beside the next leader).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from singleton_election.core.lock import Identity, Term, Token
from singleton_election.core.status import ElectionStatus, Role
from singleton_sidecar.gates import file_gate as gate
from singleton_testbed.harness.sidecars import one_leader, wait_for
from tests.support.acting import APP, FINISH, Factory, assert_never_two_actors, has_acted, spans

pytestmark = pytest.mark.postgres

IN_CONTAINER = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
IDIOMS = ["setsid", "setpgid", "popen", "daemon", "node"]


def _can_unshare() -> str | None:
    """Why a PID namespace cannot be made here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare (util-linux)"
    done = subprocess.run([*IN_CONTAINER, "true"], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"unshare --pid fails here: {done.stderr.strip()}"


needs_pid_namespace = pytest.mark.skipif(_can_unshare() is not None, reason=str(_can_unshare()))


def gate_in_container(gate_dir: Path, env: dict[str, str], stderr: Path | None = None) -> subprocess.Popen[bytes]:
    """``gate.sh`` as PID 1 of a PID namespace of its own, with /proc showing that namespace only."""
    wait_for((gate_dir / "gate.sh").exists, 10, "gate.sh to be installed")
    with open(stderr or os.devnull, "wb") as err:
        return subprocess.Popen([*IN_CONTAINER, "/bin/sh", str(gate_dir / "gate.sh"), sys.executable, APP],
                                env={**os.environ, **env}, start_new_session=True, stderr=err)


def stop_container(container: subprocess.Popen[bytes]) -> None:
    """Stop it as the kubelet would: SIGTERM to PID 1 (gate.sh stops the app and exits), then
    SIGKILL to unshare, whose death kills PID 1 and so the whole namespace."""
    if container.poll() is None:
        with contextlib.suppress(AssertionError, OSError):
            os.kill(gate_pid(container), signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            container.wait(10)
    container.kill()
    container.wait()


@pytest.fixture
def containers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for container in started:
        stop_container(container)


def gate_pid(container: subprocess.Popen[bytes]) -> int:
    """The host pid of the container's PID 1 (``gate.sh``, unshare's child)."""
    def child() -> int | None:
        children = Path(f"/proc/{container.pid}/task/{container.pid}/children").read_text().split()
        return int(children[0]) if children else None
    found: int = wait_for(child, 5, "unshare to start gate.sh")
    return found


@needs_pid_namespace
@pytest.mark.parametrize("idiom", IDIOMS)
def test_a_detached_worker_stops_before_the_next_leader_acts(
        idiom: str, gated: Factory, acting_log: Path, tmp_path: Path,
        containers: list[subprocess.Popen[bytes]]) -> None:
    if idiom == "node" and shutil.which("node") is None:
        pytest.skip("no node on PATH")
    app_env = {"ACT_LOG": str(acting_log), "ACT_FINISH": str(FINISH), "ACT_DETACH": idiom}
    members = gated(2, file_gate=True)
    containers.extend(gate_in_container(tmp_path / f"gate{i}", app_env) for i in range(2))
    leader = one_leader(members)
    old_token = leader.leader_doc()["token"]  # type: ignore[index]
    wait_for(lambda: any(len(s.pids) >= 2 for s in spans(acting_log)) if acting_log.exists() else False,
             15, "the leader's app and its detached worker to act")
    status, _ = leader.control("POST", "/step-down")
    assert status == 202
    wait_for(lambda: len(spans(acting_log)) >= 2, 15, "the next leader's app to act")
    time.sleep(1.0)  # a worker left behind would act on meanwhile
    assert_never_two_actors(acting_log, terms=2)
    old = next(s for s in spans(acting_log) if s.token == old_token)
    assert len(old.pids) >= 2, f"the detached worker never acted: {old}"


@needs_pid_namespace
def test_a_detached_worker_of_a_killed_sidecar_stops_at_the_deadline(
        gated: Factory, acting_log: Path, tmp_path: Path, containers: list[subprocess.Popen[bytes]]) -> None:
    """No sidecar left to ask: gate.sh's own deadline stops the whole container, worker included."""
    app_env = {"ACT_LOG": str(acting_log), "ACT_DETACH": "setsid", "ACT_IGNORE_TERM": "1"}
    members = gated(2, file_gate=True, env={"SINGLETON_KILL_GRACE": "0.3", "SINGLETON_DRAIN_TIMEOUT": "0.5"})
    containers.extend(gate_in_container(tmp_path / f"gate{i}", app_env) for i in range(2))
    leader = one_leader(members)
    wait_for(lambda: any(len(s.pids) >= 2 for s in spans(acting_log)) if acting_log.exists() else False,
             15, "the leader's app and its detached worker to act")
    leader.signal_sidecar_only(signal.SIGKILL)
    wait_for(lambda: len(spans(acting_log)) >= 2, 20, "the next leader's app to act")
    time.sleep(1.0)
    assert_never_two_actors(acting_log, terms=2)


@needs_pid_namespace
def test_an_app_that_daemonises_is_not_started_twice(
        gated: Factory, acting_log: Path, tmp_path: Path, containers: list[subprocess.Popen[bytes]]) -> None:
    """The app's own process exits once its worker is detached: the container still runs the
    app, so gate.sh starts no second copy beside it (it used to, once the group was empty)."""
    app_env = {"ACT_LOG": str(acting_log), "ACT_DETACH": "daemon", "ACT_MAIN_EXITS": "1"}
    members = gated(1, file_gate=True)
    containers.append(gate_in_container(tmp_path / "gate0", app_env))
    one_leader(members)
    wait_for(acting_log.exists, 15, "the detached worker to act")
    time.sleep(2.0)
    (span,) = spans(acting_log)
    assert len(span.pids) == 1, f"the app was started again beside its worker: pids {sorted(span.pids)}"


@needs_pid_namespace
def test_a_process_that_entered_the_container_is_not_the_app(
        gated: Factory, acting_log: Path, tmp_path: Path, containers: list[subprocess.Popen[bytes]]) -> None:
    """An exec probe or a ``kubectl exec`` shell joins the container's PID namespace from outside:
    gate.sh neither kills it nor waits for it before it says the app stopped."""
    members = gated(2, file_gate=True)
    containers.extend(gate_in_container(tmp_path / f"gate{i}", {"ACT_LOG": str(acting_log)}) for i in range(2))
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 15, "the leader's app to act")
    container = containers[members.index(leader)]
    visitor = subprocess.Popen(["nsenter", "--target", str(gate_pid(container)), "--pid", "--mount",
                                "sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        time.sleep(0.5)
        status, _ = leader.control("POST", "/step-down")
        assert status == 202
        wait_for(lambda: len(spans(acting_log)) >= 2, 15, "the next leader's app to act")
        assert_never_two_actors(acting_log, terms=2)
        assert visitor.poll() is None, "gate.sh killed a process that entered the container from outside"
    finally:
        os.killpg(visitor.pid, signal.SIGKILL)
        visitor.wait()


def test_outside_a_container_gate_sh_says_what_it_cannot_see(tmp_path: Path) -> None:
    gate_dir = tmp_path / "gate"
    gate.FileGate(gate_dir, kill_grace=0.3).install()
    script = subprocess.Popen(["/bin/sh", str(gate_dir / "gate.sh"), "true"], stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        time.sleep(0.5)
    finally:
        script.terminate()
        _, err = script.communicate(timeout=10)
    assert b"not PID 1 of a container" in err and b"Use the exec gate" in err, err


def test_the_kill_grace_counts_from_the_deadline_when_gate_sh_notices_late(tmp_path: Path) -> None:
    """gate.sh stalled across the flag's deadline (SIGSTOP): the app, deaf to SIGTERM, is killed
    at once on resuming, since deadline + grace has passed; it used to get the whole grace again."""
    gate_dir, acts = tmp_path / "gate", tmp_path / "acts.log"
    gate.FileGate(gate_dir, kill_grace=3.0).install()
    deadline = gate.boot_centiseconds() + 100
    (gate_dir / "leader").write_text(f"5 {deadline} 300\n")  # 1 s left, grace 3 s
    script = subprocess.Popen(["/bin/sh", str(gate_dir / "gate.sh"), sys.executable, APP],
                              env={**os.environ, "ACT_LOG": str(acts), "ACT_IGNORE_TERM": "1"},
                              start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: has_acted(acts), 10, "the app to act")
        (gate_dir / "stop").write_text("late\n")  # acknowledged once the app has stopped
        os.kill(script.pid, signal.SIGSTOP)
        # Resume 3.4 s after the deadline: 0.4 s past deadline + grace. The whole grace again
        # would be 3 s after resuming; a gate.sh slowed by a loaded machine takes about 1 s.
        time.sleep(max(0.0, (deadline + 340 - gate.boot_centiseconds()) / 100))
        os.kill(script.pid, signal.SIGCONT)
        resumed = gate.boot_centiseconds()
        idle = gate_dir / "idle"
        wait_for(lambda: idle.exists() and idle.read_text().strip() == "late", 5, "gate.sh to say the app stopped")
        assert gate.boot_centiseconds() - resumed < 200, "the app was given the whole grace again after resuming"
    finally:
        script.kill()
        script.wait()
        for pid in {int(line.split()[1]) for line in acts.read_text().splitlines()} if acts.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_gate_sh_starts_the_app_on_the_sidecars_wake_not_at_its_next_look(tmp_path: Path) -> None:
    """A flag written with a wake starts the app at once: with nothing to do, gate.sh looks on
    its own only every second (it used to poll every 0.1 s: a few percent of a core at rest)."""
    gate_dir, acts = tmp_path / "gate", tmp_path / "acts.log"
    follower = gate.FileGate(gate_dir, kill_grace=1.0)
    follower.install()
    script = subprocess.Popen(["/bin/sh", str(gate_dir / "gate.sh"), sys.executable, APP],
                              env={**os.environ, "ACT_LOG": str(acts)}, start_new_session=True,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for((gate_dir / "idle").exists, 10, "gate.sh to acknowledge the first stop nonce")
        assert len(wake_pipe_holders(gate_dir)) == 2, "gate.sh and its wake reader hold the pipe"
        time.sleep(1.2)  # past gate.sh's first look on its own: the next is a second away
        term = Term(identity=Identity("me"), token=Token(9), version="1", written_at=0.0)
        follower.on_deadline(time.monotonic() + 30)
        written = time.monotonic()
        follower.on_status(ElectionStatus(group="g", identity=Identity("me"), role=Role.LEADER, term=term,
                                          leader=Identity("me"), leader_token=Token(9), leader_since=0.0,
                                          transitions=1, reason="test"))
        wait_for(lambda: has_acted(acts), 10, "the app to act")
        first = spans(acts)[0]
        assert first.token == 9
        assert first.first - written < 0.5, f"the app began {first.first - written:.3f} s after the flag"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
        script.wait()
        for pid in {int(line.split()[1]) for line in acts.read_text().splitlines()} if acts.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_gate_sh_leaves_no_wake_reader_behind(tmp_path: Path) -> None:
    """The subshell that reads the wake pipe holds a read end only, so once gate.sh is gone (here
    SIGKILLed, outside a container) its read ends and it exits instead of blocking forever."""
    gate_dir = tmp_path / "gate"
    gate.FileGate(gate_dir, kill_grace=1.0).install()
    script = subprocess.Popen(["/bin/sh", str(gate_dir / "gate.sh"), "sleep", "60"], start_new_session=True,
                              stderr=subprocess.DEVNULL)
    (gate_dir / "leader").write_text(f"5 {gate.boot_centiseconds() + 3000} 100\n")  # so the app runs
    try:
        wait_for(lambda: len(wake_pipe_holders(gate_dir)) >= 2, 10, "gate.sh and its wake reader to open the pipe")
        assert script.pid in wake_pipe_holders(gate_dir)
        app = wait_for(lambda: app_of(script.pid), 10, "gate.sh to start the app")
        os.kill(script.pid, signal.SIGKILL)
        script.wait()
        wait_for(lambda: not wake_pipe_holders(gate_dir), 5, "the wake reader to exit once gate.sh is gone")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
    # Outside a container a killed gate.sh leaves its app (in a session of its own) running: that is
    # what docs/gating.md says of gate.sh when it is not PID 1; the test cleans it up.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(app, signal.SIGKILL)


def wake_pipe_holders(gate_dir: Path) -> set[int]:
    """The processes with the gate folder's wake pipe open (its inode, so a pipe of another
    folder never counts)."""
    inode = (gate_dir / "wake").stat().st_ino
    found = set()
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        # A process may end between the listing of /proc and the reading of its fd folder
        # (pathlib's glob raised then, CI saw it once): each read may fail.
        with contextlib.suppress(OSError):
            for fd in (process / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).endswith("/wake") and fd.stat().st_ino == inode:
                        found.add(int(process.name))
    return found


def app_of(gate_pid: int) -> int | None:
    """The app gate.sh started (its child that leads a session of its own), or None yet."""
    for child in Path(f"/proc/{gate_pid}/task/{gate_pid}/children").read_text().split():
        with contextlib.suppress(OSError):
            if os.getsid(int(child)) == int(child):
                return int(child)
    return None


FOLLOWER = """
import asyncio, sys
from pathlib import Path
from singleton_election.core.lock import Identity, Term, Token
from singleton_election.core.status import ElectionStatus, Role
from singleton_sidecar.gates.file_gate import FileGate

async def main() -> None:
    gate = FileGate(Path(sys.argv[1]), kill_grace=0.3, on_app_stopping=lambda: print("handover", flush=True))
    gate.install()
    term = Term(identity=Identity("me"), token=Token(7), version="1", written_at=0.0)
    gate.on_status(ElectionStatus(group="g", identity=Identity("me"), role=Role.LEADER, term=term,
                                  leader=Identity("me"), leader_token=Token(7), leader_since=0.0,
                                  transitions=1, reason="test"))
    print("ready", flush=True)
    await gate.run()

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_the_sidecar_follows_gate_sh_requests_it_cannot_remove() -> None:
    """An emptyDir is a sticky folder (tmpfs, mode 1777): the sidecar, another user than the main
    container's, cannot remove the ``draining.requested`` that gate.sh wrote. It used to die of
    the PermissionError (its whole task group with it, the pod's label left unwritten)."""
    gate_dir = Path(tempfile.mkdtemp(prefix="sticky-gate-", dir="/tmp"))
    try:
        gate_dir.chmod(0o1777)
        (gate_dir / "draining.requested").write_text("")  # left by gate.sh (root) before the sidecar started
        follower = subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", FOLLOWER,
             str(gate_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            assert follower.stdout is not None
            assert follower.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # the request left from before is not a new one
            os.utime(gate_dir / "draining.requested")  # gate.sh's SIGTERM: a new request
            assert follower.stdout.readline().strip() == "handover"
            time.sleep(0.5)
            assert follower.poll() is None, follower.communicate(timeout=5)[1]
        finally:
            follower.kill()
            follower.wait()
    finally:
        shutil.rmtree(gate_dir, ignore_errors=True)
