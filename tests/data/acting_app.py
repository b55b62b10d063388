"""A gated test app that records every moment it acts, where no fence can hide it.

Every ``ACT_INTERVAL`` seconds (0.01) it appends ``<token> <pid> <monotonic time>`` to the
file ``ACT_LOG`` (one ``write`` per line, O_APPEND: lines from several processes never
interleave). On SIGTERM it goes on acting for ``ACT_FINISH`` seconds (an app that needs that
long to finish its work), then exits. ``ACT_CHILDREN=N`` forks N children that act the same
way (plain children in the app's process group: a gate that signals only its direct child
misses them). ``ACT_IGNORE_TERM=1`` ignores SIGTERM altogether (only SIGKILL stops it).
CLOCK_MONOTONIC is one clock for every process of the machine, so the lines of all replicas
can be compared.
"""

import os
import signal
import sys
import time


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
    act(log, token, finish, ignore_term)
    for pid in children:
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
