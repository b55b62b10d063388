"""What the sidecar says (``GET /leader``) and this replica's term, as the SDK hands them out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class SidecarError(Exception):
    """The sidecar answered something the SDK cannot use, or refused what the SDK needs (a
    sidecar of another release, a control URL that is not this pod's sidecar, a gate mode
    other than cooperative)."""


@dataclass(frozen=True)
class Term:
    """One term of this replica: the group, its identity and the fencing token."""

    group: str
    identity: str
    token: int
    fence_key: str = ""
    """The group's key for fenced writes (``<namespace>/<group>`` in a cluster); empty: the group."""

    @property
    def key(self) -> str:
        """The key of the group's row in the fence table."""
        return self.fence_key or self.group


@dataclass(frozen=True)
class Leadership:
    """One answer of the local sidecar to ``GET /leader``."""

    group: str
    identity: str
    role: str
    is_leader: bool
    token: int | None
    leader: str | None
    fence_key: str
    reason: str
    version: str
    """Opaque; passed back as ``after`` so that the next long poll answers on the next change."""
    valid_for: float
    """Seconds this replica may still act without another renewal (0 when it does not act)."""
    waited: float
    """Seconds the sidecar held the request before answering (a long poll), floored."""

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> Leadership:
        try:
            return cls(group=doc["group"], identity=doc["identity"], role=doc["role"],
                       is_leader=bool(doc["isLeader"]), token=doc.get("token"), leader=doc.get("leader"),
                       fence_key=doc.get("fenceKey") or doc["group"], reason=doc.get("reason") or "",
                       version=str(doc["version"]), valid_for=float(doc["validFor"]),
                       waited=float(doc["waited"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise SidecarError(f"the sidecar's /leader answer lacks or garbles {exc}: "
                               "is the sidecar older than this SDK?") from exc

    def term(self) -> Term | None:
        """This replica's term if it may take work now: leading (not draining), inside its deadline."""
        if not self.is_leader or self.token is None or self.role != "leader":
            return None
        return Term(group=self.group, identity=self.identity, token=self.token, fence_key=self.fence_key)

    def ends(self, term: Term) -> str | None:
        """Why ``term`` is over or ending by this answer, or None while it holds."""
        if self.token != term.token or not self.is_leader:
            return f"term {term.token} is over ({self.role}: {self.reason})"
        if self.role != "leader":
            return f"term {term.token} is ending ({self.role}: {self.reason})"
        return None
