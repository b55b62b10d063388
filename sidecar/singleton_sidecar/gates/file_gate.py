"""The file gate, for main containers that cannot run our code: ``gate.sh`` (POSIX sh) wraps the
app's command in the main container and follows a flag file the sidecar keeps in a shared
``emptyDir``, rewritten on every renewal. The flag carries the deadline on the node's
boot-time clock in centiseconds (what ``/proc/uptime`` shows in every container of the node)
and the kill grace. "Stopped" means ``gate.sh`` acknowledged the sidecar's latest stop request
in ``idle``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from singleton_election.core.status import ElectionStatus, Role

log = logging.getLogger(__name__)

GATE_SCRIPT = "gate.sh"
PACKAGE_FILES = Path(__file__).parent
"""Where ``gate.sh`` is: written from the installed package's files (see ``exec_gate.PACKAGE_FILES``)."""
GATE_EXITED = "exited"
"""What gate.sh leaves in ``idle`` when it has stopped the app and exited (its container is stopping)."""


def boot_centiseconds() -> int:
    """Now on the node's boot-time clock in centiseconds: what ``/proc/uptime`` shows in every
    container of the node, so ``gate.sh`` needs neither ``date`` nor a synchronised wall clock."""
    return math.floor(time.clock_gettime(time.CLOCK_BOOTTIME) * 100)


