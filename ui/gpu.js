// GPU page (#/gpu/<uuid>?range=1h): who the GPU is, its inventory, five charts
// over a chosen range and its health events. Ranges up to 6 h read raw samples
// through PromQL; 24 h and 7 d read the rollup tiers through SQL, since raw
// points over a week would be millions of samples for a chart 1,000 px wide.

import * as api from './api.js';
import { h, clear, errorBox, fmtDateTime, parseTs } from './dom.js';
import { METRIC_BY_ID } from './colors.js';
import { LineChart } from './chart.js';
import { fleetHash } from './fleet.js';

const CHART_METRICS = ['DCGM_FI_DEV_GPU_TEMP', 'DCGM_FI_DEV_POWER_USAGE', 'DCGM_FI_DEV_GPU_UTIL', 'DCGM_FI_DEV_SM_CLOCK', 'DCGM_FI_DEV_FB_USED'].map((id) => METRIC_BY_ID.get(id));

// [key, label, seconds, source, step]: step in seconds for PromQL, a duration for rollup().
const RANGES = [
  ['15m', '15 min', 900, 'raw', 5],
  ['1h', '1 h', 3600, 'raw', 15],
  ['6h', '6 h', 6 * 3600, 'raw', 60],
  ['24h', '24 h', 86400, 'rollup', '1m'],
  ['7d', '7 d', 7 * 86400, 'rollup', '1h'],
];
const DEFAULT_RANGE = '1h';
const STEP_MS = { '1m': 60e3, '1h': 3600e3 };

const INVENTORY = [
  ['model_name', 'model'],
  ['driver_version', 'driver'],
  ['vbios_version', 'VBIOS'],
  ['inforom_version', 'InfoROM'],
  ['cuda_driver_version', 'CUDA driver'],
  ['serial', 'serial'],
  ['pci_bus_id', 'PCI bus id'],
  ['mig_mode', 'MIG mode'],
  ['first_seen', 'first seen'],
  ['last_seen', 'last seen'],
];

export class GpuView {
  constructor(root, uuid, app) {
    this.app = app;
    this.uuid = uuid;
    this.disposed = false;
    this.loadSeq = 0;
    this.ident = null; // {cluster, row, rack, host, gpu}
    this.header = h('header', { class: 'gpu-header' }, h('h1', null, 'GPU ', h('span', { class: 'mono' }, uuid)));
    this.inventory = h('section', { class: 'panel inventory' }, h('h2', null, 'Inventory'), h('div', { class: 'muted' }, 'loading…'));
    this.rangeBar = h('nav', { class: 'range-bar', 'aria-label': 'time range' });
    this.charts = CHART_METRICS.map((m) => new LineChart(m));
    this.events = h('section', { class: 'panel events' }, h('h2', null, 'Health events'), h('div', { class: 'muted' }, 'loading…'));
    this.el = h(
      'section',
      { class: 'gpu-page' },
      this.header,
      this.inventory,
      h('section', { class: 'panel charts' }, h('div', { class: 'charts-head' }, h('h2', null, 'Telemetry'), this.rangeBar), h('div', { class: 'chart-grid' }, this.charts.map((c) => c.el))),
      this.events,
    );
    root.appendChild(this.el);
    this.onResize = () => this.charts.forEach((c) => c.draw());
    window.addEventListener('resize', this.onResize);
  }

  async start(params) {
    this.range = RANGES.some((r) => r[0] === params.get('range')) ? params.get('range') : DEFAULT_RANGE;
    this.renderRangeBar();
    this.charts.forEach((c) => c.draw());
    const q = api.sqlString(this.uuid);
    // Identity and inventory first: the rollup query needs host and gpu.
    const [L, inv] = await Promise.allSettled([
      api.layout(),
      api.sql(`SELECT "cluster", "row", rack, host, gpu, uuid, model_name, driver_version, vbios_version, inforom_version, cuda_driver_version, serial, pci_bus_id, mig_mode, first_seen, last_seen FROM gpus WHERE uuid = ${q} LIMIT 1`),
    ]);
    if (this.disposed) return;
    let ident = null;
    if (L.status === 'fulfilled' && L.value.index.has(this.uuid)) {
      const i = L.value.index.get(this.uuid);
      const lv = L.value;
      ident = { cluster: lv.cluster[i], row: lv.row[i], rack: lv.rack[i], host: lv.host[i], gpu: String(lv.gpu[i]) };
    }
    const invRow = inv.status === 'fulfilled' ? inv.value.objects()[0] : null;
    if (!ident && invRow) ident = { cluster: invRow.cluster ?? '', row: invRow.row ?? '', rack: invRow.rack ?? '', host: invRow.host ?? '', gpu: String(invRow.gpu ?? '') };
    this.ident = ident;
    this.renderHeader(ident);
    this.renderInventory(inv, invRow);
    await Promise.all([this.loadCharts(), this.loadEvents()]);
    if (!this.disposed) this.app.painted();
  }

