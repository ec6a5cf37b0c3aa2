"""The pages in headless Chromium (Debian's /usr/bin/chromium driven by Playwright's Python package).

Skipped cleanly when Playwright or Chromium is missing. Set POOLKEEPER_CHROMIUM to use another
Chromium binary, and POOLKEEPER_SCREENSHOTS=DIR to keep the screenshots (docs/ has one of each).
"""
from __future__ import annotations

import math
import os
import random
import shutil
import threading
from pathlib import Path

import pytest

from poolkeeper.lab import QueueLab, parse_rate
from poolkeeper.report import lab_page
from poolkeeper.report.memory_map import render_html

from map_fixtures import busy_pool, synthetic

pytestmark = pytest.mark.browser

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright's Python package is not installed")
CHROMIUM = os.environ.get("POOLKEEPER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    pg = browser.new_page(viewport={"width": 1100, "height": 900})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    yield pg
    pg.close()
    assert not errors, errors


@pytest.fixture(scope="module")
def lab_url():
    server = lab_page.make_server(0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


def keep(shot: Path) -> None:
    """Copy a screenshot to $POOLKEEPER_SCREENSHOTS when set."""
    dest = os.environ.get("POOLKEEPER_SCREENSHOTS")
    if dest:
        Path(dest).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(dest) / shot.name)


# ---------------------------------------------------------------- queue lab


def state(pg) -> tuple[float, float]:
    """(elapsed, backlog) as the page holds them: the exact numbers behind the displayed text."""
    return float(pg.get_attribute("#elapsed", "data-value")), float(pg.get_attribute("#backlog", "data-value"))


def test_lab_seed_scenarios(page, lab_url, tmp_path):
    page.goto(lab_url)
    # The first scenario of docs/report_and_lab.md: Reset, arrival 0, service 4, two Steps: the four units drain by 1.0 s.
    page.click("#reset")
    page.fill("#arrival", "0")
    page.fill("#service", "4")
    page.click("#step")
    page.click("#step")
    assert state(page) == (1.0, 0.0)
    assert page.text_content("#elapsed") == "1.0 s"
    assert page.text_content("#backlog") == "0 units"
    # Second: a fresh Reset, arrival 2, service 4, two Steps: two units remain.
    page.click("#reset")
    assert state(page) == (0.0, 4.0)
    page.fill("#arrival", "2")
    page.fill("#service", "4")
    page.click("#step")
    page.click("#step")
    assert state(page) == (1.0, 2.0)
    assert page.text_content("#backlog") == "2 units"
    assert page.is_hidden("#error")
    # The plot drew the run: a point per state since the reset.
    assert page.locator("#plot circle.dot").count() == 3
    shot = tmp_path / "queue_lab.png"
    page.set_viewport_size({"width": 640, "height": 800})
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 5000
    keep(shot)


def test_lab_control_change_keeps_elapsed(page, lab_url):
    page.goto(lab_url)
    page.fill("#arrival", "3")
    page.fill("#service", "1")
    page.click("#step")
    page.click("#step")
    assert state(page) == (1.0, 6.0)
    page.fill("#arrival", "0")
    page.fill("#service", "8")
    assert state(page) == (1.0, 6.0)
    page.click("#step")
    assert state(page) == (1.5, 2.0)
    # The two mid-run changes (at 1.0 s) are marked on the plot; the run went on from there.
    assert page.locator("#plot line.change").count() == 2
    log = page.text_content("#log")
    assert "1.0 s: arrival rate set to 0 units/s (elapsed time and backlog kept)" in log
    assert "1.0 s: service rate set to 8 units/s" in log


@pytest.mark.parametrize("bad", ["-1", "abc", "", "NaN", "1e999", "2,5", "0x10"])
def test_lab_refuses_bad_input_visibly(page, lab_url, bad):
    page.goto(lab_url)
    page.fill("#service", "4")
    page.click("#step")
    before = state(page)
    page.fill("#arrival", bad)
    assert page.is_visible("#error")
    assert "Arrival rate" in page.text_content("#error")
    assert page.get_attribute("#arrival", "aria-invalid") == "true"
    page.click("#step")  # refused: the state does not move
    assert state(page) == before
    assert "Step refused" in page.text_content("#error")
    with pytest.raises(ValueError):  # and Python refuses the same text
        parse_rate(bad)
    page.fill("#arrival", "1")
    assert page.is_hidden("#error")
    page.click("#step")
    assert state(page) == (before[0] + 0.5, max(0.0, before[1] + (1 - 4) * 0.5))


def test_lab_page_matches_queuelab_step_for_step(page, lab_url):
    """A seeded random session, run on the page and on QueueLab side by side: equal bit for bit."""
    page.goto(lab_url)
    rng = random.Random(2024)
    lab = QueueLab()
    texts = ["0", "4", "2", "0.1", "0.3", "0.7", "1.25", "3.3333333", "1e-3", " 5 ", ".5", "-2", "x", "10"]
    invalid = {"arrival": False, "service": False}
    for _ in range(120):
        op = rng.choice(["step", "step", "step", "arrival", "service", "reset"])
        if op in ("arrival", "service"):
            text = rng.choice(texts)
            page.fill(f"#{op}", text)
            try:
                setattr(lab, f"{op}_rate", parse_rate(text))
                invalid[op] = False
            except ValueError:
                invalid[op] = True
        elif op == "reset":
            page.click("#reset")
            lab.reset()
        else:
            page.click("#step")
            if not any(invalid.values()):
                lab.step()
        assert state(page) == (lab.elapsed, lab.backlog)
        assert page.is_visible("#error") == any(invalid.values())
    assert lab.elapsed > 0 and not math.isnan(lab.backlog)


# ---------------------------------------------------------------- memory map


def open_map(page, snap, tmp_path, name="map.html"):
    path = tmp_path / name
    path.write_text(render_html(snap), encoding="utf-8")
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready=true]")
    return path


