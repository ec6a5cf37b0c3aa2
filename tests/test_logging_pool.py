"""LoggingPool: RMM-CSV logs of a pool's calls that round-trip through `poolkeeper replay`."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import pytest

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.bench.readers import rmm_csv
from poolkeeper.bench.replay import replay_log
from poolkeeper.errors import InvalidArgumentError, InvalidPointerError, OutOfMemoryError

KiB, MiB = 1 << 10, 1 << 20


def sim():
    return pk.upstream.Simulated(latency_us=0)


def workload(pool, seed=7, n=3000):
    """A random allocate/free mix; returns (allocations, frees, peak live bytes) as the user saw them."""
    rng = random.Random(seed)
    live = {}
    cur = peak = allocs = frees = 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            p = rng.choice(list(live))
            pool.deallocate(p, rng.choice([None, 3]))
            cur -= live.pop(p)
            frees += 1
        else:
            size = rng.choice([256, 4 * KiB, 100_000, 1 * MiB, 3 * MiB, 40 * MiB])
            live[pool.allocate(size)] = size
            cur += size
            allocs += 1
            peak = max(peak, cur)
    for p, size in list(live.items()):
        pool.deallocate(p)
        frees += 1
    return allocs, frees, peak


def test_log_round_trips_through_replay_to_the_same_peak_live_and_call_counts(tmp_path):
    path = tmp_path / "run.csv"
    with pk.LoggingPool(pk.ArenaPool(sim()), path, buffer_bytes=4096) as lp:
        allocs, frees, peak = workload(lp)
        assert lp.stats()["log_events"] == allocs + frees
    doc = replay_log(str(path), ["arena", "size_class"], "host")
    for kind in ("arena", "size_class"):
        r = doc["pools"][kind]
        assert r["counts"]["allocations"] == allocs
        assert r["counts"]["frees"] == frees
        assert r["counts"]["unknown_frees"] == r["counts"]["reallocated_live"] == r["counts"]["size_mismatch_frees"] == 0
        assert r["peak_live_bytes"] == peak
        assert r["live_at_end_bytes"] == 0


def test_log_format_is_rmm_logging_resource_adaptor(tmp_path):
    path = tmp_path / "fmt.csv"
    lp = pk.LoggingPool(pk.Direct(pk.upstream.Host()), path)
    p = lp.allocate(1000, 0x7F00)
    lp.deallocate(p, 0x7F00)
    lp.close()
    lines = path.read_text().splitlines()
    assert lines[0] == "Thread,Time,Action,Pointer,Size,Stream"
    a = lines[1].split(",")
    f = lines[2].split(",")
    assert a[2] == "allocate" and f[2] == "free"
    assert int(a[0]) > 0 and len(a[1]) == len("HH:MM:SS.ffffff") and a[1][2] == ":" and a[1][8] == "."
    assert int(a[3], 16) == p == int(f[3], 16)
    assert a[4] == f[4] == "1000"  # the free carries the allocated size, as RMM's does
    assert a[5] == f[5] == "7f00"
    with open(path) as fh:
        trace = rmm_csv.read(fh, str(path))
    assert [e.size for e in trace.events] == [1000, 1000]


def test_concurrent_threads_never_log_an_address_twice_without_its_free(tmp_path):
    # The free is logged before the inner pool can hand the address out again, so replay sees
    # neither a reallocation of a live address nor a free of an unknown one, whatever the threads.
    path = tmp_path / "mt.csv"
    lp = pk.LoggingPool(pk.ArenaPool(sim()), path, buffer_bytes=4096)
    per_thread = 3000

    def run(seed):
        rng = random.Random(seed)
        held = []
        for _ in range(per_thread):
            if held and rng.random() < 0.5:
                lp.deallocate(held.pop(rng.randrange(len(held))))
            else:
                held.append(lp.allocate(rng.choice([256, 512, 4096, 65536])))
        for p in held:
            lp.deallocate(p)

    ts = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    events = lp.stats()["log_events"]
    lp.close()
    r = replay_log(str(path), ["size_class"], "host")["pools"]["size_class"]
    c = r["counts"]
    assert c["allocations"] + c["frees"] == events
    assert c["allocations"] == c["frees"]
    assert c["unknown_frees"] == c["reallocated_live"] == c["size_mismatch_frees"] == 0
    assert len({line.split(",")[0] for line in path.read_text().splitlines()[1:]}) == 4


def test_failed_allocation_is_logged_as_allocate_failure(tmp_path):
    path = tmp_path / "oom.csv"
    lp = pk.LoggingPool(pk.Direct(sim(), limit=1 * MiB), path)
    with pytest.raises(OutOfMemoryError):
        lp.allocate(2 * MiB)
    lp.close()
    rows = [line.split(",") for line in path.read_text().splitlines()[1:]]
    assert [(r[2], int(r[3], 16), r[4]) for r in rows] == [("allocate failure", 0, str(2 * MiB))]


def test_bad_input_is_typed_and_unlogged(tmp_path):
    path = tmp_path / "bad.csv"
    lp = pk.LoggingPool(pk.ArenaPool(sim()), path)
    with pytest.raises(InvalidPointerError):
        lp.deallocate(0x1234)
    with pytest.raises(InvalidArgumentError):
        lp.allocate(0)
    p = lp.allocate(4096)
    lp.deallocate(p)
    with pytest.raises(InvalidPointerError):
        lp.deallocate(p)  # double free: refused by the inner pool, logged once
    assert lp.stats()["log_events"] == 2
    lp.close()
    with pytest.raises(InvalidArgumentError):
        pk.LoggingPool(pk.ArenaPool(sim()), tmp_path / "no" / "such" / "dir.csv")
    with pytest.raises(InvalidArgumentError):
        pk.LoggingPool("not a pool", tmp_path / "x.csv")


# Hostile probing: buffer_bytes=2**62 passed the absurd-size check and the constructor's reserve
# of the whole buffer raised a bare MemoryError (std::bad_alloc), after the file was created; a
# path with a NUL byte reached fopen(), which stopped at the NUL and created or truncated "a".
@pytest.mark.parametrize("how", ["buffer_bytes", "nul_path", "nul_make_pool_log"])
def test_regression_logging_pool_constructor_bad_alloc_and_nul_path(tmp_path, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").write_text("keep me")
    inner = pk.ArenaPool(sim())
    with pytest.raises(InvalidArgumentError):
        if how == "buffer_bytes":
            pk.LoggingPool(inner, tmp_path / "l.csv", buffer_bytes=2**62)
        elif how == "nul_path":
            pk.LoggingPool(inner, "a\0b.csv")
        else:
            pk.make_pool("arena", sim(), log="a\0y")
    assert sorted(os.listdir(tmp_path)) == ["a"] and (tmp_path / "a").read_text() == "keep me"
    inner.validate()
    lp = pk.LoggingPool(inner, tmp_path / "l.csv", buffer_bytes=1 << 20)
    lp.deallocate(lp.allocate(100))
    lp.close()


# Found beside the above: a path that is not a str (5, bytes) or not UTF-8 raised a bare TypeError
# (os.fspath's, or nanobind's "incompatible function arguments").
def test_regression_logging_pool_path_of_another_type_raised_a_bare_type_error(tmp_path):
    for bad in (5, None, str(tmp_path / "x\udcff.csv")):
        with pytest.raises(InvalidArgumentError):
            pk.LoggingPool(pk.ArenaPool(sim()), bad)
    lp = pk.LoggingPool(pk.ArenaPool(sim()), os.fsencode(tmp_path / "b.csv"))  # bytes naming a UTF-8 path
    assert lp.path == str(tmp_path / "b.csv")
    lp.close()


def test_close_refuses_live_blocks_and_keeps_logging(tmp_path):
    path = tmp_path / "live.csv"
    lp = pk.LoggingPool(pk.ArenaPool(sim()), path)
    p = lp.allocate(4096)
    with pytest.raises(pk.LiveBlocksError):
        lp.close()
    lp.deallocate(p)
    lp.close()
    assert lp.closed and lp.inner.closed
    assert len(path.read_text().splitlines()) == 3


def test_make_pool_log_option(tmp_path):
    path = tmp_path / "mk.csv"
    pool = pk.make_pool("size_class", sim(), log=path, classes_per_doubling=2)
    assert isinstance(pool, pk.LoggingPool) and isinstance(pool.inner, pk.SizeClassPool)
    pool.deallocate(pool.allocate(1000))
    pool.close()
    assert len(path.read_text().splitlines()) == 3
    with pytest.raises(InvalidArgumentError):
        pk.make_pool("arena", sim(), log=path, no_such_option=1)


def test_unclosed_pool_is_flushed_at_process_exit(tmp_path):
    path = tmp_path / "exit.csv"
    code = (
        "import poolkeeper as pk\n"
        f"lp = pk.LoggingPool(pk.ArenaPool(pk.upstream.Simulated(latency_us=0)), {str(path)!r})\n"
        "ps = [lp.allocate(4096) for _ in range(100)]\n"
        "[lp.deallocate(p) for p in ps[:50]]\n"
        "import poolkeeper._core as c; c._keep = lp\n"  # never closed, never collected before exit
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env={**os.environ})
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 150


def test_c_abi_allocations_are_logged_when_the_registry_holds_the_logging_pool(tmp_path):
    path = tmp_path / "capi.csv"
    lp = pk.LoggingPool(pk.ArenaPool(sim()), path)
    _core.registry_set(5, lp)
    try:
        _core.capi_bench_pair(5, 4096, 200)
    finally:
        _core.registry_set(5, None)
    lp.close()
    rows = path.read_text().splitlines()[1:]
    assert len(rows) == 2 * 201  # one warm-up pair, then 200
    assert {r.split(",")[2] for r in rows} == {"allocate", "free"}


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired as e:  # a hang is the failure, not a CI stall
        pytest.fail(f"hung:\n{e.stdout}\n{e.stderr}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_regression_logging_pool_inherited_through_fork_was_open_in_the_child_and_wrote_its_log_twice(tmp_path):
    # Found by hostile probing: the adaptor never joined the pool directory, so fork() did not
    # mark it. In the child, stats()/validate()/flush() went on to the inner pool's lock and the
    # adaptor's own (a hang whenever a parent thread held one at the fork: 4 of 30 forks), and a
    # child that exited normally wrote the parent's buffered lines to the shared file again.
    log = tmp_path / "fork.csv"
    r = _run(f"""
import os, sys
import poolkeeper as pk
from poolkeeper.errors import PoolClosedError
pool = pk.LoggingPool(pk.ArenaPool(pk.upstream.Simulated(latency_us=0)), {str(log)!r})
for _ in range(3):
    pool.deallocate(pool.allocate(100))
pid = os.fork()
if pid == 0:
    refused = []
    for name, call in (("stats", pool.stats), ("validate", pool.validate), ("flush", pool.flush),
                       ("snapshot", pool.snapshot), ("events", lambda: pool.events),
                       ("allocate", lambda: pool.allocate(5))):
        try:
            call()
        except PoolClosedError as e:
            refused.append(name if "fork" in str(e) else name + ": " + str(e))
    print("child refused", refused, flush=True)
    sys.exit(0)  # a normal exit: exit handlers and finalizers run
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
pool.close()
print("PARENT-OK")
""")
    assert r.returncode == 0 and "PARENT-OK" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "child refused ['stats', 'validate', 'flush', 'snapshot', 'events', 'allocate']" in r.stdout, r.stdout
    lines = log.read_text().splitlines()
    assert lines.count("Thread,Time,Action,Pointer,Size,Stream") == 1, lines
    assert len(lines) == 1 + 6, lines  # three allocations and three frees, once
