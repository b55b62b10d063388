"""Sidecar settings: per-backend default timings and overrides (pure, no I/O)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from singleton_election import contract
from singleton_election.backends.lease import WATCH_TIMEOUT as LEASE_WATCH_TIMEOUT
from singleton_election.core.timings import FIELDS as TIMING_FIELDS
from singleton_election.settings import ConfigError, Listen, parse_positive_seconds
from singleton_sidecar.config import (
    SETTINGS,
    Setting,
    SidecarConfig,
    add_run_arguments,
    load_config,
    read_settings,
)
from singleton_sidecar.podstatus import WATCH_SECONDS as POD_WATCH_SECONDS


def load(**environ: str) -> SidecarConfig:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return load_config(parser.parse_args([]), {"SINGLETON_GROUP": "g", **environ})


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("postgres", (6.0, 4.0, 2.0)), ("lease", (9.0, 7.5, 6.0)), ("both", (9.0, 7.5, 6.0))],
)
def test_each_backend_has_its_own_default_timings(backend: str, expected: tuple[float, float, float]) -> None:
    config = load(SINGLETON_BACKEND=backend, SINGLETON_NAMESPACE="ns", SINGLETON_POSTGRES_DSN="postgres://h/d")
    timings = config.timings
    assert (timings.lease_duration, timings.renew_deadline, timings.retry_period) == expected


def test_lease_defaults_stay_under_the_api_request_goal_at_rest() -> None:
    """At most 0.2 API requests/s for a group of 3 at rest: the leader's renewals, and each
    sidecar's two watches (Lease, pod) re-established once per watch timeout."""
    config = load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns")
    assert 1 / config.timings.retry_period + 3 * 2 / min(LEASE_WATCH_TIMEOUT, POD_WATCH_SECONDS) <= 0.2
    assert config.kill_grace < config.timings.stop_margin


def test_given_timings_replace_only_their_own_default() -> None:
    config = load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns", SINGLETON_RETRY_PERIOD="2")
    assert (config.timings.lease_duration, config.timings.renew_deadline, config.timings.retry_period) == (
        9.0, 7.5, 2.0)


def test_a_given_timing_that_breaks_the_defaults_order_is_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "SINGLETON_RENEW_DEADLINE (--renew-deadline) = 7.5s (the lease default): must be shorter than "
            "SINGLETON_LEASE_DURATION (--lease-duration) = 6s")):
        load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns", SINGLETON_LEASE_DURATION="6")


def test_the_postgres_lock_key_is_namespace_qualified_in_a_cluster() -> None:
    assert contract.lock_key("poller", "team-a") == "team-a/poller"


@pytest.mark.parametrize(
    ("environ", "key"),
    [
        pytest.param({"SINGLETON_NAMESPACE": "team-a"}, "team-a/g", id="in a pod: <namespace>/<group>"),
        pytest.param({"SINGLETON_LOCK_KEY": "team-a/g"}, "team-a/g", id="on a VM: given, the same as in the pod"),
        pytest.param({"SINGLETON_NAMESPACE": "team-a", "SINGLETON_LOCK_KEY": "shared/g"}, "shared/g",
                     id="given wins over the namespace"),
    ],
)
def test_the_lock_key_is_the_same_wherever_the_group_runs(environ: dict[str, str], key: str) -> None:
    config = load(SINGLETON_BACKEND="postgres", SINGLETON_POSTGRES_DSN="postgres://h/d", **environ)
    assert config.lock_key == key


def test_postgres_outside_kubernetes_needs_an_explicit_lock_key() -> None:
    """Before, a VM's sidecar took the lock under the bare group name and a pod's under
    <namespace>/<group>: both led. Now the key must be given where it cannot be derived."""
    with pytest.raises(ConfigError, match=r"^SINGLETON_LOCK_KEY \(--lock-key\): required with backend postgres "
                       r"outside Kubernetes.*e\.g\. default/g\)$"):
        load(SINGLETON_BACKEND="postgres", SINGLETON_POSTGRES_DSN="postgres://h/d")


@pytest.mark.parametrize("bad", [" team/g", "a\nb", "x" * 254])
def test_a_malformed_lock_key_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"^SINGLETON_LOCK_KEY \(--lock-key\): must be 1 to 253 printable"):
        load(SINGLETON_BACKEND="postgres", SINGLETON_POSTGRES_DSN="postgres://h/d", SINGLETON_LOCK_KEY=bad)


@pytest.mark.parametrize("url", ["http://127.0.0.1:0/drain", "http://127.0.0.1:65536/drain", "http://[::1]:99999/"])
def test_a_drain_url_with_a_port_out_of_range_is_refused_at_start(url: str) -> None:
    """Not when the drain POSTs it: the HTTP client would raise ValueError there, mid-drain."""
    with pytest.raises(ConfigError, match=r"^SINGLETON_DRAIN_URL \(--drain-url\): the port must be from 1 to 65535"):
        load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns", SINGLETON_DRAIN_URL=url)


