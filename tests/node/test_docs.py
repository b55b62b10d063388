"""The documentation is executed: every command of every ```sh block in README.md and
docs/*.md runs against the test bed, so the docs cannot rot.

Conventions (kept small on purpose):

- A command that cannot run here carries a trailing comment ``# not run by tests: REASON``
  (anywhere in the comment on its line, or on the last line of a continued command). Commands
  that plainly cannot run here (docker, kind, ``make test``/``make demo``, ``pip install``)
  must carry one; ``test_unrunnable_commands_are_marked`` checks that.
- An HTML comment on the line before a block, ``<!-- doc-test: setup=NAME [WORD=variable ...] -->``,
  gives the block its context; ``WORD=variable`` replaces a placeholder word of the block with
  a value of the context (a pod name, for example). Contexts:

  ``plain`` (the default)
      the session's cluster (kubectl's namespace ``default``), ``kubectl``/``helm`` of the
      test bed and the venv's console scripts on PATH, ``SINGLETON_TESTBED_STATE`` in a
      folder of the test's.
  ``postgres``
      plain, plus ``SINGLETON_POSTGRES_DSN`` exported (the session's PostgreSQL).
  ``chart``
      the chart is not installed yet; its pods run on the session's real node (below), so the
      operator the chart installs really runs; ``my-singletonservice.yaml`` (the README's
      SingletonService example) is in the working folder (the blocks create its namespace).
      Blocks of one document share one such context; it is torn down (helm uninstall, the
      namespaces the block created deleted) before the next document's.
  ``group``
      the group of ``make demo``: ``demo/feed-poller.yaml`` running in namespace ``feeds``
      (kubectl's namespace) on the session's real node, the operator (a process on this
      machine, ``--lease-namespace singleton-system``), backend ``postgres`` with its DSN in
      Secret ``feed-db`` (the session's PostgreSQL at the node IP, as the node's pods reach
      it). Before each block the group is settled (three ready pods, one leader, the status
      agreeing); variables ``leader`` and ``standby`` are pod names.

The ``chart`` and ``group`` blocks run their pods on the session's real node (containerd, runc,
kubelet, kube-proxy: conftest's ``real_node``), from the project's image (``project_image``,
imported into the node as ``ghcr.io/singleton-dev/singleton:0.1.0``, the chart's and the
operator's default image, pulled ``IfNotPresent``: nothing is pulled), so ``kubectl logs`` and
``exec`` work as on any cluster. They are the parameters of
``test_the_commands_of_the_docs_run_on_the_node``, which asks for those fixtures, so that they
run last with the other tests on that node (``pytest_collection_modifyitems``), after the
other blocks (``make testbed-up`` of docs/testbed.md wants the machine's one node for itself,
before the session's starts), and skip with ``real_node``'s reason when the session has no
real node (``USE_EXISTING_CLUSTER``, or a machine that cannot run one).

The node carries ``REAL_NODE_TAINT`` so that other tests' pods never land on it, and the
docs' manifests (the chart's defaults, ``demo/feed-poller.yaml``, the examples) tolerate no
taint, nor should they: a reader copies them. Adding the toleration for them would take a
mutating admission step the test bed's API server does not run, or rewriting the commands
the docs show. So while a ``chart`` or ``group`` context is active the taint is lifted, and
the context's teardown puts it back (first, so that a failing teardown cannot leave it off).
Meanwhile the node takes any pod the scheduler places there, as any untainted node would;
tests run one at a time and those on the node run last, so only a pod another test left
pending could land there.

Each block runs as one bash script (``bash -e -o pipefail -x``: it stops at the first failing
command, and a pipeline fails when any command of it fails; every ``curl`` the tests run carries
``-f``, so that an HTTP error is a failing command: ``test_every_curl_the_docs_run_fails_on_http_errors``),
from a folder mirroring the repository's top level (files a command writes land there),
with stdin closed. Background jobs a block leaves are killed with its process group.
``make`` never reinstalls the venv (``-o .venv/bin/.installed``).

Also here: every flag and variable of the settings tables of docs/sidecar.md and docs/operator.md appears in the
``--help`` of the program concerned, every ```python block compiles and its imports work, and
every SingletonService in a ```yaml block is accepted by the API server (dry run).
"""

