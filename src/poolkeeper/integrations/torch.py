"""poolkeeper inside PyTorch.

Two ways in:

- :func:`install` replaces PyTorch's CUDA caching allocator for the whole process, through
  ``torch.cuda.memory.CUDAPluggableAllocator`` over the C functions the core exports
  (``poolkeeper_torch_malloc`` / ``poolkeeper_torch_free`` in ``poolkeeper/_core*.so``, reached
  through a small shim built against the installed torch on first use, because PyTorch does not
  check malloc's result for NULL: an allocation the pool cannot serve raises
  ``torch.OutOfMemoryError`` with the pool's diagnosis; without a compiler, the core's
  ``poolkeeper_torch_malloc_raising`` raises ``RuntimeError`` instead). Every
  CUDA tensor then comes from a poolkeeper pool, one per device, created in the core on that
  device's first allocation. It must run before CUDA is initialized in the process.
- :func:`mempool` / :func:`use_mempool` keep PyTorch's own allocator and route only the
  allocations made inside a ``with`` block to a ``torch.cuda.MemPool`` whose segments come from
  poolkeeper. This works at any time.

While installed, :func:`stats`, :func:`snapshot` and :func:`pools` read poolkeeper's own pools.
PyTorch's ``torch.cuda.memory_stats``/``memory_snapshot`` raise for a pluggable allocator (it
offers no hook for them), so the same names are served here from the pools:
:func:`memory_stats`, :func:`max_memory_allocated`, :func:`max_memory_reserved`,
:func:`reset_peak_memory_stats`, :func:`memory_summary`, :func:`dump_snapshot` (PyTorch's snapshot
pickle, for ``torch.cuda._memory_viz`` and pytorch.org/memory_viz).

Hooks: PyTorch's pluggable allocator (2.x, checked against 2.11) lets an allocator take
``record_stream`` (``set_record_stream_fn``), ``empty_cache`` (``set_reset_fn``) and the three
CUDA-graph hooks (``set_begin_allocate_to_pool``, ``set_end_allocate_to_pool_fn``,
``set_release_pool``); each is wired when the running PyTorch offers it (:func:`installation`
says which were). With the graph hooks, ``torch.cuda.graph`` captures (and
``torch.compile(mode="reduce-overhead")``) allocate from a private pool per graph or shared
handle: see :func:`graph_pools` and docs/integrations.md, "CUDA graphs".
``set_memory_fraction_fn`` exists too but is not wired: a pool's cap is its ``limit`` option,
fixed when the pool is made -- pass ``limit=`` to :func:`install`. ``memory_stats``,
``memory_snapshot``, ``getMemoryFraction`` and IPC handles are not offered to pluggable
allocators by PyTorch at all.

Importing this module does not import torch; the functions do.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from poolkeeper import _core
from poolkeeper.integrations._common import (
    AllocatorInitializedError,
    FrameworkCudaUnavailableError,
    IntegrationError,
    PluggableAllocatorUnavailableError,
    import_optional,
)

MALLOC_SYMBOL = "poolkeeper_torch_malloc_raising"  # install(): a failure raises instead of NULL
MEMPOOL_MALLOC_SYMBOL = "poolkeeper_torch_malloc"  # mempool(): NULL, which PyTorch's pool checks
FREE_SYMBOL = "poolkeeper_torch_free"
RECORD_STREAM_SYMBOL = "poolkeeper_torch_record_stream_hook"
EMPTY_CACHE_SYMBOL = "poolkeeper_torch_empty_cache_hook"
HOOK_COUNTERS_SYMBOL = "poolkeeper_torch_hook_counters"
GRAPH_BEGIN_SYMBOL = "poolkeeper_torch_begin_allocate_to_pool"
GRAPH_END_SYMBOL = "poolkeeper_torch_end_allocate_to_pool"
GRAPH_RELEASE_SYMBOL = "poolkeeper_torch_release_pool"

# hook name -> (setter on PyTorch's _CUDAPluggableAllocator, our exported symbol)
HOOKS = {
    "record_stream": ("set_record_stream_fn", RECORD_STREAM_SYMBOL),
    "empty_cache": ("set_reset_fn", EMPTY_CACHE_SYMBOL),
    # CUDA graphs: torch.cuda.graph, graph_pool_handle(), torch.cuda.MemPool and torch.compile's
    # "reduce-overhead" open a private-pool scope around each capture (docs/integrations.md).
    "graph_begin": ("set_begin_allocate_to_pool", GRAPH_BEGIN_SYMBOL),
    "graph_end": ("set_end_allocate_to_pool_fn", GRAPH_END_SYMBOL),
    "graph_release": ("set_release_pool", GRAPH_RELEASE_SYMBOL),
}

_TOO_LATE = (
    "poolkeeper.integrations.torch.install() must run before CUDA is initialized in this process: "
    "PyTorch fixes its CUDA allocator at initialization and cannot swap it afterwards. Call install() "
    "first thing, right after `import torch` and before any CUDA tensor, torch.cuda call that initializes "
    "CUDA, or library that does (or run in a fresh process). To use poolkeeper inside an already running "
    "process, route a scope instead: `with poolkeeper.integrations.torch.use_mempool(): ...`."
)


@dataclass
class Installation:
    """What :func:`install` set up."""

    kind: str
    options: Dict[str, Any]
    upstream: str
    library: str
    allocator: Any  # torch.cuda.memory.CUDAPluggableAllocator
    hooks: Dict[str, bool] = field(default_factory=dict)  # hook -> wired?
    devices: List[int] = field(default_factory=list)  # pools made eagerly at install
    pool: Any = None  # the existing pool passed to install(pool), if one was
    # What an allocation that fails inside PyTorch raises: "torch.OutOfMemoryError" through the
    # shim built against this torch (see _torch_oom_shim), else "RuntimeError"; oom_note says why.
    oom_type: str = "RuntimeError"
    oom_note: str = ""


_LOCK = threading.Lock()
_INSTALLED: Optional[Installation] = None
_MEMPOOL_ALLOCATOR: Any = None  # one pluggable allocator shared by every mempool()


def library_path() -> str:
    """The shared object that exports poolkeeper's C functions (the core module itself)."""
    return _core.__file__


