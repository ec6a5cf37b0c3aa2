"""Regression tests for the Python side of "Reliability, second round" (issue 16), one per finding,
each named after what broke. Scenarios that hung before their fix run in a subprocess with a
timeout, so a regression fails instead of stalling the suite."""
from __future__ import annotations

import _thread
import gc
import http.client
import io
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import poolkeeper as pk
from poolkeeper.accounting import PhaseTracker, Snapshot
from poolkeeper.bench.errors import ReplayError, ResultsError
from poolkeeper.cli import main
from poolkeeper.errors import (
    InvalidArgumentError,
    InvalidStreamError,
    InvariantError,
    OutOfMemoryError,
    ReentrancyError,
    UpstreamError,
    UpstreamOutOfMemoryError,
)
from poolkeeper.staging import PinnedStagingPool, Uploader, _engine, copy
from poolkeeper.streams import as_handle

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB


def run_child(code: str, timeout: float = 60) -> dict:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"child exited {r.returncode}: {r.stderr[-1500:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def nothing_stranded(pool: PinnedStagingPool, host) -> dict:
    """Every staging buffer is back: none live, the upstream holds exactly the retained ones."""
    gc.collect()
    s = pool.stats()
    assert s["live_buffers"] == 0, s
    assert host.counters()["outstanding_bytes"] == s["retained_bytes"], (host.counters(), s)
    assert s["leaked_unconfirmed"] == 0
    return s


# -- 7: out of memory is OutOfMemoryError everywhere; the staging pool's recovery runs -----------------


def test_host_enomem_is_out_of_memory_error():
    with pytest.raises(OutOfMemoryError) as ei:
        pk.upstream.Host().allocate(1 << 61)  # below the "absurd" bound, far above any heap
    e = ei.value
    assert isinstance(e, UpstreamOutOfMemoryError) and isinstance(e, UpstreamError) and isinstance(e, MemoryError)
    assert (e.cause, e.upstream, e.error_name, e.code) == ("upstream", "Host", "ENOMEM", 12)
    assert e.requested is None and e.pool is None  # no pool was involved
    assert pickle.loads(pickle.dumps(e)).error_name == "ENOMEM"


def test_simulated_and_injected_oom_on_raw_upstream_calls_are_out_of_memory_errors():
    with pytest.raises(OutOfMemoryError):
        pk.upstream.Simulated(latency_us=0, capacity=1 * MiB).allocate(2 * MiB)
    with pytest.raises(OutOfMemoryError):
        pk.upstream.Faulty(pk.upstream.Host(), fail_at={0}).allocate(4096)
    with pytest.raises(UpstreamError) as ei:  # a failure that is not lack of memory stays what it was
        pk.upstream.Faulty(pk.upstream.Host(), fail_at={0}, error="upstream").allocate(4096)
    assert not isinstance(ei.value, MemoryError)


def test_staging_pool_oom_recovery_frees_retained_buffers_and_retries_once():
    host = pk.upstream.Host()
    up = pk.upstream.Faulty(host, fail_at={2})  # the 3rd allocation runs out of memory
    pool = PinnedStagingPool(up, max_buffers=4, max_bytes=64 * MiB)
    for b in [pool.acquire(4096), pool.acquire(8192)]:
        b.retire(copy(0, b, 0))
    assert pool.stats()["retained_buffers"] == 2
    big = pool.acquire(1 * MiB)  # nothing retained fits: allocation 2 fails, trim, allocation 3 serves
    s = pool.stats()
    assert s["failed_allocs"] == 1 and s["freed_by_trim"] == 2 and s["retained_buffers"] == 0
    assert s["pinned_alloc_calls"] == 3 and s["live_buffers"] == 1
    assert host.counters()["outstanding_bytes"] == big.capacity
    big.retire(copy(0, big, 0))


def test_staging_pool_oom_with_nothing_to_free_raises_out_of_memory_error():
    pool = PinnedStagingPool(pk.upstream.Faulty(pk.upstream.Host(), fail_every=1), max_buffers=2)
    with pytest.raises(OutOfMemoryError):
        pool.acquire(4096)
    assert pool.stats()["failed_allocs"] == 1


