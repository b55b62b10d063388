"""The objects a SingletonService owns, built as plain dicts (pure; no I/O).

Per group: a ServiceAccount, Role and RoleBinding for its sidecars; a Deployment whose
pods carry the sidecar; an optional leader-only Service; a PodDisruptionBudget.

Rollouts cannot deadlock: pod readiness means "ready to lead" (the sidecar's
``/candidate``), not "leads", so a new pod becomes Ready while the old one leads. Traffic
reaches only the leader through the leader Service, which selects the role label the
sidecar keeps on its own pod. The Deployment replaces one pod at a time
(maxSurge 1, maxUnavailable 0), and the leader's pod carries a high
``pod-deletion-cost``, so the old ReplicaSet removes its standbys first and the leader
last, when every other pod is of the new revision: exactly one handover per rollout,
to a new pod.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from singleton_election import contract
from singleton_operator.model import spec as specs
from singleton_operator.model.spec import GroupSpec, StartOrder, WorkloadRef, format_seconds, seconds_to_ns

# The names the operator injects live with the rules that reserve them (spec.py).
SIDECAR_CONTAINER = specs.SIDECAR_CONTAINER
GATE_VOLUME = specs.GATE_VOLUME
GATE_DIR = specs.GATE_DIR

FIELD_MANAGER = "singleton-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_PART_OF = "app.kubernetes.io/part-of"
MANAGED_BY = "singleton-operator"


def sidecar_account(spec: GroupSpec) -> str:
    """Name of the group's ServiceAccount, Role and RoleBinding (the chart's admission policy
    recognises sidecars by this prefix)."""
    return f"singleton-sidecar-{spec.name}"


def leader_service_name(spec: GroupSpec) -> str:
    return f"{spec.name}-leader"


def selector_labels(spec: GroupSpec) -> dict[str, str]:
    return {contract.LABEL_GROUP: spec.name}


ANNOTATION_PROPAGATE = f"{contract.API_GROUP}/propagate-annotations"
"""On a SingletonService: the annotation keys (comma-separated; ``prefix/*`` for every key of a
prefix) copied from it to the objects it owns."""
NOT_PROPAGATED_PREFIXES = ("argocd.argoproj.io/", "kustomize.toolkit.fluxcd.io/", "helm.toolkit.fluxcd.io/",
                           "kubectl.kubernetes.io/", f"operator.{contract.API_GROUP}/")
"""Keys that say which tool applied the SingletonService (or hold that tool's state): true of it,
false of what the operator makes, and a GitOps tool that found them on our objects would claim,
report as out of sync, or prune them."""


def default_labels(spec: GroupSpec) -> dict[str, str]:
    """Recommended labels that the user's own values override."""
    return {LABEL_INSTANCE: spec.name, LABEL_PART_OF: "singleton"}


def common_labels(spec: GroupSpec) -> dict[str, str]:
    return {**default_labels(spec), LABEL_MANAGED_BY: MANAGED_BY}


def propagated_labels(spec: GroupSpec) -> dict[str, str]:
    """The SingletonService's labels that its objects get: all but GitOps tools' tracking labels
    and ``app.kubernetes.io/instance``, which Argo CD's label tracking uses (the objects keep
    ours, the group's name). Ours (managed-by, group) are not overridable: the operator finds
    its objects by them."""
    return {k: v for k, v in spec.labels.items()
            if not k.startswith(NOT_PROPAGATED_PREFIXES) and k not in (LABEL_INSTANCE, LABEL_MANAGED_BY)
            and k not in selector_labels(spec)}


def propagated_annotations(spec: GroupSpec) -> dict[str, str]:
    """The annotations named by ``singleton.dev/propagate-annotations`` on the SingletonService."""
    wanted = [k.strip() for k in spec.annotations.get(ANNOTATION_PROPAGATE, "").split(",") if k.strip()]
    exact = {k for k in wanted if not k.endswith("/*")}
    prefixes = tuple(k[:-1] for k in wanted if k.endswith("/*"))
    return {k: v for k, v in spec.annotations.items()
            if (k in exact or (prefixes and k.startswith(prefixes)))
            and k != ANNOTATION_PROPAGATE and not k.startswith(NOT_PROPAGATED_PREFIXES)}


def object_labels(spec: GroupSpec) -> dict[str, str]:
    return {**default_labels(spec), **propagated_labels(spec), LABEL_MANAGED_BY: MANAGED_BY,
            **selector_labels(spec)}


def owner_reference(spec: GroupSpec) -> dict[str, Any]:
    return {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
            "name": spec.name, "uid": spec.uid, "controller": True, "blockOwnerDeletion": True}


def _metadata(spec: GroupSpec, name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": spec.namespace, "labels": object_labels(spec),
                                "ownerReferences": [owner_reference(spec)]}
    merged = {**propagated_annotations(spec), **(annotations or {})}
    if merged:
        metadata["annotations"] = merged
    return metadata


def service_account(spec: GroupSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(spec, sidecar_account(spec))}


def role(spec: GroupSpec) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _metadata(spec, sidecar_account(spec)), "rules": contract.sidecar_rbac_rules(spec.name)}


def role_binding(spec: GroupSpec) -> dict[str, Any]:
    user_account = (spec.template.get("spec") or {}).get("serviceAccountName")
    if spec.workload_ref is None:
        accounts = {sidecar_account(spec)}
        if user_account:
            accounts.add(user_account)
    else:
        # Adopted pods keep the account their workload gives them (the sidecar runs as it).
        accounts = {user_account or "default"}
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _metadata(spec, sidecar_account(spec)),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sidecar_account(spec)},
            "subjects": [{"kind": "ServiceAccount", "name": a, "namespace": spec.namespace} for a in sorted(accounts)]}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _seconds(value: float) -> str:
    # Exact to the nanosecond, as the spec gave it: a rounded figure (":g" keeps 6 digits, so
    # 2.4000001 became 2.4) could break a timing rule the sidecar checks again at start.
    return format_seconds(seconds_to_ns(value))


def sidecar_env(spec: GroupSpec) -> list[dict[str, Any]]:
    timings = spec.timings
    env: list[dict[str, Any]] = [
        {"name": contract.ENV_GROUP, "value": spec.name},
        {"name": contract.ENV_BACKEND, "value": spec.backend},
        {"name": contract.ENV_LOCK_KEY, "value": contract.lock_key(spec.name, spec.namespace)},
        _field_env(contract.ENV_NAMESPACE, "metadata.namespace"),
        _field_env(contract.ENV_POD_NAME, "metadata.name"),
        _field_env(contract.ENV_POD_UID, "metadata.uid"),
        {"name": contract.ENV_LISTEN, "value": f"0.0.0.0:{spec.sidecar_port}"},
        {"name": contract.ENV_CONTROL_LISTEN, "value": f"127.0.0.1:{spec.sidecar_port + 1}"},
        {"name": contract.ENV_LEASE_DURATION, "value": _seconds(timings.lease_duration)},
        {"name": contract.ENV_RENEW_DEADLINE, "value": _seconds(timings.renew_deadline)},
        {"name": contract.ENV_RETRY_PERIOD, "value": _seconds(timings.retry_period)},
        {"name": contract.ENV_DRAIN_TIMEOUT, "value": _seconds(spec.drain_timeout)},
        {"name": contract.ENV_DRAIN_WAIT_CONTAINER, "value": spec.main_container},
        {"name": contract.ENV_NATIVE_SIDECAR, "value": "true"},
        {"name": contract.ENV_SOLE_CANDIDATE_IN_POD, "value": "true"},  # one sidecar container per pod
        {"name": contract.ENV_LOG_FORMAT, "value": "json"},
        {"name": contract.ENV_LOG_LEVEL, "value": spec.sidecar_log_level},
    ]
    if spec.drain_hook_url:
        env.append({"name": contract.ENV_DRAIN_URL, "value": spec.drain_hook_url})
    if spec.gating == "file":
        env.append({"name": contract.ENV_GATE_DIR, "value": GATE_DIR})
    if spec.uses_postgres:
        env.append({"name": contract.ENV_POSTGRES_DSN, "valueFrom": {"secretKeyRef": {
            "name": spec.postgres_secret, "key": spec.postgres_secret_key}}})
        if spec.postgres_mode != "session":  # only when set: existing groups' pods stay as they are
            env.append({"name": contract.ENV_POSTGRES_MODE, "value": spec.postgres_mode})
    return env


def _probe(path: str, port: int, *, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": timeout}


def sidecar_container(spec: GroupSpec) -> dict[str, Any]:
    """A native sidecar (an init container that keeps running): it starts before the app,
    and the kubelet stops it only after the app has stopped."""
    container: dict[str, Any] = {
        "name": SIDECAR_CONTAINER,
        "image": spec.sidecar_image,
        "command": ["singleton-sidecar", "run"],
        "restartPolicy": "Always",
        "env": sidecar_env(spec),
        **({"imagePullPolicy": spec.sidecar_pull_policy} if spec.sidecar_pull_policy else {}),
        "ports": [{"name": specs.SIDECAR_PORT_NAME, "containerPort": spec.sidecar_port, "protocol": "TCP"}],
        # A starved node answers late: a probe that times out restarts the sidecar (liveness) or
        # takes the pod out of the rollout's count (readiness), so timeouts are generous; /livez
        # itself fails fast when the election loop stalls, and /candidate says 503 at once on drain.
        "startupProbe": _probe("/livez", spec.sidecar_port, period=1, failures=60, timeout=3),
        "readinessProbe": _probe("/candidate", spec.sidecar_port, period=1, failures=1, timeout=2),
        "livenessProbe": _probe("/livez", spec.sidecar_port, period=5, failures=3, timeout=3),
        "resources": spec.sidecar_resources or {"requests": {"cpu": "10m", "memory": "64Mi"},
                                                "limits": {"memory": "128Mi"}},
        "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if spec.gating == "file":
        container["volumeMounts"] = [{"name": GATE_VOLUME, "mountPath": GATE_DIR}]
    return container


def is_native_sidecar(container: Mapping[str, Any]) -> bool:
    """An init container that keeps running beside the app (``restartPolicy: Always``)."""
    return container.get("restartPolicy") == "Always"


def place_sidecar(sidecar: dict[str, Any], init_containers: Sequence[dict[str, Any]],
                  order: StartOrder) -> list[dict[str, Any]]:
    """``init_containers`` (without the sidecar) with ``sidecar`` placed by ``order``. The kubelet
    starts init containers one by one, a native sidecar's successor once its startup probe
    passes. ``AfterSidecars`` puts the sidecar right after the first native sidecars in a row (a
    mesh proxy, which must carry the sidecar's connections; the mesh's own setup containers,
    such as ``istio-init`` or ``linkerd-init``, stand ahead of it), so before the init containers
    that follow them (the user's migrations); first of all when there is no native sidecar, as
    before this setting existed. ``First`` puts it ahead of everything; ``Last`` after every
    init container (it campaigns only once the pod's own init work, a migration say, is done)."""
    others = [c for c in init_containers if c.get("name") != sidecar.get("name")]
    if order == "First":
        at = 0
    elif order == "Last":
        at = len(others)
    else:
        first = next((i for i, c in enumerate(others) if is_native_sidecar(c)), None)
        at = 0
        if first is not None:
            at = next((i for i in range(first, len(others)) if not is_native_sidecar(others[i])), len(others))
    return [*others[:at], sidecar, *others[at:]]


def _gated_command(command: list[str]) -> list[str]:
    return ["/bin/sh", "-c", _gate_script(), "singleton-gate", *command]


def uninjected_template(template: dict[str, Any]) -> dict[str, Any]:
    """A pod template without what injection added (the sidecar, the gate volume and mounts, the
    gate wrapper around the main command): what the group's rules are checked on when a workload
    was injected before it is adopted (``singletonctl inject``)."""
    result = copy.deepcopy(template)
    pod = result.get("spec") or {}
    inits = [c for c in pod.get("initContainers") or [] if c.get("name") != SIDECAR_CONTAINER]
    pod["initContainers"] = inits
    pod["volumes"] = [v for v in pod.get("volumes") or [] if v.get("name") != GATE_VOLUME]
    for key in ("initContainers", "volumes"):
        if not pod[key]:
            del pod[key]
    for container in pod.get("containers") or []:
        mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != GATE_VOLUME]
        if "volumeMounts" in container:
            container["volumeMounts"] = mounts
        command = container.get("command") or []
        if command[:2] == ["/bin/sh", "-c"] and command[2:4] == [_gate_script(), "singleton-gate"]:
            container["command"] = command[4:]
    return result


def _gate_script() -> str:
    # gate.sh is written by the sidecar; the native sidecar starts first, but wait anyway
    # so the wrapper also works if the app container starts early.
    return (f'while [ ! -f {GATE_DIR}/gate.sh ]; do sleep 0.2; done; '
            f'exec /bin/sh {GATE_DIR}/gate.sh "$@"')


def _main_container(spec: GroupSpec, container: dict[str, Any]) -> dict[str, Any]:
    main = copy.deepcopy(container)
    # Ours replace the user's entries of the same names, so the app always reaches its own
    # sidecar (an explicit env entry also beats any envFrom). They come first, so the user's
    # entries can refer to them as $(SINGLETON_LEADER_URL): Kubernetes expands a reference
    # only to a variable defined earlier in the list.
    ours = [{"name": "SINGLETON_LEADER_URL", "value": f"http://127.0.0.1:{spec.sidecar_port}/leader"},
            {"name": "SINGLETON_CONTROL_URL", "value": f"http://127.0.0.1:{spec.sidecar_port + 1}"},
            {"name": contract.ENV_GROUP, "value": spec.name}]
    names = {e["name"] for e in ours}
    main["env"] = [*ours, *(e for e in main.get("env") or [] if e.get("name") not in names)]
    if "readinessProbe" not in main:
        # Ready to take over, not "leading": see the module docstring.
        main["readinessProbe"] = _probe("/candidate", spec.sidecar_port, period=1, failures=1, timeout=2)
    if spec.gating == "file":
        main["command"] = _gated_command(list(main["command"]))
        main["volumeMounts"] = [*(main.get("volumeMounts") or []), {"name": GATE_VOLUME, "mountPath": GATE_DIR}]
    return main


def pod_template(spec: GroupSpec) -> dict[str, Any]:
    template = copy.deepcopy(spec.template)
    metadata = template.setdefault("metadata", {})
    # The user's part-of and instance win (defaults only); managed-by and the group label are
    # ours: the operator watches its pods, and the Deployment selects them, by those.
    if spec.workload_ref is None:
        metadata["labels"] = {**default_labels(spec), **(metadata.get("labels") or {}),
                              LABEL_MANAGED_BY: MANAGED_BY, **selector_labels(spec)}
    else:
        # An adopted workload's pods keep their labels (its controller selects them by those,
        # its chart says who manages them); the group label is the one the group selects by.
        # The settings' digest too, so that a manifest injected by singletonctl carries what the
        # operator's apply would put there (no extra rollout when the group adopts it).
        metadata["labels"] = {**(metadata.get("labels") or {}), **selector_labels(spec)}
        metadata["annotations"] = {**(metadata.get("annotations") or {}),
                                   ANNOTATION_SIDECAR_CONFIG: sidecar_config_digest(spec)}
    pod = template.setdefault("spec", {})
    pod["containers"] = [_main_container(spec, c) if c["name"] == spec.main_container else c
                         for c in pod["containers"]]
    pod["initContainers"] = place_sidecar(sidecar_container(spec), pod.get("initContainers") or [],
                                          spec.sidecar_start_order)
    if spec.workload_ref is None:
        pod.setdefault("serviceAccountName", sidecar_account(spec))
    if spec.image_pull_secrets:
        # The operator's, for the sidecar's image, after the user's own (each name once).
        named = {s.get("name") for s in pod.get("imagePullSecrets") or []}
        pod["imagePullSecrets"] = [*(pod.get("imagePullSecrets") or []),
                                   *({"name": n} for n in spec.image_pull_secrets if n not in named)]
    # An adopted pod keeps its own account: the group's RoleBinding names it instead.
    pod["terminationGracePeriodSeconds"] = spec.termination_grace
    if spec.gating == "file":
        pod["volumes"] = [*(pod.get("volumes") or []), {"name": GATE_VOLUME, "emptyDir": {"medium": "Memory"}}]
    return template


def deployment(spec: GroupSpec) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(spec, spec.name),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(spec)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "minReadySeconds": 0,
            "revisionHistoryLimit": 5,
            "template": pod_template(spec),
        },
    }


ANNOTATION_SIDECAR_CONFIG = f"{contract.API_GROUP}/sidecar-config"
"""On an adopted workload's pod template: a digest of what the webhook injects, so a change of
the group's settings rolls the workload out once, as it does a template group's Deployment."""


def sidecar_config_digest(spec: GroupSpec) -> str:
    """Digest of the group's injection settings (not of the workload's template, which would
    change with every apply of it)."""
    settings: dict[str, Any] = {"sidecar": sidecar_container(spec), "gating": spec.gating,
                                "main": spec.main_container, "grace": spec.termination_grace,
                                "port": spec.sidecar_port}
    if spec.sidecar_start_order != "AfterSidecars":
        # Only when set: the digest of a group without it stays what it was before the field
        # existed, so an operator upgrade rolls no adopted workload.
        settings["startOrder"] = spec.sidecar_start_order
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def adoption(spec: GroupSpec) -> dict[str, Any]:
    """The server-side apply of an adopted workload: the group label and the settings' digest on
    its pod template, and nothing else (the workload's owner, a chart or a GitOps tool, keeps
    all other fields; the operator's field manager owns only these, so it can take them back)."""
    assert spec.workload_ref is not None
    return {"apiVersion": "apps/v1", "kind": spec.workload_ref.kind,
            "metadata": {"name": spec.workload_ref.name, "namespace": spec.namespace},
            "spec": {"template": {"metadata": {
                "labels": selector_labels(spec),
                "annotations": {ANNOTATION_SIDECAR_CONFIG: sidecar_config_digest(spec)}}}}}


def adopted_by(workload: dict[str, Any]) -> str | None:
    """The group whose label an adopted workload's pod template carries, if any."""
    template = (workload.get("spec") or {}).get("template") or {}
    value = ((template.get("metadata") or {}).get("labels") or {}).get(contract.LABEL_GROUP)
    return str(value) if value else None


def release_adoption(namespace: str, ref: WorkloadRef) -> dict[str, Any]:
    """The apply that gives the workload back: the operator's field manager owns nothing."""
    return {"apiVersion": "apps/v1", "kind": ref.kind, "metadata": {"name": ref.name, "namespace": namespace}}


def leader_service(spec: GroupSpec) -> dict[str, Any] | None:
    if not spec.service_ports:
        return None
    ports = []
    for port in spec.service_ports:
        entry: dict[str, Any] = {"port": port.port, "protocol": port.protocol,
                                 "targetPort": port.target_port if port.target_port is not None else port.port}
        if port.name:
            entry["name"] = port.name
        ports.append(entry)
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(spec, leader_service_name(spec), annotations=spec.service_annotations),
        "spec": {"type": spec.service_type, "ports": ports,
                 "selector": {**selector_labels(spec), contract.LABEL_ROLE: contract.ROLE_LEADER}},
    }


def pod_disruption_budget(spec: GroupSpec) -> dict[str, Any] | None:
    if not spec.pdb_enabled:
        return None
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _metadata(spec, spec.name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(spec)}},
    }
