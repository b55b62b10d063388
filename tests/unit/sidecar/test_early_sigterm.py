"""A SIGTERM that arrives while the operator or the sidecar is still starting ends it at once.

In a container each program is PID 1, which the kernel gives no default signal action: until a
handler exists, SIGTERM is dropped and the kubelet waits out the grace period (seen as operator
pods stuck 30 s in Terminating after ``helm uninstall`` right after ``install``). The programs
install a handler first thing (``singleton_election.early_stop``), before importing kopf,
aiohttp or asyncpg (about a second), and their event loops replace it once they run.

Each case starts the real console script, waits until the kernel shows SIGTERM caught
(``SigCgt`` in /proc/PID/status), sends it at once, while the heavy imports still run, and
expects exit status 0 within seconds with the early handler's message."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

VENV_BIN = REPO_ROOT / ".venv" / "bin"
PROGRAMS = {
    "singleton-operator": (["run", "--kubeconfig", "/nonexistent/kubeconfig", "--health-listen", "127.0.0.1:0"], {}),
    # The DSN file is a FIFO nobody writes: reading its configuration, the sidecar waits there,
    # with only the early handler installed, until the SIGTERM comes. (With its configuration
    # complete and readable it reaches the event loop's handler 50 to 100 ms after the early one,
    # and a configuration it refuses ends it a few ms after: CI once lost that race.)
    "singleton-sidecar": (["run"], {"SINGLETON_GROUP": "early", "SINGLETON_BACKEND": "postgres",
                                    "SINGLETON_LOCK_KEY": "local/early", "SINGLETON_POSTGRES_DSN_FILE": "{fifo}",
                                    "SINGLETON_LISTEN": "127.0.0.1:0", "SINGLETON_CONTROL_LISTEN": "127.0.0.1:0"}),
}


def _catches_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_a_sigterm_during_start_up_ends_the_program_at_once(program: str, tmp_path: Path) -> None:
    args, env = PROGRAMS[program]
    fifo = tmp_path / "dsn"
    os.mkfifo(fifo)
    env = {name: value.format(fifo=fifo) for name, value in env.items()}
    proc = subprocess.Popen([str(VENV_BIN / program), *args], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not _catches_sigterm(proc.pid):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "SIGTERM never caught"
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=5)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, (out, err)
    assert err.strip().splitlines()[-1] == f"{program}: SIGTERM before start-up finished: exiting", err
