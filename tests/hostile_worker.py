"""Subprocess worker of tests/test_hostile.py: runs hostile cases one at a time.

Protocol: one JSON case per line on stdin; for each, the worker writes ``{"started": id}`` and then
``{"id": id, "outcome": ...}`` on stdout (flushed), so the parent knows which case was running if
the worker dies or hangs. A case is ``{"id", "target", "args"}``; ``args`` hold *value specs*
(JSON) that :func:`decode` turns into the hostile Python values (objects whose ``__index__``
raises, stream wrappers returning nonsense, 5000-digit ints, NaN, ...).

Outcome: ``{"ok": true}``, or ``{"exc": "module.Class", "typed": bool, "type_error": bool,
"msg": ...}`` (``typed``: a :class:`poolkeeper.errors.PoolkeeperError`), or for CLI targets
``{"rc": int, "traceback": bool, "stderr": tail}``.
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import sys
import tempfile
import traceback

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.errors import PoolkeeperError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import capi_lib  # noqa: E402

TMP = tempfile.mkdtemp(prefix="pk-hostile-")


# -- hostile objects -------------------------------------------------------------------------------
class _Index:
    def __init__(self, fn):
        self.fn = fn

    def __index__(self):
        return self.fn()

    def __repr__(self):
        return "<_Index>"


def _raise(exc):
    def f(*a, **k):
        raise exc

    return f


class _Proto:
    def __init__(self, r):
        self.r = r

    def __cuda_stream__(self):
        if isinstance(self.r, BaseException):
            raise self.r
        return self.r


class _Attr:
    def __init__(self, name, value):
        setattr(self, name, value)


class _SelfCudaStream:
    """``.cuda_stream`` returns the object itself."""

    @property
    def cuda_stream(self):
        return self


class _SelfPtr:
    @property
    def ptr(self):
        return self


class _SelfProto:
    def __cuda_stream__(self):
        return (0, self)


class _IntSub(int):
    pass


OBJECTS = {
    "object": lambda: object(),
    "dict": lambda: {"a": 1},
    "index_huge": lambda: _Index(lambda: 1 << 100),
    "index_neg": lambda: _Index(lambda: -5),
    "index_value_error": lambda: _Index(_raise(ValueError("bad index"))),
    "index_returns_str": lambda: _Index(lambda: "12"),
    "index_ki": lambda: _Index(_raise(KeyboardInterrupt())),
    "int_subclass": lambda: _IntSub(4096),
    "stream_proto_none": lambda: _Proto((0, None)),
    "stream_proto_short": lambda: _Proto((0,)),
    "stream_proto_str": lambda: _Proto((0, "s")),
    "stream_proto_neg": lambda: _Proto((0, -1)),
    "stream_proto_huge": lambda: _Proto((0, 1 << 70)),
    "stream_proto_int": lambda: _Proto(7),
    "stream_proto_raises": lambda: _Proto(ValueError("no stream")),
    "stream_cuda_stream_str": lambda: _Attr("cuda_stream", "x"),
    "stream_cuda_stream_float": lambda: _Attr("cuda_stream", 1.5),
    "stream_ptr_neg": lambda: _Attr("ptr", -3),
    "stream_ptr_huge": lambda: _Attr("ptr", 1 << 64),
    "stream_nested_ok": lambda: _Attr("cuda_stream", _Attr("ptr", 5)),
    "stream_self_cuda_stream": lambda: _SelfCudaStream(),
    "stream_self_ptr": lambda: _SelfPtr(),
    "stream_self_proto": lambda: _SelfProto(),
}


def decode(spec):
    """A value spec (see the module docs) -> the Python value."""
    if not isinstance(spec, list):
        return spec
    tag = spec[0]
    if tag == "int":
        return int(spec[1])
    if tag == "float":
        return float(spec[1])
    if tag == "str":
        return spec[1]
    if tag == "bytes":
        return bytes.fromhex(spec[1])
    if tag == "bool":
        return bool(spec[1])
    if tag == "none":
        return None
    if tag == "list":
        return [decode(x) for x in spec[1]]
    if tag == "obj":
        return OBJECTS[spec[1]]()
    raise ValueError(f"bad spec {spec!r}")


def kwargs(d):
    return {k: decode(v) for k, v in d.items()}


# -- targets ---------------------------------------------------------------------------------------
def _upstream(name):
    if name == "host":
        return pk.upstream.Host()
    return pk.upstream.Simulated(latency_us=0, capacity=1 << 30)


def _pool(kind, up="host"):
    return pk.make_pool(kind, _upstream(up))


def t_upstream_ctor(a):
    cls = {"Host": pk.upstream.Host, "Simulated": pk.upstream.Simulated, "Faulty": pk.upstream.Faulty}[a["cls"]]
    kw = kwargs(a["kwargs"])
    if a["cls"] == "Faulty":
        return cls(kw.pop("inner", _upstream("host")), **kw)
    return cls(**kw)


def t_pool_ctor(a):
    cls = {"direct": pk.Direct, "size_class": pk.SizeClassPool, "arena": pk.ArenaPool}[a["kind"]]
    return cls(_upstream(a.get("up", "sim")), **kwargs(a["kwargs"]))


def t_pool_op(a):
    pool = _pool(a["kind"], a.get("up", "host"))
    held = pool.allocate(4096)
    args = [decode(x) for x in a["args"]]
    if a.get("rel"):  # a pointer relative to the held block
        args[0] = held + args[0]
    kw = kwargs(a.get("kwargs", {}))
    try:
        getattr(pool, a["op"])(*args, **kw)
    finally:
        pool.validate()


def t_sim_op(a):
    sim = pk.upstream.Simulated(latency_us=0, capacity=1 << 30)
    args = [decode(x) for x in a["args"]]
    getattr(sim, a["op"])(*args)


def t_host_upstream_op(a):
    up = pk.upstream.Host()
    held = up.allocate(4096)
    args = [decode(x) for x in a["args"]]
    if a.get("rel"):
        args[0] = held + args[0]
    getattr(up, a["op"])(*args)


def t_as_handle(a):
    from poolkeeper.streams import as_handle

    as_handle(decode(a["stream"]))


def t_stream_arg(a):
    pool = _pool(a["kind"], "sim")
    p = pool.allocate(4096, stream=decode(a["stream"]))
    pool.deallocate(p)


def t_buffer(a):
    pool = _pool("arena")
    buf = pool.buffer(decode(a["nbytes"]), stream=decode(a.get("stream", ["none"])))
    buf.release()


def t_staging(a):
    from poolkeeper.staging import PinnedStagingPool, copy

    if a["op"] == "pool_ctor":
        PinnedStagingPool(pk.upstream.Host(), **kwargs(a["kwargs"]))
        return
    sp = PinnedStagingPool(pk.upstream.Host())
    if a["op"] == "acquire":
        sp.acquire(decode(a["nbytes"]))
        return
    b = sp.acquire(8192)
    try:
        if a["op"] == "view":
            with b.view(*[decode(x) for x in a["args"]]):
                pass
        elif a["op"] == "fill":
            b.fill(*[decode(x) for x in a["args"]])
        elif a["op"] == "copy":
            dst = decode(a["dst"])
            if dst == "buffer":
                dst = bytearray(16384)
            copy(dst, b, decode(a["nbytes"]), decode(a.get("stream", ["none"])))
        elif a["op"] == "retire":
            b.retire(decode(a["witness"]))
    finally:
        b.close()
        assert sp.stats()["live_buffers"] == 0


def t_uploader(a):
    from poolkeeper.staging import PinnedStagingPool, Uploader

    if a["op"] == "ctor":
        Uploader(PinnedStagingPool(pk.upstream.Host(), max_buffers=64, max_bytes=1 << 30), **kwargs(a["kwargs"])).close()
        return
    with Uploader(PinnedStagingPool(pk.upstream.Host()), chunk_bytes=65536, workers=2, depth=2,
                  engine=a.get("engine", "auto")) as up:
        src = decode(a["src"])
        if src == "file":
            src = io.BytesIO(bytes(100_000))
        dst = decode(a["dst"])
        if dst == "buffer":
            dst = bytearray(200_000)
        try:
            up.upload(src, dst, decode(a.get("nbytes", ["none"])))
        finally:
            assert up.pool.stats()["live_buffers"] == 0


_LIB = None


def t_capi(a):
    global _LIB
    if _LIB is None:
        _LIB = capi_lib.load()
        _core.registry_set(-1, pk.ArenaPool(pk.upstream.Host()))
    lib = _LIB
    args = [int(x) for x in a["args"]]
    fn = a["fn"]
    if fn == "malloc_free":
        p = lib.poolkeeper_malloc(args[0] % (1 << 64), args[1], args[2] % (1 << 64))
        if p:
            rc = lib.poolkeeper_free(p, args[1], args[2] % (1 << 64))
            assert rc == 0, capi_lib.last_error(lib)
        else:
            assert capi_lib.last_error(lib)
    elif fn == "free":
        rc = lib.poolkeeper_free(args[0] % (1 << 64), args[1], args[2] % (1 << 64))
        assert rc != 0 and capi_lib.last_error(lib), "an unknown pointer was accepted"
    elif fn == "torch":
        p = lib.poolkeeper_torch_malloc(args[0] % (1 << 64), args[1], args[2] % (1 << 64) or None)
        if p:
            lib.poolkeeper_torch_free(p, args[0] % (1 << 64), args[1], args[2] % (1 << 64) or None)
    elif fn == "torch_free_unknown":
        lib.poolkeeper_torch_free(args[0] % (1 << 64) or None, 16, args[1], None)
    elif fn == "record_stream":
        lib.poolkeeper_torch_record_stream(args[0] % (1 << 64) or None, args[1], args[2] % (1 << 64) or None)
    elif fn == "empty_cache":
        lib.poolkeeper_empty_cache()


def _cli(argv, files=None):
    from poolkeeper.cli import main

    paths = {}
    for name, (mode, content) in (files or {}).items():
        path = os.path.join(TMP, name)
        with open(path, "wb") as f:
            f.write(bytes.fromhex(content) if mode == "hex" else content.encode("utf-8", "surrogatepass"))
        paths[name] = path
    argv = [paths.get(x, x) for x in argv]
    err = io.StringIO()
    out = io.StringIO()
    rc = None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse usage errors
            rc = e.code if isinstance(e.code, int) else 2
    text = err.getvalue()
    return {"rc": rc, "traceback": "Traceback" in text, "stderr": text[-300:]}


def t_cli(a):
    if a.get("stub_bench"):
        from poolkeeper.bench import runner

        runner.run = lambda *x, **k: []  # argument handling only, not the benchmarks
    return _cli(a["argv"], a.get("files"))


TARGETS = {k[2:]: v for k, v in globals().items() if k.startswith("t_")}


def run_case(case):
    try:
        r = TARGETS[case["target"]](case["args"])
    except PoolkeeperError as e:
        return {"exc": f"{type(e).__module__}.{type(e).__qualname__}", "typed": True,
                "type_error": isinstance(e, TypeError), "msg": str(e)[:300]}
    except BaseException as e:  # noqa: BLE001 - reported, judged by the parent
        return {"exc": f"{type(e).__module__}.{type(e).__qualname__}", "typed": False,
                "type_error": isinstance(e, TypeError), "msg": str(e)[:300],
                "tb": "".join(traceback.format_exception(e))[-1500:]}
    if isinstance(r, dict) and "rc" in r:
        return r
    return {"ok": True}


def main():
    for line in sys.stdin:
        case = json.loads(line)
        print(json.dumps({"started": case["id"]}), flush=True)
        print(json.dumps({"id": case["id"], "outcome": run_case(case)}), flush=True)


if __name__ == "__main__":
    main()
