"""Build and run ``clientgo-elector`` processes, with the same interface as the sidecar's
test driver (``singleton_testbed.harness.sidecars.SidecarProcess``), so the same helpers measure both."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from singleton_testbed.harness.sidecars import SidecarProcess, one_leader

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
UNFENCED_WORKER = HERE / "unfenced_worker.py"
USER_AGENT = "clientgo-elector"
CLIENTGO_DEFAULTS = (15.0, 10.0, 2.0)  # lease duration, renew deadline, retry period (s)


class BuildError(RuntimeError):
    pass


def build() -> Path:
    """Build the elector once (``build.sh`` skips an up-to-date binary) and return its path."""
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False)
    sys.stderr.write(result.stderr)
    if result.returncode != 0:
        raise BuildError(f"{BUILD_SCRIPT} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def go_duration(seconds: float) -> str:
    return f"{seconds:g}s"


@dataclass
class ClientGoProcess(SidecarProcess):
    """One ``clientgo-elector``; with ``ledger_dsn`` also a ledger worker (``unfenced_worker.py``,
    fenced with ``fence``) in the same process group, so a signal to the group (SIGSTOP,
    SIGCONT, SIGKILL) reaches both, as it would reach the containers of one pod."""

    binary: Path = Path()
    kubeconfig: Path = Path()
    namespace: str = "default"
    lease: str = ""
    identity: str = ""
    timings: tuple[float, float, float] = CLIENTGO_DEFAULTS
    ledger_dsn: str | None = None
    fence: bool = False
    """The worker fences its writes with the term's start (``unfenced_worker.py --fence``)."""
    group_name: str = ""
    worker: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> ClientGoProcess:
        lease_duration, renew_deadline, retry_period = self.timings
        argv = [str(self.binary), f"--kubeconfig={self.kubeconfig}", f"--namespace={self.namespace}",
                f"--name={self.lease}", f"--identity={self.identity or self.name}",
                f"--listen=127.0.0.1:{self.port}", f"--lease-duration={go_duration(lease_duration)}",
                f"--renew-deadline={go_duration(renew_deadline)}", f"--retry-period={go_duration(retry_period)}"]
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as out:
            # A process group of its own in our session (the worker joins it below).
            self.popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, process_group=0)
            if self.ledger_dsn is not None:
                worker_argv = [sys.executable, str(UNFENCED_WORKER), "--url", self.url,
                               "--group", self.group_name or self.lease, "--identity", self.identity or self.name,
                               *(["--fence"] if self.fence else [])]
                self.worker = subprocess.Popen(worker_argv, env={**env, "LEDGER_DSN": self.ledger_dsn},
                                               stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               process_group=self.popen.pid)
        return self

    def stop(self) -> None:
        super().stop()
        if self.worker is not None and self.worker.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.worker.send_signal(signal.SIGCONT)
            self.worker.terminate()
            try:
                self.worker.wait(10)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait(5)


def one_clientgo_leader(members: Sequence[ClientGoProcess], timeout: float = 10.0) -> ClientGoProcess:
    """``singleton_testbed.harness.sidecars.one_leader`` for client-go electors: exactly one leads and is ready."""
    found = one_leader(list[SidecarProcess](members), timeout)
    return next(m for m in members if m is found)
