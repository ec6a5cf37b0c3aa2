"""poolkeeper inside CuPy.

:func:`install` makes poolkeeper CuPy's device allocator (``cupy.cuda.set_allocator``) and, by
default, its pinned-memory allocator (``cupy.cuda.set_pinned_memory_allocator``);
:func:`uninstall` puts the previous ones back.

Device memory. Where CuPy offers its C function-pointer interface
(``cupy.cuda.memory.CFunctionAllocator``), poolkeeper plugs in there: CuPy calls poolkeeper's C
``malloc(param, size, device)`` and, when its memory object goes, ``free(param, ptr, device)``
(``_core.CupyAllocator``). An allocation on the default (legacy) stream then runs no Python at
all: the current stream comes from CuPy's own C getter, the pool is called directly, and CuPy's
memory object is its own native ``CFunctionAllocatorMemory``. Everything else takes the slow path
below, called from C: another stream, per-thread default streams, a graph capture, a device whose
pool is not made yet. Set ``POOLKEEPER_CUPY_NATIVE=0`` (or use a CuPy without
``CFunctionAllocator``) to have CuPy call the slow path as a Python allocator for every request.

The slow path answers ``MemoryPointer(UnownedMemory(ptr, size, owner, device_id), 0)`` (or, from
C, keeps ``owner`` until CuPy frees the pointer). The owner (a native ``_core.BufferCore``: it
allocates in its constructor and frees in its C++ destructor, so no Python finalizer runs per
array) returns the block to the pool when CuPy drops the memory, ordered on the stream that was
current when CuPy asked for it -- the same rule CuPy's own pool follows: reusable at once on that
stream, by other streams once that stream's work is done. The fast path follows the same rule
with the default stream.

Pinned memory. CuPy's pinned allocator is called for staging buffers (``ndarray.get``/``set``
with a stream, ``cupyx.empty_pinned``...). CuPy itself keeps such a buffer alive until the
asynchronous copies that use it have completed (its event watcher), so a plain pool over
page-locked memory fits: the default is an :class:`~poolkeeper.ArenaPool` over
:class:`~poolkeeper.upstream.CudaPinned` (any size reuses any free range; ``cuMemHostAlloc``
costs milliseconds, so it is called rarely). :class:`poolkeeper.PinnedStagingPool` is not used
here on purpose: it only recycles a buffer after a copy-completion witness, which CuPy's generic
allocator interface cannot supply, so every CuPy buffer would be freed, never reused.

An out-of-memory from poolkeeper reaches CuPy code as ``cupy.cuda.memory.OutOfMemoryError``
(what CuPy users catch), chained from poolkeeper's :class:`~poolkeeper.errors.OutOfMemoryError`
whose message explains the cause; the diagnosis is also its ``poolkeeper_diagnosis`` attribute.

Per-thread default streams (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``): every thread's default
stream has the same handle, so poolkeeper cannot tell them apart; use explicit streams there.

Importing this module does not import cupy; the functions do.
"""
from __future__ import annotations

import contextlib
import itertools
import operator
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

from poolkeeper._core import BufferCore as _Owner  # owner of one device block (native: no finalizer)
from poolkeeper.errors import InvalidArgumentError, OutOfMemoryError, brief
from poolkeeper.integrations._common import IntegrationError, import_optional

MiB = 1 << 20


def _cupy():
    return import_optional("cupy", "poolkeeper.integrations.cupy", "cupy")


class _GraphBlock:
    """Owner of a block allocated while a graph_capture() scope was open: frees it through the
    device's GraphPools (to the private pool that made it, or to the device pool)."""

    __slots__ = ("graphs", "ptr", "stream", "__weakref__")

    def __init__(self, graphs: Any, ptr: int, stream: int) -> None:
        self.graphs, self.ptr, self.stream = graphs, ptr, stream

    def __del__(self) -> None:
        try:
            self.graphs.deallocate(self.ptr, self.stream)
        except Exception:  # interpreter shutting down: nothing safe to do
            pass


