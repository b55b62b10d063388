"""A small asyncio HTTP/1.1 server on h11: the transport of the sidecar's probe and control
endpoints (``singleton_sidecar.http``).

Ours rather than aiohttp's because of the sidecar's budget (30 MB at rest, campaigning within
0.5 s of its start): aiohttp.web and its helpers cost 12 MB and about 0.4 s of imports, h11
0.2 MB. h11 does the protocol (parsing, framing, keep-alive rules); this module only does the
I/O: it accepts connections, reads one request at a time, routes it by method and path to a
handler, writes the answer, and bounds everything a client can make it hold (open
connections, header and body sizes, a slow request, an idle keep-alive connection, the wait for
answers at shutdown).

A full server makes room rather than refusing: a new connection closes the least recently
active one (as nginx reuses idle connections). The probe port listens on the pod IP, so any pod
can open connections to it; were newcomers refused, a pod holding them all would fail the
kubelet's probes (a new connection each) and get the sidecar restarted.

Routes take no request bodies: a body is read and discarded up to ``max_body_size``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote

import h11

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024
LINGER_TIME = 1.0
"""Seconds to read and discard what a client still sends after an error answer that closes the
connection, so that closing with unread data (a TCP reset) does not destroy the answer."""


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    """Percent-decoded, without the query."""
    query: Mapping[str, str] = field(default_factory=dict)
    """The first value of each parameter (``?a=1&a=2`` → ``{"a": "1"}``), blanks kept."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Lower-case names; repeated headers joined with ``", "``."""