from __future__ import annotations

import ast
import base64
import contextlib
import dataclasses
import http.server
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from singleton_operator.cli import DEFAULT_SIDECAR_IMAGE
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.postgres import PostgresInfo
from tests.conftest import REAL_NODE_TAINT, Cluster, RealNode
from tests.support.localhttp import serving
from tests.support.paths import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
FENCE = re.compile(r"^(?P<indent> {0,4})```(?P<lang>[\w+-]*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:(?P<body>.*?)-->\s*$")
MARKER = re.compile(r"#.*\bnot run by tests:\s*(?P<reason>.*?)\s*$")
HEREDOC = re.compile(r"<<-?\s*'?\"?(?P<word>[A-Za-z_]\w*)'?\"?")
MUST_BE_MARKED = re.compile(r"^(?:\w+=\S*\s+)*(?:docker\b|kind\b|pip3? install\b|"
                            r"make\s+(?:test|unit|lint|demo|demo-down|docker-build|image|check-static)\b)")
SETUPS = ("plain", "postgres", "chart", "group")
NODE_SETUPS = ("chart", "group")
"""The setups whose pods run on the session's real node."""
VARIABLES = {"group": ("leader", "standby")}
GROUP_NS, GROUP, RELEASE_NS = "feeds", "feed-poller", "singleton-system"
BLOCK_TIMEOUT = 240


# --- reading the documents ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Command:
    line: int
    """Line of the document where the command starts."""
    first: int
    """Index of its first line within the block."""
    lines: tuple[str, ...]
    skip: str | None

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclasses.dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    """Line of the opening fence."""
    lang: str
    body: tuple[str, ...]
    directive: str | None

    @property
    def id(self) -> str:
        return f"{self.doc.name}:{self.line}"

    @property
    def options(self) -> dict[str, str]:
        items = (self.directive or "").split()
        if not all("=" in item for item in items):
            raise ValueError(f"{self.id}: doc-test directive items must be KEY=VALUE: {self.directive!r}")
        return dict(item.split("=", 1) for item in items)

    @property
    def setup(self) -> str:
        return self.options.get("setup", "plain")

    @property
    def substitutions(self) -> dict[str, str]:
        return {k: v for k, v in self.options.items() if k != "setup"}

    def commands(self) -> list[Command]:
        commands: list[Command] = []
        index = 0
        while index < len(self.body):
            line = self.body[index]
            if not line.strip() or line.lstrip().startswith("#"):
                index += 1
                continue
            first = index
            lines = [line]
            while lines[-1].rstrip().endswith("\\") and index + 1 < len(self.body):
                index += 1
                lines.append(self.body[index])
            if heredoc := HEREDOC.search(" ".join(lines)):
                while index + 1 < len(self.body) and self.body[index].strip() != heredoc["word"]:
                    index += 1
                    lines.append(self.body[index])
            marker = MARKER.search(lines[-1] if not heredoc else lines[0])
            commands.append(Command(self.line + 1 + first, first, tuple(lines),
                                    marker["reason"] if marker else None))
            index += 1
        return commands


