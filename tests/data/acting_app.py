"""A gated test app that records every moment it acts, where no fence can hide it.

Every ``ACT_INTERVAL`` seconds (0.01) it appends ``<token> <pid> <monotonic time>`` to the
file ``ACT_LOG`` (one ``write`` per line, O_APPEND: lines from several processes never
interleave). On SIGTERM it goes on acting for ``ACT_FINISH`` seconds (an app that needs that
long to finish its work), then exits. ``ACT_CHILDREN=N`` forks N children that act the same
way (plain children in the app's process group: a gate that signals only its direct child
misses them). ``ACT_IGNORE_TERM=1`` ignores SIGTERM altogether (only SIGKILL stops it).
``ACT_DETACH=<idiom>`` also starts one worker that acts the same way and leaves the app's
process group the way apps in the wild do it: ``setsid`` (a forked child calls setsid),
``setpgid`` (Go's ``SysProcAttr{Setpgid: true}``), ``popen`` (Python's
``Popen(start_new_session=True)``), ``node`` (Node's ``spawn(..., {detached: true})``, from a
``node`` that exits at once) or ``daemon`` (a double fork whose middle process exits);
with ``ACT_MAIN_EXITS=1`` the app's own process then exits at once, as a daemonising tool does.
CLOCK_MONOTONIC is one clock for every process of the machine, so the lines of all replicas
can be compared.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

NODE_SPAWN = (
    "const {spawn} = require('child_process');"
    "spawn(process.argv[1], [process.argv[2]], {detached: true, stdio: 'ignore'}).unref();"
)


def act(log: int, token: str, finish: float, ignore_term: bool) -> None:
    stop_at: list[float] = []
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop_at.append(time.monotonic() + finish) if not stop_at else None)
    interval = float(os.environ.get("ACT_INTERVAL", "0.01"))
    while not stop_at or time.monotonic() < stop_at[0]:
        os.write(log, f"{token} {os.getpid()} {time.monotonic():.6f}\n".encode())
        time.sleep(interval)


def detach(idiom: str, log: int, token: str, finish: float, ignore_term: bool) -> None:
    """Start one acting worker outside the app's process group (see the module docstring)."""
    worker_env = {key: value for key, value in os.environ.items() if key != "ACT_DETACH"}
    if idiom == "popen":
        subprocess.Popen([sys.executable, __file__], env=worker_env, start_new_session=True)
    elif idiom == "node":
        node = shutil.which("node")
        if node is None:
            raise SystemExit("ACT_DETACH=node: no node on PATH")
        subprocess.run([node, "-e", NODE_SPAWN, sys.executable, __file__], env=worker_env, check=True)
    elif idiom in ("setsid", "setpgid", "daemon"):
        if os.fork() == 0:
            if idiom == "setpgid":
                os.setpgid(0, 0)
            else:
                os.setsid()
            if idiom == "daemon" and os.fork() != 0:
                os._exit(0)  # the middle process exits: the worker is orphaned
            act(log, token, finish, ignore_term)
            os._exit(0)
    else:
        raise SystemExit(f"ACT_DETACH: unknown idiom {idiom!r}")


def main() -> int:
    token = os.environ["SINGLETON_TOKEN"]
    log = os.open(os.environ["ACT_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    finish = float(os.environ.get("ACT_FINISH", "0"))
    ignore_term = os.environ.get("ACT_IGNORE_TERM") == "1"
    children = []
    for _ in range(int(os.environ.get("ACT_CHILDREN", "0"))):
        pid = os.fork()
        if pid == 0:
            act(log, token, finish, ignore_term)
            os._exit(0)
        children.append(pid)
    if os.environ.get("ACT_DETACH"):
        detach(os.environ["ACT_DETACH"], log, token, finish, ignore_term)
        if os.environ.get("ACT_MAIN_EXITS") == "1":
            return 0
    act(log, token, finish, ignore_term)
    for pid in children:
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
