"""The release request and its answer, as written on a SingletonService: the contract
between ``kubectl singleton release`` (which writes the request and waits) and the operator
(which carries it out: singleton_operator.release). Pure JSON, so the plugin imports no
database driver."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from singleton_election import contract

RELEASE_REQUEST: Final = f"{contract.API_GROUP}/release-request"
"""``{"id": "<unique>", "by": "<requester>"}``, written by the plugin."""
RELEASE_RESULT: Final = f"{contract.API_GROUP}/release-result"
"""``{"id", "by", "done": [...], "error": str | null, "at"}``, written by the operator."""


@dataclass(frozen=True)
class ReleaseRequest:
    id: str
    by: str

    def annotation(self) -> str:
        return json.dumps({"id": self.id, "by": self.by})


def _annotations(body: dict[str, Any]) -> dict[str, str]:
    return dict((body.get("metadata") or {}).get("annotations") or {})


def request_of(body: dict[str, Any]) -> ReleaseRequest | None:
    """The release request on the object, if any (one that is not our JSON keeps its text as id)."""
    text = _annotations(body).get(RELEASE_REQUEST)
    if not text:
        return None
    try:
        doc = json.loads(text)
        return ReleaseRequest(id=str(doc["id"]), by=str(doc.get("by") or "unknown user"))
    except (ValueError, KeyError, TypeError):
        return ReleaseRequest(id=text[:64], by="unknown user")


def answer_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """The operator's last answer on the object, if any."""
    text = _annotations(body).get(RELEASE_RESULT)
    try:
        answer = json.loads(text) if text else None
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def pending_request(body: dict[str, Any]) -> ReleaseRequest | None:
    """The release request on the object that the operator has not answered yet."""
    request = request_of(body)
    answer = answer_of(body)
    if request is None or (answer is not None and answer.get("id") == request.id):
        return None
    return request
