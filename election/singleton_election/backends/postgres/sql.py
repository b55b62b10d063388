"""Every SQL statement of the PostgreSQL backend, and the rules for the names in them.

Only identifiers (the schema and table names, validated and quoted here) are put into SQL
text; every value (group, identity, token, durations, lock keys) is a bind parameter, and
durations become intervals with ``make_interval(secs => $n)``. The exceptions are the
pooler probe's values (a hex nonce we generate, IP addresses and ports from our own socket,
each checked here): the probe must use the simple query protocol, because a transaction-mode
pooler breaks prepared statements before the probe could say why.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

NAMESPACE: Final = 0x53474C54
"""First key of every two-int advisory lock singleton takes ("SGLT"). Two-int keys live in
a different key space from the bigint form (``objsubid`` 2 instead of 1 in ``pg_locks``),
so they never collide with an application's ``pg_advisory_lock(bigint)``."""

DDL_LOCK_ID: Final = 0
"""Second key of the transaction-level lock taken around schema creation; group lock ids
come from a sequence starting at 1, so this one is never a group's."""

SCHEMA_VERSION: Final = 1

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_IDENTIFIER = 63  # NAMEDATALEN - 1
_SUFFIXES: Final = ("_schema_version", "_token_seq", "_lock_id_seq")
_NONCE = re.compile(r"[0-9a-f]{8,64}")

PROBE_SETTING: Final = "singleton.session_probe"
"""Custom setting the pooler probe writes on the lock's session: ``<nonce>:<backend pid>``."""


def quote_identifier(name: str, *, what: str, max_length: int = _MAX_IDENTIFIER) -> str:
    """``name`` double-quoted, after checking it is a plain SQL identifier."""
    if not _IDENTIFIER.fullmatch(name) or len(name) > max_length:
        raise ValueError(
            f"invalid {what} name {name!r}: use 1 to {max_length} ASCII letters, digits or "
            "underscores, not starting with a digit"
        )
    return '"' + name.replace('"', '""') + '"'


def granted_group_lock(namespace: str, lock_id: str | None) -> str:
    """The condition on ``pg_locks l`` for a granted group lock of this database (the
    two-int form, so ``objsubid`` 2), with the namespace and lock id (None: any) as SQL
    expressions."""
    return (
        "l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        f" AND l.classid::bigint = {namespace}" + ("" if lock_id is None else f" AND l.objid::bigint = {lock_id}")
    )


def application_name(group: str) -> str:
    """The ``application_name`` of every session of the group's sidecars (63 characters at
    most, as the server keeps it): how a lock whose row was deleted is known for the group's."""
    return f"singleton:{group}"[:_MAX_IDENTIFIER]


