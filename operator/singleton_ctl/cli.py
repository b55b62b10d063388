"""``singletonctl``: see and steer singleton groups.

    singletonctl status [GROUP] [-n NS | -A] [-o table|json|yaml]
    singletonctl handover GROUP [-n NS] [--to POD] [--timeout S]
    singletonctl release GROUP [-n NS] [--yes]
    singletonctl history GROUP [-n NS] [-o table|json|yaml]
    singletonctl inject [-f FILE ...] [-n NS] [--sidecar-image IMAGE] [--sidecar-image-pull-policy P]
                        [--sidecar-image-pull-secret S ...]   (offline: no cluster)

Uses the usual kubeconfig (``--kubeconfig``, ``$KUBECONFIG``, ``~/.kube/config``, or the
pod's service account). Errors are one line on stderr and exit status 1 (2 for bad usage).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

import asyncpg
import yaml

from singleton_ctl.groups import Ctl, CtlError, GroupView
from singleton_ctl.manifests import inject_files
from singleton_operator.cli import DEFAULT_SIDECAR_IMAGE, PULL_POLICIES
from singleton_sidecar.kube import (
    KubeClient,
    KubeConfig,
    KubeConfigError,
    KubeError,
    KubeForbidden,
    load_kube_config,
)

PROG = "singletonctl"


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog=PROG, description="See and steer singleton groups (SingletonServices).")
    top.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    sub = top.add_subparsers(dest="command", required=True)

    def add(name: str, text: str, *, group: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("group", nargs="?" if group == "optional" else None, help="the SingletonService's name")
        cmd.add_argument("-n", "--namespace", default=None, help="namespace (default: the kubeconfig's)")
        return cmd

    status = add("status", "leader, token, since and standbys of every group, or of one", group="optional")
    status.add_argument("-A", "--all-namespaces", action="store_true", help="groups in every namespace")
    status.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table")
    handover = add("handover", "planned switchover: the leader drains and a standby takes over", group="required")
    handover.add_argument("--to", default=None, metavar="POD", help="the standby that must take over")
    handover.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the new leader")
    release = add("release", "force-release a stuck lock (runbook); records an Event naming you", group="required")
    release.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    history = add("history", "recent changes of leader of a group, from Events", group="required")
    history.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table")
    inject = sub.add_parser(
        "inject", help="add the sidecar to the Deployments and StatefulSets that SingletonServices of the input "
                       "adopt (spec.workloadRef); offline, for GitOps pipelines",
        description="Reads manifests (YAML, several documents) from the files given, or stdin, and writes them all "
                    "to stdout, the adopted workloads with the sidecar added exactly as the operator's webhook adds "
                    "it to their pods. The SingletonServices must be part of the input. Talks to no cluster.")
    inject.add_argument("-f", "--filename", action="append", default=None, metavar="FILE",
                        help="a manifest file, or - for stdin (repeatable; default: stdin)")
    inject.add_argument("-n", "--namespace", default="default",
                        help="namespace of documents that name none (default: default)")
    inject.add_argument("--sidecar-image", default=DEFAULT_SIDECAR_IMAGE, metavar="IMAGE",
                        help="the sidecar image when a SingletonService sets no spec.sidecar.image (default: the "
                             f"operator's default, {DEFAULT_SIDECAR_IMAGE}; use the operator's --sidecar-image)")
    inject.add_argument("--sidecar-image-pull-policy", default=None, choices=PULL_POLICIES,
                        help="the sidecar's imagePullPolicy (use the operator's setting)")
    inject.add_argument("--sidecar-image-pull-secret", action="append", default=None, metavar="SECRET",
                        help="a Secret added to the pods' imagePullSecrets (repeatable; use the operator's)")
    return top


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def render_status(views: list[GroupView], output: str, *, detail: bool) -> str:
    if output != "table":
        data: Any = [v.as_dict() for v in views]
        return json.dumps(data, indent=2) if output == "json" else yaml.safe_dump(data, sort_keys=False).rstrip()
    if not views:
        return "No SingletonServices found."
    rows = [["NAMESPACE", "NAME", "BACKEND", "LEADER", "TOKEN", "SINCE", "STANDBYS", "PHASE"]]
    for v in views:
        standbys = sum(m.role == "standby" and m.ready for m in v.members)
        rows.append([v.namespace, v.name, v.backend, v.leader or "-", str(v.token or "-"), v.since or "-",
                     str(standbys), v.phase or "-"])
    text = _table(rows)
    if detail:
        for v in views:
            members = [["POD", "ROLE", "READY", "TOKEN", "AGE"]] + [
                [m.pod, m.role + (" (terminating)" if m.deleting else ""), "yes" if m.ready else "no",
                 str(m.token or "-"), m.age] for m in v.members]
            text += "\n\n" + _table(members)
    return text


def confirmed(namespace: str, group: str) -> bool:
    if not sys.stdin.isatty():
        raise CtlError("release needs confirmation: run it in a terminal or pass --yes")
    answer = input(f"Force-release the lock of group {namespace}/{group}? A live leader will step down. [y/N] ")
    return answer.strip().lower() in ("y", "yes")


async def run(args: argparse.Namespace, config: KubeConfig, namespace: str) -> int:
    async with KubeClient(config, user_agent="singletonctl") as client:
        ctl = Ctl(client)
        if args.command == "status":
            views = await ctl.status(None if args.all_namespaces else namespace, args.group)
            print(render_status(views, args.output, detail=args.group is not None))
        elif args.command == "handover":
            new, took = await ctl.handover(namespace, args.group, args.to, timeout=args.timeout)
            print(f"{new} leads group {namespace}/{args.group} (handover took {took:.3f}s)")
        elif args.command == "release":
            for line in await ctl.release(namespace, args.group):
                print(line)
        elif args.command == "history":
            rows = await ctl.history(namespace, args.group)
            if args.output == "table":
                print(_table([["TIME", "OBJECT", "REASON", "MESSAGE"]] +
                             [[r["time"], r["object"], r["reason"], r["message"]] for r in rows]) if rows
                      else "No leadership events recorded (Events expire after an hour by default).")
            else:
                print(json.dumps(rows, indent=2) if args.output == "json" else yaml.safe_dump(rows).rstrip())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "inject":
            sys.stdout.write(inject_files(args.filename or ["-"], namespace=args.namespace,
                                          sidecar_image=args.sidecar_image,
                                          pull_policy=args.sidecar_image_pull_policy,
                                          pull_secrets=args.sidecar_image_pull_secret or ()))
            return 0
        config = load_kube_config(args.kubeconfig)
        namespace = args.namespace or config.namespace
        if args.command == "release" and not args.yes and not confirmed(namespace, args.group):
            print("Nothing done.")
            return 1
        return asyncio.run(run(args, config, namespace))
    except CtlError as exc:
        message = str(exc)
    except KubeForbidden as exc:
        message = f"forbidden: {exc} (ask for the RBAC this command needs)"
    except KubeConfigError as exc:
        message = f"kubeconfig: {exc}"
    except KubeError as exc:
        message = f"the API server said: {exc}" if exc.status else f"cannot reach the API server: {exc}"
    except (OSError, asyncpg.PostgresError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
