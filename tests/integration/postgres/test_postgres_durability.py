"""Both PostgreSQL modes commit their takes and renewals with ``synchronous_commit`` on, whatever
the role or database says (issue 31, item 6): a renewal acknowledged to the holder and then lost
in a server crash would leave the row's older expiry, which a standby takes over at while the
holder still acts on the lost renewal's deadline.

What the server did is read on the server itself: a deferred constraint trigger on the lease
table, which runs at the commit of the statement's transaction, logs the setting in force then."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import pytest_asyncio

from singleton_election.backends.postgres.pooled_mode import PooledPostgresBackend
from singleton_election.backends.postgres.session_mode import PostgresBackend
from singleton_election.core.lock import Identity, Term
from tests.support.backend_timings import timings_for

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(60)]

Role = tuple[str, str]  # (DSN, schema)


@pytest_asyncio.fixture(loop_scope="function")
async def lax_role(pg_dsn: str, pg_admin_dsn: str) -> AsyncIterator[Role]:
    """(DSN, schema) of a role whose sessions commit asynchronously (``synchronous_commit = off``)."""
    role, password = f"lax_{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        await admin.execute(f"CREATE SCHEMA {role} AUTHORIZATION {role}")
        await admin.execute(f"ALTER ROLE {role} SET synchronous_commit = off")
        parts = urlsplit(pg_dsn)
        yield urlunsplit(parts._replace(netloc=f"{role}:{password}@{parts.hostname}:{parts.port}")), role
    finally:
        await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role)
        await admin.execute(f"DROP SCHEMA IF EXISTS {role} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


async def log_commits(dsn: str, schema: str) -> None:
    """From now on, every update of the lease table logs, at its commit, what it was (take,
    renew or release) and the ``synchronous_commit`` in force."""
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SHOW synchronous_commit") == "off"  # the role's default
        await conn.execute(f"""
            CREATE TABLE {schema}.commit_log (id serial PRIMARY KEY, what text, setting text);
            CREATE FUNCTION {schema}.log_commit() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO {schema}.commit_log (what, setting) VALUES (
                    CASE WHEN OLD.token IS DISTINCT FROM NEW.token THEN 'take'
                         WHEN NEW.holder IS NULL THEN 'release' ELSE 'renew' END,
                    current_setting('synchronous_commit'));
                RETURN NULL;
            END $$;
            CREATE CONSTRAINT TRIGGER log_commit AFTER UPDATE ON {schema}.singleton_leases
                DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.log_commit();""")
    finally:
        await conn.close()


async def logged(dsn: str, schema: str) -> list[tuple[str, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [(row["what"], row["setting"]) for row in
                await conn.fetch(f"SELECT what, setting FROM {schema}.commit_log ORDER BY id")]
    finally:
        await conn.close()


@pytest.mark.parametrize("mode", ["session", "pooled"])
async def test_takes_and_renewals_commit_synchronously_under_a_role_that_does_not(mode: str, lax_role: Role) -> None:
    dsn, schema = lax_role
    kind = PostgresBackend if mode == "session" else PooledPostgresBackend
    options = {"dsn": dsn, "schema": schema, "timings": timings_for(10.0, 5.0)}
    first = kind(group=f"d_{uuid.uuid4().hex[:12]}", **options)  # type: ignore[arg-type]
    backend = kind(group=f"d_{uuid.uuid4().hex[:12]}", **options)  # type: ignore[arg-type]
    try:
        await first.acquire(Identity("x"), timeout=5)  # creates the schema's table
        await log_commits(dsn, schema)
        term = await backend.acquire(Identity("a"), timeout=5)
        assert isinstance(term, Term)
        renewed = await backend.renew(term, timeout=2)
        assert renewed is not None
        assert await backend.renew(renewed, timeout=2) is not None
        assert await logged(dsn, schema) == [("take", "on"), ("renew", "on"), ("renew", "on")]
    finally:
        await first.close()
        await backend.close()
