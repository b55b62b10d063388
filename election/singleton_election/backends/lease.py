"""Kubernetes Lease lock backend: a ``coordination.k8s.io/v1`` Lease per group.

Called by the election core through ``LockBackend``. Design (after client-go's leaderelection):

- **Record**: ``spec.holderIdentity``, ``leaseDurationSeconds`` (ceil of our lease duration),
  ``acquireTime`` and ``renewTime`` (RFC 3339 with microseconds, from the wall clock: for
  people and tools only, never for decisions) and ``leaseTransitions`` (+1 on every change of
  holder), so ``kubectl get lease`` and client-go tools read it as usual. The fencing token
  lives in the annotation ``singleton.dev/token``.
- **Free** means released by its holder: an empty holder with ``singleton.dev/released-token``
  equal to the token, written by the holder's own release once its app had stopped; such a
  Lease is taken at once by a warm standby, one whose backend first observed the Lease at
  least ``NEWCOMER_DEFERENCE`` ago (or that held a term on it). A newcomer, typically the
  sidecar of the pod replacing a deleted leader's, takes it only once that much time has
  passed since its own first observation (its first read, or the watch's first list): a
  standby whose app is already running wins the release, not a pod whose app has not started
  yet (PostgreSQL's lock queue gives the same order). An empty holder without the mark
  (``kubectl singleton release``, a hand edit) or no Lease at all (``kubectl delete lease``)
  says nothing of whether the last holder's app has stopped, so it is taken only when the
  last term seen here would have expired had its holder crashed: ``max(lease_duration,
  leaseDurationSeconds)`` after that term's last renewal was observed here (after the
  holder-less Lease was first observed, by a process that saw no term); no newcomer
  deference applies there, nor to a missing Lease. A process that finds no Lease and saw
  none before asks the group's pods: while one carries a token (its sidecar leads, or led and
  did not step down cleanly), it waits the lease duration before creating the Lease; a new
  group's first term is not delayed.
- **Tokens** follow the rule of every backend, a hybrid logical clock: a new term's token is
  ``max(the Lease's token + 1, the wall clock in milliseconds, the high-water mark + 1)``.
  The high-water mark is the highest token this process has observed for the group: on the
  Lease as read by ``acquire``, ``observe`` and ``renew``, in every watch event (a deleted
  Lease's last state included), in our own writes, and on the group's pods (below). Tokens
  are about 1.7e12: they fit int64 and JSON numbers. So a Lease left over from an earlier
  lease era, while the group ran on PostgreSQL meanwhile (whose tokens follow the same rule
  from the database's clock), restarts from the clock rather than from its stale token + 1;
  and a deleted Lease re-created on a node whose clock is behind continues above every
  token this process has seen.
- **Pod tokens**: when this process begins its first term, and whenever the Lease does not
  exist (never created, or deleted), the candidate first lists the pods labelled
  ``singleton.dev/group=<Lease name>`` (the sidecar names the Lease after its group) in the
  Lease's namespace and adds their ``singleton.dev/token`` annotations to the high-water
  mark: the sidecar keeps its term's token there while it leads, whatever its backend. The
  sidecar's RBAC allows listing pods; a failed list (403 without that right, a timeout
  within half of the call's remaining time) is logged and ignored, and the clock still
  applies.
- **What remains**: a token can still come out lower than an earlier one of the group only
  when the higher token is nowhere this process can see it: the process never observed it
  (a fresh process, or one that was not watching the group when it was issued), the Lease
  holding it is gone (or, for a token issued by another backend, never held it), no pod of
  the group still carries it (the annotation is removed when a pod stops leading, so after
  a clean handover and a rollout none may be left), and the wall clock of the node is
  behind the clock that issued it (another node's, or the database's) by more than the
  time since. Nothing here can close that gap: it needs a store that outlives the Lease.
- **Writes** are PUTs of the whole observed object carrying its ``resourceVersion`` (POST when
  there is no Lease). 409 means somebody else wrote first: ``acquire`` returns the current
  record, ``renew`` and ``release`` re-read and go on only if holder and token are still ours
  (someone edited a label; or our earlier write timed out but landed).
- **Expiry** is judged by local observation, never by comparing ``renewTime`` with our clock:
  a held Lease is expired when the same ``resourceVersion`` has been observed for
  ``max(lease_duration, leaseDurationSeconds)`` seconds of our monotonic clock. A Lease held
  by the acquiring identity itself (a write that timed out but landed) can be taken at once,
  and so can one held by this container's own earlier incarnation in the same pod, when the
  sidecar is its group's sole candidate in the pod (``predecessor_prefix``, see
  ``core.identity.is_predecessor``): the kubelet restarted it, so that holder is dead, and the
  only app that may still act for its term is this pod's own.
- **Watch**: from the first ``acquire`` on, a background task lists the Lease and watches it
  (field selector ``metadata.name``), restarting after 410 Gone or transport errors with
  backoff. Standbys wait on it: a release wakes them within milliseconds, and an idle standby
  makes no requests besides the watch. While the watch is down, ``acquire`` reads the Lease
  once per call instead. Seeing another holder (a higher token) or the Lease's deletion
  while holding a term calls the loss callback at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing, contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from singleton_election.contract import ANNOTATION_TOKEN, LABEL_GROUP, LEASE_ANNOTATION_RELEASED, LEASE_ANNOTATION_TOKEN
from singleton_election.core.identity import is_predecessor
from singleton_election.core.lock import (
    BackendUnavailable,
    ForceReleaseFailed,
    Identity,
    LockRecord,
    LossCallback,
    Term,
    Token,
)
from singleton_election.core.timings import Timings
from singleton_election.kube import KubeClient, KubeConflict, KubeError, KubeGone, KubeNotFound

log = logging.getLogger(__name__)

WATCH_TIMEOUT = 290.0
"""Seconds one watch request lasts before it is renewed (from the last seen resourceVersion)."""
_BACKOFF_MIN, _BACKOFF_MAX = 0.2, 5.0
_WRITE_RESERVE_MAX = 0.5  # seconds of an acquire's budget kept for the write after waiting
_MAX_CONFLICTS = 3  # renew/release re-read and retry this often while the Lease is still ours
NEWCOMER_DEFERENCE = 0.5
"""Seconds after its first observation of the Lease before a candidate takes a released Lease.
A warm standby's watch sees a release within tens of milliseconds and takes it at once, so
half a second leaves the race to the standbys with room for a slow API server, and still
costs a lone newcomer little."""

Lease = dict[str, Any]


@dataclass(frozen=True)
class Observed:
    """One version of the Lease (``lease`` None: there is none) and when we first saw it."""

    lease: Lease | None
    version: str
    first_seen: float
    holder: Identity | None
    token: Token | None
    duration: float
    transitions: int
    released: bool
    """Holder-less because its holder released it (see the module docstring)."""

    def record(self) -> LockRecord:
        return LockRecord(holder=self.holder, token=self.token, version=self.version)


def annotated_token(obj: dict[str, Any], key: str) -> Token | None:
    """The integer in annotation ``key`` of an object, or None (absent or not an integer)."""
    raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(key)
    with suppress(TypeError, ValueError):
        return Token(int(raw)) if raw is not None else None
    return None


def observed(lease: Lease | None, first_seen: float) -> Observed:
    """Parse a Lease object (``None``: absent) into an observation."""
    if lease is None:
        return Observed(None, "", first_seen, None, None, 0.0, 0, released=False)
    spec = lease.get("spec") or {}
    meta = lease.get("metadata") or {}
    token = annotated_token(lease, LEASE_ANNOTATION_TOKEN)
    holder = spec.get("holderIdentity") or None
    released = holder is None and token is not None and annotated_token(lease, LEASE_ANNOTATION_RELEASED) == token
    return Observed(lease, str(meta.get("resourceVersion", "")), first_seen,
                    Identity(holder) if holder else None, token,
                    float(spec.get("leaseDurationSeconds") or 0), int(spec.get("leaseTransitions") or 0),
                    released=released)


def micro_time(wall: float) -> str:
    """RFC 3339 with microseconds, as Kubernetes ``MicroTime`` is written."""
    return datetime.fromtimestamp(wall, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseBackend:
    """Lock backend for one group on a Kubernetes Lease; see the module docstring."""

    def __init__(
        self,
        *,
        client: KubeClient,
        namespace: str,
        name: str,
        timings: Timings,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        predecessor_prefix: str | None = None,
    ) -> None:
        if not name or not namespace:
            raise ValueError("namespace and name must not be empty")
        self.namespace = namespace
        self.lease_name = name
        self.timings = timings  # checked by Timings itself (core.timings.check_timings)
        self._client = client
        self._clock = clock
        self._wall_clock = wall_clock
        self._predecessor_prefix = predecessor_prefix
        self._collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self._path = f"{self._collection}/{name}"
        self._pods = f"/api/v1/namespaces/{namespace}/pods"
        self._high_water: Token | None = None  # the highest token of the group observed here
        self._pods_read = False  # the group's pod tokens were read (or tried) for a first term
        self._seen: Observed | None = None
        # When a released Lease may be taken here: NEWCOMER_DEFERENCE after our first
        # observation (set then), -inf once a term was held here.
        self._warm_at = math.inf
        # When a holder-less Lease that its holder did not release (or a missing one) may be
        # taken: the expiry of the last term seen here; see the module docstring.
        self._free_at = -math.inf
        self._unexplained_absence = False  # no Lease, and no term seen here before: ask the pods
        self._changed = asyncio.Event()  # set and replaced on every new observation
        self._synced = False  # the watch has listed and is following the Lease
        self._watch_task: asyncio.Task[None] | None = None
        self._term: Term | None = None  # the term held here, if any
        self._held: Lease | None = None  # the Lease as we last wrote it for self._term
        self._on_loss: LossCallback | None = None

    @property
    def lease_duration(self) -> float:
        """Seconds a term stays valid without a renewal (``timings.lease_duration``)."""
        return self.timings.lease_duration

    @property
    def name(self) -> str:
        return "lease"

    def __repr__(self) -> str:
        return (f"<LeaseBackend {self.namespace}/{self.lease_name} synced={self._synced} "
                f"term={self._term and self._term.token}>")

    def set_loss_callback(self, callback: LossCallback) -> None:
        self._on_loss = callback

    def _fields(self, **more: object) -> dict[str, object]:
        """The fields of this backend's log lines: its Lease, then ``more``."""
        return {"lease": f"{self.namespace}/{self.lease_name}", **more}

    # -- the interface ---------------------------------------------------------------

    async def acquire(self, identity: Identity, *, timeout: float) -> Term | LockRecord:
        deadline = self._clock() + timeout
        with self._unavailable("acquire", identity):
            while True:
                seen = await self._wait_takeable(identity, deadline, reserve=min(_WRITE_RESERVE_MAX, timeout / 4))
                if seen is not None:
                    return seen.record()
                # The Lease found takeable, held here: the watch may replace ``self._seen`` while the
                # pods are read below, and a Lease another candidate created meanwhile is not ours
                # to overwrite (the write carries this one's version, or creates: either conflicts).
                takeable = self._seen
                assert takeable is not None
                if takeable.lease is None and self._unexplained_absence:
                    self._unexplained_absence = False
                    if await self._read_pod_tokens(deadline):
                        # No Lease, but a pod says it leads or led: perhaps a deleted Lease whose
                        # holder's app still acts. Wait as for a term renewed just now.
                        self._free_at = self._clock() + self.timings.lease_duration
                        log.warning("no Lease, but a pod of the group carries a token (or the pods could not be "
                                    "read): taking it after the lease duration", extra=self._fields(identity=identity))
                        continue
                    return await self._take(identity, takeable, deadline, pods_read=True)
                return await self._take(identity, takeable, deadline)

    async def _wait_takeable(self, identity: Identity, deadline: float, *, reserve: float) -> Observed | None:
        """None once the Lease is takeable by ``identity`` (``self._seen`` is then the Lease to
        take); the last observation when ``deadline - reserve`` passes first."""
        self.follow()
        if not self._synced or self._seen is None:
            await self._read(deadline)
        stop_waiting, deferred = deadline - reserve, False
        while True:
            changed, seen = self._changed, self._seen
            assert seen is not None
            now = self._clock()
            if self._takeable(seen, identity, now):
                return None
            if now >= stop_waiting:
                return seen
            if seen.released and now < self._warm_at and not deferred:
                deferred = True
                log.info("the Lease was released: leaving it to warm standbys for a while first",
                         extra=self._fields(identity=identity, wait_seconds=round(self._warm_at - now, 3)))
            with suppress(TimeoutError):
                async with asyncio.timeout(min(self._expires_at(seen), stop_waiting) - now):
                    await changed.wait()

    async def renew(self, term: Term, *, timeout: float) -> Term | None:
        deadline = self._clock() + timeout
        with self._unavailable("renew", term.identity, term.token):
            written = await self._rewrite(term, deadline, self._renewed)
        if written is None:
            log.warning("lost the term: the Lease is no longer ours",
                        extra=self._fields(identity=term.identity, token=term.token))
            if self._term is not None and self._term.token == term.token:
                self._term = self._held = None
            return None
        lease, sent = written
        renewed = Term(identity=term.identity, token=term.token, version=observed(lease, 0).version, written_at=sent)
        self._term, self._held = renewed, lease
        log.debug("renewed the Lease", extra=self._fields(identity=term.identity, token=term.token))
        return renewed

    async def release(self, term: Term, *, timeout: float) -> None:
        deadline = self._clock() + timeout
        if self._term is not None and self._term.token == term.token:
            self._term = None  # from now on our own release is no loss
        try:
            with self._unavailable("release", term.identity, term.token):
                written = await self._rewrite(term, deadline, self._released)
        finally:
            self._held = None
        if written is None:
            log.debug("release: the Lease is not ours any more",
                      extra=self._fields(identity=term.identity, token=term.token))
        else:
            log.info("released the Lease", extra=self._fields(identity=term.identity, token=term.token))

    async def observe(self, *, timeout: float) -> LockRecord:
        with self._unavailable("observe"):
            return (await self._read(self._clock() + timeout)).record()

    def follow(self) -> None:
        """Start watching the Lease (idempotent), so its expiry counts from when it last
        changed, not from our next ``acquire``. ``acquire`` calls it too."""
        self._start_watch()

    async def close(self) -> None:
        task, self._watch_task = self._watch_task, None
        self._synced = False
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # close() itself was cancelled

    # -- decisions -------------------------------------------------------------------

    def _expires_at(self, seen: Observed) -> float:
        if seen.holder is None:
            return self._warm_at if seen.released else self._free_at
        return self._term_expiry(seen)

    def _term_expiry(self, seen: Observed) -> float:
        """When the held term ``seen`` expires if its holder renews no more."""
        return seen.first_seen + max(self.timings.lease_duration, seen.duration)

    def _takeable(self, seen: Observed, identity: Identity, now: float) -> bool:
        if is_predecessor(seen.holder, identity, self._predecessor_prefix):
            return True  # logged by _take: this is asked on every wake-up, with both twice a takeover
        return seen.holder == identity or now >= self._expires_at(seen)

    def _next_token(self, seen: Observed) -> Token:
        """The hybrid logical clock: above the Lease's token, the wall clock and every token seen."""
        floors = [1, int(self._wall_clock() * 1000)]
        floors += [known + 1 for known in (seen.token, self._high_water) if known is not None]
        return Token(max(floors))

    def _note(self, token: Token | None) -> None:
        """Raise the high-water mark to ``token``."""
        if token is not None and (self._high_water is None or token > self._high_water):
            self._high_water = token

    # -- writes ----------------------------------------------------------------------

    async def _take(self, identity: Identity, seen: Observed, deadline: float, *,
                    pods_read: bool = False) -> Term | LockRecord:
        """Begin a term on the observed Lease (or create it); a lost race returns the record.
        ``pods_read``: the pods' tokens were read for this very take."""
        if (seen.lease is None or not self._pods_read) and not pods_read:
            await self._read_pod_tokens(deadline)
        if is_predecessor(seen.holder, identity, self._predecessor_prefix):
            log.info("taking over from this pod's own earlier incarnation",
                     extra=self._fields(identity=identity, previous_holder=seen.holder))
        token, stamp = self._next_token(seen), micro_time(self._wall_clock())
        lease: Lease = copy.deepcopy(seen.lease) if seen.lease is not None else {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": self.lease_name, "namespace": self.namespace}, "spec": {}}
        annotations = lease["metadata"].setdefault("annotations", {})
        annotations[LEASE_ANNOTATION_TOKEN] = str(token)
        annotations.pop(LEASE_ANNOTATION_RELEASED, None)
        transitions = seen.transitions + (1 if seen.lease is not None and seen.holder != identity else 0)
        lease["spec"].update(holderIdentity=identity, leaseDurationSeconds=self._seconds(), acquireTime=stamp,
                             renewTime=stamp, leaseTransitions=transitions)
        sent = self._clock()
        try:
            if seen.lease is None:
                written = await self._client.request("POST", self._collection, body=lease,
                                                     timeout=self._left(deadline))
            else:
                written = await self._client.request("PUT", self._path, body=lease, timeout=self._left(deadline))
        except KubeNotFound:
            if seen.lease is None:
                raise  # no namespace
            now = self._observe(None)
        except KubeConflict as exc:
            log.info("lost the race for the Lease",
                     extra=self._fields(identity=identity, token=token, reason=exc.reason))
            now = await self._read(deadline)
            if now.lease is not None or seen.lease is None:
                return now.record()
        else:
            return self._began(Term(identity=identity, token=token, version=observed(written, 0).version,
                                    written_at=sent), written, transitions)
        # The Lease was deleted since we saw it (a PUT on a deleted Lease answers 409 or 404): create it.
        return await self._take(identity, now, deadline)

    def _began(self, term: Term, written: Lease, transitions: int) -> Term:
        self._term, self._held = term, written
        self._warm_at = -math.inf  # a process that held a term here is no newcomer
        self._observe(written)
        log.info("acquired the Lease",
                 extra=self._fields(identity=term.identity, token=term.token, transitions=transitions))
        return term

    async def _rewrite(
        self, term: Term, deadline: float, change: Callable[[Lease], None]
    ) -> tuple[Lease, float] | None:
        """PUT our Lease changed by ``change``, conditional on its version; None when it is not ours."""
        mine = observed(self._held, 0)  # the Lease as we last wrote it, if it is this term's
        ours = (mine.version, mine.holder, mine.token) == (term.version, term.identity, term.token)
        base = mine.lease if ours else None
        for _ in range(_MAX_CONFLICTS):
            if base is None:
                try:
                    seen = await self._read(deadline, missing_ok=False)
                except KubeNotFound:
                    return None
                if seen.lease is None or seen.holder != term.identity or seen.token != term.token:
                    return None
                base = seen.lease
            lease = copy.deepcopy(base)
            change(lease)
            sent = self._clock()
            try:
                written = await self._client.request("PUT", self._path, body=lease, timeout=self._left(deadline))
            except KubeConflict:
                base = None
                continue
            except KubeNotFound:
                return None
            self._observe(written)
            return written, sent
        raise BackendUnavailable(f"lease {self.namespace}/{self.lease_name}: writes of token {term.token} "
                                 f"conflicted {_MAX_CONFLICTS} times in a row")

    async def _read_pod_tokens(self, deadline: float) -> bool:
        """Add the tokens on the group's pods to the high-water mark; a failure is only logged.
        True when a pod carries a token (or the pods could not be read)."""
        selector = {"labelSelector": f"{LABEL_GROUP}={self.lease_name}"}
        self._pods_read = True
        try:
            pods = await self._client.request("GET", self._pods, params=selector,
                                              timeout=self._left(deadline) / 2)
        except KubeError as exc:
            log.warning("cannot read the tokens on the group's pods: the next token is "
                        "above the wall clock and the tokens seen here only", extra=self._fields(error=exc))
            return True
        claimed = False
        for pod in pods.get("items") or []:
            if isinstance(pod, dict):
                token = annotated_token(pod, ANNOTATION_TOKEN)
                self._note(token)
                claimed = claimed or token is not None
        return claimed

    def _renewed(self, lease: Lease) -> None:
        lease["spec"].update(renewTime=micro_time(self._wall_clock()), leaseDurationSeconds=self._seconds())

    def _released(self, lease: Lease) -> None:
        token = annotated_token(lease, LEASE_ANNOTATION_TOKEN)
        lease["metadata"].setdefault("annotations", {})[LEASE_ANNOTATION_RELEASED] = str(token)
        lease["spec"].update(holderIdentity="", leaseDurationSeconds=1, renewTime=micro_time(self._wall_clock()))

    def _seconds(self) -> int:
        return max(1, math.ceil(self.timings.lease_duration))

    # -- reads and the watch ---------------------------------------------------------

    async def _read(self, deadline: float, *, missing_ok: bool = True) -> Observed:
        try:
            lease: Lease | None = await self._client.request("GET", self._path, timeout=self._left(deadline))
        except KubeNotFound:
            if not missing_ok:
                raise
            lease = None
        return self._observe(lease)

    def _observe(self, lease: Lease | None, *, deleted: bool = False) -> Observed:
        """Record what we saw; a new version restarts the expiry count and wakes waiters."""
        seen, now = self._seen, observed(lease, self._clock())
        self._note(now.token)
        if seen is None:  # our first observation of the Lease
            self._warm_at = now.first_seen + NEWCOMER_DEFERENCE
        if seen is None or seen.version != now.version or (lease is None) != (seen.lease is None):
            self._note_absence(seen, now)
            seen = self._seen = now
            self._changed.set()
            self._changed = asyncio.Event()
            self._check_loss(seen, deleted=deleted)
        return seen

    def _note_absence(self, before: Observed | None, now: Observed) -> None:
        """Keep ``_free_at`` for a Lease that is now holder-less without its holder's release, or gone."""
        if now.holder is not None or now.released:
            self._free_at, self._unexplained_absence = -math.inf, False
        elif before is not None and before.holder is not None:
            self._free_at = self._term_expiry(before)  # as if that holder had crashed after its last renewal
        elif before is None and now.lease is not None:
            self._free_at = self._term_expiry(now)  # cleared before we came: count from now
        elif before is None:
            self._unexplained_absence = True
        # Otherwise it was free or waiting already: keep what was decided.

    def _check_loss(self, seen: Observed, *, deleted: bool) -> None:
        """The watch shows a newer term than ours (or the Lease deleted): report the loss at once."""
        term = self._term
        if term is None:
            return
        if deleted:
            reason = "the Lease was deleted"
        elif seen.token is not None and (seen.token > term.token
                                         or (seen.token == term.token and seen.holder != term.identity)):
            reason = f"the Lease names {seen.holder or 'nobody'} with token {seen.token}"
        else:
            return  # our own write, or an older version than ours
        self._term = self._held = None
        log.warning("lost the term", extra=self._fields(identity=term.identity, token=term.token, reason=reason))
        if self._on_loss is not None:
            try:
                self._on_loss(reason)
            except Exception:
                log.exception("loss callback failed", extra=self._fields())

    def _start_watch(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(
                self._watch_forever(), name=f"lease-watch {self.namespace}/{self.lease_name}")

    async def _watch_forever(self) -> None:
        """List, then watch from the list's version; on trouble back off and list again."""
        backoff, version = _BACKOFF_MIN, ""
        while True:
            try:
                if not version:
                    version = await self._list()
                    self._synced = True
                version = await self._follow(version)
                backoff = _BACKOFF_MIN
                continue
            except KubeGone:
                log.debug("watch expired (410), listing again", extra=self._fields())
                version = ""
                continue
            except KubeError as exc:
                log.warning("watch failed; retrying", extra=self._fields(error=exc, retry_seconds=backoff))
            except Exception:
                log.exception("watch failed; retrying", extra=self._fields(retry_seconds=backoff))
            self._synced, version = False, ""
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX)

    async def _list(self) -> str:
        listing = await self._client.request("GET", self._collection, params=self._selector(),
                                             timeout=_BACKOFF_MAX * 2)
        items = listing.get("items") or []
        self._observe(items[0] if items else None)
        return str((listing.get("metadata") or {}).get("resourceVersion", ""))

    async def _follow(self, version: str) -> str:
        """Follow the watch until it ends; return the last resourceVersion seen."""
        params = {**self._selector(), "resourceVersion": version, "allowWatchBookmarks": "true"}
        async with aclosing(self._client.watch(self._collection, params=params, timeout=WATCH_TIMEOUT)) as events:
            async for kind, lease in events:
                version = str((lease.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "DELETED":
                    self._note(annotated_token(lease, LEASE_ANNOTATION_TOKEN))  # its last state
                    self._observe(None, deleted=True)
                elif kind in ("ADDED", "MODIFIED"):
                    self._observe(lease)
        return version

    def _selector(self) -> dict[str, str]:
        return {"fieldSelector": f"metadata.name={self.lease_name}"}

    # -- helpers ---------------------------------------------------------------------

    def _left(self, deadline: float) -> float:
        return max(0.001, deadline - self._clock())

    @contextmanager
    def _unavailable(self, what: str, identity: Identity | None = None, token: Token | None = None) -> Iterator[None]:
        """API errors other than a lost race become BackendUnavailable, chained."""
        try:
            yield
        except KubeError as exc:
            log.warning("%s failed", what, extra=self._fields(identity=identity, token=token, error=exc))
            raise BackendUnavailable(f"lease {self.namespace}/{self.lease_name}: {what} failed: {exc}") from exc


async def force_release(client: KubeClient, namespace: str, name: str, *, timeout: float, attempts: int = 3) -> str:
    """Clear the Lease's holder on an operator's say-so (``kubectl singleton release``); returns
    what was done, in words. Without the released mark (``LEASE_ANNOTATION_RELEASED``): nothing
    says the holder's app has stopped, so a standby takes the Lease only once the last term
    would have expired had its holder crashed (``LeaseBackend._takeable``). A holder renewing
    meanwhile makes the write a 409: read again, ``attempts`` times in all."""
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
    for _ in range(attempts):
        try:
            lease = await client.request("GET", path, timeout=timeout)
        except KubeNotFound:
            return "no Lease to release"
        except KubeError as exc:
            raise ForceReleaseFailed(f"cannot read Lease {namespace}/{name}: {exc}") from None
        holder = (lease.get("spec") or {}).get("holderIdentity")
        if not holder:
            return "the Lease had no holder"
        lease["spec"]["holderIdentity"] = None
        try:
            await client.request("PUT", path, body=lease, timeout=timeout)
        except KubeConflict:
            continue
        except KubeError as exc:
            raise ForceReleaseFailed(f"cannot update Lease {namespace}/{name}: {exc}") from None
        return f"cleared Lease holder {holder}"
    raise ForceReleaseFailed(f"Lease {namespace}/{name} changed {attempts} times while clearing it; try again")
