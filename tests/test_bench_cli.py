"""``poolkeeper bench`` end to end through the command's main(argv), on tiny subsets."""
from __future__ import annotations

import json

import pytest

from poolkeeper.bench.arms import arena_available
from poolkeeper.cli import main

FAST = ["--backend", "simulated", "--sim-latency-us", "0", "--no-progress", "--quick"]


def test_bench_quick_subset_writes_rows_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = main(["bench", *FAST, "--arms", "direct,size_class", "--workloads", "kv_cache,random_lifetime",
               "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "poolkeeper-bench"
    assert [(r["workload"], r["arm"]) for r in doc["rows"]] == [
        ("kv_cache", "direct"), ("kv_cache", "size_class"),
        ("random_lifetime", "direct"), ("random_lifetime", "size_class")]
    assert {r["scale"] for r in doc["rows"]} == {"quick"}
    text = capsys.readouterr().out
    assert "poolkeeper bench" in text and "backend simulated" in text and "scale quick" in text
    assert "kv_cache upstream allocations: direct" in text
    assert "PyTorch on the H200: 1.16×" in text
    assert f"poolkeeper compare {out}" in text


def test_bench_then_compare_round_trip(tmp_path, capsys):
    if not arena_available():
        pytest.skip("ArenaPool not built yet")
    out = tmp_path / "rows.json"
    assert main(["bench", *FAST, "--workloads", "kv_cache", "-o", "arena.max_backing=16MiB", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    arena = [r for r in rows if r["arm"] == "arena"][0]
    assert arena["config"]["max_backing"] == 16 << 20
    assert main(["compare", str(out)]) == 0
    assert "size_class vs arena" in capsys.readouterr().out


def test_bench_threads_option(tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", *FAST, "--arms", "size_class", "--workloads", "threads", "--threads", "2,4",
                 "--json", str(out)]) == 0
    assert [r["params"]["threads"] for r in json.loads(out.read_text())["rows"]] == [2, 4]


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    text = capsys.readouterr().out
    for name in ("hit_pair", "straddle", "large_recycle", "growth", "trim", "threads", "inference",
                 "inference_mt", "kv_cache", "random_lifetime", "cuda_async†"):
        assert name in text


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "nope"], "unknown workload"),
    (["--arms", "cuda_async"], "needs the cuda backend"),
    (["--threads", "0"], "--threads"),
    (["-o", "arena=1"], "ARM.KEY=VALUE"),
])
def test_bench_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["bench", *FAST, *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_arena_vs_pool_needs_or_runs_the_arena(tmp_path, capsys):
    out = tmp_path / "avp.json"
    rc = main(["bench", *FAST, "--arena-vs-pool", "--rounds", "1", "--json", str(out)])
    if not arena_available():
        assert rc == 1 and "needs ArenaPool" in capsys.readouterr().err
        return
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["params"]["upstream"] for r in rows} == {"instant", "h200"}
    assert "arena_vs_pool" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "{snap}/x.json"],
        ["report", "-o", "{snap}/x.html", "{snap}"],
        ["compare", "{snap}/x"],
        ["lab", "--write", "{snap}/x.html"],
        ["report", "-o", "/dev/full", "{snap}"],
        ["lab", "--write", "/dev/full"],
    ],
    ids=["report-input-under-a-file", "report-output-under-a-file", "compare-under-a-file", "lab-under-a-file",
         "report-disk-full", "lab-disk-full"],
)
def test_regression_an_os_error_other_than_a_missing_file_was_a_traceback(argv, tmp_path, capsys):
    # Found by hostile probing: main() caught only FileNotFoundError, IsADirectoryError and
    # PermissionError, so a path under a regular file (NotADirectoryError) or a full disk
    # (ENOSPC, /dev/full) ended in a traceback. Every OSError is one line and exit code 1 now.
    import os

    import poolkeeper as pk

    if "/dev/full" in argv and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"))
    pool.allocate(100)
    snap = tmp_path / "snap.json"
    pool.snapshot().to_json(str(snap))
    assert main([a.replace("{snap}", str(snap)) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("poolkeeper ") and len(err.strip().splitlines()) == 1, err


def test_regression_a_lone_surrogate_in_a_snapshot_left_an_empty_report_and_a_traceback(tmp_path, capsys):
    # Found by hostile probing: "\ud800" is valid JSON; the page could not be encoded as UTF-8 at
    # its write, after the output file was opened: UnicodeEncodeError and an empty HTML file.
    import poolkeeper as pk

    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"))
    pool.allocate(100)
    snap = tmp_path / "snap.json"
    pool.snapshot().to_json(str(snap))
    d = json.loads(snap.read_text())
    d["pool"] = "\ud800"
    snap.write_text(json.dumps(d))
    out = tmp_path / "map.html"
    assert main(["report", "-o", str(out), str(snap)]) == 0
    assert out.stat().st_size > 0 and "\\ud800" in out.read_text(encoding="utf-8")


def _special_file(path, kind):
    """A FIFO, or a character device (1, 3: what /dev/null is) where we may make one; never in /dev."""
    import os
    import stat

    if kind == "fifo":
        os.mkfifo(path)
    else:
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except OSError:
            pytest.skip("cannot make a device node here (not root)")
    return os.stat(path).st_mode


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
@pytest.mark.parametrize("command", ["bench", "compare", "replay", "report", "lab"])
def test_regression_an_output_path_naming_a_device_or_fifo_was_replaced(command, kind, tmp_path):
    # Found by hostile probing: `bench --json PATH` wrote PATH.tmp and os.replace()d it onto PATH,
    # so a device node (run as root, `--json /dev/null` destroyed /dev/null) or a FIFO became a
    # regular file. A character device or FIFO is written straight now, as a shell redirection
    # writes it (`--json /dev/stdout`, a pipe): it stays what it was, and a reader gets the output.
    # Every writer goes through one check. Subprocess: a writer that never opens the FIFO hangs.
    import os
    import subprocess
    import sys
    import threading

    import poolkeeper as pk

    target = str(tmp_path / "special")
    before = _special_file(target, kind)
    got = []
    if kind == "fifo":   # the reader a pipe has: the writer's open() waits for it
        reader = threading.Thread(target=lambda: got.append(open(target, "rb").read()), daemon=True)
        reader.start()
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"))
    pool.allocate(100)
    snap = tmp_path / "snap.json"
    pool.snapshot().to_json(str(snap))
    rows = tmp_path / "rows.json"
    assert main(["bench", *FAST, "--arms", "direct", "--workloads", "kv_cache", "--json", str(rows)]) == 0
    log = tmp_path / "log.csv"
    log.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.0,allocate,0x10,1024,0x0\n"
                   "1,00:00:00.0,free,0x10,1024,0x0\n")
    argv = {
        "bench": ["bench", *FAST, "--arms", "direct", "--workloads", "kv_cache", "--json", target],
        "compare": ["compare", str(rows), "--json", target],
        "replay": ["replay", str(log), "--no-progress", "--sim-latency-us", "0", "--json", target],
        "report": ["report", "-o", target, str(snap)],
        "lab": ["lab", "--write", target],
    }[command]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-m", "poolkeeper.cli", *argv], capture_output=True, text=True, env=env,
                       timeout=60)
    assert os.stat(target).st_mode == before  # still the device / FIFO it was
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert not list(tmp_path.glob("special*.tmp"))
    if kind == "fifo":
        reader.join(10)
        assert got and len(got[0]) > 100, got   # the whole output went through the pipe


