"""Gating work, not just traffic: the exec gate and the file gate.

The exec gate runs the app as a child of the sidecar, only while this replica leads.
On loss of leadership it is sent SIGTERM at once (inside the election listener, before
any other I/O) and SIGKILL after ``kill_grace``; it dies with the sidecar
(``PR_SET_PDEATHSIG``), so a crashed sidecar never leaves it running.

The file gate serves main containers that cannot run our code: ``gate.sh`` (POSIX sh)
wraps the app's command in the main container and follows a flag file that the sidecar
keeps in a shared ``emptyDir``. The flag carries an expiry (the renew deadline in wall
seconds of this node), so if the sidecar dies the app is stopped by the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from singleton_sidecar.core.status import ElectionStatus, Role

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
GATE_SCRIPT = "gate.sh"


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ExecGate:
    """Runs ``command`` only while leading. Owned and run by ``app.Sidecar``."""

    def __init__(self, command: tuple[str, ...], *, kill_grace: float, env: dict[str, str]) -> None:
        self.command = command
        self.kill_grace = kill_grace
        self.env = env
        self._status: ElectionStatus | None = None
        self._changed = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._exited = asyncio.Event()
        self._exited.set()
        self._reaper: asyncio.Future[int] | None = None

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc is not None else None
        return f"<ExecGate command={self.command[0]!r} pid={pid}>"

    def on_status(self, status: ElectionStatus) -> None:
        self._status = status
        if status.role is not Role.LEADER and self._proc is not None and self._proc.returncode is None:
            # Synchronously, inside the listener: the app hears it before anything else happens.
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)
        self._changed.set()

    async def wait_stopped(self) -> None:
        """The drain hook: returns once the gated process has exited."""
        await self._exited.wait()

    async def run(self) -> None:
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                status = self._status
                if status is None:
                    continue
                if status.role is Role.LEADER and self._proc is None and status.token is not None:
                    await self._start(status)
                elif status.role in (Role.STANDBY, Role.RELEASED) and self._proc is not None:
                    await self._stop(grace=self.kill_grace)
        finally:
            if self._proc is not None:
                await self._stop(grace=0)

    async def _start(self, status: ElectionStatus) -> None:
        env = {**os.environ, **self.env, "SINGLETON_TOKEN": str(status.token),
               "SINGLETON_IDENTITY": status.identity}
        self._proc = await asyncio.create_subprocess_exec(
            *self.command, env=env, preexec_fn=_die_with_parent,
        )
        self._exited.clear()
        log.info("gated process started pid=%s group=%s identity=%s token=%s",
                 self._proc.pid, status.group, status.identity, status.token)
        proc = self._proc

        def reap(_: asyncio.Task[int]) -> None:
            self._exited.set()
            if self._proc is proc:
                self._proc = None
                self._changed.set()  # restart it if we still lead

        self._reaper = asyncio.ensure_future(proc.wait())
        self._reaper.add_done_callback(reap)

    async def _stop(self, *, grace: float) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace):
                await proc.wait()
        except TimeoutError:
            log.warning("gated process pid=%s ignored SIGTERM for %.1fs; killing it", proc.pid, grace)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        await self._exited.wait()


class FileGate:
    """Keeps the flag files that ``gate.sh`` in the main container follows."""

    def __init__(self, directory: Path, *, remaining: Callable[[], float], wall_clock: Callable[[], float],
                 refresh: float) -> None:
        self.directory = directory
        self._remaining = remaining
        self._wall_clock = wall_clock
        self.refresh = refresh
        self._status: ElectionStatus | None = None
        self._changed = asyncio.Event()

    def __repr__(self) -> str:
        return f"<FileGate directory={self.directory}>"

    def install(self) -> None:
        """Write ``gate.sh`` into the shared folder and clear stale flags from an earlier run."""
        self.directory.mkdir(parents=True, exist_ok=True)
        script = resources.files("singleton_sidecar").joinpath(GATE_SCRIPT).read_text()
        target = self.directory / GATE_SCRIPT
        target.write_text(script)
        target.chmod(0o755)
        for name in ("leader", "draining"):
            (self.directory / name).unlink(missing_ok=True)

    def on_status(self, status: ElectionStatus) -> None:
        self._status = status
        # Synchronously, inside the listener: the flag changes before any other I/O.
        self._write(status)
        self._changed.set()

    def _write(self, status: ElectionStatus) -> None:
        draining = self.directory / "draining"
        if status.role is Role.DRAINING:
            draining.touch()
        else:
            draining.unlink(missing_ok=True)
        remaining = self._remaining()
        if status.role in (Role.LEADER, Role.DRAINING) and remaining > 0 and status.token is not None:
            expiry = int(self._wall_clock() + remaining)  # floor: the script stops early, never late
            tmp = self.directory / "leader.tmp"
            tmp.write_text(f"{status.token} {expiry}\n")
            tmp.replace(self.directory / "leader")
        else:
            (self.directory / "leader").unlink(missing_ok=True)

    async def wait_stopped(self) -> None:
        """The drain hook: returns once gate.sh reports no gated process running."""
        # Polled: the file is written by another container, so there is nothing to wait on.
        while not (self.directory / "idle").exists():  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.refresh):
                    await self._changed.wait()
            self._changed.clear()
            if self._status is not None:
                self._write(self._status)
