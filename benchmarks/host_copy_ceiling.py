# Host ceiling on this machine: T threads memmove pageable->pinned alone / under a concurrent H2D DMA,
# and a raw ring (T workers, 8 MiB chunks, 2 buffers each, raw driver calls, no pool) for 2 GiB.
import ctypes, time, threading, os
import concurrent.futures as cf
import numpy as np
import poolkeeper as pk
from poolkeeper.cuda import driver
N = 2 << 30; M = 256 << 20; C = 8 << 20
src = np.random.default_rng(0).integers(0, 255, N, dtype=np.uint8)
pinned = pk.upstream.CudaPinned(); hp = pinned.allocate(M); hp2 = pinned.allocate(M)
dev = pk.upstream.CudaDevice().allocate(N); stream = driver.Stream()
def par(dst, s, n, T, ex):
    step = -(-n // T); step = (step + 4095)//4096*4096
    for f in [ex.submit(ctypes.memmove, dst+o, s+o, min(step, n-o)) for o in range(0, n, step)]: f.result()
def best(fn, n, reps=5):
    fn(); return max(n/(lambda t: (fn(), time.perf_counter()-t)[1])(time.perf_counter())/1e9 for _ in range(reps))
stop = threading.Event()
def dma():
    s = driver.Stream()
    while not stop.is_set(): driver.memcpy_htod_async(dev, hp2, M, s.handle); s.synchronize()
def ring(T):
    bufs = [[pinned.allocate(C) for _ in range(2)] for _ in range(T)]
    def w(k):
        evs = [None, None]; j = 0
        for i in range(k, N // C, T):
            b = j % 2
            if evs[b] is not None: evs[b].synchronize()
            ctypes.memmove(bufs[k][b], src.ctypes.data + i*C, C)
            driver.memcpy_htod_async(dev + i*C, bufs[k][b], C, stream.handle); evs[b] = driver.Event.record(stream.handle); j += 1
        for e in evs:
            if e is not None: e.synchronize()
    r = 0
    for _ in range(3):
        ths = [threading.Thread(target=w, args=(k,)) for k in range(T)]; t = time.perf_counter()
        for th in ths: th.start()
        for th in ths: th.join()
        r = max(r, N/(time.perf_counter()-t)/1e9)
    for bl in bufs:
        for b in bl: pinned.deallocate(b, C)
    return r
print("cpus", os.cpu_count())
for T in (8, 12, 16):
    ex = cf.ThreadPoolExecutor(T)
    a = best(lambda: par(hp, src.ctypes.data, M, T, ex), M)
    stop.clear(); th = threading.Thread(target=dma); th.start(); time.sleep(0.05)
    b = best(lambda: par(hp, src.ctypes.data, M, T, ex), M)
    stop.set(); th.join(); ex.shutdown()
    print(f"T={T:2d}: memmove->pinned {a:5.1f} GB/s alone, {b:5.1f} under DMA; raw ring 2 GiB {ring(T):5.1f} GB/s", flush=True)