@pytest.mark.parametrize(("url", "problem"), [
    ("http:///drain", "the URL has no host"), ("http://:8080/drain", "the URL has no host"),
    ("http://127.0.0.1:8080/dr ain", "spaces and non-ASCII characters must be percent-encoded"),
    ("http://127.0.0.1:8080/é", "spaces and non-ASCII characters must be percent-encoded"),
])
def test_a_drain_url_the_client_cannot_send_is_refused_at_start(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"^SINGLETON_DRAIN_URL \(--drain-url\): {problem}, got "):
        load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns", SINGLETON_DRAIN_URL=url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:65535/drain", "http://localhost/drain", "https://[::1]:1"])
def test_a_drain_url_with_a_usable_port_is_kept(url: str) -> None:
    assert load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns", SINGLETON_DRAIN_URL=url).drain_url == url


@pytest.mark.parametrize("environ", [
    {},
    {"SINGLETON_POD_NAME": "p"},
    {"SINGLETON_POD_NAME": "p", "SINGLETON_POD_UID": "u", "SINGLETON_IDENTITY": "me"},
], ids=["no pod", "no pod UID", "an identity given"])
def test_sole_candidate_in_pod_needs_an_identity_the_sidecar_makes_from_its_pod(environ: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"^SINGLETON_SOLE_CANDIDATE_IN_POD \(--sole-candidate-in-pod\): needs the "
                       r"pod name and UID"):
        load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns", SINGLETON_SOLE_CANDIDATE_IN_POD="true", **environ)


def test_sole_candidate_in_pod_is_off_unless_set() -> None:
    pod = {"SINGLETON_POD_NAME": "p", "SINGLETON_POD_UID": "u"}
    assert not load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns", **pod).sole_candidate_in_pod
    assert load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns", SINGLETON_SOLE_CANDIDATE_IN_POD="true",
                **pod).sole_candidate_in_pod


@pytest.mark.parametrize(("environ", "mode"), [
    pytest.param({}, "session", id="default"),
    pytest.param({"SINGLETON_POSTGRES_MODE": "pooled"}, "pooled", id="pooled"),
    pytest.param({"SINGLETON_POSTGRES_MODE": "session"}, "session", id="session"),
])
def test_the_postgres_mode(environ: dict[str, str], mode: str) -> None:
    config = load(SINGLETON_BACKEND="postgres", SINGLETON_POSTGRES_DSN="postgres://h/d", SINGLETON_LOCK_KEY="k",
                  **environ)
    assert config.postgres_mode == mode


@pytest.mark.parametrize("bad", ["transaction", "Pooled", ""])
def test_a_bad_postgres_mode_is_refused_in_one_line(bad: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(SINGLETON_BACKEND="postgres", SINGLETON_POSTGRES_DSN="postgres://h/d", SINGLETON_LOCK_KEY="k",
             SINGLETON_POSTGRES_MODE=bad)
    assert str(caught.value) == (
        f"SINGLETON_POSTGRES_MODE (--postgres-mode): must be session or pooled, got {bad!r}")


# A valid value of each setting of the table, as given and as read, other than its default; valid
# too over the environment below, which makes every setting usable at once.
EXAMPLES: dict[str, tuple[str, object]] = {
    "group": ("g2", "g2"),
    "identity": ("me", "me"),
    "backend": ("both", "both"),
    "postgres_dsn": ("postgresql://x/y", "postgresql://x/y"),
    "postgres_dsn_file": ("/run/secrets/dsn", "/run/secrets/dsn"),
    "postgres_mode": ("pooled", "pooled"),
    "namespace": ("ns2", "ns2"),
    "lock_key": ("team/k", "team/k"),
    "pod_name": ("p2", "p2"),
    "pod_uid": ("u2", "u2"),
    "listen": ("127.0.0.1:9090", Listen("127.0.0.1", 9090)),
    "control_listen": ("[::1]:9091", Listen("::1", 9091)),
    "lease_duration": ("20", 20.0),
    "renew_deadline": ("8", 8.0),
    "retry_period": ("3", 3.0),
    "drain_timeout": ("12.5", 12.5),
    "drain_url": ("http://127.0.0.1:8/drain", "http://127.0.0.1:8/drain"),
    "gate_dir": ("/gate", Path("/gate")),
    "kill_grace": ("0.25", 0.25),
    "kubeconfig": ("/kube/config", "/kube/config"),
    "readiness_gate": ("true", True),
    "drain_wait_container": ("main", "main"),
    "native_sidecar": ("yes", True),
    "sole_candidate_in_pod": ("on", True),
    "log_format": ("text", "text"),
    "log_level": ("debug", "debug"),
}
EVERY_SETTING_USABLE = {"SINGLETON_GROUP": "g", "SINGLETON_BACKEND": "lease", "SINGLETON_NAMESPACE": "ns",
                        "SINGLETON_POD_NAME": "p", "SINGLETON_POD_UID": "u",
                        "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_DRAIN_WAIT_CONTAINER": "app"}


def test_every_setting_of_the_table_has_an_example_and_its_own_flag_and_variable() -> None:
    assert sorted(EXAMPLES) == sorted(setting.name for setting in SETTINGS)
    for attribute in ("name", "flag", "env"):
        names = [getattr(setting, attribute) for setting in SETTINGS]
        assert len(set(names)) == len(names), f"two settings share a {attribute}: {names}"


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda setting: setting.name)
def test_every_setting_of_the_table_has_a_flag_a_variable_help_and_is_parsed(setting: Setting[object]) -> None:
    assert setting.flag == "--" + setting.name.replace("_", "-")
    assert re.fullmatch(r"[A-Z][A-Z_]*", setting.env), setting.env
    assert setting.help.strip() and setting.env not in setting.help
    raw, expected = EXAMPLES[setting.name]
    assert expected != setting.default, "the example must show the setting read, not its default"

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    from_environment = read_settings(parser.parse_args([]), {**EVERY_SETTING_USABLE, setting.env: raw})
    assert from_environment[setting] == expected
    from_flag = read_settings(parser.parse_args([setting.flag, raw]), EVERY_SETTING_USABLE)
    assert from_flag[setting] == expected

    # And load_config passes it on: to the field of its name, or to the timings.
    if setting.name == "postgres_dsn_file":
        return  # read by load_config from the file: test_the_dsn_file_is_read_and_excludes_the_dsn
    config = load_config(parser.parse_args([]), {**EVERY_SETTING_USABLE, setting.env: raw})
    if setting.name in TIMING_FIELDS:
        assert getattr(config.timings, setting.name) == expected
    else:
        assert getattr(config, setting.name) == expected


