"""poolkeeper replay: both log readers on generated fixtures (tests/fixtures/replay, made by
make_fixtures.py there), unknown frees skipped, malformed and truncated logs named by line."""
from __future__ import annotations

import collections
import json
import os
import pickle

import pytest

import poolkeeper as pk
from poolkeeper.bench.arms import arena_available
from poolkeeper.bench.errors import ReplayError
from poolkeeper.bench.readers import read_log
from poolkeeper.bench.replay import replay_log
from poolkeeper.bench.replay_engine import replay
from poolkeeper.cli import main

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "replay")
EXPECTED = json.load(open(os.path.join(HERE, "expected.json")))
POOLS = ["direct", "size_class"] + (["arena"] if arena_available() else [])


def fixture(name):
    return os.path.join(HERE, name)


@pytest.mark.parametrize("name", ["rmm_small.csv", "rmm_legacy.csv", "torch_small.pickle"])
def test_replay_matches_the_generator_bookkeeping(name):
    exp = EXPECTED[name]
    doc = replay_log(fixture(name), POOLS, latency_us=0)
    assert doc["events"] == exp["events"]
    for kind, r in doc["pools"].items():
        c = r["counts"]
        assert c["allocations"] == exp["allocations"]
        assert c["frees"] == exp["frees"]
        assert c["unknown_frees"] == exp["unknown_frees"]
        assert c["failed_in_log"] == exp["failed_in_log"]
        assert r["peak_live_bytes"] == exp["peak_live_bytes"]
        assert r["live_at_end_blocks"] == exp["live_at_end_blocks"]
        assert r["live_at_end_bytes"] == exp["live_at_end_bytes"]
        assert r["peak_reserved_bytes"] >= r["peak_live_bytes"]
        assert r["reserved_over_live"] == pytest.approx(r["peak_reserved_bytes"] / r["peak_live_bytes"])
        assert r["ops"] == c["allocations"] + c["frees"]
        assert r["alloc"]["samples"] == c["allocations"] and r["free"]["samples"] == c["frees"]
        assert r["at_peak_live"]["live_bytes"] == exp["peak_live_bytes"]
        assert 0.0 <= r["fragmentation_at_peak"] <= 1.0
    direct = doc["pools"]["direct"]
    assert direct["upstream_allocations"] == exp["allocations"]
    assert direct["upstream_deallocations"] == exp["frees"]  # replay-end frees come after the counters


def test_torch_snapshot_details():
    exp = EXPECTED["torch_small.pickle"]
    trace = read_log(fixture("torch_small.pickle"))
    assert trace.format == "torch_snapshot" and trace.info["device"] == exp["device"] and trace.info["devices"] == 2
    assert trace.ignored == exp["ignored_actions"]
    assert trace.info["source_peak_reserved_bytes"] == exp["source_peak_reserved_bytes"]
    one = read_log(fixture("torch_small.pickle"), device=1)
    assert [(e.kind, e.size) for e in one.events] == [("alloc", 512)]
    with pytest.raises(ReplayError, match="no trace for device 5"):
        read_log(fixture("torch_small.pickle"), device=5)


def test_legacy_and_current_rmm_pointer_formats_agree():
    legacy = read_log(fixture("rmm_legacy.csv"))
    assert legacy.events[0].addr == 0x7F0000000000 and legacy.events[0].stream == 0
    cur = read_log(fixture("rmm_small.csv"))
    assert cur.events[1].addr == 0x7F8A40000000 and cur.events[1].stream == 0x7F8A38001020


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"


def test_unknown_frees_and_reused_addresses_are_counted_not_fatal(tmp_path):
    log = write(tmp_path, "log.csv", HEADER + "\n".join([
        "1,10:00:00.000001,free,dead0000,4096,0",          # allocated before logging began
        "1,10:00:00.000002,allocate,a000,1000,0",
        "1,10:00:00.000003,allocate,a000,2000,0",          # the log lost a000's free
        "1,10:00:00.000004,allocate failure,0,99999999999,0",
        "1,10:00:00.000005,free,a000,2000,0",
    ]) + "\n")
    trace = read_log(log)
    pool = pk.SizeClassPool(pk.upstream.Simulated(latency_us=0))
    r = replay(trace, pool, pool.upstream)
    assert r["counts"]["unknown_frees"] == 1
    assert r["counts"]["reallocated_live"] == 1
    assert r["counts"]["failed_in_log"] == 1
    assert r["counts"]["allocations"] == 2 and r["counts"]["frees"] == 1
    assert r["peak_live_bytes"] == 2000  # the assumed free of the first a000 came before the second
    assert pool.stats()["live_bytes"] == 0
    pool.close()


