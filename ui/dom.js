// Small DOM helpers. Everything that comes from the data (host names, UUIDs,
// evidence text) goes in through text nodes, never through innerHTML, so a host
// named `<img src=x onerror=alert(1)>` is shown as those characters.

/**
 * h('a', {href: '#/', class: 'x', on: {click: fn}}, 'text', child, [more])
 * Props: class, text, dataset, on (event listeners), and any attribute name.
 * Children: strings and numbers become text nodes; null/undefined/false are skipped.
 */
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  if (props) {
    for (const [k, v] of Object.entries(props)) {
      if (v === undefined || v === null || v === false) continue;
      if (k === 'class') el.className = v;
      else if (k === 'text') el.textContent = String(v);
      else if (k === 'dataset') Object.assign(el.dataset, v);
      else if (k === 'on') for (const [ev, fn] of Object.entries(v)) el.addEventListener(ev, fn);
      else if (k === 'checked' || k === 'disabled' || k === 'value' || k === 'selected') el[k] = v;
      else el.setAttribute(k, v === true ? '' : String(v));
    }
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else if (c instanceof Node) el.appendChild(c);
    else el.appendChild(document.createTextNode(String(c)));
  }
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

/** A <select> with [value, label] options. */
export function select(options, value, onChange, props = {}) {
  const s = h('select', props, options.map(([v, label]) => h('option', { value: v, selected: v === value }, label)));
  s.value = value;
  if (onChange) s.addEventListener('change', () => onChange(s.value));
  return s;
}

/** An error box, text only. */
export function errorBox(message) {
  return h('div', { class: 'error', role: 'alert' }, String(message));
}

const pad = (n, w = 2) => String(n).padStart(w, '0');

/** 'YYYY-MM-DD HH:MM:SS' in local time, or '' for null/NaN. */
export function fmtDateTime(ms) {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return '';
  const d = new Date(ms);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${fmtTime(ms)}`;
}

/** 'HH:MM:SS' in local time. */
export function fmtTime(ms) {
  const d = new Date(ms);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

/** Parses an RFC 3339 timestamp from SQL results; null stays null. */
export function parseTs(s) {
  if (s === null || s === undefined || s === '') return null;
  if (typeof s === 'number') return s;
  const ms = Date.parse(s);
  return Number.isFinite(ms) ? ms : null;
}

/** A link to the GPU page. */
export function gpuHref(uuid) {
  return `#/gpu/${encodeURIComponent(uuid)}`;
}
