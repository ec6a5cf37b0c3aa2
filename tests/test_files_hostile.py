"""Hostile files and names against what poolkeeper reads and writes: the memory map, snapshots,
results files, replay logs and the CLI that joins them (docs/hardening.md, "Files and pages").

Each regression test is named after what broke and failed on the tree before its fix.
"""
from __future__ import annotations

import errno
import gzip
import json
import os
import pickle
import signal
import stat
import struct
import subprocess
import sys
import time

import pytest

import poolkeeper as pk
from poolkeeper.accounting import Backing, Chunk, Snapshot
from poolkeeper.bench.errors import ReplayError, ResultsError
from poolkeeper.bench.readers import read_log
from poolkeeper.cli import main
from poolkeeper.errors import InvalidArgumentError, InvariantError, PoolkeeperError
from poolkeeper.report.memory_map import render_html

FAST = ["--backend", "simulated", "--sim-latency-us", "0", "--no-progress", "--quick"]
HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"
RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "simulated.json")


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def _cli(*argv, timeout=120):
    """The command in a child process: (exit code, stdout, stderr)."""
    r = subprocess.run([sys.executable, "-m", "poolkeeper.cli", *map(str, argv)], capture_output=True, text=True,
                       env=_env(), timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _snapshot_file(path, **changes) -> str:
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"))
    pool.allocate(1000)
    d = pool.snapshot().to_dict()
    d.update(changes)
    path.write_text(json.dumps(d))
    return str(path)


def _log(path, body="1,t,allocate,0x10,1024,0x0\n1,t,free,0x10,1024,0x0\n") -> str:
    path.write_text(HEADER + body)
    return str(path)


def _no_temp_files(folder) -> None:
    assert not [p.name for p in folder.rglob("*.tmp")], list(folder.rglob("*"))


# ---------------------------------------------------------------- an output that is the input


@pytest.mark.parametrize("how", ["default", "same path", "symlink", "hard link"])
def test_regression_report_overwrote_the_snapshot_it_read(how, tmp_path):
    # `poolkeeper report snap.html` wrote its map to snap.html (the default output of X.html is
    # X.html) and `-o` naming the snapshot (or a link to it) did the same: the snapshot was gone.
    name = "snap.html" if how == "default" else "snap.json"
    snap = _snapshot_file(tmp_path / name)
    before = open(snap).read()
    out = {"default": None, "same path": snap, "symlink": str(tmp_path / "link.html"),
           "hard link": str(tmp_path / "hard.html")}[how]
    if how == "symlink":
        os.symlink(snap, out)
    elif how == "hard link":
        os.link(snap, out)
    rc, _, err = _cli("report", snap, *(["-o", out] if out else []))
    assert rc == 1 and ("its own output" in _one_line(err) or "is the input file" in err), err
    assert open(snap).read() == before


def test_regression_replay_json_overwrote_the_log(tmp_path):
    log = _log(tmp_path / "log.csv")
    before = open(log).read()
    rc, _, err = _cli("replay", log, "--no-progress", "--sim-latency-us", "0", "--json", log)
    assert rc == 1 and "is the input file" in _one_line(err)
    assert open(log).read() == before


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_regression_compare_output_overwrote_a_results_file(flag, tmp_path):
    res = tmp_path / "rows.json"
    res.write_text(open(RESULTS).read())
    before = res.read_text()
    rc, _, err = _cli("compare", res, flag, res)
    assert rc == 1 and "is the input file" in _one_line(err)
    assert res.read_text() == before


# ---------------------------------------------------------------- rich markup from data


def _results_with(tmp_path, **fields) -> str:
    doc = json.load(open(RESULTS))
    for r in doc["rows"]:
        r.update(fields)
    p = tmp_path / "rows.json"
    p.write_text(json.dumps(doc))
    return str(p)


@pytest.mark.parametrize("field", ["workload", "backend"])
def test_regression_rich_markup_in_a_results_file_was_a_traceback(field, tmp_path):
    # rich reads [...] as markup: a workload "[/]" raised MarkupError (a traceback), and
    # "[link=javascript:...]" wrote a terminal hyperlink. Names are printed as they are now.
    rc, out, err = _cli("compare", _results_with(tmp_path, **{field: "[/]x[link=javascript:alert(1)]y"}))
    assert rc == 0 and err == "", err
    assert "[/]x[link=javascript:alert(1)]y" in out.replace("\n", "") or "[/]x[link=" in out


def test_regression_bench_json_path_with_markup_was_a_traceback_after_the_run(tmp_path):
    # `bench --json PATH` printed PATH as rich markup once the matrix had run: "[/]" raised
    # MarkupError (a traceback after minutes of benchmarking). It prints as written now, "[b]"
    # and a backslash included.
    (tmp_path / "x[").mkdir()
    out_path = tmp_path / "x[" / "]y[/]z[b]\\.json"
    rc, out, err = _cli("bench", *FAST, "--arms", "arena", "--workloads", "hit_pair", "--json", out_path)
    assert rc == 0 and "Traceback" not in err, err
    assert f"rows written to {out_path}" in out
    assert json.loads(out_path.read_text())["rows"]


def test_regression_unpaired_rows_with_markup_were_a_traceback(tmp_path):
    doc = json.load(open(RESULTS))
    doc["rows"] = [dict(r, workload="[/]") for r in doc["rows"] if r["arm"] != "arena"]
    p = tmp_path / "rows.json"
    p.write_text(json.dumps(doc))
    rc, out, err = _cli("compare", p)
    assert rc == 0 and err == "" and "[/]" in out


def test_regression_a_log_path_or_action_with_markup_was_a_traceback_after_the_replay(tmp_path):
    # `poolkeeper replay 'x[/]y.csv'` replayed the whole log, then raised MarkupError printing its
    # name; so did a PyTorch snapshot with an action named "[/]" (its name is printed as "not replayed").
    folder = tmp_path / "x["
    folder.mkdir()
    log = _log(folder / "]y.csv")
    rc, out, err = _cli("replay", log, "--no-progress", "--sim-latency-us", "0", "--pool", "arena")
    assert rc == 0 and err == "" and "x[/]y.csv" in out, err
    snap = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 16, "size": 100, "stream": 0},
                                               {"action": "[/][bold]", "addr": 16, "size": 100},
                                               {"action": "free_completed", "addr": 16, "size": 100}]]}
    p = tmp_path / "t.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    rc, out, err = _cli("replay", p, "--no-progress", "--sim-latency-us", "0", "--pool", "arena")
    assert rc == 0 and err == "" and "[/][bold] 1" in out, err


