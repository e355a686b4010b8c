// A line chart drawn by hand on a canvas: axes with nice ticks, time labels,
// the unit, gaps where data is missing, and a hover readout. No library: the
// CSP forbids third-party code and a chart of a few thousand points is cheap.

import { h, fmtDateTime } from './dom.js';

const HEIGHT = 170;
const M = { left: 64, right: 14, top: 10, bottom: 26 };
const LINE = '#58a6ff';
const GRID = '#252b33';
const AXIS = '#7d8590';

/** A "nice" step (1, 2, 5 x 10^k) giving about `count` ticks over span. */
function niceStep(span, count) {
  const raw = span / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const f = raw / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

const MIN = 60e3;
const HOUR = 3600e3;
const TIME_STEPS = [15e3, 30e3, MIN, 2 * MIN, 5 * MIN, 10 * MIN, 15 * MIN, 30 * MIN, HOUR, 2 * HOUR, 3 * HOUR, 6 * HOUR, 12 * HOUR, 24 * HOUR, 48 * HOUR];

const pad2 = (n) => String(n).padStart(2, '0');
function timeLabel(ms, step) {
  const d = new Date(ms);
  if (step >= 24 * HOUR || (d.getHours() === 0 && d.getMinutes() === 0 && step >= HOUR)) return `${pad2(d.getMonth() + 1)}-${pad2(d.getDate())}`;
  return `${pad2(d.getHours())}:${pad2(d.getMinutes())}`;
}

export class LineChart {
  /** metric: {id, label, unit, digits}. */
  constructor(metric) {
    this.metric = metric;
    this.t = new Float64Array(0);
    this.v = new Float64Array(0);
    this.start = 0;
    this.end = 1;
    this.gapMs = Infinity;
    this.hoverIdx = -1;
    this.title = h('span', { class: 'chart-title' }, `${metric.label}${metric.unit ? ` (${metric.unit})` : ''}`);
    this.source = h('span', { class: 'chart-source' }, '');
    this.points = h('span', { class: 'chart-points' }, '');
    this.readout = h('span', { class: 'chart-readout' }, '');
    this.msg = h('div', { class: 'chart-msg' }, 'loading…');
    this.canvas = h('canvas', { class: 'chart-canvas', role: 'img', 'aria-label': `${metric.label} over time` });
    this.el = h(
      'figure',
      { class: 'chart', dataset: { metric: metric.id, points: '0', state: 'loading' } },
      h('figcaption', { class: 'chart-head' }, this.title, this.source, this.points, this.readout),
      h('div', { class: 'chart-body' }, this.canvas, this.msg),
    );
    this.canvas.addEventListener('mousemove', (e) => this.onMove(e));
    this.canvas.addEventListener('mouseleave', () => {
      this.hoverIdx = -1;
      this.readout.textContent = '';
      this.draw();
    });
  }

  setLoading(source) {
    this.el.dataset.state = 'loading';
    this.source.textContent = source || '';
    this.msg.textContent = 'loading…';
  }

  setError(message) {
    this.el.dataset.state = 'error';
    this.el.dataset.points = '0';
    this.points.textContent = '';
    this.msg.textContent = message;
    this.t = new Float64Array(0);
    this.v = new Float64Array(0);
    this.draw();
  }

  /**
   * points: [[ms, value], ...] sorted by time. start/end: the x range in ms.
   * gapMs: a jump between points longer than this breaks the line.
   */
  setData(points, { start, end, source, gapMs }) {
    this.t = Float64Array.from(points, (p) => p[0]);
    this.v = Float64Array.from(points, (p) => p[1]);
    this.start = start;
    this.end = end;
    this.gapMs = gapMs || Infinity;
    this.hoverIdx = -1;
    this.source.textContent = source;
    this.points.textContent = `${points.length} point${points.length === 1 ? '' : 's'}`;
    this.el.dataset.points = String(points.length);
    this.el.dataset.state = 'ready';
    this.msg.textContent = points.length ? '' : 'no data in this range';
    this.draw();
  }

  /** Sizes the canvas to its box (CSS px x devicePixelRatio) and paints. */
  draw() {
    const cssW = Math.max(240, this.canvas.parentElement ? this.canvas.parentElement.clientWidth : 600);
    const dpr = window.devicePixelRatio || 1;
    if (this.canvas.width !== Math.round(cssW * dpr) || this.canvas.height !== Math.round(HEIGHT * dpr)) {
      this.canvas.width = Math.round(cssW * dpr);
      this.canvas.height = Math.round(HEIGHT * dpr);
      this.canvas.style.width = `${cssW}px`;
      this.canvas.style.height = `${HEIGHT}px`;
    }
    const ctx = this.canvas.getContext('2d');
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, cssW, HEIGHT);
    const W = cssW - M.left - M.right;
    const H = HEIGHT - M.top - M.bottom;
    const { t, v } = this;

    // y range over the data, padded, on nice ticks.
    let lo = Infinity;
    let hi = -Infinity;
    for (let i = 0; i < v.length; i++) {
      if (v[i] < lo) lo = v[i];
      if (v[i] > hi) hi = v[i];
    }
    if (!Number.isFinite(lo)) {
      lo = 0;
      hi = 1;
    }
    if (hi - lo < 1e-9) {
      lo -= 1;
      hi += 1;
    }
    const yStep = niceStep(hi - lo, 4);
    lo = Math.floor(lo / yStep) * yStep;
    hi = Math.ceil(hi / yStep) * yStep;
    const xOf = (ms) => M.left + ((ms - this.start) / (this.end - this.start)) * W;
    const yOf = (val) => M.top + H - ((val - lo) / (hi - lo)) * H;
    this.xOf = xOf;
    this.yOf = yOf;

    ctx.font = '10px system-ui, sans-serif';
    ctx.lineWidth = 1;
    // y grid and labels
    ctx.textAlign = 'right';
    ctx.textBaseline = 'middle';
    const yDigits = Math.max(0, -Math.floor(Math.log10(yStep)));
    for (let y = lo; y <= hi + yStep / 2; y += yStep) {
      const py = Math.round(yOf(y)) + 0.5;
      ctx.strokeStyle = GRID;
      ctx.beginPath();
      ctx.moveTo(M.left, py);
      ctx.lineTo(M.left + W, py);
      ctx.stroke();
      ctx.fillStyle = AXIS;
      ctx.fillText(y.toFixed(yDigits), M.left - 6, py);
    }
    // unit on the y axis
    if (this.metric.unit) {
      ctx.save();
      ctx.translate(9, M.top + H / 2);
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = 'center';
      ctx.fillText(this.metric.unit, 0, 0);
      ctx.restore();
    }
    // x ticks on round times
    const span = this.end - this.start;
    const xStep = TIME_STEPS.find((s) => span / s <= 7) || TIME_STEPS[TIME_STEPS.length - 1];
    const tz = new Date(this.start).getTimezoneOffset() * 60e3; // ticks on local round times
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    for (let x = Math.ceil((this.start - tz) / xStep) * xStep + tz; x <= this.end; x += xStep) {
      const px = Math.round(xOf(x)) + 0.5;
      ctx.strokeStyle = GRID;
      ctx.beginPath();
      ctx.moveTo(px, M.top);
      ctx.lineTo(px, M.top + H + 4);
      ctx.stroke();
      ctx.fillStyle = AXIS;
      ctx.fillText(timeLabel(x, xStep), px, M.top + H + 7);
    }
    // axes
    ctx.strokeStyle = AXIS;
    ctx.beginPath();
    ctx.moveTo(M.left + 0.5, M.top);
    ctx.lineTo(M.left + 0.5, M.top + H + 0.5);
    ctx.lineTo(M.left + W, M.top + H + 0.5);
    ctx.stroke();

    // the line, broken at gaps; single points as dots
    ctx.save();
    ctx.beginPath();
    ctx.rect(M.left, M.top - 2, W, H + 4);
    ctx.clip();
    ctx.strokeStyle = LINE;
    ctx.fillStyle = LINE;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    for (let i = 0; i < t.length; i++) {
      const px = xOf(t[i]);
      const py = yOf(v[i]);
      const joined = i > 0 && t[i] - t[i - 1] <= this.gapMs;
      if (joined) ctx.lineTo(px, py);
      else ctx.moveTo(px, py);
      const alone = !joined && (i + 1 >= t.length || t[i + 1] - t[i] > this.gapMs);
      if (alone) ctx.fillRect(px - 1.5, py - 1.5, 3, 3);
    }
    ctx.stroke();
    ctx.restore();

    // hover crosshair
    if (this.hoverIdx >= 0 && this.hoverIdx < t.length) {
      const px = xOf(t[this.hoverIdx]);
      const py = yOf(v[this.hoverIdx]);
      ctx.strokeStyle = '#c9d1d9';
      ctx.setLineDash([3, 3]);
      ctx.beginPath();
      ctx.moveTo(Math.round(px) + 0.5, M.top);
      ctx.lineTo(Math.round(px) + 0.5, M.top + H);
      ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = '#ffffff';
      ctx.beginPath();
      ctx.arc(px, py, 3, 0, Math.PI * 2);
      ctx.fill();
    }
  }

  onMove(e) {
    if (!this.t.length || !this.xOf) return;
    const r = this.canvas.getBoundingClientRect();
    const x = e.clientX - r.left;
    const ms = this.start + ((x - M.left) / (r.width - M.left - M.right)) * (this.end - this.start);
    // nearest point by binary search over the sorted times
    let lo = 0;
    let hi = this.t.length - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (this.t[mid] < ms) lo = mid + 1;
      else hi = mid;
    }
    if (lo > 0 && Math.abs(this.t[lo - 1] - ms) < Math.abs(this.t[lo] - ms)) lo--;
    if (lo === this.hoverIdx) return;
    this.hoverIdx = lo;
    const m = this.metric;
    const val = this.v[lo];
    this.readout.textContent = `${fmtDateTime(this.t[lo])} · ${val.toFixed(m.digits)}${m.unit ? ` ${m.unit}` : ''}`;
    this.draw();
  }
}
