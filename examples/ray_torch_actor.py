"""A Ray actor serving a PyTorch model, every CUDA tensor from the worker's poolkeeper pool.

    python examples/ray_torch_actor.py

`poolkeeper.integrations.ray.runtime_env(...)` gives each Ray worker process a setup hook and the
pool's settings (checked here, in the driver). The actor's first call to `worker_pool()`, before
it touches CUDA, builds the pool on the GPU Ray assigned it and makes poolkeeper PyTorch's
allocator in that process.
"""
from __future__ import annotations

import sys


def main() -> int:
    import ray

    from poolkeeper.integrations import ray as pkr

    ray.init(runtime_env=pkr.runtime_env("arena", upstream="device", torch=True, limit=60 << 30))

    @ray.remote(num_gpus=1)
    class Server:
        def __init__(self, hidden: int = 4096) -> None:
            pkr.worker_pool()  # first: PyTorch's allocator can only be chosen before CUDA starts
            import torch

            self.torch = torch
            self.model = torch.nn.Sequential(
                torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden)
            ).cuda().half().eval()
            self.hidden = hidden

        def infer(self, batch: int) -> float:
            torch = self.torch
            with torch.inference_mode():
                x = torch.randn(batch, self.hidden, device="cuda", dtype=torch.half)
                return float(self.model(x).float().mean())

        def stats(self) -> dict:
            s = pkr.worker_stats()
            return {k: s[k] for k in ("pool", "device", "reserved_bytes", "live_bytes", "peak_live_bytes",
                                      "upstream_allocations")}

    server = Server.remote()
    outs = ray.get([server.infer.remote(b) for b in (1, 8, 64, 8, 1, 64)])
    print("outputs:", [round(o, 4) for o in outs])
    print("worker pool:", ray.get(server.stats.remote()))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
