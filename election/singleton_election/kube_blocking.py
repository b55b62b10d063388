"""``KubeClient`` for synchronous callers (``kubectl singleton``, the test bed's harness).

The client runs on an event loop of its own, on a thread of its own: any thread may call it,
and calls from several threads share its connections and run side by side. The errors and
timeouts are ``KubeClient``'s (``KubeError`` by status; ``KubeUnavailable`` with status 0 when
no answer came). The sidecar never imports this module.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from singleton_election.kube import KubeClient, KubeConfig

DEFAULT_TIMEOUT = 10.0

_T = TypeVar("_T")


class BlockingKubeClient:
    """One ``KubeClient`` on a private loop thread; ``close`` (or ``with``) ends both."""

    def __init__(self, config: KubeConfig, *, user_agent: str) -> None:
        self._client = KubeClient(config, user_agent=user_agent)  # a bad server or proxy URL fails here
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-client", daemon=True)
        self._thread.start()

    def __enter__(self) -> BlockingKubeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                content_type: str = "application/json", timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
        """One API call (``KubeClient.request``); returns the decoded JSON object."""
        if self._loop.is_closed():
            raise RuntimeError("the Kubernetes client is closed")
        return self._run(self._client.request(method, path, body=body, params=params, content_type=content_type,
                                              timeout=timeout))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def _run(self, call: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()
