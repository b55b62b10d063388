"""``singleton-sidecar``: the command users run (its commands: ``DESCRIPTION``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from singleton_election import contract
from singleton_election.early_stop import stop_on_sigterm_until_started
from singleton_election.settings import ConfigError
from singleton_sidecar.config import add_run_arguments, load_config

PROG = "singleton-sidecar"
DESCRIPTION = """\
    singleton-sidecar run [flags] [-- command ...]   campaign, lead, expose /readyz /livez /leader /metrics
    singleton-sidecar drain [--wait]                 ask the local sidecar to drain and release (preStop)
    singleton-sidecar step-down                      ask the local sidecar to give up the current term
    singleton-sidecar status                         print the local sidecar's /leader document
    singleton-sidecar gate-script                    print the POSIX sh file gate (gate.sh)

Bad or missing settings exit with status 2 and one line naming the setting.
"""
"""What ``--help`` shows: a constant, not the module's docstring, which the image's command runs
without (``python -OO``: see the Dockerfile)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="action", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="run the sidecar", description="Campaign for leadership of a group. "
                              "Every flag has an environment variable, shown in brackets; flags win.")
    add_run_arguments(run)
    for name, text in (("drain", "drain and release the lock (for preStop hooks)"),
                       ("step-down", "give up the current term; campaign again later"),
                       ("status", "print the local sidecar's /leader document")):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("--control", default=None, metavar="HOST:PORT",
                         help=f"control endpoint (default ${contract.ENV_CONTROL_LISTEN} or 127.0.0.1:8081)")
        if name == "drain":
            sub.add_argument("--wait", action="store_true", help="return only once the lock is released")
            sub.add_argument("--timeout", type=float, default=120.0, help="seconds to wait at most (default 120)")
    commands.add_parser("gate-script", help="print gate.sh, the file gate for /bin/sh-only images")
    return parser


def _control_call(control: str | None, method: str, path: str, timeout: float) -> int:
    # Here, not at the top: `run` never calls its control endpoint, and urllib.request (with
    # http.client and email) is 1.6 MB of a sidecar's memory.
    import urllib.error
    import urllib.request

    endpoint = control or os.environ.get(contract.ENV_CONTROL_LISTEN) or "127.0.0.1:8081"
    request = urllib.request.Request(f"http://{endpoint}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            print(response.read().decode())
            return 0
    except urllib.error.HTTPError as exc:
        print(f"{PROG}: {method} {path} answered {exc.code}: {exc.read().decode().strip()}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{PROG}: cannot reach the sidecar's control endpoint at {endpoint}: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0911 - one exit per command
    stop_on_sigterm_until_started(PROG)
    args = _parser().parse_args(argv)
    if args.action == "gate-script":
        from singleton_sidecar.gates.file_gate import GATE_SCRIPT, PACKAGE_FILES  # here: only this command reads it

        sys.stdout.write((PACKAGE_FILES / GATE_SCRIPT).read_text())
        return 0
    if args.action == "drain":
        path = "/drain?wait=true" if args.wait else "/drain"
        return _control_call(args.control, "POST", path, args.timeout)
    if args.action == "step-down":
        return _control_call(args.control, "POST", "/step-down", 10)
    if args.action == "status":
        return _control_call(args.control, "GET", "/leader", 10)
    try:
        config = load_config(args, os.environ)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    from singleton_sidecar.package_parts import without_init

    without_init("prometheus_client")  # before anything imports it: 2.9 MB less (package_parts)
    from singleton_election.core.lock import BackendMisconfigured
    from singleton_election.kube import KubeConfigError
    from singleton_election.logs import setup_logging
    from singleton_sidecar.app import Sidecar

    setup_logging(config.log_format, getattr(logging, config.log_level.upper()))
    try:
        return asyncio.run(Sidecar(config).run())
    except KubeConfigError as exc:
        print(f"{PROG}: error: Kubernetes access: {exc}", file=sys.stderr)
        return 2
    except BackendMisconfigured as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc.strerror or exc} (listen addresses: {config.listen}, {config.control_listen})",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())


