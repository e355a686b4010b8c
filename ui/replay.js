// Replay bar under the fleet view. Entering replay fetches every frame of the
// range in one request into one typed array (steps x GPUs); a step of the
// scrubber or of playback then only recolours the canvas from a subarray of it,
// with no request and no allocation, so playback keeps up at 10,000 GPUs.

import * as api from './api.js';
import { h, select, fmtDateTime } from './dom.js';
import { METRIC_BY_ID, scaleFor, typedValues } from './colors.js';

const RANGES = [
  ['hour', 'last hour', 3600, '60s', 60],
  ['day', 'last day', 86400, '15m', 900],
  ['week', 'last week', 7 * 86400, '1h', 3600],
];
const SPEEDS = [1, 2, 5, 10];
const STEPS_PER_SECOND_AT_1X = 2; // 10x plays 20 steps a second

export class ReplayBar {
  constructor(fleet) {
    this.fleet = fleet;
    this.active = false;
    this.loading = false;
    this.playing = false;
    this.speed = 1;
    this.range = 'hour';
    this.data = null; // {color, values (typed, K*N), n, steps, startMs, stepMs, scale}
    this.loadSeq = 0;
    this.raf = 0;

    this.mode = h('span', { class: 'replay-mode', dataset: { mode: 'live' } }, 'Live');
    this.rangeSelect = select(
      RANGES.map(([v, label]) => [v, label]),
      this.range,
      (v) => {
        this.range = v;
        if (this.active) this.reload();
      },
      { class: 'replay-range', 'aria-label': 'replay range' },
    );
    this.toggle = h('button', { type: 'button', class: 'replay-toggle', on: { click: () => (this.active ? this.exit() : this.enter()) } }, 'Replay');
    this.playBtn = h('button', { type: 'button', class: 'replay-play', disabled: true, 'aria-label': 'play', on: { click: () => this.setPlaying(!this.playing) } }, '▶');
    this.speedSelect = select(
      SPEEDS.map((s) => [String(s), `${s}x`]),
      '1',
      (v) => {
        this.speed = Number(v);
      },
      { class: 'replay-speed', 'aria-label': 'speed' },
    );
    this.scrubber = h('input', { type: 'range', class: 'replay-scrubber', min: '0', max: '0', step: '1', value: '0', disabled: true, 'aria-label': 'time' });
    this.scrubber.addEventListener('input', () => this.show(Number(this.scrubber.value)));
    this.time = h('span', { class: 'replay-time' }, '');
    this.info = h('span', { class: 'replay-info' }, '');
    this.el = h('div', { class: 'replay', dataset: { state: 'live' } }, this.mode, this.rangeSelect, this.toggle, this.playBtn, this.speedSelect, this.scrubber, this.time, this.info);
  }

  setState(state) {
    this.el.dataset.state = state;
    this.mode.dataset.mode = state === 'live' ? 'live' : 'replay';
    this.mode.textContent = state === 'live' ? 'Live' : 'Replay';
  }

  async enter() {
    this.active = true;
    this.fleet.setLive(false);
    this.toggle.textContent = 'Live';
    await this.reload();
  }

  exit() {
    this.active = false;
    this.loadSeq++;
    this.setPlaying(false);
    this.data = null;
    this.scrubber.disabled = true;
    this.playBtn.disabled = true;
    this.toggle.textContent = 'Replay';
    this.time.textContent = '';
    this.info.textContent = '';
    this.setState('live');
    this.fleet.setLive(true);
  }

