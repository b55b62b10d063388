"""Containers as local processes: the stand-in kubelet's "container runtime".

Called by ``kubelet_pods`` (containers, hooks) and ``kubelet_probes`` (exec probes).

A container is one host process started with ``subprocess.Popen`` whose ``preexec_fn``, in
the child before ``exec``, asks the kernel to SIGKILL it when the stand-in dies
(``PR_SET_PDEATHSIG``), enters the pod's network namespace, and unshares a mount namespace
(private propagation, so nothing leaks to the host) and a UTS namespace (hostname = pod name),
then bind-mounts the pod's volumes at their mount paths: each container sees its own pod's
files at the standard paths while the rest of the host filesystem stays visible. It is a
session and process-group leader; its exit is noticed through a pidfd on the event loop.

Exec probes and hooks enter an existing container's namespaces (``setns`` on
``/proc/PID/ns/*``). When a container's main process ends, everything left in its mount
namespace is killed, as a container runtime kills the rest of a container's PID namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from singleton_testbed.netns import kill_namespace_members, namespace_id

log = logging.getLogger(__name__)
T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class StartError(Exception):
    """The process could not be started (no such command, a failed mount); the message says why."""


@dataclass(frozen=True)
class Mount:
    """A bind mount: ``source`` on the host appears at ``target`` inside the container."""

    source: Path
    target: str
    read_only: bool = False


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one container process."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    hostname: str
    working_dir: str | None = None
    netns: Path | None = None
    """The pod's network namespace (``/run/netns/NAME``); None: the host network."""
    mounts: tuple[Mount, ...] = ()


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _die_with_parent(parent: int) -> None:
    _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the parent died before prctl: nobody would kill us later
        os._exit(1)


def _setns(fd: int, kind: int, what: str) -> None:
    _check(_libc.setns(fd, kind), f"setns({what})")


def _bind(mount: Mount) -> None:
    source, target = os.fsencode(mount.source), os.fsencode(mount.target)
    _check(_libc.mount(source, target, None, _MS_BIND | _MS_REC, None), f"bind {mount.source} on {mount.target}")
    if mount.read_only:
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY
        _check(_libc.mount(None, target, None, flags, None), f"read-only {mount.target}")


def _report(step: Callable[[], None]) -> Callable[[], None]:
    """Run ``step`` in the child; on failure say why on the container's stderr (its log) first,
    since Popen only reports "Exception occurred in preexec_fn"."""

    def run() -> None:
        try:
            step()
        except OSError as exc:
            os.write(2, f"stand-in kubelet: cannot start the container: {exc}\n".encode())
            raise

    return run


def _container_setup(spec: LaunchSpec, netns_fd: int | None, parent: int) -> Callable[[], None]:
    hostname = spec.hostname.encode()[:64]

    def setup() -> None:
        _die_with_parent(parent)
        if netns_fd is not None:
            _setns(netns_fd, _CLONE_NEWNET, "net")
        _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWUTS), "unshare(mount, uts)")
        _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
        for mount in spec.mounts:
            _bind(mount)
        _check(_libc.sethostname(hostname, len(hostname)), "sethostname")
        os.chdir(spec.working_dir or "/")  # after the mounts: the folder may be a volume

    return _report(setup)


def _enter_setup(fds: list[tuple[int, int, str]], working_dir: str | None, parent: int) -> Callable[[], None]:
    def setup() -> None:
        _die_with_parent(parent)
        for fd, kind, what in fds:
            _setns(fd, kind, what)
        os.chdir(working_dir or "/")

    return _report(setup)


def _prepare_targets(mounts: Sequence[Mount]) -> None:
    """Create mount points on the host (a file for a file, a folder otherwise): bind needs them."""
    for mount in mounts:
        target = Path(mount.target)
        if mount.source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()


