"""The exec gate's keeper: runs the app in a process group of its own and stops it on time,
even when the sidecar cannot.

The sidecar starts one keeper per term (``exec_gate.ExecGate``) and talks to it over a pipe:

    deadline <t>   the term may act until monotonic time <t> (sent on every renewal)
    stop <g>       stop now: SIGTERM to the whole group, SIGKILL <g> seconds later ("inf": no kill)
    ended          the term is over (the deadline file says 0: no new act may begin)
    alive <t>      the heartbeat (with ``--heartbeat``): the sidecar has handled everything that
                   happened before monotonic time <t>, a lost lock included

The keeper needs nothing of the sidecar to enforce that: when the deadline passes without an
extension (the sidecar is stopped, starved or paused) it sends SIGTERM to the group and
SIGKILL ``--kill-grace`` later, a drain included (it lasts only while the term is renewed);
when the pipe closes (the sidecar died) it sends SIGKILL at
once; when the heartbeat is late (the sidecar stalled) it freezes the app (see ``_heartbeat``).
It is a child subreaper, so descendants that outlive their parents are reparented to
it and reaped; it exits only once the whole group is gone, with the app's exit status. The
sidecar's "the app has stopped" is the keeper's exit.

Standard library only, started with ``python -S -E``: it is small and starts in milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import select
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(option, value)


def _die_with_keeper() -> None:
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Keeper:
    def __init__(self, command: list[str], *, deadline: float, kill_grace: float, control_fd: int,
                 deadline_file: str | None = None, heartbeat: float | None = None) -> None:
        self.command = command
        self.deadline_file = deadline_file
        self.deadline = deadline
        self._publish_deadline(deadline)
        self.kill_grace = kill_grace
        self.control_fd = control_fd
        self.stopping = False
        self.ended = False
        self.kill_at = math.inf
        self.app_pid = 0
        self.app_status: int | None = None
        self._termed: set[int] = set()
        self._buffer = b""
        self.heartbeat = heartbeat
        self.vouched = time.monotonic()  # the sidecar has just started us
        self.frozen = False

    def run(self) -> int:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # The sidecar decides when the app stops: a SIGTERM or Ctrl-C meant for its whole process
        # group (systemd's control-group stop, a terminal) must neither kill the keeper nor cut
        # the app's drain short. Handlers, not SIG_IGN, which the app would inherit.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)
        # preexec_fn is safe here: the keeper runs no threads.
        app = subprocess.Popen(self.command, start_new_session=True, preexec_fn=_die_with_keeper)  # noqa: PLW1509
        self.app_pid = app.pid
        control_open = True
        while True:
            self._reap()
            # The scan only where it is needed: the heartbeat wakes us 20 times a second.
            left = self._left() if self.stopping or self.app_status is not None else None
            if self.app_status is not None:
                if not left:
                    return self.app_status
                if not self.stopping:
                    self.stop(self.kill_grace)  # the app exited; what it left behind goes too
            now = time.monotonic()
            if now >= self.deadline and self.kill_at > self.deadline + self.kill_grace:
                # Also while draining ("stop inf"): a drain lasts only as long as the term.
                print(f"keeper: no renewal before the term's deadline; stopping process group {self.app_pid}",
                      file=sys.stderr, flush=True)
                self.stop(self.kill_grace, at=self.deadline)
            if self.heartbeat is not None:
                self._heartbeat(now, self.heartbeat)
            if self.stopping:
                self._signal(self._left() if left is None else left,
                             signal.SIGKILL if now >= self.kill_at else signal.SIGTERM)
            wake_at = min(self.kill_at, self.deadline + (self.kill_grace if now >= self.deadline else 0.0))
            if self.heartbeat is not None and not self.frozen and now < self.vouched + self.heartbeat:
                wake_at = min(wake_at, self.vouched + self.heartbeat)
            timeout = None if wake_at == math.inf else max(wake_at - now, 0.0)
            if self.stopping and (timeout is None or now >= self.kill_at):
                timeout = 0.02  # waiting for the dead to be reaped (a grandchild's exit sends us nothing)
            watched = [wake_r, self.control_fd] if control_open else [wake_r]
            readable, _, _ = select.select(watched, [], [], timeout)
            if wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            if control_open and self.control_fd in readable and not self._read_control():
                # The sidecar is gone (crashed, killed): nobody renews any more. Kill at once.
                control_open = False
                self.stop(0.0)

    def _publish_deadline(self, deadline: float) -> None:
        """Keep ``SINGLETON_DEADLINE_FILE`` (monotonic seconds): an app that checks it before
        each act never begins one after its term's deadline, even woken from a freeze of the
        whole pod before anyone could stop it."""
        if self.deadline_file is None:
            return
        tmp = f"{self.deadline_file}.tmp"
        with contextlib.suppress(OSError), open(tmp, "w") as out:
            out.write(f"{deadline:.6f}\n")
        with contextlib.suppress(OSError):
            os.replace(tmp, self.deadline_file)

    def _heartbeat(self, now: float, heartbeat: float) -> None:
        """The stop bound a successor waits after this holder's PostgreSQL session ended (0.25 s)
        holds only while the sidecar hears that end and has the group killed at once. A sidecar
        stalled alone (SIGSTOP, a debugger, CPU throttling) hears nothing, so the app may act
        only while the sidecar's latest ``alive <t>`` is younger than ``--heartbeat`` (0.2 s):
        past that, the whole app is frozen (SIGSTOP), which it cannot resist.

        Frozen, not killed: a GC pause of the sidecar must not cost a healthy leader its app, and
        a frozen app does not act. Heartbeats that resume thaw it (SIGCONT): a fresh ``<t>`` says
        the sidecar has since handled whatever happened while it stalled, and a lost lock would
        have reached us as a stop, before that line. A frozen app in a term that is ending (a
        stop other than the drain's, "ended", the deadline passed) is killed at once instead:
        it could not finish anything frozen, and a SIGCONT to let it handle SIGTERM would let
        it act again when the sidecar may not vouch for it. A drain (``stop inf``) only queues
        its SIGTERM, which the app handles once thawed."""
        silent = now >= self.vouched + heartbeat
        if silent and not self.frozen and not (self.stopping and now >= self.kill_at):
            print(f"keeper: no heartbeat from the sidecar for {now - self.vouched:.3f}s; freezing process group "
                  f"{self.app_pid}", file=sys.stderr, flush=True)
            self.frozen = True
            self._send_all(signal.SIGSTOP)
        if not self.frozen:
            return
        if self.ended or self.kill_at < math.inf:
            self.stop(0.0)
        elif not silent:
            print(f"keeper: the sidecar's heartbeat is back; thawing process group {self.app_pid}",
                  file=sys.stderr, flush=True)
            self.frozen = False
            self._send_all(signal.SIGCONT)

    def _send_all(self, signum: int) -> None:
        """``signum`` to the group at once (one killpg, no process left out), then to the rest;
        for SIGSTOP, until a scan finds nothing new (a fork under way as we signalled)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.app_pid, signum)
        sent: set[int] = set()
        while pending := [pid for pid in self._left() if pid not in sent]:
            for pid in pending:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)
            sent.update(pending)
            if signum != signal.SIGSTOP:
                break

    def stop(self, grace: float, *, at: float | None = None) -> None:
        self.stopping = True
        self.kill_at = min(self.kill_at, (time.monotonic() if at is None else at) + grace)

    def _read_control(self) -> bool:
        """Apply what the sidecar wrote; False once the pipe is closed."""
        try:
            data = os.read(self.control_fd, 4096)
        except InterruptedError:
            return True
        except OSError:
            return False
        if not data:
            return False
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            verb, _, value = line.decode().partition(" ")
            if verb == "deadline":
                self.deadline = float(value)
                if not self.ended:
                    self._publish_deadline(self.deadline)  # draining included: the term goes on
            elif verb == "stop":
                self.stop(float(value))
            elif verb == "ended":
                self.ended = True
                self._publish_deadline(0.0)  # the term is over: no new act may begin
            elif verb == "alive":
                self.vouched = max(self.vouched, float(value))
        return True

    def _left(self) -> list[int]:
        """The processes still to stop: the app's group and every descendant of ours (in the
        group or not: a worker that left it, reparented to us or not), zombies excluded. Those
        outside the group come first: a frozen worker in a group of its own whose parent dies
        first may be sent SIGCONT by the kernel (an orphaned process group with stopped members)."""
        children: dict[int, list[int]] = {}
        group: list[int] = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            # os.open/os.read, not open(): one syscall each, no buffering layers. This scan
            # runs twice in every stop, which a handover waits for.
            try:
                fd = os.open(f"/proc/{entry}/stat", os.O_RDONLY)
                try:
                    stat = os.read(fd, 4096)
                finally:
                    os.close(fd)
            except OSError:
                continue  # gone meanwhile
            fields = stat.rsplit(b")", 1)[1].split()
            if fields[0] == b"Z":
                continue
            pid = int(entry)
            children.setdefault(int(fields[1]), []).append(pid)
            if int(fields[2]) == self.app_pid:
                group.append(pid)
        outside, frontier, in_group = [], [os.getpid()], set(group)
        while frontier:
            for pid in children.get(frontier.pop(), ()):
                frontier.append(pid)
                if pid not in in_group:
                    outside.append(pid)
        return outside + group

    def _signal(self, pids: list[int], signum: int) -> None:
        for pid in pids:
            if signum == signal.SIGTERM:
                if pid in self._termed:
                    continue
                self._termed.add(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.app_pid:
                code = os.waitstatus_to_exitcode(status)
                self.app_status = code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    # Not the docstring: the image holds -OO bytecode of this file too, which has none.
    parser = argparse.ArgumentParser(prog="singleton-keeper", description="The exec gate's keeper: runs the app in "
                                     "a process group of its own and stops it on time, even when the sidecar cannot.")
    parser.add_argument("--deadline", type=float, required=True, help="monotonic time the term may act until")
    parser.add_argument("--kill-grace", type=float, required=True, help="seconds from SIGTERM to SIGKILL")
    parser.add_argument("--control-fd", type=int, required=True, help="the pipe the sidecar writes to")
    parser.add_argument("--deadline-file", default=None, help="file to keep the term's deadline in, for the app")
    parser.add_argument("--heartbeat", type=float, default=None,
                        help="freeze the app when the sidecar's latest 'alive' is older than this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command is required after --")
    return Keeper(command, deadline=args.deadline, kill_grace=args.kill_grace, control_fd=args.control_fd,
                  deadline_file=args.deadline_file, heartbeat=args.heartbeat).run()


if __name__ == "__main__":
    status = main()
    # Nothing to finalize: every process of the app is gone (that is when run() returns), and
    # the sidecar waits for this exit to release the lock, so skip the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
