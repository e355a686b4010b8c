// The fleet legend: the five health states with their colours (and how many of
// the GPUs shown are in each), or the metric's colour scale with tick labels.

import { h, clear } from './dom.js';
import { HEALTH, RAMP, formatValue, NO_DATA, PALETTE } from './colors.js';

function swatch(color) {
  const s = h('span', { class: 'swatch' });
  s.style.backgroundColor = color; // CSSOM, which the CSP allows (no style attribute)
  return s;
}

/** counts: Uint32Array indexed by health code, or null. */
export function renderHealthLegend(el, counts) {
  clear(el);
  for (const st of HEALTH) {
    el.appendChild(
      h('span', { class: 'legend-item', dataset: { state: st.key } }, swatch(st.color), st.label, counts ? h('span', { class: 'count' }, String(counts[st.code])) : null),
    );
  }
}

const RAMP_W = 220;
const RAMP_H = 10;
const TICKS = 5;

/** A ramp drawn on a small canvas, ticks and labels under it, then "no data". */
export function renderMetricLegend(el, metric, scale) {
  clear(el);
  const [lo, hi] = scale;
  const dpr = window.devicePixelRatio || 1;
  const cssW = RAMP_W + 40;
  const cssH = 30;
  const c = h('canvas', { class: 'legend-ramp', role: 'img', 'aria-label': `${metric.label} from ${formatValue(metric, lo)} to ${formatValue(metric, hi)}` });
  c.width = Math.round(cssW * dpr);
  c.height = Math.round(cssH * dpr);
  c.style.width = `${cssW}px`;
  c.style.height = `${cssH}px`;
  const ctx = c.getContext('2d');
  ctx.scale(dpr, dpr);
  const x0 = 20;
  for (let k = 0; k < RAMP.length; k++) {
    ctx.fillStyle = RAMP[k];
    ctx.fillRect(x0 + (k * RAMP_W) / RAMP.length, 2, RAMP_W / RAMP.length + 0.5, RAMP_H);
  }
  ctx.fillStyle = '#9aa4b2';
  ctx.strokeStyle = '#9aa4b2';
  ctx.font = '10px system-ui, sans-serif';
  ctx.textAlign = 'center';
  ctx.textBaseline = 'top';
  const span = hi - lo;
  const digits = span >= 50 ? 0 : span >= 5 ? Math.min(1, metric.digits) : Math.max(metric.digits, 2);
  for (let t = 0; t < TICKS; t++) {
    const f = t / (TICKS - 1);
    const x = x0 + f * RAMP_W;
    ctx.beginPath();
    ctx.moveTo(Math.round(x) + 0.5, 2 + RAMP_H);
    ctx.lineTo(Math.round(x) + 0.5, 2 + RAMP_H + 4);
    ctx.stroke();
    ctx.fillText((lo + f * span).toFixed(digits), x, 2 + RAMP_H + 6);
  }
  el.appendChild(h('span', { class: 'legend-item legend-metric' }, `${metric.label}${metric.unit ? ` (${metric.unit})` : ''}`));
  el.appendChild(c);
  el.appendChild(h('span', { class: 'legend-item', dataset: { state: 'no_data' } }, swatch(PALETTE[NO_DATA]), 'no data'));
}
