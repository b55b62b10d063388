"""The election core: states, timings, identities and the elector loop.

Pure: it imports no HTTP, Kubernetes or SQL code. It knows a lock store only through
``singleton_sidecar.backends.base.LockBackend`` and time only through ``Clock``.
"""
