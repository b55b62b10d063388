"""Child processes of the test bed: started so that they die with their parent,
stopped in order, never left behind. Used by ``postgres`` and ``controlplane``."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the test runner is killed, the
    # kernel sends SIGKILL to every server it started, so nothing is left running.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _as_user(user: str | None) -> Callable[[], None]:
    def prepare() -> None:
        _die_with_parent()
        if user is not None:
            import pwd

            entry = pwd.getpwnam(user)
            os.setgid(entry.pw_gid)
            os.initgroups(user, entry.pw_gid)
            os.setuid(entry.pw_uid)

    return prepare


# Ports handed out are drawn below the kernel's ephemeral range (32768 and up by default) and
# above the Kubernetes components' own (10248-10259): a port the kernel picks for an outgoing
# connection (a sidecar's to PostgreSQL, say) can never be one handed to a server that has
# not bound it yet. With bind(0) that happened: the server then failed with EADDRINUSE.
_ALL_PORTS = range(20000, 30000)


def _ports_of_this_worker() -> range:
    """Under pytest-xdist, each worker draws from a slice of its own: a port checked free by one
    worker could otherwise be handed out by another too before the first's server bound it (an
    operator takes about a second to bind its port; one failed with EADDRINUSE that way)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1):
        return _ALL_PORTS
    size = len(_ALL_PORTS) // int(count)
    first = _ALL_PORTS.start + int(worker[2:]) * size
    return range(first, first + size)


_PORTS = _ports_of_this_worker()
_handed: set[int] = set()
_random = random.Random()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, never handed out before by this process."""
    for _ in range(1000):
        port = _random.choice(_PORTS)
        if port in _handed:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {_PORTS.start}-{_PORTS.stop - 1} on 127.0.0.1")


class Process:
    """One server process with its log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        user: str | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.user = user
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            # PR_SET_PDEATHSIG fires when the *thread* that forked exits: a server started
            # from a worker thread (asyncio.to_thread) dies with that thread.
            raise RuntimeError(f"start {self.name} from the main thread, not {threading.current_thread().name}")
        log.info("starting %s: %s", self.name, " ".join(self.argv))
        with open(self.log_path, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                preexec_fn=_as_user(self.user),  # noqa: PLW1509 - prctl must run in the child
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was not started"
        return self.popen.pid

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.running():
            os.kill(self.pid, signum)

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", self.name, timeout)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self.popen = None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_until(check: Callable[[], bool], *, timeout: float, what: str, proc: Process | None = None) -> None:
    """Poll ``check`` until it is true; fail with the process log when it is not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.running():
            raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.tail()}")
        if check():
            return
        time.sleep(0.1)
    tail = f":\n{proc.tail()}" if proc is not None else ""
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{tail}")


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
