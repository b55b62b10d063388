"""A throw-away PostgreSQL server for tests and benchmarks.

``initdb`` into a temporary folder, a free port on loopback, a superuser for set-up and
a non-superuser role (``singleton``) for the code under test. When run as root (CI is),
the server runs as the ``postgres`` system user, since PostgreSQL refuses root.

Pods of the real nodes (``node``) reach the server at the first node's IP (10.216.0.1): with
``serve_pods`` (the default when root) it listens on every IPv4 address and ``pg_hba.conf``
admits both nodes' pod networks and the node IP with a password (``scram-sha-256``), so only
the ``singleton`` role can log in from pods; other networks match no rule and are refused.
For a pod's DSN: ``dataclasses.replace(server.info, host=FIRST_NODE.node_ip).dsn`` (this
machine can use that DSN too).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from singleton_testbed.node_config import FIRST_NODE, SECOND_NODE
from singleton_testbed.procs import Process, free_port, wait_until

APP_ROLE = "singleton"
APP_PASSWORD = "singleton-test-password"
DATABASE = "singleton"
POD_NETWORKS = (FIRST_NODE.pod_cidr, f"{FIRST_NODE.node_ip}/32", SECOND_NODE.pod_cidr)
"""Admitted when serving pods: both real nodes' pod networks, and the first node's IP itself
(what this machine's own connections to the node IP come from: an operator run on the host
checks the DSN its pods get)."""


def find_pg_bin() -> Path:
    """The folder holding initdb and postgres: $PG_BIN, PATH, or Debian's layout."""
    if explicit := os.environ.get("PG_BIN"):
        return Path(explicit)
    on_path = shutil.which("initdb")
    if on_path:
        return Path(os.path.realpath(on_path)).parent
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if debian:
        return debian[-1].parent
    raise FileNotFoundError(
        "PostgreSQL server binaries not found: install Debian's postgresql package or set PG_BIN"
    )


@dataclass(frozen=True)
class PostgresInfo:
    host: str
    port: int
    superuser: str

    @property
    def admin_dsn(self) -> str:
        return f"postgresql://{self.superuser}@{self.host}:{self.port}/{DATABASE}"

    @property
    def dsn(self) -> str:
        return f"postgresql://{APP_ROLE}:{APP_PASSWORD}@{self.host}:{self.port}/{DATABASE}"


class PostgresServer:
    def __init__(self, workdir: Path | None = None, *, serve_pods: bool | None = None,
                 pod_cidrs: Sequence[str] = POD_NETWORKS, max_connections: int = 200) -> None:
        """``serve_pods``: also accept the pod networks (default: when root, as pods need root);
        ``pod_cidrs``: the networks admitted by ``pg_hba.conf``; ``max_connections``: the
        server's (PostgreSQL's default is 100; the benchmarks of a default server use it)."""
        self.max_connections = max_connections
        self.serve_pods = os.geteuid() == 0 if serve_pods is None else serve_pods
        self.pod_cidrs = tuple(pod_cidrs)
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="singleton-pg-"))
        self.datadir = self.workdir / "data"
        self.bin = find_pg_bin()
        self.port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
        self.superuser = self.user or pwd.getpwuid(os.geteuid()).pw_name
        self.process: Process | None = None

    @property
    def info(self) -> PostgresInfo:
        return PostgresInfo(host="127.0.0.1", port=self.port, superuser=self.superuser)

    def _run(self, *argv: str) -> None:
        cmd = list(argv)
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def start(self) -> PostgresInfo:
        if self.user is not None:
            os.chmod(self.workdir, 0o755)
            shutil.chown(self.workdir, self.user, self.user)
        if not self.datadir.exists():
            self._run(
                str(self.bin / "initdb"), "-D", str(self.datadir), "-U", self.superuser,
                "--auth=trust", "--no-sync", "-E", "UTF8",
            )
        if self.serve_pods:
            self._admit_pods()
        self._start_process()
        self._bootstrap()
        return self.info

    def _admit_pods(self) -> None:
        hba = self.datadir / "pg_hba.conf"
        text = hba.read_text()
        for cidr in self.pod_cidrs:
            rule = f"host all {APP_ROLE} {cidr} scram-sha-256\n"
            if rule not in text:
                text += "# pods of the real node\n" + rule
        hba.write_text(text)

    def _start_process(self) -> None:
        sockets = self.workdir / "sockets"
        sockets.mkdir(exist_ok=True)
        if self.user is not None:
            shutil.chown(sockets, self.user, self.user)
        self.process = Process(
            "postgres",
            [
                str(self.bin / "postgres"), "-D", str(self.datadir), "-p", str(self.port),
                "-c", f"listen_addresses={'0.0.0.0' if self.serve_pods else '127.0.0.1'}",  # pods: see the docstring
                "-c", f"unix_socket_directories={sockets}",
                "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                "-c", f"max_connections={self.max_connections}", "-c", "log_min_messages=warning",
            ],
            log_path=self.workdir / "postgres.log",
            user=self.user,
        )
        self.process.start()
        wait_until(self._accepts, timeout=30, what="PostgreSQL to accept connections", proc=self.process)

    def _accepts(self) -> bool:
        result = subprocess.run(
            [str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
            capture_output=True, check=False,
        )
        return result.returncode == 0

    def psql(self, sql: str, *, database: str = "postgres") -> str:
        result = subprocess.run(
            ["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.superuser, "-d", database,
             "-v", "ON_ERROR_STOP=1", "-qAt", "-c", sql],
            capture_output=True, text=True, check=True,
        )
        return result.stdout

    def _bootstrap(self) -> None:
        exists = self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'")
        if exists.strip():
            return
        self.psql(f"CREATE ROLE {APP_ROLE} LOGIN PASSWORD '{APP_PASSWORD}' NOSUPERUSER NOCREATEDB NOCREATEROLE")
        self.psql(f"CREATE DATABASE {DATABASE} OWNER {APP_ROLE}")

    def stop(self) -> None:
        if self.process is not None:
            # SIGINT is PostgreSQL's "fast shutdown": disconnect clients, stop at once.
            self.process.signal(2)
            self.process.stop(timeout=15)
            self.process = None

    def kill(self) -> None:
        """Crash the server (SIGKILL), as a machine failure would."""
        if self.process is not None:
            self.process.signal(9)
            self.process.stop(timeout=5)
            self.process = None

    def restart(self) -> None:
        self.stop()
        self._start_process()

    def cleanup(self) -> None:
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
