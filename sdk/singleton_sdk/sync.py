"""The synchronous twin, for threaded apps:

    from singleton_sdk.sync import LeaderClient

    with LeaderClient() as client, client.leadership() as term:
        while True:
            term.check()                    # raises LeadershipLost once the term ends or starts ending
            do_one_item(term)
            term.sleep(0.5)                 # a pause that ends at once, with LeadershipLost, on loss

Python cannot cancel a thread, so the body stops cooperatively: ``term.lost`` (a
``threading.Event``) is set the moment the term ends or starts ending, and ``term.check()``
and ``term.sleep()`` raise ``LeadershipLost`` from then on. The sidecar is told the app
stopped only when the ``with`` block has exited, so it never releases the lock while the body
runs. The limit: a body that does not look (a long blocking call) keeps acting until it does,
and the sidecar waits for it only up to its stop timeout (``kill_grace`` + 2 s) or drain
timeout; past that, a step-down leaves the lock to expire, and only fenced writes keep a late
write out. Keep each step between checks short, and fence the writes.

The sidecar is watched by the asynchronous client on an event loop in a daemon thread of its
own, so the same long polls and deadlines apply.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

from singleton_sdk import client as aio
from singleton_sdk.client import LeadershipLost
from singleton_sdk.term import Leadership, Term

__all__ = ["LeaderClient", "LeadershipLost", "SyncTerm"]

T = TypeVar("T")


@dataclass(frozen=True)
class SyncTerm(Term):
    """A ``Term`` with the event that tells the body its term is over or ending."""

    lost: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)
    reason: list[str] = field(default_factory=list, compare=False, repr=False)

    def check(self) -> None:
        """Raise ``LeadershipLost`` if the term is over or ending."""
        if self.lost.is_set():
            raise LeadershipLost(self, self.reason[0] if self.reason else "lost")

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or raise ``LeadershipLost`` as soon as the term is over or ending."""
        self.lost.wait(seconds)
        self.check()


class LeaderClient:
    """``singleton_sdk.LeaderClient``'s calls, blocking; the same arguments and defaults."""

    def __init__(self, leader_url: str | None = None, *, control_url: str | None = None, timeout: float = 1.0,
                 wait: float = 30.0, retry: float = 0.2) -> None:
        self._client = aio.LeaderClient(leader_url, control_url=control_url, timeout=timeout, wait=wait,
                                        retry=retry)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="singleton-sdk", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<sync {self._client!r}>"

    @property
    def leader_url(self) -> str:
        return self._client.leader_url

    @property
    def control_url(self) -> str:
        return self._client.control_url

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = self._submit(coroutine)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # KeyboardInterrupt while waiting: stop the coroutine too
            raise

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> LeaderClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def status(self) -> Leadership:
        """What the sidecar says now (raises if it cannot be asked)."""
        return self._call(self._client.status())

    def current_term(self) -> Term | None:
        """This replica's term if it leads now, else None (also when the sidecar cannot be asked)."""
        return self._call(self._client.current_term())

    def wait_until_leading(self, *, newer_than: int = 0) -> Term:
        return self._call(self._client.wait_until_leading(newer_than=newer_than))

    @contextmanager
    def leadership(self, *, newer_than: int = 0) -> Iterator[SyncTerm]:
        """Waits until this replica leads, tells the sidecar the app acts for the term, and runs
        the block with a ``SyncTerm`` whose ``lost`` is set as soon as the term ends or starts
        ending. Once the block has exited, the sidecar is told the app stopped. A block that
        exits normally after the loss raises ``LeadershipLost`` (the code after the block runs
        only if the body finished while the term held)."""
        term, seen, since = self._call(self._acquire(newer_than))
        acting = SyncTerm(group=term.group, identity=term.identity, token=term.token, fence_key=term.fence_key)
        watcher = self._submit(self._client.watch(term, seen, since))

        def on_end(done: Future[str]) -> None:
            if done.cancelled():
                return
            error = done.exception()
            acting.reason.append(repr(error) if error is not None else done.result())
            acting.lost.set()

        watcher.add_done_callback(on_end)
        try:
            yield acting
        finally:
            watcher.cancel()
            # Only now, with the body exited: the sidecar may release the lock.
            self._call(self._client.report_stopped(term))
        acting.check()

    async def _acquire(self, newer_than: int) -> tuple[Term, Leadership, float]:
        while True:
            term, seen, since = await self._client._wait_for_term(newer_than)
            if await self._client.register(term):
                return term, seen, since
            await asyncio.sleep(self._client.retry)

    def run_while_leading(self, act: Callable[[SyncTerm], object]) -> NoReturn:
        """Run ``act(term)`` once in every term this replica leads; ``act`` stops when
        ``term.check()``/``term.sleep()`` raise ``LeadershipLost`` (or returns on its own)."""
        newer_than = 0
        while True:
            try:
                with self.leadership(newer_than=newer_than) as term:
                    newer_than = term.token
                    act(term)
            except LeadershipLost as lost:
                aio.log.info("%s; waiting for the next term", lost)
