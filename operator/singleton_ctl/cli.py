"""``kubectl singleton`` (also installed as ``singletonctl``): see and steer singleton groups.

    kubectl singleton [--kubeconfig FILE] [--context NAME] COMMAND ...   (also after COMMAND)
    kubectl singleton status [GROUP] [-n NS | -A] [-o table|json|yaml]
    kubectl singleton handover GROUP [-n NS] [--to POD] [--timeout S]
    kubectl singleton release GROUP [-n NS] [--yes] [--timeout S] [-o text|json|yaml]
    kubectl singleton history GROUP [-n NS] [-o table|json|yaml]
    kubectl singleton inject [-f FILE ...] [-n NS] [--sidecar-image IMAGE] [--sidecar-image-pull-policy P]
                             [--sidecar-image-pull-secret S ...]   (offline: no cluster)

kubectl runs ``kubectl-singleton`` from PATH for ``kubectl singleton``. Uses the usual
kubeconfig (``--kubeconfig``, ``$KUBECONFIG``, ``~/.kube/config``, or the pod's service
account) with the official client's loader: ``--context``, exec credential plugins, OIDC and
other auth providers, ``HTTPS_PROXY``/``NO_PROXY`` (an ``http://`` proxy); the requests go
through the project's own client (``singleton_ctl.kube``). ``release`` is carried out by the operator
inside the cluster. Errors are one line on stderr and exit status 1 (2 for bad usage).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from singleton_ctl.groups import Ctl, CtlError, GroupView
from singleton_ctl.kube import CLUSTER_ERRORS, error_line
from singleton_ctl.manifests import inject_files
from singleton_election.kube_blocking import BlockingKubeClient
from singleton_operator.cli import DEFAULT_SIDECAR_IMAGE, PULL_POLICIES
from singleton_operator.kubelogin import resolve

PLUGIN_NAME = "kubectl-singleton"


def prog_name(argv0: str) -> str:
    """``kubectl singleton`` when run as the kubectl plugin, else the name it was run by."""
    return "singletonctl" if os.path.basename(argv0) == "singletonctl" else "kubectl singleton"


def parser(prog: str = "kubectl singleton") -> argparse.ArgumentParser:
    # Cluster flags are accepted before and after the command (kubectl users put them
    # anywhere); SUPPRESS keeps a later absent flag from resetting an earlier one.
    cluster = argparse.ArgumentParser(add_help=False)
    cluster.add_argument("--kubeconfig", default=argparse.SUPPRESS,
                         help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    cluster.add_argument("--context", default=argparse.SUPPRESS, help="the kubeconfig context to use")
    cluster.add_argument("-n", "--namespace", default=argparse.SUPPRESS,
                         help="namespace (default: the kubeconfig context's)")
    top = argparse.ArgumentParser(
        prog=prog, parents=[cluster], description="See and steer singleton groups (SingletonServices).",
        epilog="Logs in with your kubeconfig as kubectl does: contexts, exec credential plugins, OIDC, "
               "HTTPS_PROXY/NO_PROXY. --kubeconfig, --context and -n go before or after the command. Errors are "
               "one line, exit status 1.")
    sub = top.add_subparsers(dest="command", required=True)

    def add(name: str, text: str, *, group: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=text, description=text, parents=[cluster])
        cmd.add_argument("group", nargs="?" if group == "optional" else None, help="the SingletonService's name")
        return cmd

    status = add("status", "leader, token, since and standbys of every group, or of one", group="optional")
    status.add_argument("-A", "--all-namespaces", action="store_true", help="groups in every namespace")
    status.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table")
    handover = add("handover", "planned switchover: the leader drains and a standby takes over", group="required")
    handover.add_argument("--to", default=None, metavar="POD", help="the standby that must take over")
    handover.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the new leader")
    release = add("release", "force-release a stuck lock (runbook): the operator does it inside the cluster and "
                             "records an Event naming you", group="required")
    release.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    release.add_argument("--timeout", type=float, default=30.0,
                         help="seconds to wait for the operator's answer (default 30; then the request is withdrawn)")
    release.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")
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
    inject.add_argument("-n", "--namespace", default=argparse.SUPPRESS,
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


def _dump(data: Any, output: str) -> str:
    return json.dumps(data, indent=2) if output == "json" else yaml.safe_dump(data, sort_keys=False).rstrip()


def run(args: argparse.Namespace, ctl: Ctl, namespace: str) -> int:
    if args.command == "status":
        views = ctl.status(None if args.all_namespaces else namespace, args.group)
        print(render_status(views, args.output, detail=args.group is not None))
    elif args.command == "handover":
        new, took = ctl.handover(namespace, args.group, args.to, timeout=args.timeout)
        print(f"{new} leads group {namespace}/{args.group} (handover took {took:.3f}s)")
    elif args.command == "release":
        done = ctl.release(namespace, args.group, timeout=args.timeout)
        if args.output == "text":
            for line in done:
                print(line)
        else:
            print(_dump({"namespace": namespace, "name": args.group, "done": done}, args.output))
    elif args.command == "history":
        rows = ctl.history(namespace, args.group)
        if args.output == "table":
            print(_table([["TIME", "OBJECT", "REASON", "MESSAGE"]] +
                         [[r["time"], r["object"], r["reason"], r["message"]] for r in rows]) if rows
                  else "No leadership events recorded (Events expire after an hour by default).")
        else:
            print(_dump(rows, args.output))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    prog = prog_name(sys.argv[0])
    args = parser(prog).parse_args(argv)
    try:
        if args.command == "inject":
            sys.stdout.write(inject_files(args.filename or ["-"], namespace=getattr(args, "namespace", "default"),
                                          sidecar_image=args.sidecar_image,
                                          pull_policy=args.sidecar_image_pull_policy,
                                          pull_secrets=args.sidecar_image_pull_secret or ()))
            return 0
        resolved = resolve(getattr(args, "kubeconfig", None), getattr(args, "context", None))
        namespace = getattr(args, "namespace", None) or resolved.namespace
        if args.command == "release" and not args.yes and not confirmed(namespace, args.group):
            print("Nothing done.")
            return 1
        try:
            api = BlockingKubeClient(resolved.kube_config(), user_agent=PLUGIN_NAME)
        except ValueError as exc:  # the server or proxy URL is not one
            raise CtlError(f"kubeconfig: {exc}") from None
        try:
            return run(args, Ctl(api, prog=prog), namespace)
        finally:
            api.close()
    except CtlError as exc:
        message = str(exc)
    except CLUSTER_ERRORS as exc:
        message = error_line(exc) or f"{type(exc).__name__}: {exc}"
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
