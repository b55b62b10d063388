"""The exec gate: the sidecar runs the app under a keeper (``gates/keeper.py``), a small process
that holds the app in a process group of its own, follows the deadline the sidecar sends on
every renewal, stops the whole group when it passes (SIGTERM, SIGKILL ``kill_grace`` later),
kills it at once if the sidecar dies, and freezes it while the sidecar's heartbeat is late.
"Stopped" means the keeper has exited: the whole group is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

from singleton_election.core.status import ElectionStatus, Role

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
KEEPER_SCRIPT = "keeper.py"
PACKAGE_FILES = Path(__file__).parent
"""Where ``keeper.py`` is: the keeper runs as a file, so the package is installed as files (never
zipped); importlib.resources would add 0.6 MB to every sidecar for nothing."""
HEARTBEAT_INTERVAL = 0.05
"""Seconds between the exec gate's heartbeats to its keeper (``alive <t>``)."""
HEARTBEAT_STALL = 0.1
"""A heartbeat that comes this much later than the one before is not sent: the sidecar was
stalled, and what happened meanwhile (a lost lock) may not be handled yet."""
HEARTBEAT_TIMEOUT = 0.2
"""Seconds past the time the latest heartbeat vouches for after which the keeper freezes the
app. Below the exec gate's stop bound (``app.KEEPER_SLACK``, 0.25 s), which a successor waits
after this holder's PostgreSQL session ended: the heartbeat vouches for a time before the
session's end, so the app is frozen within this bound (plus the keeper's wake-up) of it."""
ENV_DEADLINE_FILE = "SINGLETON_DEADLINE_FILE"
"""Set for the exec-gated app: a file holding the term's deadline in monotonic seconds (0 once
the term ends). An app that checks it before each act never begins one past its term."""


def become_subreaper() -> None:
    """Descendants orphaned under this process are reparented to it, not to init, so the
    exec gate can find and stop what a keeper killed on its own left behind."""
    import ctypes  # only the exec gate needs it

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)


def sweep_orphans(*, timeout: float = 5.0) -> int:
    """SIGKILL every child of this process (the exec gate's keeper has exited, so any child
    left is an orphaned descendant of the app) and reap it, until none is left. Blocking, but
    only in the rare case there are any (a keeper killed alone). Returns how many were killed."""
    me, killed, deadline = str(os.getpid()), 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = _children_of(me)
        if not children:
            break
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    if killed:
        log.warning("exec gate: killed orphaned processes of the app (its keeper died alone)",
                    extra={"killed": killed})
    return killed