def read_blocks(doc: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = doc.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None or not opening["lang"]:
            index += 1
            continue
        indent = len(opening["indent"])
        previous = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        directive = DIRECTIVE.match(previous)
        body: list[str] = []
        start = index
        index += 1
        while index < len(lines) and not re.match(r"^ {0,4}```\s*$", lines[index]):
            body.append(lines[index][indent:] if lines[index][:indent].strip() == "" else lines[index])
            index += 1
        blocks.append(Block(doc, start + 1, opening["lang"], tuple(body),
                            directive["body"].strip() if directive else None))
        index += 1
    return blocks


ALL_BLOCKS = [block for doc in DOCS for block in read_blocks(doc)]
SH_BLOCKS = sorted((b for b in ALL_BLOCKS if b.lang == "sh"),
                   key=lambda b: (SETUPS.index(b.setup) if b.setup in SETUPS else -1, DOCS.index(b.doc), b.line))


def test_the_docs_have_commands() -> None:
    assert len(SH_BLOCKS) >= 15, [b.id for b in SH_BLOCKS]
    assert {b.doc.name for b in SH_BLOCKS} >= {"README.md", "gating.md", "runbook.md", "kind.md"}


def test_directives_name_known_setups_and_variables() -> None:
    for block in ALL_BLOCKS:
        if block.directive is None:
            continue
        assert block.lang == "sh", f"{block.id}: doc-test directives apply to ```sh blocks"
        assert block.setup in SETUPS, f"{block.id}: unknown setup {block.setup!r} (known: {SETUPS})"
        known = VARIABLES.get(block.setup, ())
        for word, variable in block.substitutions.items():
            assert variable in known, f"{block.id}: {word}={variable}: setup {block.setup} provides {known}"
            assert re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", "\n".join(block.body)), \
                f"{block.id}: placeholder {word!r} does not occur in the block"


def test_unrunnable_commands_are_marked() -> None:
    """Commands that cannot run in the tests say so, with a reason; the rest run."""
    unmarked = []
    for block in SH_BLOCKS:
        for command in block.commands():
            if command.skip is not None:
                assert command.skip, f"{block.doc.name}:{command.line}: 'not run by tests:' needs a reason"
            elif MUST_BE_MARKED.match(command.lines[0].strip()):
                unmarked.append(f"{block.doc.name}:{command.line}: {command.lines[0].strip()}")
    assert not unmarked, "mark these with '# not run by tests: REASON':\n" + "\n".join(unmarked)


# --- the contexts ------------------------------------------------------------------------------


def _kubeconfig_copy(cluster: Cluster, path: Path, namespace: str) -> Path:
    config = json.loads(cluster.kubectl("config", "view", "--minify", "--raw", "-o", "json").stdout)
    for context in config["contexts"]:
        context["context"]["namespace"] = namespace
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


def _namespaces(cluster: Cluster) -> set[str]:
    listing = json.loads(cluster.kubectl("get", "namespaces", "-o", "json").stdout)
    return {item["metadata"]["name"] for item in listing["items"]}


def _create_namespace(cluster: Cluster, name: str) -> None:
    """Create it, waiting first for an earlier one of that name to finish terminating."""
    deadline = time.monotonic() + 120
    while name in _namespaces(cluster):
        assert time.monotonic() < deadline, f"namespace {name} is still terminating"
        time.sleep(0.5)
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("create", "serviceaccount", "default", "-n", name, check=False)


def _delete_namespaces(cluster: Cluster, names: set[str]) -> None:
    if names:
        cluster.kubectl("delete", "namespace", *sorted(names), "--wait=true", "--timeout=120s",
                        "--ignore-not-found", check=False)


def _set_node_taint(node: RealNode, *, present: bool) -> None:
    """Put ``REAL_NODE_TAINT`` on the session's node, or lift it (see the module docstring)."""
    key, value, effect = REAL_NODE_TAINT["key"], REAL_NODE_TAINT["value"], REAL_NODE_TAINT["effect"]
    if present:
        node.cluster.kubectl("taint", "nodes", node.name, f"{key}={value}:{effect}", "--overwrite")
        return
    taints = json.loads(node.cluster.kubectl("get", "node", node.name, "-o", "json").stdout)["spec"].get("taints")
    if any(t.get("key") == key and t.get("effect") == effect for t in taints or []):
        # kubectl refuses to remove a taint that is not there: only when it is.
        node.cluster.kubectl("taint", "nodes", node.name, f"{key}:{effect}-")


def _readme_example() -> str:
    for block in read_blocks(REPO_ROOT / "README.md"):
        if block.lang == "yaml" and any(line.startswith("kind: SingletonService") for line in block.body):
            return "\n".join(block.body) + "\n"
    raise AssertionError("README.md has no SingletonService example")


def _leader_and_standby(cluster: Cluster, namespace: str) -> dict[str, str] | None:
    """The settled group's leader and a ready standby, or None while it is not settled."""
    pods = [p for p in json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l",
                                                  f"singleton.dev/group={GROUP}", "-o", "json").stdout)["items"]
            if not p["metadata"].get("deletionTimestamp")]
    status = json.loads(cluster.kubectl("get", "sgl", GROUP, "-n", namespace, "-o", "json").stdout).get("status")
    roles = {p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get("singleton.dev/role") for p in pods}
    ready = all(any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
                for p in pods)
    leaders = [name for name, role in roles.items() if role == "leader"]
    standbys = sorted(name for name, role in roles.items() if role == "standby")
    if len(pods) != 3 or not ready or len(leaders) != 1 or len(standbys) != 2 or not status:
        return None
    if status.get("leader") != leaders[0] or status.get("phase") != "Running" or status.get("readyStandbys") != 2:
        return None
    return {"leader": leaders[0], "standby": standbys[0]}


