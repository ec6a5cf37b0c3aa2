"""A clean interpreter exit whatever poolkeeper objects are still alive.

Five things used to spoil the exit, none of them a reference-count error:

- the C ABI's pool registry (what PyTorch's pluggable allocator calls into) is a C++ static; a pool
  made in Python and installed there (``install(pool=...)``, ``install(device=0)``) is held by a
  Python reference inside it, and that static is destroyed only after the interpreter is gone, so
  nanobind reported the pool and its upstream as leaked. At exit the hook below removes such
  entries (and the lazy per-device factory), and the graph registry's GraphPools over pools made
  in Python, which hold those pools too once a CUDA graph was captured through the C ABI, so
  Python frees them during its own cleanup like any other object (a graph not yet released keeps
  its pool, unreported). Pools the factory made in C++ (no Python object) stay, with their GraphPools: tensors
  PyTorch frees during shutdown still reach them. In a forked child, what the fork handlers left
  behind on purpose (objects whose locks may have been held at the fork) is not reported.
- a daemon thread inside a pool call (the GIL released) when the interpreter finalizes: CPython
  ends a thread that asks for the GIL back during finalization with ``pthread_exit``, whose forced
  unwind through a C++ destructor aborts the process ("terminate called without an active
  exception"). The hook tells the core that exit has begun; from then on any other thread leaving
  a native call parks until the process ends instead of asking for the GIL (the core's
  ``ReleaseGil``), and the hook yields the GIL once so threads already queued for it get through
  before finalization starts. Consequence: an exit handler registered *before* poolkeeper was
  imported (handlers run last-registered-first) must not join a thread that is still calling
  poolkeeper, or it waits for a parked thread.
- CuPy keeps the allocator it was given (``cupy.cuda.set_allocator``) in an extension-module global
  that is never cleared at exit, so the CuPy integration's pools (and their upstreams) outlived
  the interpreter and nanobind reported them. The hook puts CuPy's previous allocators back
  (``integrations.cupy.uninstall``), which drops that last reference; arrays still alive keep
  their own pool alive and return their blocks to it when Python frees them.
- a thread Python never stops (a daemon thread still running) keeps its frames, and through them
  module globals, alive through shutdown; so does a thread that vanished at a ``fork()`` (in the
  child CPython drops its state without clearing its frames). Those objects are owned by that
  thread, not leaked, and no binding can release them; when such a thread is alive at exit, or
  ran when the fork that made this process happened, nanobind's leak report is switched off. So
  it is when a graph not yet released keeps its pool past the exit.
- a C ABI call on another thread (a free that retires a graph's pools) may drop the last
  reference to a pool made in Python, which takes the GIL; during finalization that ended the
  thread by the same forced unwind, through a destructor: the process aborted. The C ABI's
  registries hold such a pool through a reference that, once exit has begun, a thread other than
  the exiting one leaves to the process's end instead. A consumer's DLPack deleter and a Python
  capture filter, which may run on any thread, take the GIL through the same guard: the exit
  waits for Python work they began before it (saying so on stderr after 2 s), and they leave
  Python alone after. A DLPack export whose consumer has not called its deleter when the
  interpreter is gone keeps its buffer on purpose (the consumer may free later): the core's last
  exit callback turns the report off then.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time


def _at_exit() -> None:
    # A Ctrl-C while the program stops (a second press, or a timer's interrupt_main) raised
    # KeyboardInterrupt in the middle of this hook: the steps after it never ran, so pools made in
    # Python stayed in the C ABI's registry and nanobind reported them leaked. The exit is under
    # way already: a SIGINT during the hook is taken and dropped. (Its waits are native, without
    # the GIL, and were never interruptible by Ctrl-C.)
    held = _hold_sigint()
    try:
        _exit_steps()
    finally:
        _release_sigint(held)


def _hold_sigint():
    """SIGINT's previous Python handler after putting one that ignores it there, or None where
    that cannot be done (not the main thread, a handler installed from C)."""
    try:
        import signal

        if threading.current_thread() is not threading.main_thread():
            return None
        previous = signal.getsignal(signal.SIGINT)
        if previous is None:  # set outside Python: it cannot be put back
            return None
        signal.signal(signal.SIGINT, _ignore_signal)
        return previous
    except Exception:
        return None


def _ignore_signal(signum, frame) -> None:
    pass


def _release_sigint(previous) -> None:
    if previous is None:
        return
    try:
        import signal

        signal.signal(signal.SIGINT, previous)
    except Exception:
        pass


def _exit_steps() -> None:
    try:
        from poolkeeper import _core
    except Exception:  # pragma: no cover - the extension itself failed to load
        return
    _core._begin_exit()
    try:
        _core.registry_clear_factory()
        for device in _core.registry_python_owned():
            _core.registry_set(device, None)
        # A GraphPools (made by a CUDA-graph capture through the C ABI) holds its device pool as
        # well, installed or since replaced: those over pools made in Python are dropped now unless
        # a scope is open or a graph not yet released, whatever the program's own blocks (a graph
        # still alive keeps its pool, to serve its frees and release). Those over pools the factory
        # made in C++ stay, as those pools do.
        kept = _core.graph_registry_drop_at_exit() + _core.registry_retired()["pools"]
        # GraphPools kept past the exit keep their scopes' filters: a Python one would keep what
        # it reaches (its module's globals) from ever being cleared. From here on every Python
        # filter answers "not mine" (the device pool serves).
        _core._forget_python_filters()
        if kept or _core.registry_left_at_fork() or _forked_beside_threads:
            # Objects that outlive the interpreter on purpose, not leaks to report: a graph not yet
            # released keeps its pool (its release may still come during shutdown), and so does a
            # C ABI call still inside a pool the lines above uninstalled (a native thread's); a
            # forked child leaves the parent's registry objects behind (their locks may have been
            # held at the fork); and in a child forked while other Python threads ran, CPython
            # drops those threads' states without clearing their frames, so whatever those frames
            # reached (their module's globals) is never freed.
            _core._set_leak_warnings(False)
    except Exception:
        pass
    cupy_integration = sys.modules.get("poolkeeper.integrations.cupy")
    if cupy_integration is not None:
        try:
            cupy_integration.uninstall()
        except Exception:
            pass
    main = threading.main_thread()
    others = [t for t in threading.enumerate() if t is not main and t.is_alive()]
    if others:
        time.sleep(0.005)  # let threads already waiting for the GIL take it before finalization
        _core._set_leak_warnings(False)


_forked_beside_threads = False
_threads_at_fork = False


def _before_fork() -> None:
    global _threads_at_fork
    _threads_at_fork = threading.active_count() > 1


def _after_fork_in_child() -> None:
    global _forked_beside_threads
    _forked_beside_threads = _forked_beside_threads or _threads_at_fork


def register() -> None:
    atexit.register(_at_exit)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


__all__ = ["register"]
