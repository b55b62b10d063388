"""singleton_sidecar.httpserver (the sidecar's h11 server) on a real socket, spoken to with raw
bytes: routing, keep-alive, the limits on what a client sends, timeouts, errors, and shutdown.
The sidecar's endpoints on top of it are tested through real sidecar processes
(tests/integration/postgres/test_sidecar_postgres.py, tests/integration/postgres/test_sdk.py and others)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from singleton_sidecar.httpserver import (
    Handler,
    HttpServer,
    Request,
    Response,
    json_response,
    text_response,
)

pytestmark = pytest.mark.timeout(30)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()


class Client:
    """One connection, raw bytes out, answers parsed by hand (an independent reading of HTTP/1.1)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, *, head: bool = False) -> Answer:
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")[:-2]
        version, status, _ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1"
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = 0 if head else int(headers["content-length"])
        return Answer(int(status), headers, await self.reader.readexactly(length))

    async def get(self, target: str, method: str = "GET", extra: str = "") -> Answer:
        await self.send(f"{method} {target} HTTP/1.1\r\nHost: test\r\n{extra}\r\n".encode())
        return await self.answer(head=method == "HEAD")

    async def closed(self, timeout: float = 5.0) -> bool:
        """True once the server closed the connection (EOF with nothing more sent)."""
        async with asyncio.timeout(timeout):
            return await self.reader.read() == b""

    def close(self) -> None:
        self.writer.close()


async def hello(_request: Request) -> Response:
    return text_response("hello\n")


async def echo(request: Request) -> Response:
    return json_response({"method": request.method, "path": request.path, "query": dict(request.query),
                          "x": request.headers.get("x-test")}, status=201)


async def fail(_request: Request) -> Response:
    raise RuntimeError("boom")


ROUTES: Mapping[tuple[str, str], Handler] = {
    ("GET", "/hello"): hello, ("GET", "/echo"): echo, ("POST", "/echo"): echo, ("GET", "/fail"): fail,
}


@asynccontextmanager
async def serving(routes: Mapping[tuple[str, str], Handler] = ROUTES,
                  **options: float | list[Callable[[], None]]) -> AsyncIterator[HttpServer]:
    server = HttpServer(routes, **options)  # type: ignore[arg-type]
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close()


@asynccontextmanager
async def connect(server: HttpServer) -> AsyncIterator[Client]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
    client = Client(reader, writer)
    try:
        yield client
    finally:
        client.close()