def test_the_dsn_file_is_read_and_excludes_the_dsn(tmp_path: Path) -> None:
    dsn_file = tmp_path / "dsn"
    dsn_file.write_text(" postgresql://from/file\n")
    config = load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns", SINGLETON_POSTGRES_DSN_FILE=str(dsn_file))
    assert config.postgres_dsn == "postgresql://from/file"
    with pytest.raises(ConfigError, match=r"^SINGLETON_POSTGRES_DSN_FILE \(--postgres-dsn-file\): give the DSN or "
                       r"a file holding it, not both$"):
        load(SINGLETON_BACKEND="lease", SINGLETON_NAMESPACE="ns", SINGLETON_POSTGRES_DSN_FILE=str(dsn_file),
             SINGLETON_POSTGRES_DSN="postgres://h/d")


def test_a_setting_added_to_the_table_is_in_the_help_and_read_without_other_code() -> None:
    tea_time: Setting[float] = Setting(
        "tea_time", "--tea-time", "SINGLETON_TEA_TIME", parse_positive_seconds, default=4.0,
        help="seconds the sidecar waits for its tea (default 4)")
    table = (*SETTINGS, tea_time)
    parser = argparse.ArgumentParser()
    add_run_arguments(parser, table)

    help_text = " ".join(parser.format_help().split())  # unwrapped: the terminal's width does not count
    assert "--tea-time TEA_TIME seconds the sidecar waits for its tea (default 4) [SINGLETON_TEA_TIME]" in help_text

    environ = {"SINGLETON_GROUP": "g"}
    assert read_settings(parser.parse_args([]), environ, table)[tea_time] == 4.0
    assert read_settings(parser.parse_args([]), {**environ, "SINGLETON_TEA_TIME": "2.5"}, table)[tea_time] == 2.5
    assert read_settings(parser.parse_args(["--tea-time", "1"]), {**environ, "SINGLETON_TEA_TIME": "2.5"},
                         table)[tea_time] == 1.0
    with pytest.raises(ConfigError, match=r"^SINGLETON_TEA_TIME \(--tea-time\): must be a number of seconds, "
                       r"got 'soon'$"):
        read_settings(parser.parse_args([]), {**environ, "SINGLETON_TEA_TIME": "soon"}, table)


def test_a_required_setting_missing_everywhere_is_refused_by_its_parser() -> None:
    """Parsed as the empty text, so one message says it is required whether absent or empty."""
    assert [setting.name for setting in SETTINGS if setting.required] == ["group"]
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    for environ in ({}, {"SINGLETON_GROUP": ""}):
        with pytest.raises(ConfigError, match=r"^SINGLETON_GROUP \(--group\): required: the name of the singleton "
                           r"group$"):
            read_settings(parser.parse_args([]), environ)