@functools.lru_cache(maxsize=None)
def _capi() -> ctypes.CDLL:
    """The core module as a C library (loaded once), with the signatures of the functions Python
    calls through it."""
    lib = ctypes.CDLL(library_path())
    counters = ctypes.POINTER(ctypes.c_uint64)
    lib.poolkeeper_torch_hook_counters.argtypes, lib.poolkeeper_torch_hook_counters.restype = [counters], None
    lib.poolkeeper_call_timing.argtypes, lib.poolkeeper_call_timing.restype = [counters], None
    lib.poolkeeper_set_call_timing.argtypes, lib.poolkeeper_set_call_timing.restype = [ctypes.c_int], ctypes.c_int
    return lib


def _symbol_address(name: str) -> int:
    addr = ctypes.cast(getattr(_capi(), name), ctypes.c_void_p).value
    if not addr:
        raise IntegrationError(f"{library_path()} does not export {name}")
    return int(addr)


def _torch():
    return import_optional("torch", "poolkeeper.integrations.torch", "torch")


def _devices(device: Union[None, int, Sequence[int]]) -> List[int]:
    if device is None:
        return []
    if isinstance(device, int):
        return [device]
    return [int(d) for d in device]


def _check_device_pool(pool: Any) -> int:
    """The CUDA device ``pool`` may serve as PyTorch's allocator, or a typed error: PyTorch puts
    CUDA tensors in whatever it gets, so host, pinned or simulated memory must never get there."""
    from poolkeeper.errors import InvalidArgumentError

    up = getattr(pool, "upstream", None)
    if not callable(getattr(pool, "allocate", None)) or up is None:
        raise InvalidArgumentError(
            f"install(pool) needs a poolkeeper pool or a pool kind name; got {type(pool).__name__}"
        )
    kind, device, name = getattr(up, "kind", None), getattr(up, "device", -1), getattr(up, "name", "?")
    if kind != "device" or not isinstance(device, int) or device < 0 or name == "Simulated":
        raise InvalidArgumentError(
            f"install(pool) needs a pool over CUDA device memory (CudaDevice, CudaAsync, CudaVirtual); "
            f"this pool's upstream is {name} (kind {kind!r}, device {device}): PyTorch would put CUDA tensors in it"
        )
    return device


def _require_cuda_torch(torch: Any, what: str, mempool: bool = False) -> None:
    """Refuse, with what to do, a torch that cannot take an external CUDA allocator."""
    version = getattr(torch, "__version__", "?")
    mem = getattr(getattr(torch, "cuda", None), "memory", None)
    needed = ["CUDAPluggableAllocator"] + (["MemPool"] if mempool else ["change_current_allocator"])
    where = {"MemPool": getattr(torch, "cuda", None)}
    missing = [n for n in needed if not hasattr(where.get(n, mem), n)]
    if missing:
        raise PluggableAllocatorUnavailableError(
            f"{what} needs PyTorch's pluggable-allocator interface, but torch {version} has no "
            f"{', '.join('torch.cuda.' + ('' if n == 'MemPool' else 'memory.') + n for n in missing)}. "
            "Upgrade PyTorch (2.1 or newer for install(), 2.5 or newer for mempool()), or use poolkeeper's "
            "pools directly (poolkeeper.ArenaPool(poolkeeper.upstream.CudaDevice(0)))."
        )
    c = getattr(torch, "_C", None)
    if c is not None and not hasattr(c, "_cuda_customAllocator"):
        raise FrameworkCudaUnavailableError(
            f"{what}: torch {version} is a CPU-only build (torch._C has no _cuda_customAllocator, "
            f"torch.version.cuda is {getattr(getattr(torch, 'version', None), 'cuda', None)!r}), so it has no CUDA "
            "allocator to replace. Install a CUDA build of PyTorch (see pytorch.org's install selector) to use "
            "poolkeeper inside PyTorch; poolkeeper's own pools work without torch."
        )
    available = getattr(getattr(torch, "cuda", None), "is_available", None)
    if available is not None and not available():
        raise FrameworkCudaUnavailableError(
            f"{what}: torch.cuda.is_available() is False: PyTorch sees no CUDA device or driver (check "
            "nvidia-smi, CUDA_VISIBLE_DEVICES, and that the driver supports torch's CUDA version "
            f"{getattr(getattr(torch, 'version', None), 'cuda', None)!r})."
        )


