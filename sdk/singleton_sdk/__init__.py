"""kube-singleton's SDK for apps beside the sidecar (cooperative gating).

    from singleton_sdk import leadership

    async with leadership() as term:        # waits until this replica leads
        await work(term)                    # cancelled as soon as the term ends or starts ending

``singleton_sdk.sync`` is the threaded twin; ``singleton_sdk.asyncpg``, ``.psycopg`` and
``.sqlalchemy`` make fenced writes (each needs its extra). The sidecar's URLs come from
``$SINGLETON_LEADER_URL`` and ``$SINGLETON_CONTROL_URL``, which the operator sets.
"""

from typing import TYPE_CHECKING, Any

from singleton_sdk.fence import FENCE_DDL, StaleToken
from singleton_sdk.term import Leadership, SidecarError, Term

if TYPE_CHECKING:
    from singleton_sdk.client import (
        DEFAULT_CONTROL_URL,
        DEFAULT_LEADER_URL,
        ENV_CONTROL_URL,
        ENV_LEADER_URL,
        LeaderClient,
        LeadershipLost,
        Leading,
        leadership,
        run_while_leading,
        uninterrupted,
    )

_CLIENT_NAMES = frozenset({"DEFAULT_CONTROL_URL", "DEFAULT_LEADER_URL", "ENV_CONTROL_URL", "ENV_LEADER_URL",
                           "LeaderClient", "LeadershipLost", "Leading", "leadership", "run_while_leading",
                           "uninterrupted"})


def __getattr__(name: str) -> Any:
    """The client's names, imported when first asked for: the client loads aiohttp, which a
    process that only makes fenced writes (``singleton_sdk.asyncpg``) need not wait for."""
    if name in _CLIENT_NAMES:
        from singleton_sdk import client

        return getattr(client, name)
    raise AttributeError(f"module 'singleton_sdk' has no attribute {name!r}")


__all__ = [
    "DEFAULT_CONTROL_URL",
    "DEFAULT_LEADER_URL",
    "ENV_CONTROL_URL",
    "ENV_LEADER_URL",
    "FENCE_DDL",
    "LeaderClient",
    "Leadership",
    "LeadershipLost",
    "Leading",
    "SidecarError",
    "StaleToken",
    "Term",
    "leadership",
    "run_while_leading",
    "uninterrupted",
]