class ProcessHandle:
    """A started process: its pid (also its process group), its exit as a future."""

    def __init__(self, popen: subprocess.Popen[bytes], *, mount_ns: tuple[int, int] | None = None) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.mount_ns = mount_ns
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._exit: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(self._pidfd, self._on_readable)

    def __repr__(self) -> str:
        return f"<ProcessHandle pid={self.pid} exited={self.exited}>"

    def _on_readable(self) -> None:
        code = self.popen.poll()
        if code is None:
            return
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if not self._exit.done():
            self._exit.set_result(code)

    @property
    def exited(self) -> bool:
        return self._exit.done()

    @property
    def exit_future(self) -> asyncio.Future[int]:
        return self._exit

    async def wait(self) -> int:
        """The exit status as Popen reports it (negative: killed by that signal)."""
        return await asyncio.shield(self._exit)

    def signal(self, signum: int) -> None:
        """Signal the main process only (a container runtime signals the container's PID 1)."""
        if not self.exited:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def signal_group(self, signum: int) -> None:
        """Signal the whole process group (pause, resume or kill a whole container)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def kill_tree(self) -> None:
        """SIGKILL the group and anything else left in the container's mount namespace."""
        self.signal_group(signal.SIGKILL)
        kill_namespace_members("mnt", self.mount_ns)


def _mount_ns_of(pid: int) -> tuple[int, int] | None:
    """The process's mount namespace, unless it is ours (then killing by it would kill the host)."""
    ident = namespace_id(f"/proc/{pid}/ns/mnt")
    return None if ident == namespace_id("/proc/self/ns/mnt") else ident


def spawn_container(spec: LaunchSpec) -> ProcessHandle:
    """Start a container process; must run on the event loop's thread (PDEATHSIG follows the
    thread that forks). Raises ``StartError``."""
    _prepare_targets(spec.mounts)
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    netns_fd = os.open(spec.netns, os.O_RDONLY) if spec.netns is not None else None
    try:
        with open(spec.log_path, "ab") as out:
            popen = subprocess.Popen(
                spec.argv, env=spec.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True,
                preexec_fn=_container_setup(spec, netns_fd, os.getpid()),  # noqa: PLW1509 - namespaces need the child
            )
    except (OSError, subprocess.SubprocessError) as exc:
        raise StartError(_start_message(spec.argv, exc, spec.log_path)) from exc
    finally:
        if netns_fd is not None:
            os.close(netns_fd)
    return ProcessHandle(popen, mount_ns=_mount_ns_of(popen.pid))


def spawn_in(target_pid: int, argv: list[str], *, env: dict[str, str], working_dir: str | None) -> ProcessHandle:
    """Start ``argv`` inside the namespaces (network, mount, hostname) of the running process
    ``target_pid``: an exec probe or hook. Output is discarded. Raises ``StartError``."""
    fds: list[tuple[int, int, str]] = []
    try:
        for kind, flag in (("net", _CLONE_NEWNET), ("uts", _CLONE_NEWUTS), ("mnt", _CLONE_NEWNS)):
            fds.append((os.open(f"/proc/{target_pid}/ns/{kind}", os.O_RDONLY), flag, kind))
        popen = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_enter_setup(fds, working_dir, os.getpid()),  # noqa: PLW1509 - setns needs the child
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise StartError(_start_message(argv, exc, None)) from exc
    finally:
        for fd, _, _ in fds:
            os.close(fd)
    return ProcessHandle(popen)


def _start_message(argv: list[str], exc: BaseException, log_path: Path | None) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"exec: {argv[0]!r}: executable file not found"
    if isinstance(exc, subprocess.SubprocessError) and log_path is not None:
        return f"container set-up failed (see {log_path})"
    return f"cannot start {argv[0]!r}: {exc}"


async def run_to_completion(handle: ProcessHandle, timeout: float) -> int | None:
    """Wait for the process; on timeout kill its group and return None."""
    try:
        async with asyncio.timeout(timeout):
            return await handle.wait()
    except TimeoutError:
        handle.signal_group(signal.SIGKILL)
        await handle.wait()
        return None


class TaskSet:
    """Owns background tasks: names them, logs their failures, cancels and awaits them on close."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def __repr__(self) -> str:
        return f"<TaskSet {self.owner} tasks={len(self._tasks)}>"

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.owner}: {name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("task failed: %s", task.get_name(), exc_info=exc)

    async def close(self, *, keep: asyncio.Task[Any] | None = None) -> None:
        """Cancel every task (but ``keep``) and wait until they have finished."""
        tasks = [t for t in self._tasks if t is not keep and t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