@pytest.mark.parametrize("body, line, message", [
    ("1,10:00:00.1,allocate,a000,1000,0\n1,10:00:00.2,allocate,b0", 3, "truncated"),
    ("1,10:00:00.1,allocate,a000,1000,0\n1,10:00:00.2,allocat,b000,10,0\n", 3, "unknown action 'allocat'"),
    ("1,10:00:00.1,allocate,zz,1000,0\n", 2, "pointer 'zz' is not hexadecimal"),
    ("1,10:00:00.1,allocate,a000,-5,0\n", 2, "size '-5'"),
    ("1,10:00:00.1,allocate,a000,12,q\n", 2, "stream 'q'"),
    ("1,10:00:00.1,allocate,a000,1000,0,extra\n", 2, "expected 6"),
])
def test_malformed_rmm_logs_name_the_line(tmp_path, body, line, message):
    log = write(tmp_path, "bad.csv", HEADER + body)
    with pytest.raises(ReplayError, match=message) as ei:
        read_log(log)
    assert ei.value.line == line
    assert f"line {line}:" in str(ei.value)


def test_rmm_header_problems(tmp_path):
    with pytest.raises(ReplayError, match="line 1: expected the RMM log header"):
        read_log(write(tmp_path, "h.csv", "Thread,Time,Action\n1,2,3\n"), "rmm")
    with pytest.raises(ReplayError, match="unrecognized log format"):
        read_log(write(tmp_path, "x.txt", "hello\n"))
    with pytest.raises(ReplayError, match="empty file"):
        read_log(write(tmp_path, "e.csv", ""))


def test_a_truncated_real_fixture_names_its_last_line(tmp_path):
    text = open(fixture("rmm_small.csv")).read()
    cut = text[: text.rindex("\n", 0, len(text) - 1) + 20]  # stop 20 characters into the last line
    log = write(tmp_path, "cut.csv", cut)
    with pytest.raises(ReplayError) as ei:
        read_log(log)
    assert ei.value.line == cut.count("\n") + 1 == EXPECTED["rmm_small.csv"]["events"] + 1


def test_truncated_or_foreign_torch_pickles(tmp_path):
    data = open(fixture("torch_small.pickle"), "rb").read()
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReplayError, match="truncated"):
        read_log(str(cut))
    evil = tmp_path / "class.pickle"
    evil.write_bytes(pickle.dumps(collections.OrderedDict(device_traces=[]), protocol=4))
    with pytest.raises(ReplayError, match="refers to collections.OrderedDict"):
        read_log(str(evil))
    nodev = tmp_path / "nodev.pickle"
    nodev.write_bytes(pickle.dumps({"segments": []}, protocol=4))
    with pytest.raises(ReplayError, match="no 'device_traces'"):
        read_log(str(nodev))


def test_malformed_torch_entry_names_its_index(tmp_path):
    snap = {"device_traces": [[{"action": "alloc", "addr": 4096, "size": 10, "stream": 0},
                               {"action": "alloc", "addr": 8192, "stream": 0}]]}
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    with pytest.raises(ReplayError, match=r"device_traces\[0\]\[1\]: field 'size' is None") as ei:
        read_log(str(p))
    assert ei.value.where == "device_traces[0][1]"