@dataclasses.dataclass
class Context:
    name: str
    kubeconfig: Path
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    namespaces_before: set[str] = dataclasses.field(default_factory=set)
    node: RealNode | None = None
    """The session's node, its taint lifted while this context is active."""
    operator: OperatorProcess | None = None


class Contexts:
    """One context at a time: entering another tears the current one down."""

    def __init__(self, cluster: Cluster, workdir: Path, pg_dsn: str, pg_info: PostgresInfo | None) -> None:
        self.cluster, self.workdir, self.pg_dsn, self.pg_info = cluster, workdir, pg_dsn, pg_info
        self.current: Context | None = None
        self.key: tuple[str, str] | None = None
        self.mirror = workdir / "repo"
        self.mirror.mkdir()
        for entry in REPO_ROOT.iterdir():
            if entry.name not in (".git", ".mypy_cache", ".pytest_cache", ".ruff_cache"):
                (self.mirror / entry.name).symlink_to(entry)
        tools = workdir / "tools"
        tools.mkdir()
        make = shutil.which("make") or "/usr/bin/make"
        (tools / "make").write_text(f'#!/bin/sh\nexec {make} -o .venv/bin/.installed "$@"\n')
        (tools / "make").chmod(0o755)
        self.path = os.pathsep.join([str(tools), str(VENV_BIN), os.environ.get("PATH", "")])
        self.testbed_state = workdir / "testbed-state"

    def enter(self, block: Block, node: RealNode | None = None) -> Context:
        """The block's context; ``node`` is the session's real node, which the setups in
        ``NODE_SETUPS`` run their pods on."""
        key = (block.setup, block.doc.name if block.setup == "chart" else "")
        if self.key != key:
            self.close()
            self.current = self._setup(block.setup, block.doc.name, node)
            self.key = key
        assert self.current is not None
        return self.current

    def _setup(self, setup: str, doc: str, node: RealNode | None) -> Context:
        if setup in ("plain", "postgres"):
            context = Context(setup, _kubeconfig_copy(self.cluster, self.workdir / f"{setup}.kubeconfig", "default"))
            if setup == "postgres":
                context.env["SINGLETON_POSTGRES_DSN"] = self.pg_dsn
            return context
        assert node is not None, f"setup {setup} runs pods on the session's real node: none was given"
        if setup == "group" and self.pg_info is None:
            pytest.skip("setup group needs the session's own PostgreSQL (reachable from the node's pods)")
        context = Context(setup, self.workdir / f"{setup}-{doc or 'all'}.kubeconfig",
                          namespaces_before=_namespaces(self.cluster), node=node)
        self.current = context  # so close() undoes a half-done setup (the taint included)
        _set_node_taint(node, present=False)
        if setup == "chart":
            (self.mirror / "my-singletonservice.yaml").write_text(_readme_example())
            _kubeconfig_copy(self.cluster, context.kubeconfig, "default")
            return context
        assert self.pg_info is not None
        for namespace in (RELEASE_NS, GROUP_NS):
            _create_namespace(self.cluster, namespace)
        # The pods reach this machine's PostgreSQL at the node IP (it admits the node's pod
        # network); so does the operator, which runs here and checks the DSN the pods get.
        dsn = dataclasses.replace(self.pg_info, host=node.node.layout.node_ip).dsn
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "feed-db"},
                  "data": {"dsn": base64.b64encode(dsn.encode()).decode()}}
        self.cluster.apply(json.dumps(secret), namespace=GROUP_NS)
        context.operator = OperatorProcess(self.cluster.kubeconfig, RELEASE_NS, self.workdir / "operator.log",
                                           name="docs-operator", extra_args=["--namespace", GROUP_NS]).start()
        self.cluster.kubectl("apply", "-n", GROUP_NS, "-f", str(REPO_ROOT / "demo" / "feed-poller.yaml"))
        _kubeconfig_copy(self.cluster, context.kubeconfig, GROUP_NS)
        self.variables(context)
        return context

    def variables(self, context: Context) -> dict[str, str]:
        if context.name != "group":
            return {}
        deadline = time.monotonic() + 120
        while (found := _leader_and_standby(self.cluster, GROUP_NS)) is None:
            if time.monotonic() > deadline:
                pods = self.cluster.kubectl("get", "pods", "-n", GROUP_NS, "-o", "wide", check=False)
                raise AssertionError(f"the group did not settle:\n{pods.stdout}{pods.stderr}\n" + (
                    context.operator.log()[-3000:] if context.operator else ""))
            time.sleep(0.3)
        return found

    def close(self) -> None:
        context, self.current, self.key = self.current, None, None
        if context is None:
            return
        try:
            if context.node is not None:
                # First: whatever fails below, other tests' pods must not land on the node. The
                # context's own pods run on (NoSchedule evicts nobody) until they are deleted.
                _set_node_taint(context.node, present=True)
        finally:
            if context.name == "chart":
                subprocess.run(["helm", "uninstall", "singleton", "-n", RELEASE_NS, "--wait", "--timeout", "90s"],
                               env=self.cluster.env, capture_output=True, check=False, timeout=120)
            if context.name in NODE_SETUPS:
                _delete_namespaces(self.cluster, _namespaces(self.cluster) - context.namespaces_before)
            if context.operator is not None:
                context.operator.stop()
            (self.mirror / "my-singletonservice.yaml").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def contexts(controllers: Cluster, singleton_crd: Path, pg_dsn: str, pg_info: PostgresInfo | None,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Contexts]:
    manager = Contexts(controllers, tmp_path_factory.mktemp("docs"), pg_dsn, pg_info)
    try:
        yield manager
    finally:
        manager.close()


