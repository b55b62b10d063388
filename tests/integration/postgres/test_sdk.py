"""The application SDK (sdk/, ``singleton_sdk``) against real sidecar processes and the real
PostgreSQL server: the body of ``leadership()`` is cancelled when the term ends or starts
ending, the sidecar releases only once it has exited, the threaded twin likewise; the
sidecar's long poll over HTTP; fenced writes through asyncpg, psycopg 3 and SQLAlchemy."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy
from sqlalchemy.orm import Session

import singleton_sdk.asyncpg as sdk_asyncpg
import singleton_sdk.psycopg as sdk_psycopg
import singleton_sdk.sqlalchemy as sdk_sqlalchemy
from singleton_operator.model import resources
from singleton_operator.model.spec import read_spec
from singleton_sdk import (
    DEFAULT_CONTROL_URL,
    DEFAULT_LEADER_URL,
    ENV_CONTROL_URL,
    ENV_LEADER_URL,
    LeaderClient,
    LeadershipLost,
    SidecarError,
    StaleToken,
    Term,
    uninterrupted,
)
from singleton_sdk import sync as sdk_sync
from singleton_sidecar.config import SidecarConfig
from singleton_testbed.harness.sidecars import (
    FAST_TIMINGS,
    SidecarProcess,
    one_leader,
    wait_for,
    wait_last_row,
    wait_serving,
)
from singleton_testbed.ledger import check_ledger
from tests.support.paths import REPO_ROOT
from tests.unit.operator.test_operator_units import IMAGE, body, env_of

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(90)]

WORK_DDL = """
CREATE TABLE IF NOT EXISTS work_items (
    id bigserial PRIMARY KEY, payload text, claimed_by text, claimed_token bigint, claimed_at timestamptz,
    done_at timestamptz)
