"""The warm default pool (CUDA's stream-ordered pool kept from releasing at every synchronize), seen from Python.

CUDA's default stream-ordered pool (one per device, shared by every ``cudaMallocAsync`` user in
the process) hands memory back to the driver at every synchronize while its release threshold is
0, the default; then nearly every allocation maps memory again (135 us at 1 MiB, 3.3 ms at 1 GiB on
an H200, against 3.5 us with the threshold at its maximum). poolkeeper's manager:

- raises the threshold to the maximum when the first :class:`~poolkeeper.cuda.upstreams.CudaAsync`
  handle on a device appears -- only ever raising it, and remembering the previous value;
- when the last handle of the process goes, for every device it raised (from its own record, not
  the calling thread's current device): synchronizes the device, restores the previous value
  (unless someone else changed it meanwhile), then trims the pool to that value;
- on a failure to configure, logs it (stderr and :func:`state`) and carries on cold: it costs speed
  only, and no error is left behind for a later call;
- without pool support (old driver, device without memory pools) does nothing and says so.

:func:`state` shows the manager; the read-outs below query the driver's default pool directly.
:class:`WarmPoolManager` over a :class:`SimulatedPoolControl` runs the same policy without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from poolkeeper import _core

MAX_THRESHOLD = 2**64 - 1

WarmPoolManager = _core.WarmPoolManager
SimulatedPoolControl = _core.SimulatedPoolControl


@dataclass
class WarmPoolState:
    """The manager's state. ``devices``: one dict per device ever acquired (``device``,
    ``handles``, ``raised``, ``previous`` -- the value to restore --, ``unsupported`` -- why it is a
    no-op there, or None)."""

    devices: List[Dict[str, Any]] = field(default_factory=list)
    raised_devices: List[int] = field(default_factory=list)
    total_handles: int = 0
    raises: int = 0
    restores: int = 0
    trims: int = 0
    left_alone: int = 0
    configure_failures: int = 0
    release_failures: int = 0
    last_error: Optional[str] = None
    messages: List[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "WarmPoolState":
        return cls(**d)

    def handles(self, device: int) -> int:
        for d in self.devices:
            if d["device"] == device:
                return int(d["handles"])
        return 0


def state() -> WarmPoolState:
    """The process-wide manager's state (works without a driver: then it is empty)."""
    return WarmPoolState.from_dict(_core.cuda_warm_state())


def mempool_attribute(device: int, name: str) -> int:
    """A default-pool attribute: ``release_threshold``, ``reserved_mem_current``,
    ``reserved_mem_high``, ``used_mem_current`` or ``used_mem_high``."""
    return int(_core.cuda_mempool_attribute(device, name))


def release_threshold(device: int = 0) -> int:
    """The default pool's current release threshold (``MAX_THRESHOLD`` when warm)."""
    return mempool_attribute(device, "release_threshold")


def reserved_bytes(device: int = 0) -> int:
    """Backing memory the default pool holds now (``CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT``)."""
    return mempool_attribute(device, "reserved_mem_current")


def used_bytes(device: int = 0) -> int:
    """Memory of the default pool in use by live allocations (``USED_MEM_CURRENT``)."""
    return mempool_attribute(device, "used_mem_current")


def set_release_threshold(device: int, value: int) -> None:
    """Set the default pool's release threshold directly, as any other user of the pool may.
    The manager never lowers a value it finds; use this to choose one yourself."""
    _core.cuda_mempool_set_release_threshold(device, value)


def reset_high_watermarks(device: int = 0) -> None:
    """Restart the default pool's ``reserved_mem_high`` and ``used_mem_high`` from their current
    values, so a later read gives the high-water mark of the interval since (the benchmark reads
    the cuda_async arm's real footprint this way)."""
    _core.cuda_mempool_reset_high(device, "reserved_mem_high")
    _core.cuda_mempool_reset_high(device, "used_mem_high")


def trim_to(device: int, keep_bytes: int = 0) -> None:
    """``cuMemPoolTrimTo`` on the default pool: release memory down to ``keep_bytes`` where the
    driver can (never memory backing live allocations)."""
    _core.cuda_mempool_trim_to(device, keep_bytes)


__all__ = [
    "MAX_THRESHOLD",
    "WarmPoolState",
    "WarmPoolManager",
    "SimulatedPoolControl",
    "state",
    "mempool_attribute",
    "release_threshold",
    "reserved_bytes",
    "used_bytes",
    "set_release_threshold",
    "reset_high_watermarks",
    "trim_to",
]
