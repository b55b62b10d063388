"""singleton_election.httpclient (the sidecar's h11 client) against real servers on sockets:
aiohttp's server as an independent HTTP/1.1 peer, and raw asyncio servers for broken answers
and proxies. The Kubernetes client on top of it is tested against the API server in
tests/integration/kube/test_kube_client.py (and through a CONNECT proxy in tests/integration/kube/test_kubelogin.py)."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import os
import shutil
import ssl
from asyncio import sslproto
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from singleton_election import httpclient
from singleton_election.httpclient import HttpClient, HttpTransportError, Origin, split_url
from singleton_operator import certs
from singleton_sidecar.app import Sidecar

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def aiohttp_server(handler: Handler, *, keepalive: float = 75.0) -> AsyncIterator[str]:
    """A real HTTP server answering every method and path with ``handler``; yields its base URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, keepalive_timeout=keepalive)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def raw_server(answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                     ) -> AsyncIterator[str]:
    """A TCP server that runs ``answer`` per connection; yields its base URL."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await answer(reader, writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


async def read_head(reader: asyncio.StreamReader) -> list[str]:
    return (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")[:-2]


def peer_port(request: web.Request) -> int:
    assert request.transport is not None
    port: int = request.transport.get_extra_info("peername")[1]
    return port


async def test_answers_reuse_one_connection_and_carry_method_headers_and_body() -> None:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"method": request.method, "path": request.path_qs, "port": peer_port(request),
                                  "agent": request.headers["User-Agent"], "x": request.headers.get("X-Test"),
                                  "body": body.decode()})

    async with aiohttp_server(echo) as url, HttpClient(url, user_agent="tester/1") as client:
        first, first_body = await client.request("GET", "/a?b=1")
        second, second_body = await client.request("PUT", "/c", headers={"X-Test": "yes"}, body=b"payload")
    assert (first.status, second.status) == (200, 200)
    one, two = web_json(first_body), web_json(second_body)
    assert one == {"method": "GET", "path": "/a?b=1", "port": one["port"], "agent": "tester/1", "x": None, "body": ""}
    assert two == {"method": "PUT", "path": "/c", "port": one["port"], "agent": "tester/1", "x": "yes",
                   "body": "payload"}


def web_json(body: bytes) -> dict[str, object]:
    doc = json.loads(body)
    assert isinstance(doc, dict)
    return doc


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def port(request: web.Request) -> web.Response:
        return web.Response(text=str(peer_port(request)))

    async with aiohttp_server(port, keepalive=0.2) as url, HttpClient(url) as client:
        _, first = await client.request("GET", "/")
        await asyncio.sleep(0.6)  # the server closes the idle connection
        response, second = await client.request("GET", "/")
    assert response.status == 200 and first != second


async def test_idle_connections_past_their_time_are_closed_when_the_next_request_goes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def port(request: web.Request) -> web.Response:
        return web.Response(text=str(peer_port(request)))

    async with aiohttp_server(port) as url, HttpClient(url) as client:
        answers = await asyncio.gather(*(client.request("GET", "/") for _ in range(3)))  # three connections
        assert len({body for _, body in answers}) == 3 and len(client._idle) == 3
        monkeypatch.setattr(httpclient, "IDLE_TIMEOUT", 0.0)
        _, fresh = await client.request("GET", "/")
        assert fresh not in {body for _, body in answers}
        assert len(client._idle) == 1  # the three old ones were closed, not kept under the new one


async def test_a_base_url_path_prefixes_every_target() -> None:
    async def path(request: web.Request) -> web.Response:
        return web.Response(text=request.path_qs)

    async with aiohttp_server(path) as url, HttpClient(url + "/k8s/clusters/c1/") as client:
        _, body = await client.request("GET", "/api/v1/pods?limit=1")
    assert body == b"/k8s/clusters/c1/api/v1/pods?limit=1"


async def test_a_streamed_answer_arrives_chunk_by_chunk_and_its_deadline_holds() -> None:
    release, stop = asyncio.Event(), asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first\n")
        await release.wait()
        await response.write(b"second\n")
        await stop.wait()  # silence until the test ends: the client's deadline ends the stream
        return response

    loop = asyncio.get_running_loop()
    async with aiohttp_server(stream) as url, HttpClient(url) as client:
        deadline = loop.time() + 1.0
        seen: list[bytes] = []
        try:
            with pytest.raises(TimeoutError):
                async with client.open("GET", "/watch", deadline=deadline) as response:
                    assert response.status == 200
                    async for chunk in response.chunks():
                        seen.append(chunk)
                        release.set()
        finally:
            stop.set()
        assert seen == [b"first\n", b"second\n"]
        assert 0.9 < loop.time() - (deadline - 1.0) < 2.0
        assert not client._busy and not client._idle  # the half-read connection was closed, not kept


async def iptables(*args: str) -> int:
    process = await asyncio.create_subprocess_exec("iptables", "-w", *args)
    return await process.wait()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("iptables") is None,
                    reason="drops the server's packets with iptables: root only")
async def test_a_stream_on_a_path_gone_dead_fails_within_the_keepalive_not_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch whose path goes silent (its peer's packets dropped, no reset: a lost machine,
    a dropped conntrack entry) fails once TCP keepalive gives up, long before its deadline."""
    monkeypatch.setattr(httpclient, "KEEPALIVE_IDLE", 1)
    monkeypatch.setattr(httpclient, "KEEPALIVE_INTERVAL", 1)
    monkeypatch.setattr(httpclient, "KEEPALIVE_COUNT", 2)
    monkeypatch.setattr(httpclient, "USER_TIMEOUT_MS", 3000)  # Linux: decides with keepalive's probes
    stop = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first\n")
        await stop.wait()
        return response

    loop = asyncio.get_running_loop()
    async with aiohttp_server(stream) as url, HttpClient(url) as client:
        port = url.rpartition(":")[2]
        rules = [["INPUT", "-i", "lo", "-p", "tcp", "--sport", port, "-j", "DROP"],
                 ["INPUT", "-i", "lo", "-p", "tcp", "--dport", port, "-j", "DROP"]]
        seen: list[bytes] = []
        started = loop.time()
        try:
            with pytest.raises(OSError) as failed:
                async with client.open("GET", "/watch", deadline=started + 20) as response:
                    async for chunk in response.chunks():
                        seen.append(chunk)
                        for rule in rules:
                            assert await iptables("-I", *rule) == 0
        finally:
            for rule in rules:
                await iptables("-D", *rule)
            stop.set()
        took = loop.time() - started
    assert seen == [b"first\n"]
    assert took < 10, f"the dead path was noticed after {took:.1f}s (the stream's deadline was 20s)"
    assert not isinstance(failed.value, TimeoutError) or failed.value.errno is not None, repr(failed.value)