"""
STEP_SECONDS = 0.8
"""How long a cancelled body goes on (finishing its step) before it exits, in the tests."""


@pytest.fixture
def pair(pg_dsn: str, tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    group = "sdk-" + uuid.uuid4().hex[:8]
    members = [SidecarProcess(f"s{i}", {"SINGLETON_GROUP": group, "SINGLETON_POSTGRES_DSN": pg_dsn,
                                        **FAST_TIMINGS}, tmp_path / f"s{i}.log").start() for i in range(2)]
    wait_serving(members)
    yield members
    for member in members:
        member.stop()


def client_of(sidecar: SidecarProcess, **kwargs: Any) -> LeaderClient:
    return LeaderClient(sidecar.url + "/leader", control_url=f"http://127.0.0.1:{sidecar.control_port}", **kwargs)


def sync_client_of(sidecar: SidecarProcess) -> sdk_sync.LeaderClient:
    return sdk_sync.LeaderClient(sidecar.url + "/leader", control_url=f"http://127.0.0.1:{sidecar.control_port}")


def get_json(sidecar: SidecarProcess, path: str, timeout: float = 70.0) -> tuple[int, dict[str, Any], float]:
    """(status, document, seconds taken) of a GET on the probe port."""
    started = time.monotonic()
    status, text = sidecar.get(path, timeout)
    return status, json.loads(text), time.monotonic() - started


# --- the long poll ------------------------------------------------------------------------

def test_the_long_poll_answers_on_each_change_and_waits_otherwise(pair: list[SidecarProcess]) -> None:
    leader = one_leader(pair)
    standby = next(s for s in pair if s is not leader)
    status, first, _ = get_json(standby, "/leader")
    assert status == 200 and first["role"] == "standby" and first["validFor"] == 0
    # Once a standby's document settles, the answer comes when the wait is over, the same
    # version; an answer before that always carries a new version.
    unchanged = 0
    for _ in range(5):
        status, same, took = get_json(standby, f"/leader?after={first['version']}&wait=1")
        assert status == 200
        if same["version"] == first["version"]:
            assert 0.95 <= took < 2.0 and 0.95 <= same["waited"] <= took, (took, same)
            unchanged += 1
        first = same
    assert unchanged >= 3
    # A leader's document moves with each renewal (every retry period, 0.5 s here), deadline and all.
    _, before, _ = get_json(leader, "/leader")
    assert before["isLeader"] and 0 < before["validFor"] <= 1.5
    status, renewed, took = get_json(leader, f"/leader?after={before['version']}&wait=30")
    assert status == 200 and renewed["version"] != before["version"] and took < 1.0, (took, renewed)
    assert renewed["token"] == before["token"] and renewed["validFor"] > 1.0
    # A step-down reaches a standby's waiting poll at once.
    _, waiting_from, _ = get_json(standby, "/leader")
    answers: list[tuple[dict[str, Any], float]] = []
    poll = threading.Thread(target=lambda: answers.append(
        get_json(standby, f"/leader?after={waiting_from['version']}&wait=30")[1:]))
    poll.start()
    time.sleep(0.3)
    stepped_at = time.monotonic()
    assert leader.control("POST", "/step-down")[0] == 202
    poll.join(10)
    (changed, _), = answers
    assert time.monotonic() - stepped_at < 3.0
    assert changed["version"] != waiting_from["version"]


def test_a_version_of_another_incarnation_answers_at_once(pair: list[SidecarProcess]) -> None:
    status, doc, took = get_json(pair[0], "/leader?after=0123456789abcdef.3&wait=30")
    assert status == 200 and doc["version"] != "0123456789abcdef.3" and took < 1.0


@pytest.mark.parametrize(("query", "message"), [
    ("wait=5", "query parameter wait needs after=<version>"),
    ("after=0123456789abcdef.1", "query parameter after needs wait=<seconds>"),
    ("after=0123456789abcdef.1&wait=soon", "query parameter wait must be a number of seconds above 0, at most 60, "
                                           "got 'soon'"),
    ("after=0123456789abcdef.1&wait=0", "got '0'"),
    ("after=0123456789abcdef.1&wait=61", "got '61'"),
    ("after=0123456789abcdef.1&wait=nan", "got 'nan'"),
    ("after=7&wait=5", "query parameter after must be the version of an earlier /leader answer, got '7'"),
])
def test_the_long_poll_refuses_bad_parameters_by_name(pair: list[SidecarProcess], query: str, message: str) -> None:
    for port in (pair[0].port, pair[0].control_port):  # both ports serve /leader
        status, text = pair[0].probe("GET", f"/leader?{query}") if port == pair[0].port else \
            pair[0].control("GET", f"/leader?{query}")
        assert status == 400, text
        assert message in json.loads(text)["error"]


# --- leadership(): cancelled on loss, released only after --------------------------------

async def body_until_cancelled(standby: SidecarProcess, marks: dict[str, float], step: float) -> None:
    """Acts until cancelled; then goes on for ``step`` seconds (finishing its step), checking
    all the while that no other replica leads."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        marks["cancelled"] = time.monotonic()
        assert not await asyncio.to_thread(standby.ready), "another replica led before the body was cancelled"
        until = marks["cancelled"] + step
        while time.monotonic() < until:
            assert not await asyncio.to_thread(standby.ready), "another replica leads while the body still acts"
            await asyncio.sleep(0.05)
        marks["exited"] = time.monotonic()
        raise


@pytest.mark.parametrize("ending", ["step-down", "drain", "sigkill", "sigstop"])
async def test_the_body_is_cancelled_when_the_term_ends_and_the_sidecar_waits_for_it(
        pair: list[SidecarProcess], ending: str) -> None:
    leader = await asyncio.to_thread(one_leader, pair)
    standby = next(s for s in pair if s is not leader)
    marks: dict[str, float] = {}
    # A stalled sidecar waits for nobody: the term's deadline is all that stops the body, and
    # the next leader may take over once the lease has expired (2 s here), fenced writes only.
    step = 0.0 if ending == "sigstop" else STEP_SECONDS
    async with client_of(leader) as client:
        entered = asyncio.Event()

        async def app() -> Term:
            async with client.leadership() as term:
                entered.set()
                await body_until_cancelled(standby, marks, step)
            return term

        task = asyncio.create_task(app())
        await asyncio.wait_for(entered.wait(), 5)
        ended_at = time.monotonic()
        if ending == "step-down":
            assert (await asyncio.to_thread(leader.control, "POST", "/step-down"))[0] == 202
        elif ending == "drain":
            leader.signal(signal.SIGTERM)
        elif ending == "sigkill":
            leader.signal(signal.SIGKILL)
        else:
            leader.signal_sidecar_only(signal.SIGSTOP)
        with pytest.raises(LeadershipLost) as lost:
            await asyncio.wait_for(task, 15)
    # Cancelled promptly: at once on a word from the sidecar or a broken connection; a silent
    # sidecar within the last answer's validFor (the renew deadline, 1.5 s here).
    limit = 3.0 if ending == "sigstop" else 2.0  # margins for a loaded 2-core machine
    assert marks["cancelled"] - ended_at < limit, (ending, marks["cancelled"] - ended_at)
    assert marks["exited"] - marks["cancelled"] >= step
    if ending in ("step-down", "drain"):
        # The sidecar waited for the body's /stopped, then released at once.
        await asyncio.to_thread(wait_for, standby.ready, 5, "the standby to lead")
        assert time.monotonic() - marks["exited"] < 3.0
        assert "is ending (draining: " in lost.value.reason, lost.value.reason  # word from the sidecar
    if ending == "sigstop":
        leader.signal_sidecar_only(signal.SIGCONT)


