"""A TCP proxy on 127.0.0.1 that a test can cut and heal, as a network partition would:
while cut, nothing is forwarded in either direction and new connections hang, so the
client sees timeouts rather than resets (packets dropped, not refused)."""

from __future__ import annotations

import asyncio
import contextlib


class CuttableProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host, self.target_port = target_host, target_port
        self._healed = asyncio.Event()
        self._healed.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"<CuttableProxy -> {self.target_host}:{self.target_port} cut={not self._healed.is_set()}>"

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> CuttableProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    def cut(self) -> None:
        self._healed.clear()

    def heal(self) -> None:
        self._healed.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._healed.wait()
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
            try:
                await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
            finally:
                up_writer.close()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            await self._healed.wait()  # while cut, hold the bytes back: the peer hears nothing
            writer.write(data)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()
