"""What every process of the project parses the same way from its flags and environment: the
error a bad setting raises, listen addresses (``host:port``), seconds, booleans and a choice
among names. Each parser takes the setting's name (flag and variable) and its raw text, and
raises ``ConfigError`` starting with that name."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

Name = TypeVar("Name", bound=str)


class ConfigError(ValueError):
    """A bad or missing setting; the message starts with the setting's name."""


@dataclass(frozen=True)
class Listen:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_listen(name: str, raw: str, *, loopback_only: bool = False) -> Listen:
    """``host:port`` (IPv6 in brackets), port 0-65535; ``loopback_only``: a loopback address or
    ``localhost`` (control actions). ``name`` (flag and variable) starts the error's message."""
    host, sep, port_text = raw.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{name}: must be host:port, got {raw!r}")
    host = host.strip("[]")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{name}: port must be a number from 0 to 65535, got {port_text!r}")
    if loopback_only and host != "localhost":
        try:
            is_loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            is_loopback = False
        if not is_loopback:
            raise ConfigError(f"{name}: control actions must listen on loopback only, got host {host!r}")
    return Listen(host, int(port_text))


def parse_positive_seconds(name: str, raw: str) -> float:
    """A finite number of seconds above 0 (``inf`` and ``nan`` refused)."""
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}: must be a number of seconds, got {raw!r}") from None
    if not (0 < value < float("inf")):
        raise ConfigError(f"{name}: must be a positive number of seconds, got {raw!r}")
    return value


def parse_bool(name: str, raw: str) -> bool:
    """``1 true yes on`` or ``0 false no off`` (any case, surrounding spaces ignored); empty is false."""
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}: must be true or false, got {raw!r}")


def parse_choice(name: str, raw: str, choices: Sequence[Name]) -> Name:
    """One of ``choices``, exactly (case and spaces count); the error lists them: "a, b or c"."""
    for choice in choices:
        if raw == choice:
            return choice
    listed = ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else "".join(choices)
    raise ConfigError(f"{name}: must be {listed}, got {raw!r}")
