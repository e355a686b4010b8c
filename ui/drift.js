// Drift (#/drift): driver and VBIOS versions across the fleet from the `gpus`
// inventory, the majority of each marked, and the GPUs that differ from it. A
// host left on an old driver after a rollout is the usual cause of odd jobs.

import * as api from './api.js';
import { h, clear, errorBox, gpuHref } from './dom.js';

const FIELDS = [
  ['driver_version', 'Driver'],
  ['vbios_version', 'VBIOS'],
];
const LIMIT = 5000;

const shown = (v) => (v === null || v === undefined || v === '' ? '(unknown)' : v);

export class DriftView {
  constructor(root, app) {
    this.app = app;
    this.disposed = false;
    this.body = h('div', { class: 'drift-body' }, h('div', { class: 'muted' }, 'loading…'));
    this.el = h('section', { class: 'drift-page panel' }, h('h1', null, 'Driver and firmware drift'), this.body);
    root.appendChild(this.el);
  }

  async start() {
    try {
      const counts = await Promise.all(
        FIELDS.map(([col]) =>
          api.sql(`SELECT ${col} AS version, count(*) AS gpus, count(DISTINCT host) AS hosts FROM gpus GROUP BY ${col} ORDER BY gpus DESC, version`),
        ),
      );
      if (this.disposed) return;
      const majority = counts.map((res) => (res.rows.length ? res.rows[0][0] ?? '' : null));
      const total = counts[0].rows.reduce((a, r) => a + Number(r[1]), 0);
      // GPUs off the majority in any field; NULL counts as '' on both sides.
      const cond = FIELDS.map(([col], j) => (majority[j] === null ? null : `COALESCE(${col}, '') <> ${api.sqlString(majority[j])}`)).filter(Boolean);
      const odd = cond.length
        ? await api.sql(`SELECT host, gpu, uuid, "row", rack, driver_version, vbios_version FROM gpus WHERE ${cond.join(' OR ')} ORDER BY host, gpu LIMIT ${LIMIT}`)
        : { objects: () => [] };
      if (this.disposed) return;
      this.render(counts, majority, total, odd.objects());
    } catch (e) {
      if (this.disposed) return;
      clear(this.body).appendChild(errorBox(e.message));
      this.app.setStatus({ error: e.message });
    }
    if (!this.disposed) this.app.painted();
  }

  update() {
    this.app.painted();
  }

  unmount() {
    this.disposed = true;
    this.el.remove();
  }

  render(counts, majority, total, odd) {
    clear(this.body);
    if (total === 0) {
      this.body.appendChild(h('div', { class: 'muted' }, 'No GPU in the inventory yet.'));
      return;
    }
    const cards = h('div', { class: 'drift-cards' });
    FIELDS.forEach(([, label], j) => {
      const rows = counts[j].rows;
      cards.appendChild(
        h(
          'div',
          { class: 'drift-card', dataset: { field: FIELDS[j][0] } },
          h('h2', null, `${label} versions`, h('span', { class: 'muted' }, ` · ${rows.length} distinct`)),
          h(
            'table',
            { class: 'table' },
            h('thead', null, h('tr', null, h('th', null, 'version'), h('th', { class: 'num' }, 'GPUs'), h('th', { class: 'num' }, 'hosts'), h('th', { class: 'num' }, 'share'), h('th', null, ''))),
            h(
              'tbody',
              null,
              rows.map(([version, gpus, hosts], k) =>
                h(
                  'tr',
                  { class: k === 0 ? 'majority' : 'minority' },
                  h('td', { class: 'mono' }, shown(version)),
                  h('td', { class: 'num' }, String(gpus)),
                  h('td', { class: 'num' }, String(hosts)),
                  h('td', { class: 'num' }, `${((100 * Number(gpus)) / total).toFixed(1)} %`),
                  h('td', null, k === 0 ? h('span', { class: 'badge-majority' }, 'majority') : h('span', { class: 'badge-drift' }, 'drift')),
                ),
              ),
            ),
          ),
        ),
      );
    });
    this.body.appendChild(cards);

    const hosts = new Set(odd.map((r) => r.host));
    this.body.appendChild(
      h('h2', null, odd.length ? `${odd.length}${odd.length >= LIMIT ? '+' : ''} GPU${odd.length === 1 ? '' : 's'} on ${hosts.size} host${hosts.size === 1 ? '' : 's'} differ from the majority` : 'Every GPU runs the majority versions'),
    );
    if (!odd.length) return;
    odd.sort((a, b) => (a.host < b.host ? -1 : a.host > b.host ? 1 : Number(a.gpu) - Number(b.gpu)));
    const cell = (r, col, j) => h('td', { class: (r[col] ?? '') !== majority[j] ? 'mono differs' : 'mono' }, shown(r[col]));
    this.body.appendChild(
      h(
        'table',
        { class: 'table drift-table' },
        h('thead', null, h('tr', null, ['GPU', 'rack', 'row', 'driver', 'VBIOS', 'UUID'].map((c) => h('th', null, c)))),
        h(
          'tbody',
          null,
          odd.map((r) =>
            h(
              'tr',
              null,
              h('td', { class: 'nowrap' }, h('a', { href: gpuHref(r.uuid), class: 'gpu-link' }, `${r.host} / GPU ${r.gpu}`)),
              h('td', null, r.rack ?? ''),
              h('td', null, r.row ?? ''),
              cell(r, 'driver_version', 0),
              cell(r, 'vbios_version', 1),
              h('td', { class: 'mono' }, r.uuid),
            ),
          ),
        ),
      ),
    );
  }
}

export function mountDrift(root, params, app) {
  const view = new DriftView(root, app);
  view.start(params);
  return view;
}