def _children_of(ppid: str) -> list[int]:
    found, wanted = [], ppid.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        # os.open/os.read: one syscall each; this scan runs in every handover, before release.
        try:
            fd = os.open(f"/proc/{entry}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 4096)
            finally:
                os.close(fd)
        except OSError:
            continue
        if stat.rsplit(b")", 1)[1].split()[1] == wanted:
            found.append(int(entry))
    return found


class ExecGate:
    """Runs ``command`` under a keeper only while leading. Owned and run by ``app.Sidecar``."""

    def __init__(self, command: tuple[str, ...], *, kill_grace: float, env: dict[str, str]) -> None:
        self.command = command
        self.kill_grace = kill_grace
        self.env = env
        self._status: ElectionStatus | None = None
        self._deadline = 0.0
        self._changed = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._control: int | None = None  # our end of the keeper's pipe
        self._pending: list[str] | None = None  # said while a keeper is spawned, before its pipe is ours
        self._exited = asyncio.Event()
        self._exited.set()
        self._reaper: asyncio.Future[int] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._dropped = False  # a line the keeper did not take: the heartbeat vouches no more
        self._dir: str | None = None

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc is not None else None
        return f"<ExecGate command={self.command[0]!r} keeper={pid}>"

    sees_the_app = True
    """The gate knows when the app has stopped (the keeper's exit)."""

    def on_status(self, status: ElectionStatus) -> None:
        self._status = status
        # Synchronously, inside the listener: the app hears it before anything else happens.
        if status.role is Role.DRAINING:
            self._tell(f"stop {math.inf}")  # SIGTERM; the drain timeout bounds the wait
        elif status.role is not Role.LEADER:
            self._tell(f"stop {self.kill_grace}")
        self._changed.set()

    def on_deadline(self, deadline: float) -> None:
        if deadline > 0:
            self._deadline = deadline
            self._tell(f"deadline {deadline}")
        else:
            self._tell("ended")

    def on_app_container_ended(self) -> None:
        """Nothing to learn: the exec gate's app runs in the sidecar's own container."""

    async def wait_stopped(self) -> None:
        """The drain step: returns once the keeper has exited (the app's group is gone)."""
        await self._exited.wait()

    async def stop(self, urgent: bool = False) -> None:
        """The stop step: SIGTERM (if not sent), SIGKILL after ``kill_grace`` (at once when
        ``urgent``: the lock is gone already), and wait until the group is gone."""
        self._tell(f"stop {0 if urgent else self.kill_grace}")
        await self._exited.wait()

    def _runtime_dir(self) -> str:
        """A private folder for the deadline file; "" where none can be made (a read-only
        root filesystem without a writable temporary folder): the app then has no file."""
        if self._dir is None:
            import tempfile  # here: only the exec gate makes a folder

            try:
                self._dir = tempfile.mkdtemp(prefix="singleton-gate-")
            except OSError as exc:
                log.warning("exec gate: no folder for the deadline file; apps get none", extra={"error": exc})
                self._dir = ""
        return self._dir

    def _tell(self, line: str) -> None:
        if self._control is None:
            if self._pending is not None:
                self._pending.append(line)  # a keeper is being spawned: it hears this once it runs
            return
        try:
            os.write(self._control, f"{line}\n".encode())
        except (BlockingIOError, BrokenPipeError):
            # A keeper that does not read is stalled or gone: its own deadline stops the app.
            self._dropped = True
            log.warning("exec gate: the keeper did not take a command", extra={"command": line})

    async def run(self) -> None:
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                status = self._status
                if (status is not None and status.role is Role.LEADER and self._proc is None
                        and status.token is not None):
                    await self._start(status)
        finally:
            if self._proc is not None:
                self._tell("stop 0")
                await self._exited.wait()
            if self._heartbeat is not None:
                await asyncio.gather(self._heartbeat, return_exceptions=True)  # cancelled with its keeper
            if self._dir:
                import shutil

                shutil.rmtree(self._dir, ignore_errors=True)

    async def _start(self, status: ElectionStatus) -> None:
        env = {**os.environ, **self.env, "SINGLETON_TOKEN": str(status.token),
               "SINGLETON_IDENTITY": status.identity}
        runtime_dir = self._runtime_dir()
        deadline_file = os.path.join(runtime_dir, f"deadline-{status.token}") if runtime_dir else ""
        if deadline_file:
            env[ENV_DEADLINE_FILE] = deadline_file
        keeper = str(PACKAGE_FILES / KEEPER_SCRIPT)
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        # Not stopped from here on: the keeper (and the app) may run before the spawn returns, so
        # stop() waits for it, and what is said meanwhile (a stop, a renewal, "ended") is kept for it.
        self._exited.clear()
        pending: list[str] = []
        self._pending, self._dropped = pending, False
        # From the spawn on: the keeper counts the heartbeat's timeout from its own start.
        heartbeat = self._heartbeat = asyncio.ensure_future(self._beat(write_end))
        try:
            # No PR_SET_PDEATHSIG on the keeper: when we die it must live on for the moment it
            # takes to kill the app (it sees its pipe close).
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-S", "-E", keeper, "--deadline", repr(self._deadline),
                "--kill-grace", repr(self.kill_grace), "--control-fd", str(read_end),
                "--heartbeat", repr(HEARTBEAT_TIMEOUT),
                *(["--deadline-file", deadline_file] if deadline_file else []), "--", *self.command,
                env=env, pass_fds=(read_end,), stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            # No keeper runs: a cancelled spawn killed it (the app dies with it, its children
            # were reparented to us). Say so, or every stop() would wait forever.
            heartbeat.cancel()  # before the close: it writes no more to that descriptor
            os.close(write_end)
            self._pending = None
            sweep_orphans()
            self._exited.set()
            raise
        finally:
            os.close(read_end)
        self._control, self._pending = write_end, None
        for line in pending:
            self._tell(line)
        log.info("gated process started", extra={"group": status.group, "identity": status.identity,
                                                 "token": status.token, "keeper_pid": self._proc.pid})
        proc = self._proc

        def reaped(task: asyncio.Task[int]) -> None:
            heartbeat.cancel()  # before the close: it writes no more to that descriptor
            os.close(write_end)
            if self._control == write_end:
                self._control = None
            # A keeper killed on its own takes the app with it (PR_SET_PDEATHSIG), but not the
            # app's children: they were reparented to us (a child subreaper) and go now.
            sweep_orphans()
            if self._proc is proc:
                self._proc = None
            if deadline_file:
                with contextlib.suppress(OSError):
                    os.unlink(deadline_file)
            code = task.result() if not task.cancelled() and task.exception() is None else None
            log.info("gated process stopped", extra={"group": status.group, "exit_code": code})
            self._exited.set()
            self._changed.set()  # start it again if we still lead

        self._reaper = asyncio.ensure_future(proc.wait())
        self._reaper.add_done_callback(reaped)

    async def _beat(self, fd: int) -> None:
        """Tell the keeper, every ``HEARTBEAT_INTERVAL``, that the sidecar runs (``alive <t>``),
        for as long as it runs, stops included: a graceful stop leaves the app acting under a
        lock that is still ours, and a lost session then needs the same bound. Each line
        vouches for the time of the beat before it: the loop has run since, so whatever came
        before that (a lost lock's stop, an ended term) is in the pipe ahead of the line. A beat
        that comes late (the sidecar stalled) vouches for nothing and is not sent; the keeper
        freezes the app meanwhile, and the next beat, once that has been handled, thaws it.
        Nothing while lines said during the spawn wait (``_pending``): they come first; nothing
        once a line was lost (a keeper that stopped reading): the app then stays frozen."""
        previous = time.monotonic()
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            now = time.monotonic()
            if now - previous <= HEARTBEAT_STALL and not self._pending and not self._dropped:
                # A full pipe is a stalled keeper, a broken one a dead keeper: nothing to say.
                with contextlib.suppress(BlockingIOError, BrokenPipeError):
                    os.write(fd, f"alive {previous!r}\n".encode())
            previous = now
