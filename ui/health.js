// Health list (#/health): the newest 1,000 events, active and cleared, with
// filters (kind, severity, active only) and sorting by any column. Filters and
// sort live in the hash (replaced, not pushed) so a link reproduces the view.

import * as api from './api.js';
import { h, clear, select, errorBox, fmtDateTime, parseTs, gpuHref } from './dom.js';

const LIMIT = 1000;
const SEVERITY_RANK = { critical: 3, warning: 2, info: 1 };

// [key, header, sort value]
const COLUMNS = [
  ['severity', 'severity', (r) => SEVERITY_RANK[r.severity] ?? 0],
  ['kind', 'kind', (r) => r.kind ?? ''],
  ['xid', 'xid', (r) => r.xid ?? -1],
  ['gpu', 'GPU', (r) => `${r.host ?? ''}\u0000${String(r.gpu ?? '').padStart(4, '0')}`],
  ['rack', 'rack', (r) => r.rack ?? ''],
  ['row', 'row', (r) => r.row ?? ''],
  ['onset_at', 'onset', (r) => r.onset ?? 0],
  ['detected_at', 'detected', (r) => r.detected ?? 0],
  ['cleared_at', 'cleared', (r) => (r.cleared === null ? Infinity : r.cleared)],
  ['action', 'action', (r) => r.action ?? ''],
  ['evidence', 'evidence', (r) => r.evidence ?? ''],
];

export class HealthView {
  constructor(root, app) {
    this.app = app;
    this.disposed = false;
    this.rows = [];
    this.msg = h('div', { class: 'muted' }, 'loading…');
    this.controls = h('div', { class: 'filters' });
    this.table = h('div', { class: 'table-wrap' });
    this.el = h('section', { class: 'health-page panel' }, h('h1', null, 'Health events'), this.controls, this.msg, this.table);
    root.appendChild(this.el);
  }

  async start(params) {
    this.state = {
      kind: params.get('kind') || '',
      severity: params.get('severity') || '',
      active: params.get('active') === '1',
      sort: COLUMNS.some((c) => c[0] === params.get('sort')) ? params.get('sort') : 'detected_at',
      dir: params.get('dir') === 'asc' ? 'asc' : 'desc',
    };
    await this.load();
    if (!this.disposed) this.app.painted();
  }

  update(params) {
    this.start(params);
  }

  unmount() {
    this.disposed = true;
    this.el.remove();
  }

  async load() {
    try {
      const res = await api.sql(
        `SELECT id, kind, severity, "cluster", "row", rack, host, gpu, uuid, xid, onset_at, detected_at, cleared_at, action, evidence FROM health_events ORDER BY detected_at DESC, id DESC LIMIT ${LIMIT}`,
      );
      if (this.disposed) return;
      this.rows = res.objects().map((r) => ({ ...r, onset: parseTs(r.onset_at), detected: parseTs(r.detected_at), cleared: parseTs(r.cleared_at) }));
      this.msg.textContent = '';
      this.render();
    } catch (e) {
      if (this.disposed) return;
      clear(this.msg).appendChild(errorBox(e.message));
      this.app.setStatus({ error: e.message });
    }
  }

  /** Writes the filters to the hash without a history entry or a reload. */
  saveState() {
    const p = new URLSearchParams();
    const s = this.state;
    if (s.kind) p.set('kind', s.kind);
    if (s.severity) p.set('severity', s.severity);
    if (s.active) p.set('active', '1');
    if (s.sort !== 'detected_at' || s.dir !== 'desc') {
      p.set('sort', s.sort);
      p.set('dir', s.dir);
    }
    const q = p.toString();
    history.replaceState(null, '', q ? `#/health?${q}` : '#/health');
  }