class _PinnedBlock:
    """What ``cupy.cuda.PinnedMemoryPointer`` needs of its memory (``ptr``, ``size``); frees the
    block on collection."""

    __slots__ = ("pool", "ptr", "size", "__weakref__")

    def __init__(self, pool: Any, ptr: int, size: int) -> None:
        self.pool, self.ptr, self.size = pool, ptr, size

    def __int__(self) -> int:
        return self.ptr

    def __del__(self) -> None:
        try:
            self.pool.deallocate(self.ptr)
        except Exception:
            pass


class _DevicePools:
    """Device index -> pool, made on first use (or one given pool for its own device)."""

    def __init__(self, pool: Any, upstream: Optional[str], options: Dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._pools: Dict[int, Any] = {}
        self._any: Any = None  # a pool without a device (simulated/host) serves every device
        if isinstance(pool, str):
            from poolkeeper.pools import resolve_cuda_upstream

            upstream = resolve_cuda_upstream(pool, upstream)  # validates the kind and the pair
            self._kind, self._upstream, self._options = pool, upstream, dict(options)
            # The pools' own option checks, now: a misspelt option passed install() and failed
            # every CuPy allocation after it. A pool over a simulated device costs nothing.
            from poolkeeper.pools import make_pool
            from poolkeeper.upstream import make_upstream

            make_pool(pool, make_upstream("simulated", latency_us=0), **self._options).close()
        else:
            d = getattr(getattr(pool, "upstream", None), "device", None)
            if not isinstance(d, int):  # 3 or None raised a bare AttributeError
                raise InvalidArgumentError(f"pool must be a pool kind name or a poolkeeper pool; got {brief(pool)}")
            if options:
                raise IntegrationError("options apply to a pool kind, not to an existing pool")
            self._kind = None
            if d < 0:
                self._any = pool
            else:
                self._pools[d] = pool

    def get(self, device: int) -> Any:
        p = self._pools.get(device)
        if p is not None:
            return p
        if self._any is not None:
            return self._any
        if self._kind is None:
            raise IntegrationError(
                f"the pool given to install() serves device {next(iter(self._pools))}, not device {device}"
            )
        with self._lock:
            p = self._pools.get(device)
            if p is None:
                p = self._make(device)
                self._pools[device] = p
            return p

    def _make(self, device: int) -> Any:
        from poolkeeper.pools import make_device_pool

        return make_device_pool(self._kind, device, self._upstream, **self._options)

    def all(self) -> Dict[int, Any]:
        with self._lock:
            out = dict(self._pools)
        if self._any is not None:
            out[-1] = self._any
        return out


class _DeviceAllocator:
    """The function CuPy calls: ``allocator(size) -> MemoryPointer``."""

    def __init__(self, cupy: Any, pools: _DevicePools) -> None:
        cuda = cupy.cuda
        self._get_device = cuda.runtime.getDevice
        self._current_stream = cuda.get_current_stream
        self._MemoryPointer = cuda.MemoryPointer
        self._UnownedMemory = cuda.UnownedMemory
        self._Memory = cuda.memory.Memory
        self._OOM = cuda.memory.OutOfMemoryError
        self.pools = pools
        self.calls = 0
        # device -> GraphPools, made by the first graph_capture() on that device. Until then the
        # allocation path pays one dict lookup for it.
        self.graphs: Dict[int, Any] = {}
        # Non-default CuPy streams our blocks were ordered on, kept alive while the pool may still
        # name their handles (a block's free, its pending release until settled). Why: CuPy
        # destroys a stream when its object goes (`with cupy.cuda.Stream(): ...`), and giving the
        # driver a destroyed stream's handle is undefined -- on the H200 it answered
        # CONTEXT_IS_DESTROYED, then INVALID_CONTEXT, and then crashed the process.
        self._streams: Dict[int, Any] = {}
        self._lock = threading.Lock()
        self._prune_at = 32
        # _core.CupyAllocator when CuPy calls poolkeeper through CFunctionAllocator (install()).
        self.native: Any = None
        self.cfunction_allocator: Any = None  # the cupy.cuda.memory.CFunctionAllocator over it

    def graph_pools(self, device: int) -> Any:
        gp = self.graphs.get(device)
        if gp is None:
            from poolkeeper import _core

            gp = self.graphs.setdefault(device, _core.GraphPools(self.pools.get(device)))
            native = self.native  # read once: uninstall() on another thread sets it to None
            if native is not None:
                native.set_graph_pools(device, gp)  # a capture scope sends `device` to the slow path
        return gp

    def __call__(self, size: int):
        """CuPy's Python allocator interface (CuPy without CFunctionAllocator, or
        POOLKEEPER_CUPY_NATIVE=0): every request takes the slow path."""
        device = self._get_device()
        if size == 0:
            return self._MemoryPointer(self._Memory(0), 0)  # what CuPy's own pool returns
        ptr, owner = self.slow(size, device)
        return self._MemoryPointer(self._UnownedMemory(ptr, size, owner, device), 0)

    def slow(self, size: int, device: int):
        """Allocate ``size`` bytes on ``device`` on the current CuPy stream: ``(ptr, owner)``,
        where dropping ``owner`` returns the block (ordered on that stream, which it keeps alive).
        Called by CuPy through :meth:`__call__`, or from C for what the fast path does not serve."""
        pool = self.pools.get(device)
        # Read once: uninstall() on another thread sets it to None, and between a check and a use
        # of the attribute that was a bare AttributeError out of CuPy's allocation.
        native = self.native
        if native is not None:
            native.set_pool(device, pool)  # the next default-stream request takes the fast path
        gp = self.graphs.get(device)
        stream_obj = self._current_stream()
        stream = stream_obj.ptr
        try:
            if gp is not None and gp.routing:
                # A capture scope is open (graph_capture): GraphPools decides, and the block goes
                # back through it (to the capture's private pool, or to the device pool).
                ptr = gp.allocate(size, stream)
                owner = _GraphBlock(gp, ptr, stream)
            else:
                # The owner is native: it allocated the block and returns it, ordered on `stream`,
                # from its C++ destructor when CuPy drops the memory (no Python __del__ per array).
                owner = _Owner(pool, size, stream)
        except OutOfMemoryError as e:
            self.raise_oom(e, size)
        with self._lock:  # threads allocate at once; `+=` alone can lose a count
            self.calls += 1
        if stream:
            self._keep_stream(stream, stream_obj, pool)
            # The stream outlives the block's free: a tuple drops its items last to first.
            return owner.ptr, (stream_obj, owner)
        return owner.ptr, owner

    def raise_oom(self, e: BaseException, size: int) -> None:
        """Raise what CuPy users catch for poolkeeper's error ``e`` (the fast path's error hook)."""
        if not isinstance(e, OutOfMemoryError):
            raise e
        err = self._OOM(size, getattr(e, "reserved", 0) or 0, getattr(e, "limit", 0) or 0)
        err.poolkeeper_diagnosis = str(e)
        raise err from e

    def _keep_stream(self, handle: int, stream_obj: Any, pool: Any) -> None:
        # Several threads allocate through CuPy at once: a walk over the table while another
        # thread added a stream raised "dictionary changed size during iteration" out of CuPy's
        # allocation. Keys are plain ints (no user code runs while the lock is held), and the
        # pool is asked outside the lock.
        handle = operator.index(handle)
        with self._lock:
            if handle in self._streams:
                return
            self._streams[handle] = stream_obj
            if len(self._streams) < self._prune_at:
                return
        # Drop streams with nothing pending in the pool (live blocks hold their own stream).
        try:
            pending = {operator.index(h) for h in pool.stats().get("pending_by_stream", {})}
        except Exception:
            return
        with self._lock:
            for h in [h for h in self._streams if h not in pending and h != handle]:
                del self._streams[h]
            self._prune_at = max(32, 2 * len(self._streams))


class _PinnedAllocator:
    """The function CuPy calls for pinned memory: ``allocator(size) -> PinnedMemoryPointer``."""

    def __init__(self, cupy: Any, pool: Any) -> None:
        self._PinnedMemoryPointer = cupy.cuda.PinnedMemoryPointer
        self._PinnedMemory = cupy.cuda.PinnedMemory
        self.pool = pool
        self.calls = 0

    def __call__(self, size: int):
        if size == 0:
            return self._PinnedMemoryPointer(self._PinnedMemory(0), 0)
        ptr = self.pool.allocate(size)
        self.calls += 1
        return self._PinnedMemoryPointer(_PinnedBlock(self.pool, ptr, size), 0)


@dataclass
class CupyInstallation:
    """What :func:`install` set up, and what :func:`uninstall` restores."""

    allocator: _DeviceAllocator
    pinned_allocator: Optional[_PinnedAllocator]
    previous_allocator: Optional[Callable]
    previous_pinned_allocator: Optional[Callable]
    notes: Dict[str, str] = field(default_factory=dict)
    # What CuPy was given: ``CFunctionAllocator(...).malloc`` over ``native`` (the C path), or
    # ``allocator`` itself (the Python path).
    cupy_allocator: Any = None
    native: Any = None  # _core.CupyAllocator, or None on the Python path

    @property
    def calls(self) -> int:
        """Device allocations poolkeeper has served for CuPy (both paths)."""
        fast = self.native.stats()["fast_allocs"] if self.native is not None else 0
        return self.allocator.calls + fast

    @property
    def path(self) -> str:
        """``"native"`` (CuPy calls poolkeeper's C functions) or ``"python"``."""
        return "native" if self.native is not None else "python"

    def pools(self) -> Dict[int, Any]:
        """``{device: pool}`` for device memory (-1 for a pool that serves every device)."""
        return self.allocator.pools.all()

    @property
    def pinned_pool(self) -> Any:
        return self.pinned_allocator.pool if self.pinned_allocator else None


_LOCK = threading.Lock()
_INSTALLED: Optional[CupyInstallation] = None


def installation() -> Optional[CupyInstallation]:
    """The current :class:`CupyInstallation`, or None."""
    return _INSTALLED


def default_pinned_pool(device: int = 0) -> Any:
    """The pinned pool :func:`install` makes when none is given: an ArenaPool over CudaPinned."""
    from poolkeeper.cuda.upstreams import CudaPinned
    from poolkeeper.pools import ArenaPool

    return ArenaPool(CudaPinned(device), initial_backing=2 * MiB, max_backing=256 * MiB)


def install(
    pool: Any = "arena",
    *,
    pinned: Any = True,
    upstream: Optional[str] = None,
    **options: Any,
) -> CupyInstallation:
    """Make poolkeeper CuPy's allocator.

    Args:
        pool: a pool kind (``"arena"``, ``"arena_expandable"``, ``"size_class"``, ``"direct"``;
            see :data:`poolkeeper.pools.KINDS`): one pool per device, made on first use over
            ``upstream`` (``"device"``: CudaDevice, ``"async"``: CudaAsync, ``"virtual"``:
            CudaVirtual; None: the kind's default -- ``"virtual"`` for ``arena_expandable``,
            ``"device"`` otherwise) with ``options``; or an existing pool, serving its own device.
        pinned: True (default): also CuPy's pinned allocator, over :func:`default_pinned_pool`;
            a pool: use that one (its upstream should be CudaPinned); False: leave pinned
            memory to CuPy.

    CuPy calls poolkeeper's C functions where it can (``CupyInstallation.path == "native"``;
    see the module docstring); ``POOLKEEPER_CUPY_NATIVE=0`` keeps the Python allocator.

    Raises :class:`MissingDependencyError` without cupy, :class:`IntegrationError` when already
    installed (call :func:`uninstall` first). All or nothing: if CuPy refuses the pinned
    allocator, its previous device allocator is put back before the error propagates.
    """
    global _INSTALLED
    cupy = _cupy()
    with _LOCK:
        if _INSTALLED is not None:
            raise IntegrationError("poolkeeper is already CuPy's allocator: call uninstall() first")
        pools = _DevicePools(pool, upstream, options)
        cuda = cupy.cuda
        notes: Dict[str, str] = {}
        prev = cuda.get_allocator() if hasattr(cuda, "get_allocator") else None
        getter = getattr(cuda, "get_pinned_memory_allocator", None)
        if getter is not None:
            prev_pinned = getter()
        else:
            # CuPy has no getter for the pinned allocator: restore CuPy's own default on uninstall.
            prev_pinned = cupy.get_default_pinned_memory_pool().malloc
            notes["pinned_restore"] = "CuPy's default pinned memory pool (CuPy offers no getter)"
        alloc = _DeviceAllocator(cupy, pools)
        given, why = _native_allocator(cupy, alloc)
        notes["path"] = why
        pinned_alloc = None
        if not (isinstance(pinned, bool) or pinned is None or callable(getattr(pinned, "allocate", None))):
            # pinned=3 was accepted, and CuPy's first pinned allocation raised AttributeError
            raise InvalidArgumentError(f"pinned must be True, False or a poolkeeper pool; got {brief(pinned)}")
        if pinned is not False and pinned is not None:
            ppool = default_pinned_pool(_first_device(cupy)) if pinned is True else pinned
            pinned_alloc = _PinnedAllocator(cupy, ppool)
        cuda.set_allocator(given)
        if pinned_alloc is not None:
            try:
                cuda.set_pinned_memory_allocator(pinned_alloc)
            except BaseException:
                # All or nothing: CuPy keeps its own device allocator, installation() stays None.
                cuda.set_allocator(prev if prev is not None else _cupy_default_allocator(cupy))
                alloc.native = alloc.cfunction_allocator = None  # see uninstall(): no cycle left behind
                raise
        _INSTALLED = CupyInstallation(alloc, pinned_alloc, prev, prev_pinned, notes, given, alloc.native)
        return _INSTALLED


def _stream_getter(cupy: Any) -> Any:
    """CuPy's C getter of the current stream (a capsule of ``intptr_t (void)``), or a Python
    callable when this CuPy does not export one."""
    try:
        import importlib

        capi = getattr(importlib.import_module("cupy_backends.cuda.stream"), "__pyx_capi__", {})
        cap = capi.get("get_current_stream_ptr")
        if cap is not None and _capsule_signature(cap).replace(" ", "") in ("intptr_t(void)", "Py_intptr_t(void)"):
            return cap
    except Exception:  # another CuPy layout: the Python getter below is always right
        pass
    get = cupy.cuda.get_current_stream
    return lambda: get().ptr


def _capsule_signature(cap: Any) -> str:
    import ctypes

    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return (name(cap) or b"").decode()


def _native_allocator(cupy: Any, alloc: _DeviceAllocator):
    """(what to give cupy.cuda.set_allocator, why): CFunctionAllocator over _core.CupyAllocator
    where CuPy has it and POOLKEEPER_CUPY_NATIVE is not 0, else the Python allocator."""
    if os.environ.get("POOLKEEPER_CUPY_NATIVE", "1") == "0":
        return alloc, "python (POOLKEEPER_CUPY_NATIVE=0)"
    cfa_type = getattr(getattr(cupy.cuda, "memory", None), "CFunctionAllocator", None)
    if cfa_type is None:
        return alloc, "python (this CuPy has no cupy.cuda.memory.CFunctionAllocator)"
    from poolkeeper import _core

    getter = _stream_getter(cupy)
    native = _core.CupyAllocator(alloc.slow, alloc.raise_oom, getter)
    cfa = cfa_type(native.param, native.malloc_address, native.free_address, native)
    alloc.native = native
    alloc.cfunction_allocator = cfa
    stream = "CuPy's C stream getter" if native.c_stream_getter else "a Python stream getter"
    return cfa.malloc, f"native (CFunctionAllocator; current stream through {stream})"


def _cupy_default_allocator(cupy: Any) -> Any:
    # What CuPy allocates with when nobody set an allocator: its default memory pool.
    return cupy.get_default_memory_pool().malloc


def _first_device(cupy: Any) -> int:
    try:
        return int(cupy.cuda.runtime.getDevice())
    except Exception:
        return 0


def uninstall() -> None:
    """Put back the allocators that were current before :func:`install`. Blocks CuPy still holds
    keep their pools alive and return to them when collected. Does nothing when not installed."""
    global _INSTALLED
    cupy = _cupy()
    with _LOCK:
        inst = _INSTALLED
        if inst is None:
            return
        cupy.cuda.set_allocator(inst.previous_allocator)
        if inst.pinned_allocator is not None:
            cupy.cuda.set_pinned_memory_allocator(inst.previous_pinned_allocator)
        # The native state holds the allocator's bound methods; dropping the allocator's link back
        # breaks that cycle (a native object is invisible to the garbage collector), so the state
        # goes with the last block CuPy frees, and the allocator with it.
        inst.allocator.native = None
        inst.allocator.cfunction_allocator = None
        _INSTALLED = None


_GRAPH_IDS = itertools.count(1)
_GRAPH_STREAMS: Dict[tuple, Any] = {}  # graph pool id -> its capture stream (see graph_capture)


class CapturedGraph:
    """A CUDA graph captured by :func:`graph_capture`: ``graph`` is CuPy's ``cupy.cuda.Graph``
    (``graph.launch(stream)`` replays it). The graph's private pool is released when this object
    is collected or :meth:`release` is called; its memory returns to the device pool once no
    block of it is alive any more."""

    def __init__(self, graph_pools: Any, pool_id: tuple, stream: Any = None) -> None:
        self.graph: Any = None
        self.pool_id = pool_id
        # The capture stream lives as long as the graph: blocks the capture freed wait in its lane
        # until the pool settles them, and a destroyed stream handle must never be asked about.
        self.stream = stream
        self._finalizer = weakref.finalize(self, graph_pools.release, pool_id)

    def launch(self, stream: Any = None) -> None:
        """Replay the graph on ``stream`` (default: the current stream)."""
        if stream is None:
            self.graph.launch()
        else:
            self.graph.launch(stream)

    def release(self) -> None:
        """Release the graph's private pool now (the graph must not be launched afterwards)."""
        self.graph = None
        self._finalizer()


@contextlib.contextmanager
def graph_capture(stream: Any = None, *, pool: Optional[tuple] = None) -> Any:
    """Capture the CuPy work of the block into a CUDA graph, with every allocation made on the
    capturing stream coming from a private pool of poolkeeper's (docs/integrations.md, "CUDA
    graphs"): addresses the graph uses stay reserved for it, and an array freed inside the
    capture is reused only inside it.

    Args:
        stream: a ``cupy.cuda.Stream`` to capture on (default: a new non-blocking one; the block
            runs with it as the current stream).
        pool: share a private pool between graphs (any ``(int, int)`` pair; graphs sharing one
            must be launched in the order they were captured).

    Yields a :class:`CapturedGraph` whose ``graph`` is set when the block ends.
    """
    cupy = _cupy()
    inst = _INSTALLED
    if inst is None:
        raise IntegrationError("graph_capture() needs poolkeeper installed as CuPy's allocator (install() first)")
    device = _first_device(cupy)
    gp = inst.allocator.graph_pools(device)
    try:
        pid = tuple(pool) if pool is not None else (next(_GRAPH_IDS), 0)
    except TypeError:  # pool=3 was tuple()'s bare TypeError
        raise InvalidArgumentError(f"pool must be a pair of ints such as (1, 0); got {brief(pool)}") from None
    s = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)
    # begin() checks the id. The graph (whose finalizer releases the id) is made only once the
    # scope is open: made first, a refused id was released again at collection, which raised
    # there ("Exception ignored in: <finalize object>").
    gp.begin(pid, s.ptr)
    try:
        captured = CapturedGraph(gp, pid, s)
        # The capture stream stays alive while the graph's pool exists (its lane names the handle).
        live_ids = {tuple(i["id"]) for i in gp.info()}
        for k in [k for k in _GRAPH_STREAMS if k not in live_ids]:
            del _GRAPH_STREAMS[k]
        _GRAPH_STREAMS[pid] = s
        with s:
            s.begin_capture()
            try:
                yield captured
            finally:
                captured.graph = s.end_capture()
    finally:
        gp.end(pid)


def stats(device: Optional[int] = None) -> Dict[str, Any]:
    """Stats of the device pool serving ``device`` (default: CuPy's current device)."""
    inst = _INSTALLED
    if inst is None:
        raise IntegrationError("poolkeeper is not CuPy's allocator (install() first)")
    if device is None:
        device = _first_device(_cupy())
    return inst.allocator.pools.get(device).stats()


__all__ = [
    "install",
    "uninstall",
    "installation",
    "stats",
    "default_pinned_pool",
    "CupyInstallation",
    "graph_capture",
    "CapturedGraph",
]
