"""The sidecar's HTTP endpoints, served by ``singleton_sidecar.httpserver``.

Probe app (pod network): ``GET /readyz`` (200 only for a leader that is not draining),
``GET /livez`` (200 while the election loop makes progress, whatever the role),
``GET /candidate`` (200 while leader or standby: ready to lead; 503 once draining),
``GET /leader`` (JSON), ``GET /metrics``. Read-only by construction: it has no
route that changes anything.

``GET /leader?after=<version>&wait=<seconds>`` is a long poll: it answers as soon as the
document's ``version`` is no longer ``after`` (a new role, term or leader, a renewal that moved
the term's deadline, a sidecar restarted since), when this replica's term passes its deadline
unrenewed (``isLeader`` turns false without an event), or after ``wait`` seconds (at most 60)
with the unchanged document. ``validFor`` is how many seconds this replica may still act
without another renewal, so a client that hears nothing for that long knows the term is over;
``waited`` is how long the answer was held (floored), so that the client can count
``validFor`` from no earlier than its request's start plus ``waited``.

Control app (loopback only): ``POST /drain`` and ``POST /step-down``; ``GET /leader``; in
cooperative mode ``POST /acting?token=N`` and ``POST /stopped?token=N``, with which an app
(the SDK) makes the end of term N wait until it has stopped acting.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import re
import secrets
from collections.abc import Callable
from typing import Any

from singleton_election.core.elector import Elector
from singleton_election.core.status import ElectionStatus, Role
from singleton_sidecar.gates.cooperative_gate import CooperativeGate
from singleton_sidecar.httpserver import Handler, HttpServer, Request, Response, json_response, text_response
from singleton_sidecar.metrics import SidecarMetrics

MAX_WAIT = 60.0
"""The longest long poll, in seconds: short enough that a client's request never outlives a
proxy's idle timeout, long enough that a standby asks about once a minute."""
_VERSION = re.compile(r"[0-9a-f]{16}\.[0-9]+")


class LeaderFeed:
    """Versions of the ``/leader`` document, for long polls. A version is ``<epoch>.<count>``:
    the epoch is random per feed, so a version from before a restart never matches, and the
    count moves on every status the elector publishes and every move of the term's deadline."""

    def __init__(self, elector: Elector) -> None:
        self._elector = elector
        self._epoch = secrets.token_hex(8)
        self._count = 0
        self._changed = asyncio.Event()
        self._closed = False
        elector.add_listener(self._on_change)
        elector.add_deadline_listener(self._on_change)

    def __repr__(self) -> str:
        return f"<LeaderFeed version={self.version}>"

    @property
    def version(self) -> str:
        return f"{self._epoch}.{self._count}"

    def _on_change(self, _change: object) -> None:
        self._count += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        """Answer every waiting long poll now (the server is shutting down)."""
        self._closed = True
        self._changed.set()

    async def wait_for_change(self, after: str, wait: float) -> None:
        """Until the version is not ``after``, the acting term's deadline passed, the feed
        closed, or ``wait`` seconds passed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        while not self._closed and self.version == after:
            left = end - loop.time()
            if left <= 0:
                return
            acting = self._elector.acting_term() is not None
            changed = self._changed
            try:
                async with asyncio.timeout(min(left, self._elector.remaining()) if acting else left):
                    await changed.wait()
            except TimeoutError:
                if acting and self._elector.acting_term() is None:
                    return  # the deadline passed unrenewed: the document says isLeader false now


def _rfc3339(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def leader_document(elector: Elector, fence_key: str) -> dict[str, Any]:
    status: ElectionStatus = elector.status
    acting = elector.acting_term()
    return {
        "group": status.group,
        "fenceKey": fence_key,
        "identity": status.identity,
        "role": status.role.value,
        "isLeader": acting is not None,
        "ready": elector.is_ready_leader(),
        "token": acting.token if acting is not None else None,
        "leader": status.leader,
        "leaderToken": status.leader_token,
        "since": _rfc3339(status.leader_since),
        "transitions": status.transitions,
        "reason": status.reason,
        "backend": elector.backend.name,
        "validFor": math.floor(elector.remaining() * 1000) / 1000,  # never more than is left
    }


def liveness_limit(elector: Elector) -> float:
    """Seconds without loop progress after which /livez fails: generous, since a
    standby's acquire call may wait a retry period and a leader sleeps between renewals."""
    timings = elector.timings
    return 2 * timings.lease_duration + timings.retry_period