# --- running the blocks ------------------------------------------------------------------------


def _substitute(text: str, substitutions: dict[str, str], values: dict[str, str]) -> str:
    for word, variable in substitutions.items():
        text = re.sub(rf"(?<![\w-]){re.escape(word)}(?![\w-])", values[variable], text)
    return text


def script_of(block: Block, values: dict[str, str]) -> str:
    """The block as a bash script: skipped commands become no-ops (line numbers kept)."""
    lines = list(block.body)
    for command in block.commands():
        if command.skip is not None:
            for offset in range(len(command.lines)):
                lines[command.first + offset] = f": skipped, not run by tests: {command.skip!r}" if offset == 0 else ""
    return _substitute("\n".join(lines), block.substitutions, values) + "\n"


def _run(script: str, *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-x", "-c", script], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return subprocess.CompletedProcess(proc.args, -9, output + f"\n(timed out after {BLOCK_TIMEOUT} s)", "")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # background jobs the block left
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")


NODE_BLOCKS = [b for b in SH_BLOCKS if b.setup in NODE_SETUPS]
OTHER_BLOCKS = [b for b in SH_BLOCKS if b.setup not in NODE_SETUPS]


@pytest.mark.k8s
@pytest.mark.controlplane
@pytest.mark.postgres
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", OTHER_BLOCKS, ids=lambda b: b.id)
def test_the_commands_of_the_docs_run(block: Block, contexts: Contexts) -> None:
    run_doc_block(block, contexts, None)


@pytest.mark.k8s
@pytest.mark.controlplane
@pytest.mark.postgres
@pytest.mark.image
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", NODE_BLOCKS, ids=lambda b: b.id)
def test_the_commands_of_the_docs_run_on_the_node(block: Block, real_node: RealNode, project_image: str,
                                                  contexts: Contexts) -> None:
    """The ``chart`` and ``group`` blocks, on the session's real node (see the module docstring:
    asking for ``real_node`` makes them run last, and skip with its reason). ``real_node`` comes
    before ``contexts``, so that it is set up first and its skip comes before anything else
    touches the cluster."""
    # The docs, the chart and the operator name this image with pull policy IfNotPresent: any
    # other reference would send the node to a registry it cannot reach.
    assert project_image == DEFAULT_SIDECAR_IMAGE, f"the project's image is {project_image}, the docs use " \
                                                   f"{DEFAULT_SIDECAR_IMAGE}"
    run_doc_block(block, contexts, real_node)


def run_doc_block(block: Block, contexts: Contexts, node: RealNode | None) -> None:
    """Enter the block's context and run its commands, which must all succeed."""
    runnable = [c for c in block.commands() if c.skip is None]
    if not runnable:
        pytest.skip("every command of this block is marked 'not run by tests'")
    context = contexts.enter(block, node)
    env = {**os.environ, "KUBECONFIG": str(context.kubeconfig), "PATH": contexts.path,
           "SINGLETON_TESTBED_STATE": str(contexts.testbed_state), "PS4": "+ [doc line $LINENO] ", **context.env}
    if any(re.search(r"(^|[\s;(|&])singletonctl\b", c.text) for c in runnable) and \
            shutil.which("singletonctl", path=env["PATH"]) is None:
        pytest.skip("the singletonctl console script is not installed (yet): pip install -e . provides it")
    values = contexts.variables(context)
    try:
        result = _run(script_of(block, values), cwd=contexts.mirror, env=env)
    finally:
        if (contexts.testbed_state / "testbed.json").exists():  # a `make testbed-up` that was not brought down
            subprocess.run([str(VENV_BIN / "singleton-testbed"), "down"], env=env, capture_output=True, check=False)
    print(result.stdout)  # shown with -rP
    if result.returncode != 0 and context.name == "group":
        print(_group_logs(contexts.cluster))  # what the sidecars saw: shown with the failure
    check_block_ran(block, result)


def _group_logs(cluster: Cluster) -> str:
    """The last lines of every container of the group's pods (their sidecars' view of a failed block)."""
    logs = cluster.kubectl("logs", "-n", GROUP_NS, "-l", f"singleton.dev/group={GROUP}", "--all-containers",
                           "--prefix", "--tail=150", "--max-log-requests=10", check=False)
    return f"--- the group's containers' logs ---\n{logs.stdout}{logs.stderr}"


def check_block_ran(block: Block, result: subprocess.CompletedProcess[str]) -> None:
    """The verdict on a block's run: every command succeeded."""
    assert result.returncode == 0, (
        f"{block.id} (setup {block.setup}) failed with status {result.returncode}; doc line numbers are "
        f"relative to the block (line {block.line} + N):\n{result.stdout[-6000:]}")


# --- an HTTP error fails a block ----------------------------------------------------------------

CURL = re.compile(r"(?<![\w-])curl(?P<args>(?:\s+(?!#)[^\s|;&)]+)*)")
CURL_OPTIONS_WITH_ARGUMENT = set("AbcCdDeEFHKmoPQrtTuUwxXyYz")
"""Short options of curl that take an argument (the rest of their cluster, or the next word)."""


def curl_fails_on_http_errors(args: str) -> bool:
    """Whether curl, given these arguments, exits non-zero on an HTTP error (``-f``, ``--fail``,
    ``--fail-with-body``; ``-f`` may sit in a cluster such as ``-sSf``)."""
    try:
        words = shlex.split(args)
    except ValueError:
        words = args.split()
    argument_next = False
    for word in words:
        if argument_next:
            argument_next = False
            continue
        if word in ("--fail", "--fail-with-body"):
            return True
        if word.startswith("-") and not word.startswith("--"):
            for index, letter in enumerate(word[1:], start=1):
                if letter == "f":
                    return True
                if letter in CURL_OPTIONS_WITH_ARGUMENT:
                    argument_next = index == len(word) - 1
                    break
    return False


def curls_without_fail(text: str) -> list[str]:
    """The curl commands of a shell command that an HTTP error would not fail."""
    return [f"curl{m['args']}" for m in CURL.finditer(text) if not curl_fails_on_http_errors(m["args"])]


@pytest.mark.parametrize(("command", "lacking"), [
    ("curl -sf 127.0.0.1:1/leader", []),
    ("curl -fsS 127.0.0.1:1/x | grep y", []),
    ("curl --fail -s http://h/x", []),
    ("curl -s --fail-with-body http://h/x", []),
    ("x=$(curl -sSf http://h/x) && echo $x", []),
    ("curl -s 127.0.0.1:1/metrics | grep '^a'", ["curl -s 127.0.0.1:1/metrics"]),
    ("curl -o f http://h/x", ["curl -o f http://h/x"]),  # f is -o's file
    ("curl -XPOST -s http://h/x", ["curl -XPOST -s http://h/x"]),
    ("echo a; curl http://h/x && curl -f http://h/y", ["curl http://h/x"]),
])
def test_the_curl_check_reads_flags_as_curl_does(command: str, lacking: list[str]) -> None:
    assert curls_without_fail(command) == lacking


def test_every_curl_the_docs_run_fails_on_http_errors() -> None:
    """``curl`` exits 0 on a 404 or a 503 unless told ``-f``: a doc command that fetches an
    endpoint would pass the doc tests whatever the endpoint answered."""
    lacking = [f"{block.doc.name}:{command.line}: {curl}" for block in SH_BLOCKS for command in block.commands()
               if command.skip is None for curl in curls_without_fail(command.text)]
    assert not lacking, "give these -f (--fail), so that an HTTP error fails the doc test:\n" + "\n".join(lacking)


class _Pages(http.server.BaseHTTPRequestHandler):
    """/ok answers 200, /unavailable 503, anything else 404; each with a body, as a server's error
    pages have."""

    def do_GET(self) -> None:
        status = {"/ok": 200, "/unavailable": 503}.get(self.path, 404)
        body = f"page says {status}\n".encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the test's output is the blocks'


@pytest.fixture
def pages() -> Iterator[str]:
    with serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pages), "doc-test-pages") as url:
        yield url