  /** Fetches every frame of the range for the current colour (one request). */
  async reload() {
    const seq = ++this.loadSeq;
    const [, label, seconds, step, stepS] = RANGES.find((r) => r[0] === this.range);
    const keep = this.data ? Number(this.scrubber.value) / Math.max(1, this.data.steps - 1) : 1;
    this.setPlaying(false);
    this.loading = true;
    this.setState('loading');
    this.scrubber.disabled = true;
    this.playBtn.disabled = true;
    this.info.textContent = `loading ${label}…`;
    const color = this.fleet.color;
    // Windows aligned to the step, so each one is whole rollup windows.
    const end = Math.floor(Date.now() / 1000);
    const start = Math.floor((end - seconds) / stepS) * stepS;
    try {
      let d = await api.frames(color, start, end, step);
      if (seq !== this.loadSeq) return;
      let L = this.fleet.L;
      if (!L || d.version !== L.version) {
        L = await api.layout(true);
        if (seq !== this.loadSeq) return;
        this.fleet.L = L;
        this.fleet.rebuild();
        if (d.version !== L.version) throw new api.ApiError(`frames are of layout ${d.version}, the layout is ${L.version}`);
      }
      const n = L.n;
      const steps = d.steps ?? d.values.length;
      const values = color === 'health' ? new Uint8Array(steps * n) : new Float32Array(steps * n);
      for (let k = 0; k < steps; k++) {
        const row = d.values[k];
        if (!row || row.length !== n) throw new api.ApiError(`frame ${k} has ${row ? row.length : 0} values, expected ${n}`);
        typedValues(color, row, values.subarray(k * n, (k + 1) * n));
      }
      const scale = color === 'health' ? [0, 1] : scaleFor(METRIC_BY_ID.get(color), values);
      this.data = { color, values, n, steps, startMs: d.start_ms, stepMs: d.step_ms, scale, tier: d.tier };
      const warnings = d.warnings;
      d = null; // the JSON arrays can go: the typed array holds the frames
      this.loading = false;
      this.setState('ready');
      this.scrubber.max = String(Math.max(0, steps - 1));
      this.scrubber.disabled = steps === 0;
      this.playBtn.disabled = steps === 0;
      this.info.textContent = `${steps} steps of ${step}${this.data.tier ? ` · ${this.data.tier === 'raw' ? 'raw' : `rollup ${this.data.tier}`}` : ''}`;
      if (steps > 0) {
        const k = Math.round(keep * (steps - 1));
        this.scrubber.value = String(k);
        this.show(k);
      } else this.time.textContent = 'no data in range';
      this.fleet.app.setStatus({ error: null, warnings });
    } catch (e) {
      if (seq !== this.loadSeq) return;
      this.loading = false;
      this.setState('error');
      this.info.textContent = e.message;
      this.fleet.app.setStatus({ error: e.message });
    }
  }

  /** Shows step k from the typed array: no request. */
  show(k) {
    const d = this.data;
    if (!d || !this.active) return;
    const n = d.n;
    const view = d.values.subarray(k * n, (k + 1) * n);
    const t = d.startMs + k * d.stepMs;
    this.fleet.showFrame(d.color, view, t, d.scale);
    this.time.textContent = `${fmtDateTime(t)} (${k + 1}/${d.steps})`;
  }

  setPlaying(on) {
    cancelAnimationFrame(this.raf);
    this.playing = on && !!this.data;
    this.playBtn.textContent = this.playing ? '❚❚' : '▶';
    this.playBtn.setAttribute('aria-label', this.playing ? 'pause' : 'play');
    if (!this.playing) return;
    // From the end, play restarts at the beginning.
    if (Number(this.scrubber.value) >= this.data.steps - 1) {
      this.scrubber.value = '0';
      this.show(0);
    }
    let last = performance.now();
    let acc = 0;
    const tick = (now) => {
      if (!this.playing || !this.data) return;
      acc += ((now - last) / 1000) * this.speed * STEPS_PER_SECOND_AT_1X;
      last = now;
      if (acc >= 1) {
        const adv = Math.floor(acc);
        acc -= adv;
        const k = Math.min(this.data.steps - 1, Number(this.scrubber.value) + adv);
        this.scrubber.value = String(k);
        this.show(k);
        if (k >= this.data.steps - 1) {
          this.setPlaying(false);
          return;
        }
      }
      this.raf = requestAnimationFrame(tick);
    };
    this.raf = requestAnimationFrame(tick);
  }

  dispose() {
    this.loadSeq++;
    this.playing = false;
    cancelAnimationFrame(this.raf);
  }
}