class _Endpoints:
    """The handlers of both apps, over one elector."""

    def __init__(self, elector: Elector, *, fence_key: str, feed: LeaderFeed,
                 metrics: SidecarMetrics | None = None, acks: CooperativeGate | None = None,
                 labelled_leader_unduly: Callable[[], bool] | None = None) -> None:
        self.elector = elector
        self.fence_key = fence_key
        self.feed = feed
        self._metrics = metrics
        self._acks = acks
        self._labelled_leader_unduly = labelled_leader_unduly

    def __repr__(self) -> str:
        return f"<_Endpoints group={self.elector.status.group}>"

    def _document(self) -> dict[str, Any]:
        return leader_document(self.elector, self.fence_key)

    async def readyz(self, _request: Request) -> Response:
        if self.elector.is_ready_leader():
            return text_response("leader\n")
        return text_response(f"{self.elector.status.role.value}\n", 503)

    async def candidate(self, _request: Request) -> Response:
        """200 while this replica leads or stands by with a live loop: pod readiness that does
        not depend on leading, so rolling updates progress (the leader Service selects by label)."""
        elector = self.elector
        role = elector.status.role
        stalled = elector.clock.monotonic() - elector.last_progress
        if role not in (Role.LEADER, Role.STANDBY) or stalled > liveness_limit(elector):
            return text_response(f"{role.value}\n", 503)
        if self._labelled_leader_unduly is not None and self._labelled_leader_unduly():
            # Not ready, so the endpoints drop the pod even if the API server never hears from us.
            return text_response(f"{role.value}: the pod is still labelled leader\n", 503)
        return text_response(f"{role.value}\n")

    async def livez(self, _request: Request) -> Response:
        elector = self.elector
        stalled = elector.clock.monotonic() - elector.last_progress
        if stalled > liveness_limit(elector):
            return text_response(f"election loop stalled for {stalled:.1f}s\n", 503)
        return text_response("ok\n")

    async def leader(self, request: Request) -> Response:
        long_poll = _long_poll(request)
        if isinstance(long_poll, Response):
            return long_poll
        loop = asyncio.get_running_loop()
        started = loop.time()
        if long_poll is not None:
            await self.feed.wait_for_change(*long_poll)
        waited = math.floor((loop.time() - started) * 1000) / 1000
        # No await between reading the version and the document: they belong together.
        return json_response({**self._document(), "version": self.feed.version, "waited": waited})

    async def metrics(self, request: Request) -> Response:
        assert self._metrics is not None
        body, content_type = self._metrics.render(request.headers.get("accept", ""))
        return Response(body=body, content_type=content_type)

    async def drain(self, request: Request) -> Response:
        """Start draining; with ``?wait=true`` answer only once the lock is released."""
        elector = self.elector
        wait = request.query.get("wait", "false").lower()
        if wait not in ("true", "false"):
            return _bad_request("query parameter wait must be true or false")
        elector.request_drain()
        if wait == "true":
            limit = elector.drain_timeout + elector.timings.lease_duration
            try:
                async with asyncio.timeout(limit):
                    await elector.wait_released()
            except TimeoutError:
                return json_response({"error": f"not released within {limit:g}s", **self._document()}, status=504)
        return json_response(self._document(), status=200 if wait == "true" else 202)

    async def step_down(self, request: Request) -> Response:
        reason = request.query.get("reason", "requested through the control endpoint")[:200]
        self.elector.request_step_down(reason)
        return json_response(self._document(), status=202)

    async def acting(self, request: Request) -> Response:
        """The app says it acts for a term: the term's end then waits for its ``/stopped``."""
        assert self._acks is not None
        token = _token(request)
        if isinstance(token, Response):
            return token
        if not self._acks.register(token):
            return json_response({"error": f"token {token} is not this replica's acting term", **self._document()},
                                 status=409)
        return json_response({"acting": token})

    async def stopped(self, request: Request) -> Response:
        """The app stopped acting for a term it registered: the term may be released."""
        assert self._acks is not None
        token = _token(request)
        if isinstance(token, Response):
            return token
        if not self._acks.acknowledge(token):
            return json_response({"error": f"token {token} was not registered with POST /acting"}, status=409)
        return json_response({"stopped": token})


def _long_poll(request: Request) -> tuple[str, float] | Response | None:
    """``(after, wait)`` for a long poll, None for a plain read, or a 400 answer naming the problem."""
    after, wait = request.query.get("after"), request.query.get("wait")
    if after is None and wait is None:
        return None
    if wait is None:
        return _bad_request("query parameter after needs wait=<seconds> (the long poll's limit)")
    if after is None:
        return _bad_request("query parameter wait needs after=<version> (the version of an earlier answer)")
    try:
        seconds = float(wait)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_WAIT:  # also refuses nan
        return _bad_request(f"query parameter wait must be a number of seconds above 0, at most {MAX_WAIT:g}, "
                            f"got {wait!r}")
    if not _VERSION.fullmatch(after):
        return _bad_request(f"query parameter after must be the version of an earlier /leader answer, got {after!r}")
    return after, seconds


def _bad_request(message: str) -> Response:
    return json_response({"error": message}, status=400)


def _token(request: Request) -> int | Response:
    raw = request.query.get("token", "")
    if not raw.isdigit():
        return _bad_request(f"query parameter token must be a positive integer, got {raw!r}")
    return int(raw)


def _server(routes: dict[tuple[str, str], Handler], endpoints: _Endpoints) -> HttpServer:
    routes[("GET", "/leader")] = endpoints.leader
    # close() calls on_shutdown before it waits for the requests being answered: no long poll holds up an exit.
    return HttpServer(routes, on_shutdown=[endpoints.feed.close])


def probe_server(elector: Elector, sidecar_metrics: SidecarMetrics, *, fence_key: str,
                 labelled_leader_unduly: Callable[[], bool] | None = None) -> HttpServer:
    """``labelled_leader_unduly``: true while the pod's role label names this replica leader
    though it leads no more (``/candidate`` then says 503)."""
    endpoints = _Endpoints(elector, fence_key=fence_key, feed=LeaderFeed(elector), metrics=sidecar_metrics,
                           labelled_leader_unduly=labelled_leader_unduly)
    return _server({("GET", "/readyz"): endpoints.readyz, ("GET", "/livez"): endpoints.livez,
                    ("GET", "/candidate"): endpoints.candidate, ("GET", "/metrics"): endpoints.metrics}, endpoints)


def control_server(elector: Elector, *, fence_key: str, acks: CooperativeGate | None = None) -> HttpServer:
    endpoints = _Endpoints(elector, fence_key=fence_key, feed=LeaderFeed(elector), acks=acks)
    routes: dict[tuple[str, str], Handler] = {("POST", "/drain"): endpoints.drain,
                                               ("POST", "/step-down"): endpoints.step_down}
    if acks is not None:
        routes[("POST", "/acting")] = endpoints.acting
        routes[("POST", "/stopped")] = endpoints.stopped
    return _server(routes, endpoints)
