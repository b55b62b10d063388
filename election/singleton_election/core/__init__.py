"""The election core: states, timings, identities and the elector loop.

Pure: it imports no HTTP, Kubernetes or SQL code. It knows a lock store only through
``singleton_election.core.lock.LockBackend`` and time only through ``Clock``.
"""
