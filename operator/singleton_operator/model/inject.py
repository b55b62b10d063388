"""Adding the sidecar to workloads the operator did not create (pure; no I/O).

One code path for the three ways a workload is adopted: the operator's mutating webhook
(each pod of an adopted workload, as it is created), ``singletonctl inject`` (manifests, for
GitOps pipelines without webhooks), and the operator's own template groups
(``resources.pod_template``). What is added is what ``resources.pod_template`` adds to a
template group's pods: the native sidecar, its environment and probes, the main container's
readiness and gate, the grace period; the pod keeps its own labels, service account and
everything else.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from singleton_election import contract
from singleton_operator.model import resources
from singleton_operator.model.spec import SIDECAR_CONTAINER, GroupSpec, SpecError, WorkloadRef, read_spec, workload_ref

WORKLOAD_API_VERSION = "apps/v1"


class InjectError(ValueError):
    """Input that cannot be injected; the message names the object and the field."""


def is_injected(pod_spec: Mapping[str, Any]) -> bool:
    """Whether the sidecar is already there (an operator-made pod, or a manifest injected before)."""
    return any(c.get("name") == SIDECAR_CONTAINER for c in pod_spec.get("initContainers") or [])


def adoption_labels(spec: GroupSpec) -> dict[str, str]:
    """The label the operator puts on an adopted workload's pod template: the webhook injects
    into pods that carry it, and the group's Service, PodDisruptionBudget and status select by it."""
    return resources.selector_labels(spec)


def injected_template(spec: GroupSpec, template: Mapping[str, Any]) -> dict[str, Any]:
    """``template`` (a pod template, or a pod: metadata and spec) with the group's sidecar.

    ``spec`` is the group read with this very template (``read_spec(..., workload=...)``), so the
    checks that admission makes on a template group's template were made on this one."""
    return resources.pod_template(replace(spec, template=copy.deepcopy(dict(template))))


