"""Instrumentation shared by the staging tests: hold the host copy thread at a gate.

The Host engine runs ``copy_async`` on one worker thread through ``_engine._memmove``; wrapping
that function lets a test keep a copy "in flight" for as long as it needs, deterministically
(the gate has a generous timeout only so a broken build fails instead of hanging).
"""
from __future__ import annotations

import ctypes
import threading

from poolkeeper.staging import _engine

WORKER = "poolkeeper-staging-copy"
TIMEOUT_S = 20.0


class CopyGate:
    """Replaces ``_engine._memmove``: copies on the worker thread wait until ``open()``."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.entered = threading.Event()  # a worker copy reached the gate
        self.timed_out = False

    def open(self) -> None:
        self._open.set()

    def __call__(self, dst: int, src: int, n: int) -> int:
        if threading.current_thread().name == WORKER:
            self.entered.set()
            if not self._open.wait(TIMEOUT_S):
                self.timed_out = True
        return ctypes.memmove(dst, src, n)


def install_gate(monkeypatch) -> CopyGate:
    gate = CopyGate()
    monkeypatch.setattr(_engine, "_memmove", gate)
    return gate
