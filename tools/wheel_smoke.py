"""Smoke test of an installed poolkeeper wheel (run by tools/build_wheels.sh and cibuildwheel).

Runs from any directory, with the installed package only: no source tree, no compiler. Exits
non-zero with a message on the first failure.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile


def check_no_libcuda(module_path: str) -> None:
    # CUDA is reached through dlopen("libcuda.so.1") at run time; a NEEDED entry would make the
    # wheel unimportable on machines without a driver.
    readelf = shutil.which("readelf")
    if readelf is None:
        print("readelf not found: skipping the NEEDED check")
        return
    out = subprocess.run([readelf, "-d", module_path], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    print("NEEDED:", ", ".join(needed) or "(none)")
    bad = [n for n in needed if "cuda" in n.lower()]
    if bad:
        sys.exit(f"the extension links {bad} at load time; CUDA must only be dlopen'ed")


def main() -> None:
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # never import a source checkout by accident
        try:
            import poolkeeper as pk
            from poolkeeper import _core

            if "site-packages" not in pk.__file__:
                sys.exit(f"imported poolkeeper from {pk.__file__}, not from an installed wheel")
            print(f"poolkeeper {pk.__version__} from {os.path.dirname(pk.__file__)}")
            check_no_libcuda(_core.__file__)

            sim = pk.upstream.Simulated(latency_us=0)
            for pool in (pk.ArenaPool(sim), pk.SizeClassPool(sim), pk.Direct(sim)):
                with pool:
                    p = pool.allocate(3 << 20)
                    pool.deallocate(p)
                    s = sim.stream()
                    q = pool.allocate(1 << 20, stream=s)
                    pool.deallocate(q, stream=s)
                    pool.validate()
                    st = pool.stats()
                    parts = st["live_bytes"] + st["free_bytes"] + st["pending_bytes"] + st["overhead_bytes"]
                    assert st["reserved_bytes"] == parts, st
            host = pk.ArenaPool(pk.upstream.Host())
            with host.buffer(64) as buf:
                mv = memoryview(buf)  # the buffer protocol, natively, on every Python
                mv[:3] = b"abc"
                assert bytes(mv[:3]) == b"abc"
                mv.release()
            host.validate()
            host.close()
            print(f"cuda available: {pk.cuda.is_available()}")

            # The console script, on a tiny part of the benchmark matrix.
            exe = shutil.which("poolkeeper")
            if exe is None:
                sys.exit("the poolkeeper console script is not on PATH")
            r = subprocess.run(
                [exe, "bench", "--quick", "--backend", "simulated", "--workloads", "hit_pair,trim",
                 "--arms", "direct,arena", "--no-progress"],
                capture_output=True, text=True, timeout=300,
            )
            print(r.stdout[-2000:])
            if r.returncode != 0:
                sys.exit(f"poolkeeper bench failed ({r.returncode}):\n{r.stderr[-2000:]}")
        finally:
            os.chdir(here)
    print("wheel smoke test: OK")


if __name__ == "__main__":
    main()
