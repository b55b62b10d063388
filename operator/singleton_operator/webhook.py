"""The mutating admission webhook: the sidecar for each new pod of an adopted workload.

Served by every operator replica, leader or not (``runtime``): with ``failurePolicy: Fail``
an adopted workload's pods can be created only while a replica answers, so the answer must
not wait for an election. What a pod gets is a pure function of its SingletonService and the
pod itself (``inject.pod_patch``), so any replica answers alike; the group is read from the API
server on each request, never from a cache that could be older than the group.

Decisions, per pod that reaches us (the MutatingWebhookConfiguration sends only pods with
the group label, and none the operator made):
- already has the sidecar (``singletonctl inject``, or this webhook called again because a later
  one changed the pod, ``reinvocationPolicy: IfNeeded``): allowed, with the sidecar moved back to
  its place among the init containers (``spec.sidecar.startOrder``) if another webhook's
  containers took it, else unchanged;
- its group does not exist, or carries its own template: allowed unchanged, with a warning
  (the label alone does not make a pod part of a group);
- its group adopts a workload: allowed with the patch, or refused with the group's rule the
  pod breaks (its controller shows the message in its Events and retries);
- the group cannot be read: refused, so no adopted pod ever runs without its sidecar.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from singleton_election import contract
from singleton_election.kube import KubeClient, KubeError, KubeNotFound
from singleton_operator.model.inject import is_injected, pod_patch
from singleton_operator.model.resources import uninjected_template
from singleton_operator.model.spec import NANOSECONDS, GroupSpec, SpecError, parse_duration, workload_ref
from singleton_operator.reconcile import CALL_TIMEOUT, ReconcileProblem, cr_path

log = logging.getLogger(__name__)

PATH = "/mutate-pods"
ANSWER_MARGIN = 1.0
"""Seconds kept, of the time the API server gives an admission, for answering after the group's
read: a read that outlasts the rest fails as ours (a 503 naming the group), not the API server's
bare "context deadline exceeded"."""
LEAST_GIVEN = 1.0
"""The least time an admission can be given: the smallest ``timeoutSeconds``."""
MAX_BODY = 3 * 1024 * 1024
"""The API server sends at most its request limit (3 MiB by default) per object."""

SpecReader = Callable[[dict[str, Any], dict[str, Any]], GroupSpec]


class Refused(Exception):
    """The pod must not be created; the message is shown to whoever created it."""

    def __init__(self, message: str, code: int = 403) -> None:
        super().__init__(message)
        self.code = code


class PodAdmission:
    """Answers AdmissionReviews of pods (``admission.k8s.io/v1``)."""

    def __init__(self, client: KubeClient, read_spec: SpecReader,
                 observe: Callable[[float], None] | None = None) -> None:
        self.client = client
        self.read_spec = read_spec
        self.observe = observe or (lambda _seconds: None)

    async def handle(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        try:
            review = json.loads(await request.read())
            admission = review["request"]
            uid = str(admission["uid"])
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "expected an admission.k8s.io/v1 AdmissionReview with a request"},
                                     status=400)
        # Counted from the request's arrival: the body's read and a busy event loop take from it.
        timeout = max(read_timeout(request.query.get("timeout")) - (time.perf_counter() - started), 0.1)
        try:
            patch, warnings = await self.decide(admission, timeout)
            response: dict[str, Any] = {"uid": uid, "allowed": True}
            if patch:
                response["patchType"] = "JSONPatch"
                response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
        except Refused as exc:
            warnings = []
            response = {"uid": uid, "allowed": False, "status": {"code": exc.code, "message": str(exc)}}
        if warnings:
            response["warnings"] = warnings
        elapsed = time.perf_counter() - started
        self.observe(elapsed)
        log.info("pod admission", extra={"namespace": admission.get("namespace"),
                                         "group": _group_label(admission.get("object") or {}),
                                         "allowed": response["allowed"], "patched": "patch" in response,
                                         "duration_seconds": elapsed, "read_timeout_seconds": timeout})
        return web.json_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                  "response": response})

    async def decide(self, admission: dict[str, Any], timeout: float = CALL_TIMEOUT
                     ) -> tuple[list[dict[str, Any]], list[str]]:
        """(JSON patch, warnings) for one pod; raises ``Refused``. ``timeout``: for reading
        the group (``read_timeout``)."""
        pod = admission.get("object") or {}
        group = _group_label(pod)
        namespace = str(admission.get("namespace") or (pod.get("metadata") or {}).get("namespace") or "")
        if admission.get("operation") != "CREATE" or not group or not namespace:
            return [], []
        try:
            body = await self.client.request("GET", cr_path(namespace, group), timeout=timeout)
        except KubeNotFound:
            return [], [f"label {contract.LABEL_GROUP}={group}: no SingletonService {namespace}/{group}; the pod "
                        "runs without the singleton sidecar"]
        except KubeError as exc:
            raise Refused(f"singleton: cannot read SingletonService {namespace}/{group} to add its sidecar: {exc}",
                          code=503) from None
        try:
            ref = workload_ref(body)
        except SpecError as exc:
            raise Refused(f"singleton: SingletonService {namespace}/{group}: {exc}") from None
        if ref is None:
            return [], [f"label {contract.LABEL_GROUP}={group}: SingletonService {namespace}/{group} carries its "
                        "own template, so this pod is not one of its members and gets no sidecar"]
        template = {"metadata": pod.get("metadata") or {}, "spec": pod.get("spec") or {}}
        if is_injected(template["spec"]):
            # Injected by singletonctl, or by this webhook before another webhook changed the pod:
            # the group's rules are about the pod as its owner wrote it.
            template = uninjected_template(template)
        as_workload = {"spec": {"template": template}}
        try:
            spec = self.read_spec(body, as_workload)
        except (SpecError, ReconcileProblem) as exc:
            raise Refused(f"singleton: SingletonService {namespace}/{group} cannot run this pod: {exc}") from None
        return pod_patch(spec, pod), []

    def app(self) -> web.Application:
        application = web.Application(client_max_size=MAX_BODY)
        application.router.add_post(PATH, self.handle)
        return application


def read_timeout(given: str | None) -> float:
    """Seconds for reading the group: what the API server still gives the admission, less
    ``ANSWER_MARGIN`` (or half of it when that leaves more: under 2 s), and never more than
    ``CALL_TIMEOUT``.

    The API server says how long it will wait in the request's ``timeout`` parameter: the time
    left to its deadline (the webhook configuration's ``timeoutSeconds``, or less when the
    request being admitted has less left), as a Go duration rounded up to whole seconds ("5s"),
    read as the spec's durations are (``parse_duration``).
    Without one: ``CALL_TIMEOUT``. One that does not parse is taken for the least an admission
    can be given (1 s), rather than for more than it may have."""
    if not given:
        return CALL_TIMEOUT
    try:
        waits = parse_duration("timeout", given) / NANOSECONDS
    except SpecError:
        waits = 0.0
    if waits <= 0:
        waits = LEAST_GIVEN
    return min(CALL_TIMEOUT, max(waits - ANSWER_MARGIN, waits / 2))


def _group_label(pod: dict[str, Any]) -> str:
    return str(((pod.get("metadata") or {}).get("labels") or {}).get(contract.LABEL_GROUP) or "")
