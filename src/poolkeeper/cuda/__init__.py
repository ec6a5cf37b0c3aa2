"""CUDA support: device discovery, the CUDA upstreams, driver helpers and the warm default pool.

Everything here reaches the NVIDIA driver (``libcuda.so.1``) at run time through poolkeeper's core;
importing this package never loads it. Without a driver or a device, :func:`is_available` is
``False``, :func:`devices` is empty and constructing a CUDA upstream raises
:class:`poolkeeper.errors.CudaUnavailableError` saying why.

- :mod:`poolkeeper.cuda.upstreams`: ``CudaDevice``, ``CudaAsync``, ``CudaPinned`` (also reachable as
  ``poolkeeper.upstream.CudaDevice`` etc.).
- :mod:`poolkeeper.cuda.driver`: streams, events, copies and memset on raw device pointers.
- :mod:`poolkeeper.cuda.warm`: the warm-pool manager that keeps CUDA's default stream-ordered pool
  from returning memory at every synchronize (docs/cuda.md), and read-outs of that pool.

Set ``POOLKEEPER_LIBCUDA`` to load another driver library than ``libcuda.so.1`` (read once, at the
first CUDA call of the process).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

from poolkeeper import _core


@dataclass(frozen=True)
class DeviceInfo:
    """One CUDA device as the driver reports it."""

    index: int
    name: str
    pci_bus_id: str
    total_memory: int
    free_memory: int
    compute_capability: Tuple[int, int]
    multiprocessors: int
    memory_pools_supported: bool
    virtual_memory_supported: bool  # CudaVirtual, and so the expandable arena, can run on it


def is_available() -> bool:
    """Is a CUDA driver with at least one device present? Never raises."""
    return bool(_core.cuda_is_available())


def unavailable_reason() -> str:
    """Why CUDA is unavailable (``""`` when it is available)."""
    return _core.cuda_unavailable_reason()


def device_count() -> int:
    """Number of visible CUDA devices (0 without a driver)."""
    return int(_core.cuda_device_count())


def driver_version() -> Optional[int]:
    """The driver's CUDA version as an int (e.g. ``13000``), or ``None`` without a driver."""
    return _core.cuda_driver_version() if is_available() else None


def device_info(device: int = 0) -> DeviceInfo:
    """Information on one device. Raises CudaUnavailableError without a driver,
    InvalidArgumentError for an index out of range."""
    d = _core.cuda_device_info(device)
    d["compute_capability"] = tuple(d["compute_capability"])
    return DeviceInfo(**d)


def devices() -> List[DeviceInfo]:
    """Every visible device (``[]`` without a driver)."""
    return [device_info(i) for i in range(device_count())]


def __getattr__(name: str):
    if name in ("upstreams", "driver", "warm"):
        return importlib.import_module(f"poolkeeper.cuda.{name}")
    if name in ("CudaDevice", "CudaAsync", "CudaPinned", "CudaVirtual"):
        from poolkeeper.cuda import upstreams

        return getattr(upstreams, name)
    raise AttributeError(f"module 'poolkeeper.cuda' has no attribute {name!r}")


__all__ = [
    "DeviceInfo",
    "is_available",
    "unavailable_reason",
    "device_count",
    "driver_version",
    "device_info",
    "devices",
    "CudaDevice",
    "CudaAsync",
    "CudaPinned",
    "CudaVirtual",
]
