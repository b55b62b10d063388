"""A small asyncio HTTP/1.1 client on h11: the transport of ``singleton_election.kube`` and of
the sidecar's drain hook.

Ours rather than aiohttp's because of the sidecar's budget (30 MB at rest, campaigning within
0.5 s of its start): aiohttp and its helpers cost 12 MB and about 0.4 s of imports, h11 0.2 MB.
h11 does the protocol (framing, chunked bodies, keep-alive rules); this module only opens
connections (TCP, TLS, a CONNECT tunnel through an HTTP proxy), keeps idle ones for reuse, and
reads bodies whole or as a stream.

Timeouts are the caller's: ``asyncio.timeout`` around ``request``, or a ``deadline`` (the loop's
clock) for a streamed answer, whose reads happen between the caller's own awaits. A call that is
cancelled or fails closes its connection, so a half-read answer is never read by the next request. Transport and
protocol failures raise ``HttpTransportError`` (an ``OSError``).
"""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

import h11

MAX_BODY = 256 * 1024 * 1024
"""Largest body ``read`` accepts (a list of every pod of a large cluster is tens of MB)."""
READ_SIZE = 256 * 1024
IDLE_TIMEOUT = 15.0
"""Seconds an idle connection is kept for reuse (servers close idle ones after a while; an older
connection risks failing on its next request)."""
MAX_CONNECTIONS = 100
"""Connections open at once per client, idle and busy (a watch holds one while it runs)."""
HAPPY_EYEBALLS: dict[str, Any] = {"happy_eyeballs_delay": 0.25, "interleave": 1}
"""A host name with IPv6 and IPv4 addresses: try the next address family after 0.25 s (RFC 8305),
so a black-holed one does not hold every connection until its caller's timeout."""


TLS_READ_BUFFER = 16 * 1024
"""Bytes asyncio reads from a TLS connection's socket at once (its default: 256 KiB, allocated
zero-filled per connection, so resident: 1 MB of a Lease sidecar's memory for its four
connections to the API server). 16 KiB is about a TLS record (16 KiB of data at most, plus a few
hundred bytes): a record split across reads is put together again, and a large answer is only
read in more, smaller steps. See ``use_small_tls_buffers``."""


def use_small_tls_buffers() -> None:
    """Make every TLS connection of this process opened from now on read through a
    ``TLS_READ_BUFFER``. Process-wide, as asyncio takes no parameter for it (a class attribute of
    its TLS protocol): the sidecar calls it at its start; the operator keeps the default."""
    from asyncio import sslproto

    sslproto.SSLProtocol.max_size = TLS_READ_BUFFER


KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 10, 5, 3
"""TCP keepalive on every connection: a path that went dead without a reset (a peer's machine
lost, a NAT or conntrack entry dropped) fails the connection within 25 s, instead of leaving a
watch that waits for events to wait until its own deadline (minutes) and miss what happens."""
USER_TIMEOUT_MS = 25_000
"""The same for data sent and never acknowledged (TCP_USER_TIMEOUT, Linux; where it is set, it
also decides when unanswered keepalive probes end the connection: 25 s after the last answer)."""


class HttpTransportError(OSError):
    """The connection failed, or the server's answer broke HTTP/1.1."""