@pytest.mark.parametrize("kind", ["directory", "socket"])
def test_an_output_path_naming_a_directory_or_socket_is_one_line(kind, tmp_path, capsys):
    import os
    import socket

    target = str(tmp_path / "special")
    if kind == "directory":
        os.mkdir(target)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(target)
    assert main(["lab", "--write", target]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and kind in err, err


def test_regression_bench_json_through_a_symlink_replaced_the_link(tmp_path):
    # Found with the device-node finding: os.replace() onto a symlink replaced the link itself with
    # a regular file, leaving its target stale. A symlink is now written through, as open() does:
    # the link stays, its target gets the rows.
    import os

    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert main(["bench", *FAST, "--arms", "direct", "--workloads", "kv_cache", "--json", str(link)]) == 0
    assert os.path.islink(link) and json.loads(target.read_text())["rows"]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("stdout", ["pipe", "file"])
def test_regression_bench_json_to_dev_stdout_failed_on_a_pipe_and_cut_a_files_output(stdout, tmp_path):
    # Found by review of the device-node fix: `--json /dev/stdout` resolved through
    # /proc/self/fd/1 to "pipe:[N]", which has no name, so the atomic write failed ("No such file
    # or directory: .../pipe:[N].tmp"); with stdout redirected to a file it renamed a new file over
    # it, and everything the program had printed (the table) went to the unlinked old one. A path
    # that reaches the process's own output is written through that stream now.
    import os
    import subprocess
    import sys

    if not os.path.exists("/dev/stdout"):
        pytest.skip("no /dev/stdout here")
    argv = [sys.executable, "-m", "poolkeeper.cli", "bench", *FAST, "--arms", "direct", "--workloads", "kv_cache",
            "--json", "/dev/stdout"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if stdout == "pipe":
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        out = r.stdout
    else:
        log = tmp_path / "log.txt"
        log.write_text("PRE-EXISTING LINE\n")
        with open(log, "a") as f:
            r = subprocess.run(argv, stdout=f, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
        out = log.read_text()
        assert out.startswith("PRE-EXISTING LINE\n")
    assert r.returncode == 0, r.stderr
    assert "direct" in out.split('"format"')[0]  # the table printed before the rows
    start = out.index('{\n "format"')
    doc = json.JSONDecoder().raw_decode(out[start:])[0]
    assert doc["rows"]


def test_regression_bench_json_overwrote_and_deleted_the_users_path_tmp(tmp_path):
    # The atomic write used the fixed name PATH.tmp: the writability probe opened and deleted a file
    # of the user's by that name, and the final write overwrote it and renamed it away. The
    # temporary file is a new one under a random name now (O_EXCL), and it is created with the mode
    # open() would give the results file (mkstemp's 0600 would make every results file private).
    import os

    out = tmp_path / "rows.json"
    mine = tmp_path / "rows.json.tmp"
    mine.write_text("the user's own file")
    umask = os.umask(0o022)
    try:
        assert main(["bench", *FAST, "--arms", "direct", "--workloads", "kv_cache", "--json", str(out)]) == 0
    finally:
        os.umask(umask)
    assert mine.read_text() == "the user's own file"
    assert json.loads(out.read_text())["rows"]
    assert os.stat(out).st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json", "rows.json.tmp"]
