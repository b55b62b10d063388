"""Gating work, not just traffic: what the sidecar runs beside the elector to start the app
only while leading and to know when it has stopped.

The exec and file gates carry the term's deadline themselves, so a sidecar that stalls
(SIGSTOP of the sidecar alone, a long GC pause, CPU starvation) cannot keep the app acting
past it: ``exec_gate`` (with ``keeper.py``) and ``file_gate`` (with ``gate.sh``). The
cooperative gate (``cooperative_gate``) waits for an SDK app that registered as acting.
"""

from __future__ import annotations

from singleton_sidecar.gates.cooperative_gate import CooperativeGate
from singleton_sidecar.gates.exec_gate import ExecGate
from singleton_sidecar.gates.file_gate import FileGate

Gate = ExecGate | FileGate | CooperativeGate
"""What the sidecar runs beside the elector: one of the three, chosen by its settings."""

__all__ = ["CooperativeGate", "ExecGate", "FileGate", "Gate"]