  update(params) {
    const r = params.get('range') || DEFAULT_RANGE;
    if (r !== this.range && RANGES.some((x) => x[0] === r)) {
      this.range = r;
      this.renderRangeBar();
      this.loadCharts().then(() => this.app.painted());
    } else this.app.painted();
  }

  unmount() {
    this.disposed = true;
    window.removeEventListener('resize', this.onResize);
    this.el.remove();
  }

  renderHeader(ident) {
    clear(this.header);
    if (!ident) {
      this.header.appendChild(h('h1', null, 'GPU ', h('span', { class: 'mono' }, this.uuid)));
      this.header.appendChild(errorBox('This UUID is neither in the fleet layout nor in the inventory.'));
      return;
    }
    const zoom = fleetHash({ ...(ident.cluster ? { cluster: ident.cluster } : {}), row: ident.row, rack: ident.rack, host: ident.host });
    this.header.appendChild(h('h1', null, h('span', { class: 'gpu-host' }, ident.host || '(no host)'), h('span', { class: 'gpu-index' }, ` GPU ${ident.gpu}`)));
    this.header.appendChild(
      h(
        'dl',
        { class: 'ident' },
        h('dt', null, 'UUID'),
        h('dd', { class: 'mono' }, this.uuid),
        h('dt', null, 'rack'),
        h('dd', null, ident.rack || '—'),
        h('dt', null, 'row'),
        h('dd', null, ident.row || '—'),
        ident.cluster ? [h('dt', null, 'cluster'), h('dd', null, ident.cluster)] : null,
        h('dt', null, ''),
        h('dd', null, h('a', { href: zoom }, 'show host in fleet')),
      ),
    );
    document.title = `gpulse · ${ident.host} GPU ${ident.gpu}`;
  }

  renderInventory(inv, row) {
    clear(this.inventory);
    this.inventory.appendChild(h('h2', null, 'Inventory'));
    if (inv.status === 'rejected') {
      this.inventory.appendChild(errorBox(inv.reason.message));
      return;
    }
    if (!row) {
      this.inventory.appendChild(h('div', { class: 'muted' }, 'Not in the gpus table (no agent announced this GPU).'));
      return;
    }
    const dl = h('dl', { class: 'kv' });
    for (const [col, label] of INVENTORY) {
      let v = row[col];
      if (col === 'first_seen' || col === 'last_seen') v = fmtDateTime(parseTs(v));
      dl.appendChild(h('dt', null, label));
      dl.appendChild(h('dd', { class: col === 'serial' || col === 'pci_bus_id' ? 'mono' : null }, v === null || v === undefined || v === '' ? '—' : String(v)));
    }
    this.inventory.appendChild(dl);
  }

  renderRangeBar() {
    clear(this.rangeBar);
    for (const [key, label] of RANGES) {
      const p = new URLSearchParams({ range: key });
      const a = h('a', { href: `#/gpu/${encodeURIComponent(this.uuid)}?${p}`, class: key === this.range ? 'range active' : 'range' }, label);
      if (key === this.range) a.setAttribute('aria-current', 'true');
      this.rangeBar.appendChild(a);
    }
  }

