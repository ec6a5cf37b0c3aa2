"use strict";
// The queue lab model, the same as poolkeeper.lab.QueueLab: the constants and the rate pattern
// come from Python (lab-config), and step() evaluates the same expression in the same order.
(function () {
  const CFG = JSON.parse(document.getElementById("lab-config").textContent);
  const RATE_RE = new RegExp(CFG.rate_pattern);
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";

  const lab = {
    arrival: CFG.arrival_rate,
    service: CFG.service_rate,
    elapsed: 0,
    backlog: CFG.reset_backlog,
    history: [],   // [elapsed, backlog] after the reset and after each step
    changes: [],   // elapsed times at which a rate changed since the reset
    log: [],
  };
  const invalid = { arrival: null, service: null };  // the message for a refused control, or null
  const NAMES = { arrival: "Arrival rate", service: "Service rate" };

  function parseRate(text, name) {
    const s = text.trim();
    if (!RATE_RE.test(s)) throw new Error(`${name} must be a number (got "${text}")`);
    const x = Number(s);
    if (!Number.isFinite(x)) throw new Error(`${name} must be a finite number (got "${text}")`);
    if (x < 0) throw new Error(`${name} must be 0 or more units/s (got "${text}")`);
    return x + 0;  // -0 becomes 0, as in Python
  }

  function reset() {
    lab.elapsed = 0;
    lab.backlog = CFG.reset_backlog;
    lab.history = [[lab.elapsed, lab.backlog]];
    lab.changes = [];
    lab.log = [`Reset: ${fmt(lab.backlog)} units at 0.0 s`];
  }

  function step() {
    const before = lab.backlog;
    lab.backlog = Math.max(0, lab.backlog + (lab.arrival - lab.service) * CFG.step_seconds);
    lab.elapsed = lab.elapsed + CFG.step_seconds;
    lab.history.push([lab.elapsed, lab.backlog]);
    lab.log.push(`${lab.elapsed.toFixed(1)} s: max(0, ${fmt(before)} + (${fmt(lab.arrival)} \u2212 ${fmt(lab.service)}) \u00d7 ${CFG.step_seconds}) = ${fmt(lab.backlog)}`);
  }

  function setRate(which, text) {
    let x;
    try {
      x = parseRate(text, NAMES[which]);
    } catch (e) {
      invalid[which] = `${e.message}; still using ${fmt(lab[which])} units/s.`;
      return;
    }
    invalid[which] = null;
    if (x !== lab[which]) {
      lab[which] = x;
      if (lab.elapsed > 0) lab.changes.push(lab.elapsed);  // a mid-run change: mark it on the plot
      lab.log.push(`${lab.elapsed.toFixed(1)} s: ${NAMES[which].toLowerCase()} set to ${fmt(x)} units/s (elapsed time and backlog kept)`);
    }
  }

  function fmt(x) {
    if (Number.isInteger(x)) return String(x);
    const r = Number(x.toFixed(3));
    return (r === x ? "" : "\u2248") + String(r);
  }

  // -- view --
  function render(extraError) {
    const el = $("elapsed"), bl = $("backlog");
    el.dataset.value = String(lab.elapsed);
    el.textContent = `${lab.elapsed.toFixed(1)} s`;
    bl.dataset.value = String(lab.backlog);
    bl.textContent = `${fmt(lab.backlog)} units`;
    for (const which of ["arrival", "service"]) {
      $(which).setAttribute("aria-invalid", invalid[which] ? "true" : "false");
    }
    const msgs = [extraError, invalid.arrival, invalid.service].filter(Boolean);
    const err = $("error");
    err.textContent = msgs.join(" ");
    err.hidden = msgs.length === 0;
    const log = $("log");
    log.replaceChildren(...lab.log.map((line) => {
      const li = document.createElement("li");
      li.textContent = line;
      return li;
    }));
    log.scrollTop = log.scrollHeight;
    plot();
  }

  function niceStep(span, target) {
    const raw = span / target;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 5, 10]) if (m * mag >= raw) return m * mag;
    return 10 * mag;
  }

  function node(tag, attrs, text) {
    const n = document.createElementNS(SVG, tag);
    for (const k in attrs) n.setAttribute(k, attrs[k]);
    if (text !== undefined) n.textContent = text;
    return n;
  }

  function plot() {
    const svg = $("plot");
    const W = 520, H = 220, L = 44, R = 12, T = 24, B = 30;
    const maxT = Math.max(2, lab.elapsed);
    const maxB = lab.history.reduce((m, p) => Math.max(m, p[1]), CFG.reset_backlog);
    const xs = niceStep(maxT, 6), ys = niceStep(maxB, 4);
    const xMax = Math.ceil(maxT / xs) * xs, yMax = Math.ceil(maxB / ys) * ys;
    const X = (t) => L + (t / xMax) * (W - L - R);
    const Y = (b) => H - B - (b / yMax) * (H - T - B);
    const parts = [];
    for (let v = 0; v <= yMax + 1e-9; v += ys) {
      parts.push(node("line", { class: "grid", x1: L, x2: W - R, y1: Y(v), y2: Y(v) }));
      parts.push(node("text", { class: "tick", x: L - 6, y: Y(v) + 4, "text-anchor": "end" }, fmt(v)));
    }
    for (let v = 0; v <= xMax + 1e-9; v += xs) {
      parts.push(node("text", { class: "tick", x: X(v), y: H - B + 16, "text-anchor": "middle" }, fmt(v)));
    }
    parts.push(node("text", { class: "tick", x: W - R, y: H - 2, "text-anchor": "end" }, "elapsed (s)"));
    parts.push(node("text", { class: "tick", x: L - 6, y: 12 }, "backlog (units)"));
    for (const t of lab.changes) {
      const line = node("line", { class: "change", x1: X(t), x2: X(t), y1: T, y2: H - B });
      line.appendChild(node("title", {}, `rate changed at ${t.toFixed(1)} s`));
      parts.push(line);
    }
    parts.push(node("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
    parts.push(node("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
    parts.push(node("polyline", { class: "curve", points: lab.history.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ") }));
    if (lab.history.length <= 80) {
      for (const p of lab.history) {
        const dot = node("circle", { class: "dot", cx: X(p[0]), cy: Y(p[1]), r: 3 });
        dot.appendChild(node("title", {}, `${p[0].toFixed(1)} s: ${fmt(p[1])} units`));
        parts.push(dot);
      }
    }
    svg.replaceChildren(...parts);
  }

  // -- wiring --
  for (const which of ["arrival", "service"]) {
    const input = $(which);
    input.value = String(lab[which]);
    input.addEventListener("input", () => { setRate(which, input.value); render(); });
  }
  $("reset").addEventListener("click", () => { reset(); render(); });
  $("step").addEventListener("click", () => {
    if (invalid.arrival || invalid.service) {
      render("Step refused: the lab keeps its state until every rate is a number of 0 or more.");
      return;
    }
    step();
    render();
  });
  reset();
  render();
})();
