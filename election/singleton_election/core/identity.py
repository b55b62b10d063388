"""Candidate identities: unique per process incarnation, never just a hostname or PID."""

from __future__ import annotations

import re
import secrets

from singleton_election.core.lock import Identity

_ALLOWED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,251}")


def make_identity(*, pod_name: str | None, pod_uid: str | None, hostname: str, pid: int,
                  nonce: str | None = None) -> Identity:
    """``<pod name>/<first 8 of pod UID>/<nonce>`` in a pod, ``<host>/<pid>/<nonce>`` outside.

    The nonce is new on every start, so a restarted container never inherits the term
    of its previous incarnation.
    """
    start_nonce = nonce or secrets.token_hex(4)
    if pod_name:
        return Identity(f"{pod_prefix(pod_name, pod_uid)}{start_nonce}")
    return Identity(f"{hostname}/{pid}/{start_nonce}")


def pod_prefix(pod_name: str, pod_uid: str | None) -> str:
    """``<pod name>/<first 8 of pod UID>/``: what every incarnation's identity in that pod begins with."""
    uid = (pod_uid or "nouid").replace("-", "")[:8]
    return f"{pod_name}/{uid}/"


def is_predecessor(holder: str | None, identity: str, prefix: str | None) -> bool:
    """Whether ``holder`` is an earlier incarnation of the candidate ``identity`` in the same pod.

    ``prefix`` is the pod's (``pod_prefix``), given only when this candidate is the sole
    candidate of its group in its pod: the kubelet never runs two incarnations of one container
    at once, so a holder of this pod with another identity is dead, and the only app that can
    still act for its term is this pod's own."""
    return (prefix is not None and holder is not None and holder != identity
            and holder.startswith(prefix) and identity.startswith(prefix))


def validate_identity(value: str) -> Identity:
    if not _ALLOWED.fullmatch(value):
        raise ValueError(
            "identity must be 1-252 characters of letters, digits and . _ : / -, starting with a letter or digit"
        )
    return Identity(value)


def pod_of(identity: str) -> str:
    """The pod name part of an identity made by ``make_identity`` inside a pod."""
    return identity.split("/", 1)[0]