@dataclass(frozen=True)
class Origin:
    """Where requests go: scheme, host and port of a base URL, and its path prefix."""

    scheme: str
    host: str
    port: int
    prefix: str = ""
    """The base URL's path without a trailing slash (an API server behind a path-routing proxy)."""
    userinfo: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL with a host: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)  # .port raises ValueError if malformed
        userinfo = None
        if parts.username is not None:
            userinfo = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"), userinfo)

    @property
    def authority(self) -> str:
        """``host:port``, as a CONNECT target writes it."""
        return f"{self._bracketed}:{self.port}"

    @property
    def host_header(self) -> str:
        """The Host header: without the scheme's default port, as browsers, Go and aiohttp send
        it (a gateway routing by host name may know ``api.example.com`` and not ``…:443``)."""
        default = 443 if self.scheme == "https" else 80
        return self._bracketed if self.port == default else self.authority

    @property
    def _bracketed(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host


def split_url(url: str) -> tuple[str, str]:
    """``(base URL, request target)`` of a full URL: ``http://h:1/a?b`` → ``("http://h:1", "/a?b")``."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}", (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def watch_the_path(writer: asyncio.StreamWriter) -> None:
    """Turn on TCP keepalive (and the user timeout where the platform has them) on the
    connection's socket: see ``KEEPALIVE_IDLE``."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class _Connection:
    """One open connection and its h11 state."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, protocol: h11.Connection) -> None:
        self.reader = reader
        self.writer = writer
        self.protocol = protocol
        self.idle_since = time.monotonic()

    def reusable(self) -> bool:
        return (self.protocol.our_state is h11.IDLE and not self.reader.at_eof() and not self.writer.is_closing()
                and time.monotonic() - self.idle_since < IDLE_TIMEOUT)

    async def send(self, event: h11.Event) -> None:
        data = self.protocol.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def next_event(self) -> h11.Event:
        while True:
            try:
                event = self.protocol.next_event()
            except h11.RemoteProtocolError as exc:
                if self.reader.at_eof():
                    raise HttpTransportError("the server closed the connection before its answer was complete") from exc
                raise HttpTransportError(f"malformed answer: {exc}") from exc
            if event is h11.NEED_DATA:
                self.protocol.receive_data(await self.reader.read(READ_SIZE))  # b"": the server closed
                continue
            assert not isinstance(event, type)  # PAUSED never comes: we send nothing while reading
            return event

    def close(self) -> None:
        self.writer.close()


class HttpResponse:
    """An answer whose body is read with ``read`` or ``chunks``, once."""

    def __init__(self, connection: _Connection, head: h11.Response, deadline: float | None) -> None:
        self.status = head.status_code
        self.reason = head.reason.decode("latin-1")
        self.headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in head.headers}
        self._connection = connection
        self._deadline = deadline
        self.complete = False
        """The whole body was read: the connection may serve another request."""

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            async with asyncio.timeout_at(self._deadline):  # around the read only, never a yield
                event = await self._connection.next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self.complete = True
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise HttpTransportError("the server closed the connection before its answer was complete")

    async def read(self, limit: int = MAX_BODY) -> bytes:
        body = bytearray()
        async for chunk in self.chunks():
            body += chunk
            if len(body) > limit:
                raise HttpTransportError(f"answer over {limit} bytes")
        return bytes(body)


class HttpClient:
    """Requests to one origin over reused connections; use ``async with`` or call ``close()``.

    ``proxy`` is an ``http://`` proxy URL (credentials in it become ``Proxy-Authorization``):
    https origins are reached through a CONNECT tunnel, http ones with absolute targets.
    """

    def __init__(self, base_url: str, *, ssl_context: ssl.SSLContext | None = None, proxy: str | None = None,
                 user_agent: str = "singleton") -> None:
        self.origin = Origin.parse(base_url)
        if proxy and urlsplit(proxy).scheme != "http":
            raise ValueError(f"only http:// proxies are supported, got {proxy!r}")
        self.proxy = Origin.parse(proxy) if proxy else None
        if self.origin.scheme == "https" and ssl_context is None:
            ssl_context = ssl.create_default_context()
        self._ssl = ssl_context if self.origin.scheme == "https" else None
        self._user_agent = user_agent
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._closed = False

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection, idle or busy (a running watch then fails); requests after
        this, and those still connecting, fail with ``HttpTransportError``."""
        self._closed = True
        connections = [*self._idle, *self._busy]
        self._idle.clear()
        for connection in connections:
            connection.close()
        if not connections:
            return
        # A TLS peer that is gone never confirms the close: a second at most for all, then abort.
        waits = {asyncio.ensure_future(_closed(c)): c for c in connections}
        _, late = await asyncio.wait(waits, timeout=1)
        for wait in late:
            waits[wait].writer.transport.abort()
        await asyncio.gather(*waits)

    async def request(self, method: str, path: str, *, headers: Mapping[str, str] | None = None,
                      body: bytes | None = None) -> tuple[HttpResponse, bytes]:
        """Send a request and read its whole answer."""
        async with self.open(method, path, headers=headers, body=body) as response:
            return response, await response.read()

    @asynccontextmanager
    async def open(self, method: str, path: str, *, headers: Mapping[str, str] | None = None,
                   body: bytes | None = None, deadline: float | None = None) -> AsyncIterator[HttpResponse]:
        """Send a request and yield its answer once the head has come, the body unread.

        Past ``deadline`` (``loop.time()``), any step of it raises TimeoutError. The connection
        is kept for reuse only when the body was read to its end; otherwise (an error, a
        cancel, a stream left early) it is closed.
        """
        if self._closed:
            raise HttpTransportError("the client is closed")
        async with asyncio.timeout_at(deadline):
            await self._slots.acquire()
        connection: _Connection | None = None
        response: HttpResponse | None = None
        try:
            async with asyncio.timeout_at(deadline):
                connection = await self._connection()
                await self._send_request(connection, method, path, headers or {}, body)
                response = await self._read_head(connection, deadline)
            yield response
        finally:
            if connection is not None:
                self._busy.discard(connection)
                if not self._closed and response is not None and response.complete and self._recycle(connection):
                    self._idle.append(connection)
                else:
                    connection.close()
            self._slots.release()

    @staticmethod
    def _recycle(connection: _Connection) -> bool:
        protocol = connection.protocol
        if protocol.our_state is not h11.DONE or protocol.their_state is not h11.DONE:
            return False
        if protocol.trailing_data[0]:  # bytes past the answer's end: the next answer read would be wrong
            return False
        protocol.start_next_cycle()
        connection.idle_since = time.monotonic()
        return True

    async def _connection(self) -> _Connection:
        # Every idle connection is checked, not only the one taken: one left over from a burst
        # of concurrent requests would otherwise stay open under the ones in use.
        expired = [connection for connection in self._idle if not connection.reusable()]
        for connection in expired:
            self._idle.remove(connection)
            connection.close()
        if self._idle:
            connection = self._idle.pop()  # the most recent: the least likely to be closed by now
            self._busy.add(connection)
            return connection
        connection = await self._connect()
        self._busy.add(connection)
        return connection

    async def _connect(self) -> _Connection:
        origin, proxy = self.origin, self.proxy
        try:
            if proxy is None:
                reader, writer = await asyncio.open_connection(
                    origin.host, origin.port, ssl=self._ssl, server_hostname=origin.host if self._ssl else None,
                    **HAPPY_EYEBALLS)
                watch_the_path(writer)
                return _Connection(reader, writer, h11.Connection(h11.CLIENT))
            reader, writer = await asyncio.open_connection(proxy.host, proxy.port, **HAPPY_EYEBALLS)
            watch_the_path(writer)
            if self._ssl is not None:
                await self._tunnel(_Connection(reader, writer, h11.Connection(h11.CLIENT)))
                await writer.start_tls(self._ssl, server_hostname=origin.host)
            return _Connection(reader, writer, h11.Connection(h11.CLIENT))
        except ssl.SSLError as exc:
            raise HttpTransportError(f"TLS with {origin.authority} failed: {exc}") from exc

    async def _tunnel(self, connection: _Connection) -> None:
        """Ask the proxy for a tunnel to the origin (CONNECT host:port)."""
        target = self.origin.authority
        try:
            await connection.send(h11.Request(method="CONNECT", target=target,
                                              headers=[("Host", target), *self._proxy_headers()]))
            await connection.send(h11.EndOfMessage())
            head = await connection.next_event()
        except BaseException:
            connection.close()
            raise
        if not isinstance(head, h11.Response) or not 200 <= head.status_code < 300:
            connection.close()
            status = head.status_code if isinstance(head, h11.Response) else "no answer"
            raise HttpTransportError(f"proxy {self.proxy and self.proxy.authority} refused CONNECT {target}: {status}")

    def _proxy_headers(self) -> list[tuple[str, str]]:
        if self.proxy is None or self.proxy.userinfo is None:
            return []
        return [("Proxy-Authorization", "Basic " + base64.b64encode(self.proxy.userinfo.encode()).decode())]

    async def _send_request(self, connection: _Connection, method: str, path: str, headers: Mapping[str, str],
                            body: bytes | None) -> None:
        target = self.origin.prefix + path
        extra: list[tuple[str, str]] = []
        if self.proxy is not None and self._ssl is None:
            target = f"http://{self.origin.authority}{target}"  # absolute form: the proxy forwards it
            extra = self._proxy_headers()
        fields = [("Host", self.origin.host_header), ("User-Agent", self._user_agent), *headers.items(), *extra]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            fields.append(("Content-Length", str(len(body or b""))))
        try:
            await connection.send(h11.Request(method=method, target=target, headers=fields))
            if body:
                await connection.send(h11.Data(data=body))
            await connection.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            raise ValueError(f"cannot send {method} {target}: {exc}") from exc

    @staticmethod
    async def _read_head(connection: _Connection, deadline: float | None) -> HttpResponse:
        while True:
            event = await connection.next_event()
            if isinstance(event, h11.Response):
                return HttpResponse(connection, event, deadline)
            if isinstance(event, h11.ConnectionClosed):
                raise HttpTransportError("the server closed the connection before its answer was complete")
            # h11.InformationalResponse (100 Continue and the like): the real answer follows.


async def _closed(connection: _Connection) -> None:
    with suppress(OSError):
        await connection.writer.wait_closed()