  async loadCharts() {
    const seq = ++this.loadSeq;
    const [, , seconds, source, step] = RANGES.find((r) => r[0] === this.range);
    const endMs = Date.now();
    const startMs = endMs - seconds * 1000;
    this.charts.forEach((c) => c.setLoading(source === 'raw' ? 'raw' : 'rollup'));
    if (source === 'raw') {
      // One PromQL range query per metric, selected by the UUID label.
      const sel = `{UUID=${api.promString(this.uuid)}}`;
      await Promise.all(
        this.charts.map(async (c) => {
          try {
            const d = await api.queryRange(`${c.metric.id}${sel}`, startMs / 1000, endMs / 1000, step);
            if (seq !== this.loadSeq || this.disposed) return;
            // Series of the same GPU whose other labels changed are merged in time order.
            const pts = [];
            for (const s of d.result || []) for (const [t, v] of s.values || []) pts.push([t * 1000, Number(v)]);
            pts.sort((a, b) => a[0] - b[0]);
            c.setData(pts.filter((p) => Number.isFinite(p[1])), { start: startMs, end: endMs, source: `raw · step ${step}s`, gapMs: step * 1000 * 2.5 });
          } catch (e) {
            if (seq === this.loadSeq && !this.disposed) c.setError(e.message);
          }
        }),
      );
      return;
    }
    // Rollups: one SQL query for all five metrics, level 'gpu', by host and gpu.
    const id = this.ident;
    if (!id || !id.host) {
      this.charts.forEach((c) => c.setError('unknown host and gpu index: no rollup to read'));
      return;
    }
    const metrics = this.charts.map((c) => api.sqlString(c.metric.id)).join(', ');
    const where = [`level = 'gpu'`, `host = ${api.sqlString(id.host)}`, `gpu = ${api.sqlString(id.gpu)}`, `metric IN (${metrics})`];
    if (id.cluster) where.push(`"cluster" = ${api.sqlString(id.cluster)}`);
    const stmt = `SELECT CAST(ts AS BIGINT) AS t, metric, avg, tier FROM rollup(to_timestamp_millis(${Math.floor(startMs)}), to_timestamp_millis(${Math.floor(endMs)}), '${step}') WHERE ${where.join(' AND ')} ORDER BY t`;
    try {
      const res = await api.sql(stmt);
      if (seq !== this.loadSeq || this.disposed) return;
      const by = new Map(this.charts.map((c) => [c.metric.id, { pts: [], tiers: new Set() }]));
      for (const [t, metric, avg, tier] of res.rows) {
        const b = by.get(metric);
        if (!b || avg === null) continue;
        b.pts.push([typeof t === 'number' ? t : parseTs(t), Number(avg)]);
        if (tier) b.tiers.add(tier);
      }
      for (const c of this.charts) {
        const b = by.get(c.metric.id);
        const tiers = b.tiers.size ? [...b.tiers].join('+') : step;
        c.setData(b.pts, { start: startMs, end: endMs, source: `rollup ${tiers}`, gapMs: (STEP_MS[step] || 60e3) * 2.5 });
      }
    } catch (e) {
      if (seq === this.loadSeq && !this.disposed) this.charts.forEach((c) => c.setError(e.message));
    }
  }

  async loadEvents() {
    const body = this.events;
    try {
      const res = await api.sql(
        `SELECT id, kind, severity, xid, onset_at, detected_at, cleared_at, action, evidence FROM health_events WHERE uuid = ${api.sqlString(this.uuid)} ORDER BY detected_at DESC, id DESC LIMIT 500`,
      );
      if (this.disposed) return;
      clear(body);
      body.appendChild(h('h2', null, 'Health events'));
      const rows = res.objects();
      if (!rows.length) {
        body.appendChild(h('div', { class: 'muted' }, 'No health events for this GPU.'));
        return;
      }
      const head = ['severity', 'kind', 'xid', 'onset', 'detected', 'cleared', 'action', 'evidence'];
      body.appendChild(
        h(
          'table',
          { class: 'table events-table' },
          h('thead', null, h('tr', null, head.map((c) => h('th', null, c)))),
          h(
            'tbody',
            null,
            rows.map((r) =>
              h(
                'tr',
                { class: r.cleared_at ? 'cleared' : 'active' },
                h('td', null, h('span', { class: `sev sev-${r.severity}` }, r.severity)),
                h('td', null, r.kind),
                h('td', null, r.xid === null ? '' : String(r.xid)),
                h('td', { class: 'nowrap' }, fmtDateTime(parseTs(r.onset_at))),
                h('td', { class: 'nowrap' }, fmtDateTime(parseTs(r.detected_at))),
                h('td', { class: 'nowrap' }, r.cleared_at ? fmtDateTime(parseTs(r.cleared_at)) : h('span', { class: 'badge-active' }, 'active')),
                h('td', null, r.action ?? ''),
                h('td', { class: 'evidence' }, r.evidence ?? ''),
              ),
            ),
          ),
        ),
      );
    } catch (e) {
      if (this.disposed) return;
      clear(body);
      body.appendChild(h('h2', null, 'Health events'));
      body.appendChild(errorBox(e.message));
    }
  }
}

export function mountGpu(root, uuid, params, app) {
  const view = new GpuView(root, uuid, app);
  view.start(params);
  return view;
}