async def test_a_healthy_term_is_not_cut_short_when_renewals_come_at_half_the_deadline(
        pg_dsn: str, tmp_path: Path) -> None:
    """Renewals every 0.5 s, renew deadline 1 s: each long-poll answer arrives just as the
    previous one's validFor would run out if it were counted from the request's start; it is
    counted from the moment the sidecar answered (the request's start plus ``waited``)."""
    timings = {"SINGLETON_LEASE_DURATION": "2", "SINGLETON_RENEW_DEADLINE": "1", "SINGLETON_RETRY_PERIOD": "0.5"}
    sidecar = SidecarProcess("tight", {"SINGLETON_GROUP": "sdk-" + uuid.uuid4().hex[:8],
                                       "SINGLETON_POSTGRES_DSN": pg_dsn, **timings}, tmp_path / "tight.log").start()
    try:
        await asyncio.to_thread(one_leader, [sidecar])
        async with client_of(sidecar) as client:
            async with client.leadership() as term:
                await asyncio.sleep(5)
            assert (await client.status()).token == term.token
    finally:
        sidecar.stop()


async def test_a_body_that_finishes_first_exits_normally_and_the_sidecar_is_told(
        pair: list[SidecarProcess]) -> None:
    leader = await asyncio.to_thread(one_leader, pair)
    async with client_of(leader) as client:
        async with client.leadership() as term:
            await asyncio.sleep(0.1)
        # /stopped was posted: a second /stopped for the term is refused? No: it is accepted
        # (the registration stands) while /acting for a stale token is refused.
        assert term.token == (await client.status()).token
    # Told it stopped, the sidecar steps down without waiting for anyone.
    started = time.monotonic()
    assert (await asyncio.to_thread(leader.control, "POST", "/step-down"))[0] == 202
    standby = next(s for s in pair if s is not leader)
    await asyncio.to_thread(wait_for, standby.ready, 5, "the standby to lead")
    assert time.monotonic() - started < 2.0


async def test_uninterrupted_finishes_the_step_in_hand_before_the_body_exits(pair: list[SidecarProcess]) -> None:
    leader = await asyncio.to_thread(one_leader, pair)
    steps: list[str] = []

    async def step() -> None:
        steps.append("began")
        await asyncio.sleep(STEP_SECONDS)
        steps.append("finished")

    async with client_of(leader) as client:
        with pytest.raises(LeadershipLost):
            async with client.leadership():
                stepping = asyncio.ensure_future(uninterrupted(step()))
                await asyncio.sleep(0.1)
                # Asked from another task: the term's end may be seen before the answer to the
                # step-down is, and it must find the block awaiting the step, not the request.
                stepping_down = asyncio.ensure_future(asyncio.to_thread(leader.control, "POST", "/step-down"))
                await stepping
    assert (await stepping_down)[0] == 202
    assert steps == ["began", "finished"]


