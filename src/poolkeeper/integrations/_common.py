"""What the framework integrations share: their errors and the optional import."""
from __future__ import annotations

import importlib
from types import ModuleType

from poolkeeper.errors import CudaUnavailableError, PoolkeeperError


class IntegrationError(PoolkeeperError, RuntimeError):
    """A framework integration cannot do what was asked (see the message for what to do)."""


class MissingDependencyError(IntegrationError, ImportError):
    """The framework an integration needs is not installed."""


class AllocatorInitializedError(IntegrationError):
    """The framework's allocator is already in use and can no longer be replaced."""


class FrameworkCudaUnavailableError(IntegrationError, CudaUnavailableError):
    """The framework is installed but cannot use CUDA here (a CPU-only build, or no device or
    driver visible), so there is no device allocator to replace."""


class PluggableAllocatorUnavailableError(IntegrationError):
    """The installed framework has no interface for an external allocator (too old, or built
    without it)."""


# What to pip-install for each optional part: the framework itself, by its PyPI name (an extra
# such as poolkeeper[torch] only works where poolkeeper itself comes from an index).
_PIP_NAMES = {"torch": "torch", "cupy": "cupy-cuda12x", "plot": "matplotlib"}


def import_optional(name: str, feature: str, extra: str) -> ModuleType:
    """Import ``name`` for ``feature``, or raise :class:`MissingDependencyError` saying how to
    install it. Only the integrations call this, and only when asked to: importing poolkeeper
    never imports a framework."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingDependencyError(
            f"{feature} needs {name!r}, which cannot be imported here ({e}). "
            f"Install it, e.g. `pip install {_PIP_NAMES.get(extra, extra)}`.",
            module=name,
        ) from e


__all__ = [
    "IntegrationError",
    "MissingDependencyError",
    "AllocatorInitializedError",
    "FrameworkCudaUnavailableError",
    "PluggableAllocatorUnavailableError",
    "import_optional",
]