def installation() -> Optional[Installation]:
    """The current :class:`Installation`, or None when :func:`install` has not run."""
    return _INSTALLED


def _virtual_memory_everywhere() -> bool:
    """Whether every CUDA device this process can see can run the expandable arena (CUDA virtual
    memory). Asked of the driver, not of torch, which must not initialize CUDA before install(),
    and by device attributes alone: ``poolkeeper.cuda.device_info`` would retain a context on
    every device, hundreds of MiB each, in every process (a review found it)."""
    try:
        n = int(_core.cuda_device_count())
        return n > 0 and all(bool(_core.cuda_virtual_memory_supported(d)) for d in range(n))
    except Exception:  # no driver poolkeeper can use: the fallback pool asks nothing of it
        return False


def install(
    pool: Any = None,
    device: Union[None, int, Sequence[int]] = None,
    *,
    upstream: Optional[str] = None,
    **options: Any,
) -> Installation:
    """Make poolkeeper PyTorch's CUDA allocator for this process.

    Args:
        pool: the pool kind made for each device (``"arena"``, ``"arena_expandable"``,
            ``"size_class"``, ``"direct"``: :data:`poolkeeper.pools.KINDS`), or an existing
            device pool to serve its own device. None (default): ``"arena_expandable"`` with
            ``single_stream=True`` where every visible device supports CUDA virtual memory and
            ``upstream`` is None or ``"virtual"``, else ``"arena"`` with ``single_stream=True``
            (:func:`poolkeeper.pools.default_device_pool`; why: docs/integrations.md, "Which pool
            by default"). Options given here override those (``single_stream=False``).
        device: devices whose pools are made now rather than on first use (None: all lazily).
        upstream: where each device pool gets memory: ``"device"`` (``cuMemAlloc``), ``"async"``
            (``cuMemAllocAsync``) or ``"virtual"`` (``CudaVirtual``: reserve and map, what
            ``arena_expandable`` needs). None (default): the kind's own default, ``"virtual"``
            for ``arena_expandable`` and ``"device"`` for the others.
        **options: the pool's options (see :class:`poolkeeper.ArenaPool` etc.), e.g.
            ``max_backing=1 << 30`` or ``limit=64 << 30``. Checked now: an unknown option raises
            :class:`~poolkeeper.errors.InvalidArgumentError` and installs nothing.

    Returns the :class:`Installation`. Calling it again with the same arguments (the same kind
    and options, or the very same pool object) returns the same installation; with different ones
    it raises :class:`IntegrationError` (PyTorch cannot swap a used allocator).

    An allocation that fails inside PyTorch raises ``torch.OutOfMemoryError`` carrying the pool's
    diagnosis when the small shim built against this torch on first use is available (a C++
    compiler and torch's headers are needed) and has passed a check in a separate process (a few
    seconds, once; both are cached), else ``RuntimeError`` with the same text, with a warning;
    :attr:`Installation.oom_type` says which and ``oom_note`` why. ``POOLKEEPER_TORCH_OOM_SHIM=0``
    turns the shim off, ``=1`` uses it without the check (see ``_torch_oom_shim``).

    Raises:
        InvalidArgumentError: ``pool`` is a pool whose upstream is not CUDA device memory
            (``CudaPinned``, ``Host``, ``Simulated``...), or not a pool at all.
        MissingDependencyError: torch is not installed.
        PluggableAllocatorUnavailableError: this torch has no pluggable-allocator interface.
        FrameworkCudaUnavailableError: a CPU-only torch, or no CUDA device visible to it.
        AllocatorInitializedError: CUDA is already initialized (see the message for what to do).
    """
    global _INSTALLED
    if pool is not None and not isinstance(pool, str):
        _check_device_pool(pool)  # before torch is even imported: a wrong pool is wrong anywhere
    torch = _torch()
    _require_cuda_torch(torch, "poolkeeper.integrations.torch.install()")
    if pool is None:
        from poolkeeper.pools import default_device_pool

        pool, defaults = default_device_pool(upstream, _virtual_memory_everywhere)
        options = {**defaults, **options}
    if isinstance(pool, str):
        from poolkeeper.pools import resolve_cuda_upstream, set_device_factory

        upstream = resolve_cuda_upstream(pool, upstream)
    with _LOCK:
        if _INSTALLED is not None:
            if isinstance(pool, str):
                same = (
                    _INSTALLED.pool is None
                    and pool == _INSTALLED.kind
                    and options == _INSTALLED.options
                    and upstream == _INSTALLED.upstream
                )
            else:
                same = pool is _INSTALLED.pool and not options
            if same:
                return _INSTALLED
            raise IntegrationError(
                f"poolkeeper is already PyTorch's allocator ({_INSTALLED.kind} over {_INSTALLED.upstream}, "
                f"options {_INSTALLED.options}); PyTorch cannot swap an allocator once it is in use"
            )
        if _MEMPOOL_ALLOCATOR is not None:
            raise IntegrationError(
                "mempool() already routes scopes through PyTorch's native allocator in this process; "
                "install() must come first, before any mempool() and before CUDA is initialized"
            )
        if torch.cuda.is_initialized():
            raise AllocatorInitializedError(_TOO_LATE)

        if isinstance(pool, str):
            kind = pool
            set_device_factory(kind, options, upstream)  # validates; raises before any change
        else:
            if options:
                raise IntegrationError("options apply to a pool kind, not to an existing pool")
            kind = type(pool).__name__
            _core.registry_set(_check_device_pool(pool), pool)
        made: List[int] = []
        try:
            if isinstance(pool, str):
                for d in _devices(device):
                    # Made by the factory in C++, like the lazy ones: a Python-made pool in the
                    # registry would outlive the interpreter (poolkeeper._exit).
                    _core.registry_ensure(d)
                    made.append(d)
            oom_lib, malloc_symbol, free_symbol, oom_type, oom_note = _oom_allocator(torch)
            allocator = torch.cuda.memory.CUDAPluggableAllocator(oom_lib, malloc_symbol, free_symbol)
            hooks = _wire_hooks(allocator)
            torch.cuda.memory.change_current_allocator(allocator)
        except RuntimeError as e:
            _core.registry_clear()
            if "initialized" in str(e):
                raise AllocatorInitializedError(_TOO_LATE + f" (PyTorch said: {e})") from e
            raise
        except BaseException:
            _core.registry_clear()
            raise
        _provide_pool_live_check(torch)
        _INSTALLED = Installation(
            kind=kind,
            options=dict(options),
            upstream=upstream,
            library=library_path(),
            allocator=allocator,
            hooks=hooks,
            devices=made,
            pool=None if isinstance(pool, str) else pool,
            oom_type=oom_type,
            oom_note=oom_note,
        )
        return _INSTALLED


