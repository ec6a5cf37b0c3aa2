"""Arms: the allocation strategies a benchmark compares, each built over a fresh upstream.

- ``direct``: the upstream itself behind the pool API (one upstream call per allocate and per
  deallocate) -- the cost a pool exists to remove.
- ``size_class``: :class:`poolkeeper.SizeClassPool`.
- ``arena``: :class:`poolkeeper.ArenaPool`.
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
        upstream = upstream_factory()
        return pk.make_pool(self.name, upstream, **self.options), upstream

    def config(self) -> Dict[str, Any]:
        """The pool's effective options: documented defaults overlaid with this arm's options."""
        import poolkeeper as pk

        cls = pk.Direct if self.name == "cuda_async" else pk.pools.POOL_KINDS[self.name]
        out: Dict[str, Any] = {}
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


ARM_NAMES = ("direct", "size_class", "arena", "cuda_async")

_DESCRIPTIONS = {
    "direct": "the upstream itself: one upstream call per allocate and per deallocate",
    "size_class": "SizeClassPool: size classes with per-class free lists",
    "arena": "ArenaPool: large backings sliced with split/coalesce, per-thread cache",
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
        if n == "arena" and not arena_available():
            if explicit:
                raise UnknownNameError("arm 'arena' is not built in this poolkeeper yet")
            skipped.append("arena: ArenaPool not built in this poolkeeper yet")
            continue
        arms.append(arm)
    return arms, skipped


__all__ = ["Arm", "ARM_NAMES", "make_arm", "select_arms", "arena_available", "STREAM_ORDERED_MARK", "STREAM_ORDERED_NOTE"]
