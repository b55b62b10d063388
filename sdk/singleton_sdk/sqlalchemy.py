"""Fenced writes with SQLAlchemy 2 on PostgreSQL, for a ``Session`` or a ``Connection``
(``pip install 'kube-singleton-sdk[sqlalchemy]'``).

    with fenced(session, term):             # session.begin(): commits at the end of the block
        session.add(Result(...))

``fence`` is the statement alone, for a transaction you manage yourself (SQLAlchemy begins
one with the first statement, unless the engine's isolation level is ``AUTOCOMMIT``, which
is refused: the fence would commit on its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

from sqlalchemy import Connection, text
from sqlalchemy.orm import Session

from singleton_sdk.fence import FENCE_DDL, NOT_IN_TRANSACTION, StaleToken, fence_sql, seen_sql
from singleton_sdk.term import Term

__all__ = ["StaleToken", "ensure_fence_table", "fence", "fenced"]

Bind = TypeVar("Bind", Session, Connection)

_FENCE = text(fence_sql(key=":key", token=":token"))
_SEEN = text(seen_sql(key=":key"))


def _connection(bind: Session | Connection) -> Connection:
    return bind.connection() if isinstance(bind, Session) else bind


def ensure_fence_table(bind: Session | Connection) -> None:
    """Create the fence table if it is missing (in the current transaction; commit it)."""
    bind.execute(text(FENCE_DDL))


def fence(bind: Session | Connection, *, key: str, token: int) -> None:
    """In the transaction of the fenced writes: ``StaleToken`` unless ``token`` is the newest
    the group's fence ``key`` (``Term.key``) has seen."""
    # The driver's connection tells, whichever way AUTOCOMMIT was asked for (engine, execution options).
    if getattr(_connection(bind).connection.dbapi_connection, "autocommit", False):
        raise RuntimeError(NOT_IN_TRANSACTION)
    params = {"key": key, "token": token}
    if bind.execute(_FENCE, params).first() is None:
        seen = bind.execute(_SEEN, params).first()
        raise StaleToken(key, token, None if seen is None else int(seen[0]))


@contextlib.contextmanager
def fenced(bind: Bind, term: Term) -> Iterator[Bind]:
    """A transaction (``bind.begin()``, so none may be open yet) whose writes commit only if
    no newer term has written (``StaleToken``, and nothing commits)."""
    with bind.begin():
        fence(bind, key=term.key, token=term.token)
        yield bind
