"""The HTML memory map: rendered from real pool snapshots and a 10,000-chunk one, the CLI, and
refusal of snapshots that do not add up. (Drawing itself is checked in test_browser.py.)"""
from __future__ import annotations

import json
import re

import pytest

import poolkeeper as pk

from poolkeeper.cli import main
from poolkeeper.errors import InvariantError
from poolkeeper.report.memory_map import render_html

from map_fixtures import busy_pool, synthetic

DATA_RE = re.compile(r'<script type="application/json" id="snapshot-data">(.*?)</script>', re.S)


def page_data(html: str) -> dict:
    m = DATA_RE.search(html)
    assert m, "no embedded snapshot data"
    return json.loads(m.group(1))


@pytest.mark.parametrize("kind", ["direct", "size_class", "arena"])
def test_real_snapshot_renders_with_every_chunk_and_the_verified_partition(kind):
    pool, _ = busy_pool(kind)
    snap = pool.snapshot()
    html = render_html(snap)
    data = page_data(html)
    chunks = [c for _, c in snap.chunks()]
    assert sum(len(b["off"]) for b in data["backings"]) == len(chunks)
    assert [b["address"] for b in data["backings"]] == [hex(b.address) for b in snap.backings]
    assert [b["size"] for b in data["backings"]] == [b.size for b in snap.backings]
    # Per chunk: offset, size, state and (live) requested survive the trip.
    flat = [
        (off, sz, data["states"][st], rq)
        for b in data["backings"]
        for off, sz, st, rq in zip(b["off"], b["sz"], b["st"], b["req"])
    ]
    assert flat == [(c.offset, c.size, c.state, c.requested if c.state == "live" else None) for c in chunks]
    st = pool.stats()
    v = data["verified"]
    assert (v["reserved"], v["live"], v["free"], v["pending"], v["overhead"]) == (
        st["reserved_bytes"], st["live_bytes"], st["free_bytes"], st["pending_bytes"], st["overhead_bytes"]
    )
    assert v["reserved"] == v["live"] + v["free"] + v["pending"] + v["overhead"]
    assert v["largest_free"] == st["largest_free_block"]
    assert data["pending_by_stream"] == [[str(k), v] for k, v in st["pending_by_stream"].items()]
    if kind == "direct":
        return  # Direct hands releases straight back to the upstream: nothing pending to draw
    assert "pending" in {c.state for c in chunks}, "the scenario should leave a pending release to draw"
    # A pending chunk names the streams it waits on, as the page shows them.
    pend = [(b, i) for b in data["backings"] for i, s in enumerate(b["st"]) if data["states"][s] == "pending"]
    waits = {data["streams"][k] for b, i in pend for k in (b["w"][i] or [])}
    assert waits >= {"2"}


def test_an_empty_pool_renders():
    pool = pk.SizeClassPool(pk.upstream.Simulated(latency_us=0))
    data = page_data(render_html(pool.snapshot()))
    assert data["backings"] == [] and data["verified"]["reserved"] == 0


def test_to_html_writes_the_same_page(tmp_path):
    pool, _ = busy_pool("size_class")
    snap = pool.snapshot()
    out = tmp_path / "m.html"
    assert snap.to_html(out) == str(out)
    assert out.read_text(encoding="utf-8") == render_html(snap)
    assert render_html(snap.to_dict()) == render_html(snap)


def markup_without_data(html: str) -> str:
    return DATA_RE.sub("", html)


def test_ten_thousand_chunks_add_data_not_markup():
    small, big = synthetic(2, 5), synthetic(4, 2500)
    html_small, html_big = render_html(small), render_html(big)
    data = page_data(html_big)
    assert sum(len(b["off"]) for b in data["backings"]) == 10_000
    # Chunks are data for the canvas: the markup does not grow with them.
    assert markup_without_data(html_big) == markup_without_data(html_small)
    # Columns, not objects: well under 40 bytes of embedded JSON per chunk.
    assert len(DATA_RE.search(html_big).group(1)) < 40 * 10_000
    assert data["streams"].count("0x7f00deadbeef") == 1  # a pointer-sized handle, sent as text


def test_markup_is_self_contained():
    html = render_html(synthetic(1, 3))
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html and "fetch(" not in html and "XMLHttpRequest" not in html
    assert html.count("<script") == 2 and html.count("</script>") == 2


def test_hostile_names_cannot_break_out_of_the_data_block():
    evil = "</script><script>alert(1)</script><!--"
    snap = synthetic(1, 3, pool=evil)
    html = render_html(snap)
    assert html.count("</script>") == 2
    assert "<script>alert" not in html
    assert page_data(html)["pool"] == evil
    assert "&lt;/script&gt;" in html  # the title is escaped too


def write(tmp_path, snap_dict, name="snap.json"):
    p = tmp_path / name
    p.write_text(json.dumps(snap_dict), encoding="utf-8")
    return p


def test_cli_writes_the_map(tmp_path, capsys):
    pool, _ = busy_pool("size_class")
    src = tmp_path / "snap.json"
    pool.snapshot().to_json(src)
    out = tmp_path / "map.html"
    assert main(["report", str(src), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert page_data(out.read_text(encoding="utf-8"))["pool"] == "SizeClassPool"
    # Without -o the map lands next to the snapshot.
    assert main(["report", str(src)]) == 0
    assert (tmp_path / "snap.html").exists()


def tampered(kind: str) -> dict:
    d = synthetic(2, 6).to_dict()
    c = d["backings"][0]["chunks"]
    if kind == "gap":
        c[2]["offset"] += 256
    elif kind == "overlap":
        c[1]["size"] += 256
    elif kind == "stats":
        d["stats"]["live_bytes"] += 1
    elif kind == "requested":
        live = next(x for x in c if x["state"] == "live")
        live["requested"] = live["size"] + 1
    elif kind == "state":
        c[0]["state"] = "borrowed"
    elif kind == "type":
        c[0]["size"] = "lots"
    elif kind == "missing":
        del c[0]["size"]
    elif kind == "backing_overlap":
        d["backings"][1]["address"] = d["backings"][0]["address"] + 256
    return d


@pytest.mark.parametrize(
    "kind, message",
    [
        ("gap", "gap"),
        ("overlap", "overlap"),
        ("stats", "live_bytes"),
        ("requested", "requested"),
        ("state", "borrowed"),
        ("type", "must be an integer"),
        ("missing", "not a poolkeeper snapshot"),
        ("backing_overlap", "overlap"),
    ],
)
def test_cli_refuses_a_tampered_snapshot_with_a_message(tmp_path, capsys, kind, message):
    src = write(tmp_path, tampered(kind))
    out = tmp_path / "map.html"
    assert main(["report", str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"poolkeeper report: refusing {src}: ")
    assert message in err
    assert "Traceback" not in err
    assert not out.exists()


def test_render_html_raises_invariant_error_on_tampering():
    with pytest.raises(InvariantError, match="gap"):
        render_html(tampered("gap"))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff\xfe"])
def test_cli_refuses_what_is_not_a_snapshot(tmp_path, capsys, text):
    src = tmp_path / "bad.json"
    src.write_bytes(text.encode("latin-1"))
    assert main(["report", str(src), "-o", str(tmp_path / "m.html")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("poolkeeper report: ") and "Traceback" not in err


def test_cli_missing_file(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope.json")]) == 1
    assert "nope.json" in capsys.readouterr().err
