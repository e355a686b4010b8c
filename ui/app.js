// Entry point: hash router, the top bar's status line, the shared health poll
// (states for the status line, active events for the fleet tooltip) and the
// `window.gpulse` test hook. Hash routing keeps the back button and links
// working without any server-side routes beyond `/` and `/ui/*`.

import * as api from './api.js';
import { h, clear, fmtTime, errorBox } from './dom.js';
import { mountFleet } from './fleet.js';
import { mountGpu } from './gpu.js';
import { mountHealth } from './health.js';
import { mountDrift } from './drift.js';

const HEALTH_POLL_MS = 15000;
const TITLES = { fleet: 'Fleet', gpu: 'GPU', health: 'Health', drift: 'Drift' };

const viewEl = document.getElementById('view');
const statusEl = document.getElementById('status');

// ---- status line ---------------------------------------------------------

// errors: by source ('health' poll, 'view'), so one source's recovery does not hide another's failure.
const status = { gpus: null, states: null, refreshed: null, errors: {}, warnings: [] };

function renderStatus() {
  clear(statusEl);
  const parts = [];
  if (status.gpus !== null) parts.push(h('span', null, `${status.gpus} GPUs`));
  if (status.states) {
    // Health order first (ok, warning, critical, no data, lost), then any other key.
    const order = ['ok', 'warning', 'critical', 'no_data', 'lost'];
    const keys = [...order.filter((k) => k in status.states), ...Object.keys(status.states).filter((k) => !order.includes(k))];
    for (const k of keys) {
      const n = status.states[k];
      if (n > 0 || k === 'ok') parts.push(h('span', { class: `st st-${k}` }, `${k.replaceAll('_', ' ')} ${n}`));
    }
  }
  if (status.refreshed) parts.push(h('span', { class: 'muted' }, `refreshed ${fmtTime(status.refreshed)}`));
  for (const w of status.warnings || []) parts.push(h('span', { class: 'warn' }, `warning: ${w}`));
  for (const msg of Object.values(status.errors)) if (msg) parts.push(h('span', { class: 'err' }, `error: ${msg}`));
  parts.forEach((p, j) => {
    if (j) statusEl.appendChild(document.createTextNode(' · '));
    statusEl.appendChild(p);
  });
}

// ---- shared health poll ------------------------------------------------------

let eventsByUuid = new Map();

async function pollHealth() {
  try {
    const d = await api.health();
    const m = new Map();
    for (const ev of d.active || []) {
      if (!m.has(ev.uuid)) m.set(ev.uuid, []);
      m.get(ev.uuid).push(ev);
    }
    eventsByUuid = m;
    const upd = { gpus: d.gpus ?? status.gpus, states: d.states || null };
    if (!current || current.kind !== 'fleet') upd.refreshed = Date.now();
    Object.assign(status, upd);
    status.errors.health = null;
    renderStatus();
  } catch (e) {
    status.errors.health = e.message;
    renderStatus();
  } finally {
    setTimeout(pollHealth, HEALTH_POLL_MS);
  }
}

// ---- views and routing -------------------------------------------------------

let current = null; // {kind, key, view}
let resolveReady = () => {};

/** What views get: status updates, "first paint done", active events. */
const app = {
  /** partial: gpus, refreshed, warnings; and `error` (text or null) for the current view. */
  setStatus(partial) {
    const { error, ...rest } = partial;
    Object.assign(status, rest);
    if (error !== undefined) status.errors.view = error;
    renderStatus();
  },
  painted() {
    resolveReady();
  },
  eventsFor(uuid) {
    return eventsByUuid.get(uuid) || [];
  },
};

function parseHash() {
  const raw = location.hash.replace(/^#/, '') || '/';
  const q = raw.indexOf('?');
  const path = q < 0 ? raw : raw.slice(0, q);
  const params = new URLSearchParams(q < 0 ? '' : raw.slice(q + 1));
  if (path === '/' || path === '') return { kind: 'fleet', key: '', params };
  const m = /^\/gpu\/(.+)$/.exec(path);
  if (m) {
    let uuid = m[1];
    try {
      uuid = decodeURIComponent(uuid);
    } catch {
      // a malformed escape: use the text as it is
    }
    return { kind: 'gpu', key: uuid, params };
  }
  if (path === '/health') return { kind: 'health', key: '', params };
  if (path === '/drift') return { kind: 'drift', key: '', params };
  return { kind: 'unknown', key: path, params };
}

function newReady() {
  hook.ready = new Promise((resolve) => {
    resolveReady = resolve;
  });
}

function route() {
  const r = parseHash();
  newReady();
  hook.route = location.hash || '#/';
  for (const a of document.querySelectorAll('.nav a')) a.classList.toggle('active', a.dataset.view === r.kind);
  document.title = `gpulse · ${TITLES[r.kind] || 'not found'}`;
  // Same view, other parameters (zoom, range, filters): keep the view and its data.
  if (current && current.kind === r.kind && current.key === r.key && current.view.update) {
    current.view.update(r.params);
    return;
  }
  if (current) current.view.unmount();
  status.errors.view = null;
  status.warnings = [];
  renderStatus();
  clear(viewEl);
  window.scrollTo(0, 0);
  let view;
  if (r.kind === 'fleet') view = mountFleet(viewEl, r.params, app);
  else if (r.kind === 'gpu') view = mountGpu(viewEl, r.key, r.params, app);
  else if (r.kind === 'health') view = mountHealth(viewEl, r.params, app);
  else if (r.kind === 'drift') view = mountDrift(viewEl, r.params, app);
  else {
    viewEl.appendChild(h('section', { class: 'panel' }, errorBox(`No page at #${r.key}.`), h('a', { href: '#/' }, 'Back to the fleet')));
    view = { unmount() {} };
    app.painted();
  }
  current = { kind: r.kind, key: r.key, view };
}

// ---- test hook -----------------------------------------------------------------

const hook = {
  ready: null,
  route: '',
  /** Time (ms) of the frame on screen in the fleet view, live or replay. */
  get frameTime() {
    return current && current.kind === 'fleet' ? current.view.frameTimeMs : null;
  },
  /** The GPU's cell in CSS px relative to the viewport, or null if not drawn. */
  cellRect(uuid) {
    return current && current.kind === 'fleet' ? current.view.cellRect(uuid) : null;
  },
  /** The label box of a row, rack or host on the fleet canvas (first match by name). */
  labelRect(level, name) {
    return current && current.kind === 'fleet' ? current.view.labelRect(level, name) : null;
  },
  /** Main-thread costs in ms: last paint, last live refresh (parse + paint), last replay step. */
  get stats() {
    return current && current.kind === 'fleet' ? { ...current.view.stats } : {};
  },
};
window.gpulse = hook;

window.addEventListener('hashchange', route);
route();
pollHealth();