async def test_a_cancelled_request_closes_its_connection() -> None:
    stop = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        if request.path == "/slow":
            await stop.wait()
        return web.Response(text=str(peer_port(request)))

    async with aiohttp_server(slow) as url, HttpClient(url) as client:
        _, before = await client.request("GET", "/fast")
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await client.request("GET", "/slow")  # on the reused connection: it must not be reused again
        finally:
            stop.set()
        _, after = await client.request("GET", "/fast")
    assert before != after


@pytest.mark.parametrize(("answer", "message"), [
    (b"not http at all\r\n\r\n", "malformed answer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", "closed the connection before its answer was complete"),
    (b"", "closed the connection before its answer was complete"),
])
async def test_broken_answers_are_transport_errors(answer: bytes, message: str) -> None:
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    async with raw_server(reply) as url, HttpClient(url) as client:
        with pytest.raises(HttpTransportError, match=message):
            await client.request("GET", "/")


async def test_an_answer_over_the_limit_is_refused() -> None:
    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 5000)

    async with aiohttp_server(big) as url, HttpClient(url) as client, client.open("GET", "/") as response:
        with pytest.raises(HttpTransportError, match="answer over 4096 bytes"):
            await response.read(limit=4096)


async def test_a_refused_connection_is_an_os_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with HttpClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(ConnectionRefusedError):
            await client.request("GET", "/")


