// Colours and metric definitions shared by the fleet view, the legend, the replay
// and the GPU page. The fleet canvas paints from PALETTE by index, so a frame of
// any size is coloured with one table lookup per GPU and no string building.

/** Health states: the frame's code is the index. Colours are fixed by the contract. */
export const HEALTH = [
  { code: 0, key: 'ok', label: 'ok', color: '#2e9d57' },
  { code: 1, key: 'warning', label: 'warning', color: '#f2a900' },
  { code: 2, key: 'critical', label: 'critical', color: '#d62728' },
  { code: 3, key: 'no_data', label: 'no data', color: '#4a4f57' },
  { code: 4, key: 'lost', label: 'lost', color: '#7b2cbf' },
];
export const NO_DATA = 3;

/** Metric colours start here in PALETTE; RAMP_STEPS entries from low to high. */
export const RAMP_BASE = HEALTH.length;
export const RAMP_STEPS = 256;

// Viridis at 0, 0.1, ... 1: perceptually uniform, readable on a dark background
// and far from the five health colours (checked below), so a metric view is
// never mistaken for a health view.
const VIRIDIS = ['#440154', '#482475', '#414487', '#355f8d', '#2a788e', '#21918c', '#22a884', '#44bf70', '#7ad151', '#bddf26', '#fde725'];

const rgb = (hex) => [1, 3, 5].map((o) => parseInt(hex.slice(o, o + 2), 16));
const hex = (c) => `#${c.map((v) => Math.round(v).toString(16).padStart(2, '0')).join('')}`;

function buildRamp() {
  const stops = VIRIDIS.map(rgb);
  const healthSet = new Set(HEALTH.map((s) => s.color));
  const out = [];
  for (let k = 0; k < RAMP_STEPS; k++) {
    const t = (k / (RAMP_STEPS - 1)) * (stops.length - 1);
    const j = Math.min(stops.length - 2, Math.floor(t));
    const f = t - j;
    const c = stops[j].map((v, ch) => v + (stops[j + 1][ch] - v) * f);
    let s = hex(c);
    // The contract says the ramp never yields a health colour exactly.
    if (healthSet.has(s)) s = hex([c[0], c[1], c[2] > 0 ? c[2] - 1 : 1]);
    out.push(s);
  }
  return out;
}

export const RAMP = buildRamp();
/** Index -> CSS colour: health states, then the metric ramp. */
export const PALETTE = [...HEALTH.map((s) => s.color), ...RAMP];
export const BACKGROUND = '#111418';

/**
 * The metrics one can colour by. `range` fixes the scale where a natural one
 * exists (so colours mean the same from frame to frame); null means min..max
 * of the data shown.
 */
export const METRICS = [
  { id: 'DCGM_FI_DEV_GPU_TEMP', label: 'Temperature', short: 'temp', unit: '°C', range: [20, 100], digits: 1 },
  { id: 'DCGM_FI_DEV_POWER_USAGE', label: 'Power', short: 'power', unit: 'W', range: null, digits: 1 },
  { id: 'DCGM_FI_DEV_GPU_UTIL', label: 'Utilisation', short: 'util', unit: '%', range: [0, 100], digits: 0 },
  { id: 'DCGM_FI_PROF_SM_ACTIVE', label: 'SM activity', short: 'SM active', unit: '', range: [0, 1], digits: 2 },
  { id: 'DCGM_FI_DEV_SM_CLOCK', label: 'SM clock', short: 'SM clock', unit: 'MHz', range: null, digits: 0 },
  { id: 'DCGM_FI_DEV_FB_USED', label: 'Memory used', short: 'mem used', unit: 'MiB', range: null, digits: 0 },
  { id: 'DCGM_FI_DEV_MEMORY_TEMP', label: 'Memory temperature', short: 'mem temp', unit: '°C', range: [20, 110], digits: 1 },
  { id: 'DCGM_FI_DEV_XID_ERRORS', label: 'Last XID', short: 'XID', unit: '', range: [0, 160], digits: 0, xid: true },
];
export const METRIC_BY_ID = new Map(METRICS.map((m) => [m.id, m]));

/** A value with its unit, e.g. '63.0 °C'; 'no data' for null/NaN. */
export function formatValue(metric, v) {
  if (v === null || v === undefined || Number.isNaN(v)) return 'no data';
  if (metric.xid) return v === 0 ? 'none' : `XID ${Math.round(v)}`;
  const s = v.toFixed(metric.digits);
  return metric.unit ? `${s} ${metric.unit}` : s;
}

/** The scale of a metric over some values (typed array, NaN = none). */
export function scaleFor(metric, values) {
  if (metric.range) return metric.range;
  let lo = Infinity;
  let hi = -Infinity;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v < lo) lo = v; // NaN compares false both ways: skipped
    if (v > hi) hi = v;
  }
  if (!Number.isFinite(lo)) return [0, 1];
  if (hi - lo < 1e-9) return [lo - 0.5, hi + 0.5];
  return [lo, hi];
}

/** Frame values (JSON numbers and nulls) as a typed array: codes, or floats with NaN for null. */
export function typedValues(color, values, out) {
  const n = values.length;
  if (color === 'health') {
    const a = out instanceof Uint8Array && out.length === n ? out : new Uint8Array(n);
    for (let i = 0; i < n; i++) {
      const v = values[i];
      a[i] = typeof v === 'number' && v >= 0 && v < HEALTH.length ? v : NO_DATA;
    }
    return a;
  }
  const a = out instanceof Float32Array && out.length === n ? out : new Float32Array(n);
  for (let i = 0; i < n; i++) {
    const v = values[i];
    a[i] = typeof v === 'number' ? v : NaN;
  }
  return a;
}
