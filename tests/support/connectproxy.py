"""An HTTP CONNECT proxy for tests of clients behind HTTPS_PROXY (kubectl singleton, the operator)."""

from __future__ import annotations

import select
import socket
import socketserver


class ConnectProxy(socketserver.ThreadingTCPServer):
    """An HTTP CONNECT proxy that records the targets it tunnelled to."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.targets: list[str] = []
        super().__init__(("127.0.0.1", 0), _Tunnel)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Tunnel(socketserver.StreamRequestHandler):
    server: ConnectProxy

    def handle(self) -> None:
        method, target, _ = self.rfile.readline().decode().split(" ", 2)
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        if method != "CONNECT":
            self.wfile.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
            return
        self.server.targets.append(target)
        host, _, port = target.rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as upstream:
            self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            self.wfile.flush()
            ends = [self.connection, upstream]
            while True:
                readable, _, _ = select.select(ends, [], [], 30)
                if not readable:
                    return
                for end in readable:
                    data = end.recv(65536)
                    if not data:
                        return
                    (upstream if end is self.connection else self.connection).sendall(data)
