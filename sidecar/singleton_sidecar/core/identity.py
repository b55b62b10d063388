"""Candidate identities: unique per process incarnation, never just a hostname or PID."""

from __future__ import annotations

import re
import secrets

from singleton_sidecar.core.lock import Identity

_ALLOWED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,251}")


def make_identity(*, pod_name: str | None, pod_uid: str | None, hostname: str, pid: int,
                  nonce: str | None = None) -> Identity:
    """``<pod name>/<first 8 of pod UID>/<nonce>`` in a pod, ``<host>/<pid>/<nonce>`` outside.

    The nonce is new on every start, so a restarted container never inherits the term
    of its previous incarnation.
    """
    start_nonce = nonce or secrets.token_hex(4)
    if pod_name:
        uid = (pod_uid or "nouid").replace("-", "")[:8]
        return Identity(f"{pod_name}/{uid}/{start_nonce}")
    return Identity(f"{hostname}/{pid}/{start_nonce}")


def validate_identity(value: str) -> Identity:
    if not _ALLOWED.fullmatch(value):
        raise ValueError(
            "identity must be 1-252 characters of letters, digits and . _ : / -, starting with a letter or digit"
        )
    return Identity(value)


def pod_of(identity: str) -> str:
    """The pod name part of an identity made by ``make_identity`` inside a pod."""
    return identity.split("/", 1)[0]