def _block(tmp_path: Path, *lines: str) -> Block:
    return Block(tmp_path / "probe.md", 1, "sh", lines, None)


def _run_block(block: Block, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return _run(script_of(block, {}), cwd=tmp_path, env={**os.environ, "PS4": "+ [doc line $LINENO] "})


@pytest.mark.parametrize(("path", "status"), [("/missing", 404), ("/unavailable", 503)])
def test_a_doc_block_whose_curl_gets_an_http_error_fails(pages: str, tmp_path: Path, path: str, status: int) -> None:
    after = tmp_path / "after"
    # Without -f, curl prints the error page and exits 0: the block would run on and pass.
    plain = _run_block(_block(tmp_path, f"curl -s {pages}{path}", f"touch {after}"), tmp_path)
    assert plain.returncode == 0 and f"page says {status}" in plain.stdout, plain.stdout
    assert after.exists()
    after.unlink()
    # With -f it exits 22, alone or inside a pipeline, and the block stops there and fails.
    for command in (f"curl -sf {pages}{path}", f"curl -sf {pages}{path} | cat"):
        block = _block(tmp_path, command, f"touch {after}")
        result = _run_block(block, tmp_path)
        assert result.returncode == 22, result.stdout  # curl: "HTTP page not retrieved" (--fail)
        assert not after.exists(), f"the block went on after `{command}` failed:\n{result.stdout}"
        with pytest.raises(AssertionError, match=r"probe\.md:1 \(setup plain\) failed with status 22"):
            check_block_ran(block, result)
    # The same block against a page that answers 200 runs to its end and passes.
    block = _block(tmp_path, f"curl -sf {pages}/ok | cat", f"touch {after}")
    result = _run_block(block, tmp_path)
    check_block_ran(block, result)
    assert "page says 200" in result.stdout and after.exists(), result.stdout


# --- the other kinds of blocks, and --help -------------------------------------------------------


PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]
YAML_GROUPS = [b for b in ALL_BLOCKS if b.lang == "yaml" and any(line.startswith("kind: SingletonService")
                                                                 for line in b.body)]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_examples_compile_and_their_imports_work(block: Block) -> None:
    source = "\n".join(block.body)
    tree = compile(source, block.id, "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    compile(tree, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    imports = ast.Module(body=[node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)],
                         type_ignores=[])
    exec(compile(imports, block.id, "exec"), {})  # the docs' own import lines


