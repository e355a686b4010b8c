// Fleet view (#/ and #/?row=R&rack=K&host=H): every GPU a cell on ONE canvas,
// grouped by row, rack and host, coloured by health or by a metric. Values live
// in typed arrays indexed like the layout; a repaint is one lookup per GPU into
// PALETTE and a fillRect, grouped by colour so the fill style changes at most
// once per palette entry.

import * as api from './api.js';
import { h, clear, select, gpuHref, fmtDateTime } from './dom.js';
import { HEALTH, METRICS, METRIC_BY_ID, NO_DATA, PALETTE, RAMP_BASE, RAMP_STEPS, BACKGROUND, formatValue, scaleFor, typedValues } from './colors.js';
import { selectGpus, buildTree, hostLabelWidth, computeGeometry, hitTest, labelBox, hostLabelOrigin } from './fleetgeom.js';
import { renderHealthLegend, renderMetricLegend } from './legend.js';
import { ReplayBar } from './replay.js';

const REFRESH_MS = 5000;
const LEVELS = ['cluster', 'row', 'rack', 'host'];

/** The fleet hash for a zoom filter and colour: '#/?row=..&rack=..&color=..'. */
export function fleetHash(filter, color) {
  const p = new URLSearchParams();
  for (const k of LEVELS) if (filter[k] !== undefined && filter[k] !== null) p.set(k, filter[k]);
  if (color && color !== 'health') p.set('color', color);
  const s = p.toString();
  return s ? `#/?${s}` : '#/';
}

const display = (s, what) => (s === '' || s === null || s === undefined ? `(no ${what})` : s);

/** Cuts text to maxW px with an ellipsis (binary search over the length). */
function fit(ctx, text, maxW) {
  if (maxW <= 0) return '';
  if (ctx.measureText(text).width <= maxW) return text;
  let lo = 0;
  let hi = text.length;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (ctx.measureText(`${text.slice(0, mid)}…`).width <= maxW) lo = mid;
    else hi = mid - 1;
  }
  return lo > 0 ? `${text.slice(0, lo)}…` : '';
}

export class FleetView {
  constructor(root, app) {
    this.app = app;
    this.root = root;
    this.disposed = false;
    this.live = true;
    this.seq = 0; // newer live refreshes supersede older ones still in flight
    this.timer = 0;
    this.L = null;
    this.filter = {};
    this.color = 'health';
    // The frame on screen: values indexed like the layout.
    this.values = null;
    this.valuesColor = 'health';
    this.scale = [0, 1];
    this.frameTimeMs = null;
    this.stats = { paintMs: 0, refreshMs: 0 };
    this.counts = new Uint32Array(PALETTE.length);
    this.healthCounts = new Uint32Array(HEALTH.length);
    this.hover = null;
    this.pendingMove = null;
    this.buildDom();
  }

  buildDom() {
    this.crumbs = h('nav', { class: 'breadcrumb', 'aria-label': 'zoom' });
    this.colorSelect = select(
      [['health', 'Health'], ...METRICS.map((m) => [m.id, `${m.label}${m.unit ? ` (${m.unit})` : ''}`])],
      this.color,
      (v) => this.setColor(v),
      { class: 'color-select', 'aria-label': 'colour by' },
    );
    this.legend = h('div', { class: 'legend' });
    this.msg = h('div', { class: 'fleet-msg', role: 'status' });
    this.canvas = h('canvas', { class: 'fleet-canvas', role: 'img', 'aria-label': 'fleet map' });
    this.ctx = this.canvas.getContext('2d', { alpha: false });
    this.wrap = h('div', { class: 'fleet-canvas-wrap' }, this.canvas);
    this.replay = new ReplayBar(this);
    this.tooltip = document.getElementById('tooltip');
    this.el = h(
      'section',
      { class: 'fleet' },
      h('div', { class: 'fleet-toolbar' }, this.crumbs, h('label', { class: 'color-label' }, 'Colour ', this.colorSelect), this.legend),
      this.msg,
      this.wrap,
      this.replay.el,
    );
    this.root.appendChild(this.el);

    this.onMove = (e) => {
      // One hit test per animation frame, however fast the mouse moves.
      if (!this.pendingMove) requestAnimationFrame(() => this.handleMove());
      this.pendingMove = e;
    };
    this.onLeave = () => {
      this.pendingMove = null;
      this.hideTooltip();
    };
    this.onClick = (e) => this.handleClick(e);
    this.onResize = () => {
      if (this.resizeQueued) return;
      this.resizeQueued = true;
      requestAnimationFrame(() => {
        this.resizeQueued = false;
        if (!this.disposed && this.tree) this.relayout();
      });
    };
    this.canvas.addEventListener('mousemove', this.onMove);
    this.canvas.addEventListener('mouseleave', this.onLeave);
    this.canvas.addEventListener('click', this.onClick);
    window.addEventListener('resize', this.onResize);
  }

