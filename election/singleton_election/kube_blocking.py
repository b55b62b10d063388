"""``KubeClient`` for synchronous callers (``kubectl singleton``, the test bed's harness).

The client runs on an event loop of its own, on a thread of its own: any thread may call it,
and calls from several threads share its connections and run side by side. The errors and
timeouts are ``KubeClient``'s (``KubeError`` by status; ``KubeUnavailable`` with status 0 when
no answer came). The sidecar never imports this module.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from singleton_election.kube import KubeClient, KubeConfig

DEFAULT_TIMEOUT = 10.0

_T = TypeVar("_T")


class ClientClosed(RuntimeError):
    """A call on a ``BlockingKubeClient`` after (or while) it was closed."""


class BlockingKubeClient:
    """One ``KubeClient`` on a private loop thread; ``close`` (or ``with``) ends both."""

    def __init__(self, config: KubeConfig, *, user_agent: str) -> None:
        self._client = KubeClient(config, user_agent=user_agent)  # a bad server or proxy URL fails here
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-client", daemon=True)
        self._thread.start()
        # Held while a call is handed to the loop and while closing: no call slips in between
        # the client's close and the loop's end (it would wait on a stopped loop for ever).
        self._state = threading.Lock()
        self._closed = False

    def __enter__(self) -> BlockingKubeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                content_type: str = "application/json", timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
        """One API call (``KubeClient.request``); returns the decoded JSON object."""
        return self._run(lambda: self._client.request(method, path, body=body, params=params,
                                                      content_type=content_type, timeout=timeout))

    def close(self) -> None:
        """End the client's connections, then its loop and thread. Idempotent. A call made
        after it raises ``ClientClosed``; one still in flight ends with the client's error."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("BlockingKubeClient.close() from its own loop thread would wait for itself")
        with self._state:
            if self._closed:
                return
            self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def _run(self, make_call: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        with self._state:
            if self._closed:
                raise ClientClosed("the Kubernetes client is closed")
            future = asyncio.run_coroutine_threadsafe(self._coroutine(make_call), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C): the call must not go on alone on the loop
            raise

    @staticmethod
    async def _coroutine(make_call: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        # The call is made on the loop, once it is sure to run: none is left never awaited.
        return await make_call()
