"""Run real operator processes for tests, and read what they produce."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from singleton_testbed.procs import free_port


@dataclass
class OperatorProcess:
    kubeconfig: Path
    lease_namespace: str
    log_path: Path
    name: str = "op"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        argv = [sys.executable, "-m", "singleton_operator.cli", "run", "--kubeconfig", str(self.kubeconfig),
                "--lease-namespace", self.lease_namespace, "--health-listen", f"127.0.0.1:{self.port}",
                "--identity", self.name, "--log-format", "text", *self.extra_args]
        with open(self.log_path, "ab") as out:
            self.popen = subprocess.Popen(argv, env={**os.environ, **self.env}, stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        return self

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=1) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except (urllib.error.URLError, OSError):
            return 0, ""

    def role(self) -> str:
        status, body = self.get("/readyz")
        return body.strip() if status == 200 else ""

    def signal(self, signum: int) -> None:
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signum)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