class FileGate:
    """Keeps the files that ``gate.sh`` in the main container follows:

    - ``leader``: ``<token> <deadline> <grace>`` while this replica may act; the deadline in
      boot-time centiseconds (floored: the script stops early, never late), rewritten on every
      renewal; the grace (centiseconds from SIGTERM to SIGKILL) is the sidecar's kill grace;
    - ``draining``: the term is draining: let the app finish, do not kill it;
    - ``stop``: a nonce, written after the flag is gone; ``gate.sh`` copies it into ``idle``
      once no gated process runs, which is how the sidecar knows the app has stopped;
    - ``draining.requested``: written by ``gate.sh`` when its own container is being stopped;
      the sidecar then hands the term over (``on_app_stopping``) instead of holding it without an app;
    - ``wake``: a FIFO that ``gate.sh`` holds open; a line written to it after each change of
      the files above makes it act at once (a check every 0.1 s costs a few percent of a core
      at rest, and still adds up to 0.1 s to every handover).
    """

    def __init__(self, directory: Path, *, monotonic: Callable[[], float] = time.monotonic,
                 kill_grace: float, poll: float = 0.02,
                 on_app_stopping: Callable[[], None] | None = None) -> None:
        self.directory = directory
        self._monotonic = monotonic
        self.kill_grace = kill_grace
        self.poll = poll
        self._on_app_stopping = on_app_stopping
        self._status: ElectionStatus | None = None
        self._deadline = 0.0
        self._stop_nonce = ""
        self._container_ended = False
        self._handled_request: tuple[int, int] | None = None  # the draining.requested acted on

    def __repr__(self) -> str:
        return f"<FileGate directory={self.directory}>"

    sees_the_app = True
    """The gate knows when the app has stopped (gate.sh's acknowledgement)."""

    def install(self) -> None:
        """Write ``gate.sh`` into the shared folder and clear stale flags from an earlier run."""
        self.directory.mkdir(parents=True, exist_ok=True)
        script = (PACKAGE_FILES / GATE_SCRIPT).read_text()
        target = self.directory / GATE_SCRIPT
        tmp = self.directory / f"{GATE_SCRIPT}.tmp"
        tmp.write_text(script)
        tmp.chmod(0o755)
        tmp.replace(target)
        for name in ("leader", "draining", "draining.requested"):
            # draining.requested is gate.sh's: in an emptyDir (tmpfs, sticky) another user's file
            # cannot be removed; one left from before is then known as handled instead.
            with contextlib.suppress(OSError):
                (self.directory / name).unlink(missing_ok=True)
        self._handled_request = _file_id(self.directory / "draining.requested")
        self._make_wake_pipe()
        self._request_stop()

    def _make_wake_pipe(self) -> None:
        """Create the FIFO ``wake``, or keep the one there: a ``gate.sh`` still running from
        before this sidecar's restart holds it open, and would not see a new one."""
        wake = self.directory / "wake"
        if wake.is_fifo():
            return
        with contextlib.suppress(OSError):
            wake.unlink(missing_ok=True)
        os.mkfifo(wake)
        wake.chmod(0o666)  # gate.sh may run as another user than the sidecar

    def _wake(self) -> None:
        """Tell ``gate.sh`` that the files changed. Never blocks: no reader (gate.sh not running
        or an older one) or a full pipe (a wake is pending already) is fine."""
        try:
            fd = os.open(self.directory / "wake", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        try:
            with contextlib.suppress(OSError):
                os.write(fd, b"\n")
        finally:
            os.close(fd)

    def on_status(self, status: ElectionStatus) -> None:
        previous, self._status = self._status, status
        # Synchronously, inside the listener: the flag changes before any other I/O.
        self._write()
        if status.role is not Role.LEADER and (previous is None or previous.role != status.role):
            if previous is not None and previous.role is Role.DRAINING and self._acknowledged():
                return  # the drain's stop was acknowledged, and no app starts under a drain's flags
            # After the flags: gate.sh acknowledges this nonce only once it saw them and no app runs.
            self._request_stop()

    def on_deadline(self, deadline: float) -> None:
        self._deadline = deadline
        self._write()

    def _write(self) -> None:
        status = self._status
        if status is None:
            return
        draining = self.directory / "draining"
        if status.role is Role.DRAINING:
            draining.touch()
        else:
            draining.unlink(missing_ok=True)
        remaining = self._deadline - self._monotonic()
        if status.role in (Role.LEADER, Role.DRAINING) and remaining > 0 and status.token is not None:
            deadline = boot_centiseconds() + math.floor(remaining * 100)
            grace = math.floor(self.kill_grace * 100)
            tmp = self.directory / "leader.tmp"
            tmp.write_text(f"{status.token} {deadline} {grace}\n")
            tmp.replace(self.directory / "leader")
        else:
            (self.directory / "leader").unlink(missing_ok=True)
        self._wake()

    def _request_stop(self) -> None:
        self._stop_nonce = secrets.token_hex(8)
        tmp = self.directory / "stop.tmp"
        tmp.write_text(f"{self._stop_nonce}\n")
        tmp.replace(self.directory / "stop")
        self._wake()

    def on_app_container_ended(self) -> None:
        """The pod shows the main container terminated: gate.sh and every process it ran are gone
        with it, whether or not gate.sh had its say."""
        self._container_ended = True

    def _acknowledged(self) -> bool:
        if self._container_ended:
            return True
        try:
            return (self.directory / "idle").read_text().strip() in (self._stop_nonce, GATE_EXITED)
        except OSError:
            return False

    async def wait_stopped(self) -> None:
        """Returns once ``gate.sh`` acknowledged that no gated process runs."""
        # Polled: the file is written by another container, so there is nothing to wait on. A
        # quarter of the usual period: only while a term ends, and the handover waits on it.
        while not self._acknowledged():  # noqa: ASYNC110
            await asyncio.sleep(self.poll / 4)

    async def stop(self, urgent: bool = False) -> None:
        """The stop step: the flag is gone (``gate.sh`` kills after the grace); wait for its word.
        ``urgent`` changes nothing: gate.sh applies the grace it read (a takeover after a lost
        lock waits out the old term's lease for the file gate)."""
        del urgent
        await self.wait_stopped()

    async def run(self) -> None:
        """Hand over when the main container is being stopped while this replica leads."""
        requested = self.directory / "draining.requested"
        while True:
            # Often while leading: at a pod's deletion the kubelet's SIGTERM to gate.sh may come
            # before this sidecar's pod watch tells; a standby has nothing to hand over.
            leading = self._status is not None and self._status.role is Role.LEADER
            await asyncio.sleep(self.poll if leading else self.poll * 10)
            request = _file_id(requested)
            if request is None or request == self._handled_request:
                continue
            self._handled_request = request
            with contextlib.suppress(OSError):  # gate.sh's file: see install()
                requested.unlink(missing_ok=True)
            status = self._status
            if status is not None and status.role is Role.LEADER and self._on_app_stopping is not None:
                log.info("file gate: the main container is stopping; handing the term over",
                         extra={"group": status.group, "token": status.token})
                self._on_app_stopping()


def _file_id(path: Path) -> tuple[int, int] | None:
    """Which file ``path`` is (inode, modification time), or None when there is none."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns
