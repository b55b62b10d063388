"""The clock the core reads and sleeps on, injected so unit tests run on fake time."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (local deadlines only)."""
        ...

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        """Wait until ``event`` is set or ``timeout`` seconds pass; True if it was set."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        if event.is_set():
            return True
        if timeout <= 0:
            return False
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return False
        return True