def test_regression_staging_failed_allocs_missed_an_upstream_error_that_is_not_oom():
    # Hostile probing: only a MemoryError from the first upstream.allocate was counted, though
    # failed_allocs means every upstream allocation that raised (docs/staging.md).
    up = pk.upstream.Faulty(pk.upstream.Host(), fail_at={0}, error="upstream")
    pool = PinnedStagingPool(up, max_buffers=2)
    with pytest.raises(UpstreamError) as ei:
        pool.acquire(4096)
    assert not isinstance(ei.value, MemoryError)
    s = pool.stats()
    assert s["failed_allocs"] == 1 and s["live_buffers"] == 0 and s["freed_by_trim"] == 0
    b = pool.acquire(4096)  # the next allocation is not refused
    b.retire(copy(0, b, 0))
    pool.close()


# -- 8: Ctrl-C during an upload strands no staging buffer ---------------------------------------------


class _KIOnce:
    """Raises KeyboardInterrupt at the n-th call, as a Ctrl-C landing there would."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def hit(self) -> None:
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt


@pytest.fixture
def host():
    return pk.upstream.Host()


def make_uploader(host, engine: str, workers: int = 3) -> Uploader:
    return Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=workers, depth=2, engine=engine)


class _InterruptingFile(io.BytesIO):
    def __init__(self, data: bytes, ki: _KIOnce) -> None:
        super().__init__(data)
        self.ki = ki

    def readinto(self, b):  # noqa: D401
        self.ki.hit()
        return super().readinto(b)


@pytest.mark.parametrize("at", [1, 3, 6])
def test_ctrl_c_in_file_readinto_strands_no_staging_buffer(host, at):
    data = payload(12 * CHUNK, seed=at)
    with make_uploader(host, "auto") as up:
        with pytest.raises(KeyboardInterrupt):
            up.upload(_InterruptingFile(data, _KIOnce(at)), bytearray(len(data)))
        s = nothing_stranded(up.pool, host)
        assert s["dropped_without_retire"] == 0
        dst = bytearray(len(data))  # still serves
        up.upload(io.BytesIO(data), dst)
        assert dst == data


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("source", ["memory", "file"])
@pytest.mark.parametrize("at", [1, 4])
def test_ctrl_c_in_progress_callback_strands_no_staging_buffer(host, engine, source, at):
    if source == "file" and engine == "native":
        pytest.skip("file sources always run on the Python engine")
    if engine == "native" and at > 1:
        pytest.skip("the native engine may report progress only once: only the first call is certain")
    data = payload(16 * CHUNK, seed=at)
    ki = _KIOnce(at)
    with make_uploader(host, engine if source == "memory" else "auto") as up:
        src = data if source == "memory" else io.BytesIO(data)
        with pytest.raises(KeyboardInterrupt):
            up.upload(src, bytearray(len(data)), progress=lambda done, total: ki.hit())
        s = nothing_stranded(up.pool, host)
        assert s["dropped_without_retire"] == 0


@pytest.mark.parametrize("source", ["memory", "file"])
def test_ctrl_c_while_waiting_for_a_copy_strands_no_staging_buffer(host, monkeypatch, source):
    """The buffer used to leave the in-flight list before its wait: a Ctrl-C there lost it."""
    real_wait = _engine.PendingCopy.wait
    ki = _KIOnce(2)

    def wait(self):
        ki.hit()
        return real_wait(self)

    data = payload(12 * CHUNK, seed=5)
    with make_uploader(host, "python", workers=1) as up:
        up.warm_up()
        monkeypatch.setattr(_engine.PendingCopy, "wait", wait)
        src = data if source == "memory" else io.BytesIO(data)
        with pytest.raises(KeyboardInterrupt) as ei:
            up.upload(src, bytearray(len(data)))
        s = up.pool.stats()  # before any collection: the traceback still holds every frame's buffer
        assert s["live_buffers"] == 0, s
        del ei
        s = nothing_stranded(up.pool, host)
        assert s["dropped_without_retire"] == 0 and s["closed_without_retire"] == 0


@pytest.mark.parametrize("engine", ["python", "native"])
def test_real_interrupts_at_every_chunk_strand_no_staging_buffer(host, monkeypatch, engine):
    """A SIGINT-like interrupt (``_thread.interrupt_main``) raised from the copy thread at the k-th
    copy lands in the main thread wherever it happens to be."""
    data = payload(10 * CHUNK, seed=9)
    real = _engine._memmove
    for k in range(1, 9):
        count = [0]

        def memmove(dst, src, n, k=k):
            count[0] += 1
            if count[0] == k:
                _thread.interrupt_main()
            return real(dst, src, n)

        monkeypatch.setattr(_engine, "_memmove", memmove)
        up = make_uploader(host, engine, workers=2)
        try:
            up.upload(data, bytearray(len(data)))
        except KeyboardInterrupt:
            pass
        try:  # an interrupt still pending when upload() returned lands here at the latest
            for _ in range(1000):
                pass
        except KeyboardInterrupt:
            pass
        nothing_stranded(up.pool, host)
        up.close()


# -- 11 (Python side): hostile readinto, streams, logs, snapshots, results ------------------------------


def test_readinto_returning_minus_one_fails_instead_of_looping_forever():
    out = run_child("""
        import io, json
        import poolkeeper as pk
        from poolkeeper.staging import PinnedStagingPool, Uploader
        class Bad(io.RawIOBase):
            def readinto(self, b): return -1
        up = Uploader(PinnedStagingPool(pk.upstream.Host()), chunk_bytes=65536, workers=1, depth=2)
        try:
            up.upload(Bad(), bytearray(4096), nbytes=4096)
            err = None
        except Exception as e:
            err = type(e).__name__
        s = up.pool.stats()
        print(json.dumps({"err": err, "live": s["live_buffers"]}))
    """, timeout=60)
    assert out == {"err": "InvalidArgumentError", "live": 0}


@pytest.mark.parametrize("ret", [4097, 1 << 40, "12", None, 2.0, True])
def test_readinto_returning_more_than_the_buffer_or_a_non_count_raises(ret):
    class Bad(io.RawIOBase):
        def readinto(self, b):
            return ret

    with Uploader(PinnedStagingPool(pk.upstream.Host()), chunk_bytes=CHUNK, workers=1, depth=2) as up:
        with pytest.raises(InvalidArgumentError, match="readinto returned"):
            up.upload(Bad(), bytearray(4096), nbytes=4096)
        assert up.pool.stats()["live_buffers"] == 0


class _SelfStream:
    def __init__(self, attr: str) -> None:
        self.attr = attr

    def __getattr__(self, name):
        if name == self.attr:
            return self
        raise AttributeError(name)


class _ProtocolSelf:
    def __cuda_stream__(self):
        return (0, self)


@pytest.mark.parametrize("obj", [_SelfStream("cuda_stream"), _SelfStream("ptr"), _ProtocolSelf()],
                         ids=["cuda_stream", "ptr", "__cuda_stream__"])
def test_streams_as_handle_on_a_self_referential_stream_raises_invalid_stream_error(obj):
    with pytest.raises(InvalidStreamError, match="levels"):
        as_handle(obj)


def test_streams_as_handle_on_a_cycle_and_bad_protocol_tuples():
    a, b = _SelfStream("cuda_stream"), _SelfStream("cuda_stream")
    a.__dict__["cuda_stream"], b.__dict__["cuda_stream"] = b, a
    with pytest.raises(InvalidStreamError):
        as_handle(a)

    class P:
        def __init__(self, r):
            self.r = r

        def __cuda_stream__(self):
            return self.r

    for r in [(0, None), (0,), 5, (0, "s"), (0, -1), (0, 1 << 64)]:
        with pytest.raises(InvalidStreamError):
            as_handle(P(r))

    class Raises:
        @property
        def cuda_stream(self):
            raise ValueError("driver gone")

    with pytest.raises(InvalidStreamError) as ei:
        as_handle(Raises())
    assert isinstance(ei.value.__cause__, ValueError)
    assert as_handle(P((0, 7))) == 7 and as_handle(_Wrap(_Wrap(3))) == 3


class _Wrap:
    def __init__(self, inner):
        self.cuda_stream = inner


RMM_HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"


@pytest.mark.parametrize("size", ["9" * 5000, "²", "1²", "٣", "18446744073709551616", "-5", "1_0"],
                         ids=["5000-digits", "superscript", "digit-superscript", "arabic-indic", "2^64", "negative",
                              "underscore"])
def test_replay_rmm_log_with_a_hostile_size_is_a_replay_error(tmp_path, size, capsys):
    log = tmp_path / "log.csv"
    log.write_text(RMM_HEADER + f"1,00:00:00.000001,allocate,0x1000,{size},0x0\n", encoding="utf-8")
    from poolkeeper.bench.readers import read_log

    with pytest.raises(ReplayError) as ei:
        read_log(str(log))
    assert ei.value.line == 2
    assert main(["replay", str(log), "--pool", "direct", "--sim-latency-us", "0"]) == 1
    err = capsys.readouterr().err
    assert "ReplayError" in err and "Traceback" not in err


@pytest.mark.parametrize("ptr", ["0x" + "f" * 5000, "-0x10", "0x1_0", "0x²"])
def test_replay_rmm_log_with_a_hostile_pointer_is_a_replay_error(tmp_path, ptr):
    log = tmp_path / "log.csv"
    log.write_text(RMM_HEADER + f"1,00:00:00.000001,allocate,{ptr},4096,0x0\n", encoding="utf-8")
    from poolkeeper.bench.readers import read_log

    with pytest.raises(ReplayError):
        read_log(str(log))


def _deep_pickle(depth: int) -> bytes:
    """``{"device_traces": [[[[...]]]]}`` nested ``depth`` lists deep, written opcode by opcode
    (pickle.dumps itself would recurse that deep)."""
    key = b"device_traces"
    return (b"\x80\x02}" + b"X" + len(key).to_bytes(4, "little") + key + b"]]" + b"]" * depth + b"a" * (depth - 1)
            + b"aas.")


def _nested(depth: int):
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("snap", [
    {"device_traces": [[{"action": "alloc", "addr": 1 << 5000, "size": 4096}]]},
    {"device_traces": [[{"action": "alloc", "addr": 4096, "size": "4096"}]]},
    {"device_traces": [[{"action": "alloc", "addr": 4096, "size": 1 << 64}]]},
    "deep",
    {"device_traces": [[{"action": _nested(10)}]]},
    {"device_traces": {"0": []}},
    {"device_traces": [[{"action": "alloc", "addr": 1, "size": 1}]], "segments": 5},
    {"device_traces": [[]], "segments": [{"blocks": 7}]},
], ids=["huge-addr", "str-size", "size-2^64", "deep-nesting", "list-action", "dict-traces", "int-segments",
        "int-blocks"])
def test_replay_torch_snapshot_with_hostile_fields_is_a_replay_error_or_clean(tmp_path, snap):
    path = tmp_path / "snap.pickle"
    path.write_bytes(_deep_pickle(50_000) if snap == "deep" else pickle.dumps(snap, protocol=4))
    from poolkeeper.bench.readers import read_log

    try:
        read_log(str(path))  # the ignorable ones (unknown segments) parse cleanly
    except ReplayError:
        pass


@pytest.mark.parametrize("text", [
    '{"pool": "x", "alignment": ' + "9" * 5000 + "}",
    "[" * 100_000 + "]" * 100_000,
    '{"pool": "a", "upstream": "b", "alignment": "²", "stats": {}, "backings": []}',
    '{"pool": "a", "upstream": "b", "alignment": 256, "stats": {"pending_by_stream": [1]}, "backings": []}',
    '{"pool": "a", "upstream": "b", "alignment": 256, "stats": {}, "backings": [{"address": 1e400, "size": 1, "chunks": []}]}',
    '{"pool": "a", "upstream": "b", "alignment": 256, "stats": {}, "backings": [{"address": ' + str(1 << 70)
    + ', "size": 1, "chunks": []}]}',
    '{"pool": "a", "upstream": "b", "alignment": 256, "stats": 5, "backings": []}',
], ids=["5000-digits", "deep-nesting", "superscript", "pending-list", "float-inf", "70-bit", "int-stats"])
def test_report_on_hostile_snapshot_json_is_a_typed_error(tmp_path, text, capsys):
    path = tmp_path / "snap.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InvariantError):
        Snapshot.from_json(str(path))
    assert main(["report", str(path), "-o", str(tmp_path / "m.html")]) == 1
    err = capsys.readouterr().err
    assert "poolkeeper report" in err and "Traceback" not in err


def _row(**over):
    r = {"arm": "arena", "workload": "w", "params": {"n": 1}, "backend": "simulated", "scale": "quick", "ops": 10,
         "p50_ns": 1.0, "p90_ns": 2.0, "p99_ns": 3.0, "max_ns": 4.0, "ops_per_s": 5.0, "upstream_allocations": 1,
         "upstream_deallocations": 1, "peak_reserved_bytes": 4096, "peak_live_bytes": 4096, "machine": {},
         "stream_ordered": False}
    r.update(over)
    return r


@pytest.mark.parametrize("over", [{"p50_ns": "fast"}, {"ops_per_s": [1]}, {"params": [1, 2]}, {"workload": 5},
                                  {"scale": None}, {"params": {"n": {"deep": 1}}}, {"peak_live_bytes": True},
                                  {"machine": "h200"}])
def test_compare_on_rows_of_the_wrong_field_types_is_a_one_line_error(tmp_path, over, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"format": "poolkeeper-bench", "schema": 1, "rows": [_row(), _row(arm="direct", **over)]}))
    from poolkeeper.bench import results

    with pytest.raises(ResultsError, match="wrong type"):
        results.load([str(path)])
    assert main(["compare", str(path)]) == 1
    err = capsys.readouterr().err
    assert "ResultsError" in err and "wrong type" in err and "Traceback" not in err


def test_compare_on_unreadable_json_is_a_one_line_error(tmp_path, capsys):
    for i, text in enumerate(["[" * 100_000, '{"format": "poolkeeper-bench", "schema": ' + "7" * 5000 + "}"]):
        path = tmp_path / f"r{i}.json"
        path.write_text(text)
        assert main(["compare", str(path)]) == 1
        err = capsys.readouterr().err
        assert "ResultsError" in err and "Traceback" not in err


# -- 15: PhaseTracker's trend test -------------------------------------------------------------------


def _track(series, peak_round=2 * MiB) -> PhaseTracker:
    t = PhaseTracker()
    peak = 0.0
    for live in series:
        peak = max(peak, live)
        reserved = -(-int(peak) // peak_round) * peak_round
        t.record({"reserved_bytes": reserved, "live_bytes": int(live), "free_bytes": 0, "pending_bytes": 0})
    return t


def test_phase_tracker_catches_a_leak_that_starts_after_a_stable_stretch():
    base = 64 * MiB
    v = _track([base] * 5 + [base + 2 * MiB * (i + 1) for i in range(25)]).verdict()
    assert not v.stable and "live" in v.growing and "per phase" in v.message


def test_phase_tracker_catches_a_slow_leak():
    v = _track([64 * MiB + 256 * KiB * i for i in range(40)]).verdict()
    assert not v.stable and "live" in v.growing


def test_phase_tracker_catches_a_leak_under_noise():
    missed = 0
    for seed in range(40):
        rng = random.Random(seed)
        missed += _track([64 * MiB + MiB * i + rng.uniform(-3, 3) * MiB for i in range(30)]).verdict().stable
    assert missed <= 1


def test_phase_tracker_does_not_call_a_noisy_stable_workload_a_leak():
    flagged = 0
    for seed in range(40):
        rng = random.Random(1000 + seed)
        flagged += not _track([64 * MiB + rng.uniform(-3, 3) * MiB for _ in range(30)]).verdict().stable
    assert flagged <= 1  # the old rule flagged 5 of 40 such runs


def test_phase_tracker_does_not_call_a_late_plateau_or_one_raised_high_water_mark_a_leak():
    base = 64 * MiB
    assert _track([base + 2 * MiB * min(i, 8) for i in range(30)]).verdict().stable
    assert _track([base] * 15 + [base + 8 * MiB] * 15).verdict().stable


def test_phase_tracker_refuses_bad_parameters():
    for kw in ({"window": 2}, {"min_growth": -1}, {"alpha": 0}, {"alpha": float("nan")}, {"warmup": "2"}):
        with pytest.raises(InvalidArgumentError):
            PhaseTracker(**kw)


# -- 17: a progress callback that calls upload() on the same uploader ----------------------------------


@pytest.mark.parametrize("engine", ["python", "native"])
def test_upload_from_own_progress_callback_raises_instead_of_deadlocking(engine):
    out = run_child(f"""
        import json
        import poolkeeper as pk
        from poolkeeper.errors import ReentrancyError
        from poolkeeper.staging import PinnedStagingPool, Uploader
        up = Uploader(PinnedStagingPool(pk.upstream.Host()), chunk_bytes=65536, workers=2, depth=2, engine="{engine}")
        other = Uploader(PinnedStagingPool(pk.upstream.Host()), chunk_bytes=65536, workers=2, depth=2, engine="{engine}")
        data = bytes(range(256)) * 2048
        seen = []
        def progress(done, total):
            if not seen:
                for call in (lambda: up.upload(b"x" * 10, bytearray(10)), lambda: up.start(b"x" * 10, bytearray(10))):
                    try:
                        call()
                        seen.append("no error")
                    except ReentrancyError as e:
                        seen.append(type(e).__name__)
                small = bytearray(10)
                other.upload(b"y" * 10, small)  # another uploader is fine
                seen.append(bytes(small) == b"y" * 10)
        dst = bytearray(len(data))
        up.upload(data, dst, progress=progress)
        dst2 = bytearray(len(data))
        up.upload(data, dst2)  # and the uploader still works
        s = up.pool.stats()
        print(json.dumps({{"seen": seen, "ok": dst == data and dst2 == data, "live": s["live_buffers"]}}))
    """, timeout=60)
    assert out == {"seen": ["ReentrancyError", "ReentrancyError", True], "ok": True, "live": 0}


def test_reentrancy_error_is_typed():
    assert issubclass(ReentrancyError, pk.PoolkeeperError) and issubclass(ReentrancyError, RuntimeError)


# -- 19: pkt.install(pool) checks the pool (no torch needed) --------------------------------------------


class _StandIn:
    """A pool-shaped object over an upstream of a given kind (what install() inspects)."""

    def __init__(self, kind, device=0, name="CudaPinned"):
        self.upstream = type("U", (), {"kind": kind, "device": device, "name": name})()

    def allocate(self, n):  # pragma: no cover - never called
        raise AssertionError


@pytest.mark.parametrize("make", [
    lambda: pk.Direct(pk.upstream.Host()),
    lambda: pk.SizeClassPool(pk.upstream.Simulated(latency_us=0)),
    lambda: pk.ArenaPool(pk.upstream.Simulated(latency_us=0)),
    lambda: _StandIn("pinned"),
    lambda: _StandIn("device", device=-1, name="Simulated"),
    lambda: 42,  # (None is not here: it asks for the default kind)
    lambda: object(),
], ids=["host", "simulated-size-class", "simulated-arena", "cuda-pinned", "simulated-kind", "int", "object"])
def test_torch_install_refuses_a_pool_not_over_cuda_device_memory(monkeypatch, make):
    from poolkeeper import _core
    from poolkeeper.integrations import torch as pk_torch

    monkeypatch.setitem(sys.modules, "torch", None)  # torch absent: the check comes first anyway
    pk_torch._forget_for_tests()
    with pytest.raises(InvalidArgumentError):
        pk_torch.install(make())
    assert pk_torch.installation() is None and _core.registry_devices() == []


# -- Also: lab HEAD and --timeout; bench --json; cupy install rollback -------------------------------------


def test_lab_server_answers_head_like_get_without_a_body():
    from poolkeeper.report.lab_page import make_server

    server = make_server(0)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        for path, status in (("/", 200), ("/index.html", 200), ("/nope", 404)):
            c = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=20)
            c.request("HEAD", path)
            r = c.getresponse()
            body = r.read()
            assert (r.status, body) == (status, b"")
            if status == 200:
                assert int(r.getheader("Content-Length")) > 1000 and r.getheader("Content-Type").startswith("text/html")
            c.close()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "1e300"])
def test_lab_timeout_that_is_not_a_sane_number_is_a_one_line_error(value):
    # A subprocess: before the fix "inf" served forever (or died in threading.Timer).
    r = subprocess.run([sys.executable, "-m", "poolkeeper.cli", "lab", "--timeout", value], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "--timeout" in r.stderr and "Traceback" not in r.stderr


FAST = ["--quick", "--backend", "simulated", "--no-progress", "--sim-latency-us", "0", "--arms", "direct",
        "--workloads", "kv_cache"]


def test_bench_json_path_is_checked_before_the_matrix_runs(tmp_path, monkeypatch, capsys):
    from poolkeeper.bench import runner

    ran = []
    monkeypatch.setattr(runner, "run", lambda *a, **k: ran.append(1) or [])
    d = tmp_path / "adir"
    d.mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in (str(d), str(blocker / "sub" / "out.json")):
        assert main(["bench", *FAST, "--json", bad]) == 1
        err = capsys.readouterr().err
        assert "cannot write results" in err and "Traceback" not in err
    assert not ran and not list(tmp_path.rglob("*.tmp"))


def test_bench_json_write_failing_after_the_matrix_keeps_the_rows(tmp_path, monkeypatch, capsys):
    import tempfile

    out = tmp_path / "out.json"
    real_replace = os.replace
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "rescue"))
    (tmp_path / "rescue").mkdir()

    def replace(src, dst):
        if str(dst) == str(out):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert main(["bench", *FAST, "--json", str(out)]) == 1
    cap = capsys.readouterr()
    assert "kv_cache" in cap.out  # the table was printed
    assert "saved to" in cap.err and "Traceback" not in cap.err
    (rescued,) = list((tmp_path / "rescue").glob("poolkeeper-bench-*.json"))
    assert json.loads(rescued.read_text())["rows"]
    assert not out.exists() and not list(tmp_path.rglob("*.tmp"))


def test_cupy_install_rolls_back_when_the_pinned_allocator_is_refused(monkeypatch):
    from test_integrations_cpu import make_fake_cupy

    from poolkeeper.integrations import cupy as pk_cupy

    c = make_fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", c)

    def refuse(a=None):
        raise RuntimeError("pinned allocator refused")

    c.cuda.set_pinned_memory_allocator = refuse
    pinned = pk.ArenaPool(pk.upstream.Host())
    with pytest.raises(RuntimeError, match="refused"):
        pk_cupy.install("arena", pinned=pinned, upstream="device")
    assert pk_cupy.installation() is None
    assert c.state["allocator"] == "cupy-default"
    pk_cupy.uninstall()  # nothing to undo
    assert c.state["allocator"] == "cupy-default"


def test_pools_and_as_handle_read_streams_the_same_way():
    """streams.as_handle is the pools' own (C++) reading: the same inputs accepted with the same
    handle, the same ones refused, and a wrapper whose handle attribute raises is an
    InvalidStreamError caused by what it raised in both (KeyboardInterrupt passes through)."""
    import poolkeeper as pk

    class Raises:
        @property
        def cuda_stream(self):
            raise ValueError("driver gone")

    class Interrupted:
        def __cuda_stream__(self):
            raise KeyboardInterrupt

    class P:
        def __init__(self, r):
            self.r = r

        def __cuda_stream__(self):
            return self.r

    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.SizeClassPool(sim)
    for good in (None, 0, 7, P((0, 9)), _Wrap(_Wrap(3))):
        pool.deallocate(pool.allocate(64, good), good)
        assert as_handle(good) == (None if good is None else {0: 0, 7: 7}.get(good, 9 if isinstance(good, P) else 3))
    for bad in (Raises(), P((0, None)), P(5), -1, 1 << 64, True, "s"):
        with pytest.raises(InvalidStreamError) as via_pool:
            pool.allocate(64, bad)
        with pytest.raises(InvalidStreamError) as via_helper:
            as_handle(bad)
        assert str(via_pool.value) == str(via_helper.value)
        assert type(via_pool.value.__cause__) is type(via_helper.value.__cause__)
    with pytest.raises(InvalidStreamError) as ei:
        pool.allocate(64, Raises())
    assert isinstance(ei.value.__cause__, ValueError) and "driver gone" in str(ei.value)
    for call in (lambda: pool.allocate(64, Interrupted()), lambda: as_handle(Interrupted())):
        with pytest.raises(KeyboardInterrupt):
            call()
    assert pool.stats()["live_blocks"] == 0
    pool.validate()


def test_regression_an_int_too_long_to_print_escaped_the_new_checks_as_a_bare_value_error(tmp_path):
    # Found rereading the hostile-probing fixes: their error messages printed the bad value with
    # repr(), and an int of more than 4,300 digits cannot be printed, so the check meant to
    # report it raised Python's own ValueError instead. Messages describe values with
    # errors.brief() now ("an int of N bits", as the core's messages say).
    import poolkeeper as pk
    from poolkeeper.buffers import BufferExportError
    from poolkeeper.errors import InvalidArgumentError
    from poolkeeper.staging import PinnedStagingPool
    from poolkeeper.staging.uploader import _check_timeout

    big = 10**5000
    snap = pk.ArenaPool(pk.upstream.Simulated(latency="none")).snapshot()
    staging = PinnedStagingPool(pk.upstream.Host()).acquire(64)
    buf = pk.ArenaPool(pk.upstream.Simulated(latency="none")).buffer(64)
    cases = [
        (lambda: snap.to_json(big), InvalidArgumentError),
        (lambda: snap.to_torch(tmp_path / "s.pickle", device=big), InvalidArgumentError),
        (lambda: _check_timeout(-big), InvalidArgumentError),
        (lambda: staging.view(big), InvalidArgumentError),
        (lambda: staging.view(-big), InvalidArgumentError),
        (lambda: buf.__dlpack__(stream=big), BufferExportError),
    ]
    for call, error in cases:
        with pytest.raises(error, match="an int of 16610 bits"):
            call()
    staging.close()



# Ctrl-C while an allocation waits without the GIL (docs/hardening.md, "Fourth round: the Python
# API under threads"): the upstream call takes a second (Simulated's latency), the SIGINT is raised
# by another thread once Faulty (no rules: a pass-through that counts) has seen the call begin.
CTRL_C_IN_AN_ALLOCATION = """
    import json, signal, sys, threading
    import poolkeeper as pk
    from poolkeeper import _core
    via = sys.argv[1]
    sim = pk.upstream.Simulated(latency_us=1_000_000)
    up = pk.upstream.Faulty(sim)
    pool = None if via == "upstream" else pk.pools.make_pool("direct" if via != "arena" else "arena", up)
    target = {"upstream": up, "graph_pools": pool and _core.GraphPools(pool)}.get(via, pool)

    def ctrl_c_once_under_way():
        while up.calls == 0:
            pass
        signal.raise_signal(signal.SIGINT)

    t = threading.Thread(target=ctrl_c_once_under_way)
    t.start()
    try:
        target.allocate(1 << 20)
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    t.join()
    live = None if pool is None else pool.stats()["live_blocks"]
    if pool is not None:
        pool.validate()
    print(json.dumps({"outcome": outcome, "live_blocks": live, "upstream_holds": sim.counters()["outstanding_bytes"]}))
"""


@pytest.mark.parametrize("via", ["direct", "arena", "graph_pools", "upstream"])
def test_regression_ctrl_c_during_an_allocation_left_its_block_live_for_good(via):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(CTRL_C_IN_AN_ALLOCATION), via], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, f"child exited {r.returncode}: {r.stderr[-1500:]}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # The address never reached the caller, so the block must not stay: given back before the
    # KeyboardInterrupt went up (before, it stayed live and the pool could never close).
    assert got["outcome"] == "KeyboardInterrupt"
    assert got["live_blocks"] in (0, None)
    assert got["upstream_holds"] == 0 or via == "arena", got