def _device_index(device: Any) -> int:
    """``device`` as the core's graph registry takes it, or InvalidArgumentError: a str, or an int
    outside 64 bits, was nanobind's bare TypeError."""
    import operator

    from poolkeeper.errors import InvalidArgumentError, brief

    try:
        d = operator.index(device)
    except TypeError:
        raise InvalidArgumentError(f"device must be an int; got {brief(device)}") from None
    if not -(1 << 31) <= d < 1 << 31:
        raise InvalidArgumentError(f"device {brief(d)} is not a device index")
    return d


def check_pool_live_allocations(device: int, pool_id: Any, expected: Any) -> bool:
    """What ``torch._C._cuda_checkPoolLiveAllocations`` answers for PyTorch's own allocator, for
    poolkeeper's graph pools: are the live blocks of graph pool ``pool_id`` on ``device`` exactly
    the data pointers in ``expected``? torch.compile's CUDA-graph trees ask this to check that
    nothing but the tensors they track is alive in a graph's pool."""
    gp = _core.graph_pools_find(_device_index(device))
    live = set() if gp is None else set(gp.live_blocks((int(pool_id[0]), int(pool_id[1]))))
    return live == {int(p) for p in expected}


@dataclass(frozen=True)
class GraphPoolCheckpoint:
    """What :func:`get_checkpoint_state` records of a graph pool: its live blocks at that moment,
    as addresses and as ``(address, size asked, stream)``."""

    device: int
    pool_id: tuple
    live_blocks: frozenset
    blocks: tuple = ()


def get_checkpoint_state(device: int, pool_id: Any) -> GraphPoolCheckpoint:
    """``torch._C._cuda_getCheckpointState`` for poolkeeper's graph pools: the live blocks of graph
    pool ``pool_id`` now. torch.compile's CUDA-graph trees take one after each recording."""
    gp = _core.graph_pools_find(_device_index(device))
    pid = (int(pool_id[0]), int(pool_id[1]))
    blocks = () if gp is None else tuple(tuple(b) for b in gp.live_block_info(pid))
    return GraphPoolCheckpoint(int(device), pid, frozenset(b[0] for b in blocks), blocks)


_STORAGE_SHIM: Any = None  # the ctypes library of _torch_oom_shim, once loaded for storage changes


