"""The contract the operator and the sidecar share: API group, annotation and label keys,
environment variable names. Both sides import these names from here and nowhere else."""

from typing import Final

API_GROUP: Final = "singleton.dev"
API_VERSION: Final = "v1alpha1"
KIND: Final = "SingletonService"
PLURAL: Final = "singletonservices"

# Pod annotations and labels written by the sidecar on its own pod.
ANNOTATION_ROLE: Final = f"{API_GROUP}/role"
ANNOTATION_LEADER_SINCE: Final = f"{API_GROUP}/leader-since"
ANNOTATION_TOKEN: Final = f"{API_GROUP}/token"
ANNOTATION_GROUP: Final = f"{API_GROUP}/group"
ANNOTATION_IDENTITY: Final = f"{API_GROUP}/identity"
LABEL_ROLE: Final = f"{API_GROUP}/role"
LABEL_GROUP: Final = f"{API_GROUP}/group"

# Set by the sidecar on its own pod while it leads, so a ReplicaSet scaling down during a
# rolling update removes the standbys first and the leader last: one handover per rollout.
ANNOTATION_DELETION_COST: Final = "controller.kubernetes.io/pod-deletion-cost"
LEADER_DELETION_COST: Final = "1000"

# Requests written on a pod by `singletonctl handover` (anyone allowed to patch the pod):
# "<request id>" asks the pod's leader to step down; "<request id>:<seconds>" asks a standby
# not to campaign for that long. A sidecar acts on a new request id only, never on one it
# found at start.
ANNOTATION_STEP_DOWN: Final = f"{API_GROUP}/step-down"
ANNOTATION_HOLD: Final = f"{API_GROUP}/hold"

# The fencing token of the current term, kept on the Lease by the lease backend.
LEASE_ANNOTATION_TOKEN: Final = f"{API_GROUP}/token"
# Written with the empty holder by the holder's own release, after its app stopped: the token
# of the term it ended. A holder-less Lease without it (a forced release, a hand edit) is
# taken only once the term it cleared has expired.
LEASE_ANNOTATION_RELEASED: Final = f"{API_GROUP}/released-token"

# Pod readiness-gate condition type the sidecar sets on its own pod.
CONDITION_LEADER: Final = f"{API_GROUP}/leader"

ROLE_LEADER: Final = "leader"
ROLE_STANDBY: Final = "standby"
ROLE_DRAINING: Final = "draining"
ROLE_RELEASED: Final = "released"


def lock_key(group: str, namespace: str) -> str:
    """The key of a group's lock and fence rows in PostgreSQL: ``<namespace>/<group>``, set
    explicitly on every replica (``SINGLETON_LOCK_KEY``; the operator sets it on its pods),
    so a replica on a VM and one in a pod of the same group take the same lock. Qualified by
    namespace so that same-named groups in two namespaces that share a database never meet."""
    return f"{namespace}/{group}"


# Set by the exec gate for the gated process: the key to pass to ``fencing.fence``.
ENV_FENCE_KEY: Final = "SINGLETON_FENCE_KEY"

# Environment variables read by `singleton-sidecar run` (flags override them).
ENV_GROUP: Final = "SINGLETON_GROUP"
ENV_IDENTITY: Final = "SINGLETON_IDENTITY"
ENV_BACKEND: Final = "SINGLETON_BACKEND"
ENV_POSTGRES_DSN: Final = "SINGLETON_POSTGRES_DSN"
ENV_POSTGRES_DSN_FILE: Final = "SINGLETON_POSTGRES_DSN_FILE"
ENV_POSTGRES_MODE: Final = "SINGLETON_POSTGRES_MODE"
ENV_NAMESPACE: Final = "SINGLETON_NAMESPACE"
ENV_LOCK_KEY: Final = "SINGLETON_LOCK_KEY"
ENV_POD_NAME: Final = "SINGLETON_POD_NAME"
ENV_POD_UID: Final = "SINGLETON_POD_UID"
ENV_LISTEN: Final = "SINGLETON_LISTEN"
ENV_CONTROL_LISTEN: Final = "SINGLETON_CONTROL_LISTEN"
ENV_LEASE_DURATION: Final = "SINGLETON_LEASE_DURATION"
ENV_RENEW_DEADLINE: Final = "SINGLETON_RENEW_DEADLINE"
ENV_RETRY_PERIOD: Final = "SINGLETON_RETRY_PERIOD"
ENV_DRAIN_TIMEOUT: Final = "SINGLETON_DRAIN_TIMEOUT"
ENV_DRAIN_URL: Final = "SINGLETON_DRAIN_URL"
ENV_GATE_DIR: Final = "SINGLETON_GATE_DIR"
ENV_DRAIN_WAIT_CONTAINER: Final = "SINGLETON_DRAIN_WAIT_CONTAINER"
ENV_NATIVE_SIDECAR: Final = "SINGLETON_NATIVE_SIDECAR"
ENV_SOLE_CANDIDATE_IN_POD: Final = "SINGLETON_SOLE_CANDIDATE_IN_POD"
ENV_READINESS_GATE: Final = "SINGLETON_READINESS_GATE"
ENV_LOG_FORMAT: Final = "SINGLETON_LOG_FORMAT"
ENV_LOG_LEVEL: Final = "SINGLETON_LOG_LEVEL"
ENV_KUBECONFIG: Final = "KUBECONFIG"


def sidecar_rbac_rules(group: str) -> list[dict[str, list[str]]]:
    """The Role rules a group's sidecars need, and nothing more: their group's Lease, and
    their own pod (the chart's admission policy narrows "pods" to the caller's own pod).

    ``create`` cannot be limited by name in RBAC, so creating Leases is allowed in the
    namespace; reading, watching and updating only the group's own Lease.
    """
    return [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [group],
         "verbs": ["get", "list", "watch", "update"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]