def settle(page) -> None:
    """Let pending scroll events and the next frame run."""
    page.evaluate("new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))")


def figure(page, key) -> float:
    return float(page.get_attribute(f"#sum-{key}", "data-value"))


@pytest.mark.parametrize("kind", ["size_class", "arena"])
def test_map_of_a_real_pool(page, tmp_path, kind):
    pool, _ = busy_pool(kind)
    snap = pool.snapshot()
    st = pool.stats()
    open_map(page, snap, tmp_path)
    chunks = [(bi, ci, c) for bi, b in enumerate(snap.backings) for ci, c in enumerate(b.chunks)]
    assert figure(page, "chunks") == len(chunks)
    assert figure(page, "backings") == len(snap.backings)
    for key, stat in [
        ("reserved", "reserved_bytes"),
        ("live", "live_bytes"),
        ("free", "free_bytes"),
        ("pending", "pending_bytes"),
        ("overhead", "overhead_bytes"),
        ("thread_cached", "thread_cached_bytes"),
        ("largest_free", "largest_free_block"),
    ]:
        assert figure(page, key) == st[stat], key
    assert figure(page, "fragmentation") == pytest.approx(st["fragmentation"], abs=1e-12)
    assert "adds up" in page.text_content("#equation")
    by_stream = page.text_content("#sum-pending_by_stream")
    for s, n in st["pending_by_stream"].items():
        assert f"stream {s}: " in by_stream
    assert page.get_attribute("#verify", "class") != "bad"
    # Hover the pending release: the tooltip names its state and the streams it waits on.
    bi, ci, c = next((bi, ci, c) for bi, ci, c in chunks if c.state == "pending" and 2 in c.waits_on)
    pos = page.evaluate(f"window.poolkeeperMap.locate({bi}, {ci})")
    settle(page)
    page.mouse.move(pos["x"], pos["y"])
    tip = page.text_content("#tooltip")
    assert page.is_visible("#tooltip")
    assert "state: pending" in tip and "waits on streams: " in tip and "2" in tip.split("waits on streams: ")[1]
    # Click pins the details of the chunk under the cursor.
    page.mouse.click(pos["x"], pos["y"])
    shot = tmp_path / f"memory_map_{kind}.png"
    page.screenshot(path=str(shot), full_page=True)
    rows = dict(
        (r.get_attribute("data-field"), r.locator("td").nth(1).text_content())
        for r in page.locator("#details-table tr").all()
    )
    assert rows["state"] == "pending"
    assert rows["offset"].startswith(f"{c.offset:,}")
    assert rows["address"] == hex(snap.backings[bi].address + c.offset)
    # A live chunk shows its requested size and overhead.
    bi, ci, c = next((bi, ci, c) for bi, ci, c in chunks if c.state == "live" and c.requested < c.size)
    pos = page.evaluate(f"window.poolkeeperMap.locate({bi}, {ci})")
    settle(page)
    page.mouse.click(pos["x"], pos["y"])
    rows = {r.get_attribute("data-field"): r.locator("td").nth(1).text_content() for r in page.locator("#details-table tr").all()}
    assert rows["state"] == "live" and f"({c.requested:,} B)" in rows["requested"]
    assert f"({c.size - c.requested:,} B)" in rows["overhead"]
    keep(shot)


