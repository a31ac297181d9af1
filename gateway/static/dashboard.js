// Pagoda's memory page: the paged KV cache of each engine, live from /dashboard/events (falling back
// to polling /dashboard/snapshot), or replayed from snapshots embedded in the page (`pagoda bench
// memory --replay`). Plain JavaScript, no dependencies. Snapshots carry token counts only, never text.
//
// One panel per scheduler (keyed by its scheduler_id: two schedulers of one engine group are two
// panels), removed when the scheduler leaves (`event: gone`, or missing from a polled reply).
//
// For tests and the curious, window.pagoda holds the page's state: panels (scheduler_id -> panel),
// errors, panel(key), blocks(key, pool) (the reference counts as last drawn), tables(key) (the
// block tables as listed), highlighted(key), blockInfo(key, block, pool) (the hover text),
// events(key), gaps(key), select(id), take(snapshot), gone(scheduler_id), seek(index), timings
// (median milliseconds per part of the page's last draws). A key is a scheduler_id, or an engine
// id naming that engine's first panel, or nothing: the first panel.
(function () {
  "use strict";

  const MAX_POINTS = 600; // time series points kept per engine (2.5 min at 4 snapshots/s)
  const MAX_EVENTS = 1000; // events kept per engine; the newest MAX_EVENT_ROWS are listed
  const MAX_EVENT_ROWS = 200;
  const MAX_TABLE_ROWS = 100; // block tables listed (the selected request's first)
  const MAX_TABLE_BLOCKS = 32; // blocks drawn per table before "+N" and its last two
  const POLL_MS = 1000;
  const STALE_S = 5; // a panel whose snapshot is this much older than the newest is greyed
  const ROLL_CALL_MS = 3000; // after (re)connecting, a panel no snapshot names in this long is gone
  const MAX_TIMINGS = 50; // draws per part kept for the median
  const MAP_HEIGHT = { gpu: 240, cpu: 240 }; // the most CSS pixels a pool's map may take

  // ---------------------------------------------------------------------------- errors into the page
  const errors = [];
  function reportError(message) {
    errors.push(String(message));
    document.body.dataset.errors = String(errors.length);
    const box = document.getElementById("errors");
    box.hidden = false;
    box.textContent = errors.slice(-5).join("\n");
  }
  window.onerror = function (message, source, line, column, error) {
    reportError((error && error.stack) || message + " (" + source + ":" + line + ":" + column + ")");
  };
  window.addEventListener("unhandledrejection", function (event) {
    reportError("unhandled rejection: " + ((event.reason && event.reason.stack) || event.reason));
  });

  // ---------------------------------------------------------------------------- state
  const panels = new Map(); // scheduler_id -> Panel (never a plain object: any id must work as a key)
  let selected = null; // the selected request id
  let source = "connecting";
  const params = new URLSearchParams(location.search);
  const apiKey = params.get("api_key");
  const dataQuery = apiKey ? "?api_key=" + encodeURIComponent(apiKey) : "";
  if (params.has("api_key")) { // kept in memory for the data requests, out of the address bar and history
    params.delete("api_key");
    const rest = params.toString();
    history.replaceState(history.state, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
  }

  function Panel(engine, schedulerId) {
    this.engine = engine; // the engine group's id
    this.id = schedulerId;
    this.snapshot = null;
    this.series = []; // {step, time, stats}
    this.events = []; // oldest first, each once; {gap: N} where N events were not seen
    this.lastEventId = null; // the newest event id taken
    this.view = null; // derived from snapshot: per pool owners (see derive)
    this.drawn = { gpu: null, cpu: null, tables: null }; // what each map and the tables show now
    this.rendered = {}; // keys of what the DOM shows, to redraw only on change
    this.el = null;
  }

  function byPanel(a, b) { // by engine, then scheduler_id (as /dashboard/snapshot lists them)
    return a.engine < b.engine ? -1 : a.engine > b.engine ? 1 : a.id < b.id ? -1 : a.id > b.id ? 1 : 0;
  }

  function sortedPanels() {
    return Array.from(panels.values()).sort(byPanel);
  }

  // Take one scheduler's snapshot; false when it is the one already shown.
  function apply(snapshot) {
    let panel = panels.get(snapshot.scheduler_id);
    if (!panel) {
      panel = new Panel(snapshot.engine, snapshot.scheduler_id);
      panels.set(snapshot.scheduler_id, panel);
    }
    if (rollCall) rollCall.add(snapshot.scheduler_id);
    const old = panel.snapshot;
    if (old && old.version === snapshot.version && old.step === snapshot.step) return false;
    panel.snapshot = snapshot;
    panel.view = null;
    panel.series.push({ step: snapshot.step, time: snapshot.time, stats: snapshot.stats });
    if (panel.series.length > MAX_POINTS) panel.series.splice(0, panel.series.length - MAX_POINTS);
    takeEvents(panel, snapshot.events);
    return true;
  }

  // A scheduler's event ids increase by one per event and never restart: an id past the last one
  // taken is new, and a jump past last + 1 is events that left the snapshot's window (its latest
  // 256) between two snapshots, shown as one gap line.
  function takeEvents(panel, events) {
    for (const event of events) {
      const last = panel.lastEventId;
      if (last !== null && event.id <= last) continue;
      if (last !== null && event.id > last + 1) panel.events.push({ gap: event.id - last - 1, before: event.id });
      panel.events.push(Object.assign({ scheduler_id: panel.id }, event));
      panel.lastEventId = event.id;
    }
    if (panel.events.length > MAX_EVENTS) panel.events.splice(0, panel.events.length - MAX_EVENTS);
  }

  // The scheduler left: its panel goes.
  function gone(schedulerId) {
    const panel = panels.get(schedulerId);
    if (!panel) return;
    if (panel.el) panel.el.remove();
    panels.delete(schedulerId);
    document.getElementById("no-engines").hidden = panels.size > 0;
    scheduleRender();
  }

  // Per pool: which request holds each block (-1 none, -2 several), the tables holding each block.
  function poolView(refCounts, seqs, cached) {
    const n = refCounts.length;
    const owner = new Int32Array(n).fill(-1);
    const requests = [];
    const index = new Map();
    for (const seq of seqs) {
      let r = index.get(seq.request_id);
      if (r === undefined) {
        r = requests.length;
        index.set(seq.request_id, r);
        requests.push(seq.request_id);
      }
      for (const block of seq.block_table) {
        if (block < n) owner[block] = owner[block] === -1 || owner[block] === r ? r : -2;
      }
    }
    const isCached = new Uint8Array(n);
    for (const block of cached) if (block < n) isCached[block] = 1;
    return { counts: refCounts, owner: owner, requests: requests, index: index, cached: isCached, seqs: seqs };
  }

  function bySeq(seqs) {
    return seqs.sort((a, b) => (a.request_id < b.request_id ? -1 : a.request_id > b.request_id ? 1 : a.seq_id - b.seq_id));
  }

  function derive(panel) {
    if (!panel.view) {
      const s = panel.snapshot;
      panel.view = {
        gpu: poolView(s.ref_counts, bySeq(s.sequences.filter((q) => q.pool === "gpu")), s.cached),
        cpu: poolView(s.cpu_ref_counts, bySeq(s.sequences.filter((q) => q.pool === "cpu")), s.cpu_cached || []),
      };
    }
    return panel.view;
  }

  // The selected request's blocks in a pool, and of them those its samples or beams share.
  function highlight(view) {
    const blocks = new Set();
    const shared = new Set();
    if (selected === null) return { blocks: blocks, shared: shared };
    const holders = new Map();
    for (const seq of view.seqs) {
      if (seq.request_id !== selected) continue;
      for (const block of seq.block_table) {
        blocks.add(block);
        holders.set(block, (holders.get(block) || 0) + 1);
      }
    }
    for (const [block, count] of holders) if (count > 1) shared.add(block);
    return { blocks: blocks, shared: shared };
  }

  // ---------------------------------------------------------------------------- colours
  function hash(text) {
    let h = 2166136261;
    for (let i = 0; i < text.length; i++) {
      h ^= text.charCodeAt(i);
      h = Math.imul(h, 16777619);
    }
    return h >>> 0;
  }
  function hue(requestId) {
    return (hash(requestId) % 360 + 360) % 360;
  }
  function hsl(h, s, l) {
    // -> [r, g, b] in 0..255
    s /= 100;
    l /= 100;
    const k = (n) => (n + h / 30) % 12;
    const a = s * Math.min(l, 1 - l);
    const f = (n) => l - a * Math.max(-1, Math.min(k(n) - 3, Math.min(9 - k(n), 1)));
    return [Math.round(255 * f(0)), Math.round(255 * f(8)), Math.round(255 * f(4))];
  }
  function css(rgb) {
    return "rgb(" + rgb[0] + "," + rgb[1] + "," + rgb[2] + ")";
  }
  function pack(rgb) {
    // an ImageData pixel as one little-endian uint32: A B G R
    return ((255 << 24) | (rgb[2] << 16) | (rgb[1] << 8) | rgb[0]) >>> 0;
  }
  const FREE = [38, 43, 51], CACHED = [89, 97, 109], NULL_BLOCK = [0, 0, 0], SELECT = [255, 213, 74], WHITE = [255, 255, 255];
  const SEVERAL = [205, 210, 218]; // a block tables of several requests hold (a shared prefix)
  const P_FREE = pack(FREE), P_CACHED = pack(CACHED), P_NULL = pack(NULL_BLOCK), P_SELECT = pack(SELECT);
  const P_WHITE = pack(WHITE), P_SEVERAL = pack(SEVERAL), P_SEVERAL_DIM = pack([80, 84, 90]);
  function requestColour(requestId, shared, dim) {
    const h = hue(requestId);
    if (dim) return hsl(h, 30, shared ? 36 : 28);
    return shared ? hsl(h, 90, 72) : hsl(h, 65, 48);
  }

  // ---------------------------------------------------------------------------- block maps
  function drawMap(panel, pool, canvas, width) {
    const view = derive(panel)[pool];
    const n = view.counts.length;
    const key = [panel.snapshot.scheduler_id, panel.snapshot.version, panel.snapshot.step, selected, width].join("|");
    if (panel.rendered["map-" + pool] === key) return;
    panel.rendered["map-" + pool] = key;
    const cell = n ? Math.max(1, Math.min(16, Math.floor(Math.sqrt((width * MAP_HEIGHT[pool]) / n)))) : 16;
    const cols = Math.max(1, Math.floor(width / cell));
    const rows = Math.max(1, Math.ceil(n / cols));
    canvas.width = width;
    canvas.height = rows * cell;
    canvas.style.height = rows * cell + "px";
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(canvas.width, canvas.height);
    const pixels = new Uint32Array(image.data.buffer);
    pixels.fill(pack([20, 23, 28])); // the page's background between blocks
    const lit = highlight(view);
    const mark = new Uint8Array(n); // 1: the selected request's block, 2: shared by its samples or beams
    for (const b of lit.blocks) if (b < n) mark[b] = 1;
    for (const b of lit.shared) if (b < n) mark[b] = 2;
    const some = selected !== null;
    const colours = new Map(); // memo: request index * 4 + shared * 2 + dim -> packed
    const gap = cell >= 5 ? 1 : 0, size = cell - gap, W = canvas.width;
    const dot = cell >= 7 ? pack(WHITE) : 0, mid = Math.floor(size / 2);
    let used = 0, shared = 0;
    for (let b = 0; b < n; b++) {
      const count = view.counts[b];
      const owner = view.owner[b];
      let colour;
      if (count > 0) used++;
      if (count > 1) shared++;
      if (pool === "gpu" && b === 0) colour = P_NULL;
      else if (count === 0) colour = view.cached[b] ? P_CACHED : P_FREE;
      else if (mark[b] === 2) colour = P_SELECT;
      else if (owner === -2) colour = some && !mark[b] ? P_SEVERAL_DIM : P_SEVERAL;
      else if (owner < 0) colour = P_WHITE; // a count without a table: never in a consistent snapshot
      else {
        const dim = some && !mark[b];
        const memo = owner * 4 + (count > 1 ? 2 : 0) + (dim ? 1 : 0);
        colour = colours.get(memo);
        if (colour === undefined) {
          colour = pack(requestColour(view.requests[owner], count > 1, dim));
          colours.set(memo, colour);
        }
      }
      const x0 = (b % cols) * cell, y0 = ((b / cols) | 0) * cell;
      if (size === 1) pixels[y0 * W + x0] = colour;
      else for (let y = y0; y < y0 + size; y++) pixels.fill(colour, y * W + x0, y * W + x0 + size);
      if (dot && count > 1) { // shared: a white mark in the middle
        for (const [dx, dy] of [[0, 0], [-1, 0], [0, -1], [-1, -1]]) pixels[(y0 + mid + dy) * W + x0 + mid + dx] = dot;
      }
    }
    ctx.putImageData(image, 0, 0);
    panel.drawn[pool] = { counts: view.counts, cached: view.cached, cell: cell, cols: cols, n: n, lit: lit };
    canvas.dataset.blocks = String(n);
    canvas.dataset.used = String(used);
    canvas.dataset.shared = String(shared);
    canvas.dataset.draws = String(Number(canvas.dataset.draws || 0) + 1);
    const meta = panel.el.querySelector(".pool-" + pool + "-meta");
    meta.textContent = n ? n + " blocks · " + used + " used · " + cell + " px per block" : "none";
  }

  function blockInfo(panel, block, pool) {
    const view = derive(panel)[pool];
    if (block < 0 || block >= view.counts.length) return "";
    const count = view.counts[block];
    const lines = [(pool === "gpu" ? "GPU" : "CPU") + " block " + block];
    if (pool === "gpu" && block === 0) return lines.concat("the null block (padding)").join("\n");
    if (count === 0) {
      const cached = pool === "gpu" ? "cached: free, held by the prefix cache (evictable)"
        : "cached: in the prefix cache's CPU tier, copied back on a hit (evictable)";
      return lines.concat(view.cached[block] ? cached : "free").join("\n");
    }
    lines.push("reference count " + count + (count > 1 ? " (shared)" : ""));
    const holders = new Map(); // request -> [seq_id:logical]
    for (const seq of view.seqs) {
      seq.block_table.forEach((b, logical) => {
        if (b !== block) return;
        if (!holders.has(seq.request_id)) holders.set(seq.request_id, []);
        holders.get(seq.request_id).push("seq " + seq.seq_id + " [" + logical + "]");
      });
    }
    for (const [request, seqs] of holders) lines.push(request + ": " + seqs.join(", "));
    return lines.join("\n");
  }

  function blockAt(panel, pool, canvas, event) {
    const drawn = panel.drawn[pool];
    if (!drawn) return -1;
    const rect = canvas.getBoundingClientRect();
    const x = ((event.clientX - rect.left) * canvas.width) / rect.width;
    const y = ((event.clientY - rect.top) * canvas.height) / rect.height;
    const col = Math.floor(x / drawn.cell), row = Math.floor(y / drawn.cell);
    if (col < 0 || col >= drawn.cols) return -1;
    const block = row * drawn.cols + col;
    return block < drawn.n ? block : -1;
  }

  function wireMap(panel, pool, canvas) {
    const tooltip = document.getElementById("tooltip");
    canvas.addEventListener("mousemove", function (event) {
      const block = blockAt(panel, pool, canvas, event);
      if (block < 0) {
        tooltip.hidden = true;
        return;
      }
      tooltip.textContent = blockInfo(panel, block, pool);
      tooltip.dataset.block = String(block);
      tooltip.hidden = false;
      tooltip.style.left = Math.min(event.clientX + 14, window.innerWidth - tooltip.offsetWidth - 4) + "px";
      tooltip.style.top = event.clientY + 14 + "px";
    });
    canvas.addEventListener("mouseleave", function () {
      tooltip.hidden = true;
    });
    canvas.addEventListener("click", function (event) {
      const block = blockAt(panel, pool, canvas, event);
      if (block < 0) return;
      const view = derive(panel)[pool];
      const owner = view.owner[block];
      select(owner >= 0 ? view.requests[owner] : null);
    });
  }

  // ---------------------------------------------------------------------------- time series
  const CHARTS = {
    slots: { percent: true, lines: [
      ["token states", "--c0", (s) => (s.allocated_slots ? s.token_slots / s.allocated_slots : 0)],
      ["internal fragmentation", "--c1", (s) => (s.allocated_slots ? 1 - s.token_slots / s.allocated_slots : 0)],
    ] },
    blocks: { lines: [
      ["used", "--c0", (s) => s.num_used_blocks],
      ["shared", "--c2", (s) => s.num_shared_blocks],
      ["saved by sharing", "--c1", (s) => s.blocks_saved_by_sharing],
      ["cached", "--c3", (s) => s.num_cached_blocks],
    ] },
    requests: { lines: [
      ["running", "--c0", (s) => s.num_running],
      ["waiting", "--c3", (s) => s.num_waiting],
      ["swapped", "--c1", (s) => s.num_swapped],
    ] },
    preemptions: { lines: [
      ["preemptions", "--text", (s) => s.num_preemptions],
      ["copy-on-write copies", "--c1", (s) => s.num_cow_copies],
    ] },
  };

  function drawChart(panel, name, canvas, width) {
    const last = panel.series[panel.series.length - 1];
    const key = [panel.series.length, last && last.step, last && last.time, width].join("|");
    if (panel.rendered["chart-" + name] === key) return;
    panel.rendered["chart-" + name] = key;
    const chart = CHARTS[name];
    const height = 110;
    canvas.width = width;
    canvas.height = height;
    const ctx = canvas.getContext("2d");
    const style = getComputedStyle(document.documentElement);
    ctx.clearRect(0, 0, width, height);
    const points = panel.series;
    const values = chart.lines.map((line) => points.map((p) => Number(line[2](p.stats || {})) || 0));
    let top = chart.percent ? 1 : Math.max(1, ...values.map((v) => Math.max(0, ...v)));
    const pad = { left: 4, right: 4, top: 14, bottom: 4 };
    const w = width - pad.left - pad.right, h = height - pad.top - pad.bottom;
    ctx.strokeStyle = "#2c323c";
    ctx.beginPath();
    ctx.moveTo(pad.left, pad.top + 0.5);
    ctx.lineTo(width - pad.right, pad.top + 0.5);
    ctx.moveTo(pad.left, pad.top + h - 0.5);
    ctx.lineTo(width - pad.right, pad.top + h - 0.5);
    ctx.stroke();
    ctx.fillStyle = "#8a93a0";
    ctx.font = "11px ui-monospace, monospace";
    ctx.fillText(chart.percent ? "100%" : String(top), pad.left + 2, pad.top + 12);
    const n = points.length;
    values.forEach((v, i) => {
      ctx.strokeStyle = style.getPropertyValue(chart.lines[i][1]).trim() || "#fff";
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      for (let j = 0; j < n; j++) {
        const x = pad.left + (n > 1 ? (j * w) / (n - 1) : w);
        const y = pad.top + h - (Math.min(v[j], top) / top) * h;
        if (j === 0) ctx.moveTo(x, y);
        else ctx.lineTo(x, y);
      }
      ctx.stroke();
    });
    const latest = values.map((v) => format(v[v.length - 1] || 0, chart.percent));
    let now = latest.map((value, i) => chart.lines[i][0] + " " + value).join(" · ");
    if (ctx.measureText(now).width > width - pad.left - pad.right) now = latest.join(" · "); // too narrow: the values alone
    ctx.fillStyle = "#8a93a0";
    ctx.textAlign = "right";
    ctx.fillText(now, width - pad.right, 10);
    canvas.dataset.points = String(n);
    canvas.dataset.last = JSON.stringify(values.map((v) => v[v.length - 1] || 0));
  }

  function format(value, percent) {
    return percent ? (100 * value).toFixed(1) + "%" : String(Math.round(value * 100) / 100);
  }

  // ---------------------------------------------------------------------------- block tables, events
  function tableRows(panel) {
    const s = panel.snapshot;
    const rows = s.sequences.slice();
    rows.sort((a, b) => (b.request_id === selected) - (a.request_id === selected)
      || (a.request_id < b.request_id ? -1 : a.request_id > b.request_id ? 1 : a.seq_id - b.seq_id));
    return rows.slice(0, MAX_TABLE_ROWS).map((seq) => ({
      request_id: seq.request_id, seq_id: seq.seq_id, status: seq.status, pool: seq.pool, num_tokens: seq.num_tokens,
      block_table: seq.block_table, lora: seq.lora || "",
      last_block_slots: seq.block_table.length ? seq.num_slots - (seq.block_table.length - 1) * s.block_size : 0,
    }));
  }

  function renderTables(panel) {
    const s = panel.snapshot;
    const key = [s.scheduler_id, s.version, s.step, selected].join("|");
    if (panel.rendered.tables === key) return;
    panel.rendered.tables = key;
    const box = panel.el.querySelector(".tables");
    const counts = { gpu: s.ref_counts, cpu: s.cpu_ref_counts };
    const fragment = document.createDocumentFragment();
    const rows = tableRows(panel);
    for (const row of rows) {
      const div = el("div", "table-row" + (row.request_id === selected ? " selected" : ""));
      div.dataset.requestId = row.request_id;
      div.dataset.seqId = String(row.seq_id);
      div.dataset.pool = row.pool;
      div.dataset.lastBlockSlots = String(row.last_block_slots);
      const who = el("div", "who");
      const swatch = el("i");
      swatch.style.background = css(requestColour(row.request_id, false, false));
      who.append(swatch, shortId(row.request_id) + " ");
      who.append(el("span", "status", "seq " + row.seq_id + " · " + row.status + " · " + row.num_tokens + " tokens"
        + (row.pool === "cpu" ? " · CPU" : "") + (row.lora ? " · LoRA " + row.lora : "")));
      who.title = row.request_id;
      const blocks = el("div", "blocks");
      const table = row.block_table;
      const shown = table.length > MAX_TABLE_BLOCKS ? MAX_TABLE_BLOCKS - 2 : table.length;
      const add = (logical) => {
        const physical = table[logical];
        const count = counts[row.pool][physical] || 0;
        const box = el("span", "blk" + (count > 1 ? " shared" : ""), String(physical));
        box.title = "logical " + logical + " → " + row.pool.toUpperCase() + " block " + physical + " (reference count " + count + ")";
        if (logical === table.length - 1) {
          const fill = el("span", "fill");
          fill.style.width = (100 * row.last_block_slots) / s.block_size + "%";
          box.append(fill);
          box.title += "; " + row.last_block_slots + " of " + s.block_size + " slots filled";
        }
        blocks.append(box);
      };
      for (let i = 0; i < shown; i++) add(i);
      if (shown < table.length) {
        blocks.append(el("span", "blk more", "+" + (table.length - shown - 2)));
        add(table.length - 2);
        add(table.length - 1);
      }
      div.append(who, blocks);
      div.addEventListener("click", () => select(selected === row.request_id ? null : row.request_id));
      fragment.append(div);
    }
    if (s.sequences.length > rows.length) fragment.append(el("p", "dim", (s.sequences.length - rows.length) + " more sequences"));
    if (!rows.length) fragment.append(el("p", "dim", "no sequence holds blocks"));
    box.replaceChildren(fragment);
    box.dataset.rows = String(rows.length);
    panel.drawn.tables = rows;
  }

  function shortId(requestId) {
    // cmpl-cebcae8ac15a454f99612013eecfc449-0 -> cmpl-cebcae8a…c449-0 (the whole id on hover)
    return requestId.length > 24 ? requestId.slice(0, 13) + "…" + requestId.slice(-6) : requestId;
  }

  // "[3, 4, 5, 6, 7, 8] +34 more": the first blocks, and how many of num_blocks are not listed (an
  // event carries at most its first 32 blocks; num_blocks counts them all, and may be absent).
  const LISTED_BLOCKS = 6;
  function describeBlocks(event) {
    const b = event.blocks;
    if (event.kind === "cow") return b[0] + " → " + b[1];
    const total = Math.max(b.length, event.num_blocks === undefined ? 0 : event.num_blocks);
    const listed = b.slice(0, LISTED_BLOCKS);
    return "[" + listed.join(", ") + "]" + (total > listed.length ? " +" + (total - listed.length) + " more" : "");
  }

  function renderEvents(panel) {
    const last = panel.events[panel.events.length - 1];
    const key = [panel.events.length, last && last.id, selected].join("|");
    if (panel.rendered.events === key) return;
    panel.rendered.events = key;
    const list = panel.el.querySelector(".events");
    const fragment = document.createDocumentFragment();
    const events = panel.events.slice(-MAX_EVENT_ROWS).reverse();
    for (const event of events) {
      if (event.gap !== undefined) {
        const li = el("li", "gap dim", event.gap + (event.gap === 1 ? " event" : " events") + " not shown");
        li.dataset.gap = String(event.gap);
        li.title = "they left the scheduler's window of its latest events between two snapshots";
        fragment.append(li);
        continue;
      }
      const li = el("li", event.request_id && event.request_id === selected ? "selected" : "");
      li.dataset.eventId = String(event.id);
      li.dataset.kind = event.kind;
      const when = new Date(event.time * 1000).toISOString().slice(11, 23);
      li.append(el("span", "dim", when + " step " + event.step + " "), el("span", "kind kind-" + event.kind, event.kind));
      const who = event.request_id ? shortId(event.request_id) + (event.seq_id >= 0 ? " seq " + event.seq_id : "") + ": " : "";
      li.append(who + describeBlocks(event));
      const blocks = event.kind === "cow" ? "" : (event.num_blocks || event.blocks.length) + " blocks: " + event.blocks.join(", ")
        + (event.num_blocks > event.blocks.length ? ", … (the first " + event.blocks.length + " listed)" : "");
      li.title = [event.request_id, blocks].filter(Boolean).join("\n");
      if (event.request_id) {
        li.addEventListener("click", () => select(event.request_id));
      }
      fragment.append(li);
    }
    if (!events.length) fragment.append(el("li", "dim", "none yet"));
    list.replaceChildren(fragment);
    list.dataset.count = String(panel.events.length);
  }

  function renderStats(panel, newest) {
    const s = panel.snapshot, st = s.stats || {};
    const behind = newest - s.time;
    const stale = behind > STALE_S; // idle, or no longer publishing (a scheduler that left is removed)
    panel.el.classList.toggle("stale", stale);
    panel.el.dataset.stale = stale ? "1" : "0";
    panel.el.querySelector(".engine-age").textContent = stale ? behind.toFixed(0) + " s behind the newest snapshot" : "";
    const usable = Math.max(1, s.num_gpu_blocks - 1);
    const parts = [
      ["step", s.step],
      ["used", (st.num_used_blocks || 0) + " / " + usable + " blocks (" + ((100 * (st.num_used_blocks || 0)) / usable).toFixed(1) + "%)"],
      ["shared", st.num_shared_blocks || 0], ["saved by sharing", st.blocks_saved_by_sharing || 0],
      ["cached", st.num_cached_blocks || 0], ["free", st.num_free_blocks || 0],
      ["token states", st.allocated_slots ? ((100 * st.token_slots) / st.allocated_slots).toFixed(1) + "% of allocated slots" : "-"],
      ["running", st.num_running || 0], ["waiting", st.num_waiting || 0], ["swapped", st.num_swapped || 0],
      ["preemptions", st.num_preemptions || 0],
    ];
    const box = panel.el.querySelector(".stats");
    box.replaceChildren(...parts.map((p) => {
      const span = el("span", "", p[0] + " ");
      span.append(el("b", "", String(p[1])));
      return span;
    }));
    panel.el.querySelector(".engine-meta").textContent = "block size " + s.block_size + " · " + s.num_gpu_blocks + " GPU blocks (the null block included) · " + s.num_cpu_blocks + " CPU blocks";
    panel.el.dataset.step = String(s.step);
    panel.el.dataset.version = String(s.version);
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // ---------------------------------------------------------------------------- rendering
  function mount(panel) {
    const node = document.getElementById("engine-template").content.firstElementChild.cloneNode(true);
    node.dataset.engine = panel.engine;
    node.dataset.scheduler = panel.id;
    node.querySelector(".engine-name").textContent = panel.engine;
    node.querySelector(".scheduler-name").textContent = panel.id;
    panel.el = node;
    const after = sortedPanels().find((other) => other.el && byPanel(other, panel) > 0);
    document.getElementById("engines").insertBefore(node, after ? after.el : null);
    wireMap(panel, "gpu", node.querySelector(".map-gpu"));
    wireMap(panel, "cpu", node.querySelector(".map-cpu"));
    document.getElementById("no-engines").hidden = true;
  }

  const spent = new Map(); // part -> milliseconds of the last MAX_TIMINGS renders that drew it
  function timed(part, draw) {
    const start = performance.now();
    draw();
    const ms = performance.now() - start;
    if (!spent.has(part)) spent.set(part, []);
    const list = spent.get(part);
    list.push(ms);
    if (list.length > MAX_TIMINGS) list.shift();
    return ms;
  }
  function median(values) {
    const sorted = values.slice().sort((a, b) => a - b);
    const mid = sorted.length >> 1;
    return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
  }
  function timings() { // median milliseconds per part, "page" the whole render
    const out = {};
    for (const [part, list] of spent) out[part] = Math.round(median(list) * 100) / 100;
    out.renders = (spent.get("page") || []).length;
    return out;
  }

  function measure(panel) { // CSS pixels across each canvas's box
    const across = (selector) => Math.max(100, Math.floor(panel.el.querySelector(selector).parentElement.clientWidth));
    return { gpu: across(".map-gpu"), cpu: across(".map-cpu"), chart: across(".chart-slots") };
  }

  let pending = false;
  function scheduleRender() {
    if (pending) return;
    pending = true;
    (document.hidden ? (f) => setTimeout(f, 0) : requestAnimationFrame)(render);
  }

  function render() {
    pending = false;
    timed("page", () => {
      const shown = sortedPanels().filter((panel) => panel.snapshot);
      const newest = Math.max(...shown.map((panel) => panel.snapshot.time));
      for (const panel of shown) if (!panel.el) mount(panel);
      // every width read before any write: one layout per render, not one per canvas
      const widths = [];
      timed("layout", () => shown.forEach((panel) => widths.push(measure(panel))));
      shown.forEach((panel, i) => {
        const width = widths[i];
        timed("stats", () => renderStats(panel, newest));
        timed("maps", () => {
          drawMap(panel, "gpu", panel.el.querySelector(".map-gpu"), width.gpu);
          drawMap(panel, "cpu", panel.el.querySelector(".map-cpu"), width.cpu);
        });
        timed("charts", () => {
          for (const chart of Object.keys(CHARTS)) drawChart(panel, chart, panel.el.querySelector(".chart-" + chart), width.chart);
        });
        timed("tables", () => renderTables(panel));
        timed("events", () => renderEvents(panel));
      });
    });
    document.body.dataset.selected = selected || "";
    window.pagoda.renders += 1;
  }

  function select(requestId) {
    selected = requestId || null;
    scheduleRender();
  }

  function take(snapshot) {
    if (apply(snapshot)) scheduleRender();
  }

  // ---------------------------------------------------------------------------- data: live
  function setSource(name, text) {
    source = name;
    document.body.dataset.source = name;
    document.getElementById("status").textContent = text;
  }

  // On (re)connecting, /dashboard/events sends every live scheduler's snapshot at once; a panel none
  // of them names in ROLL_CALL_MS left while the page was not listening (it saw no `event: gone`).
  let rollCall = null; // the scheduler_ids named since the last connect, while counting
  function startRollCall() {
    const present = (rollCall = new Set());
    setTimeout(() => {
      if (rollCall !== present) return; // a newer connect counts again
      rollCall = null;
      for (const id of Array.from(panels.keys())) if (!present.has(id)) gone(id);
    }, ROLL_CALL_MS);
  }

  function connect() {
    if (!window.EventSource) return poll();
    const events = new EventSource("/dashboard/events" + dataQuery);
    let opened = false;
    events.addEventListener("open", () => {
      opened = true;
      setSource("events", "live (server-sent events)");
      startRollCall();
    });
    events.addEventListener("snapshot", (message) => take(JSON.parse(message.data)));
    events.addEventListener("gone", (message) => gone(JSON.parse(message.data).scheduler_id));
    events.addEventListener("error", () => {
      if (!opened || events.readyState === EventSource.CLOSED) {
        events.close(); // never opened or gave up: poll instead
        poll();
      } else {
        setSource("events", "reconnecting…");
      }
    });
  }

  function poll() {
    setSource("polling", "live (polling /dashboard/snapshot)");
    // a gateway that does not answer is retried; an error of the page's own is reported (unhandled)
    const once = () => fetch("/dashboard/snapshot" + dataQuery, { cache: "no-store" })
      .then((response) => {
        if (response.status === 401) {
          setSource("polling", "this server needs an API key: open /dashboard?api_key=KEY");
          return null;
        }
        return response.ok ? response.json() : null;
      }, () => {
        setSource("polling", "the gateway does not answer; retrying");
        return null;
      })
      .then((body) => {
        if (body) {
          setSource("polling", "live (polling /dashboard/snapshot)");
          const live = new Set(body.engines.map((snapshot) => snapshot.scheduler_id));
          for (const id of Array.from(panels.keys())) if (!live.has(id)) gone(id); // the reply lists every live one
          body.engines.forEach(take);
        }
      })
      .finally(() => setTimeout(once, POLL_MS));
    once();
  }

  // ---------------------------------------------------------------------------- data: replay
  let trace = null; // the embedded snapshots, in order
  let position = -1; // the last applied
  let timer = null;

  function reset() {
    for (const panel of panels.values()) if (panel.el) panel.el.remove();
    panels.clear();
    document.getElementById("no-engines").hidden = false;
  }

  function seek(index) {
    index = Math.max(0, Math.min(trace.length - 1, index));
    if (index < position) {
      reset();
      position = -1;
    }
    for (let i = Math.max(0, position + 1, index - MAX_POINTS * 4); i <= index; i++) apply(trace[i]);
    position = index;
    const s = trace[index];
    document.getElementById("replay-slider").value = String(index);
    document.getElementById("replay-label").textContent = "snapshot " + (index + 1) + " / " + trace.length
      + " · engine " + s.engine + " · scheduler " + s.scheduler_id + " · step " + s.step + " · +" + (s.time - trace[0].time).toFixed(2) + " s";
    document.body.dataset.position = String(index);
    render();
  }

  function play() {
    const button = document.getElementById("replay-play");
    if (timer !== null) {
      clearInterval(timer);
      timer = null;
      button.textContent = "▶";
      return;
    }
    if (position >= trace.length - 1) seek(0);
    button.textContent = "❚❚";
    timer = setInterval(() => {
      if (position >= trace.length - 1) return play();
      seek(position + 1);
    }, 120);
  }

  function startReplay(snapshots) {
    trace = snapshots;
    setSource("replay", "replay of " + snapshots.length + " snapshots");
    document.getElementById("replay").hidden = false;
    const slider = document.getElementById("replay-slider");
    slider.max = String(Math.max(0, snapshots.length - 1));
    slider.addEventListener("input", () => seek(Number(slider.value)));
    document.getElementById("replay-prev").addEventListener("click", () => seek(position - 1));
    document.getElementById("replay-next").addEventListener("click", () => seek(position + 1));
    document.getElementById("replay-play").addEventListener("click", play);
    document.addEventListener("keydown", (event) => {
      if (event.target.closest && event.target.closest("button, input")) return; // they have their own keys
      if (event.key === "ArrowLeft") seek(position - 1);
      else if (event.key === "ArrowRight") seek(position + 1);
      else if (event.key === " ") {
        event.preventDefault();
        play();
      }
    });
    // open where the most blocks are in use (a trace usually ends with every request done)
    let fullest = 0;
    snapshots.forEach((s, i) => { if ((s.stats || {}).num_used_blocks > ((snapshots[fullest].stats || {}).num_used_blocks || 0)) fullest = i; });
    if (!snapshots.length) return;
    if (location.hash === "#timings") drawEach();
    seek(fullest);
  }

  // `page.html#timings`: draw every snapshot once, in order, and write the median draw times into the
  // status line (`chromium --headless --dump-dom 'file:///…/page.html#timings'` prints them).
  function drawEach() {
    for (let i = 0; i < trace.length; i++) seek(i);
    const t = timings();
    const status = "drew " + trace.length + " snapshots; median ms per draw: page " + t.page + " (layout " + t.layout
      + ", block maps " + t.maps + ", block tables " + t.tables + ", events " + t.events + ", charts " + t.charts
      + ", stats " + t.stats + ")";
    setSource("replay", status);
    document.body.dataset.timings = JSON.stringify(t);
  }

  // ---------------------------------------------------------------------------- the page's state, for tests
  function panelOf(key) { // a scheduler_id, or an engine id (its first panel), or nothing (the first panel)
    const panel = key === undefined ? sortedPanels()[0] : panels.get(key) || sortedPanels().find((p) => p.engine === key);
    if (!panel) throw new Error("no panel " + key);
    return panel;
  }
  window.pagoda = {
    panels: panels,
    errors: errors,
    renders: 0,
    get timings() { return timings(); },
    get source() { return source; },
    get selected() { return selected; },
    panel: panelOf,
    select: select,
    take: take,
    gone: gone,
    seek: (index) => seek(index),
    blocks: (panel, pool) => { const d = panelOf(panel).drawn[pool || "gpu"]; return d ? d.counts : null; },
    cached: (panel) => { const d = panelOf(panel).drawn.gpu; return d ? Array.from(d.cached).flatMap((c, b) => (c ? [b] : [])) : null; },
    tables: (panel) => panelOf(panel).drawn.tables,
    highlighted: (panel, pool) => {
      const d = panelOf(panel).drawn[pool || "gpu"];
      return d ? { blocks: Array.from(d.lit.blocks).sort((a, b) => a - b), shared: Array.from(d.lit.shared).sort((a, b) => a - b) } : null;
    },
    blockInfo: (panel, block, pool) => blockInfo(panelOf(panel), block, pool || "gpu"),
    events: (panel) => panelOf(panel).events.filter((event) => event.gap === undefined),
    gaps: (panel) => panelOf(panel).events.filter((event) => event.gap !== undefined),
    colour: (requestId, shared) => requestColour(requestId, shared, false),
  };

  window.addEventListener("resize", scheduleRender);
  const embedded = document.getElementById("pagoda-trace");
  if (embedded) startReplay(JSON.parse(embedded.textContent));
  else connect();
})();
