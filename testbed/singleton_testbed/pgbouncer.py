"""A throw-away PgBouncer in front of the test bed's PostgreSQL, in a given pool mode.

Used by the PostgreSQL backend's tests to check that a transaction- or statement-mode pooler
is refused and a session-mode one works. PgBouncer listens on a free loopback port, asks
clients for the ``singleton`` role's password (``md5``; the password sits in its auth file,
which it also uses to log in to the server, whose loopback rule is ``trust``) and keeps its
files in a temporary folder. PgBouncer refuses to run as root: as root it runs as the
``postgres`` system user, like the server.

    with PgBouncer(server.info, pool_mode="transaction") as bouncer:
        dsn = bouncer.dsn   # the singleton role, through the pooler

``settings`` adds or overrides ``[pgbouncer]`` options (``server_round_robin``, ...).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Literal

from singleton_testbed.postgres import APP_PASSWORD, APP_ROLE, DATABASE, PostgresInfo
from singleton_testbed.procs import Process, free_port, wait_until

PoolMode = Literal["session", "transaction", "statement"]


def find_pgbouncer() -> Path:
    """The pgbouncer binary: $PGBOUNCER, PATH, or Debian's /usr/sbin."""
    if explicit := os.environ.get("PGBOUNCER"):
        return Path(explicit)
    on_path = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if on_path:
        return Path(on_path)
    raise FileNotFoundError("pgbouncer not found: install Debian's pgbouncer package or set PGBOUNCER")


class PgBouncer:
    """One PgBouncer process; a context manager that starts and stops it."""

    def __init__(self, server: PostgresInfo, *, pool_mode: PoolMode, settings: Mapping[str, str] | None = None,
                 workdir: Path | None = None) -> None:
        self.server = server
        self.pool_mode = pool_mode
        self.settings = dict(settings or {})
        self.binary = find_pgbouncer()
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="singleton-pgbouncer-"))
        self.port = free_port()
        self.user = "postgres" if os.geteuid() == 0 else None
        self.process: Process | None = None

    @property
    def dsn(self) -> str:
        """The ``singleton`` role's DSN through the pooler."""
        return f"postgresql://{APP_ROLE}:{APP_PASSWORD}@127.0.0.1:{self.port}/{DATABASE}"

    def _write_config(self) -> Path:
        userlist = self.workdir / "userlist.txt"
        userlist.write_text(f'"{APP_ROLE}" "{APP_PASSWORD}"\n')
        ini = self.workdir / "pgbouncer.ini"
        options = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",  # loopback TCP only: no socket file to collide with another test bed
            "auth_type": "md5",
            "auth_file": str(userlist),
            "pool_mode": self.pool_mode,
            "max_client_conn": "100",
            "default_pool_size": "20",
            "log_connections": "0",
            "log_disconnections": "0",
            **self.settings,
        }
        ini.write_text("\n".join([
            "[databases]",
            f"{DATABASE} = host={self.server.host} port={self.server.port} dbname={DATABASE}",
            "[pgbouncer]",
            *(f"{name} = {value}" for name, value in options.items()),
            "",
        ]))
        if self.user is not None:
            os.chmod(self.workdir, 0o755)
            for path in (self.workdir, userlist, ini):
                shutil.chown(path, self.user, self.user)
        return ini

    def start(self) -> str:
        """Start PgBouncer and wait until it accepts connections; returns the DSN."""
        ini = self._write_config()
        self.process = Process(
            "pgbouncer", [str(self.binary), str(ini)], log_path=self.workdir / "pgbouncer.log", user=self.user)
        self.process.start()
        wait_until(self._accepts, timeout=15, what="PgBouncer to accept connections", proc=self.process)
        return self.dsn

    def _accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(timeout=10)  # SIGTERM: PgBouncer's immediate shutdown
            self.process = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