  // ---- lifecycle ----------------------------------------------------------

  async start(params) {
    this.applyParams(params);
    try {
      const [L, f] = await Promise.all([api.layout(), api.frame(this.color)]);
      if (this.disposed) return;
      this.L = f.version !== L.version || f.values.length !== L.n ? await api.layout(true) : L;
      if (this.disposed) return;
      this.rebuild();
      this.acceptFrame(f);
      this.app.setStatus({ error: null });
    } catch (e) {
      if (this.disposed) return;
      this.showError(e);
      if (this.L) this.rebuild();
    }
    this.app.painted();
    this.scheduleRefresh();
  }

  /** A new hash for this view: zoom and colour, without refetching the layout. */
  update(params) {
    const oldFilter = JSON.stringify(this.filter);
    const oldColor = this.color;
    this.applyParams(params);
    if (this.color !== oldColor) this.setColor(this.color, true);
    if (JSON.stringify(this.filter) !== oldFilter && this.L) this.rebuild();
    // Before the first load finishes, start() resolves `ready` itself.
    if (this.L) this.app.painted();
  }

  unmount() {
    this.disposed = true;
    clearTimeout(this.timer);
    this.replay.dispose();
    window.removeEventListener('resize', this.onResize);
    this.hideTooltip();
    this.el.remove();
  }

  applyParams(params) {
    this.filter = {};
    for (const k of LEVELS) if (params.has(k)) this.filter[k] = params.get(k);
    const c = params.get('color');
    this.color = c && METRIC_BY_ID.has(c) ? c : 'health';
    this.colorSelect.value = this.color;
  }

  // ---- data ---------------------------------------------------------------

  setColor(color, fromHash = false) {
    this.color = color;
    this.colorSelect.value = color;
    // Replace, not push: the back button walks zoom levels, not colour changes.
    if (!fromHash) history.replaceState(null, '', fleetHash(this.filter, color));
    if (this.replay.active) this.replay.reload();
    else this.refresh();
  }

  setLive(live) {
    this.live = live;
    clearTimeout(this.timer);
    this.seq++; // drop any live frame still in flight
    if (live) this.refresh();
  }

  scheduleRefresh() {
    clearTimeout(this.timer);
    if (this.disposed || !this.live) return;
    this.timer = setTimeout(() => this.refresh(), REFRESH_MS);
  }

  /** One live refresh: the frame call only; the layout only when its version moved. */
  async refresh() {
    clearTimeout(this.timer);
    const seq = ++this.seq;
    const color = this.color;
    try {
      const f = await api.frame(color);
      if (this.disposed || seq !== this.seq || !this.live) return;
      if (!this.L || f.version !== this.L.version || f.values.length !== this.L.n) {
        this.L = await api.layout(true);
        if (this.disposed || seq !== this.seq) return;
        this.rebuild();
      }
      this.acceptFrame(f);
      this.app.setStatus({ error: null });
    } catch (e) {
      if (!this.disposed && seq === this.seq) this.showError(e);
    } finally {
      if (seq === this.seq) this.scheduleRefresh();
    }
  }

  acceptFrame(f) {
    const t0 = performance.now();
    if (f.values.length !== this.L.n) throw new api.ApiError(`frame has ${f.values.length} values, layout ${this.L.n} GPUs (version ${f.version} vs ${this.L.version})`);
    const color = f.color || this.color;
    // Live frames reuse their own buffer (never a replay's subarray).
    this.liveBuf = typedValues(color, f.values, this.liveBuf);
    this.values = this.liveBuf;
    this.valuesColor = color;
    this.scale = color === 'health' ? [0, 1] : scaleFor(METRIC_BY_ID.get(color), this.values);
    this.frameTimeMs = f.time_ms ?? Date.now();
    this.paintCells();
    this.renderLegend();
    this.msg.textContent = '';
    this.stats.refreshMs = performance.now() - t0 + api.timings.lastParseMs;
    this.app.setStatus({ gpus: this.L.n, refreshed: Date.now(), warnings: f.warnings });
  }