def _storage_shim(torch: Any) -> Any:
    """The shim's storage functions (see :mod:`._torch_oom_shim`), built on first use, or
    IntegrationError saying why they cannot be had and what to do instead."""
    global _STORAGE_SHIM
    if _STORAGE_SHIM is None:
        from poolkeeper.integrations import _torch_oom_shim

        b = _torch_oom_shim.build(torch, force=True)
        if b.path is None:
            raise IntegrationError(
                "torch.compile's CUDA-graph trees asked poolkeeper to restore a graph-pool checkpoint "
                "(setCheckpointPoolState), which needs a small library built against the installed torch "
                f"to change storages' owners, and it could not be built: {b.reason}. Install a C++ compiler, or set "
                "torch._inductor.config.triton.cudagraph_trees = False before compiling (mode='reduce-overhead' then "
                "captures each graph into a pool of its own)"
            )
        lib = ctypes.CDLL(b.path)
        lib.poolkeeper_shim_storage_data.argtypes = [ctypes.c_void_p]
        lib.poolkeeper_shim_storage_data.restype = ctypes.c_void_p
        for name in ("poolkeeper_shim_adopt", "poolkeeper_shim_disown"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_int
        _STORAGE_SHIM = lib
    return _STORAGE_SHIM


def set_checkpoint_pool_state(
    device: int, state: Any, stale_storages: Sequence[int] = (), storages_to_add_deleters_to: Sequence[int] = ()
) -> None:
    """``torch._C._cuda_setCheckpointPoolState`` for poolkeeper's graph pools: put graph pool
    ``state.pool_id`` back to the live blocks of checkpoint ``state`` (:func:`get_checkpoint_state`).

    torch.compile's CUDA-graph trees call it to record a new graph while outputs of another one
    are alive (a new input shape after a graph break, say). Blocks allocated since the checkpoint
    are freed and blocks freed since are handed out again at their own addresses (the graphs write
    there on replay), both through PyTorch's allocator interface so that its own record of each
    block follows. Then each storage of ``storages_to_add_deleters_to`` (``StorageImpl`` pointers:
    outputs the trees made over graph memory, with no deleter) whose block was handed out again
    takes the allocator's deleter, so that its death frees the block; each of ``stale_storages``
    (whose blocks this frees) loses it. Those two steps change storages inside PyTorch, which only
    code built against its headers can do: the small library of :mod:`._torch_oom_shim`, built on
    first use.

    Raises :class:`InvalidArgumentError` for a ``state`` not made by :func:`get_checkpoint_state`
    or storages that are not pointers, and :class:`IntegrationError` when the library cannot be
    built, when a block this would free is not matched by a stale storage (as PyTorch's own
    restore checks; nothing changes then), or when a block cannot be put back (the blocks handed
    back before it are freed again; the message says which)."""
    torch = _torch()
    from poolkeeper.errors import InvalidArgumentError, brief

    if not isinstance(state, GraphPoolCheckpoint):
        raise InvalidArgumentError(f"state must be what get_checkpoint_state returned; got {brief(state)}")
    dev = _device_index(device)
    if dev != state.device:
        raise InvalidArgumentError(f"the checkpoint is of device {state.device}, not {dev}")
    gp = _core.graph_pools_find(dev)
    if gp is None:
        raise IntegrationError(f"no CUDA-graph pool exists on device {dev}: nothing to restore")
    shim = _storage_shim(torch)
    pid = state.pool_id
    try:
        want = {int(a): (int(n), s) for a, n, s in state.blocks}
        stale = _storage_pointers(stale_storages)
        adopters = _storage_pointers(storages_to_add_deleters_to)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"a checkpoint's blocks are (address, size, stream) triples and storages are StorageImpl pointers (ints); "
            f"got {brief(state.blocks)}, {brief(stale_storages)}, {brief(storages_to_add_deleters_to)}"
        ) from None
    now = {a: (n, s) for a, n, s in gp.live_block_info(pid)}
    # A block live both times but of another size was freed and its address reused: it goes and
    # comes back at the checkpoint's size.
    freed = sorted(a for a in now if a not in want or want[a][0] != now[a][0])
    allocd = sorted(a for a in want if a not in now or want[a][0] != now[a][0])
    gone = set(freed)
    # Checked before anything changes (PyTorch's restore checks the same): a block freed here whose
    # storage lives on with the allocator's deleter must be named stale, or that storage's death
    # frees the block a second time -- by then perhaps another tensor's.
    definitely_freed = sum(1 for a in freed if a not in want)
    if len(stale) < definitely_freed:
        raise IntegrationError(
            f"restoring graph pool {pid}: {definitely_freed} block(s) allocated since the checkpoint would be freed, "
            f"but only {len(stale)} stale storage(s) were named; any stale tensors being freed must be passed"
        )
    if any(shim.poolkeeper_shim_storage_data(impl) not in gone for impl in stale):
        raise IntegrationError("a stale storage of the checkpoint restore is not one whose block it frees")
    with torch.cuda.device(dev):
        # Any storage the allocator made has the allocator's deleter: the one to give and to take.
        like = torch.empty(1, dtype=torch.uint8, device=f"cuda:{dev}").untyped_storage()
        like_impl = like._cdata
        disowned: list = []
        for impl in stale:
            if shim.poolkeeper_shim_disown(impl, like_impl):
                # The storages disowned so far no longer free their blocks: this does, and goes no further.
                for a in dict.fromkeys(shim.poolkeeper_shim_storage_data(i) for i in disowned):
                    torch._C._cuda_cudaCachingAllocator_raw_delete(a)
                raise IntegrationError(
                    f"restoring graph pool {pid}: a stale storage has a deleter other than the allocator's"
                )
            disowned.append(impl)
        for a in freed:  # through PyTorch: its record of the block goes too
            torch._C._cuda_cudaCachingAllocator_raw_delete(a)
        handed: list = []
        try:
            for a in allocd:
                n, s = want[a]
                gp.reclaim_next(pid, a, n)
                try:
                    got = torch._C._cuda_cudaCachingAllocator_raw_alloc(n, s)
                except RuntimeError as e:
                    raise IntegrationError(
                        f"restoring graph pool {pid}: the block at {a:#x} ({n} bytes) could not be handed out again: {e}"
                    ) from None
                finally:
                    gp.reclaim_cancel()
                if got != a:  # cannot happen while reclaim_next holds; never hand a graph the wrong memory
                    torch._C._cuda_cudaCachingAllocator_raw_delete(got)
                    raise IntegrationError(f"restoring graph pool {pid}: {a:#x} was asked for, {got:#x} came")
                handed.append(a)
        except BaseException:
            # No storage owns the blocks handed out again yet: left live, they stayed in the graph's
            # pool for good (it could never close). Back to free, as they were before this call.
            for a in handed:
                torch._C._cuda_cudaCachingAllocator_raw_delete(a)
            raise
        # Every block of the checkpoint is live now, as after PyTorch's own restore (which frees and
        # hands out again all of them, the ones live both times too): a storage the trees made over
        # any of them without a deleter takes the allocator's. One handed out again here has no
        # owner yet, so a storage over it that already has a deleter is an error; over a block live
        # both times such a storage already owns it, and keeps it.
        back = set(want)
        handed_back = set(allocd)
        for impl in adopters:
            p = shim.poolkeeper_shim_storage_data(impl)
            if p in back:
                back.discard(p)  # aliased outputs share one storage's block: one owner
                if shim.poolkeeper_shim_adopt(impl, like_impl) and p in handed_back:
                    raise IntegrationError(f"restoring graph pool {pid}: the storage over {p:#x} already has a deleter")
        del like