@dataclass(frozen=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: Sequence[tuple[str, str]] = ()
    """Further headers; Content-Type, Content-Length and Connection are the server's."""


def text_response(text: str, status: int = 200) -> Response:
    return Response(status, text.encode())


def json_response(doc: object, status: int = 200) -> Response:
    # json.dumps' own separators (", ", ": "), as the sidecar answered on aiohttp: scripts grep them.
    return Response(status, json.dumps(doc).encode(), "application/json; charset=utf-8")


Handler = Callable[[Request], Awaitable[Response]]
Routes = Mapping[tuple[str, str], Handler]
"""Handlers by ``(method, path)``: ``{("GET", "/livez"): livez}``. A GET route answers HEAD too."""


class _Close(Exception):
    """End the connection, after sending ``answer`` if there is one."""

    def __init__(self, answer: Response | None = None) -> None:
        super().__init__()
        self.answer = answer


@dataclass
class _Arrival:
    """A request's progress: whether its first byte came, and until when the rest may take."""

    started: bool
    deadline: float


@dataclass
class _Connection:
    writer: asyncio.StreamWriter
    since: float
    """Loop time of its last activity: accepted, a whole request received, an answer sent
    (bytes of a request trickling in do not count)."""
    busy: bool = False
    """Between a whole request and the end of its answer: close() waits for these."""


class HttpServer:
    """Serves ``routes`` on one address from ``start`` until ``close``."""

    def __init__(self, routes: Routes, *, on_shutdown: Iterable[Callable[[], None]] = (),
                 idle_timeout: float = 75.0, request_timeout: float = 10.0, shutdown_timeout: float = 5.0,
                 max_header_size: int = 16 * 1024, max_body_size: int = 64 * 1024,
                 max_connections: int = 256) -> None:
        """``max_connections``: connections served at once; one more closes the least recently
        active one;
        ``idle_timeout``: how long a keep-alive connection may wait for its next request;
        ``request_timeout``: how long a new connection may wait before it sends its first
        request, and a client may take to send a request once it started (and to take an
        answer); ``shutdown_timeout``: how long ``close`` waits for requests being
        answered; ``on_shutdown``: called by ``close`` before that wait (to answer long polls)."""
        self._routes = dict(routes)
        self._on_shutdown = list(on_shutdown)
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        self.shutdown_timeout = shutdown_timeout
        self.max_header_size = max_header_size
        self.max_body_size = max_body_size
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        self.max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        self._evicted: set[asyncio.Task[None]] = set()  # closed to make room, still ending
        self._evictions = 0  # since the last warning, which a flood gets once a minute
        self._warned_at = -math.inf
        self._closing = False

    def __repr__(self) -> str:
        return f"<HttpServer ports={self.ports} connections={len(self._connections)}>"

    @property
    def ports(self) -> list[int]:
        """The ports listened on (one per address family), for a server started on port 0."""
        if self._server is None:
            return []
        return sorted({sock.getsockname()[1] for sock in self._server.sockets})

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._accept, host, port)

    async def close(self) -> None:
        """Stop listening, call the shutdown callbacks, wait (``shutdown_timeout`` at most) for
        the answers being written, and close every connection."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for callback in self._on_shutdown:
            callback()
        for task, connection in list(self._connections.items()):
            if not connection.busy:  # waiting for a request: nothing to finish
                task.cancel()
        tasks = [*self._connections, *self._evicted]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.shutdown_timeout)
            if late:
                log.warning("closing connections whose answers were not ready",
                            extra={"connections": len(late), "timeout": self.shutdown_timeout})
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):  # Python 3.12+ waits for every connection here
                async with asyncio.timeout(self.shutdown_timeout):
                    await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A task of our own, not asyncio's per connection: close() may cancel it (Python 3.11's
        # streams log the cancellation of theirs as an error).
        if self._closing:  # accepted just before the listener closed
            writer.transport.abort()
            return
        if len(self._connections) >= self.max_connections:
            self._evict()
        connection = _Connection(writer, asyncio.get_running_loop().time())
        task = asyncio.create_task(self._serve(reader, connection), name="http-connection")
        self._connections[task] = connection
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._connections.pop(task, None)  # not there once evicted

    def _evict(self) -> None:
        """Close the least recently active connection to make room for a new one: idle, silent,
        trickling its head, in a long poll or not reading its answer alike (idle ones first would
        let 255 long polls leave a probe one slot to fight over). A new connection goes last: to
        keep out a probe, answered within a few turns of the loop, a flood would need
        ``max_connections`` new connections in those turns. What others lose is an idle or long
        wait, which their clients retry."""
        task, victim = min(self._connections.items(), key=lambda item: item[1].since)
        self._evictions += 1
        now = asyncio.get_running_loop().time()
        if now - self._warned_at >= 60:
            log.warning("too many connections: each new one closes the least recently active",
                        extra={"max_connections": self.max_connections, "closed": self._evictions})
            self._evictions, self._warned_at = 0, now
        del self._connections[task]
        self._evicted.add(task)
        task.add_done_callback(self._evicted.discard)
        victim.writer.transport.abort()  # also if its task never ran: the socket is closed here
        task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        loop = asyncio.get_running_loop()
        writer = connection.writer
        protocol = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_header_size)
        clean = False
        fresh = True
        try:
            while not self._closing:
                try:
                    request = await self._receive(protocol, reader, writer, fresh=fresh)
                except _Close as close:
                    if close.answer is not None:
                        await self._send(protocol, writer, close.answer, close=True)
                        await _linger(reader, writer)
                    clean = True
                    break
                connection.busy, connection.since = True, loop.time()
                answer = await self._answer(request)
                await self._send(protocol, writer, answer, head_only=request.method == "HEAD", close=self._closing)
                connection.busy, connection.since, fresh = False, loop.time(), False
                if protocol.our_state is not h11.DONE or protocol.their_state is not h11.DONE:
                    clean = True  # the client asked to close (Connection: close, HTTP/1.0)
                    break
                protocol.start_next_cycle()
            else:
                clean = True
        except (ConnectionError, TimeoutError):
            pass  # the client went away, or did not take its answer in time
        except Exception:
            log.exception("HTTP connection failed")
        finally:
            if not clean:
                writer.transport.abort()
            writer.close()
            try:
                async with asyncio.timeout(LINGER_TIME):
                    await writer.wait_closed()
            except TimeoutError:
                writer.transport.abort()  # a client that reads nothing: what it did not take is dropped
            except OSError:
                pass

    async def _receive(self, protocol: h11.Connection, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter, *, fresh: bool) -> Request:
        """The next whole request (its body read and discarded), or ``_Close``. A ``fresh``
        connection has ``request_timeout`` to start its first request, not ``idle_timeout``
        (Go's ReadHeaderTimeout): a client connects to send one, and silent ones go soon."""
        started = bool(protocol.trailing_data[0])  # a pipelined request already read
        arrival = _Arrival(started, asyncio.get_running_loop().time()
                           + (self.request_timeout if started or fresh else self.idle_timeout))
        head: h11.Request | None = None
        body_size = 0
        while True:
            event = await self._next_event(protocol, reader, writer, arrival)
            if isinstance(event, h11.Request):
                head = event
                # h11 bounds a head that is still arriving; one that came whole in a read is measured here.
                size = len(event.target) + sum(len(name) + len(value) + 4 for name, value in event.headers)
                if size > self.max_header_size:
                    raise _Close(self._head_too_large())
                length = _header(event.headers, b"content-length")
                if length.isdigit() and int(length) > self.max_body_size:
                    raise _Close(_too_large(self.max_body_size))
            elif isinstance(event, h11.Data):
                body_size += len(event.data)
                if body_size > self.max_body_size:
                    raise _Close(_too_large(self.max_body_size))
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return _request(head)
            else:  # ConnectionClosed
                raise _Close

    async def _next_event(self, protocol: h11.Connection, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter, arrival: _Arrival) -> h11.Event:
        """h11's next event, reading as needed until ``arrival.deadline``."""
        while True:
            try:
                event = protocol.next_event()
            except h11.RemoteProtocolError as exc:
                if reader.at_eof():
                    raise _Close from None  # the client went away mid-request: nobody to answer
                if exc.error_status_hint == 431:  # h11's max_incomplete_event_size
                    raise _Close(self._head_too_large()) from None
                raise _Close(text_response(f"bad request: {exc}\n", exc.error_status_hint)) from None
            if isinstance(event, h11.Event):
                return event
            # NEED_DATA (PAUSED never comes: we read one request at a time)
            if protocol.they_are_waiting_for_100_continue:
                await self._write(writer, protocol.send(h11.InformationalResponse(status_code=100, headers=[])))
            try:
                async with asyncio.timeout_at(arrival.deadline):
                    data = await reader.read(READ_SIZE)
            except TimeoutError:
                if not arrival.started:
                    raise _Close from None  # an idle keep-alive connection
                raise _Close(text_response(f"request not received within {self.request_timeout:g}s\n",
                                           408)) from None
            if data and not arrival.started:
                arrival.started = True
                arrival.deadline = asyncio.get_running_loop().time() + self.request_timeout
            protocol.receive_data(data)  # b"": the client closed its side

    def _head_too_large(self) -> Response:
        return text_response(f"request head larger than {self.max_header_size} bytes\n", 431)

    async def _answer(self, request: Request) -> Response:
        handler = self._routes.get((request.method, request.path))
        if handler is None and request.method == "HEAD":
            handler = self._routes.get(("GET", request.path))
        if handler is None:
            allowed = sorted({method for method, path in self._routes if path == request.path})
            if not allowed:
                return text_response(f"not found: {request.path[:200]}\n", 404)
            if "GET" in allowed:
                allowed = sorted([*allowed, "HEAD"])
            return Response(405, f"method {request.method} not allowed for {request.path}\n".encode(),
                            headers=[("Allow", ", ".join(allowed))])
        try:
            return await handler(request)
        except Exception:
            log.exception("HTTP handler failed", extra={"method": request.method, "path": request.path})
            return text_response("internal server error\n", 500)

    async def _send(self, protocol: h11.Connection, writer: asyncio.StreamWriter, answer: Response, *,
                    head_only: bool = False, close: bool = False) -> None:
        headers = [("Content-Type", answer.content_type), ("Content-Length", str(len(answer.body))),
                   *answer.headers]
        if close:
            headers.append(("Connection", "close"))
        try:
            reason = HTTPStatus(answer.status).phrase.encode()
        except ValueError:
            reason = b""
        data = protocol.send(h11.Response(status_code=answer.status, headers=headers, reason=reason))
        assert data is not None
        if not head_only and answer.body:
            data += protocol.send(h11.Data(data=answer.body)) or b""
        data += protocol.send(h11.EndOfMessage()) or b""
        await self._write(writer, data)

    async def _write(self, writer: asyncio.StreamWriter, data: bytes | None) -> None:
        if data:
            writer.write(data)
            async with asyncio.timeout(self.request_timeout):
                await writer.drain()


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str:
    return next((value.decode("latin-1") for key, value in headers if key == name), "")


def _request(head: h11.Request) -> Request:
    target = head.target.decode("latin-1")
    path, _, query = target.partition("?")
    if not path.startswith("/"):  # absolute form (http://host/path) or "*"
        scheme, _, rest = path.partition("://")
        path = "/" + rest.partition("/")[2] if scheme and rest else path
    params: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        params.setdefault(key, value)
    headers: dict[str, str] = {}
    for raw_name, raw_value in head.headers:
        name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return Request(head.method.decode("latin-1"), unquote(path), params, headers)


def _too_large(limit: int) -> Response:
    return text_response(f"request body larger than {limit} bytes\n", 413)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After an answer that ends the connection: stop sending and drop what the client still
    sends, until it closes or for ``LINGER_TIME`` at most."""
    with contextlib.suppress(OSError, TimeoutError):
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(LINGER_TIME):
            while await reader.read(READ_SIZE):
                pass