  /** A replay step: values already typed, scale fixed over the whole replay. */
  showFrame(color, values, timeMs, scale) {
    const t0 = performance.now();
    this.values = values;
    this.valuesColor = color;
    this.scale = scale;
    this.frameTimeMs = timeMs;
    this.paintCells();
    this.renderLegend();
    if (this.hover !== null) this.showTooltipFor(this.hover.pos, this.hover.x, this.hover.y);
    this.stats.stepMs = performance.now() - t0;
  }

  showError(e) {
    const msg = e && e.message ? e.message : String(e);
    this.msg.textContent = msg;
    this.app.setStatus({ error: msg });
  }

  // ---- layout and painting ------------------------------------------------

  rebuild() {
    const L = this.L;
    this.sel = selectGpus(L, this.filter);
    this.tree = buildTree(L, this.sel);
    this.posOf = new Int32Array(L.n).fill(-1);
    for (let p = 0; p < this.sel.length; p++) this.posOf[this.sel[p]] = p;
    this.ci = new Uint16Array(this.sel.length);
    this.order = new Int32Array(this.sel.length);
    this.ctx.font = '11px system-ui, sans-serif';
    this.hostW = hostLabelWidth(this.tree, (s) => this.ctx.measureText(s).width);
    if (this.values && this.values.length !== L.n) this.values = null;
    this.renderCrumbs();
    if (this.sel.length === 0) this.msg.textContent = L.n === 0 ? 'No GPUs have reported yet.' : 'No GPU matches this zoom.';
    this.relayout();
  }

  relayout() {
    const width = Math.max(320, this.wrap.clientWidth);
    const top = this.wrap.getBoundingClientRect().top + window.scrollY;
    const avail = Math.max(240, window.innerHeight - top - this.replay.el.offsetHeight - 12);
    const g = computeGeometry(this.tree, this.sel, width, avail, this.hostW);
    this.geom = g;
    const dpr = window.devicePixelRatio || 1;
    this.dpr = dpr;
    this.canvas.width = Math.round(g.width * dpr);
    this.canvas.height = Math.round(g.height * dpr);
    this.canvas.style.width = `${g.width}px`;
    this.canvas.style.height = `${g.height}px`;
    // Cells in device pixels, so every edge is on a pixel boundary and a cell is
    // one flat colour at any devicePixelRatio.
    const n = this.sel.length;
    this.dx = new Int32Array(n);
    this.dy = new Int32Array(n);
    for (let p = 0; p < n; p++) {
      this.dx[p] = Math.round(g.cx[p] * dpr);
      this.dy[p] = Math.round(g.cy[p] * dpr);
    }
    this.dcs = Math.max(1, Math.round(g.cs * dpr));
    this.paintStatic();
    this.paintCells();
  }

  paintStatic() {
    const { ctx, geom: g, dpr } = this;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = BACKGROUND;
    ctx.fillRect(0, 0, g.width, g.height);
    ctx.textBaseline = 'middle';
    for (const row of g.rows) {
      ctx.font = '600 13px system-ui, sans-serif';
      ctx.fillStyle = '#d0d7de';
      const name = g.multiCluster ? `${display(row.cluster, 'cluster')} / ${display(row.row, 'row')}` : display(row.row, 'row');
      const label = fit(ctx, name, g.width - 120);
      ctx.fillText(label, 8, row.y + 11);
      const labelW = ctx.measureText(label).width; // in the label's own font
      ctx.font = '11px system-ui, sans-serif';
      ctx.fillStyle = '#7d8590';
      ctx.fillText(`${row.count} GPU${row.count === 1 ? '' : 's'}`, 8 + labelW + 12, row.y + 11);
      for (const rk of row.racks) {
        ctx.fillStyle = '#181c22';
        ctx.fillRect(rk.x, rk.y, rk.w, rk.h);
        ctx.strokeStyle = '#2a313b';
        ctx.lineWidth = 1;
        ctx.strokeRect(rk.x + 0.5, rk.y + 0.5, rk.w - 1, rk.h - 1);
        ctx.font = '11px system-ui, sans-serif';
        if (g.rackHead) {
          ctx.fillStyle = '#9aa4b2';
          ctx.fillText(fit(ctx, display(rk.rack, 'rack'), rk.w - 2 * g.pad), rk.x + g.pad, rk.y + g.rackHead / 2 + 1);
        }
        if (g.hostW) {
          ctx.fillStyle = '#8b949e';
          for (const hs of rk.hosts) {
            const [hx, hy] = hostLabelOrigin(g, hs);
            ctx.fillText(fit(ctx, display(hs.host, 'host'), g.hostW - 6), hx, hy + g.cs / 2);
          }
        }
      }
    }
    ctx.setTransform(1, 0, 0, 1, 0, 0);
  }