def _storage_pointers(impls: Any) -> list:
    """StorageImpl pointers as ints, each once (aliased tensors name one storage several times:
    PyTorch's own restore takes each once too). TypeError/ValueError for anything else."""
    import operator

    return list(dict.fromkeys(operator.index(i) for i in impls))


def _provide_pool_live_check(torch: Any) -> None:
    # PyTorch gives pluggable allocators no hook for checkPoolLiveAllocations and raises "pluggable
    # does not yet support checkPoolLiveAllocations", which stops torch.compile's CUDA-graph trees
    # (mode="reduce-overhead") at their first check. The check is a plain function of torch._C,
    # looked up at each call, so the installed allocator answers it from its own graph pools.
    # The same for the checkpoint pair the trees use between recordings.
    c = getattr(torch, "_C", None)
    if c is None:
        return
    for name, fn in (
        ("_cuda_checkPoolLiveAllocations", check_pool_live_allocations),
        ("_cuda_getCheckpointState", get_checkpoint_state),
        ("_cuda_setCheckpointPoolState", set_checkpoint_pool_state),
    ):
        if hasattr(c, name):
            setattr(c, name, fn)


def _oom_allocator(torch: Any):
    """(library, malloc symbol, free symbol, oom type, note) for the pluggable allocator: the shim
    that raises torch.OutOfMemoryError when it builds, else the core's raising symbol."""
    import warnings

    from poolkeeper.integrations import _torch_oom_shim as shim

    b = shim.load(torch, library_path())
    if b.path is not None:
        return b.path, shim.MALLOC, shim.FREE, "torch.OutOfMemoryError", f"shim {b.reason}: {b.path}"
    note = f"no torch.OutOfMemoryError shim ({b.reason}); out of memory raises RuntimeError"
    if b.reason.startswith("disabled"):  # the user chose it: no warning
        return library_path(), MALLOC_SYMBOL, FREE_SYMBOL, "RuntimeError", note
    warnings.warn(
        "poolkeeper: out of memory inside PyTorch will raise RuntimeError, not torch.OutOfMemoryError: "
        f"{b.reason}. `except torch.OutOfMemoryError` blocks will not fire.",
        RuntimeWarning,
        stacklevel=3,
    )
    return library_path(), MALLOC_SYMBOL, FREE_SYMBOL, "RuntimeError", note


def _wire_hooks(allocator: Any) -> Dict[str, bool]:
    native = allocator.allocator()
    wired: Dict[str, bool] = {}
    for hook, (setter, symbol) in HOOKS.items():
        fn = getattr(native, setter, None)
        if fn is None:
            wired[hook] = False
            continue
        fn(_symbol_address(symbol))
        wired[hook] = True
    return wired


# -- reading our pools while installed ------------------------------------------------------------


def pools() -> Dict[int, Any]:
    """Every device pool behind the C ABI: ``{device: pool}`` (those made so far)."""
    out = {}
    for d in _core.registry_devices():
        if d >= 0:
            p = _core.registry_get(d)
            if p is not None:
                out[d] = p
    return out


def _pool_for(device: Optional[int]):
    ps = pools()
    if device is None:
        if not ps:
            raise IntegrationError("no poolkeeper device pool yet: nothing has been allocated through it")
        device = _current_device(ps)
    device = _device_index(device)
    if device not in ps:
        raise IntegrationError(f"no poolkeeper pool for device {device} yet (devices with pools: {sorted(ps)})")
    return ps[device]