async def test_run_while_leading_runs_once_per_term_and_waits_between(pair: list[SidecarProcess]) -> None:
    leader = await asyncio.to_thread(one_leader, pair)
    standby = next(s for s in pair if s is not leader)
    tokens: list[int] = []
    cancelled: list[int] = []

    async def act(term: Term) -> None:
        tokens.append(term.token)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(term.token)
            raise

    async with client_of(leader) as client:
        runner = asyncio.create_task(client.run_while_leading(act))
        try:
            await asyncio.to_thread(wait_for, lambda: len(tokens) == 1, 5, "the first term's act")
            assert (await asyncio.to_thread(leader.control, "POST", "/step-down"))[0] == 202
            await asyncio.to_thread(wait_for, standby.ready, 5, "the standby to lead")
            assert cancelled == tokens
            # The other replica hands back: this one leads again, with a greater token.
            assert (await asyncio.to_thread(standby.control, "POST", "/step-down"))[0] == 202
            try:
                await asyncio.to_thread(wait_for, lambda: len(tokens) == 2, 10, "the next term's act")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; tokens {tokens}\n--- {leader.name} ---\n{leader.log()[-4000:]}"
                                     f"\n--- {standby.name} ---\n{standby.log()[-4000:]}") from None
            assert tokens[1] > tokens[0]
        finally:
            runner.cancel()
            with pytest.raises(asyncio.CancelledError):
                await runner
    assert cancelled == tokens


async def test_the_sample_poller_hands_over_without_overlaps_or_items_lost(pair: list[SidecarProcess], pg_dsn: str,
                                                                        tmp_path: Path) -> None:
    """``singleton-sample-poller`` (an app of the SDK) beside each sidecar: step-downs and a
    drain of the leading sidecar hand the work over; the ledger shows one term after the
    other, none overlapping, and every item begun was finished before its term ended."""
    pollers = [_start_sample_poller(sidecar, pg_dsn, tmp_path) for sidecar in pair]
    group = pair[0].env["SINGLETON_GROUP"]
    try:
        for ending in ("step-down", "step-down", "drain"):
            leader = await asyncio.to_thread(one_leader, pair)
            doc = leader.leader_doc()
            assert doc is not None
            await wait_last_row(pg_dsn, group, doc["token"], timeout=15)  # its poller works
            await asyncio.sleep(0.5)
            if ending == "drain":
                leader.signal(signal.SIGTERM)
            else:
                assert (await asyncio.to_thread(leader.control, "POST", "/step-down"))[0] == 202
            await asyncio.to_thread(one_leader, [s for s in pair if s is not leader])
        await asyncio.sleep(1.0)
    finally:
        for poller in pollers:
            poller.send_signal(signal.SIGTERM)
        for poller in pollers:
            await asyncio.to_thread(poller.wait, 15)
    logs = "\n".join((tmp_path / f"poller-{s.name}.log").read_text() for s in pair)
    assert all(poller.returncode == 0 for poller in pollers), logs
    report = await check_ledger(pg_dsn, group)
    assert len(report.terms) == 4, f"{report.summary()}\n{logs}"
    assert not report.overlaps and not report.regressions and not report.stale_accepted, report.summary()
    # Every term but the last ended with its item in hand finished (``uninterrupted``).
    assert not report.lost_at_handover, report.summary()
    assert "fenced out" not in logs


