"""SIGTERM during start-up.

In a container the program is PID 1, and the kernel drops a signal that PID 1 has no handler
for. The event loop's own SIGTERM handler comes only after the imports (about a second, more on
a busy node), so a SIGTERM in between (a pod deleted while starting, ``helm uninstall`` right
after ``install``) would be lost, and the kubelet would wait out the whole grace period before
SIGKILL. Until the loop installs its handler (``loop.add_signal_handler`` replaces this one), a
SIGTERM ends the program at once: no term has been campaigned for yet, and what little was set
up (a file gate's script in its shared folder, the subreaper flag) needs no undoing.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType


def stop_on_sigterm_until_started(prog: str) -> None:
    def stop(signum: int, _frame: FrameType | None) -> None:
        print(f"{prog}: {signal.Signals(signum).name} before start-up finished: exiting", file=sys.stderr)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