  /** Recolours every cell from the current values: no allocation, no request. */
  paintCells() {
    if (!this.geom) return;
    const t0 = performance.now();
    const { sel, ci, order, counts, ctx, dx, dy, dcs } = this;
    const n = sel.length;
    const v = this.values;
    if (!v) ci.fill(NO_DATA);
    else if (this.valuesColor === 'health') {
      for (let p = 0; p < n; p++) ci[p] = v[sel[p]];
    } else {
      const [lo, hi] = this.scale;
      const k = (RAMP_STEPS - 1) / (hi - lo);
      for (let p = 0; p < n; p++) {
        const x = v[sel[p]];
        if (x !== x) ci[p] = NO_DATA; // NaN: no sample
        else {
          const t = Math.round((x - lo) * k);
          ci[p] = RAMP_BASE + (t < 0 ? 0 : t > RAMP_STEPS - 1 ? RAMP_STEPS - 1 : t);
        }
      }
    }
    // Counting sort by colour, then one fillStyle per colour in use.
    counts.fill(0);
    for (let p = 0; p < n; p++) counts[ci[p]]++;
    let acc = 0;
    const start = new Uint32Array(PALETTE.length);
    for (let c = 0; c < PALETTE.length; c++) {
      start[c] = acc;
      acc += counts[c];
    }
    const next = start.slice();
    for (let p = 0; p < n; p++) order[next[ci[p]]++] = p;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    for (let c = 0; c < PALETTE.length; c++) {
      if (counts[c] === 0) continue;
      ctx.fillStyle = PALETTE[c];
      for (let j = start[c], end = start[c] + counts[c]; j < end; j++) {
        const p = order[j];
        ctx.fillRect(dx[p], dy[p], dcs, dcs);
      }
    }
    for (let s = 0; s < HEALTH.length; s++) this.healthCounts[s] = counts[s];
    this.stats.paintMs = performance.now() - t0;
  }

  renderLegend() {
    if (this.valuesColor === 'health') renderHealthLegend(this.legend, this.values ? this.healthCounts : null);
    else renderMetricLegend(this.legend, METRIC_BY_ID.get(this.valuesColor), this.scale);
  }

  renderCrumbs() {
    clear(this.crumbs);
    const parts = [['Fleet', {}]];
    const acc = {};
    for (const k of LEVELS) {
      if (this.filter[k] === undefined) continue;
      acc[k] = this.filter[k];
      parts.push([display(this.filter[k], k), { ...acc }, k]);
    }
    parts.forEach(([label, f, level], j) => {
      if (j > 0) this.crumbs.appendChild(h('span', { class: 'sep', 'aria-hidden': 'true' }, '›'));
      const last = j === parts.length - 1;
      const item = last ? h('span', { class: 'crumb current', 'aria-current': 'page' }, label) : h('a', { class: 'crumb', href: fleetHash(f, this.color) }, label);
      if (level) item.dataset.level = level;
      this.crumbs.appendChild(item);
    });
    this.crumbs.appendChild(h('span', { class: 'crumb-count' }, `${this.sel.length} GPU${this.sel.length === 1 ? '' : 's'}`));
  }

  // ---- interaction ------------------------------------------------------------

  eventXY(e) {
    const r = this.canvas.getBoundingClientRect();
    return [e.clientX - r.left, e.clientY - r.top];
  }

  handleMove() {
    const e = this.pendingMove;
    this.pendingMove = null;
    if (!e || this.disposed || !this.geom) return;
    const [x, y] = this.eventXY(e);
    const hit = hitTest(this.geom, x, y);
    this.canvas.style.cursor = hit ? 'pointer' : 'default';
    if (hit && hit.level === 'gpu') {
      this.hover = { pos: hit.pos, x: e.clientX, y: e.clientY };
      this.showTooltipFor(hit.pos, e.clientX, e.clientY);
    } else if (hit) {
      this.hover = null;
      this.showGroupTooltip(hit, e.clientX, e.clientY);
    } else this.hideTooltip();
  }

  handleClick(e) {
    if (!this.geom) return;
    const [x, y] = this.eventXY(e);
    const hit = hitTest(this.geom, x, y);
    if (!hit) return;
    if (hit.level === 'gpu') {
      location.hash = gpuHref(this.L.uuid[this.sel[hit.pos]]);
      return;
    }
    const g = hit.group;
    const f = {};
    if (this.filter.cluster !== undefined || this.geom.multiCluster) f.cluster = g.cluster;
    f.row = g.row;
    if (hit.level === 'rack' || hit.level === 'host') f.rack = g.rack;
    if (hit.level === 'host') f.host = g.host;
    const target = fleetHash(f, this.color);
    if (target !== fleetHash(this.filter, this.color)) location.hash = target;
  }