def _current_device(ps: Dict[int, Any]) -> int:
    if len(ps) == 1:
        return next(iter(ps))
    try:
        import torch

        if torch.cuda.is_initialized() and torch.cuda.current_device() in ps:
            return torch.cuda.current_device()
    except Exception:
        pass
    return min(ps)


def stats(device: Optional[int] = None) -> Dict[str, Any]:
    """The pool stats of ``device`` (default: the current device): reserved, live, free,
    pending, peaks, upstream calls... (see :mod:`poolkeeper.pools`)."""
    return _pool_for(device).stats()


def snapshot(device: Optional[int] = None):
    """A :class:`poolkeeper.accounting.Snapshot` of ``device``'s pool (default: current)."""
    from poolkeeper.accounting import Snapshot

    return Snapshot.from_dict(_pool_for(device)._snapshot_dict())


# -- PyTorch's memory API names, read from our pools (see integrations.torch_memory) -------------


def memory_stats(device: Optional[int] = None) -> Dict[str, int]:
    """``torch.cuda.memory_stats()``'s keys for ``device``'s pool (default: the current device),
    where they map (table in :mod:`poolkeeper.integrations.torch_memory`). PyTorch's own
    ``torch.cuda.memory_stats`` raises under a pluggable allocator; call this one instead."""
    from poolkeeper.integrations.torch_memory import memory_stats_from

    return memory_stats_from(_pool_for(device).stats())


def memory_allocated(device: Optional[int] = None) -> int:
    """Live bytes (``allocated_bytes.all.current``)."""
    return memory_stats(device)["allocated_bytes.all.current"]


def memory_reserved(device: Optional[int] = None) -> int:
    """Bytes held from the driver (``reserved_bytes.all.current``)."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_allocated(device: Optional[int] = None) -> int:
    """Peak live bytes since the pool was made or :func:`reset_peak_memory_stats`."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def max_memory_reserved(device: Optional[int] = None) -> int:
    """Peak reserved bytes since the pool was made or :func:`reset_peak_memory_stats`."""
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Optional[int] = None) -> None:
    """Restart the peaks of ``device``'s pool (default: the current device) from the current
    live and reserved bytes."""
    _pool_for(device).reset_peaks()


def memory_summary(device: Optional[int] = None, abbreviated: bool = False) -> str:
    """Readable text like ``torch.cuda.memory_summary()``: ``device``'s pool, or every device pool
    when ``device`` is None. ``abbreviated`` is accepted for PyTorch's signature and ignored."""
    from poolkeeper.integrations.torch_memory import summary_text

    ps = pools() if device is None else {device: _pool_for(device)}
    return summary_text({d: p.stats() for d, p in ps.items()}, {d: repr(p) for d, p in ps.items()})


def dump_snapshot(path: str = "dump_snapshot.pickle", device: Optional[int] = None) -> str:
    """Write every device pool (or ``device``'s) as PyTorch's memory-snapshot pickle, the format
    of ``torch.cuda.memory._dump_snapshot``: ``torch.cuda._memory_viz``, pytorch.org/memory_viz
    and ``poolkeeper replay`` read it. Returns the path."""
    from poolkeeper.accounting import Snapshot
    from poolkeeper.integrations.torch_memory import write_torch_snapshot

    ps = pools() if device is None else {device: _pool_for(device)}
    return write_torch_snapshot({d: Snapshot.from_dict(p._snapshot_dict()) for d, p in ps.items()}, path)


def empty_cache() -> int:
    """Wait for pending releases and return every wholly free backing of every device pool to the
    driver (what ``torch.cuda.empty_cache()`` does through the hook). Returns bytes released."""
    total = 0
    for p in pools().values():
        p.synchronize()
        total += p.trim()
    return total


def graph_pools(device: Optional[int] = None) -> List[Dict[str, Any]]:
    """The CUDA-graph private pools of ``device`` (default: the current device): one entry per
    graph or shared pool handle, with its id, uses, open capture scopes, whether it was released,
    its live blocks and its pool stats. Memory in them is live in the device pool's own stats."""
    if device is None:
        ps = pools()
        if not ps:  # nothing allocated through the C ABI yet (min() of no devices was a ValueError)
            return []
        device = _current_device(ps)
    gp = _core.graph_pools_find(_device_index(device))
    return [] if gp is None else gp.info()


def hook_counters() -> Dict[str, int]:
    """How often PyTorch reached the hooks: ``record_stream`` calls served, ``record_stream``
    calls on pointers no pool owned, ``empty_cache`` calls."""
    out = (ctypes.c_uint64 * 3)()
    getattr(_capi(), HOOK_COUNTERS_SYMBOL)(out)
    return {"record_stream": out[0], "record_stream_unowned": out[1], "empty_cache": out[2]}