def test_replay_cli_json_and_errors(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["replay", fixture("torch_small.pickle"), "--pool", "direct,size_class", "--json", str(out),
                 "--sim-latency-us", "0", "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["pools"]) == {"direct", "size_class"}
    assert doc["source_peak_reserved_bytes"] == EXPECTED["torch_small.pickle"]["source_peak_reserved_bytes"]
    text = capsys.readouterr().out
    assert "logged allocator" in text and "peak reserved" in text

    assert main(["replay", fixture("rmm_legacy.csv"), "--pool", "direct", "--json", "--sim-latency-us", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["pools"]["direct"]["peak_live_bytes"] == 3072

    bad = write(tmp_path, "bad.csv", HEADER + "1,10:00:00.1,allocate,a000,10,0\n1,10:00:00.2,fre")
    assert main(["replay", bad, "--sim-latency-us", "0"]) == 1
    err = capsys.readouterr().err
    assert "ReplayError" in err and "line 3" in err and "Traceback" not in err

    assert main(["replay", fixture("rmm_legacy.csv"), "--pool", "nope"]) == 1
    assert "unknown pool" in capsys.readouterr().err
    assert main(["replay", fixture("rmm_legacy.csv"), "-o", "nonsense=1", "--pool", "direct"]) == 1
    assert "not accepted" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.csv")]) == 1


def test_pool_options_reach_the_pool(capsys):
    # max_cached_bytes=1: the size-class pool can cache nothing, so every free goes upstream.
    assert main(["replay", fixture("rmm_small.csv"), "--pool", "size_class", "-o", "max_cached_bytes=1",
                 "--json", "--sim-latency-us", "0"]) == 0
    r = json.loads(capsys.readouterr().out)["pools"]["size_class"]
    assert r["upstream_deallocations"] == r["counts"]["frees"] == EXPECTED["rmm_small.csv"]["frees"]


def test_option_values():
    from poolkeeper.bench.options import parse_options

    assert parse_options(["a=64MiB", "b=1.5", "c=true", "d=none", "e=0x100", "f=2k"]) == {
        "a": 64 << 20, "b": 1.5, "c": True, "d": None, "e": 256, "f": 2048}
    with pytest.raises(pk.errors.InvalidArgumentError):
        parse_options(["novalue"])
    with pytest.raises(pk.errors.InvalidArgumentError):
        parse_options(["a=lots"])


def test_gzip_compressed_logs_are_read_and_truncation_is_reported(tmp_path):
    import gzip

    for name in ("rmm_small.csv", "torch_small.pickle"):
        data = open(fixture(name), "rb").read()
        gz = tmp_path / (name + ".gz")
        gz.write_bytes(gzip.compress(data))
        plain, packed = read_log(fixture(name)), read_log(str(gz))
        assert packed.events == plain.events and packed.format == plain.format
        cut = tmp_path / (name + ".cut.gz")
        comp = gzip.compress(data)
        cut.write_bytes(comp[: len(comp) // 2])
        with pytest.raises(ReplayError, match="truncated"):
            read_log(str(cut))


def test_blocks_from_before_the_log_can_be_replayed_too(tmp_path):
    # A snapshot whose process held two blocks before recording began: one freed during the trace
    # (an unknown free), one still allocated at the end (seen only in the segments).
    snap = {
        "segments": [{"device": 0, "address": 0x1000000, "total_size": 4 << 20, "stream": 0, "segment_type": "large",
                      "allocated_size": 3000, "active_size": 3000,
                      "blocks": [{"address": 0x1000000, "size": 3072, "requested_size": 3000,
                                  "state": "active_allocated", "frames": []},
                                 {"address": 0x1000c00, "size": 1024, "requested_size": 1024,
                                  "state": "inactive", "frames": []}]}],
        "device_traces": [[
            {"action": "alloc", "addr": 0x2000000, "size": 5000, "stream": 0},
            {"action": "free_completed", "addr": 0x3000000, "size": 7000, "stream": 0},  # held since before
            {"action": "alloc", "addr": 0x2100000, "size": 1000, "stream": 0},
            {"action": "free_completed", "addr": 0x2000000, "size": 5000, "stream": 0},
            {"action": "free_completed", "addr": 0x2100000, "size": 1000, "stream": 0},
        ]],
    }
    p = tmp_path / "pre.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    trace = read_log(str(p))
    assert sorted((e.addr, e.size) for e in trace.pre_trace) == [(0x1000000, 3000), (0x3000000, 7000)]
    assert trace.info["source_live_before_trace"] == 10000
    assert trace.info["source_peak_live_bytes"] == 3000 + 7000 + 5000  # before the 7000 block is freed

    skipped = replay_log(str(p), ["direct"], latency_us=0)["pools"]["direct"]
    assert skipped["counts"]["unknown_frees"] == 1 and skipped["peak_live_bytes"] == 6000
    included = replay_log(str(p), ["direct"], latency_us=0, include_pre_trace=True)["pools"]["direct"]
    assert included["counts"]["unknown_frees"] == 0 and included["counts"]["pre_trace_blocks"] == 2
    assert included["peak_live_bytes"] == trace.info["source_peak_live_bytes"]
    assert included["live_at_end_bytes"] == 3000  # the block still allocated when the snapshot was taken


def test_rmm_unknown_frees_become_pre_trace_blocks(capsys):
    exp = EXPECTED["rmm_small.csv"]
    assert main(["replay", fixture("rmm_small.csv"), "--pool", "direct", "--include-pre-trace", "--json",
                 "--sim-latency-us", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    r = doc["pools"]["direct"]
    assert doc["pre_trace_blocks"] == 1 and doc["pre_trace_bytes"] == 4096
    assert r["counts"]["unknown_frees"] == 0 and r["counts"]["frees"] == exp["frees"] + 1
    assert r["peak_live_bytes"] == exp["peak_live_bytes"]  # the early block is freed by the first event


@pytest.mark.parametrize("value", ["9" * 400 + "GiB", "9" * 5000 + "k", "9" * 5000, "0x1" + "0" * 16, "1e999"])
def test_regression_a_size_option_with_many_digits_was_an_overflow_traceback(value, tmp_path, capsys):
    # Found by hostile probing: a size with a suffix was parsed as int(float(digits) * unit); float()
    # of 400 digits is inf and int(inf) raised OverflowError, a traceback out of `replay -o` and
    # `bench -o`. Sizes are parsed exactly now and anything beyond 64 bits (or not finite) is a
    # one-line InvalidArgumentError.
    from poolkeeper.bench.options import parse_value

    with pytest.raises(pk.errors.InvalidArgumentError):
        parse_value(value)
    assert parse_value("1.5GiB") == 3 << 29 and parse_value("1.3k") == 1331 and parse_value(str(2**64 - 1)) == 2**64 - 1
    assert main(["replay", fixture("rmm_small.csv"), "--no-progress", "-o", "max_backing=" + value]) == 1
    assert main(["bench", "--quick", "--backend", "simulated", "--no-progress", "--arms", "direct",
                 "-o", "direct.max_backing=" + value]) == 1
    err = capsys.readouterr().err
    assert err.count("InvalidArgumentError") == 2 and len(err.strip().splitlines()) == 2, err


@pytest.mark.parametrize("size, error", [(10**15, pk.errors.OutOfMemoryError),
                                         (2**63 - 1, pk.errors.InvalidArgumentError)])
def test_regression_a_replay_refused_by_the_pool_did_not_name_the_event(tmp_path, capsys, size, error):
    # An allocation the pool refuses (more than the simulated device holds; an absurd size) stopped
    # the replay with the pool's one-line error and nothing about where in the log it was.
    log = write(tmp_path, "big.csv", HEADER + "1,10:00:00.1,allocate,a000,1000,0\n"
                f"1,10:00:00.2,allocate,b000,{size},0\n")
    pool = pk.Direct(pk.upstream.Simulated(latency_us=0))
    with pytest.raises(error) as ei:
        replay(read_log(log), pool, pool.upstream)
    assert ei.value.event == 1 and ei.value.line == 3
    assert str(ei.value).startswith(f"event 1 (line 3: alloc of {size} bytes at 0xb000): ")
    pool.validate()
    assert main(["replay", log, "--pool", "size_class", "--sim-latency-us", "0", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"{error.__name__}: event 1 (line 3: alloc of {size} bytes" in err and "Traceback" not in err


def test_a_refused_block_from_before_the_log_is_named_as_such(tmp_path):
    log = write(tmp_path, "pre.csv", HEADER + "1,10:00:00.1,free,dead0000,1000000000000000,0\n")
    pool = pk.Direct(pk.upstream.Simulated(latency_us=0))
    with pytest.raises(pk.errors.OutOfMemoryError, match=r"^a block held from before the log began \(alloc of") as ei:
        replay(read_log(log), pool, pool.upstream, include_pre_trace=True)
    assert ei.value.event is None and ei.value.line is None


def test_replay_reports_a_stitching_pools_aliases_beside_its_upstream_calls(capsys):
    """Aliases are driver calls that take no memory: the replay counts them apart (JSON) and shows
    a row for them only when a pool made some (docs/expandable.md, "Trading memory for driver
    calls")."""
    log = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "traces", "live_bert_arena.csv.gz")
    opts = ["-o", "single_stream=true", "-o", "map_piece=2MiB", "-o", "stitch_max_parts=256", "-o", "stitch_from=4MiB",
            "-o", "stitch_edge_from=64MiB", "-o", "stitch_top_up=true"]
    assert main(["replay", log, "--pool", "arena,arena_expandable", *opts, "--json", "-", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    stitched, arena = doc["pools"]["arena_expandable"], doc["pools"]["arena"]
    assert stitched["upstream_aliases"] > 0 and stitched["upstream_unaliases"] <= stitched["upstream_aliases"]
    assert arena["upstream_aliases"] == arena["upstream_unaliases"] == 0
    # The unaliases go back in runs of adjacent aliases (docs/expandable.md, "Runs").
    assert 0 < stitched["unalias_runs"] < stitched["upstream_unaliases"]
    assert arena["unmap_runs"] == arena["unalias_runs"] == 0
    assert main(["replay", log, "--pool", "arena_expandable", *opts, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "aliases / unaliases" in out and "in runs (frees / unaliases)" in out
    assert main(["replay", log, "--pool", "arena", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "aliases / unaliases" not in out and "in runs" not in out
