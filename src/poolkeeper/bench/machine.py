"""Where a benchmark ran: every row carries this, because a figure means nothing without it."""
from __future__ import annotations

import os
import platform
import sys
from functools import lru_cache
from typing import Any, Dict, Optional


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def gpu_name(device: int = 0) -> Optional[str]:
    """The CUDA device's name, or None without a GPU (never raises, never needs CUDA to import)."""
    try:
        from poolkeeper import _core

        if not _core.cuda_is_available():
            return None
        from poolkeeper import cuda

        return str(cuda.device_info(device).name)
    except Exception:
        return None


@lru_cache(maxsize=1)
def machine_info() -> Dict[str, Any]:
    """CPU model, usable cores, Python, platform, poolkeeper version and GPU name (or None)."""
    from poolkeeper import __version__

    return {
        "cpu": _cpu_model(),
        "cores": _usable_cores(),
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "platform": platform.platform(),
        "poolkeeper": __version__,
        "gpu": gpu_name(),
    }


__all__ = ["machine_info", "gpu_name"]