def pod_patch(spec: GroupSpec, pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that injects the sidecar into ``pod``; for a pod that has it,
    the one that puts it back in its place among the init containers (``placement_patch``)."""
    if is_injected(pod.get("spec") or {}):
        return placement_patch(spec, pod.get("spec") or {})
    before = {"metadata": dict(pod.get("metadata") or {}), "spec": dict(pod.get("spec") or {})}
    after = injected_template(spec, before)
    # Whole fields replaced, not a diff of them (jsonpatch.make_patch took most of the
    # webhook's time): injection changes only a few top-level fields of metadata and spec.
    operations: list[dict[str, Any]] = []
    for part in ("metadata", "spec"):
        old, new = before[part], after[part]
        for key in sorted(new):
            if old.get(key) != new[key]:
                path = f"/{part}/{_pointer(key)}"
                operations.append({"op": "replace" if key in old else "add", "path": path, "value": new[key]})
    return operations


def placement_patch(spec: GroupSpec, pod_spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Empty when the sidecar of an injected pod stands where ``spec.sidecar.startOrder`` puts
    it; else the patch that moves it there. The webhook is called again after a later webhook
    changed the pod (``reinvocationPolicy: IfNeeded``): a mesh's injector that added its proxy
    behind ours is then put ahead of it, whichever webhook ran first."""
    init_containers = list(pod_spec.get("initContainers") or [])
    sidecar = next(c for c in init_containers if c.get("name") == SIDECAR_CONTAINER)
    placed = resources.place_sidecar(sidecar, init_containers, spec.sidecar_start_order)
    if placed == init_containers:
        return []
    return [{"op": "replace", "path": "/spec/initContainers", "value": placed}]


def _pointer(key: str) -> str:
    """A JSON-pointer token (RFC 6901): ``~`` and ``/`` escaped."""
    return key.replace("~", "~0").replace("/", "~1")


@dataclass(frozen=True)
class Manifest:
    """One document of the input, with where it came from (for messages)."""

    doc: dict[str, Any]
    source: str


def inject_manifests(manifests: Iterable[Manifest], *, default_namespace: str, default_sidecar_image: str,
                     sidecar_pull_policy: str | None = None,
                     image_pull_secrets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every document, in order, with the sidecar injected into each Deployment or
    StatefulSet that a SingletonService of the input adopts. Raises ``InjectError`` naming the
    document for anything that would make a half-injected output."""
    docs = [m for m in manifests if m.doc is not None]
    for manifest in docs:
        if not isinstance(manifest.doc, dict) or "kind" not in manifest.doc:
            raise InjectError(f"{manifest.source}: not a Kubernetes object (no kind)")
    groups: dict[tuple[str, str, str], tuple[Manifest, WorkloadRef]] = {}
    for manifest in docs:
        if manifest.doc.get("kind") != contract.KIND:
            continue
        namespace = _namespace(manifest.doc, default_namespace)
        try:
            ref = workload_ref(manifest.doc)
        except SpecError as exc:
            raise InjectError(f"{manifest.source}: SingletonService {namespace}/{_name(manifest)}: {exc}") from None
        if ref is None:
            continue  # a template group: the operator builds its Deployment
        target = (ref.kind, namespace, ref.name)
        if target in groups:
            raise InjectError(f"{manifest.source}: {ref.describe(namespace)} is adopted by two SingletonServices "
                              f"({_name(groups[target][0])} and {_name(manifest)})")
        groups[target] = (manifest, ref)
    if not groups:
        raise InjectError("no SingletonService with spec.workloadRef in the input: nothing says which workload to "
                          "inject into (add the SingletonService's manifest, e.g. with -f)")
    found: set[tuple[str, str, str]] = set()
    output = []
    for manifest in docs:
        doc = manifest.doc
        key = (str(doc.get("kind")), _namespace(doc, default_namespace), _name(manifest))
        if key in groups and doc.get("apiVersion") == WORKLOAD_API_VERSION:
            found.add(key)
            spec_settings = {"sidecar_pull_policy": sidecar_pull_policy, "image_pull_secrets": image_pull_secrets}
            output.append(_inject_workload(groups[key][0], doc, default_namespace, default_sidecar_image,
                                           spec_settings))
        else:
            output.append(doc)
    missing = [(m, ref) for target, (m, ref) in groups.items() if target not in found]
    if missing:
        manifest, ref = missing[0]
        raise InjectError(f"{manifest.source}: SingletonService {_name(manifest)} adopts "
                          f"{ref.describe(_namespace(manifest.doc, default_namespace))}, which is not in the input "
                          f"(an {WORKLOAD_API_VERSION} {ref.kind} of that name and namespace)")
    return output


def _inject_workload(group: Manifest, workload: dict[str, Any], default_namespace: str,
                     default_sidecar_image: str, operator_settings: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(group.doc)
    metadata = body.setdefault("metadata", {})
    metadata.setdefault("namespace", default_namespace)
    metadata.setdefault("uid", "")
    template = (workload.get("spec") or {}).get("template") or {}
    if is_injected(template.get("spec") or {}):
        # Injecting again would wrap the gate twice: the pipeline must start from the original.
        raise InjectError(f"{workload.get('kind')} {_name_of(workload)} already has the {SIDECAR_CONTAINER} "
                          "container: inject the original manifest, not an injected one")
    try:
        spec = read_spec(body, default_sidecar_image=default_sidecar_image, workload=workload)
    except SpecError as exc:
        raise InjectError(f"{group.source}: SingletonService {_name(group)}: {exc}") from None
    # The operator's own settings (its --sidecar-image-pull-policy and pull secrets), as its
    # webhook applies them.
    spec = replace(spec, **operator_settings)
    result = copy.deepcopy(workload)
    result["spec"]["template"] = injected_template(spec, template)
    return result


def _namespace(doc: Mapping[str, Any], default: str) -> str:
    return str((doc.get("metadata") or {}).get("namespace") or default)


def _name(manifest: Manifest) -> str:
    return _name_of(manifest.doc)


def _name_of(doc: Mapping[str, Any]) -> str:
    return str((doc.get("metadata") or {}).get("name"))