def _start_sample_poller(sidecar: SidecarProcess, dsn: str, folder: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "LEDGER_DSN": dsn, ENV_LEADER_URL: sidecar.url + "/leader",
           ENV_CONTROL_URL: f"http://127.0.0.1:{sidecar.control_port}"}
    with open(folder / f"poller-{sidecar.name}.log", "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "singleton_sidecar.sample_poller"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


async def test_an_unreachable_sidecar_means_not_leading() -> None:
    async with LeaderClient("http://127.0.0.1:9/leader", timeout=0.2) as client:
        assert await client.current_term() is None


async def test_a_control_url_that_is_not_the_sidecar_is_refused_by_name(pair: list[SidecarProcess]) -> None:
    leader = await asyncio.to_thread(one_leader, pair)
    async with LeaderClient(leader.url + "/leader", control_url="http://127.0.0.1:9") as client:
        with pytest.raises(SidecarError, match=r"POST http://127.0.0.1:9/acting failed .*SINGLETON_CONTROL_URL"):
            async with client.leadership():
                pass


# --- the threaded twin ----------------------------------------------------------------------

def test_the_sync_twin_stops_the_body_before_the_sidecar_releases(pair: list[SidecarProcess]) -> None:
    leader = one_leader(pair)
    standby = next(s for s in pair if s is not leader)
    marks: dict[str, float] = {}
    with sync_client_of(leader) as client, pytest.raises(LeadershipLost), client.leadership() as term:
        assert term.token == client.status().token and not term.lost.is_set()
        assert leader.control("POST", "/step-down")[0] == 202
        try:
            while True:
                term.sleep(0.05)
        except LeadershipLost:
            marks["lost"] = time.monotonic()
            while time.monotonic() < marks["lost"] + STEP_SECONDS:
                assert not standby.ready(), "another replica leads while the body still acts"
                time.sleep(0.05)
            marks["exited"] = time.monotonic()
            raise
    wait_for(standby.ready, 5, "the standby to lead")
    assert time.monotonic() - marks["exited"] < 3.0


def test_the_sync_twin_tells_a_body_that_checks_and_runs_once_per_term(pair: list[SidecarProcess]) -> None:
    leader = one_leader(pair)
    standby = next(s for s in pair if s is not leader)
    tokens: list[int] = []
    stop = threading.Event()

    def act(term: sdk_sync.SyncTerm) -> None:
        tokens.append(term.token)
        while not stop.is_set():
            term.sleep(0.05)  # raises LeadershipLost when the term ends

    with sync_client_of(leader) as client:
        runner = threading.Thread(target=lambda: _run_until_stopped(client, act, stop), daemon=True)
        runner.start()
        wait_for(lambda: len(tokens) == 1, 5, "the first term's act")
        assert leader.control("POST", "/step-down")[0] == 202
        wait_for(standby.ready, 5, "the standby to lead")
        # Stopped, not stepped down: two sidecars back from a step-down's pause campaign in no
        # set order (on a loaded machine the standby's may come first and keep the term); the
        # next term must be the one of the sidecar the SDK asks.
        standby.stop()
        wait_for(lambda: len(tokens) == 2, 10, "the next term's act")
        assert tokens[1] > tokens[0]
        stop.set()
        runner.join(60)
        assert not runner.is_alive()


class _Stopped(Exception):
    pass


def _run_until_stopped(client: sdk_sync.LeaderClient, act: Any, stop: threading.Event) -> None:
    def checked(term: sdk_sync.SyncTerm) -> None:
        act(term)
        raise _Stopped  # act returns only when the test stops it

    with pytest.raises(_Stopped):
        client.run_while_leading(checked)


# --- the URL convention ---------------------------------------------------------------------

def test_the_sdk_reaches_the_sidecar_the_operator_puts_beside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pod = resources.deployment(read_spec(body(), default_sidecar_image=IMAGE))["spec"]["template"]["spec"]
    main = env_of(pod["containers"][0])
    sidecar = env_of(next(c for c in pod["initContainers"] if c["name"] == "singleton-sidecar"))
    monkeypatch.setenv(ENV_LEADER_URL, main[ENV_LEADER_URL])
    monkeypatch.setenv(ENV_CONTROL_URL, main[ENV_CONTROL_URL])
    client = LeaderClient()
    leader_url, control_url = urllib.parse.urlsplit(client.leader_url), urllib.parse.urlsplit(client.control_url)
    assert leader_url.hostname == "127.0.0.1" and leader_url.path == "/leader"
    assert leader_url.port == int(sidecar["SINGLETON_LISTEN"].rsplit(":", 1)[1])
    assert f"{control_url.hostname}:{control_url.port}" == sidecar["SINGLETON_CONTROL_LISTEN"]
    # Without the operator, the sidecar's own defaults.
    monkeypatch.delenv(ENV_LEADER_URL)
    monkeypatch.delenv(ENV_CONTROL_URL)
    assert urllib.parse.urlsplit(DEFAULT_LEADER_URL).port == SidecarConfig.listen.port
    assert f"http://{SidecarConfig.control_listen}" == DEFAULT_CONTROL_URL
    assert LeaderClient().leader_url == DEFAULT_LEADER_URL
    with pytest.raises(ValueError, match="wait must be above 0 and at most 60 seconds"):
        LeaderClient(wait=90)


def test_the_sdk_distribution_needs_aiohttp_alone() -> None:
    """Its own distribution: aiohttp is its one dependency, the drivers are extras, and
    importing it (the twin included) loads nothing of the operator, the sidecar or a driver."""
    project = tomllib.loads((REPO_ROOT / "sdk" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "kube-singleton-sdk"
    assert [re.split(r"[<>=]", d)[0] for d in project["dependencies"]] == ["aiohttp"]
    assert set(project["optional-dependencies"]) == {"asyncpg", "psycopg", "sqlalchemy"}
    check = ("import sys, singleton_sdk, singleton_sdk.sync; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'kopf', 'kubernetes', 'singleton_sidecar', "
             "'singleton_operator', 'asyncpg', 'psycopg', 'sqlalchemy'}))")
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded


# --- fencing ------------------------------------------------------------------------------

async def test_asyncpg_fenced_writes_refuse_a_stale_term_and_claims_are_idempotent(pg_dsn: str) -> None:
    group = "sdk-" + uuid.uuid4().hex[:8]
    table = "work_items"
    conn = await asyncpg.connect(pg_dsn)
    try:
        await sdk_asyncpg.ensure_fence_table(conn)
        await conn.execute(WORK_DDL)
        await conn.execute(f"TRUNCATE {table}")
        await conn.executemany(f"INSERT INTO {table} (payload) VALUES ($1)", [(f"item-{i}",) for i in range(5)])
        old, new = Term(group, "old", 10), Term(group, "new", 11)
        first = await sdk_asyncpg.claim_work(conn, old, table=table, limit=3)
        assert len(first) == 3
        # The old leader died mid-work: the new term reclaims its unfinished items, and all others.
        second = await sdk_asyncpg.claim_work(conn, new, table=table, limit=10)
        assert {r["id"] for r in second} >= {r["id"] for r in first} and len(second) == 5
        # The ex-leader wakes up: every write of its term is refused, nothing commits.
        with pytest.raises(StaleToken) as stale:
            async with sdk_asyncpg.fenced(conn, old):
                await conn.execute(f"UPDATE {table} SET done_at = now()")
        assert (stale.value.token, stale.value.seen) == (10, 11)
        assert await conn.fetchval(f"SELECT count(*) FROM {table} WHERE done_at IS NOT NULL") == 0
        with pytest.raises(StaleToken):
            await sdk_asyncpg.claim_work(conn, old, table=table)
        async with sdk_asyncpg.fenced(conn, new):
            await conn.execute(f"UPDATE {table} SET done_at = now() WHERE claimed_token = $1", new.token)
        assert await conn.fetchval(f"SELECT count(*) FROM {table} WHERE done_at IS NULL") == 0
        with pytest.raises(ValueError, match="plain identifier"):
            await sdk_asyncpg.claim_work(conn, new, table="work_items; DROP TABLE x")
        with pytest.raises(RuntimeError, match="inside the transaction"):
            await sdk_asyncpg.fence(conn, key=group, token=12)
    finally:
        await conn.close()


RESULTS_DDL = "CREATE TABLE IF NOT EXISTS sdk_results (group_name text, token bigint)"


def test_psycopg_fenced_writes_refuse_a_stale_writer(pg_dsn: str) -> None:
    group = "sdk-" + uuid.uuid4().hex[:8]
    old, new = Term(group, "old", 20, fence_key=f"ns/{group}"), Term(group, "new", 21, fence_key=f"ns/{group}")
    with psycopg.connect(pg_dsn) as conn, psycopg.connect(pg_dsn) as stale_conn:
        sdk_psycopg.ensure_fence_table(conn)
        with conn.transaction():
            conn.execute(RESULTS_DDL)
        with sdk_psycopg.fenced(conn, new):
            conn.execute("INSERT INTO sdk_results VALUES (%s, %s)", (group, new.token))
        with pytest.raises(StaleToken) as stale, sdk_psycopg.fenced(stale_conn, old):
            stale_conn.execute("INSERT INTO sdk_results VALUES (%s, %s)", (group, old.token))
        assert (stale.value.key, stale.value.token, stale.value.seen) == (f"ns/{group}", 20, 21)
        rows = conn.execute("SELECT token FROM sdk_results WHERE group_name = %s", (group,)).fetchall()
        assert rows == [(21,)]
        conn.rollback()
        # A racing stale writer waits for the newer term's commit on the fence row, then is refused.
        newer = Term(group, "newer", 22, fence_key=f"ns/{group}")
        with sdk_psycopg.fenced(conn, newer):
            racing = threading.Thread(target=_stale_write, args=(pg_dsn, new, group), daemon=True)
            outcome: list[BaseException] = []
            racing.run = lambda: outcome.append(_catch(_stale_write, pg_dsn, new, group))  # type: ignore[method-assign]
            racing.start()
            time.sleep(0.3)
            assert racing.is_alive(), "the stale writer did not wait for the fence row"
            conn.execute("INSERT INTO sdk_results VALUES (%s, %s)", (group, newer.token))
        racing.join(5)
        assert len(outcome) == 1 and isinstance(outcome[0], StaleToken), outcome
        autocommit = psycopg.connect(pg_dsn, autocommit=True)
        with autocommit, pytest.raises(RuntimeError, match="inside the transaction"):
            sdk_psycopg.fence(autocommit, key=group, token=30)


def _stale_write(dsn: str, term: Term, group: str) -> None:
    with psycopg.connect(dsn) as conn, sdk_psycopg.fenced(conn, term):
        conn.execute("INSERT INTO sdk_results VALUES (%s, %s)", (group, term.token))


def _catch(function: Any, *args: Any) -> BaseException:
    try:
        function(*args)
    except BaseException as exc:
        return exc
    raise AssertionError("the stale write was accepted")


async def test_psycopg_async_fenced_writes_refuse_a_stale_writer(pg_dsn: str) -> None:
    group = "sdk-" + uuid.uuid4().hex[:8]
    old, new = Term(group, "old", 40), Term(group, "new", 41)
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        await sdk_psycopg.ensure_fence_table_async(conn)
        async with conn.transaction():
            await conn.execute(RESULTS_DDL)
        async with sdk_psycopg.fenced_async(conn, new):
            await conn.execute("INSERT INTO sdk_results VALUES (%s, %s)", (group, new.token))
        with pytest.raises(StaleToken) as stale:
            async with sdk_psycopg.fenced_async(conn, old):
                await conn.execute("INSERT INTO sdk_results VALUES (%s, %s)", (group, old.token))
        assert stale.value.seen == 41
        rows = await (await conn.execute("SELECT token FROM sdk_results WHERE group_name = %s", (group,))).fetchall()
        assert rows == [(41,)]
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as autocommit:
        with pytest.raises(RuntimeError, match="inside the transaction"):
            await sdk_psycopg.fence_async(autocommit, key=group, token=50)


def test_sqlalchemy_fenced_writes_refuse_a_stale_writer(pg_dsn: str) -> None:
    group = "sdk-" + uuid.uuid4().hex[:8]
    engine = sqlalchemy.create_engine(pg_dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    insert = sqlalchemy.text("INSERT INTO sdk_results VALUES (:group, :token)")
    try:
        with engine.begin() as conn:
            sdk_sqlalchemy.ensure_fence_table(conn)
            conn.execute(sqlalchemy.text(RESULTS_DDL))
        old, new, newest = Term(group, "old", 60), Term(group, "new", 61), Term(group, "newest", 62)
        with Session(engine) as session:
            with sdk_sqlalchemy.fenced(session, new):
                session.execute(insert, {"group": group, "token": new.token})
            with pytest.raises(StaleToken) as stale, sdk_sqlalchemy.fenced(session, old):
                session.execute(insert, {"group": group, "token": old.token})
            assert stale.value.seen == 61
        with engine.connect() as conn:
            with sdk_sqlalchemy.fenced(conn, newest):
                conn.execute(insert, {"group": group, "token": newest.token})
            with pytest.raises(StaleToken), sdk_sqlalchemy.fenced(conn, new):
                conn.execute(insert, {"group": group, "token": new.token})
            tokens = conn.execute(sqlalchemy.text("SELECT token FROM sdk_results WHERE group_name = :g ORDER BY 1"),
                                  {"g": group}).scalars().all()
            assert tokens == [61, 62]
            conn.rollback()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn, \
                pytest.raises(RuntimeError, match="inside the transaction"):
            sdk_sqlalchemy.fence(conn, key=group, token=70)
    finally:
        engine.dispose()


async def test_acting_and_stopped_refuse_a_token_that_is_not_the_term(pair: list[SidecarProcess]) -> None:
    leader = await asyncio.to_thread(one_leader, pair)
    doc = leader.leader_doc()
    assert doc is not None
    assert leader.control("POST", f"/acting?token={doc['token'] - 1}")[0] == 409
    assert leader.control("POST", "/acting?token=abc")[0] == 400
    assert leader.control("POST", f"/stopped?token={doc['token']}")[0] == 409  # never registered
    assert leader.control("POST", f"/acting?token={doc['token']}")[0] == 200
    assert leader.control("POST", f"/stopped?token={doc['token']}")[0] == 200
