"""Importing parts of a package without its ``__init__``.

prometheus_client's ``__init__`` imports the library's HTTP server, push-gateway client and
WSGI/ASGI apps, with http.server, urllib.request, email and wsgiref: 2.9 MB of a sidecar's
~30 MB budget, for a registry, a few metrics and the OpenMetrics encoder that need none of it.
``singleton-sidecar run`` registers the package with ``without_init`` before anything imports
it; every other process (the operator, the tests) imports it as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from importlib.machinery import PathFinder


def without_init(package: str) -> None:
    """Register ``package`` without running its ``__init__``, so that importing its submodules
    loads only them; the first use of another name of the package itself runs the ``__init__``
    then, once (other threads wait for it), so code that uses the package whole still gets all
    of it. Nothing changes if the package is already imported.
    """
    if package in sys.modules:
        return
    spec = importlib.util.find_spec(package)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        raise ImportError(f"{package} is not an installed package")
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader
    lock = threading.RLock()  # reentrant: the __init__ itself may ask for a name of the package
    loading = False

    def load_whole(name: str) -> object:
        nonlocal loading
        if PathFinder.find_spec(f"{package}.{name}", module.__path__) is not None:
            # A submodule (`from . import x` asks for it this way first): import just that one.
            return importlib.import_module(f"{package}.{name}")
        with lock:
            if "__getattr__" in module.__dict__ and not loading:
                loading = True
                try:
                    loader.exec_module(module)
                    # The real __init__ defines no __getattr__: from now on, the package as usual.
                    del module.__dict__["__getattr__"]
                finally:
                    loading = False
        if name in module.__dict__:
            return module.__dict__[name]
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    module.__dict__["__getattr__"] = load_whole
    sys.modules[package] = module
