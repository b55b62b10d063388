"""Logs: one JSON object a line with typed fields from ``extra=`` (or readable text), the same
shape from the formatter, a real sidecar on PostgreSQL, and a real operator (kopf's lines too)."""

from __future__ import annotations

import enum
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest

from singleton_election.logs import JsonFormatter, TextFormatter, event_fields, setup_logging
from singleton_operator import kopf_logs
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.harness.sidecars import FAST_TIMINGS, SidecarProcess, one_leader, wait_for
from singleton_testbed.procs import free_port
from tests.conftest import Cluster

RFC3339_UTC_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


class Colour(enum.StrEnum):
    RED = "red"


def record(msg: str = "acquired the lock", *args: object, level: int = logging.INFO,
           exc_info: Any = None, **fields: object) -> logging.LogRecord:
    """A record as ``logger.log(level, msg, *args, extra=fields)`` makes it."""
    made = logging.getLogger("singleton_sidecar.test").makeRecord(
        "singleton_sidecar.test", level, __file__, 1, msg, args, exc_info, extra=fields)
    return made


def as_json(rec: logging.LogRecord) -> dict[str, Any]:
    line = JsonFormatter().format(rec)
    assert "\n" not in line, line
    doc: dict[str, Any] = json.loads(line)
    return doc


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every non-empty line of a log as a JSON object; fails on any line that is not one."""
    docs = []
    for line in text.splitlines():
        if line.strip():
            doc = json.loads(line)
            assert isinstance(doc, dict), line
            docs.append(doc)
    return docs


# --- the formatter -------------------------------------------------------------------------


def test_json_has_the_fixed_shape_and_typed_fields() -> None:
    doc = as_json(record(group="feed-poller", identity="pod-a", token=17, role=Colour.RED, ok=True,
                         duration_seconds=0.25, holder=None, done=["cleared Lease holder"]))
    assert list(doc)[:4] == ["time", "level", "logger", "msg"], doc
    assert RFC3339_UTC_MS.match(doc["time"]), doc["time"]
    assert (doc["level"], doc["logger"], doc["msg"]) == ("info", "singleton_sidecar.test", "acquired the lock")
    assert doc["group"] == "feed-poller" and doc["identity"] == "pod-a"
    assert doc["token"] == 17 and type(doc["token"]) is int
    assert doc["duration_seconds"] == 0.25 and type(doc["duration_seconds"]) is float
    assert doc["ok"] is True and doc["holder"] is None and doc["role"] == "red"
    assert doc["done"] == ["cleared Lease holder"]
    assert "exception" not in doc


def test_the_message_is_formatted_and_fields_are_not_parsed_from_it() -> None:
    doc = as_json(record("role %s -> %s token=%s", "standby", "leader", "5", reason="renew failed: timeout"))
    assert doc["msg"] == "role standby -> leader token=5"
    assert "token" not in doc, "fields come from extra=, never from the message text"
    assert doc["reason"] == "renew failed: timeout", "a value is kept whole, spaces and all"


def test_an_exception_is_one_field_after_the_others_on_one_line() -> None:
    try:
        raise ValueError("bad\nvalue")
    except ValueError as exc:
        exc_info = (type(exc), exc, exc.__traceback__)
    doc = as_json(record("renewal failed", level=logging.ERROR, exc_info=exc_info, token=3, error=OSError("down")))
    assert doc["level"] == "error"
    assert list(doc)[-1] == "exception", doc
    assert doc["exception"].startswith("Traceback (most recent call last):")
    assert doc["exception"].endswith("ValueError: bad\nvalue")
    assert doc["error"] == "OSError: down", "an exception as a field value: its type and text"
    assert doc["token"] == 3


def test_kopf_internals_and_record_attributes_are_not_fields() -> None:
    rec = record(settings=kopf.OperatorSettings(), k8s_skip=True, k8s_ref={"kind": "Pod", "name": "p"})
    assert event_fields(rec) == {}
    assert set(as_json(rec)) == {"time", "level", "logger", "msg"}


def test_text_appends_the_fields_readably() -> None:
    text = TextFormatter().format(record(group="feed-poller", token=17, reason="lost the lock: timeout",
                                         patched=True, empty=""))
    assert RFC3339_UTC_MS.match(text.split(" ", 1)[0]), text
    assert text.split(" ", 1)[1] == ('INFO singleton_sidecar.test: acquired the lock group=feed-poller token=17 '
                                     'reason="lost the lock: timeout" patched=True empty=""')
    plain = TextFormatter().format(record("stopped"))
    assert plain.endswith("singleton_sidecar.test: stopped"), plain


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("root_logging")
def test_setup_logging_writes_one_json_line_per_event_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("json")
    logging.getLogger("singleton_election.core.elector").info("role %s -> %s", "standby", "leader",
                                                             extra={"group": "g", "token": 9})
    (doc,) = json_lines(capsys.readouterr().err)
    assert (doc["msg"], doc["group"], doc["token"]) == ("role standby -> leader", "g", 9)


@pytest.mark.usefixtures("root_logging")
def test_kopf_object_lines_get_our_group_fields(capsys: pytest.CaptureFixture[str]) -> None:
    """kopf's real ObjectLogger, as the operator's kopf lines go through it."""
    setup_logging("json")
    kopf_logs.install()
    kopf_logs.install()  # idempotent
    assert sum(isinstance(f, kopf_logs.KopfObjectFields)
               for f in logging.getLogger(kopf_logs.KOPF_OBJECTS_LOGGER).filters) == 1
    settings = kopf.OperatorSettings()
    service = kopf.Body({"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService",
                         "metadata": {"name": "feed-poller", "namespace": "feeds", "uid": "u1"}})
    pod = kopf.Body({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p-1", "namespace": "feeds"}})
    kopf.LocalObjectLogger(body=service, settings=settings).info("Handler 'reconcile' succeeded.")
    kopf.LocalObjectLogger(body=pod, settings=settings).warning("odd", extra={"namespace": "given"})
    first, second = json_lines(capsys.readouterr().err)
    assert first == {"time": first["time"], "level": "info", "logger": "kopf.objects",
                     "msg": "Handler 'reconcile' succeeded.", "namespace": "feeds", "group": "feed-poller"}
    assert (second["object"], second["namespace"]) == ("Pod/p-1", "given"), second
    assert "group" not in second


# --- across the process boundary ------------------------------------------------------------


@pytest.mark.postgres
def test_a_real_sidecar_logs_leadership_as_one_json_line_with_typed_fields(pg_dsn: str, tmp_path: Path) -> None:
    group, identity = "g-" + uuid.uuid4().hex[:10], "logs-" + uuid.uuid4().hex[:6]
    env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres", "SINGLETON_POSTGRES_DSN": pg_dsn,
           "SINGLETON_IDENTITY": identity, **FAST_TIMINGS}
    sidecar = SidecarProcess("logs", env, tmp_path / "sidecar.log", log_format="json").start()
    try:
        leader_doc = one_leader([sidecar], timeout=15).leader_doc()
        assert leader_doc is not None
        acquired = wait_for(lambda: next((d for d in json_lines(sidecar.log()) if d.get("role") == "leader"), None),
                            10, "the leadership line")
    finally:
        sidecar.stop()
    assert sidecar.wait_exit(10) == 0, sidecar.log()
    assert acquired["logger"] == "singleton_election.core.elector" and acquired["level"] == "info"
    assert acquired["msg"] == "role standby -> leader"
    assert acquired["group"] == group and acquired["identity"] == identity
    assert type(acquired["token"]) is int and acquired["token"] == leader_doc["token"]
    assert (acquired["role"], acquired["previous_role"], acquired["reason"]) == ("leader", "standby",
                                                                                "acquired the lock")
    docs = json_lines(sidecar.log())  # every line of the run, the shutdown included, is one JSON object
    assert all(RFC3339_UTC_MS.match(d["time"]) and {"level", "logger", "msg"} <= d.keys() for d in docs), docs
    taken = next(d for d in docs if d["msg"] == "acquired the lock")
    assert (taken["lock_key"], taken["identity"], taken["token"]) == (f"local/{group}", identity,
                                                                      leader_doc["token"])
    released = next(d for d in docs if d["msg"] == "released")
    assert (released["group"], released["token"]) == (group, leader_doc["token"])
    assert type(released["reason"]) is str and released["reason"], released
    starting = next(d for d in docs if d["msg"] == "starting")
    assert starting["lease_duration"] == 2.0 and starting["backend"] == "postgres", starting


def test_a_sidecar_whose_store_is_down_says_so_once_not_per_retry(tmp_path: Path) -> None:
    """The runbook's first look: a standby that cannot reach PostgreSQL logs it, once."""
    group = "g-" + uuid.uuid4().hex[:10]
    closed = f"postgresql://app@127.0.0.1:{free_port()}/app?connect_timeout=1"
    sidecar = SidecarProcess("down", {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres",
                                      "SINGLETON_POSTGRES_DSN": closed, **FAST_TIMINGS},
                             tmp_path / "down.log", log_format="json").start()
    try:
        def outage_lines() -> list[dict[str, Any]]:
            return [d for d in json_lines(sidecar.log()) if d["msg"] == "lock store unavailable"]
        wait_for(lambda: outage_lines() or None, 15, "the outage line")
        time.sleep(4 * float(FAST_TIMINGS["SINGLETON_RETRY_PERIOD"]))  # several retries, all failing
        lines = outage_lines()
    finally:
        sidecar.stop()
    assert len(lines) == 1, lines
    (line,) = lines
    assert (line["level"], line["group"], type(line["identity"])) == ("warning", group, str), line
    assert "postgres acquire" in line["error"], line


