"""kubectl singleton, self-contained: the ``__main__`` of the zipapp plugins/krew/build.py makes.

The archive holds the plugin and its dependencies under ``site/``, native modules included
(pydantic-core, which the Kubernetes client needs, has no pure-Python fallback) for every
CPython the archive names. Python cannot import native modules from a zip, so the first run
unpacks ``site/`` into ``~/.cache/kubectl-singleton/<build id>`` (atomically: concurrent first
runs are safe), and every run imports from there. Nothing is installed into the system Python.
"""

import os
import shutil
import sys
import tempfile
import zipfile

PYTHONS = ()  # the (major, minor) versions the archive has native modules for; set by build.py


def unpacked(archive: str, build_id: str) -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    target = os.path.join(cache, "kubectl-singleton", build_id)
    if os.path.isdir(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=build_id + ".", dir=os.path.dirname(target))
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(staging, [name for name in zf.namelist() if name.startswith("site/")])
    try:
        os.rename(os.path.join(staging, "site"), target)
    except OSError:  # another first run got there first
        if not os.path.isdir(target):
            raise
    shutil.rmtree(staging, ignore_errors=True)
    return target


def main() -> int:
    if sys.version_info[:2] not in PYTHONS:
        supported = ", ".join(f"{major}.{minor}" for major, minor in PYTHONS)
        print(f"kubectl singleton: error: this archive runs on CPython {supported}, not {sys.version.split()[0]} "
              f"({sys.executable})", file=sys.stderr)
        return 1
    archive = os.path.dirname(os.path.abspath(__file__))
    with zipfile.ZipFile(archive) as zf:
        build_id = zf.read("BUILD_ID").decode().strip()
    sys.path.insert(0, unpacked(archive, build_id))
    from singleton_ctl.entry import main as plugin_main

    return plugin_main()


if __name__ == "__main__":
    sys.exit(main())
