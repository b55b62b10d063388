"""The groups marked for a status refresh, shared by the reconciler (groups.py), which marks a
group when its reconcile ends and forgets it when it is deleted, the kopf handlers, which mark
it on a pod or Deployment event, and the refresher (refresher.py), which serves the marks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from singleton_operator.listing import GroupKey


@dataclass
class RefreshMarks:
    pending: dict[GroupKey, None] = field(default_factory=dict)
    """The groups marked for a refresh, in the order they were first marked (served in it:
    in a burst, the groups created first get their status first)."""
    deferred_since: dict[GroupKey, float] = field(default_factory=dict)
    """When the refresh of a marked group in a reconcile was first put off."""
    forgotten: set[GroupKey] = field(default_factory=set)
    """Groups deleted since the periodic pass began (its listing may still show them)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a group is marked: the refresher sleeps until then."""

    def mark(self, namespace: str, name: str) -> None:
        """Refresh this group's status soon."""
        self.pending.setdefault((namespace, name))
        self.wake.set()

    def marked(self) -> frozenset[GroupKey]:
        """The groups the refresher refreshes next."""
        return frozenset(self.pending)

    def forget(self, key: GroupKey) -> None:
        """The group was deleted: no refresh for it, and none from a listing older than that."""
        self.pending.pop(key, None)
        self.deferred_since.pop(key, None)
        self.forgotten.add(key)