@pytest.mark.k8s
@pytest.mark.parametrize("block", YAML_GROUPS, ids=lambda b: b.id)
def test_singletonservice_examples_are_accepted(block: Block, cluster: Cluster, singleton_crd: Path,
                                                namespace: str) -> None:
    body: dict[str, Any] = yaml.safe_load("\n".join(block.body))
    body["metadata"].pop("namespace", None)
    result = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input_text=json.dumps(body),
                             check=False)
    assert result.returncode == 0, f"{block.id}: {result.stderr}"


def _table_rows(doc: Path, heading: str) -> list[list[str]]:
    """The rows of the first table after ``heading``, as lists of cells."""
    text = doc.read_text()
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # header and separator


def _help(*argv: str) -> str:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout


def test_every_sidecar_setting_of_the_readme_is_in_its_help() -> None:
    rows = _table_rows(REPO_ROOT / "docs" / "sidecar.md", "## Settings")
    assert len(rows) >= 15
    text = _help(str(VENV_BIN / "singleton-sidecar"), "run", "--help")
    for variables, flags, *_ in rows:
        for name in re.findall(r"SINGLETON_[A-Z_]+", variables) + re.findall(r"--[a-z][a-z-]*", flags):
            assert name in text, (f"docs/sidecar.md's settings table names {name}, "
                                  "`singleton-sidecar run --help` does not")


def test_every_operator_setting_of_the_readme_is_in_its_help() -> None:
    rows = _table_rows(REPO_ROOT / "docs" / "operator.md", "## High availability of the operator")
    assert len(rows) >= 5
    text = _help(str(VENV_BIN / "singleton-operator"), "run", "--help")
    for flags, variables, *_ in rows:
        for name in re.findall(r"--[a-z][a-z-]*", flags) + re.findall(r"\b[A-Z][A-Z_]+[A-Z]\b", variables):
            assert name in text, (f"docs/operator.md's operator table names {name}, "
                                  "`singleton-operator run --help` does not")
