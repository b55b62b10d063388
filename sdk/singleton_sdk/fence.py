"""The fence every driver module shares: one table, one statement, one error.

A fenced write runs in a transaction whose first statement raises the group's row in
``singleton_fence`` to the writer's token, or finds a greater token there and refuses. The
upsert takes the row's lock, so a stale writer racing a newer one waits for the newer commit
and is then refused: the check and the writes commit together or not at all.
"""

from __future__ import annotations

FENCE_DDL = """
CREATE TABLE IF NOT EXISTS singleton_fence (
    group_name text PRIMARY KEY,
    token bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
)
"""

_FENCE = """
INSERT INTO singleton_fence AS f (group_name, token) VALUES ({key}, {token})
ON CONFLICT (group_name) DO UPDATE SET token = EXCLUDED.token, updated_at = now()
    WHERE f.token <= EXCLUDED.token
RETURNING token
"""

_SEEN = "SELECT token FROM singleton_fence WHERE group_name = {key}"


def fence_sql(*, key: str, token: str) -> str:
    """The fence statement with the driver's placeholders for the key and the token."""
    return _FENCE.format(key=key, token=token)


def seen_sql(*, key: str) -> str:
    """The statement that reads the token a refused writer lost to."""
    return _SEEN.format(key=key)


class StaleToken(Exception):
    """A write carried a token older than one the fence has already seen."""

    def __init__(self, key: str, token: int, seen: int | None) -> None:
        super().__init__(f"group {key}: token {token} is stale (the fence has seen {seen})")
        self.key = key
        self.token = token
        self.seen = seen


NOT_IN_TRANSACTION = "fence() must run inside the transaction that makes the fenced write"