  showTooltipFor(pos, cx, cy) {
    const L = this.L;
    const i = this.sel[pos];
    const tt = this.tooltip;
    clear(tt);
    tt.appendChild(h('div', { class: 'tt-title' }, display(L.host[i], 'host')));
    tt.appendChild(h('div', null, `GPU ${L.gpu[i]}`));
    tt.appendChild(h('div', { class: 'tt-mono' }, L.uuid[i]));
    tt.appendChild(h('div', null, `rack ${display(L.rack[i], 'rack')} · row ${display(L.row[i], 'row')}${L.cluster[i] ? ` · ${L.cluster[i]}` : ''}`));
    if (this.values) {
      if (this.valuesColor === 'health') {
        const st = HEALTH[this.values[i]];
        tt.appendChild(h('div', { class: `tt-value state-${st.key}` }, `state: ${st.label}`));
      } else {
        const m = METRIC_BY_ID.get(this.valuesColor);
        tt.appendChild(h('div', { class: 'tt-value' }, `${m.label}: ${formatValue(m, this.values[i])}`));
      }
    }
    if (this.replay.active && this.frameTimeMs) tt.appendChild(h('div', { class: 'tt-dim' }, `at ${fmtDateTime(this.frameTimeMs)}`));
    const events = this.app.eventsFor(L.uuid[i]);
    if (events.length) {
      const list = h('ul', { class: 'tt-events' });
      for (const ev of events) {
        list.appendChild(h('li', { class: `sev-${ev.severity}` }, `${ev.kind} · ${ev.severity}${ev.xid !== null && ev.xid !== undefined ? ` · xid ${ev.xid}` : ''}`, ev.action ? h('div', { class: 'tt-dim' }, ev.action) : null));
      }
      tt.appendChild(list);
    } else tt.appendChild(h('div', { class: 'tt-dim' }, 'no active events'));
    this.placeTooltip(cx, cy);
  }

  showGroupTooltip(hit, cx, cy) {
    const g = hit.group;
    const tt = this.tooltip;
    clear(tt);
    const name = hit.level === 'row' ? g.row : hit.level === 'rack' ? g.rack : g.host;
    tt.appendChild(h('div', { class: 'tt-title' }, `${hit.level} ${display(name, hit.level)}`));
    const n = hit.level === 'host' ? g.end - g.start : g.count;
    tt.appendChild(h('div', { class: 'tt-dim' }, `${n} GPU${n === 1 ? '' : 's'} · click to zoom`));
    this.placeTooltip(cx, cy);
  }

  placeTooltip(cx, cy) {
    const tt = this.tooltip;
    tt.hidden = false;
    const w = tt.offsetWidth;
    const hh = tt.offsetHeight;
    let x = cx + 14;
    let y = cy + 14;
    if (x + w > window.innerWidth - 4) x = Math.max(4, cx - w - 14);
    if (y + hh > window.innerHeight - 4) y = Math.max(4, cy - hh - 14);
    tt.style.left = `${x}px`;
    tt.style.top = `${y}px`;
  }

  hideTooltip() {
    this.hover = null;
    if (this.tooltip) this.tooltip.hidden = true;
  }

  // ---- test hook --------------------------------------------------------------

  cellRect(uuid) {
    if (!this.L || !this.geom) return null;
    const i = this.L.index.get(uuid);
    if (i === undefined) return null;
    const p = this.posOf[i];
    if (p < 0) return null;
    const r = this.canvas.getBoundingClientRect();
    return { x: r.left + this.geom.cx[p], y: r.top + this.geom.cy[p], w: this.geom.cs, h: this.geom.cs };
  }

  labelRect(level, name) {
    if (!this.geom) return null;
    const r = this.canvas.getBoundingClientRect();
    for (const row of this.geom.rows) {
      const cands = level === 'row' ? [row] : level === 'rack' ? row.racks : level === 'host' ? row.racks.flatMap((rk) => rk.hosts) : [];
      for (const g of cands) {
        if (g[level] !== name) continue;
        const b = labelBox(this.geom, level, g);
        return b ? { x: r.left + b.x, y: r.top + b.y, w: b.w, h: b.h } : null;
      }
    }
    return null;
  }
}

export function mountFleet(root, params, app) {
  const view = new FleetView(root, app);
  view.start(params);
  return view;
}