@dataclass(frozen=True)
class Statements:
    """The statements for one schema and table."""

    schema: str
    table: str

    @classmethod
    def build(cls, schema: str, table: str) -> Statements:
        quote_identifier(schema, what="schema")
        quote_identifier(table, what="table", max_length=_MAX_IDENTIFIER - max(map(len, _SUFFIXES)))
        return cls(schema, table)

    def _name(self, suffix: str = "") -> str:
        schema = quote_identifier(self.schema, what="schema")
        return f"{schema}.{quote_identifier(self.table + suffix, what='table')}"

    @property
    def leases(self) -> str:
        return self._name()

    @property
    def version_table(self) -> str:
        return self._name("_schema_version")

    @property
    def token_seq(self) -> str:
        return self._name("_token_seq")

    @property
    def lock_id_seq(self) -> str:
        return self._name("_lock_id_seq")

    # -- schema ------------------------------------------------------------------------

    @property
    def objects_exist(self) -> str:
        """$1..$4 = the qualified names of the table, version table and sequences."""
        return (
            "SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL"
            " AND to_regclass($3) IS NOT NULL AND to_regclass($4) IS NOT NULL"
            # Columns added within schema version 1 (nullable, so older sidecars ignore them).
            " AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1)"
            "   AND attname = 'stop_bound' AND NOT attisdropped)"
        )

    @property
    def read_schema_version(self) -> str:
        return f"SELECT max(version) FROM {self.version_table}"

    @property
    def schema_exists(self) -> str:
        return "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)"

    @property
    def create_schema(self) -> str:
        return f"CREATE SCHEMA IF NOT EXISTS {quote_identifier(self.schema, what='schema')}"

    @property
    def ddl_lock(self) -> str:
        return "SELECT pg_advisory_xact_lock($1::int4, $2::int4)"

    @property
    def create_objects(self) -> tuple[str, ...]:
        return (
            f"CREATE SEQUENCE IF NOT EXISTS {self.token_seq} AS bigint MINVALUE 1 NO CYCLE",
            f"CREATE SEQUENCE IF NOT EXISTS {self.lock_id_seq} AS integer MINVALUE 1 NO CYCLE",
            f"""CREATE TABLE IF NOT EXISTS {self.leases} (
                group_name  text        PRIMARY KEY,
                lock_id     bigint      NOT NULL UNIQUE,
                holder      text        NULL,
                holder_pid  integer     NULL,
                token       bigint      NULL,
                transitions bigint      NOT NULL DEFAULT 0,
                acquired_at timestamptz NULL,
                renewed_at  timestamptz NULL,
                expires_at  timestamptz NULL,
                released_at timestamptz NULL)""",
            # How long the holder's app may act after its session ends (NULL: until expires_at).
            f"ALTER TABLE {self.leases} ADD COLUMN IF NOT EXISTS stop_bound double precision NULL",
            f"""CREATE TABLE IF NOT EXISTS {self.version_table} (
                version     integer     PRIMARY KEY,
                applied_at  timestamptz NOT NULL DEFAULT now())""",
        )

    @property
    def record_schema_version(self) -> str:
        return f"INSERT INTO {self.version_table} (version) VALUES ($1) ON CONFLICT DO NOTHING"

    # -- per group ---------------------------------------------------------------------

    @property
    def insert_group(self) -> str:
        """$1 = group, $2 = lock id sequence, $3 = the group's ``application_name``, $4 =
        namespace. Creates the group's row on first use, and again after it was deleted.

        The lock id is the group's for good: a row deleted while its lock is held (the old
        holder's app may still act) comes back under that lock id, found as a granted group lock
        of this database that no row names, held by a session of the group's application_name,
        so the next holder waits for it. Two such locks (groups whose names share their first
        53 characters, both deleted while held) are not told apart: no row is created until one
        is given back. Otherwise the next value of the sequence."""
        return (
            "WITH orphaned AS (SELECT DISTINCT l.objid::bigint AS lock_id"
            " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            f" WHERE {granted_group_lock('$4', None)} AND l.objid::bigint <> {DDL_LOCK_ID}"
            " AND a.application_name = $3"
            f" AND NOT EXISTS (SELECT 1 FROM {self.leases} r WHERE r.lock_id = l.objid::bigint))"
            f" INSERT INTO {self.leases} (group_name, lock_id)"
            " SELECT $1, coalesce(max(lock_id), nextval($2::text::regclass)) FROM orphaned HAVING count(*) <= 1"
            " ON CONFLICT (group_name) DO NOTHING"
        )

    @property
    def lock_id(self) -> str:
        return f"SELECT lock_id FROM {self.leases} WHERE group_name = $1"

    @property
    def set_lock_timeout(self) -> str:
        return "SELECT set_config('lock_timeout', $1, false)"

    @property
    def set_session(self) -> str:
        """$1 names, $2 values: session-level settings of the lock's connection."""
        return "SELECT count(set_config(s.name, s.value, false)) FROM unnest($1::text[], $2::text[]) AS s(name, value)"

    @property
    def lock(self) -> str:
        return "SELECT pg_advisory_lock($1::int4, $2::int4)"

    @property
    def unlock(self) -> str:
        return "SELECT pg_advisory_unlock($1::int4, $2::int4)"

    @property
    def still_locked(self) -> str:
        """$1 namespace, $2 lock id: whether this session still holds the lock (after an unlock:
        it had taken it more than once, as session advisory locks stack)."""
        return (
            f"SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE {granted_group_lock('$1', '$2')}"
            " AND l.pid = pg_backend_pid())"
        )

    @property
    def unlock_all(self) -> str:
        return "SELECT pg_advisory_unlock_all()"

    @property
    def take(self) -> str:
        """$1 group, $2 identity, $3 lease seconds, $4 lock id, $5 token sequence, $6 this holder's
        stop bound (seconds its app may act after its session ends; NULL: until its lease expires).

        Returns the previous term's state too: a term that was not released (its holder crashed,
        or its session was ended under it) may still have an app stopping, for at most its stop
        bound and never past its expiry; the new holder waits that long before acting.

        The token is a hybrid logical clock: the greatest of the sequence's next value, the
        server's clock in milliseconds since the epoch (the Lease backend's unit, so a group
        switched between backends never goes down) and the row's last token + 1 (the group's
        own floor: the sequence is shared by groups and may lag, the clock may step back).
        A sequence that fell behind is advanced to the token (``setval``, not rolled back), so
        later ``nextval`` starts above it. Runs under the group's advisory lock."""
        return (
            f"WITH issued AS (SELECT nextval($5::text::regclass) AS seq,"
            " floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS clock_ms),"
            f" prev AS (SELECT holder, token, expires_at, stop_bound FROM {self.leases}"
            "   WHERE group_name = $1 AND lock_id = $4)"
            f" UPDATE {self.leases} r SET holder = $2, holder_pid = pg_backend_pid(),"
            " token = greatest(i.seq, i.clock_ms, coalesce(r.token, 0) + 1),"
            " transitions = r.transitions + 1,"
            " acquired_at = now(), renewed_at = now(),"
            " expires_at = now() + make_interval(secs => $3), released_at = NULL, stop_bound = $6"
            " FROM issued i, prev p WHERE r.group_name = $1 AND r.lock_id = $4"
            " RETURNING r.token, CASE WHEN r.token > i.seq THEN setval($5::text::regclass, r.token) END AS advanced,"
            " p.holder IS NOT NULL AS unreleased, p.holder AS previous_holder, p.token AS previous_token,"
            " p.stop_bound AS previous_stop_bound,"
            " extract(epoch FROM p.expires_at - now())::float8 AS previous_expiry_left"
        )

    @property
    def under_lock(self) -> str:
        """$1 group, $2 lock id: the row as the take will find it, read once under the lock:
        ``pooled``, a live pooled-mode term holds it (a holder without a session, unexpired:
        that mode takes no advisory lock); the last term (``holder``, ``token``, ``stop_bound``,
        ``expiry_left``) when the row is this lock's (``same_lock``)."""
        return (
            "SELECT holder, token, stop_bound, extract(epoch FROM expires_at - now())::float8 AS expiry_left,"
            " coalesce(holder IS NOT NULL AND holder_pid IS NULL AND expires_at > now(), false) AS pooled,"
            " lock_id = $2 AS same_lock"
            f" FROM {self.leases} WHERE group_name = $1"
        )

    @property
    def renew(self) -> str:
        """$1 group, $2 identity, $3 token, $4 lease seconds. A row only if still ours."""
        return (
            f"UPDATE {self.leases} SET renewed_at = now(),"
            " expires_at = now() + make_interval(secs => $4)"
            " WHERE group_name = $1 AND holder = $2 AND token = $3 AND holder_pid = pg_backend_pid()"
            " RETURNING token"
        )

    @property
    def release(self) -> str:
        """$1 group, $2 identity, $3 token."""
        return (
            f"UPDATE {self.leases} SET holder = NULL, holder_pid = NULL,"
            " released_at = now(), expires_at = now()"
            " WHERE group_name = $1 AND holder = $2 AND token = $3"
        )

    @property
    def observe(self) -> str:
        """$1 group, $2 namespace. The row, whether its holder's session still holds the
        advisory lock (``live``), and whether (and in how many seconds) its lease expires by the
        database clock."""
        return (
            "SELECT r.holder, r.token, r.holder_pid, r.lock_id,"
            " coalesce(r.expires_at < now(), false) AS expired,"
            " extract(epoch FROM r.expires_at - now())::float8 AS expiry_left,"
            " EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            f"   WHERE {granted_group_lock('$2', 'r.lock_id')}"
            "   AND l.pid = r.holder_pid AND a.backend_start <= r.acquired_at) AS live"
            f" FROM {self.leases} r WHERE r.group_name = $1"
        )

    @property
    def lock_sessions(self) -> str:
        """$1 namespace, $2 lock id. The sessions holding the group's advisory lock (pid,
        application_name, state, when the backend and its state began): what a standby
        reports when the lock is held while the row names no holder."""
        return (
            "SELECT a.pid, a.application_name, a.state, a.backend_start, a.state_change"
            " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            f" WHERE {granted_group_lock('$1', '$2')}"
        )

    @property
    def terminate(self) -> str:
        return "SELECT pg_terminate_backend($1)"

    @property
    def session_alive(self) -> str:
        # pg_terminate_backend only signals the session: it holds its locks until it has exited.
        return "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)"

    @property
    def holder(self) -> str:
        """$1 group. Who holds the row: its holder, the holder's session (none in pooled mode)
        and the seconds until the row expires by the database clock."""
        return (
            "SELECT holder, holder_pid, extract(epoch FROM expires_at - now())::float8 AS expires_in"
            f" FROM {self.leases} WHERE group_name = $1"
        )


