// pdserve's KV block map: one canvas grid per instance, fed by /dashboard/feed (SSE).
//
// Each instance sends one snapshot (one byte per block, base64) and then deltas (changed
// block ids + their bytes); the page keeps the map and its counts incrementally and paints
// only the cells that changed, into one ImageData per instance, once per animation frame.
// Byte layout (services/common/state_feed.py): bits 0-1 state (0 free, 1 in use, 2 pinned,
// 3 null block), bit 2 cached (holds a block hash). window.pdDash is the test hook.
"use strict";
(() => {
  const FREE = 0, USED = 1, PINNED = 2, NULL_BLOCK = 3, CACHED = 4, STATE = 3;
  const ORDER = { running: 0, transfer: 1, pinned: 2, waiting: 3, preempted: 4, paused: 5,
                  held: 6 };
  const MAX_ROWS = 40, TABLE_INTERVAL_MS = 500;
  const RATE_WINDOW_S = 5, HIST_WINDOW_S = 60;

  const cssVar = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  function packed(hex) { // "#rrggbb" -> the Uint32 of an RGBA pixel (little endian)
    const n = parseInt(hex.slice(1), 16);
    return (0xff << 24 | (n & 0xff) << 16 | (n >> 8 & 0xff) << 8 | n >> 16) >>> 0;
  }
  const COLORS = new Uint32Array(8);
  const PALETTE = {};
  function loadColors() {
    for (const k of ["free", "evictable", "used", "pinned", "null", "sel", "shared", "prefix"]) {
      PALETTE[k] = cssVar("--" + k);
    }
    COLORS[FREE] = packed(PALETTE.free); COLORS[FREE | CACHED] = packed(PALETTE.evictable);
    COLORS[USED] = COLORS[USED | CACHED] = packed(PALETTE.used);
    COLORS[PINNED] = COLORS[PINNED | CACHED] = packed(PALETTE.pinned);
    COLORS[NULL_BLOCK] = COLORS[NULL_BLOCK | CACHED] = packed(PALETTE.null);
  }

  function b64bytes(s) {
    const bin = atob(s), out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => "&#" + c.charCodeAt(0) + ";");
  const fmt = (x, d = 1) => (x === null || x === undefined || !isFinite(x)) ? "–" : x.toFixed(d);
  const pct = (x) => (x === null || !isFinite(x)) ? "–" : (100 * x).toFixed(1) + "%";

  function quantile(bounds, counts, q) { // Prometheus' histogram_quantile over cumulative counts
    const total = counts.length ? counts[counts.length - 1] : 0;
    if (!total) return null;
    const rank = q * total;
    for (let i = 0; i < counts.length; i++) {
      if (counts[i] >= rank) {
        const hi = bounds[i] === null ? bounds[i - 1] : bounds[i];
        if (bounds[i] === null) return hi;
        const lo = i ? bounds[i - 1] : 0, below = i ? counts[i - 1] : 0;
        const inBucket = counts[i] - below;
        return inBucket ? lo + (hi - lo) * (rank - below) / inBucket : hi;
      }
    }
    return null;
  }

  // ---------------------------------------------------------------- performance probes
  const perf = { gaps: [], lags: [], applyMs: [], renderMs: [], frames: 0, lastRaf: 0 };
  function rafProbe(t) {
    if (perf.lastRaf) { perf.gaps.push(t - perf.lastRaf); if (perf.gaps.length > 240) perf.gaps.shift(); }
    perf.lastRaf = t; perf.frames++;
    requestAnimationFrame(rafProbe);
  }
  let lagExpected = performance.now() + 50;
  setInterval(() => {
    const now = performance.now();
    perf.lags.push(Math.max(0, now - lagExpected)); if (perf.lags.length > 400) perf.lags.shift();
    lagExpected = now + 50;
  }, 50);
  const pctl = (xs, q) => { if (!xs.length) return 0; const s = [...xs].sort((a, b) => a - b);
    return s[Math.min(s.length - 1, Math.floor(q * s.length))]; };

  // ---------------------------------------------------------------- one instance
  class Instance {
    constructor(role, address) {
      this.role = role; this.address = address; this.key = role + "@" + address;
      this.seq = 0; this.map = null; this.counts = new Int32Array(8); this.frame = null;
      this.requests = []; this.byId = new Map(); this.holders = null; this.selected = null;
      this.history = []; this.down = null; this.dirty = []; this.fullPaint = true;
      this.overlayDirty = true; this.textDirty = true; this.geom = null; this.auditOk = null;
      this.build();
    }

    build() {
      const card = this.card = document.createElement("section");
      card.className = "card"; card.dataset.key = this.key;
      card.innerHTML = `
        <h2><span class="role">${esc(this.role)}</span><span class="addr">${esc(this.address)}</span>
          <span class="meta"></span><span class="check"></span></h2>
        <div class="row">
          <div class="gridwrap"><canvas class="base"></canvas><canvas class="cells"></canvas>
            <canvas class="path"></canvas></div>
          <div class="side"><div class="stats"></div>
            <div class="hist"><h3>TTFT <span class="q ttftq"></span></h3><canvas class="ttft" width="330" height="54"></canvas></div>
            <div class="hist"><h3>ITL <span class="q itlq"></span></h3><canvas class="itl" width="330" height="54"></canvas></div>
            <div class="hist tierbox" hidden><h3>KV tiers <span class="q tierq"></span></h3>
              <table class="tiers"><thead><tr><th>tier</th><th>blocks</th><th>MiB</th><th>hit rate</th>
                <th>loads/s</th><th>stores/s</th><th>load p50</th></tr></thead><tbody></tbody></table></div>
          </div>
        </div>
        <div class="detail"></div>
        <table class="reqs"><thead><tr><th>request</th><th>status</th><th>tokens</th>
          <th>cached</th><th>blocks</th><th>block table (logical → physical)</th></tr></thead>
          <tbody></tbody></table>`;
      const q = (s) => card.querySelector(s);
      this.el = { meta: q(".meta"), check: q(".check"), wrap: q(".gridwrap"), base: q("canvas.base"),
        cells: q("canvas.cells"), path: q("canvas.path"), stats: q(".stats"), detail: q(".detail"),
        tbody: q("table.reqs tbody"), tierbox: q(".tierbox"), tiers: q("table.tiers tbody"),
        tierq: q(".tierq"), ttft: q("canvas.ttft"), itl: q("canvas.itl"), ttftq: q(".ttftq"),
        itlq: q(".itlq") };
      this.el.tbody.addEventListener("click", (ev) => {
        const tr = ev.target.closest("tr.req");
        if (tr) this.select(tr.dataset.rid === this.selected ? null : tr.dataset.rid);
      });
      this.el.path.addEventListener("mousemove", (ev) => this.hover(ev));
      this.el.path.addEventListener("mouseleave", () => { tip.style.display = "none"; });
      this.el.path.addEventListener("click", (ev) => {
        const b = this.blockAt(ev); if (b === null) return;
        const holders = this.requests.filter((r) => r.blocks.includes(b));
        if (holders.length) this.select(holders[0].id);
      });
      const list = document.getElementById("instances");
      card.dataset.order = (this.role === "prefill" ? "0" : "1") + this.address;
      const after = [...list.children].find((c) => c.dataset.order > card.dataset.order);
      list.insertBefore(card, after || null);
    }

    // -- frames --------------------------------------------------------------------------
    apply(f) {
      const t0 = performance.now();
      if (f.snapshot) {
        const map = b64bytes(f.blocks);
        if (!this.map || this.map.length !== map.length) { this.map = map; this.layout(); }
        else this.map = map;
        this.counts.fill(0);
        for (let i = 1; i < map.length; i++) this.counts[map[i]]++;
        this.fullPaint = true;
      } else {
        if (!this.map || f.seq !== this.seq + 1) return false; // a gap: ask for a snapshot
        const states = b64bytes(f.blocks), ids = f.ids, map = this.map, counts = this.counts;
        for (let k = 0; k < ids.length; k++) {
          const i = ids[k], s = states[k];
          if (i > 0) { counts[map[i]]--; counts[s]++; }
          map[i] = s; this.dirty.push(i);
        }
      }
      this.seq = f.seq; this.frame = f; this.down = null;
      this.requests = f.requests.sort((a, b) => (ORDER[a.status] ?? 9) - (ORDER[b.status] ?? 9));
      this.byId = new Map(this.requests.map((r) => [r.id, r]));
      const holders = this.holders && this.holders.length === this.map.length ? this.holders
        : new Uint16Array(this.map.length);
      holders.fill(0);
      for (const r of this.requests) for (const b of r.blocks) holders[b]++;
      this.holders = holders;
      const c = this.pageCounts(), s = f.state;
      this.auditOk = c.free === s.num_free_blocks && c.used === s.num_used_blocks &&
        c.pinned === s.num_pinned_blocks && c.cached === s.num_cached_blocks;
      this.history.push({ t: f.time, prompt: f.prompt_tokens, gen: f.generation_tokens,
        q: f.prefix_queries, h: f.prefix_hits, ttft: f.ttft, itl: f.itl, tiers: f.tiers || [] });
      while (this.history.length > 2 && this.history[0].t < f.time - HIST_WINDOW_S) this.history.shift();
      this.overlayDirty = this.textDirty = true;
      perf.applyMs.push(performance.now() - t0); if (perf.applyMs.length > 400) perf.applyMs.shift();
      return true;
    }

    pageCounts() { // the leak audit's definitions (null block excluded)
      const c = this.counts;
      return { free: c[FREE] + c[FREE | CACHED], evictable: c[FREE | CACHED],
        used: c[USED] + c[USED | CACHED] + c[PINNED] + c[PINNED | CACHED],
        in_use: c[USED] + c[USED | CACHED], pinned: c[PINNED] + c[PINNED | CACHED],
        cached: c[FREE | CACHED] + c[USED | CACHED] + c[PINNED | CACHED] + c[NULL_BLOCK | CACHED] };
    }

    // -- geometry and painting -------------------------------------------------------------
    layout() {
      const n = this.map.length;
      const width = Math.max(300, Math.floor(this.el.wrap.clientWidth || 600));
      const maxH = n > 20000 ? 640 : 420;
      let cell = Math.floor(Math.sqrt(width * maxH / n));
      cell = Math.max(1, Math.min(18, cell));
      const cols = Math.max(1, Math.floor(width / cell)), rows = Math.ceil(n / cols);
      const W = cols * cell, H = rows * cell;
      for (const cv of [this.el.base, this.el.cells, this.el.path]) { cv.width = W; cv.height = H; }
      this.el.wrap.style.height = H + "px";
      const ctx = this.el.base.getContext("2d");
      const img = ctx.createImageData(W, H);
      this.geom = { cell, cols, rows, W, H, ctx, img, pix: new Uint32Array(img.data.buffer),
        inner: cell >= 5 ? cell - 1 : cell };
      this.fullPaint = true; this.overlayDirty = true;
    }

    paintCell(i) {
      const g = this.geom, color = COLORS[this.map[i]];
      const x0 = (i % g.cols) * g.cell, y0 = Math.floor(i / g.cols) * g.cell;
      for (let dy = 0; dy < g.inner; dy++) {
        const row = (y0 + dy) * g.W + x0;
        for (let dx = 0; dx < g.inner; dx++) g.pix[row + dx] = color;
      }
    }

    render() {
      if (!this.map) return;
      const g = this.geom;
      if (this.fullPaint) {
        g.pix.fill(0xffffffff);
        for (let i = 0; i < this.map.length; i++) this.paintCell(i);
        this.fullPaint = false; this.dirty = [];
        g.ctx.putImageData(g.img, 0, 0);
      } else if (this.dirty.length) {
        let y0 = Infinity, y1 = -1;
        for (const i of this.dirty) {
          this.paintCell(i);
          const y = Math.floor(i / g.cols) * g.cell; if (y < y0) y0 = y; if (y > y1) y1 = y;
        }
        this.dirty = [];
        g.ctx.putImageData(g.img, 0, 0, 0, y0, g.W, y1 - y0 + g.cell);
      }
      if (this.overlayDirty) { this.drawSelection(); this.overlayDirty = false; }
      if (this.textDirty) { this.drawText(); this.textDirty = false; }
    }

    center(i) {
      const g = this.geom;
      return [(i % g.cols) * g.cell + g.inner / 2, Math.floor(i / g.cols) * g.cell + g.inner / 2];
    }

    selection() { // the selected request's blocks, each with its role in the picture
      const r = this.selected && this.byId.get(this.selected);
      if (!r || !this.frame) return null;
      const bs = this.frame.state.block_size || 1, prefix = Math.floor(r.cached / bs);
      return { r, prefix, blocks: r.blocks.map((b, j) => ({ b, j,
        kind: j < prefix ? "prefix" : this.holders[b] > 1 ? "shared" : "sel" })) };
    }

    drawSelection() {
      const g = this.geom, cells = this.el.cells.getContext("2d"), path = this.el.path.getContext("2d");
      cells.clearRect(0, 0, g.W, g.H); path.clearRect(0, 0, g.W, g.H);
      const s = this.selection();
      if (!s) return;
      const pad = g.cell >= 5 ? 0 : 0;
      for (const { b, kind } of s.blocks) {
        cells.fillStyle = PALETTE[kind];
        cells.fillRect((b % g.cols) * g.cell - pad, Math.floor(b / g.cols) * g.cell - pad,
          g.inner + 2 * pad, g.inner + 2 * pad);
      }
      if (s.blocks.length > 1) { // the block table in logical order
        path.strokeStyle = "rgba(60, 20, 120, .55)"; path.lineWidth = Math.max(1, g.cell / 8);
        path.beginPath();
        s.blocks.forEach(({ b }, j) => { const [x, y] = this.center(b); j ? path.lineTo(x, y) : path.moveTo(x, y); });
        path.stroke();
      }
      if (g.cell >= 14) {
        path.fillStyle = "#fff"; path.font = `${Math.floor(g.cell * 0.55)}px system-ui`;
        path.textAlign = "center"; path.textBaseline = "middle";
        for (const { b, j } of s.blocks) { const [x, y] = this.center(b); path.fillText(String(j), x, y); }
      }
    }

    drawText() {
      const f = this.frame, s = f.state, c = this.pageCounts();
      this.el.meta.textContent = `${s.instance_id || ""} · seq ${this.seq} · ${this.map.length} blocks of ${s.block_size} tokens`;
      this.el.check.textContent = this.auditOk ? "✓ counts = leak audit" : "✗ counts ≠ leak audit";
      this.el.check.className = "check " + (this.auditOk ? "ok" : "bad");
      const h = this.history, last = h[h.length - 1];
      let base = h[0];
      for (const e of h) if (e.t <= last.t - RATE_WINDOW_S) base = e;
      const dt = last.t - base.t;
      const rate = (k) => dt > 0 ? (last[k] - base[k]) / dt : null;
      const dq = last.q - base.q, hitRecent = dq > 0 ? (last.h - base.h) / dq : null;
      const sends = f.transfers.filter((t) => t.direction === "send").length;
      const recvs = f.transfers.filter((t) => t.direction === "receive").length;
      const usable = this.map.length - 1;
      const rows = [
        ["free (incl. evictable)", `${c.free}`], ["cached, evictable", `${c.evictable}`],
        ["in use", `${c.in_use}`], ["pinned for transfer", `${c.pinned}`],
        ["cached (hashed)", `${c.cached}`], ["KV usage", pct(usable ? c.used / usable : 0)],
        ["running / waiting", `${s.num_running} / ${s.num_waiting}`],
        ["preemptions", `${f.preemptions}`],
        ["prefix hit rate (recent / all)", `${pct(hitRecent)} / ${pct(f.prefix_queries ? f.prefix_hits / f.prefix_queries : null)}`],
        ["prompt tok/s", fmt(rate("prompt"))], ["generated tok/s", fmt(rate("gen"))],
        ["KV transfers in flight", this.role === "prefill" ? `${sends} sending` : `${recvs} receiving`],
      ];
      this.el.stats.innerHTML = rows.map(([k, v]) => `<span class="k">${k}</span><span class="v">${v}</span>`).join("");
      this.el.stats.dataset.free = c.free; this.el.stats.dataset.used = c.used;
      this.el.stats.dataset.pinned = c.pinned; this.el.stats.dataset.cached = c.cached;
      this.drawHist(this.el.ttft, this.el.ttftq, "ttft");
      this.drawHist(this.el.itl, this.el.itlq, "itl");
      this.drawTiers(base, dt);
      // NOTE: the table is the page's costliest part to lay out (300 rows rebuilt at 4 Hz
      // stalled the page for ~120 ms a frame with 100,000 blocks): a few rows, twice a second.
      const now = performance.now();
      if (this.tableForced || now - (this.tableAt || 0) >= TABLE_INTERVAL_MS) {
        this.drawTable(); this.tableAt = now; this.tableForced = false;
      }
      this.drawDetail();
    }

    drawHist(canvas, label, key) {
      const h = this.history, now = h[h.length - 1][key], then = h[0][key];
      const ctx = canvas.getContext("2d"); ctx.clearRect(0, 0, canvas.width, canvas.height);
      if (!now || !now.counts.length) { label.textContent = "no samples"; return; }
      const cum = now.counts.map((v, i) => v - (then && then.counts.length === now.counts.length ? then.counts[i] : 0));
      const total = cum[cum.length - 1];
      const q = (x) => quantile(now.bounds, cum, x);
      label.textContent = total ? `last ${HIST_WINDOW_S}s: p50 ${fmt(q(.5) * 1000, 0)} ms · p90 ${fmt(q(.9) * 1000, 0)} ms · p99 ${fmt(q(.99) * 1000, 0)} ms · n=${total}` : "no samples in the last minute";
      const per = cum.map((v, i) => v - (i ? cum[i - 1] : 0)), max = Math.max(1, ...per);
      const w = canvas.width / per.length;
      ctx.fillStyle = "#6c7a91";
      per.forEach((v, i) => { const bh = (canvas.height - 12) * v / max; ctx.fillRect(i * w + 1, canvas.height - 12 - bh, w - 2, bh); });
      ctx.fillStyle = "#5b6472"; ctx.font = "9px system-ui"; ctx.textAlign = "center";
      now.bounds.forEach((b, i) => { if (i % 3 === 0) ctx.fillText(b === null ? "+Inf" : String(b), i * w + w / 2, canvas.height - 2); });
    }

    drawTiers(base, dt) { // one row per KV tier (none without a disk tier): rates as tokens/s
      const h = this.history, last = h[h.length - 1], tiers = last.tiers;
      this.el.tierbox.hidden = !tiers.length;
      if (!tiers.length) return;
      const of = (e, name) => e.tiers.find((t) => t.tier === name);
      const rows = tiers.map((t) => {
        const b = of(base, t.tier), disk = t.tier !== "memory"; // memory: no loads or stores
        const rate = (k) => disk && b && dt > 0 ? fmt((t[k] - b[k]) / dt) : "–";
        let p50 = null;
        if (t.load_seconds && t.load_seconds.counts.length) { // the last minute, as TTFT's
          const then = of(h[0], t.tier), h0 = then && then.load_seconds, now = t.load_seconds;
          const cum = now.counts.map((v, i) => v - (h0 && h0.counts.length === now.counts.length ? h0.counts[i] : 0));
          p50 = quantile(now.bounds, cum, 0.5);
        }
        return `<tr data-tier="${esc(t.tier)}"><td>${esc(t.tier)}</td><td>${t.blocks}</td>` +
          `<td>${fmt(t.bytes / 1048576)}</td><td>${pct(t.queries ? t.hits / t.queries : null)}</td>` +
          `<td>${rate("loads")}</td><td>${rate("stores")}</td>` +
          `<td>${p50 === null ? "–" : fmt(p50 * 1000, 1) + " ms"}</td></tr>`;
      });
      const html = rows.join("");
      if (html !== this.tiersHtml) { this.el.tiers.innerHTML = html; this.tiersHtml = html; }
      const d = of(last, "disk");
      this.el.tierq.textContent = d ? `disk: ${d.failures} failures · ${d.evictions} evictions` : "";
    }

    drawTable() {
      const shown = this.requests.slice(0, MAX_ROWS);
      const sel = this.selected && this.byId.get(this.selected);
      if (sel && !shown.includes(sel)) shown.push(sel);
      const rows = shown.map((r) => {
        const short = r.id.length > 18 ? r.id.slice(0, 17) + "…" : r.id;
        const table = r.blocks.slice(0, 24).map((b, j) => `${j}→${b}`).join(" ") + (r.blocks.length > 24 ? " …" : "");
        return `<tr class="req${r.id === this.selected ? " selected" : ""}" data-rid="${esc(r.id)}">` +
          `<td title="${esc(r.id)}">${esc(short)}</td><td>${esc(r.status)}${r.lora ? " · " + esc(r.lora) : ""}</td>` +
          `<td>${r.computed}/${r.tokens}</td><td>${r.cached}</td><td>${r.blocks.length}</td>` +
          `<td class="blocks">${table}</td></tr>`;
      });
      if (this.requests.length > shown.length) rows.push(`<tr><td colspan="6">… and ${this.requests.length - shown.length} more (click a block to select its request)</td></tr>`);
      if (!rows.length) rows.push(`<tr><td colspan="6">no request holds or waits for blocks</td></tr>`);
      const html = rows.join("");
      if (html !== this.tableHtml) { this.el.tbody.innerHTML = html; this.tableHtml = html; }
    }

    drawDetail() {
      const s = this.selection();
      if (!s) { this.el.detail.textContent = this.selected ? `${this.selected}: finished (no longer holds blocks)` : "Select a request to light up its block table."; return; }
      const shared = new Map();
      for (const o of this.requests) {
        if (o.id === s.r.id) continue;
        const n = o.blocks.filter((b) => this.holders[b] > 1 && s.r.blocks.includes(b)).length;
        if (n) shared.set(o.id, n);
      }
      const nShared = s.blocks.filter((x) => this.holders[x.b] > 1).length;
      this.el.detail.innerHTML = `<b>${esc(s.r.id)}</b> (${esc(s.r.status)}): ${s.blocks.length} blocks; ` +
        `cached prefix ${s.prefix} blocks (${s.r.cached} tokens); shares ${nShared} blocks` +
        (shared.size ? " with " + [...shared].slice(0, 6).map(([id, n]) => `${esc(id.slice(0, 12))} (${n})`).join(", ") : "");
    }

    // -- interaction -------------------------------------------------------------------------
    select(rid) {
      this.selected = rid; this.overlayDirty = this.textDirty = this.tableForced = true; schedule();
    }

    blockAt(ev) {
      if (!this.geom) return null;
      const rect = this.el.path.getBoundingClientRect(), g = this.geom;
      const x = Math.floor((ev.clientX - rect.left) / g.cell), y = Math.floor((ev.clientY - rect.top) / g.cell);
      const i = y * g.cols + x;
      return x >= 0 && x < g.cols && i >= 0 && i < this.map.length ? i : null;
    }

    hover(ev) {
      const b = this.blockAt(ev);
      if (b === null) { tip.style.display = "none"; return; }
      const s = this.map[b], names = ["free", "in use", "pinned", "null block"];
      const holders = this.requests.filter((r) => r.blocks.includes(b)).map((r) => r.id.slice(0, 14));
      tip.textContent = `block ${b}: ${names[s & STATE]}${s & CACHED ? ", cached" : ""}` +
        (holders.length ? ` · held by ${holders.slice(0, 4).join(", ")}${holders.length > 4 ? "…" : ""}` : "");
      tip.style.left = ev.clientX + 12 + "px"; tip.style.top = ev.clientY + 12 + "px"; tip.style.display = "block";
    }

    highlightedPixels() { // block ids whose cell is painted on the selection layer
      const g = this.geom; if (!g) return [];
      const data = this.el.cells.getContext("2d").getImageData(0, 0, g.W, g.H).data, out = [];
      for (let i = 0; i < this.map.length; i++) {
        const [x, y] = this.center(i);
        if (data[(Math.floor(y) * g.W + Math.floor(x)) * 4 + 3] > 0) out.push(i);
      }
      return out;
    }

    markDown(error) { this.down = error; this.el.meta.innerHTML = `<span class="down">down: ${esc(error)}</span>`; }
  }

  // ---------------------------------------------------------------- the feed
  const tip = document.getElementById("tip");
  const statusEl = document.getElementById("status");
  const instances = new Map();
  let source = null, paused = false, framesSeen = 0, scheduled = false;

  function schedule() { if (!scheduled) { scheduled = true; requestAnimationFrame(renderAll); } }
  function renderAll() {
    scheduled = false;
    const t0 = performance.now();
    for (const inst of instances.values()) inst.render();
    drawTransfers();
    perf.renderMs.push(performance.now() - t0); if (perf.renderMs.length > 400) perf.renderMs.shift();
  }

  function drawTransfers() {
    const all = [];
    for (const inst of instances.values()) {
      if (!inst.frame) continue;
      for (const t of inst.frame.transfers) all.push({ ...t, at: inst.address, role: inst.role });
    }
    const el = document.getElementById("transfers");
    if (!all.length) { el.textContent = "KV transfers in flight: none"; return; }
    el.innerHTML = "KV transfers in flight: " + all.slice(0, 20).map((t) => t.direction === "receive"
      ? `<b>${esc(t.id.slice(0, 14))}</b> ${esc(t.peer)} → ${esc(t.at)} (${t.blocks} blocks, ${fmt(t.seconds, 2)} s)`
      : `<b>${esc(t.id.slice(0, 14))}</b> ${esc(t.at)} sending (${t.blocks} blocks, ${fmt(t.seconds, 2)} s)`).join(" · ");
  }

  function instanceFor(role, address) {
    const key = role + "@" + address;
    let inst = instances.get(key);
    if (!inst) { inst = new Instance(role, address); instances.set(key, inst); }
    return inst;
  }

  function connect() {
    if (source) source.close();
    source = new EventSource("dashboard/feed?interval=0.25");
    statusEl.textContent = "connecting…";
    source.addEventListener("hello", () => { statusEl.textContent = "live"; });
    source.addEventListener("frame", (ev) => {
      const f = JSON.parse(ev.data);
      const inst = instanceFor(f.role, f.address);
      if (!inst.apply(f)) { connect(); return; } // a gap in the deltas: start over
      framesSeen++;
      statusEl.textContent = `live · ${framesSeen} frames`;
      schedule();
    });
    source.addEventListener("down", (ev) => {
      const d = JSON.parse(ev.data);
      const inst = instances.get(d.role + "@" + d.address);
      if (inst) inst.markDown(d.error);
    });
    source.addEventListener("resync", () => { for (const inst of instances.values()) inst.seq = 0; });
    source.onerror = () => { statusEl.textContent = "disconnected; retrying…"; };
  }

  function pause() {
    paused = true; if (source) { source.close(); source = null; }
    document.getElementById("pause").textContent = "Resume";
    statusEl.textContent = "paused at " + [...instances.values()].map((i) => `${i.role} seq ${i.seq}`).join(", ");
  }
  function resume() { paused = false; document.getElementById("pause").textContent = "Pause"; connect(); }
  document.getElementById("pause").addEventListener("click", () => (paused ? resume() : pause()));
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { for (const i of instances.values()) if (i.map) i.layout(); schedule(); }, 150);
  });

  window.pdDash = {
    instances: () => [...instances.values()].map((i) => ({ key: i.key, role: i.role, address: i.address,
      instance_id: i.frame && i.frame.state.instance_id, seq: i.seq, num_blocks: i.map ? i.map.length : 0,
      counts: i.pageCounts(), state: i.frame && i.frame.state, audit_ok: i.auditOk,
      tiers: i.frame ? i.frame.tiers || [] : [],
      requests: i.requests.map((r) => ({ id: r.id, status: r.status, blocks: r.blocks, cached: r.cached })) })),
    select: (key, rid) => { instances.get(key).select(rid); },
    selected: (key) => instances.get(key).selected,
    selectedBlocks: (key) => { const s = instances.get(key).selection(); return s ? s.blocks.map((x) => x.b) : []; },
    highlightedPixels: (key) => instances.get(key).highlightedPixels(),
    rendered: () => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve))),
    perf: () => ({ frames: perf.frames, fps: perf.gaps.length ? 1000 / pctl(perf.gaps, 0.5) : 0,
      gap_p99_ms: pctl(perf.gaps, 0.99), gap_max_ms: perf.gaps.length ? Math.max(...perf.gaps) : 0,
      lag_p99_ms: pctl(perf.lags, 0.99), lag_max_ms: perf.lags.length ? Math.max(...perf.lags) : 0,
      apply_p99_ms: pctl(perf.applyMs, 0.99), apply_max_ms: perf.applyMs.length ? Math.max(...perf.applyMs) : 0,
      render_p99_ms: pctl(perf.renderMs, 0.99), render_max_ms: perf.renderMs.length ? Math.max(...perf.renderMs) : 0 }),
    resetPerf: () => { perf.gaps = []; perf.lags = []; perf.applyMs = []; perf.renderMs = []; },
    pause, resume, isPaused: () => paused, frames: () => framesSeen,
  };

  loadColors();
  requestAnimationFrame(rafProbe);
  connect();
})();
