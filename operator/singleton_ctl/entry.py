"""The console scripts' entry point: ``kubectl singleton`` needs the official Kubernetes client,
which is the package's ``cli`` extra (the image leaves it out); without it, one line says so."""

from __future__ import annotations

import os
import sys

CLI_EXTRA_MISSING = "needs the official kubernetes client: pip install 'kube-singleton[cli]'"


def main() -> int:
    try:
        from singleton_ctl.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "kubernetes":
            raise
        prog = "singletonctl" if os.path.basename(sys.argv[0]) == "singletonctl" else "kubectl singleton"
        print(f"{prog}: error: {CLI_EXTRA_MISSING}", file=sys.stderr)
        return 1
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
