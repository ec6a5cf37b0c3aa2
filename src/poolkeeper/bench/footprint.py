"""The real footprint of arms whose memory is held below the upstream the pool sees.

``cuda_async`` is ``Direct`` over ``cuMemAllocAsync``: the pool's own ``peak_reserved_bytes`` is its
peak of *live* bytes, while CUDA's default pool keeps freed memory (the warm pool's release
threshold is raised to the maximum) and may round or hold more. Reporting the pool's view would
credit CUDA's pool with a perfect 1.00x it does not have. So for that arm the runner trims the
default pool and restarts its high watermark before the workload, and reads
``CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`` after it: the device memory CUDA's pool really held.
"""
from __future__ import annotations

from typing import Any, Dict, Optional


class CudaPoolFootprint:
    """Brackets one workload run on CUDA's default pool of ``upstream.device``."""

    SOURCE = "CUDA default pool RESERVED_MEM_HIGH"

    def __init__(self, upstream: Any) -> None:
        from poolkeeper.cuda import warm

        self._warm = warm
        self._device = int(upstream.device)
        upstream.synchronize()  # frees of earlier rows complete, so the trim below can return them
        warm.trim_to(self._device, 0)
        warm.reset_high_watermarks(self._device)
        self.start_reserved = warm.reserved_bytes(self._device)

    def finish(self) -> Dict[str, Any]:
        w, d = self._warm, self._device
        high = max(w.mempool_attribute(d, "reserved_mem_high"), w.reserved_bytes(d))
        return {
            "peak_reserved_bytes": high,
            "start_reserved_bytes": self.start_reserved,
            "used_high_bytes": w.mempool_attribute(d, "used_mem_high"),
            "source": self.SOURCE,
        }


def probe_for(arm_name: str, upstream: Any) -> Optional[CudaPoolFootprint]:
    """A footprint probe for arms that need one (``cuda_async``), else None."""
    if arm_name == "cuda_async":
        return CudaPoolFootprint(upstream)
    return None


__all__ = ["CudaPoolFootprint", "probe_for"]
