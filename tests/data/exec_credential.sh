#!/bin/sh
# A kubeconfig exec credential plugin for the tests (kubectl singleton, the operator with
# --kubeconfig): prints an ExecCredential holding the bearer token read from $TOKEN_FILE,
# expiring at $EXPIRES (RFC 3339) when set, and appends one line to $CALLS_FILE per call.
# Like a real plugin whose login fails, it exits 1 with a message on stderr when
# $TOKEN_FILE cannot be read.
set -eu
if [ -n "${CALLS_FILE:-}" ]; then
    echo call >> "$CALLS_FILE"
fi
if ! token=$(cat "$TOKEN_FILE" 2>/dev/null); then
    echo "exec_credential.sh: login refused: no token at $TOKEN_FILE" >&2
    exit 1
fi
expiry=""
if [ -n "${EXPIRES:-}" ]; then
    expiry=", \"expirationTimestamp\": \"$EXPIRES\""
fi
printf '{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": {"token": "%s"%s}}\n' \
    "$token" "$expiry"
