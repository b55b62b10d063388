"""Probes and lifecycle hooks of the stand-in kubelet: ``exec``, ``httpGet``, ``tcpSocket``
(and the hooks' ``sleep``), with the kubelet's timing and threshold rules.

Called by ``kubelet_pods``: one ``Prober`` per running container. HTTP and TCP checks go from
the host to the pod's IP, as the kubelet's do; ``exec`` runs inside the container's
namespaces (``kubelet_runtime.spawn_in``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from singleton_testbed.kubelet_runtime import StartError, run_to_completion, spawn_in

log = logging.getLogger(__name__)

Obj = dict[str, Any]
HANDLERS = ("exec", "httpGet", "tcpSocket", "grpc", "sleep")


@dataclass(frozen=True)
class Probe:
    """A probe's settings with the API's defaults."""

    handler: Obj
    initial_delay: float = 0
    period: float = 10
    timeout: float = 1
    success_threshold: int = 1
    failure_threshold: int = 3
    termination_grace: float | None = None

    @classmethod
    def parse(cls, spec: Obj | None) -> Probe | None:
        if not spec:
            return None
        grace = spec.get("terminationGracePeriodSeconds")
        return cls(
            handler={k: v for k, v in spec.items() if k in HANDLERS},
            initial_delay=float(spec.get("initialDelaySeconds", 0)), period=float(spec.get("periodSeconds", 10)),
            timeout=float(spec.get("timeoutSeconds", 1)), success_threshold=int(spec.get("successThreshold", 1)),
            failure_threshold=int(spec.get("failureThreshold", 3)),
            termination_grace=None if grace is None else float(grace),
        )


@dataclass(frozen=True)
class Target:
    """Where a container's handlers run: its pod's IP, its main process, its spec and env."""

    pod_ip: str
    pid: int
    container: Obj
    env: dict[str, str]
    http: aiohttp.ClientSession

    def port(self, value: int | str) -> int:
        """A port number, or a named port of the container."""
        if isinstance(value, int) or str(value).isdigit():
            return int(value)
        for port in self.container.get("ports") or []:
            if port.get("name") == value:
                return int(port["containerPort"])
        raise ValueError(f"container {self.container['name']!r} has no port named {value!r}")


async def run_handler(handler: Obj, target: Target, timeout: float) -> tuple[bool, str]:
    """Run one probe or hook handler; (success, why not)."""
    try:
        if "exec" in handler:
            return await _exec(handler["exec"], target, timeout)
        if "httpGet" in handler:
            return await _http_get(handler["httpGet"], target, timeout)
        if "tcpSocket" in handler:
            return await _tcp(handler["tcpSocket"], target, timeout)
        if "sleep" in handler:
            await asyncio.sleep(min(float(handler["sleep"]["seconds"]), timeout))
            return True, ""
    except (OSError, ValueError, aiohttp.ClientError, TimeoutError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return False, f"unsupported handler {sorted(handler)}"


async def _exec(action: Obj, target: Target, timeout: float) -> tuple[bool, str]:
    try:
        handle = spawn_in(target.pid, list(action.get("command") or []), env=target.env,
                          working_dir=target.container.get("workingDir"))
    except StartError as exc:
        return False, str(exc)
    code = await run_to_completion(handle, timeout)
    if code is None:
        return False, f"command timed out after {timeout:g}s"
    return code == 0, f"command exited with {code}"


async def _http_get(action: Obj, target: Target, timeout: float) -> tuple[bool, str]:
    scheme = str(action.get("scheme", "HTTP")).lower()
    host = action.get("host") or target.pod_ip
    path = action.get("path") or "/"
    url = f"{scheme}://{host}:{target.port(action['port'])}{path if path.startswith('/') else '/' + path}"
    headers = {"User-Agent": "kube-probe/1.34", **{h["name"]: h["value"] for h in action.get("httpHeaders") or []}}
    async with target.http.get(url, headers=headers, ssl=False, allow_redirects=False,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        await resp.read()
        return 200 <= resp.status < 400, f"HTTP probe failed with statuscode: {resp.status}"


async def _tcp(action: Obj, target: Target, timeout: float) -> tuple[bool, str]:
    host = action.get("host") or target.pod_ip
    async with asyncio.timeout(timeout):
        _, writer = await asyncio.open_connection(host, target.port(action["port"]))
    writer.close()
    await writer.wait_closed()
    return True, ""


class Prober:
    """Runs one probe of a running container on its schedule and reports state changes."""

    def __init__(self, kind: str, probe: Probe, target: Target, started_at: float) -> None:
        self.kind, self.probe, self.target, self.started_at = kind, probe, target, started_at
        self._successes = 0
        self._failures = 0

    async def _wait_initial_delay(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, self.started_at + self.probe.initial_delay - loop.time()))

    async def _once(self) -> tuple[bool, str]:
        ok, why = await run_handler(self.probe.handler, self.target, self.probe.timeout)
        if ok:
            self._successes, self._failures = self._successes + 1, 0
        else:
            self._successes, self._failures = 0, self._failures + 1
            log.debug("%s probe failed container=%s: %s", self.kind, self.target.container["name"], why)
        return ok, why

    async def until_started(self) -> bool:
        """A startup probe: True once it succeeds, False when it has failed ``failureThreshold`` times."""
        await self._wait_initial_delay()
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            ok, _ = await self._once()
            if ok:
                return True
            if self._failures >= self.probe.failure_threshold:
                return False
            await asyncio.sleep(max(0.0, began + self.probe.period - loop.time()))

    async def watch(self, initial: bool, on_change: Callable[[bool, str], None]) -> None:
        """Liveness or readiness: call ``on_change`` when the thresholds flip the result."""
        await self._wait_initial_delay()
        loop = asyncio.get_running_loop()
        state = initial
        while True:
            began = loop.time()
            _, why = await self._once()
            if not state and self._successes >= self.probe.success_threshold:
                state = True
                on_change(True, "")
            elif state and self._failures >= self.probe.failure_threshold:
                state = False
                on_change(False, why)
            await asyncio.sleep(max(0.0, began + self.probe.period - loop.time()))