def test_map_draws_each_state_in_its_colour(page, tmp_path):
    from poolkeeper.accounting import Backing, Chunk, Snapshot, check

    chunks = [
        Chunk(0, 4096, "live", requested=4096, alloc_stream=1, last_stream=1),
        Chunk(4096, 4096, "free"),
        Chunk(8192, 4096, "pending", alloc_stream=1, last_stream=2, event=7, waits_on=[2]),
        Chunk(12288, 4096, "thread_cached"),
    ]
    snap = Snapshot("Tiny", "none", 256, {}, [Backing(1 << 40, 16384, chunks=chunks)])
    check(snap, compare_stats=False)
    open_map(page, snap, tmp_path)
    colours = page.evaluate(
        """() => {
      const css = getComputedStyle(document.documentElement), c = document.getElementById("map");
      const ctx = c.getContext("2d"), dpr = window.devicePixelRatio || 1, r = c.getBoundingClientRect();
      const out = {};
      for (const [i, s] of ["live", "free", "pending", "thread_cached"].entries()) {
        const p = window.poolkeeperMap.locate(0, i);
        const px = ctx.getImageData(Math.round((p.x - r.left) * dpr), Math.round((p.y - r.top) * dpr), 1, 1).data;
        const hex = "#" + [px[0], px[1], px[2]].map((v) => v.toString(16).padStart(2, "0")).join("");
        out[s] = [hex, css.getPropertyValue("--" + s).trim()];
      }
      return out;
    }"""
    )
    for state_, (drawn, wanted) in colours.items():
        assert drawn == wanted, state_


def test_map_with_ten_thousand_chunks_stays_light(page, tmp_path):
    snap = synthetic(4, 2500)
    open_map(page, snap, tmp_path, "big.html")
    assert figure(page, "chunks") == 10_000
    for key in ("reserved", "live", "free", "pending", "overhead"):
        assert figure(page, key) == snap.stats[f"{key}_bytes"], key
    # No DOM node per chunk: the page stays a few hundred elements whatever the snapshot.
    assert page.evaluate("document.getElementsByTagName('*').length") < 300
    assert page.evaluate("window.poolkeeperMap.stats.drawnChunks") == 10_000
    # Zooming in paints only what is in view.
    for _ in range(4):
        page.click("#zoom-in")
    settle(page)
    assert "showing 46.88\u201353.13%" in page.text_content("#view-range")
    assert page.evaluate("window.poolkeeperMap.stats.drawnChunks") < 2000
    page.click("#zoom-fit")
    settle(page)
    assert page.evaluate("window.poolkeeperMap.stats.drawnChunks") == 10_000
    timings = page.evaluate("window.poolkeeperMap.timings")
    print(f"\n10,000-chunk map: ready {timings['ready_ms']:.0f} ms, first frame {timings['first_frame_ms']:.1f} ms")


def test_map_many_backings_are_virtualized(page, tmp_path):
    snap = synthetic(10_000, 1)
    open_map(page, snap, tmp_path, "rows.html")
    assert figure(page, "backings") == 10_000
    drawn = page.evaluate("window.poolkeeperMap.stats.drawnChunks")
    assert 0 < drawn < 100  # only the rows in view
    pos = page.evaluate("window.poolkeeperMap.locate(9999, 0)")  # scrolls the last row into view
    settle(page)
    page.mouse.move(pos["x"], pos["y"])
    assert hex(snap.backings[9999].address) in page.text_content("#tooltip")


def test_map_of_an_empty_pool(page, tmp_path):
    import poolkeeper as pk

    open_map(page, pk.SizeClassPool(pk.upstream.Simulated(latency_us=0)).snapshot(), tmp_path, "empty.html")
    assert figure(page, "reserved") == 0 and figure(page, "chunks") == 0
    assert "adds up" in page.text_content("#equation")


def test_map_runs_no_script_from_the_snapshots_strings(page, tmp_path):
    # Every string of a snapshot that reaches the page -- pool, upstream, a stats key, a
    # pending_by_stream key -- carrying the ways out of a JSON block and into markup. The page must
    # show them as text: no handler runs, no element is added, the title stays text.
    from poolkeeper.accounting import Backing, Chunk, Snapshot

    evil = ('</script><script>window.__pwned="script"</script><img src=x onerror="window.__pwned=\'img\'">'
            '<!--<script>window.__pwned="comment"</script>{{JS}}\u2028\u2029')
    chunks = [Chunk(0, 4096, "live", requested=4000, alloc_stream=1, last_stream=1),
              Chunk(4096, 4096, "pending", alloc_stream=1, last_stream=2, event=7, waits_on=[2])]
    snap = Snapshot(evil, evil, 256, {evil: 5, "pending_by_stream": {evil: 4096}},
                    [Backing(1 << 40, 8192, chunks=chunks)])
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    open_map(page, snap, tmp_path, "evil.html")
    for i in range(2):  # the tooltip and the pinned details of each chunk
        pos = page.evaluate(f"window.poolkeeperMap.locate(0, {i})")
        settle(page)
        page.mouse.move(pos["x"], pos["y"])
        page.mouse.click(pos["x"], pos["y"])
    page.click("#stats-box summary")
    assert page.evaluate("window.__pwned") is None
    assert not dialogs
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("document.querySelectorAll('script').length") == 2  # the data block and the page's own
    assert evil.split("{{")[0] in page.title()
    assert evil in page.text_content("#stats")
    assert f"stream {evil}" in page.text_content("#sum-pending_by_stream")