  renderControls() {
    const s = this.state;
    const kinds = [...new Set(this.rows.map((r) => r.kind))].sort();
    if (s.kind && !kinds.includes(s.kind)) kinds.push(s.kind);
    const set = (k) => (v) => {
      s[k] = v;
      this.saveState();
      this.render();
    };
    const active = h('input', { type: 'checkbox', class: 'active-only', checked: s.active });
    active.addEventListener('change', () => set('active')(active.checked));
    clear(this.controls);
    this.controls.append(
      h('label', null, 'kind ', select([['', 'all'], ...kinds.map((k) => [k, k])], s.kind, set('kind'), { class: 'filter-kind' })),
      h('label', null, 'severity ', select([['', 'all'], ['critical', 'critical'], ['warning', 'warning'], ['info', 'info']], s.severity, set('severity'), { class: 'filter-severity' })),
      h('label', null, active, ' active only'),
      h('button', { type: 'button', on: { click: () => this.load() } }, 'Refresh'),
    );
  }

  render() {
    this.renderControls();
    const s = this.state;
    let rows = this.rows.filter((r) => (!s.kind || r.kind === s.kind) && (!s.severity || r.severity === s.severity) && (!s.active || r.cleared === null));
    const col = COLUMNS.find((c) => c[0] === s.sort);
    const key = col[2];
    const sign = s.dir === 'asc' ? 1 : -1;
    rows = rows
      .map((r) => [key(r), r])
      .sort((a, b) => (a[0] < b[0] ? -sign : a[0] > b[0] ? sign : (b[1].detected ?? 0) - (a[1].detected ?? 0)))
      .map((x) => x[1]);

    const head = h(
      'tr',
      null,
      COLUMNS.map(([k, label]) => {
        const sorted = k === s.sort;
        const th = h(
          'th',
          { class: sorted ? 'sortable sorted' : 'sortable', 'aria-sort': sorted ? (s.dir === 'asc' ? 'ascending' : 'descending') : 'none', dataset: { col: k } },
          h('button', { type: 'button', class: 'th-button' }, label, sorted ? (s.dir === 'asc' ? ' ▲' : ' ▼') : ''),
        );
        th.addEventListener('click', () => {
          if (s.sort === k) s.dir = s.dir === 'asc' ? 'desc' : 'asc';
          else {
            s.sort = k;
            s.dir = k === 'kind' || k === 'gpu' || k === 'rack' || k === 'row' || k === 'action' || k === 'evidence' ? 'asc' : 'desc';
          }
          this.saveState();
          this.render();
        });
        return th;
      }),
    );
    const body = h(
      'tbody',
      null,
      rows.map((r) =>
        h(
          'tr',
          { class: r.cleared === null ? 'active' : 'cleared', dataset: { id: String(r.id), kind: r.kind ?? '', xid: r.xid === null ? '' : String(r.xid) } },
          h('td', null, h('span', { class: `sev sev-${r.severity}` }, r.severity)),
          h('td', null, r.kind),
          h('td', null, r.xid === null ? '' : String(r.xid)),
          h('td', { class: 'nowrap' }, r.uuid ? h('a', { href: gpuHref(r.uuid), class: 'gpu-link' }, `${r.host ?? ''} / GPU ${r.gpu ?? ''}`) : `${r.host ?? ''} / GPU ${r.gpu ?? ''}`),
          h('td', null, r.rack ?? ''),
          h('td', null, r.row ?? ''),
          h('td', { class: 'nowrap' }, fmtDateTime(r.onset)),
          h('td', { class: 'nowrap' }, fmtDateTime(r.detected)),
          h('td', { class: 'nowrap' }, r.cleared === null ? h('span', { class: 'badge-active' }, 'active') : fmtDateTime(r.cleared)),
          h('td', null, r.action ?? ''),
          h('td', { class: 'evidence' }, r.evidence ?? ''),
        ),
      ),
    );
    clear(this.table);
    const shown = `${rows.length} of ${this.rows.length} event${this.rows.length === 1 ? '' : 's'}${this.rows.length >= LIMIT ? ` (newest ${LIMIT})` : ''}`;
    this.table.append(h('div', { class: 'muted count-line' }, shown), h('table', { class: 'table health-table' }, h('thead', null, head), body));
    if (!rows.length) this.table.appendChild(h('div', { class: 'muted' }, this.rows.length ? 'No event matches these filters.' : 'No health events.'));
  }
}

export function mountHealth(root, params, app) {
  const view = new HealthView(root, app);
  view.start(params);
  return view;
}
