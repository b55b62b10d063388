"""The release request and answer annotations (singleton_operator.release_request)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from singleton_operator.release_request import RELEASE_REQUEST, RELEASE_RESULT, ReleaseRequest, pending_request


def body(annotations: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "g", "namespace": "ns", "annotations": annotations}}


def test_a_request_is_pending_until_its_id_is_answered() -> None:
    request = ReleaseRequest(id="abc", by="alice")
    asked = {RELEASE_REQUEST: request.annotation()}
    assert pending_request(body(asked)) == request
    earlier = {**asked, RELEASE_RESULT: json.dumps({"id": "older", "done": []})}
    assert pending_request(body(earlier)) == request
    answered = {**asked, RELEASE_RESULT: json.dumps({"id": "abc", "done": ["cleared"]})}
    assert pending_request(body(answered)) is None


@pytest.mark.parametrize(("text", "expected"), [
    ("not json", ReleaseRequest(id="not json", by="unknown user")),
    ('{"by": "bob"}', ReleaseRequest(id='{"by": "bob"}', by="unknown user")),
    ('{"id": 7}', ReleaseRequest(id="7", by="unknown user")),
])
def test_a_request_written_by_hand_is_still_answered(text: str, expected: ReleaseRequest) -> None:
    """kubectl annotate works too: whatever is written is answered once, under its own text."""
    assert pending_request(body({RELEASE_REQUEST: text})) == expected


def test_no_request_or_an_unreadable_answer() -> None:
    assert pending_request(body({})) is None
    assert pending_request({"metadata": {}}) is None
    broken = {RELEASE_REQUEST: ReleaseRequest(id="x", by="y").annotation(), RELEASE_RESULT: "{"}
    assert pending_request(body(broken)) == ReleaseRequest(id="x", by="y")
