"""The campaign's eyes: a thread that polls every pod's sidecar ``/readyz`` over its pod IP, as
a kubelet's readiness probe would, and records who answered ready with which term token.

Each pod is polled on its own (a SIGSTOPped or partitioned pod only delays its own answers),
every ``slow`` seconds between faults and every ``fast`` seconds while one is being measured.
A ``200`` from ``/readyz`` is followed by ``GET /leader`` for the term's token; a sample counts
as ready only when both say so. Times are wall-clock seconds (``time.time()``), comparable with
the ledger's timestamps (same machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass

import aiohttp

PORT = 8080


@dataclass(frozen=True)
class Sample:
    pod: str
    sent: float
    received: float
    status: int | None
    """``/readyz``'s status; None when the pod did not answer in time."""
    token: int | None
    """The term's token when ready."""

    @property
    def ready(self) -> bool:
        return self.status == 200 and self.token is not None


class Poller:
    def __init__(self, *, slow: float = 0.1, fast: float = 0.01, timeout: float = 0.25, port: int = PORT) -> None:
        self.slow, self.fast, self.timeout, self.port = slow, fast, timeout, port
        self._interval = slow
        self._targets: dict[str, str] = {}
        self._latest: dict[str, Sample] = {}
        self._ready: list[Sample] = []
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<Poller pods={sorted(self._targets)} interval={self._interval}>"

    # --- control (any thread) -------------------------------------------------------------

    def start(self) -> Poller:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="campaign-poller",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(10)

    def watch(self, pod: str, ip: str) -> None:
        with self._cond:
            self._targets[pod] = ip

    def forget(self, pod: str) -> None:
        with self._cond:
            self._targets.pop(pod, None)
            self._latest.pop(pod, None)

    def forget_all(self) -> None:
        with self._cond:
            self._targets.clear()
            self._latest.clear()
            self._ready.clear()

    def set_fast(self, fast: bool) -> None:
        self._interval = self.fast if fast else self.slow

    # --- reading ----------------------------------------------------------------------------

    def latest(self) -> dict[str, Sample]:
        with self._cond:
            return dict(self._latest)

    def leader(self, fresh: float = 0.5) -> Sample | None:
        """The pod answering ready most recently (the greatest token if several do)."""
        now = time.time()
        ready = [s for s in self.latest().values() if s.ready and now - s.received < fresh]
        return max(ready, key=lambda s: s.token or 0) if ready else None

    def settled(self, pods: set[str], since: float = 0.0) -> Sample | None:
        """The leader once every pod of ``pods`` answered after ``since`` (200 or 503, fresh),
        and exactly one answered ready."""
        now = time.time()
        latest = self.latest()
        if set(latest) != pods:
            return None
        for sample in latest.values():
            if sample.status not in (200, 503) or sample.sent < since or now - sample.received > 1.0:
                return None
        ready = [s for s in latest.values() if s.ready]
        return ready[0] if len(ready) == 1 and len([s for s in latest.values() if s.status == 200]) == 1 else None

    def first_ready(self, after: float, above: int | None) -> Sample | None:
        with self._cond:
            return self._first_ready(after, above)

    def _first_ready(self, after: float, above: int | None) -> Sample | None:
        for sample in self._ready:
            if sample.sent >= after and (above is None or (sample.token or 0) > above):
                return sample
        return None

    def last_ready(self, pod: str, after: float) -> Sample | None:
        """``pod``'s last ready sample sent at or after ``after``."""
        with self._cond:
            return next((s for s in reversed(self._ready) if s.pod == pod and s.sent >= after), None)

    def wait_ready(self, after: float, above: int | None, timeout: float) -> Sample | None:
        """The first ready sample sent at or after ``after`` (with a token above ``above``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (found := self._first_ready(after, above)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.1))
            return found

    # --- the thread -------------------------------------------------------------------------

    def _record(self, sample: Sample) -> None:
        with self._cond:
            if sample.pod not in self._targets:
                return
            self._latest[sample.pod] = sample
            if sample.ready:
                self._ready.append(sample)
                if len(self._ready) > 20000:
                    cutoff = time.time() - 300
                    self._ready = [s for s in self._ready if s.sent >= cutoff]
            self._cond.notify_all()

    async def _main(self) -> None:
        tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            try:
                while not self._stopping.is_set():
                    with self._cond:
                        wanted = set(self._targets.items())
                    for key in wanted - set(tasks):
                        tasks[key] = asyncio.create_task(self._poll(session, *key))
                    for key in set(tasks) - wanted:
                        tasks.pop(key).cancel()
                    await asyncio.sleep(0.02)
            finally:
                for task in tasks.values():
                    task.cancel()
                for task in tasks.values():
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def _poll(self, session: aiohttp.ClientSession, pod: str, ip: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        base = f"http://{ip}:{self.port}"
        while True:
            sent = time.time()
            status: int | None = None
            token: int | None = None
            try:
                async with session.get(base + "/readyz", timeout=timeout) as response:
                    await response.read()
                    status = response.status
                if status == 200:
                    async with session.get(base + "/leader", timeout=timeout) as response:
                        doc = await response.json()
                    token = doc.get("token") if doc.get("ready") else None
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                pass
            self._record(Sample(pod, sent, time.time(), status, token))
            await asyncio.sleep(self._interval)
