"""Arms: the allocation strategies a benchmark compares, each built over a fresh upstream.

- ``direct``: the upstream itself behind the pool API (one upstream call per allocate and per
  deallocate) -- the cost a pool exists to remove.
- ``size_class``: :class:`poolkeeper.SizeClassPool`.
- ``arena``: :class:`poolkeeper.ArenaPool`.
- ``arena_expandable``: :class:`poolkeeper.ArenaPool` with ``expandable=True``: one reserved
  virtual range, physical memory mapped onto its end as it grows (docs/expandable.md). Needs an
  upstream with virtual memory: the simulated device has it; on ``cuda`` the arm draws from
  ``CudaVirtual`` (skipped with a reason where that upstream is not built); ``host`` has none.
- ``cuda_async``: CUDA's own stream-ordered pool (``cuMemAllocAsync`` on the device's default
  pool, warm) behind ``Direct``; GPU only. **Stream-ordered**: its release does not wait for
  pending device work, a weaker guarantee than the other three arms, so its ratios are not a
  drop-in speedup. Every table, JSON row and plot marks it.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from poolkeeper.bench.errors import UnknownNameError

STREAM_ORDERED_MARK = "†"
STREAM_ORDERED_NOTE = (
    f"{STREAM_ORDERED_MARK} stream-ordered (cuda_async): release does not wait for pending device work -- "
    "a weaker guarantee than the other arms, so its ratios are not a drop-in speedup"
)


@dataclass(frozen=True)
class Arm:
    """One strategy. ``build(upstream_factory)`` returns ``(pool, upstream)``."""

    name: str
    description: str
    stream_ordered: bool = False
    needs_gpu: bool = False
    options: Dict[str, Any] = field(default_factory=dict)

    def build(self, upstream_factory: Callable[[], Any]) -> Tuple[Any, Any]:
        import poolkeeper as pk

        if self.name == "cuda_async":
            from poolkeeper import upstream as up_mod

            upstream = up_mod.CudaAsync()  # lazy: needs the CUDA helper's module and a device
            return pk.Direct(upstream, **self.options), upstream
        upstream = virtual_upstream(self.name, upstream_factory)
        return make_arm_pool(self.name, upstream, **self.options), upstream

    def config(self) -> Dict[str, Any]:
        """The pool's effective options: documented defaults overlaid with this arm's options."""
        import poolkeeper as pk

        kind, fixed = ARM_POOLS.get(self.name, (self.name, {}))
        cls = pk.Direct if self.name == "cuda_async" else pk.pools.POOL_KINDS[kind]
        out: Dict[str, Any] = dict(fixed)
        try:
            for name, p in inspect.signature(cls.__init__).parameters.items():
                if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty:
                    out[name] = p.default
        except (TypeError, ValueError):
            pass
        out.update(self.options)
        return out

    @property
    def label(self) -> str:
        """The name as tables print it: stream-ordered arms carry the mark."""
        return self.name + (STREAM_ORDERED_MARK if self.stream_ordered else "")


def _pool_kinds() -> Dict[str, Any]:
    from poolkeeper.pools import KINDS

    return KINDS


ARM_NAMES = ("direct", "size_class", "arena", "arena_expandable", "cuda_async")

# Arms that are a pool kind with fixed options: name -> (base pool kind, options), from the one
# table of pool kinds that install(), make_pool and replay read too.
ARM_POOLS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    n: (k.base, dict(k.fixed)) for n, k in _pool_kinds().items() if k.fixed
}
# Options such an arm accepts beyond its pool kind's keyword arguments.
ARM_EXTRA_OPTIONS: Dict[str, Tuple[str, ...]] = {
    "arena_expandable": ("va_bytes", "step_fraction", "max_step", "map_piece", "reclaim_holes", "release_on_grow", "stitch",
                         "stitch_max_parts")
}


def make_arm_pool(name: str, upstream: Any, **options: Any) -> Any:
    """The pool of arm (or replay pool) ``name`` over ``upstream``."""
    import poolkeeper as pk

    kind, fixed = ARM_POOLS.get(name, (name, {}))
    return pk.make_pool(kind, upstream, **{**fixed, **options})


def virtual_upstream(name: str, upstream_factory: Callable[[], Any]) -> Any:
    """A fresh upstream for arm ``name``: ``arena_expandable`` on the cuda backend needs the
    virtual-memory CUDA upstream instead of the factory's ``CudaDevice``."""
    upstream = upstream_factory()
    kind = _pool_kinds().get(name)
    if kind is not None and kind.cuda_upstream == "virtual" and not getattr(upstream, "supports_virtual", False):
        cls = _cuda_virtual_class()
        if cls is not None and getattr(upstream, "name", "").startswith("Cuda"):
            return cls()
    return upstream


