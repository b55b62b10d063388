"""What every process of the project parses the same way from its flags and environment: the
error a bad setting raises, and listen addresses (``host:port``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


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
