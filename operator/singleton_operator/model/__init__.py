"""The operator's model: what a SingletonService means, apart from how it is carried out.

Pure functions and values, no I/O: a SingletonService read into a typed ``GroupSpec``
(``spec``), the objects the group owns built as plain dicts (``resources``), the status
computed from what its pods say (``status``), and the sidecar added to an adopted
workload's pods (``inject``). Nothing here imports kopf, aiohttp, a Kubernetes client, a
lock backend or any other module of the operator; the ``model-is-pure`` import-linter
contract in pyproject.toml checks it. The kopf handlers, the reconciler and the webhook
(the rest of ``singleton_operator``) do the I/O around it.
"""
