"""Structured logs: one JSON object a line (or readable text), the event's fields typed.

A log call carries its fields in ``extra=``; the message stays short and human::

    log.info("acquired the lock", extra={"group": "feed-poller", "identity": who, "token": 17})

JSON (python-json-logger) writes ``time`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``,
``msg``, then the fields as JSON values (ints stay ints, ``None`` is ``null``), and ``exception``
with the traceback when there is one; text appends the fields to the message as ``key=value``.
The sidecar, the operator (kopf's own lines too) and the CLI all log through here.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal

from pythonjsonlogger.core import RESERVED_ATTRS, merge_record_extra
from pythonjsonlogger.defaults import exception_default
from pythonjsonlogger.json import JsonFormatter as _LibraryJsonFormatter

# kopf's ObjectLogger passes these as extras: its settings object and event-posting flag are
# not fields of the event; its object reference is turned into fields by the operator.
KOPF_ATTRS = ("k8s_skip", "k8s_ref", "settings")
NOT_FIELDS = frozenset({*RESERVED_ATTRS, "message", "asctime", "taskName", *KOPF_ATTRS})


def _utc_time(record: logging.LogRecord) -> str:
    """RFC 3339 in UTC with milliseconds: ``2026-11-26T22:44:37.123Z``."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class JsonFormatter(_LibraryJsonFormatter):
    """One JSON object a line: ``time``, ``level``, ``logger``, ``msg``, the fields, ``exception``."""

    def __init__(self) -> None:
        super().__init__(
            ["asctime", "levelname", "name", "message"],
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger", "message": "msg",
                           "exc_info": "exception", "stack_info": "stack"},
            reserved_attrs=sorted(NOT_FIELDS),
        )

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _utc_time(record)

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        log_data["level"] = str(log_data["level"]).lower()
        for last in ("exception", "stack"):  # after the fields: the traceback is the long part
            if last in log_data:
                log_data[last] = log_data.pop(last)
        return log_data


def event_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a log call passed in ``extra=``, in their order."""
    fields: dict[str, Any] = merge_record_extra(record, {}, reserved=NOT_FIELDS)
    return fields


def _text_value(value: object) -> str:
    if isinstance(value, BaseException):
        value = exception_default(value)
    text = str(value)
    # Quoted only when needed, so that key=value pairs still split on spaces.
    return json.dumps(text) if not text or any(c.isspace() or c in "\"=" for c in text) else text


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <msg> key=value ...``, for people reading a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _utc_time(record)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in event_fields(record).items())
        return f"{line} {pairs}" if pairs else line


def setup_logging(fmt: Literal["json", "text"], level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