@dataclass(frozen=True)
class SessionProbe:
    """Statements of the pooler probe for one nonce; run with the simple query protocol
    (``execute`` without arguments), each answers with its row count: ``SELECT 1`` or ``SELECT 0``."""

    nonce: str

    def __post_init__(self) -> None:
        if not _NONCE.fullmatch(self.nonce):
            raise ValueError(f"probe nonce must be 8 to 64 lowercase hex digits, got {self.nonce!r}")

    @property
    def mark(self) -> str:
        """Write ``<nonce>:<pid>`` into the session (session-level, not transaction-local)."""
        return f"SELECT set_config('{PROBE_SETTING}', '{self.nonce}:' || pg_backend_pid(), false)"

    @property
    def still_mine(self) -> str:
        """One row if this statement ran in the marked session (same setting, same backend)."""
        return f"SELECT 1 WHERE current_setting('{PROBE_SETTING}', true) = '{self.nonce}:' || pg_backend_pid()"

    @property
    def seen_elsewhere(self) -> str:
        """One row if this session carries the mark (run on a second connection: it must not)."""
        return f"SELECT 1 WHERE current_setting('{PROBE_SETTING}', true) LIKE '{self.nonce}:%'"


def same_tcp_connection(client: tuple[str, int], server: tuple[str, int]) -> str:
    """One row if the server's end of this session is the TCP connection whose ends are
    ``client`` (our socket's address) and ``server`` (the address we reached). A pooler's
    server connection has the pooler's address and port, never ours; that the server itself
    is at the address we reached rules out a proxy or pooler on our own machine.
    Raises ``ValueError`` for anything but plain IP addresses and ports."""
    (client_ip, client_port), (server_ip, server_port) = (_endpoint(*client), _endpoint(*server))
    return (
        "SELECT 1 FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        f" AND client_addr = '{client_ip}'::inet AND client_port = {client_port}"
        f" AND inet_server_addr() = '{server_ip}'::inet AND inet_server_port() = {server_port}"
    )


def _endpoint(host: str, port: int) -> tuple[str, int]:
    address = ipaddress.ip_address(host)
    if "%" in str(address) or not (isinstance(port, int) and 0 < port < 65536):
        raise ValueError(f"not a plain IP endpoint: {host!r} {port!r}")
    return str(address), port
