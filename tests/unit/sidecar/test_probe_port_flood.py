"""The probe port under a flood (issue 31, item 6): any pod can open connections to it, since it
listens on the pod IP for the kubelet. Holding them all must not fail ``/livez`` (the kubelet
would restart the sidecar, ending the leader's term for nothing).

The server is the sidecar's own: ``singleton_sidecar.http.probe_server`` (the class, routes and
limits the sidecar serves), over an elector that is not run, on a real socket. The stranger runs
on a thread of its own with its own event loop, as another pod would in its own process, and
keeps what it holds: a connection the server closes is opened again 0.1 s later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from singleton_election.core.elector import Elector
from singleton_election.core.lock import Identity
from singleton_election.core.timings import Timings
from singleton_sidecar.http import probe_server
from singleton_sidecar.httpserver import HttpServer
from singleton_sidecar.metrics import SidecarMetrics
from singleton_testbed.harness.sidecars import PROMETHEUS_ACCEPT
from tests.support.fakes import FakeBackend, FakeClock

pytestmark = pytest.mark.timeout(90)

STRANGERS = 300
"""Connections the stranger holds: more than the server's 256."""
KUBELET_WINDOW = 12.0
"""Longer than the operator's liveness probe takes to restart the sidecar: 3 failures 5 s apart,
10 s from the first."""


@asynccontextmanager
async def sidecar_probe_port() -> AsyncIterator[HttpServer]:
    clock = FakeClock()  # does not move: /livez sees a loop that just made progress
    elector = Elector(group="g", identity=Identity("web-0/0f1e2d3c/cafe0001"), backend=FakeBackend(clock),
                      timings=Timings(), clock=clock, wall_clock=lambda: 1_700_000_000.0 + clock.now)
    server = probe_server(elector, SidecarMetrics("g", "fake"), fence_key="ns/g")
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close()


async def get(port: int, target: str, *, timeout: float = 1.0, headers: str = "") -> tuple[int, bytes]:
    """One request on a new connection, as the kubelet probes (``Connection: close``)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(f"GET {target} HTTP/1.1\r\nHost: pod\r\n{headers}Connection: close\r\n\r\n".encode())
            answer = await reader.read()
        finally:
            writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


class Stranger:
    """Holds ``STRANGERS`` connections to a port from a thread: a third idle (connected, silent),
    a third trickling a request head that never ends (a byte every 0.5 s), a third in long polls
    of ``/leader`` (60 s, the longest). Each one closed by the server is opened again."""

    def __init__(self, port: int, version: str) -> None:
        self.port = port
        self.version = version
        self.connected = threading.Event()  # all of them, once
        self.opened = 0
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),), daemon=True)

    def __enter__(self) -> Stranger:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()
        self._loop.close()

    async def _run(self) -> None:
        tasks = [asyncio.create_task(self._hold(i % 3)) for i in range(STRANGERS)]
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _hold(self, kind: int) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            self.opened += 1
            if self.opened == STRANGERS:
                self.connected.set()
            try:
                if kind == 1:
                    writer.write(b"GET /livez HTTP/1.1\r\nHost: pod\r\nX-Slow: ")
                    trickle = asyncio.create_task(self._trickle(writer))
                elif kind == 2:
                    writer.write(f"GET /leader?after={self.version}&wait=60 HTTP/1.1\r\nHost: pod\r\n\r\n".encode())
                with contextlib.suppress(OSError):
                    await reader.read()  # until the server closes it
            finally:
                if kind == 1:
                    trickle.cancel()
                    await asyncio.gather(trickle, return_exceptions=True)
                writer.transport.abort()
            await asyncio.sleep(0.1)

    @staticmethod
    async def _trickle(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while not writer.is_closing():
                await asyncio.sleep(0.5)
                writer.write(b"a")


def enough_files() -> None:
    """Both ends of the stranger's connections live in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * STRANGERS + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard) if hard != resource.RLIM_INFINITY else need, hard))


@pytest.mark.slow  # the kubelet's window, by design
async def test_livez_answers_on_a_new_connection_while_a_stranger_holds_more_than_the_connection_limit() -> None:
    enough_files()
    async with sidecar_probe_port() as server:
        port = server.ports[0]
        version = json.loads((await get(port, "/leader"))[1])["version"]
        with Stranger(port, version) as stranger:
            assert await asyncio.to_thread(stranger.connected.wait, 10), "the stranger could not connect"
            await asyncio.sleep(0.5)  # the pool is full and the stranger's trickles and polls under way
            loop = asyncio.get_running_loop()
            end = loop.time() + KUBELET_WINDOW
            probes: list[str] = []  # what each probe got, in order
            pool: list[int] = []  # the server's connections before each probe
            slowest = 0.0
            while loop.time() < end:
                started = loop.time()
                pool.append(server.connections)
                try:
                    status, body = await get(port, "/livez", timeout=1.0)
                    probes.append(f"{status} {body.decode(errors='replace').strip()}")
                except TimeoutError:
                    probes.append("no answer within 1 s")
                except OSError as exc:
                    probes.append(f"{type(exc).__name__}: {exc}")
                slowest = max(slowest, loop.time() - started)
                await asyncio.sleep(max(0.0, started + 0.2 - loop.time()))
        assert len(probes) >= 40
        assert [p for p in probes if p != "200 ok"] == [], f"{len(probes)} probes: {probes}"
        assert slowest < 1.0
        # The stranger kept the pool full all along, and it never grew beyond the limit.
        assert min(pool) >= server.max_connections - 10, pool
        assert max(pool) == server.max_connections


async def test_keep_alive_scrapes_are_served_on_one_connection() -> None:
    async with sidecar_probe_port() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
        try:
            for _ in range(5):
                writer.write(f"GET /metrics HTTP/1.1\r\nHost: pod\r\nAccept: {PROMETHEUS_ACCEPT}\r\n\r\n".encode())
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                assert head.startswith("HTTP/1.1 200 ")
                length = next(int(line.split(":")[1]) for line in head.split("\r\n")
                              if line.lower().startswith("content-length:"))
                assert (await reader.readexactly(length)).endswith(b"# EOF\n")
                assert "connection: close" not in head.lower()
            assert server.connections == 1  # the same connection every time
        finally:
            writer.close()


async def test_a_new_connection_that_sends_nothing_is_closed_after_the_request_timeout_not_the_idle_one() -> None:
    server = HttpServer({}, idle_timeout=30.0, request_timeout=0.3)
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed without a word: it asked nothing
        assert 0.25 < loop.time() - started < 2.0
        writer.close()
    finally:
        await server.close()