def _cuda_virtual_class() -> Any:
    from poolkeeper import upstream as up_mod

    try:
        return getattr(up_mod, "CudaVirtual")
    except Exception:
        return None


def expandable_skip_reason(backend: str) -> Optional[str]:
    """Why ``arena_expandable`` cannot run on a resolved backend, or None."""
    if backend == "host":
        return "arena_expandable: the host upstream has no virtual memory interface"
    if backend == "cuda" and _cuda_virtual_class() is None:
        return "arena_expandable: CudaVirtual (virtual-memory CUDA upstream) not built in this poolkeeper"
    return None

_DESCRIPTIONS = {
    "direct": "the upstream itself: one upstream call per allocate and per deallocate",
    "size_class": "SizeClassPool: size classes with per-class free lists",
    "arena": "ArenaPool: large backings sliced with split/coalesce, per-thread cache",
    "arena_expandable": "ArenaPool(expandable=True): one virtual range, physical pieces mapped at its end",
    "cuda_async": "cuMemAllocAsync on the device's default pool (warm), stream-ordered",
}


def make_arm(name: str, options: Optional[Dict[str, Any]] = None) -> Arm:
    if name not in ARM_NAMES:
        raise UnknownNameError(f"unknown arm {name!r} (valid: {', '.join(ARM_NAMES)})")
    return Arm(
        name=name,
        description=_DESCRIPTIONS[name],
        stream_ordered=(name == "cuda_async"),
        needs_gpu=(name == "cuda_async"),
        options=dict(options or {}),
    )


def arena_available() -> bool:
    """False while ArenaPool is still a stub on this build (its constructor raises)."""
    import poolkeeper as pk

    try:
        pk.ArenaPool(pk.upstream.Simulated(latency_us=0)).close()
        return True
    except Exception:
        return False


def select_arms(
    names: Optional[Sequence[str]],
    backend: str,
    options: Optional[Dict[str, Dict[str, Any]]] = None,
) -> Tuple[List[Arm], List[str]]:
    """The arms to run on a resolved backend, and a note for each requested arm left out.

    ``names=None`` means every arm that can run here: ``cuda_async`` only on ``cuda``, ``arena``
    only once it is built. An explicitly requested arm that cannot run is an error.
    """
    options = options or {}
    explicit = names is not None
    wanted = list(names) if explicit else list(ARM_NAMES)
    arms: List[Arm] = []
    skipped: List[str] = []
    for n in wanted:
        arm = make_arm(n, options.get(n))
        if arm.needs_gpu and backend != "cuda":
            if explicit:
                raise UnknownNameError(f"arm {n!r} needs the cuda backend (this run: {backend})")
            skipped.append(f"{n}: needs a GPU (backend {backend})")
            continue
        if n == "arena_expandable" and (reason := expandable_skip_reason(backend)):
            if explicit:
                raise UnknownNameError(reason)
            skipped.append(reason)
            continue
        if n in ("arena", "arena_expandable") and not arena_available():
            if explicit:
                raise UnknownNameError("arm 'arena' is not built in this poolkeeper yet")
            skipped.append("arena: ArenaPool not built in this poolkeeper yet")
            continue
        arms.append(arm)
    return arms, skipped


__all__ = ["Arm", "ARM_NAMES", "ARM_POOLS", "make_arm_pool", "virtual_upstream", "expandable_skip_reason", "make_arm", "select_arms", "arena_available", "STREAM_ORDERED_MARK", "STREAM_ORDERED_NOTE"]