def test_a_real_operator_logs_its_own_and_kopfs_lines_in_the_same_shape(
    cluster: Cluster, singleton_crd: Path, namespace: str, tmp_path: Path
) -> None:
    operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator.log", name="op-logs",
                               extra_args=["--namespace", namespace, "--log-format", "json"]).start()
    name = "logs-" + uuid.uuid4().hex[:4]
    try:
        wait_for(lambda: operator.role() == "leader", 20, "the operator to lead", 0.1)
        body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": name},
                "spec": {"replicas": 1, "template": {"spec": {"containers": [
                    {"name": "app", "image": "example.invalid/app:1", "command": ["sleep", "infinity"]}]}}}}
        cluster.apply(json.dumps(body), namespace=namespace)
        handled = wait_for(lambda: next((d for d in json_lines(operator.log())
                                         if d["logger"] == "kopf.objects" and d.get("group") == name), None),
                           30, "kopf's line about the SingletonService", 0.2)
    finally:
        operator.stop()
    docs = json_lines(operator.log())
    assert all(RFC3339_UTC_MS.match(d["time"]) and {"level", "logger", "msg"} <= d.keys() for d in docs), docs
    assert handled["namespace"] == namespace and type(handled["msg"]) is str
    assert not {"k8s_ref", "k8s_skip", "settings"} & handled.keys(), handled
    leading = next(d for d in docs if d["msg"] == "leading: starting kopf")
    assert leading["identity"].startswith("op-logs/"), leading  # the name, then a nonce per incarnation
    assert (leading["role"], leading["namespaces"]) == ("leader", [namespace])
    assert any(d["logger"].startswith("kopf.") and d["logger"] != "kopf.objects" for d in docs), \
        "kopf's own (not per-object) lines come through the same formatter"