def call_timing(enable: Optional[bool] = None) -> Dict[str, Any]:
    """Wall time spent inside poolkeeper's allocate and free calls (the C ABI's ``poolkeeper_malloc``
    / ``poolkeeper_free``, which every PyTorch hook goes through, as does any other C caller in the
    process), so that the allocator's share of a workload can be read beside its step time.
    ``enable=True`` starts counting, ``False`` stops it (off by default: two clock reads cost more
    than a thread-cache hit); ``None`` leaves it as it is. Returns the counts so far, never reset:
    ``malloc_calls``, ``malloc_ns``, ``free_calls``, ``free_ns``, and ``enabled``. Take the
    difference of two readings around the work. Time PyTorch spends around the call (its pluggable
    allocator's own bookkeeping) is not in it. Raises
    :class:`~poolkeeper.errors.InvalidArgumentError` for anything but None or a bool (a string such
    as ``"no"`` would otherwise read as True)."""
    if enable is not None and not isinstance(enable, bool):
        from poolkeeper.errors import InvalidArgumentError

        raise InvalidArgumentError(f"call_timing(enable): None, True or False, not {enable!r}")
    lib = _capi()
    was = lib.poolkeeper_set_call_timing(-1 if enable is None else int(enable))
    out = (ctypes.c_uint64 * 4)()
    lib.poolkeeper_call_timing(out)
    return {"malloc_calls": out[0], "malloc_ns": out[1], "free_calls": out[2], "free_ns": out[3],
            "enabled": bool(was) if enable is None else enable}


# -- scoped use through torch.cuda.MemPool --------------------------------------------------------


def mempool(pool: str = "arena", *, upstream: Optional[str] = None, use_on_oom: bool = False, **options: Any):
    """A ``torch.cuda.MemPool`` whose segments come from poolkeeper (PyTorch's own allocator
    stays in charge of everything else, and of splitting those segments).

    Use it with ``torch.cuda.use_mem_pool(mp)`` or :func:`use_mempool`. The first call sets the
    per-device pool kind and options for every mempool of the process; a later call asking for
    another kind raises :class:`IntegrationError`.
    """
    global _MEMPOOL_ALLOCATOR
    torch = _torch()
    _require_cuda_torch(torch, "poolkeeper.integrations.torch.mempool()", mempool=True)
    from poolkeeper.pools import resolve_cuda_upstream, set_device_factory

    upstream = resolve_cuda_upstream(pool, upstream)
    with _LOCK:
        if _INSTALLED is not None:
            raise IntegrationError(
                "install() made poolkeeper PyTorch's allocator; torch.cuda.MemPool routing needs PyTorch's "
                "native allocator, and every CUDA allocation already comes from poolkeeper"
            )
        if _MEMPOOL_ALLOCATOR is None:
            set_device_factory(pool, options, upstream)
            _MEMPOOL_ALLOCATOR = (
                torch.cuda.memory.CUDAPluggableAllocator(library_path(), MEMPOOL_MALLOC_SYMBOL, FREE_SYMBOL),
                (pool, dict(options), upstream),
            )
        elif _MEMPOOL_ALLOCATOR[1] != (pool, dict(options), upstream):
            raise IntegrationError(
                f"mempool() pools are already {_MEMPOOL_ALLOCATOR[1][0]} over {_MEMPOOL_ALLOCATOR[1][2]} with "
                f"options {_MEMPOOL_ALLOCATOR[1][1]} in this process"
            )
        allocator = _MEMPOOL_ALLOCATOR[0]
    return torch.cuda.MemPool(allocator.allocator(), use_on_oom=use_on_oom)


@contextlib.contextmanager
def use_mempool(mem_pool: Any = None, device: Any = None, **kwargs: Any) -> Iterator[Any]:
    """Route the CUDA allocations of this thread inside the block to ``mem_pool`` (default: a new
    :func:`mempool` made with ``kwargs``). Yields the ``torch.cuda.MemPool``."""
    torch = _torch()
    if mem_pool is None or not hasattr(torch.cuda, "use_mem_pool"):
        _require_cuda_torch(torch, "poolkeeper.integrations.torch.use_mempool()", mempool=True)
    if not hasattr(torch.cuda, "use_mem_pool"):
        raise PluggableAllocatorUnavailableError(
            f"use_mempool() needs torch.cuda.use_mem_pool (PyTorch 2.5 or newer); torch "
            f"{getattr(torch, '__version__', '?')} has none. Upgrade PyTorch, or use install()."
        )
    mp = mem_pool if mem_pool is not None else mempool(**kwargs)
    with torch.cuda.use_mem_pool(mp, device=device):
        yield mp


def _forget_for_tests() -> None:
    """Drop this module's record of what it installed and the core registry (tests only: the
    framework side cannot be undone)."""
    global _INSTALLED, _MEMPOOL_ALLOCATOR
    with _LOCK:
        _INSTALLED = None
        _MEMPOOL_ALLOCATOR = None
        _core.registry_clear()


__all__ = [
    "install",
    "installation",
    "Installation",
    "library_path",
    "pools",
    "stats",
    "snapshot",
    "empty_cache",
    "memory_stats",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "memory_summary",
    "dump_snapshot",
    "hook_counters",
    "call_timing",
    "graph_pools",
    "mempool",
    "use_mempool",
    "HOOKS",
]
