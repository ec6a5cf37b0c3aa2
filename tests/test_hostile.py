"""The hostile-input suite: every public entry point fed generated bad values.

Entry points: constructors (upstreams, pools, staging pool, uploader), pool / upstream / buffer
/ staging operations, stream objects, the C ABI (through ctypes), and the CLI's inputs (replay and
report files, compare results, bench and lab arguments).

Each case runs in a subprocess worker (tests/hostile_worker.py) with a timeout, so a crash or a
hang is a test failure naming the case, not a dead or stalled test run. One worker serves many
cases; it is restarted after a death. Values come from hypothesis, derandomized, with few
examples per entry point so the file stays under a minute on 2 cores.

What passes: no error, or a :class:`poolkeeper.errors.PoolkeeperError` (for the CLI: exit code
0, 1 or 2 and no traceback). A plain ``TypeError`` passes only where a value of the wrong Python
type meets a constructor argument (nanobind's own check, documented in docs/hardening.md).
Inputs known to crash or misbehave until another part of issue 16 lands are separate cases,
each marked ``xfail(strict=False)`` with the item's number, so they can be flipped after merging.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

WORKER = Path(__file__).with_name("hostile_worker.py")
CASE_TIMEOUT_S = 20.0
EXAMPLES = int(os.environ.get("POOLKEEPER_HOSTILE_EXAMPLES", "25"))

SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


class Worker:
    """A long-lived worker process; :meth:`run` sends one case and waits for its outcome."""

    def __init__(self) -> None:
        self.proc = None
        self.lines: "queue.Queue" = queue.Queue()
        self.n = 0

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()

    @staticmethod
    def _read(proc, lines) -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, target: str, args: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.n += 1
        case = {"id": self.n, "target": target, "args": args}
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        started = None
        while True:
            try:
                line = self.lines.get(timeout=CASE_TIMEOUT_S)
            except queue.Empty:
                self.stop()
                pytest.fail(f"hang: no answer within {CASE_TIMEOUT_S:.0f} s; last case started: "
                            f"{target} {json.dumps(args)[:600]}")
            if line is None:
                rc = self.proc.wait()
                err = self.proc.stderr.read()[-1500:]
                self.proc = None
                pytest.fail(f"crash: the worker died (exit {rc}) in case {target} {json.dumps(args)[:600]} "
                            f"(started: {started is not None})\n{err}")
            msg = json.loads(line)
            if "started" in msg:
                started = msg["started"]
                continue
            return msg["outcome"]


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.stop()
    if tolerated_seen:  # shown with -s: what still waits for the C++ side of issue 16
        print(f"\nhostile suite: {len(tolerated_seen)} tolerated outcomes:",
              *sorted({item for item, _, _ in tolerated_seen}), sep="\n  ")


# The hostile objects' own exceptions (raised by their __index__ / __cuda_stream__): they
# propagate unchanged, as from any Python callback.
OWN_ERRORS = {"builtins.ValueError": ("bad index", "no stream")}

# Wrong outcomes a generated case may still meet while a known item is open: (exception class,
# message fragment or "", issue item). Each must also have an explicit case in KNOWN_OPEN.
TOLERATED: list = []  # empty since the C++ items of issue 16 landed; kept for the next round
tolerated_seen: list = []
OS_ERRORS = {"FileNotFoundError", "IsADirectoryError", "PermissionError", "NotADirectoryError", "OSError"}


def typed(out: dict, target: str, args: dict, type_error_ok: bool = False) -> None:
    """Fail unless the outcome is success or a typed error (or a TypeError, where allowed)."""
    if out.get("ok") or out.get("typed"):
        return
    if type_error_ok and out.get("type_error"):
        return
    if any(m in out.get("msg", "") for m in OWN_ERRORS.get(out.get("exc"), ())):
        return
    for exc, fragment, item in TOLERATED:
        if out.get("exc") == exc and fragment in out.get("msg", ""):
            tolerated_seen.append((item, target, json.dumps(args)[:200]))
            return
    pytest.fail(f"untyped error {out.get('exc')}: {out.get('msg')}\ncase: {target} {json.dumps(args)[:600]}\n"
                f"{out.get('tb', '')}")


def clean_cli(out: dict, target_args: dict) -> None:
    assert out.get("rc") in (0, 1, 2) and not out.get("traceback"), (out, json.dumps(target_args)[:600])


# -- value specs (decoded by the worker) -----------------------------------------------------------------

def I(v: int) -> list:  # noqa: E743
    return ["int", str(v)]


def F(v: str) -> list:
    return ["float", v]


def O(name: str) -> list:  # noqa: E743
    return ["obj", name]


NONE = ["none"]

huge_ints = st.sampled_from([2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100, -(2**63), -1, 0])
edge_ints = st.one_of(huge_ints, st.integers(-(2**70), 2**70), st.integers(-4, 70_000))
numbers = st.one_of(edge_ints.map(I), st.sampled_from(["nan", "inf", "-inf", "0.5", "-0.0", "1e300"]).map(F))
other_types = st.one_of(
    st.just(NONE),
    st.text(max_size=12).map(lambda s: ["str", s]),
    st.sampled_from(["²", "٣", "1_000", "9" * 5000, "0x10", " 12 ", ""]).map(lambda s: ["str", s]),
    st.binary(max_size=8).map(lambda b: ["bytes", b.hex()]),
    st.booleans().map(lambda b: ["bool", b]),
    st.just(["list", [I(1), I(2)]]),
    st.sampled_from(["object", "dict", "index_huge", "index_neg", "index_value_error", "index_returns_str",
                     "int_subclass"]).map(O),
)
values = st.one_of(numbers, other_types)
# Sizes a pool may see: small ones hit real paths; everything else must be refused cleanly.
sizes = st.one_of(st.integers(1, 70_000).map(I), values)
streams = st.one_of(
    st.just(NONE), st.integers(-3, 2**64 + 3).map(I), st.sampled_from([0, 1, 2**64 - 1, 2**64 - 2]).map(I),
    other_types,
    st.sampled_from(["stream_proto_short", "stream_proto_str", "stream_proto_neg", "stream_proto_huge",
                     "stream_proto_int", "stream_proto_raises", "stream_cuda_stream_str", "stream_cuda_stream_float",
                     "stream_ptr_neg", "stream_ptr_huge", "stream_nested_ok"]).map(O),
)
POOLS = st.sampled_from(["direct", "size_class", "arena"])


def is_wrong_python_type(spec) -> bool:
    """A value a documented ``int`` parameter refuses by type (nanobind raises TypeError)."""
    return not (isinstance(spec, list) and spec[0] == "int")


# -- constructors ---------------------------------------------------------------------------------------------

UPSTREAM_KW = {
    "Host": ["alignment"],
    "Simulated": ["latency", "capacity", "alignment"],  # latency_us is item 11 (see the xfail cases)
    "Faulty": ["fail_every", "fail_at", "fail_bytes_over", "error"],
}


@SETTINGS
@given(data=st.data())
def test_upstream_constructors(worker, data):
    cls = data.draw(st.sampled_from(sorted(UPSTREAM_KW)))
    key = data.draw(st.sampled_from(UPSTREAM_KW[cls]))
    v = data.draw(values)
    if cls == "Simulated":  # a huge *valid* latency would make the calls busy-wait for days (item 3)
        kw = {"latency_us": F("0"), "latency": NONE} if key != "latency" else {}
        kw[key] = v
    else:
        kw = {key: v}
    args = {"cls": cls, "kwargs": kw}
    out = worker.run("upstream_ctor", args)
    typed(out, "upstream_ctor", args, type_error_ok=is_wrong_python_type(v))


POOL_KW = {
    "direct": ["alignment", "limit", "bogus_option"],
    "size_class": ["alignment", "limit", "classes_per_doubling", "max_cached_bytes"],
    "arena": ["alignment", "limit", "initial_backing", "max_backing", "growth_factor", "thread_cache_bytes",
              "thread_cache_max_block", "shrink_hysteresis", "shrink_interval", "oversize_threshold"],
}


@SETTINGS
@given(data=st.data())
def test_pool_constructors(worker, data):
    kind = data.draw(POOLS)
    kw = {k: data.draw(values) for k in data.draw(st.lists(st.sampled_from(POOL_KW[kind]), min_size=1, max_size=3,
                                                           unique=True))}
    args = {"kind": kind, "up": data.draw(st.sampled_from(["host", "sim"])), "kwargs": kw}
    out = worker.run("pool_ctor", args)
    typed(out, "pool_ctor", args)


# -- pool, upstream and buffer operations -------------------------------------------------------------------------

@SETTINGS
@given(data=st.data())
def test_pool_operations(worker, data):
    kind = data.draw(POOLS)
    op = data.draw(st.sampled_from(["allocate", "deallocate", "owns", "record_stream", "deallocate_rel",
                                    "record_stream_rel"]))
    rel = op.endswith("_rel")
    op = op.removesuffix("_rel")
    if op == "allocate":
        a = [data.draw(sizes)]
        kw = {"stream": data.draw(streams)} if data.draw(st.booleans()) else {}
    elif rel:  # near the held block: interior, one past the end, just before it
        a = [I(data.draw(st.sampled_from([0, 1, 255, 256, 4095, 4096, -1, -256, 1 << 20])))]
        kw = {}
        if op == "record_stream":
            a.append(data.draw(streams))
        elif data.draw(st.booleans()):
            kw = {"stream": data.draw(streams)}
    else:
        a = [data.draw(values)]
        kw = {}
        if op == "record_stream":
            a.append(data.draw(streams))
    args = {"kind": kind, "up": "host", "op": op, "args": a, "kwargs": kw, "rel": rel}
    if op == "deallocate" and rel and a[0] == I(0):
        return  # a valid free: not hostile
    out = worker.run("pool_op", args)
    typed(out, "pool_op", args)


@SETTINGS
@given(op=st.sampled_from(["allocate", "enqueue", "advance", "record_event", "query_event", "wait_event",
                            "release_event", "reserve"]), data=st.data())
def test_simulated_upstream_operations(worker, op, data):
    if op == "allocate":
        a = [data.draw(st.one_of(st.integers(1, 1 << 20).map(I), other_types, huge_ints.map(I)))]
    elif op == "enqueue":
        a = [data.draw(streams), data.draw(st.one_of(st.integers(0, 10).map(I), other_types))]
    elif op == "advance":
        a = [data.draw(st.one_of(st.integers(-5, 10).map(I), other_types))]
    elif op == "reserve":
        a = [data.draw(st.one_of(st.integers(1, 1 << 30).map(I), other_types, huge_ints.map(I)))]
    else:
        a = [data.draw(st.one_of(edge_ints.map(I), other_types))]
    args = {"op": op, "args": a}
    typed(worker.run("sim_op", args), "sim_op", args, type_error_ok=any(is_wrong_python_type(x) for x in a))


@SETTINGS
@given(size=st.one_of(st.integers(1, 1 << 20).map(I), other_types, huge_ints.map(I)))
def test_host_upstream_allocate(worker, size):
    args = {"op": "allocate", "args": [size]}
    typed(worker.run("host_upstream_op", args), "host_upstream_op", args)


@SETTINGS
@given(nbytes=sizes, stream=streams)
def test_pool_buffers(worker, nbytes, stream):
    args = {"nbytes": nbytes, "stream": stream}
    typed(worker.run("buffer", args), "buffer", args)


# -- stream objects ---------------------------------------------------------------------------------------------------

@SETTINGS
@given(stream=streams, kind=POOLS)
def test_stream_objects(worker, stream, kind):
    typed(worker.run("as_handle", {"stream": stream}), "as_handle", {"stream": stream})
    args = {"kind": kind, "stream": stream}
    typed(worker.run("stream_arg", args), "stream_arg", args)


# -- staging -------------------------------------------------------------------------------------------------------------

@SETTINGS
@given(data=st.data())
def test_staging(worker, data):
    op = data.draw(st.sampled_from(["pool_ctor", "acquire", "view", "fill", "copy", "retire"]))
    args: dict = {"op": op}
    if op == "pool_ctor":
        args["kwargs"] = {k: data.draw(values) for k in data.draw(st.lists(
            st.sampled_from(["max_buffers", "max_bytes", "granularity"]), min_size=1, max_size=2, unique=True))}
    elif op == "acquire":
        args["nbytes"] = data.draw(st.one_of(values, huge_ints.map(I)))
    elif op == "view":
        args["args"] = [data.draw(values), data.draw(values)]
    elif op == "fill":
        args["args"] = [data.draw(st.one_of(other_types, st.binary(max_size=20000).map(lambda b: ["bytes", b.hex()]))),
                        data.draw(values)]
    elif op == "copy":
        args.update(dst=data.draw(st.one_of(st.just("buffer"), values)), nbytes=data.draw(values),
                    stream=data.draw(st.one_of(st.just(NONE), streams)))
    else:
        args["witness"] = data.draw(values)
    typed(worker.run("staging", args), "staging", args)


@SETTINGS
@given(data=st.data())
def test_uploader(worker, data):
    if data.draw(st.booleans()):
        args = {"op": "ctor", "kwargs": {k: data.draw(values) for k in data.draw(st.lists(
            st.sampled_from(["chunk_bytes", "workers", "depth", "engine", "stream"]), min_size=1, max_size=2,
            unique=True))}}
    else:
        args = {"op": "upload", "engine": data.draw(st.sampled_from(["auto", "python"])),
                "src": data.draw(st.one_of(st.just("file"), other_types, st.binary(max_size=300).map(
                    lambda b: ["bytes", b.hex()]))),
                "dst": data.draw(st.one_of(st.just("buffer"), values)),
                "nbytes": data.draw(st.one_of(st.just(NONE), values))}
    out = worker.run("uploader", args)
    if args.get("src", [None])[0] == "str" and out.get("exc", "").split(".")[-1] in OS_ERRORS:
        return  # a path that cannot be opened: the OSError of open(), as documented
    typed(out, "uploader", args)


# -- the C ABI ----------------------------------------------------------------------------------------------------------------

@SETTINGS
@given(fn=st.sampled_from(["malloc_free", "free", "torch", "torch_free_unknown", "record_stream", "empty_cache"]),
       a=st.one_of(huge_ints, st.integers(0, 1 << 22)), device=st.integers(-3, 8),
       s=st.one_of(st.sampled_from([0, 1, 2**64 - 1]), st.integers(0, 2**64 - 1)))
def test_c_abi(worker, fn, a, device, s):
    if fn in ("free", "torch_free_unknown", "record_stream"):
        a = a | 1  # never a block's address (those are aligned): an unknown pointer
    args = {"fn": fn, "args": [str(a), str(device), str(s)]}
    typed(worker.run("capi", args), "capi", args)


# -- CLI inputs ------------------------------------------------------------------------------------------------------------------

csv_field = st.one_of(st.text(max_size=10), st.sampled_from(["9" * 5000, "²", "0x" + "f" * 40, "-1", "0x1000", "4096",
                                                             "(nil)", "allocate", "free", "18446744073709551616"]))


@SETTINGS
@given(rows=st.lists(st.lists(csv_field, min_size=4, max_size=7), max_size=4),
       header=st.sampled_from(["Thread,Time,Action,Pointer,Size,Stream", "Thread,Action", ""]))
def test_cli_replay_rmm_csv(worker, rows, header):
    text = header + "\n" + "\n".join(",".join(r) for r in rows) + "\n"
    args = {"argv": ["replay", "log.csv", "--pool", "direct", "--sim-latency-us", "0"],
            "files": {"log.csv": ["text", text]}}
    clean_cli(worker.run("cli", args), args)


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                      st.text(max_size=6))
json_values = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=3),
                                                          st.dictionaries(st.text(max_size=6), c, max_size=3)),
                           max_leaves=12)


def _snapshot_like(d: dict) -> dict:
    base = {"pool": "ArenaPool", "upstream": "Host", "alignment": 256, "version": 1,
            "stats": {"reserved_bytes": 4096, "live_bytes": 0, "free_bytes": 4096, "pending_bytes": 0},
            "backings": [{"address": 1 << 20, "size": 4096, "chunks": [{"offset": 0, "size": 4096, "state": "free"}]}]}
    base.update(d)
    return base


@SETTINGS
@given(over=st.dictionaries(st.sampled_from(["pool", "alignment", "stats", "backings", "version"]), json_values,
                            max_size=2),
       raw=st.sampled_from(["", "[" * 5000, '{"alignment": ' + "7" * 5000 + "}", "\ufeff{}", "null"]))
def test_cli_report(worker, over, raw):
    text = raw or json.dumps(_snapshot_like(over))
    args = {"argv": ["report", "snap.json", "-o", os.devnull], "files": {"snap.json": ["text", text]}}
    clean_cli(worker.run("cli", args), args)


ROW = {"arm": "arena", "workload": "w", "params": {"n": 1}, "backend": "simulated", "scale": "quick", "ops": 10,
       "p50_ns": 1.0, "p90_ns": 2.0, "p99_ns": 3.0, "max_ns": 4.0, "ops_per_s": 5.0, "upstream_allocations": 1,
       "upstream_deallocations": 1, "peak_reserved_bytes": 4096, "peak_live_bytes": 4096, "machine": {},
       "stream_ordered": False}


@SETTINGS
@given(over=st.dictionaries(st.sampled_from(sorted(ROW)), json_values, max_size=3),
       schema=st.sampled_from([1, 1, "1", None, 2**80]))
def test_cli_compare(worker, over, schema):
    other = {**ROW, "arm": "direct", **over}
    doc = {"format": "poolkeeper-bench", "schema": schema, "rows": [ROW, other]}
    args = {"argv": ["compare", "r.json"], "files": {"r.json": ["text", json.dumps(doc)]}}
    clean_cli(worker.run("cli", args), args)


bench_arg = st.one_of(st.text(max_size=8), st.sampled_from(["0", "-1", "1,2", "9" * 5000, "nan", "arena.max_backing=x",
                                                            "arena=1", "size_class.limit=-5", "direct.bogus=1"]))


@SETTINGS
@given(flag=st.sampled_from(["--threads", "--arms", "--workloads", "-o", "--seed", "--rounds", "--backend", "--json",
                             "--sim-latency-us"]), value=bench_arg)
def test_cli_bench_arguments(worker, flag, value):
    if flag == "--json":
        value = os.path.join("/nonexistent-dir-for-poolkeeper", value or "x")
    args = {"argv": ["bench", "--quick", "--backend", "simulated", "--no-progress", "--arms", "direct",
                     "--workloads", "kv_cache", flag, value], "stub_bench": True}
    if flag == "--backend":
        args["argv"] = args["argv"][:3] + args["argv"][4:]
    clean_cli(worker.run("cli", args), args)


@SETTINGS
@given(flag=st.sampled_from(["--timeout", "--port"]), value=st.one_of(
    st.sampled_from(["inf", "-inf", "nan", "0", "-1", "1e400", "65536", "99999999999999999999", "x"]),
    st.text(max_size=6)))
def test_cli_lab_arguments(worker, flag, value):
    args = {"argv": ["lab", flag, value, "--once", "--timeout", "0.01"] if flag == "--port" else ["lab", flag, value]}
    if flag == "--timeout":
        try:
            t = float(value)
        except ValueError:
            t = None
        if t is not None and 0 < t < 1e9 and t == t:
            args["argv"] += ["--once"]  # a sane timeout would serve: one request at most, then stop
    clean_cli(worker.run("cli", args), args)


# -- inputs that crashed, hung or got untyped errors before issue 16's C++ fixes (regressions) -----------------

KNOWN_OPEN = [
    pytest.param("stream_arg", {"kind": "arena", "stream": O("stream_self_cuda_stream")}, "typed",  # was open: issue 16 item 1: C++ stream parser recurses
                 id="item1-self-cuda_stream"),
    pytest.param("stream_arg", {"kind": "size_class", "stream": O("stream_self_ptr")}, "typed",  # was open: issue 16 item 1: C++ stream parser recurses
                 id="item1-self-ptr"),
    pytest.param("stream_arg", {"kind": "direct", "stream": O("stream_self_proto")}, "typed",  # was open: issue 16 item 1: C++ stream parser recurses
                 id="item1-self-proto"),
    pytest.param("stream_arg", {"kind": "arena", "stream": O("stream_proto_none")}, "typed",  # was open: issue 16 item 11: (v, None) taken as no stream
                 id="item11-proto-none"),
    pytest.param("pool_op", {"kind": "arena", "op": "allocate", "args": [O("index_ki")]}, "keyboard_interrupt",  # was open: issue 16 item 11: KeyboardInterrupt in __index__ swallowed
                 id="item11-index-ki"),
    pytest.param("pool_op", {"kind": "size_class", "op": "allocate", "args": [I(2**63 + 5)]}, "absurd",  # was open: issue 16 item 11: sizes in [2^63, 2^64) say 'must be positive'
                 id="item11-size-2^63"),
    pytest.param("upstream_ctor", {"cls": "Simulated", "kwargs": {"latency_us": ["str", "1"]}}, "typed",  # was open: issue 16 item 11: std::bad_cast
                 id="item11-latency-str"),
    pytest.param("upstream_ctor", {"cls": "Simulated", "kwargs": {"latency_us": F("inf")}}, "typed",  # was open: issue 16 item 11: an infinite latency is accepted
                 id="item11-latency-inf"),
    pytest.param("upstream_ctor", {"cls": "Host", "kwargs": {"alignment": I(-1)}}, "typed",  # was open: issue 16 item 11: nanobind TypeError
                 id="item11-host-alignment-neg"),
    pytest.param("upstream_ctor", {"cls": "Faulty", "kwargs": {"inner": NONE}}, "typed",  # was open: issue 16 item 11: nanobind TypeError
                 id="item11-faulty-none"),
    pytest.param("pool_ctor", {"kind": "size_class", "up": "sim", "kwargs": {"alignment": I(2**62)}}, "typed",  # was open: issue 16 item 11: std::bad_alloc
                 id="item11-size-class-alignment"),
    pytest.param("sim_op", {"op": "advance", "args": [F("nan")]}, "typed",  # was open: issue 16 item 11: advance(nan) accepted
                 id="item11-advance-nan"),
    pytest.param("host_upstream_op", {"op": "deallocate", "args": [I(1 << 40), I(4096)]}, "typed",  # was open: issue 16 item 10: Host frees unknown pointers (glibc abort)
                 id="item10-host-unknown-free"),
    pytest.param("host_upstream_op", {"op": "deallocate", "args": [I(0), I(1 << 30)], "rel": True}, "typed",  # was open: issue 16 item 10: a wrong size wraps outstanding_bytes
                 id="item10-host-wrong-size"),
    pytest.param("uninit", {"how": "subclass"}, "type_error",  # was open: issue 16 item 2: uninitialized pool subclass segfaults
                 id="item2-uninit-subclass"),
    pytest.param("uninit", {"how": "new"}, "type_error",  # was open: issue 16 item 2: Direct.__new__ then deallocate segfaults
                 id="item2-uninit-new"),
    pytest.param("slow_sim", {}, "typed",  # was open: issue 16 item 3: latency paid before the capacity check
                 id="item3-simulated-2^61"),
]


@pytest.mark.parametrize("target, args, expect", KNOWN_OPEN)
def test_known_open_inputs(worker, target, args, expect):
    if target in ("uninit", "slow_sim"):
        out = _isolated(target, args)
    else:
        out = worker.run(target, args)
    if expect == "typed":  # must be refused with a poolkeeper error: no success, nothing tolerated
        assert out.get("typed"), out
    elif expect == "keyboard_interrupt":
        assert out.get("exc") == "builtins.KeyboardInterrupt", out
    elif expect == "absurd":
        assert out.get("typed") and "absurd" in out.get("msg", ""), out
    elif expect == "type_error":
        assert out.get("type_error"), out


_ISOLATED = {
    "uninit": {
        "subclass": "class P(pk.ArenaPool):\n    def __init__(self): pass\nP().allocate(10)",
        "new": "pk.Direct.__new__(pk.Direct).deallocate(1)",
    },
    "slow_sim": "pk.Direct(pk.upstream.Simulated()).allocate(2**61)",
}


def _isolated(target: str, args: dict) -> dict:
    """Cases that kill or stall the interpreter get a process of their own and a short timeout."""
    code = _ISOLATED[target] if target == "slow_sim" else _ISOLATED[target][args["how"]]
    prog = ("import json, poolkeeper as pk\ntry:\n" + "".join(f"    {line}\n" for line in code.splitlines())
            + "    print(json.dumps({'ok': True}))\nexcept BaseException as e:\n"
            "    print(json.dumps({'exc': type(e).__module__ + '.' + type(e).__qualname__, "
            "'typed': isinstance(e, pk.PoolkeeperError), 'type_error': isinstance(e, TypeError), 'msg': str(e)}))\n")
    try:
        r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hang: {code!r}")
    if r.returncode != 0:
        pytest.fail(f"crash (exit {r.returncode}): {code!r}")
    return json.loads(r.stdout.strip().splitlines()[-1])