@dataclass
class Blocking:
    """A handler that never answers: ``entered`` once called, ``cancelled`` once cancelled."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, _request: Request) -> Response:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.set()
        raise AssertionError("unreachable")


def other_tasks() -> set[asyncio.Task[object]]:
    return {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}


async def test_a_route_answers_with_its_status_type_and_body() -> None:
    async with serving() as server, connect(server) as client:
        answer = await client.get("/hello")
        assert (answer.status, answer.text) == (200, "hello\n")
        assert answer.headers["content-type"] == "text/plain; charset=utf-8"
        assert answer.headers["content-length"] == "6"
        answer = await client.get("/echo?a=1&a=2&b=&c=%2Fx", extra="X-Test: yes\r\n")
        assert answer.status == 201
        assert answer.headers["content-type"] == "application/json; charset=utf-8"
        # json.dumps' default separators, as aiohttp's answers had: scripts grep '"isLeader": true'.
        assert answer.text == ('{"method": "GET", "path": "/echo", "query": {"a": "1", "b": "", "c": "/x"}, '
                               '"x": "yes"}')


async def test_an_unknown_path_is_404_naming_it() -> None:
    async with serving() as server, connect(server) as client:
        answer = await client.get("/nope?x=1")
        assert (answer.status, answer.text) == (404, "not found: /nope\n")
        assert (await client.get("/hello")).status == 200  # still serving this connection


async def test_a_known_path_with_another_method_is_405_with_allow() -> None:
    async with serving() as server, connect(server) as client:
        answer = await client.get("/hello", method="POST", extra="Content-Length: 0\r\n")
        assert (answer.status, answer.text) == (405, "method POST not allowed for /hello\n")
        assert answer.headers["allow"] == "GET, HEAD"
        answer = await client.get("/echo", method="DELETE")
        assert (answer.status, answer.headers["allow"]) == (405, "GET, HEAD, POST")


async def test_head_answers_a_get_route_without_the_body() -> None:
    async with serving() as server, connect(server) as client:
        answer = await client.get("/hello", method="HEAD")
        assert (answer.status, answer.headers["content-length"], answer.body) == (200, "6", b"")
        # Nothing of the body was sent: the next answer on the connection parses from its start.
        assert (await client.get("/hello")).text == "hello\n"


async def test_keep_alive_serves_several_requests_on_one_connection_until_close_is_asked() -> None:
    async with serving() as server, connect(server) as client:
        await client.send(b"GET /hello HTTP/1.1\r\nHost: t\r\n\r\nGET /echo?n=2 HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await client.answer()).text == "hello\n"  # pipelined: both answered, in order
        assert json.loads((await client.answer()).body)["query"] == {"n": "2"}
        assert (await client.get("/hello")).text == "hello\n"
        last = await client.get("/hello", extra="Connection: close\r\n")
        assert (last.status, last.text, last.headers["connection"]) == (200, "hello\n", "close")
        assert await client.closed()
        assert server.connections == 0


async def test_a_malformed_request_line_is_400_and_closes() -> None:
    async with serving() as server, connect(server) as client:
        await client.send(b"NOT HTTP AT ALL\r\n\r\n")
        answer = await client.answer()
        assert answer.status == 400
        assert answer.text.startswith("bad request: illegal request line")
        assert answer.headers["connection"] == "close"
        assert await client.closed()


async def test_headers_over_the_limit_are_431_and_close() -> None:
    async with serving(max_header_size=1024) as server, connect(server) as client:
        await client.send(b"GET /hello HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n")
        answer = await client.answer()
        assert (answer.status, answer.text) == (431, "request head larger than 1024 bytes\n")
        assert await client.closed()
        async with connect(server) as trickling:  # a head still arriving is cut off at the limit too
            await trickling.send(b"GET /hello HTTP/1.1\r\nHost: t\r\n")
            for _ in range(5):
                await trickling.send(b"X-Part: " + b"a" * 300 + b"\r\n")
                await asyncio.sleep(0.01)
            answer = await trickling.answer()
            assert (answer.status, answer.text) == (431, "request head larger than 1024 bytes\n")
            assert await trickling.closed()
        async with connect(server) as fresh:  # headers under the limit are fine
            assert (await fresh.get("/hello", extra=f"X-Big: {'a' * 512}\r\n")).status == 200


async def test_a_small_body_is_discarded_and_the_connection_reused() -> None:
    async with serving() as server, connect(server) as client:
        await client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")
        assert json.loads((await client.answer()).body)["method"] == "POST"
        await client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        assert (await client.answer()).status == 201
        assert (await client.get("/hello")).text == "hello\n"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_over_the_limit_is_413_and_closes(framing: str) -> None:
    body = b"x" * 3000
    if framing == "chunked":
        head, body = b"Transfer-Encoding: chunked\r\n", b"".join(b"3e8\r\n" + b"x" * 1000 + b"\r\n" for _ in range(3))
    else:
        head = b"Content-Length: 3000\r\n"
    async with serving(max_body_size=2000) as server, connect(server) as client:
        await client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\n" + head + b"\r\n" + body)
        answer = await client.answer()
        assert (answer.status, answer.text) == (413, "request body larger than 2000 bytes\n")
        assert answer.headers["connection"] == "close"
        assert await client.closed()


async def test_a_slow_request_is_answered_408_and_closed_after_the_timeout() -> None:
    async with serving(request_timeout=0.3) as server, connect(server) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await client.send(b"GET /hello HTTP/1.1\r\nHost: t\r\n")  # never finishes its headers
        answer = await client.answer()
        assert (answer.status, answer.text) == (408, "request not received within 0.3s\n")
        assert await client.closed()
        assert 0.25 < loop.time() - started < 2.0


async def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() -> None:
    async with serving(idle_timeout=0.3, request_timeout=5.0) as server, connect(server) as client:
        assert (await client.get("/hello")).status == 200
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await client.closed()  # closed without a word
        assert 0.25 < loop.time() - started < 2.0
        assert server.connections == 0


async def test_a_handler_error_is_500_logged_and_the_server_keeps_serving(caplog: pytest.LogCaptureFixture) -> None:
    async with serving() as server, connect(server) as client:
        with caplog.at_level(logging.ERROR, logger="singleton_sidecar.httpserver"):
            answer = await client.get("/fail")
        assert (answer.status, answer.text) == (500, "internal server error\n")
        [record] = caplog.records
        assert (record.getMessage(), record.method, record.path) == ("HTTP handler failed", "GET", "/fail")  # type: ignore[attr-defined]
        assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
        assert (await client.get("/hello")).text == "hello\n"  # same connection


async def test_a_client_leaving_mid_request_or_mid_answer_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()
    entered = asyncio.Event()

    async def slow(_request: Request) -> Response:
        entered.set()
        await release.wait()
        return text_response("late\n")

    with caplog.at_level(logging.DEBUG):
        async with serving({("GET", "/slow"): slow, ("GET", "/hello"): hello}) as server:
            async with connect(server) as client:
                await client.send(b"GET /hel")
                await asyncio.sleep(0.05)
            async with connect(server) as client:
                await client.send(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
                await entered.wait()
            await asyncio.sleep(0.05)
            release.set()  # the answer goes to a closed connection
            await asyncio.sleep(0.1)
            assert server.connections == 0
            async with connect(server) as client:
                assert (await client.get("/hello")).status == 200
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("singleton", "asyncio"))] == []


async def wait_for_connections(server: HttpServer, count: int) -> None:
    async with asyncio.timeout(5):
        while server.connections != count:  # noqa: ASYNC110 (the server has no event for it)
            await asyncio.sleep(0.01)


async def test_a_connection_over_the_limit_closes_the_least_recently_active_one(
        caplog: pytest.LogCaptureFixture) -> None:
    # Not refused: a client holding every connection would keep out the kubelet's probes.
    async with serving(max_connections=2) as server, connect(server) as first, connect(server) as second:
        assert (await first.get("/hello")).status == 200
        assert (await second.get("/hello")).status == 200
        async with connect(server) as third:
            assert await first.closed()  # idle longest: closed without a word, as an idle timeout does
            assert (await third.get("/hello")).status == 200
            assert (await second.get("/hello")).status == 200  # now more recently active than third
            async with connect(server) as fourth:
                assert await third.closed()
                assert (await fourth.get("/hello")).status == 200
                assert (await second.get("/hello")).status == 200
                assert server.connections == 2
        warnings = [r for r in caplog.records
                    if r.getMessage() == "too many connections: each new one closes the least recently active"]
        assert len(warnings) == 1  # at most once a minute, not per connection
        assert warnings[0].closed == 1  # type: ignore[attr-defined]


async def test_a_long_poll_is_closed_to_make_room_once_least_recently_active() -> None:
    long_poll = Blocking()
    entered, cancelled = long_poll.entered, long_poll.cancelled

    server = HttpServer({("GET", "/poll"): long_poll, ("GET", "/hello"): hello}, max_connections=1)
    await server.start("127.0.0.1", 0)
    async with connect(server) as polling:
        await polling.send(b"GET /poll HTTP/1.1\r\nHost: t\r\n\r\n")
        await entered.wait()
        async with connect(server) as probe:
            assert (await probe.get("/hello")).status == 200
            assert cancelled.is_set()
            assert await polling.closed()
        await server.close()
    assert server.connections == 0
    assert other_tasks() == set()


async def test_a_flood_keeps_the_newest_connections_up_to_the_limit() -> None:
    async with serving(max_connections=4) as server, contextlib.AsyncExitStack() as stack:
        flood = [await stack.enter_async_context(connect(server)) for _ in range(10)]
        for old in flood[:6]:
            assert await old.closed()
        await wait_for_connections(server, 4)
        for new in flood[6:]:  # silent so far, and still served
            assert (await new.get("/hello")).status == 200


def test_max_connections_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_connections must be at least 1, not 0"):
        HttpServer(ROUTES, max_connections=0)


async def test_close_answers_long_polls_through_on_shutdown_and_leaves_nothing_open() -> None:
    changed = asyncio.Event()
    waiting = asyncio.Event()

    async def long_poll(_request: Request) -> Response:
        waiting.set()
        await changed.wait()
        return text_response("answered\n")

    server = HttpServer({("GET", "/poll"): long_poll, ("GET", "/hello"): hello}, on_shutdown=[changed.set])
    await server.start("127.0.0.1", 0)
    port = server.ports[0]
    async with connect(server) as idle, connect(server) as polling:
        assert (await idle.get("/hello")).status == 200  # now an idle keep-alive connection
        await polling.send(b"GET /poll HTTP/1.1\r\nHost: t\r\n\r\n")
        await waiting.wait()
        await server.close()
        answer = await polling.answer()
        assert (answer.status, answer.text, answer.headers["connection"]) == (200, "answered\n", "close")
        assert await polling.closed(timeout=0.1)
        assert await idle.closed(timeout=0.1)
    assert server.connections == 0
    assert other_tasks() == set()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_close_gives_up_on_a_handler_after_the_shutdown_timeout() -> None:
    stuck = Blocking()
    entered, cancelled = stuck.entered, stuck.cancelled

    server = HttpServer({("GET", "/stuck"): stuck}, shutdown_timeout=0.2)
    await server.start("127.0.0.1", 0)
    async with connect(server) as client:
        await client.send(b"GET /stuck HTTP/1.1\r\nHost: t\r\n\r\n")
        await entered.wait()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await server.close()
        assert loop.time() - started < 1.5
        assert cancelled.is_set()
        assert await client.closed(timeout=0.1)
    assert server.connections == 0
    assert other_tasks() == set()


def test_the_server_module_imports_only_the_standard_library_and_h11() -> None:
    import subprocess
    import sys

    code = ("import sys; before = set(sys.modules); import singleton_sidecar.httpserver; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    ours = {"singleton_sidecar", "singleton_election"}
    third_party = {name.split(".")[0] for name in loaded} - set(sys.stdlib_module_names) - ours
    assert third_party == {"h11"}

