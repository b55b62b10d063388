"""The asynchronous client: who leads, and code that runs only while this replica does.

    async with leadership() as term:        # waits until this replica leads
        await work(term)                    # cancelled as soon as the term ends or starts ending

The sidecar is asked with long polls (``GET /leader?after=<version>&wait=<seconds>``): an
answer comes as soon as the leadership document changes, and on every renewal while this
replica leads. Each answer carries ``validFor``, the seconds this replica may still act without
another renewal; if no newer answer arrives within that time (a stalled sidecar, a cut
connection), the term counts as lost, as it does when the sidecar cannot be reached at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import NoReturn, TypeVar

import aiohttp

from singleton_sdk.term import Leadership, SidecarError, Term

log = logging.getLogger(__name__)
T = TypeVar("T")

ENV_LEADER_URL = "SINGLETON_LEADER_URL"
"""The sidecar's leadership document, set by the operator on the main container
(``http://127.0.0.1:<sidecar port>/leader``)."""
ENV_CONTROL_URL = "SINGLETON_CONTROL_URL"
"""The sidecar's control endpoint (loopback only), set by the operator on the main container
(``http://127.0.0.1:<sidecar port + 1>``)."""
DEFAULT_LEADER_URL = "http://127.0.0.1:8080/leader"
"""Without the operator: ``singleton-sidecar run``'s default ``--listen`` port."""
DEFAULT_CONTROL_URL = "http://127.0.0.1:8081"
"""Without the operator: ``singleton-sidecar run``'s default ``--control-listen``."""
_UNREACHABLE = (OSError, aiohttp.ClientError, TimeoutError)


class LeadershipLost(Exception):
    """The term ended (or began to end) while the code that acted for it ran; it was cancelled."""

    def __init__(self, term: Term, reason: str) -> None:
        super().__init__(f"leadership lost: {reason}")
        self.term = term
        self.reason = reason


class LeaderClient:
    """The local sidecar, asked over HTTP. ``leader_url`` and ``control_url`` default to
    ``$SINGLETON_LEADER_URL`` and ``$SINGLETON_CONTROL_URL`` (what the operator sets), else to
    the sidecar's own defaults. ``timeout``: seconds an answer may take beyond the long poll's
    ``wait``; ``retry``: the pause before asking again a sidecar that could not be reached."""

    def __init__(self, leader_url: str | None = None, *, control_url: str | None = None, timeout: float = 1.0,
                 wait: float = 30.0, retry: float = 0.2) -> None:
        self.leader_url = leader_url or os.environ.get(ENV_LEADER_URL) or DEFAULT_LEADER_URL
        self.control_url = (control_url or os.environ.get(ENV_CONTROL_URL) or DEFAULT_CONTROL_URL).rstrip("/")
        if not 0 < wait <= 60:
            raise ValueError(f"wait must be above 0 and at most 60 seconds (the sidecar's limit), got {wait!r}")
        self.timeout = timeout
        self.wait = wait
        self.retry = retry
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"<LeaderClient {self.leader_url} control={self.control_url}>"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> LeaderClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    # --- reading -------------------------------------------------------------------------

    async def status(self, *, after: Leadership | None = None) -> Leadership:
        """What the sidecar says now, or with ``after``, once it says something newer than
        ``after`` (at most ``wait`` seconds later). Raises ``OSError``, ``aiohttp.ClientError``
        or ``TimeoutError`` if it cannot be asked, ``SidecarError`` if it refuses."""
        params = {} if after is None else {"after": after.version, "wait": f"{self.wait:g}"}
        limit = self.timeout + (0 if after is None else self.wait)
        async with self._http().get(self.leader_url, params=params,
                                    timeout=aiohttp.ClientTimeout(total=limit)) as response:
            if response.status != 200:
                raise SidecarError(f"GET {self.leader_url} answered {response.status}: {await response.text()}")
            return Leadership.from_document(await response.json())

    async def current_term(self) -> Term | None:
        """This replica's term if it leads now, else None (also when the sidecar cannot be asked)."""
        try:
            return (await self.status()).term()
        except _UNREACHABLE:
            return None

    async def wait_until_leading(self, *, newer_than: int = 0) -> Term:
        """The term once this replica leads with a token greater than ``newer_than``."""
        term, _, _ = await self._wait_for_term(newer_than)
        return term

    async def _wait_for_term(self, newer_than: int) -> tuple[Term, Leadership, float]:
        """The term, the answer that showed it and the loop time from which its ``validFor`` counts."""
        loop = asyncio.get_running_loop()
        seen: Leadership | None = None
        while True:
            asked = loop.time()
            try:
                seen = await self.status(after=seen)
            except _UNREACHABLE as exc:
                log.debug("sidecar %s not reachable: %r", self.leader_url, exc)
                seen = None
                await asyncio.sleep(self.retry)
                continue
            term = seen.term()
            if term is not None and term.token > newer_than:
                return term, seen, asked + seen.waited

    async def watch(self, term: Term, seen: Leadership, since: float) -> str:
        """Returns why ``term`` is over or ending, as soon as it is: the sidecar says so, cannot
        be reached, or gives no newer answer within the last answer's ``validFor`` (``seen``,
        counted from loop time ``since``: the request's start plus the time the sidecar held
        it, no later than the moment the answer was made)."""
        loop = asyncio.get_running_loop()
        while (reason := seen.ends(term)) is None:
            try:
                async with asyncio.timeout_at(since + seen.valid_for):
                    asked = loop.time()
                    seen = await self.status(after=seen)
                since = asked + seen.waited
            except TimeoutError:
                return f"term {term.token}: no word from the sidecar within its deadline"
            except (OSError, aiohttp.ClientError, SidecarError) as exc:
                return f"term {term.token}: the sidecar cannot be asked ({exc!r})"
        return reason

    # --- acting --------------------------------------------------------------------------

    def leadership(self) -> Leading:
        """``async with client.leadership() as term:``: see ``Leading``."""
        return Leading(self)

    async def run_while_leading(self, act: Callable[[Term], Awaitable[object]]) -> NoReturn:
        """Run ``act(term)`` once in every term this replica leads, cancelled when the term
        ends or starts ending; between terms, wait. Returns only by an exception (``act``'s own
        ones propagate; cancel the task to stop)."""
        newer_than = 0
        while True:
            try:
                async with Leading(self, newer_than=newer_than) as term:
                    newer_than = term.token
                    await act(term)
            except LeadershipLost as lost:
                log.info("%s; waiting for the next term", lost)

    async def register(self, term: Term) -> bool:
        """Tell the sidecar the app acts for ``term`` (``POST /acting``): the term's end then
        waits for ``report_stopped``. False if the term is no longer the sidecar's acting term."""
        url = f"{self.control_url}/acting"
        try:
            async with self._http().post(url, params={"token": str(term.token)},
                                         timeout=aiohttp.ClientTimeout(total=self.timeout)) as response:
                if response.status == 409:
                    return False
                if response.status != 200:
                    raise SidecarError(f"POST {url} answered {response.status} ({await response.text()!r}): "
                                       "the sidecar must gate cooperatively (no exec or file gate)")
                return True
        except _UNREACHABLE as exc:
            raise SidecarError(f"POST {url} failed ({exc!r}): is {ENV_CONTROL_URL} this pod's sidecar?") from exc

    async def report_stopped(self, term: Term) -> None:
        """Tell the sidecar the app no longer acts for ``term`` (``POST /stopped``): it may release.
        A sidecar that cannot be told does not wait for it (it is gone, or its term is over)."""
        try:
            async with self._http().post(f"{self.control_url}/stopped", params={"token": str(term.token)},
                                         timeout=aiohttp.ClientTimeout(total=self.timeout)) as response:
                if response.status != 200:
                    log.warning("POST /stopped for term %s answered %s", term.token, response.status)
        except _UNREACHABLE as exc:
            log.warning("POST /stopped for term %s failed: %r", term.token, exc)


class Leading:
    """``async with Leading(client) as term:`` waits until this replica leads, tells the sidecar
    the app acts for the term, and runs the block. As soon as the term ends or starts ending
    (draining, step-down, handover, lost lock, a sidecar gone or silent past the term's
    deadline) the task running the block is cancelled; once the block has exited, however it
    exited, the sidecar is told the app stopped, and only then does it release the lock.

    A block cancelled that way raises ``LeadershipLost`` (as ``asyncio.timeout`` raises
    ``TimeoutError``); a block that finished first exits normally. A block must not swallow
    ``CancelledError``: until it exits, the sidecar waits (up to its stop timeout) and the
    next leader with it."""

    def __init__(self, client: LeaderClient, *, newer_than: int = 0, owns_client: bool = False) -> None:
        self._client = client
        self._newer_than = newer_than
        self._owns_client = owns_client
        self._task: asyncio.Task[object] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._term: Term | None = None
        self._lost: str | None = None

    def __repr__(self) -> str:
        return f"<Leading term={self._term} lost={self._lost!r}>"

    async def __aenter__(self) -> Term:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("leadership() must be entered inside a task")
        self._task = task
        client = self._client
        try:
            while True:
                term, seen, since = await client._wait_for_term(self._newer_than)
                if await client.register(term):
                    break
                await asyncio.sleep(client.retry)  # the term ended between the answer and the registration
        except BaseException:
            if self._owns_client:
                await client.close()
            raise
        self._term = term
        self._watcher = asyncio.create_task(self._watch(term, seen, since), name=f"singleton-term-{term.token}")
        return term

    async def _watch(self, term: Term, seen: Leadership, since: float) -> None:
        reason = await self._client.watch(term, seen, since)
        # No await between here and the cancel: stopping this task in __aexit__ either comes
        # before both or after both.
        self._lost = reason
        assert self._task is not None
        self._task.cancel(reason)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        assert self._task is not None and self._watcher is not None and self._term is not None
        self._watcher.cancel()  # from here on, the block's task is never cancelled by us
        landed_late = False
        if self._lost is not None:
            self._task.uncancel()
            if exc_type is not asyncio.CancelledError:
                # Our cancel may still be pending (the block finished just before it landed): take it.
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    landed_late = True
        # Only now, with the block exited, may the sidecar release the lock; shielded, so that
        # another cancellation of this task does not keep the sidecar waiting.
        await asyncio.shield(asyncio.ensure_future(self._finish(self._term, self._watcher)))
        if self._task.cancelling() > 0:  # someone else cancels this task too: let that go on
            if landed_late:
                raise asyncio.CancelledError
            return False
        if self._lost is None or landed_late:
            return False  # the block finished while the term held: its own outcome
        if exc_type is None or exc_type is asyncio.CancelledError:
            raise LeadershipLost(self._term, self._lost) from exc
        return False  # the block, cancelled, raised something else: that goes on

    async def _finish(self, term: Term, watcher: asyncio.Task[None]) -> None:
        (outcome,) = await asyncio.gather(watcher, return_exceptions=True)
        if isinstance(outcome, Exception):
            log.error("watching term %s failed", term.token, exc_info=outcome)
        await self._client.report_stopped(term)
        if self._owns_client:
            await self._client.close()


async def uninterrupted(step: Awaitable[T]) -> T:
    """Await ``step`` to its end even if the block is cancelled meanwhile, then let the
    cancellation go on: for a short step that must not be cut in half (one item of work and
    its bookkeeping). Unlike ``asyncio.shield``, the caller does not return before ``step``
    has finished, so the sidecar is never told the app stopped while the step still runs. The
    sidecar waits for it only up to its stop timeout: keep such steps short, and fence them."""
    task = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):  # the step ends first, whatever asks
                await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            log.warning("a step finished after its block was cancelled, with %r", task.exception())
        raise


def leadership(leader_url: str | None = None, *, control_url: str | None = None, timeout: float = 1.0,
               wait: float = 30.0) -> Leading:
    """``async with leadership() as term:`` with a client of its own (``LeaderClient``'s
    arguments and defaults), closed when the block exits. See ``Leading``."""
    client = LeaderClient(leader_url, control_url=control_url, timeout=timeout, wait=wait)
    return Leading(client, owns_client=True)


async def run_while_leading(act: Callable[[Term], Awaitable[object]], leader_url: str | None = None, *,
                            control_url: str | None = None) -> NoReturn:
    """``LeaderClient.run_while_leading`` with a client of its own."""
    async with LeaderClient(leader_url, control_url=control_url) as client:
        await client.run_while_leading(act)