async def test_an_http_origin_goes_through_a_proxy_in_absolute_form_with_its_credentials() -> None:
    heads: list[list[str]] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await read_head(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with raw_server(proxy) as proxy_url:
        proxy_with_credentials = proxy_url.replace("http://", "http://user%40corp:p%3Ass@")
        async with HttpClient("http://origin.example:8080", proxy=proxy_with_credentials) as client:
            response, body = await client.request("GET", "/x?y=1")
    assert (response.status, body) == (200, b"ok")
    [head] = heads
    assert head[0] == "GET http://origin.example:8080/x?y=1 HTTP/1.1"
    credentials = base64.b64encode(b"user@corp:p:ss").decode()
    assert f"Proxy-Authorization: Basic {credentials}" in head and "Host: origin.example:8080" in head


def test_bad_urls_and_proxies_are_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="not an http\\(s\\) URL with a host: 'ftp://x'"):
        HttpClient("ftp://x")
    with pytest.raises(ValueError, match="only http:// proxies are supported, got 'socks5://p:1080'"):
        HttpClient("https://x", proxy="socks5://p:1080")
    assert split_url("http://h:1/a/b?c=d") == ("http://h:1", "/a/b?c=d")
    assert split_url("https://h") == ("https://h", "/")


async def test_the_drain_hook_posts_to_the_app_and_reads_its_answer() -> None:
    calls: list[str] = []

    async def app(request: web.Request) -> web.Response:
        calls.append(f"{request.method} {request.path_qs}")
        return web.Response(status=200 if request.query.get("ok") == "1" else 500)

    async with aiohttp_server(app) as url:
        assert await Sidecar._ask_app_to_drain(f"{url}/drain?ok=1") is True
        assert await Sidecar._ask_app_to_drain(f"{url}/drain?ok=0") is False
    assert calls == ["POST /drain?ok=1", "POST /drain?ok=0"]
    assert await Sidecar._ask_app_to_drain(url + "/drain") is False  # the app's listener is gone: refused


def test_the_host_header_leaves_out_the_default_port() -> None:
    assert Origin.parse("https://api.example.com").host_header == "api.example.com"
    assert Origin.parse("https://api.example.com:443/k8s").host_header == "api.example.com"
    assert Origin.parse("http://10.0.0.1:80").host_header == "10.0.0.1"
    assert Origin.parse("https://[fd00::1]:6443").host_header == "[fd00::1]:6443"
    assert Origin.parse("https://api.example.com").authority == "api.example.com:443"  # a CONNECT target keeps it


async def test_a_connection_with_bytes_past_its_answer_is_not_reused() -> None:
    connections = 0

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        first = connections == 1
        while True:
            try:
                await read_head(reader)
            except asyncio.IncompleteReadError:  # the client closed the connection
                return
            extra = b"HTTP/1.1 500 Stale\r\nContent-Length: 0\r\n\r\n" if first else b""
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + extra)
            await writer.drain()

    async with raw_server(reply) as url, HttpClient(url) as client:
        first, _ = await client.request("GET", "/")
        await asyncio.sleep(0.1)  # the extra answer arrives and waits in the connection's buffer
        second, body = await client.request("GET", "/")
    assert (first.status, second.status, body, connections) == (200, 200, b"ok", 2)


async def test_a_closed_client_refuses_requests() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async with aiohttp_server(ok) as url:
        client = HttpClient(url)
        await client.request("GET", "/")
        await client.close()
        assert not client._idle
        with pytest.raises(HttpTransportError, match="the client is closed"):
            await client.request("GET", "/")


async def test_tls_answers_arrive_whole_through_the_sidecars_small_read_buffers(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``use_small_tls_buffers`` (the sidecar's start; 1 MB less at rest): a TLS connection opened
    after it reads through 16 KiB, and a body of megabytes arrives whole through it."""
    monkeypatch.setattr(sslproto.SSLProtocol, "max_size", sslproto.SSLProtocol.max_size)  # put back afterwards
    httpclient.use_small_tls_buffers()
    bundle = certs.new_bundle(["127.0.0.1"], dt.datetime.now(dt.UTC))
    (tmp_path / "tls.crt").write_bytes(bundle.cert)
    (tmp_path / "tls.key").write_bytes(bundle.key)
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    big = os.urandom(3 * 1024 * 1024 + 17)

    async def answer(_request: web.Request) -> web.Response:
        return web.Response(body=big, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/big", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=serving).start()
    trusting = ssl.create_default_context(cadata=bundle.ca_cert.decode())
    try:
        async with HttpClient(f"https://127.0.0.1:{runner.addresses[0][1]}", ssl_context=trusting) as client:
            resp, body = await client.request("GET", "/big")
            assert resp.status == 200
            assert body == big
            (connection,) = client._idle
            tls: Any = connection.writer.transport
            assert len(tls._ssl_protocol._ssl_buffer) == httpclient.TLS_READ_BUFFER == 16 * 1024
    finally:
        await runner.cleanup()
