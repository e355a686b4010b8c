// The HTTP API, in one place. Every call either resolves with the parsed answer
// or rejects with an ApiError whose message is meant to be shown as text: views
// catch it and display it, nothing is left to throw uncaught.

export class ApiError extends Error {
  constructor(message, status = 0) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
  }
}

/** Main-thread cost of the last JSON parse, for the performance hook. */
export const timings = { lastParseMs: 0 };

// ---- tokens ------------------------------------------------------------------
// A node started with --auth-file answers 401 without a token. The UI then asks
// for one (read scope) once, keeps it for this tab only (sessionStorage), and
// sends it as `Authorization: Bearer` with every call.

const TOKEN_KEY = 'gpulse.token';

function storedToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || '';
  } catch {
    return '';
  }
}

function withToken(init, token) {
  if (!token) return init;
  const headers = new Headers((init && init.headers) || {});
  headers.set('authorization', `Bearer ${token}`);
  return { ...(init || {}), headers };
}

/**
 * After a 401 with `used`: true when there is a token to try again with. A
 * call that raced another one's prompt takes the token it got; otherwise the
 * user is asked (a cancelled prompt leaves the 401 to be shown).
 */
function askToken(used) {
  const now = storedToken();
  if (now && now !== used) return true;
  const entered = window.prompt('This gpulse node needs a token with the read scope (gpulse token create --scope read):', '');
  const token = (entered || '').trim();
  if (!token) return false;
  try {
    sessionStorage.setItem(TOKEN_KEY, token);
  } catch {
    return false;
  }
  return true;
}

async function request(url, init) {
  let res;
  for (let attempt = 0; ; attempt++) {
    const token = storedToken();
    try {
      res = await fetch(url, withToken(init, token));
    } catch (e) {
      throw new ApiError(`network error: ${e && e.message ? e.message : e}`);
    }
    if (res.status !== 401 || attempt >= 2 || !askToken(token)) break;
  }
  const text = await res.text();
  let body;
  const t0 = performance.now();
  try {
    body = JSON.parse(text);
    timings.lastParseMs = performance.now() - t0;
  } catch {
    throw new ApiError(`HTTP ${res.status} from ${url.split('?')[0]}: not JSON`, res.status);
  }
  if (!res.ok || (body && body.status === 'error')) {
    const msg = body && body.error ? `${body.errorType || 'error'}: ${body.error}` : `HTTP ${res.status}`;
    throw new ApiError(msg, res.status);
  }
  return body;
}

const qs = (params) => new URLSearchParams(Object.entries(params).filter(([, v]) => v !== undefined && v !== null)).toString();

// ---- SQL ---------------------------------------------------------------------

/** An SQL string literal: single quotes doubled. */
export function sqlString(s) {
  return `'${String(s).replaceAll("'", "''")}'`;
}

/**
 * Runs one SQL statement. Resolves with {columns: [names], rows: [[...]], objects()}.
 */
export async function sql(statement) {
  const body = await request('/api/v1/sql', {
    method: 'POST',
    headers: { 'content-type': 'text/plain' },
    body: statement,
  });
  const columns = (body.columns || []).map((c) => c.name);
  const rows = body.rows || [];
  return {
    columns,
    rows,
    warnings: body.warnings || [],
    objects() {
      return rows.map((r) => Object.fromEntries(columns.map((c, j) => [c, r[j]])));
    },
  };
}

// ---- PromQL ------------------------------------------------------------------

/** A PromQL label value inside double quotes: backslash, quote and newline escaped. */
export function promString(s) {
  return `"${String(s).replaceAll('\\', '\\\\').replaceAll('"', '\\"').replaceAll('\n', '\\n')}"`;
}

/** GET /api/v1/query_range; times in unix seconds, step in seconds. */
export async function queryRange(query, start, end, step) {
  const body = await request(`/api/v1/query_range?${qs({ query, start, end, step })}`);
  return body.data;
}

// ---- Fleet -------------------------------------------------------------------

/**
 * The fleet layout, cached by version: the frame tells whether it changed.
 * Adds `index` (uuid -> position) built once per version.
 */
let layoutCache = null;
let layoutPending = null;

export function cachedLayout() {
  return layoutCache;
}

export async function layout(force = false) {
  if (layoutCache && !force) return layoutCache;
  if (layoutPending) return layoutPending;
  layoutPending = (async () => {
    try {
      const body = await request('/api/v1/fleet/layout');
      const d = body.data;
      const n = d.gpus ?? (d.uuid ? d.uuid.length : 0);
      for (const k of ['uuid', 'host', 'gpu', 'rack', 'row', 'cluster']) {
        if (!Array.isArray(d[k]) || d[k].length !== n) throw new ApiError(`layout: "${k}" has ${d[k] ? d[k].length : 'no'} entries, expected ${n}`);
      }
      const index = new Map();
      for (let i = 0; i < n; i++) index.set(d.uuid[i], i);
      layoutCache = { ...d, n, index };
      return layoutCache;
    } finally {
      layoutPending = null;
    }
  })();
  return layoutPending;
}

/** GET /api/v1/fleet/frame. time: unix seconds (or undefined for now). */
export async function frame(color, time) {
  const body = await request(`/api/v1/fleet/frame?${qs({ color, time })}`);
  return { ...body.data, warnings: body.warnings || [] };
}

/** GET /api/v1/fleet/frames. start/end: unix seconds; step: a duration such as '60s'. */
export async function frames(color, start, end, step) {
  const body = await request(`/api/v1/fleet/frames?${qs({ color, start, end, step })}`);
  return { ...body.data, warnings: body.warnings || [] };
}

/** GET /api/v1/health: states and active events. */
export async function health() {
  const body = await request('/api/v1/health');
  return body.data;
}