def test_regression_compare_plot_drew_every_row_however_many(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    # The figure grew with the rows: 2,500 identities took 48 s, and past ~190,000 the image
    # exceeded matplotlib's limit (2^23 pixels) and savefig raised a bare ValueError after hours.
    # At most MAX_ROWS rows are drawn now (the table and --json have them all); a small bound here.
    from poolkeeper.bench import plot as plot_mod
    from poolkeeper.bench.pivot import pivot
    from poolkeeper.bench.results import load

    doc = json.load(open(RESULTS))
    rows = [r for r in doc["rows"] if r["arm"] in ("arena", "direct")][:2]
    many = []
    for i in range(12):
        for r in rows:
            many.append(dict(r, workload=f"w{i}", params={"i": i}))
    doc["rows"] = many
    res = tmp_path / "many.json"
    res.write_text(json.dumps(doc))
    piv = pivot(load([str(res)]), None)

    def height(bound, name):
        monkeypatch.setattr(plot_mod, "MAX_ROWS", bound, raising=False)
        out = tmp_path / name
        plot_mod.plot(piv, str(out))
        return struct.unpack(">I", out.read_bytes()[20:24])[0]  # the PNG header's height

    assert height(3, "three.png") < height(100, "all.png") * 0.6


def test_regression_plot_labels_were_read_as_mathtext_and_a_long_one_took_minutes(tmp_path):
    pytest.importorskip("matplotlib")
    # A "$" in a workload name started matplotlib's mathtext: "$\foo{$" raised ValueError. A
    # 100,000-character name took over two minutes to lay out; a non-string "upstream" parameter
    # was a TypeError. Labels are plain text, cut to 60 characters.
    for i, fields in enumerate([{"workload": "$\\foo{$"}, {"workload": "w" * 100_000 + "$"},
                                {"backend": "$\\x$" * 1000}]):
        res = _results_with(tmp_path, **fields)
        t = time.monotonic()
        rc, _, err = _cli("compare", res, "--plot", tmp_path / f"p{i}.png")
        assert rc == 0 and "Traceback" not in err, err
        assert time.monotonic() - t < 60
    doc = json.load(open(RESULTS))
    for r in doc["rows"]:
        r["params"]["upstream"] = 5
    p = tmp_path / "up.json"
    p.write_text(json.dumps(doc))
    rc, _, err = _cli("compare", p, "--plot", tmp_path / "up.png")
    assert rc == 0, err
    rc, _, err = _cli("compare", p, "--plot", tmp_path / "up.xyz")
    assert rc == 1 and "cannot write .xyz" in _one_line(err)


# ---------------------------------------------------------------- bounded reading


def test_regression_a_gzip_bomb_pickle_was_read_whole_into_memory(tmp_path):
    # 6 MB of gzip held a pickle of 6 GiB (bytes whose length is in the header, then zeros): the
    # reader loaded it whole (12.6 GB resident, 69 s) before finding it truncated. Reading stops
    # at max_bytes now (default 1 GiB; replay --max-log-bytes), having made at most that much.
    p = tmp_path / "bomb.pickle.gz"
    with gzip.open(p, "wb") as f:
        f.write(b"\x80\x04\x8e" + struct.pack("<Q", 64 << 20))
        f.write(bytes(16 << 20))
    with pytest.raises(ReplayError, match="max-log-bytes"):
        read_log(str(p), max_bytes=1 << 20)
    rc, _, err = _cli("replay", p, "--no-progress", "--max-log-bytes", "1MiB")
    assert rc == 1 and "more than 1,048,576 bytes once decompressed" in _one_line(err)


def test_regression_a_csv_bomb_line_was_read_whole(tmp_path):
    # One line of commas with no end (a gzip bomb of them) was read into one string.
    p = tmp_path / "bomb.csv.gz"
    with gzip.open(p, "wb") as f:
        f.write(HEADER.encode() + b"," * (8 << 20))
    with pytest.raises(ReplayError, match=r"line 2: line longer than 65,536"):
        read_log(str(p))


def test_a_log_over_the_bound_is_refused_and_the_bound_can_be_raised(tmp_path):
    log = _log(tmp_path / "log.csv", "1,t,allocate,0x10,1024,0x0\n" * 100)
    with pytest.raises(ReplayError, match="more than 1,000 bytes"):
        read_log(log, max_bytes=1000)
    assert len(read_log(log, max_bytes=None).events) == 100
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(InvalidArgumentError):
            read_log(log, max_bytes=bad)
    rc, _, err = _cli("replay", log, "--no-progress", "--sim-latency-us", "0", "--max-log-bytes", "1kb")
    assert rc == 1 and "--max-log-bytes" in _one_line(err)
    rc, _, err = _cli("replay", log, "--no-progress", "--sim-latency-us", "0", "--max-log-bytes", "none")
    assert rc == 0, err
    rc, _, err = _cli("replay", log, "--no-progress", "--max-log-bytes", "-5")
    assert rc == 1 and "positive size" in _one_line(err)


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_regression_a_missing_log_was_called_unreadable_gzip_data(what, tmp_path):
    path = tmp_path / "nope.csv"
    if what == "directory":
        path.mkdir()
    with pytest.raises(ReplayError) as e:
        read_log(str(path))
    assert "gzip" not in str(e.value) and "cannot read the log" in str(e.value)


def test_read_log_takes_no_file_descriptor():
    # read_log(0) would have adopted (and closed) stdin, as open(0) does.
    with pytest.raises(InvalidArgumentError):
        read_log(0)


_ALLOC = {"action": "alloc", "addr": 4096, "size": 256}


@pytest.mark.parametrize("shape", ["one trace list named per device", "one block list named per segment",
                                   "one entry named many times"])
def test_regression_a_small_pickle_naming_one_list_many_times_was_walked_for_hours(shape, tmp_path):
    # A pickle names an object again in two bytes (a memo reference): 300 references to one list
    # of 300 entries are 90,000 entries to walk from ~1 KB. At 40,000 x 40,000 (160 KB) the reader
    # walked for hours; one list of blocks shared by 10,000 segments (40 KB) made 10^8 events
    # (OOM). These small ones went through; now every shape is refused before it is walked.
    if shape == "one trace list named per device":
        snap = {"device_traces": [[{"action": "segment_map", "size": 1}] * 300] * 300}
    elif shape == "one block list named per segment":
        block = {"state": "active_allocated", "address": 1 << 20, "size": 256}
        snap = {"device_traces": [[_ALLOC]], "segments": [{"blocks": [block] * 300, "total_size": 256}] * 300}
    else:
        snap = {"device_traces": [[_ALLOC] * 10_000]}
    p = tmp_path / "shared.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    assert p.stat().st_size < 25_000
    with pytest.raises(ReplayError, match="names the same"):
        read_log(str(p))
    # A snapshot whose entries are objects of their own reads as before.
    fine = {"device_traces": [[dict(_ALLOC, addr=4096 * (i + 1)) for i in range(300)] for _ in range(3)],
            "segments": [{"blocks": [{"state": "active_allocated", "address": (1 << 30) + 256 * i, "size": 256}
                                     for i in range(100)], "total_size": 1 << 20}]}
    p.write_bytes(pickle.dumps(fine, protocol=4))
    trace = read_log(str(p))
    assert len(trace.events) == 300 and len(trace.pre_trace) == 100


@pytest.mark.parametrize("compressed", [False, True])
def test_regression_a_log_read_from_a_pipe_lost_its_first_bytes(compressed, tmp_path):
    # The log was opened three times (the gzip magic, the format, the parse): a pipe
    # (`replay /dev/stdin`, `replay <(zcat log.gz)`) gave its first bytes to the first two opens,
    # and every such log was "unrecognized". It is opened and read once now.
    data = (HEADER + "1,t,allocate,0x10,1024,0x0\n1,t,free,0x10,1024,0x0\n" * 50).encode()
    if compressed:
        data = gzip.compress(data)
    code = ("import sys; from poolkeeper.bench.readers import read_log; "
            "t = read_log('/dev/stdin'); print(len(t.events))")
    r = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, env=_env(), timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == b"100", r.stderr.decode()[-400:]


# ---------------------------------------------------------------- whole or nothing


def _interrupt_mid_write(monkeypatch, exc=KeyboardInterrupt):
    """Every write stops half-way: the first half of the data is written, then ``exc``."""
    import builtins

    from poolkeeper import _paths

    real_open = builtins.open

    class Half:
        def __init__(self, f):
            self._f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self._f.close()

        def write(self, data):
            self._f.write(data[: len(data) // 2])
            self._f.flush()
            raise exc()

        def __getattr__(self, name):
            return getattr(self._f, name)

    def half_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Half(f) if ("w" in mode or "a" in mode) else f

    # The module-level open() of every writer (before the fix, each wrote with open(path, "w")),
    # and the one write_output uses.
    monkeypatch.setattr(builtins, "open", half_open)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
@pytest.mark.parametrize("writer", ["to_json", "to_html", "to_torch", "report", "lab", "results", "compare", "replay"])
def test_regression_an_interrupted_or_failed_write_left_a_half_written_file(writer, exc, tmp_path, monkeypatch, capsys):
    # Every output but the bench results was written in place: a Ctrl-C or a full disk during the
    # write left a truncated page or JSON where the old file was (here: the first half of it). They
    # are written beside the target and renamed over it now: the old file stays whole, no
    # temporary file is left.
    out = tmp_path / "out.file"
    out.write_text("OLD")
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"))
    pool.allocate(1000)
    snap = pool.snapshot()
    snap_path = tmp_path / "in.json"
    snap.to_json(str(snap_path))
    log = _log(tmp_path / "log.csv")
    from poolkeeper.bench import results

    _interrupt_mid_write(monkeypatch, exc)
    run = {
        "to_json": lambda: snap.to_json(str(out)),
        "to_html": lambda: snap.to_html(str(out)),
        "to_torch": lambda: snap.to_torch(str(out)),
        "report": lambda: main(["report", str(snap_path), "-o", str(out)]),
        "lab": lambda: main(["lab", "--write", str(out)]),
        "results": lambda: results.write(str(out), []),
        "compare": lambda: main(["compare", RESULTS, "--json", str(out)]),
        "replay": lambda: main(["replay", log, "--no-progress", "--sim-latency-us", "0", "--json", str(out)]),
    }[writer]
    if writer in ("report", "lab", "compare", "replay"):
        rc = run()
        assert rc == (130 if exc is KeyboardInterrupt else 1)
    else:
        with pytest.raises(exc):
            run()
    assert out.read_text() == "OLD"
    _no_temp_files(tmp_path)


def test_write_output_keeps_a_files_mode_and_writes_through_a_link(tmp_path):
    from poolkeeper._paths import write_output

    target = tmp_path / "t.json"
    target.write_text("old")
    os.chmod(target, 0o600)
    link = tmp_path / "l.json"
    link.symlink_to(target)
    write_output(str(link), "new")
    assert os.path.islink(link) and target.read_text() == "new"
    assert (os.stat(target).st_mode & 0o777) == 0o600
    fresh = tmp_path / "fresh.json"
    old = os.umask(0o022)
    try:
        write_output(str(fresh), b"x")
    finally:
        os.umask(old)
    assert (os.stat(fresh).st_mode & 0o777) == 0o644  # as open() makes it, not mkstemp's 0600
    # A loop of links is refused as open() refuses it (renaming would have replaced the link).
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(OSError):
        write_output(str(tmp_path / "a"), b"x")
    assert os.path.islink(tmp_path / "a")
    # A name at the file system's limit still has room for its temporary.
    long = tmp_path / ("n" * 250)
    write_output(str(long), b"x")
    assert long.read_bytes() == b"x"
    # An error names the path asked for, not the temporary.
    with pytest.raises(FileNotFoundError) as e:
        write_output(str(tmp_path / "no" / "such.json"), b"x")
    assert e.value.filename == str(tmp_path / "no" / "such.json")
    _no_temp_files(tmp_path)


def test_regression_an_output_was_renamed_into_place_before_its_data_reached_the_disk(tmp_path, monkeypatch):
    # write_output renamed the temporary over the target without an fsync: a file system may put
    # the rename on the disk before the data, and a power cut then left an empty file under the
    # target's name. The temporary is synced before the rename, the folder after it; a file
    # system that cannot sync (EINVAL) still gets the file, and devices and pipes get no fsync.
    from poolkeeper import _paths

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.stat(a).st_ino))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "out.json"
    out.write_text("OLD")
    _paths.write_output(str(out), "NEW")
    assert out.read_text() == "NEW"
    ino = os.stat(out).st_ino
    assert events == [("fsync", "file", ino), ("replace", ino), ("fsync", "dir", os.stat(tmp_path).st_ino)]

    events.clear()
    _paths.write_output(os.devnull, "x")
    r, w = os.pipe()
    try:
        _paths.write_output(f"/dev/fd/{w}", "through a pipe")
        assert os.read(r, 100) == b"through a pipe"
    finally:
        os.close(r)
        os.close(w)
    assert events == []

    def cannot_sync(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", cannot_sync)
    _paths.write_output(str(out), "AGAIN")
    assert out.read_text() == "AGAIN"

    def io_error(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", io_error)
    with pytest.raises(OSError) as e:
        _paths.write_output(str(out), "LOST")
    assert e.value.errno == errno.EIO and e.value.filename == str(out)
    assert out.read_text() == "AGAIN"
    _no_temp_files(tmp_path)


def test_regression_the_bench_json_probe_deleted_an_existing_path_tmp(tmp_path):
    # check_writable probed PATH.tmp by creating and then removing it: a user's own PATH.tmp was deleted.
    from poolkeeper.bench import results

    mine = tmp_path / "rows.json.tmp"
    mine.write_text("mine")
    results.check_writable(str(tmp_path / "rows.json"))
    assert mine.read_text() == "mine"


def test_regression_ctrl_c_in_the_cli_printed_a_traceback(tmp_path):
    # A KeyboardInterrupt escaped main(): a traceback, exit status -2. One line and 130 now, and
    # the --json output is not written at all.
    log = _log(tmp_path / "log.csv", "".join(f"1,t,allocate,{0x1000 * (i + 1):x},4096,0x0\n" for i in range(20000)))
    out = tmp_path / "out.json"
    p = subprocess.Popen([sys.executable, "-m", "poolkeeper.cli", "replay", log, "--no-progress", "--pool", "direct",
                          "--sim-latency-us", "500", "--json", str(out)], env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert _one_line(err) == "poolkeeper replay: interrupted"
    assert not out.exists()
    _no_temp_files(tmp_path)


# ---------------------------------------------------------------- snapshots and the memory map


def test_regression_from_json_of_a_file_that_is_not_utf8_was_a_bare_unicode_error(tmp_path):
    p = tmp_path / "bin.json"
    p.write_bytes(b"\xff\xfe{}")
    with pytest.raises(InvariantError, match="not UTF-8"):
        Snapshot.from_json(str(p))
    # A byte-order mark is not an error (editors on Windows write one).
    good = _snapshot_file(tmp_path / "bom.json")
    with open(good, "rb") as f:
        data = f.read()
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + data)
    assert Snapshot.from_json(str(tmp_path / "bom.json")).pool == "ArenaPool"
    rc, _, err = _cli("report", tmp_path / "bom.json", "-o", tmp_path / "bom.html")
    assert rc == 0, err


def test_regression_to_html_with_a_lone_surrogate_left_an_empty_file(tmp_path):
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"))
    snap = pool.snapshot()
    snap.pool = "pool \ud800"
    out = tmp_path / "map.html"
    snap.to_html(str(out))
    assert "pool \\ud800" in out.read_text()


def _hand_made():
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"))
    pool.allocate(1000)
    return pool.snapshot()


def _set(attr, value):
    def change(s):
        obj, name = (s, attr) if "." not in attr else (s.backings[0], attr.split(".", 1)[1])
        if name.startswith("chunks."):
            obj, name = obj.chunks[0], name.split(".", 1)[1]
        setattr(obj, name, value)
        return s
    return change


@pytest.mark.parametrize("change", [
    _set("alignment", float("nan")), _set("version", float("inf")), _set("version", 10**100), _set("stats", None),
    _set("backings", [1]), _set("b.chunks", [1]), _set("b.resident", "no"), _set("b.chunks.state", 5),
    _set("b.chunks.offset", "0"),
], ids=["nan alignment", "inf version", "huge version", "stats None", "backing not a Backing",
        "chunk not a Chunk", "resident a string", "state an int", "offset a string"])
def test_regression_render_html_of_a_hand_changed_snapshot_raised_bare_errors(change):
    with pytest.raises(InvariantError):
        render_html(change(_hand_made()))


@pytest.mark.parametrize("value", [None, [1], 5, "snap.json"])
def test_render_html_of_what_is_not_a_snapshot_is_invalid_argument(value):
    with pytest.raises(InvalidArgumentError):
        render_html(value)


def test_to_json_of_a_value_json_cannot_hold_is_an_invariant_error(tmp_path):
    snap = _hand_made()
    snap.stats["x"] = object()
    with pytest.raises(InvariantError, match="cannot be written as JSON"):
        snap.to_json(str(tmp_path / "s.json"))
    assert not (tmp_path / "s.json").exists()


def test_regression_a_duplicate_key_was_taken_silently(tmp_path):
    # {"pool": "A", "pool": "B"} read as "B" without a word (JSON keeps the last): a snapshot or
    # results file holding a key twice was edited or spliced, and is refused now.
    good = _snapshot_file(tmp_path / "s.json")
    text = open(good).read().replace('"pool": "ArenaPool"', '"pool": "ArenaPool", "pool": "Other"', 1)
    dup = tmp_path / "dup.json"
    dup.write_text(text)
    with pytest.raises(InvariantError, match="'pool' twice"):
        Snapshot.from_json(str(dup))
    rc, _, err = _cli("report", dup, "-o", tmp_path / "m.html")
    assert rc == 1 and "'pool' twice" in _one_line(err)
    rows = open(RESULTS).read().replace('"arm": "arena"', '"arm": "arena", "arm": "direct"', 1)
    res = tmp_path / "rows.json"
    res.write_text(rows)
    from poolkeeper.bench import results

    with pytest.raises(ResultsError, match="'arm' twice"):
        results.load([str(res)])


@pytest.mark.parametrize("value", ["no", 1, None])
def test_regression_a_resident_flag_that_is_not_a_boolean_was_read_as_true(value, tmp_path):
    d = _hand_made().to_dict()
    d["backings"][0]["resident"] = value
    with pytest.raises(InvariantError, match="true or false"):
        Snapshot.from_dict(d)


def test_regression_a_non_finite_float_parameter_reached_the_compare_json(tmp_path):
    doc = json.load(open(RESULTS))
    doc["rows"][0]["params"]["x"] = float("nan")
    p = tmp_path / "rows.json"
    p.write_text(json.dumps(doc))
    from poolkeeper.bench import results

    with pytest.raises(ResultsError, match="params"):
        results.load([str(p)])


def test_python_dash_m_poolkeeper_runs_the_command():
    r = subprocess.run([sys.executable, "-m", "poolkeeper", "--help"], capture_output=True, text=True, env=_env(),
                       timeout=60)
    assert r.returncode == 0 and "report" in r.stdout, r.stderr


def test_every_error_here_is_a_poolkeeper_error():
    # The API's promise: what these readers refuse is a PoolkeeperError (ReplayError, ResultsError
    # and InvariantError all are).
    for cls in (ReplayError, ResultsError, InvariantError, InvalidArgumentError):
        assert issubclass(cls, PoolkeeperError)


@pytest.mark.skipif(sys.platform != "linux", reason="file names of any bytes: a Linux file system")
def test_regression_a_file_name_that_is_not_utf8_was_a_traceback_after_the_write(tmp_path):
    # Such a name reaches Python as lone surrogates; with a strict UTF-8 stdout (a UTF-8 locale)
    # "wrote <name>" and the replay's heading raised UnicodeEncodeError once the work was done.
    folder = os.fsencode(str(tmp_path))
    snap = _snapshot_file(tmp_path / "s.json")
    log = _log(tmp_path / "l.csv")
    bad_snap = os.fsdecode(folder + b"/\xff.json")
    bad_log = os.fsdecode(folder + b"/\xfe.csv")
    os.rename(snap, bad_snap)
    os.rename(log, bad_log)
    env = dict(_env(), PYTHONIOENCODING="utf-8:strict")
    for argv in (["report", bad_snap], ["replay", bad_log, "--no-progress", "--sim-latency-us", "0"],
                 ["lab", "--write", os.fsdecode(folder + b"/\xfd.html")]):
        r = subprocess.run([sys.executable, "-m", "poolkeeper.cli", *argv], capture_output=True, env=env, timeout=120)
        assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
        assert b"\\udc" in r.stdout  # the name, escaped


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_regression_an_endless_json_source_was_read_until_memory_ran_out(monkeypatch, capsys):
    # `poolkeeper report /dev/zero` (and compare, Snapshot.from_json) read until memory ran out:
    # a MemoryError traceback under a 4 GB ulimit, the OOM killer without one. JSON files are read
    # up to poolkeeper._json.MAX_JSON_BYTES (1 GiB; lowered here so the test is quick).
    from poolkeeper import _json
    from poolkeeper.bench import results

    monkeypatch.setattr(_json, "MAX_JSON_BYTES", 1 << 16)
    assert main(["report", "/dev/zero", "-o", os.devnull]) == 1
    assert "more than 65,536 bytes" in _one_line(capsys.readouterr().err)
    with pytest.raises(ResultsError, match="more than 65,536 bytes"):
        results.load(["/dev/zero"])
    with pytest.raises(InvariantError, match="more than 65,536 bytes"):
        Snapshot.from_json("/dev/zero")
