"use strict";
// The memory map. Data: one object per backing with its chunks as parallel columns
// (off, sz, st, req, as, ls, ev, w); streams are indices into D.streams. The canvas paints only
// the rows in view and only the chunks inside the horizontal view, so the cost of a frame is
// bounded by what is visible, not by the snapshot.
(function () {
  const t0 = performance.now();
  const D = JSON.parse(document.getElementById("snapshot-data").textContent);
  const $ = (id) => document.getElementById(id);
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue("--" + name).trim();
  const STATES = D.states;
  const LIVE = STATES.indexOf("live"), PENDING = STATES.indexOf("pending");
  const COLORS = STATES.map(color);
  const OVERHEAD_COLOR = color("overhead");
  // Order in which a pixel column holding many chunks is stacked, top to bottom.
  const STACK = [COLORS[LIVE], OVERHEAD_COLOR, ...STATES.map((s, i) => (i === LIVE ? null : COLORS[i])).filter(Boolean)];
  const STACK_OVERHEAD = 1;
  const STACK_OF = STATES.map((s, i) => (i === LIVE ? 0 : 2 + STATES.filter((t, j) => j !== LIVE && j < i).length));
  const DESC = {
    live: "in use: the bytes a caller asked for",
    overhead: "slack of a live chunk beyond its requested size",
    free: "reusable by any stream now",
    pending: "released, waiting for stream order (not reusable yet)",
    thread_cached: "free, held in a thread's cache (counted in free)",
  };
  const B = D.backings;
  const nChunks = B.reduce((n, b) => n + b.off.length, 0);

  // ---- formatting ----
  const intFmt = new Intl.NumberFormat("en-US");
  function human(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0, x = n;
    while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
    return i === 0 ? `${n} B` : `${x.toFixed(x < 10 ? 2 : 1)} ${units[i]}`;
  }
  const bytes = (n) => `${human(n)} (${intFmt.format(n)} B)`;
  const stream = (i) => (i < 0 ? "none" : D.streams[i]);
  const el = (tag, attrs, ...kids) => {
    const n = document.createElement(tag);
    for (const k in attrs || {}) {
      if (k === "class") n.className = attrs[k];
      else if (k === "style") n.style.cssText = attrs[k];
      else n.setAttribute(k, attrs[k]);
    }
    for (const k of kids) n.append(k);
    return n;
  };

  // ---- summary: recomputed from the chunks, compared with what Python's check() verified ----
  function totals() {
    const t = { reserved: 0, live: 0, free: 0, pending: 0, overhead: 0, thread_cached: 0,
      largest_free: 0, free_chunks: 0, counts: STATES.map(() => 0) };
    for (const b of B) {
      t.reserved += b.size;
      for (let i = 0; i < b.off.length; i++) {
        const s = STATES[b.st[i]], size = b.sz[i];
        t.counts[b.st[i]]++;
        if (s === "live") {
          const req = b.req[i] === null ? size : b.req[i];
          t.live += req;
          t.overhead += size - req;
        } else if (s === "pending") {
          t.pending += size;
        } else {
          t.free += size;
          t.free_chunks++;
          if (size > t.largest_free) t.largest_free = size;
          if (s === "thread_cached") t.thread_cached += size;
        }
      }
    }
    t.fragmentation = t.free > 0 ? 1 - t.largest_free / t.free : 0;
    return t;
  }

  function renderSummary(t) {
    $("subtitle").textContent = `alignment ${D.alignment} B \u00b7 ` +
      `${intFmt.format(B.length)} backings \u00b7 ${intFmt.format(nChunks)} chunks \u00b7 snapshot format v${D.version}`;
    const bar = $("partition-bar");
    for (const [k, c] of [["live", COLORS[LIVE]], ["overhead", OVERHEAD_COLOR], ["free", color("free")], ["pending", COLORS[PENDING]]]) {
      if (t.reserved > 0 && t[k] > 0) bar.append(el("div", { style: `width:${(100 * t[k]) / t.reserved}%;background:${c}`, title: `${k}: ${human(t[k])}` }));
    }
    const ok = t.reserved === t.live + t.free + t.pending + t.overhead;
    const eq = $("equation");
    eq.append(
      `reserved ${human(t.reserved)} = live ${human(t.live)} + free ${human(t.free)} + pending ${human(t.pending)} + overhead ${human(t.overhead)} `,
      el("span", { class: ok ? "ok" : "warn" }, ok ? "\u2713 adds up" : "\u2717 does not add up"),
    );
    const pct = (n) => (t.reserved > 0 ? `${((100 * n) / t.reserved).toFixed(1)}%` : "");
    const rows = [
      ["reserved", "reserved (held from the upstream)", t.reserved, bytes(t.reserved), "100%", null],
      ["live", "live", t.live, bytes(t.live), pct(t.live), COLORS[LIVE]],
      ["free", "free", t.free, bytes(t.free), pct(t.free), color("free")],
      ["thread_cached", "\u2003of which thread-cached", t.thread_cached, bytes(t.thread_cached), pct(t.thread_cached), color("thread_cached")],
      ["pending", "pending", t.pending, bytes(t.pending), pct(t.pending), COLORS[PENDING]],
      ["overhead", "overhead", t.overhead, bytes(t.overhead), pct(t.overhead), OVERHEAD_COLOR],
      ...(D.pending_by_stream.length ? [["pending_by_stream", "\u2003pending by stream (as the pool reports it)",
        D.pending_by_stream.reduce((a, [, n]) => a + n, 0),
        D.pending_by_stream.map(([s, n]) => `stream ${s}: ${human(n)}`).join(", "), "", null]] : []),
      ["largest_free", "largest free block", t.largest_free, bytes(t.largest_free), "", null],
      ["fragmentation", "fragmentation (1 \u2212 largest free / free)", t.fragmentation, `${(Math.floor(1000 * t.fragmentation) / 10).toFixed(1)}%`, `${intFmt.format(t.free_chunks)} free chunks`, null],
      ["backings", "backings", B.length, intFmt.format(B.length), "", null],
      ["chunks", "chunks", nChunks, intFmt.format(nChunks),
        STATES.map((s, i) => `${t.counts[i]} ${s.replace("_", "-")}`).join(", "), null],
    ];
    const body = $("summary").tBodies[0];
    for (const [key, label, value, text, extra, sw] of rows) {
      const name = el("td", {}, ...(sw ? [el("span", { class: "swatch", style: `background:${sw}` })] : []), label);
      body.append(el("tr", {}, name, el("td", { class: "num", id: `sum-${key}`, "data-value": String(value) }, text), el("td", { class: "muted" }, extra)));
    }
    const v = D.verified, bad = [];
    for (const k of ["reserved", "live", "free", "pending", "overhead", "thread_cached", "largest_free", "free_chunks"]) {
      if (v[k] !== t[k]) bad.push(`${k}: page ${t[k]} vs check() ${v[k]}`);
    }
    const vp = $("verify");
    if (bad.length || !ok) {
      vp.className = "bad";
      vp.textContent = "The page's sums disagree with poolkeeper.accounting.check(): " + bad.join("; ");
    } else {
      vp.textContent = "Verified when the page was made: chunks tile every backing, and these sums equal " +
        "poolkeeper.accounting.check() and the pool's reported stats.";
    }
    const legend = $("legend");
    for (const [name, c] of [["live", COLORS[LIVE]], ["overhead", OVERHEAD_COLOR], ["free", color("free")], ["pending", COLORS[PENDING]], ["thread_cached", color("thread_cached")]]) {
      legend.append(el("span", { class: "item" }, el("span", { class: "swatch", style: `background:${c}` }), name.replace("_", "-") + " ", el("span", { class: "desc" }, DESC[name])));
    }
    const st = $("stats").tBodies[0];
    for (const k in D.stats) st.append(el("tr", {}, el("td", {}, k), el("td", { class: "num" }, intFmt.format(D.stats[k]))));
  }

  // ---- the map ----
  const ROW_H = 22, BAR_Y = 4, BAR_H = 14, LABEL_W = 240, PAD_R = 10;
  const scroll = $("map-scroll"), canvas = $("map"), spacer = $("map-spacer"), tip = $("tooltip");
  const ctx = canvas.getContext("2d");
  const maxSize = B.reduce((m, b) => Math.max(m, b.size), 1);
  const view = { v0: 0, v1: 1, perBacking: false };
  let W = 0, H = 0, hover = null, pinned = null, drawPending = false;
  const stats = { frames: 0, lastFrameMs: 0, drawnChunks: 0 };

  const barW = () => Math.max(10, W - LABEL_W - PAD_R);
  const rowLen = (b) => (view.perBacking ? 1 : b.size / maxSize);
  const xOf = (b, byte) => LABEL_W + (((byte / b.size) * rowLen(b)) - view.v0) / (view.v1 - view.v0) * barW();
  const byteAt = (b, x) => (((x - LABEL_W) / barW()) * (view.v1 - view.v0) + view.v0) / rowLen(b) * b.size;

  function firstChunkEndingAfter(b, byte) {  // binary search on the sorted offsets
    let lo = 0, hi = b.off.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (b.off[mid] + b.sz[mid] <= byte) lo = mid + 1; else hi = mid;
    }
    return lo;
  }

  function layout() {
    W = scroll.clientWidth;
    const total = B.length * ROW_H;
    H = Math.max(ROW_H, Math.min(total, Math.floor(window.innerHeight * 0.65) - 2));
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(W * dpr);
    canvas.height = Math.round(H * dpr);
    canvas.style.height = H + "px";
    spacer.style.height = Math.max(0, total - H) + "px";
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    requestDraw();
  }

  function requestDraw() {
    if (!drawPending) { drawPending = true; requestAnimationFrame(() => { drawPending = false; draw(); }); }
  }

  function draw() {
    const start = performance.now();
    ctx.clearRect(0, 0, W, H);
    ctx.font = "12px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    let drawn = 0;
    if (B.length === 0) {
      ctx.fillStyle = "#5b6675";
      ctx.fillText("This pool holds no backings.", 8, ROW_H / 2);
    }
    const first = Math.floor(scroll.scrollTop / ROW_H);
    for (let r = first; r < B.length; r++) {
      const y = r * ROW_H - scroll.scrollTop;
      if (y >= H) break;
      drawn += drawRow(r, y);
    }
    for (const [mark, style] of [[pinned, "#000"], [hover, "#d21f3c"]]) {
      if (!mark) continue;
      const y = mark.row * ROW_H - scroll.scrollTop;
      if (y < -ROW_H || y > H) continue;
      const b = B[mark.row], i = mark.chunk;
      const x0 = Math.max(LABEL_W, xOf(b, b.off[i])), x1 = Math.min(LABEL_W + barW(), xOf(b, b.off[i] + b.sz[i]));
      if (x1 < x0) continue;  // zoomed out of view
      ctx.strokeStyle = style;
      ctx.lineWidth = 2;
      const w = Math.max(3, x1 - x0);
      ctx.strokeRect(x0 - (w - (x1 - x0)) / 2, y + BAR_Y - 1.5, w, BAR_H + 3);
    }
    stats.frames++;
    stats.drawnChunks = drawn;
    stats.lastFrameMs = performance.now() - start;
    canvas.dataset.drawnChunks = String(drawn);
    updateRange();
  }

  function drawRow(r, y) {
    const b = B[r];
    ctx.fillStyle = "#1d2430";
    const flags = (b.resident ? " \u00b7 resident" : "") + (b.oversize ? " \u00b7 oversize" : "");
    ctx.fillText(`${b.address}  ${human(b.size)}${flags}`, 6, y + ROW_H / 2, LABEL_W - 12);
    const left = LABEL_W, right = LABEL_W + barW();
    const bx0 = xOf(b, 0), bx1 = xOf(b, b.size);
    if (bx1 < left || bx0 > right) return 0;
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, y, right - left, ROW_H);
    ctx.clip();
    const lo = Math.max(0, byteAt(b, left)), hi = Math.min(b.size, byteAt(b, right));
    // Chunks narrower than a pixel are summed per pixel column and the column is split by state
    // in proportion to bytes: thousands of tiny rectangles would cost time and still blend.
    const acc = new Float64Array(STACK.length);
    let col = null, colPending = false, n = 0;
    const flush = () => {
      if (col === null) return;
      let total = 0;
      for (const v of acc) total += v;
      let yy = y + BAR_Y;
      for (let k = 0; k < STACK.length; k++) {
        if (!acc[k]) continue;
        const h = (BAR_H * acc[k]) / total;
        ctx.fillStyle = STACK[k];
        ctx.fillRect(col, yy, 1, h);
        yy += h;
      }
      if (colPending) { ctx.fillStyle = COLORS[PENDING]; ctx.fillRect(col - 0.5, y, 2, BAR_Y - 1); }
      acc.fill(0);
      col = null;
      colPending = false;
    };
    for (let i = firstChunkEndingAfter(b, lo); i < b.off.length && b.off[i] < hi; i++, n++) {
      const off = b.off[i], size = b.sz[i], st = b.st[i];
      const req = st === LIVE && b.req[i] !== null ? b.req[i] : size;
      const x0 = xOf(b, off), x1 = xOf(b, off + size), w = x1 - x0;
      if (w < 1) {
        const c = Math.floor(x0);
        if (c !== col) { flush(); col = c; }
        acc[STACK_OF[st]] += req;
        if (req < size) acc[STACK_OVERHEAD] += size - req;
        if (st === PENDING) colPending = true;
        continue;
      }
      flush();
      const gap = w >= 4 ? 1 : 0;  // a visible seam between chunks that are wide enough
      if (req < size) {
        const xr = xOf(b, off + req);
        ctx.fillStyle = COLORS[LIVE];
        ctx.fillRect(x0, y + BAR_Y, xr - x0, BAR_H);
        ctx.fillStyle = OVERHEAD_COLOR;
        ctx.fillRect(xr, y + BAR_Y, x1 - xr - gap, BAR_H);
      } else {
        ctx.fillStyle = COLORS[st];
        ctx.fillRect(x0, y + BAR_Y, w - gap, BAR_H);
      }
      if (st === PENDING && w < 2) {
        ctx.fillRect(x0 - 0.5, y, 2, BAR_Y - 1);
      }
    }
    flush();
    ctx.restore();
    ctx.strokeStyle = "#8a94a3";
    ctx.lineWidth = 1;
    ctx.strokeRect(Math.max(left, bx0) + 0.5, y + BAR_Y - 0.5, Math.min(right, bx1) - Math.max(left, bx0) - 1, BAR_H + 1);
    return n;
  }

  function updateRange() {
    const span = view.v1 - view.v0;
    const perPx = view.perBacking ? "" : ` \u00b7 1 px \u2248 ${human(Math.max(1, Math.round((span * maxSize) / barW())))}`;
    $("view-range").textContent = `showing ${(100 * view.v0).toFixed(2)}\u2013${(100 * view.v1).toFixed(2)}% of ` +
      (view.perBacking ? "each backing" : "the largest backing") + perPx;
  }

  // ---- hit testing, tooltip, details ----
  function hit(clientX, clientY) {
    const rect = canvas.getBoundingClientRect();
    const x = clientX - rect.left, y = clientY - rect.top;
    const row = Math.floor((y + scroll.scrollTop) / ROW_H);
    if (row < 0 || row >= B.length || x < LABEL_W || x > LABEL_W + barW()) return null;
    const b = B[row];
    const byte = byteAt(b, x);
    if (byte < 0 || byte >= b.size) return null;
    const chunk = firstChunkEndingAfter(b, byte);
    if (chunk >= b.off.length) return null;
    // Everything under this pixel, so sub-pixel chunks are not silently hidden.
    const a = firstChunkEndingAfter(b, Math.max(0, byteAt(b, Math.floor(x))));
    const z = firstChunkEndingAfter(b, Math.min(b.size, byteAt(b, Math.floor(x) + 1)) - 1e-9);
    return { row, chunk, inPixel: Math.max(1, z - a + 1), firstInPixel: a };
  }

  function describe(h) {
    const b = B[h.row], i = h.chunk, st = STATES[b.st[i]];
    const base = BigInt(b.address), off = b.off[i], size = b.sz[i];
    const f = [
      ["backing", `${b.address} (${human(b.size)})${b.resident ? ", resident" : ""}${b.oversize ? ", oversize" : ""}`],
      ["chunk", `${i + 1} of ${b.off.length}`],
      ["state", st.replace("_", "-")],
      ["address", "0x" + (base + BigInt(off)).toString(16)],
      ["offset", `${intFmt.format(off)} (0x${off.toString(16)})`],
      ["size", bytes(size)],
    ];
    if (st === "live") {
      const req = b.req[i] === null ? size : b.req[i];
      f.push(["requested", bytes(req)], ["overhead", bytes(size - req)]);
    }
    f.push(["allocated on stream", stream(b.as[i])], ["last used on stream", stream(b.ls[i])]);
    if (st === "pending") {
      f.push(["pending event", b.ev[i] === null ? "none recorded" : b.ev[i]],
        ["waits on streams", b.w[i] ? b.w[i].map(stream).join(", ") : "none"]);
    }
    if (h.inPixel > 1) {
      const counts = STATES.map(() => 0);
      for (let k = h.firstInPixel; k < h.firstInPixel + h.inPixel && k < b.off.length; k++) counts[b.st[k]]++;
      const mix = STATES.map((s, k) => (counts[k] ? `${counts[k]} ${s.replace("_", "-")}` : "")).filter(Boolean).join(", ");
      f.push(["under this pixel", `${h.inPixel} chunks: ${mix} (zoom in to tell them apart)`]);
    }
    return f;
  }

  function showTip(h, clientX, clientY) {
    if (!h) { tip.hidden = true; return; }
    tip.textContent = describe(h).map(([k, v]) => `${k}: ${v}`).join("\n");
    tip.hidden = false;
    const pad = 14, w = tip.offsetWidth, hgt = tip.offsetHeight;
    tip.style.left = Math.min(clientX + pad, window.innerWidth - w - 4) + "px";
    tip.style.top = (clientY + pad + hgt > window.innerHeight ? clientY - hgt - pad : clientY + pad) + "px";
  }

  function pin(h) {
    pinned = h;
    const box = $("details");
    if (!h) { box.replaceChildren(el("p", { class: "muted" }, "Click a chunk to pin its details here.")); return; }
    const rows = describe(h).map(([k, v]) => el("tr", { "data-field": k }, el("td", {}, k), el("td", {}, v)));
    box.replaceChildren(el("h2", { style: "font-size:15px;margin:0 0 4px" }, "Pinned chunk"), el("table", { id: "details-table" }, el("tbody", {}, ...rows)));
  }

  // ---- interaction ----
  function zoom(factor, anchorX) {
    const span = view.v1 - view.v0;
    const ax = anchorX === undefined ? LABEL_W + barW() / 2 : anchorX;
    const u = view.v0 + ((ax - LABEL_W) / barW()) * span;
    const ns = Math.min(1, Math.max(1e-12, span / factor));
    let v0 = u - ((ax - LABEL_W) / barW()) * ns;
    v0 = Math.min(Math.max(0, v0), 1 - ns);
    view.v0 = v0;
    view.v1 = v0 + ns;
    requestDraw();
  }
  function pan(du) {
    const span = view.v1 - view.v0;
    view.v0 = Math.min(Math.max(0, view.v0 + du), 1 - span);
    view.v1 = view.v0 + span;
    requestDraw();
  }

  let drag = null;
  canvas.addEventListener("mousedown", (e) => { drag = { x: e.clientX, v0: view.v0, moved: false }; });
  window.addEventListener("mouseup", (e) => {
    if (drag && !drag.moved && e.target === canvas) { pin(hit(e.clientX, e.clientY)); requestDraw(); }
    drag = null;
    canvas.classList.remove("dragging");
  });
  canvas.addEventListener("mousemove", (e) => {
    if (drag) {
      const dx = e.clientX - drag.x;
      if (Math.abs(dx) > 3) { drag.moved = true; canvas.classList.add("dragging"); }
      if (drag.moved) {
        const span = view.v1 - view.v0;
        view.v0 = drag.v0;
        pan((-dx / barW()) * span);
        return;
      }
    }
    hover = hit(e.clientX, e.clientY);
    showTip(hover, e.clientX, e.clientY);
    requestDraw();
  });
  canvas.addEventListener("mouseleave", () => { hover = null; tip.hidden = true; requestDraw(); });
  canvas.addEventListener("wheel", (e) => {
    if (!(e.ctrlKey || e.metaKey)) return;  // plain wheel scrolls the rows
    e.preventDefault();
    zoom(e.deltaY < 0 ? 1.25 : 0.8, e.clientX - canvas.getBoundingClientRect().left);
  }, { passive: false });
  canvas.addEventListener("keydown", (e) => {
    const span = view.v1 - view.v0;
    if (e.key === "+" || e.key === "=") zoom(2);
    else if (e.key === "-") zoom(0.5);
    else if (e.key === "0") { view.v0 = 0; view.v1 = 1; requestDraw(); }
    else if (e.key === "ArrowLeft") pan(-span / 10);
    else if (e.key === "ArrowRight") pan(span / 10);
    else return;
    e.preventDefault();
  });
  scroll.addEventListener("scroll", () => { tip.hidden = true; hover = null; requestDraw(); }, { passive: true });
  window.addEventListener("resize", layout);
  $("zoom-in").addEventListener("click", () => zoom(2));
  $("zoom-out").addEventListener("click", () => zoom(0.5));
  $("zoom-fit").addEventListener("click", () => { view.v0 = 0; view.v1 = 1; requestDraw(); });
  $("per-backing").addEventListener("change", (e) => { view.perBacking = e.target.checked; requestDraw(); });

  // For scripts and tests: where a chunk is drawn (scrolled into view), and frame figures.
  window.poolkeeperMap = {
    chunkCount: nChunks,
    stats,
    locate(row, chunk) {
      const b = B[row];
      if (!b || chunk < 0 || chunk >= b.off.length) return null;
      scroll.scrollTop = Math.max(0, row * ROW_H - H / 2);
      const yIn = row * ROW_H - scroll.scrollTop + BAR_Y + BAR_H / 2;
      let rect = canvas.getBoundingClientRect();
      if (rect.top + yIn < 0 || rect.top + yIn > window.innerHeight - 4) {
        window.scrollBy(0, rect.top + yIn - window.innerHeight / 2);
        rect = canvas.getBoundingClientRect();
      }
      const x0 = Math.max(LABEL_W, xOf(b, b.off[chunk])), x1 = Math.min(LABEL_W + barW(), xOf(b, b.off[chunk] + b.sz[chunk]));
      return { x: rect.left + (x0 + x1) / 2, y: rect.top + yIn };
    },
    timings: {},
  };

  renderSummary(totals());
  layout();
  requestAnimationFrame(() => {
    window.poolkeeperMap.timings = { ready_ms: performance.now() - t0, first_frame_ms: stats.lastFrameMs };
    document.body.dataset.ready = "true";
  });
})();
