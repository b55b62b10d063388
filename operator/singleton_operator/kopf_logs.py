"""kopf's own lines in the shape of ours.

kopf logs through the standard library, so the root handler set up by
``singleton_election.logs.setup_logging`` formats them like every other line. Its per-object lines
(logger ``kopf.objects``) name their object only in the ``k8s_ref`` extra; this filter turns that
into the fields our lines use: ``namespace`` and ``group`` for a SingletonService, ``namespace``
and ``object`` (``Kind/name``) for anything else.
"""

from __future__ import annotations

import logging

from singleton_election import contract

KOPF_OBJECTS_LOGGER = "kopf.objects"


class KopfObjectFields(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ref = record.__dict__.get("k8s_ref")
        if not isinstance(ref, dict):
            return True
        fields: dict[str, object] = {"namespace": ref.get("namespace")}
        if ref.get("kind") == contract.KIND:
            fields["group"] = ref.get("name")
        else:
            fields["object"] = f"{ref.get('kind')}/{ref.get('name')}"
        for key, value in fields.items():
            record.__dict__.setdefault(key, value)  # a field the call passed itself wins
        return True


def install() -> None:
    """Add the filter to kopf's per-object logger (once, however often called)."""
    logger = logging.getLogger(KOPF_OBJECTS_LOGGER)
    if not any(isinstance(f, KopfObjectFields) for f in logger.filters):
        logger.addFilter(KopfObjectFields())
