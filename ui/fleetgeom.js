// Geometry of the fleet canvas: which GPUs are shown, where each group (row,
// rack, host) and each GPU cell sits, and the reverse (what is under a point).
// Everything is arithmetic over a few arrays, so 100,000 GPUs cost no DOM
// elements and a hover costs a binary search and two divisions.

const MARGIN = 8;
const ROW_HEAD = 22; // row label band
const ROW_GAP = 12; // space after a row
const RACK_GAP = 8; // between rack boxes, both ways
const MAX_COLS = 16; // a host with more GPUs wraps onto more lines
const HOST_LABEL_MAX = 130; // CSS px; longer host names are cut with an ellipsis
// Cell sizes tried from large to small; the first whose layout fits the
// available height wins (the smallest is used even if it does not fit).
const CELL_SIZES = [64, 52, 44, 36, 30, 26, 22, 18, 15, 13, 11, 9, 7, 6, 5, 4, 3];
// Side-by-side columns of host lines in a rack, tried in this order.
const BANDS = [1, 2, 4, 8];

/**
 * The GPUs to show: indices into the layout arrays whose cluster/row/rack/host
 * match the given filter (empty filter = all). The layout is sorted by cluster,
 * row, rack, host, gpu, so the result is too.
 */
export function selectGpus(L, filter) {
  const keys = ['cluster', 'row', 'rack', 'host'].filter((k) => filter[k] !== undefined && filter[k] !== null);
  if (keys.length === 0) {
    const all = new Int32Array(L.n);
    for (let i = 0; i < L.n; i++) all[i] = i;
    return all;
  }
  const out = [];
  const cols = keys.map((k) => L[k]);
  const want = keys.map((k) => filter[k]);
  outer: for (let i = 0; i < L.n; i++) {
    for (let j = 0; j < cols.length; j++) if (cols[j][i] !== want[j]) continue outer;
    out.push(i);
  }
  return Int32Array.from(out);
}

/**
 * Groups the selected GPUs into rows -> racks -> hosts (runs of equal names,
 * which the sort makes contiguous). Each rack also gets its lines: a line is
 * up to MAX_COLS GPUs of one host, and lineStart/lineEnd are positions in sel.
 */
export function buildTree(L, sel) {
  const rows = [];
  let row = null;
  let rack = null;
  let host = null;
  for (let p = 0; p < sel.length; p++) {
    const i = sel[p];
    const c = L.cluster[i];
    const r = L.row[i];
    const k = L.rack[i];
    const hn = L.host[i];
    if (!row || row.cluster !== c || row.row !== r) {
      row = { cluster: c, row: r, racks: [], count: 0 };
      rows.push(row);
      rack = null;
    }
    if (!rack || rack.rack !== k) {
      rack = { cluster: c, row: r, rack: k, hosts: [], count: 0 };
      row.racks.push(rack);
      host = null;
    }
    if (!host || host.host !== hn) {
      host = { cluster: c, row: r, rack: k, host: hn, start: p, end: p };
      rack.hosts.push(host);
    }
    host.end = p + 1;
    rack.count++;
    row.count++;
  }
  const hostNames = [];
  for (const rw of rows) {
    for (const rk of rw.racks) {
      let widest = 1;
      for (const hs of rk.hosts) widest = Math.max(widest, hs.end - hs.start);
      rk.cols = Math.min(MAX_COLS, widest);
      const starts = [];
      const ends = [];
      const lineHost = [];
      for (const hs of rk.hosts) {
        hs.rk = rk;
        hs.firstLine = starts.length;
        for (let s = hs.start; s < hs.end; s += rk.cols) {
          starts.push(s);
          ends.push(Math.min(hs.end, s + rk.cols));
          lineHost.push(hs);
        }
        hostNames.push(hs.host);
      }
      rk.lineStart = Int32Array.from(starts);
      rk.lineEnd = Int32Array.from(ends);
      rk.lineHost = lineHost;
      rk.lines = starts.length;
    }
  }
  const clusters = new Set(rows.map((r) => r.cluster));
  return { rows, hostNames, multiCluster: clusters.size > 1, count: sel.length };
}

/** Widest host label in CSS px (measures only the longest names, by length). */
export function hostLabelWidth(tree, measure) {
  const names = [...new Set(tree.hostNames)].sort((a, b) => b.length - a.length).slice(0, 24);
  let w = 0;
  for (const n of names) w = Math.max(w, measure(n || '(no host)'));
  return Math.min(HOST_LABEL_MAX, Math.ceil(w)) + 8;
}

function metrics(cs, hostLabelW) {
  const gap = cs >= 10 ? 2 : 1;
  const pitch = cs + gap;
  const tiny = cs < 6;
  return {
    cs,
    gap,
    pitch,
    rackHead: tiny ? 0 : 18,
    pad: tiny ? 2 : 5,
    bandGap: tiny ? 3 : 8,
    // Host names only where a line is tall enough to read them.
    hostW: pitch >= 12 ? hostLabelW : 0,
  };
}

/**
 * Places rows and racks for one cell size and band count; returns the total
 * height, or Infinity if a rack would not fit the width. A rack's host lines
 * are split into up to `bands` side-by-side columns, so that a rack of many
 * hosts is drawn squarish instead of as a tall thin strip.
 */
function place(tree, width, m, bands) {
  let y = MARGIN;
  for (const row of tree.rows) {
    row.y = y;
    let lineTop = y + ROW_HEAD;
    let x = MARGIN;
    let lineH = 0;
    for (const rk of row.racks) {
      const b = Math.max(1, Math.min(bands, rk.lines));
      const per = Math.ceil(rk.lines / b);
      const bandW = m.hostW + rk.cols * m.pitch - m.gap;
      const w = m.pad * 2 + b * bandW + (b - 1) * m.bandGap;
      const h = m.rackHead + m.pad * 2 + per * m.pitch - m.gap;
      if (b > 1 && w > width - 2 * MARGIN) return Infinity;
      if (x > MARGIN && x + w > width - MARGIN) {
        x = MARGIN;
        lineTop += lineH + RACK_GAP;
        lineH = 0;
      }
      Object.assign(rk, { x, y: lineTop, w, h, bands: b, per, bandW });
      rk.cellsY = lineTop + m.rackHead + m.pad;
      x += w + RACK_GAP;
      lineH = Math.max(lineH, h);
    }
    row.h = lineTop + lineH - row.y;
    row.w = width - 2 * MARGIN;
    y = row.y + row.h + ROW_GAP;
  }
  return y - ROW_GAP + MARGIN;
}

/** Left edge of line l's band (host label first, then the cells) and its top. */
function lineOrigin(rk, l, m) {
  const j = Math.floor(l / rk.per);
  return [rk.x + m.pad + j * (rk.bandW + m.bandGap), rk.cellsY + (l - j * rk.per) * m.pitch];
}

/**
 * Lays the tree out in `width` CSS px with the largest cell size whose layout
 * fits `availHeight` (fewest bands first), or else the most compact layout of
 * the smallest size. Returns the geometry used for painting and hit-testing;
 * cell positions are in CSS px, per position in sel.
 */
export function computeGeometry(tree, sel, width, availHeight, hostLabelW) {
  let pick = null;
  for (const cs of CELL_SIZES) {
    const m = metrics(cs, hostLabelW);
    for (const bands of BANDS) {
      const height = place(tree, width, m, bands);
      if (height <= availHeight) {
        pick = { m, bands };
        break;
      }
      if (cs === CELL_SIZES[CELL_SIZES.length - 1] && (!pick || height < pick.height)) pick = { m, bands, height };
    }
    if (pick && pick.height === undefined) break;
  }
  const { m, bands } = pick;
  const height = place(tree, width, m, bands);
  const cx = new Float32Array(sel.length);
  const cy = new Float32Array(sel.length);
  for (const row of tree.rows) {
    for (const rk of row.racks) {
      for (let l = 0; l < rk.lines; l++) {
        const [lx, ly] = lineOrigin(rk, l, m);
        const s = rk.lineStart[l];
        for (let q = s; q < rk.lineEnd[l]; q++) {
          cx[q] = lx + m.hostW + (q - s) * m.pitch;
          cy[q] = ly;
        }
      }
    }
  }
  return { ...m, width, height: Math.max(height, 40), rows: tree.rows, multiCluster: tree.multiCluster, cx, cy, rowHead: ROW_HEAD };
}

/** Where a host's label goes: its first line's band, left of the cells. */
export function hostLabelOrigin(g, hs) {
  return lineOrigin(hs.rk, hs.firstLine, g);
}

/**
 * What is at (x, y) in CSS px of the canvas: {level:'gpu', pos} (pos in sel),
 * {level:'host'|'rack'|'row', group}, or null.
 */
export function hitTest(g, x, y) {
  const rows = g.rows;
  let lo = 0;
  let hi = rows.length - 1;
  let row = null;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    const r = rows[mid];
    if (y < r.y) hi = mid - 1;
    else if (y >= r.y + r.h) lo = mid + 1;
    else {
      row = r;
      break;
    }
  }
  if (!row || x < MARGIN || x >= MARGIN + row.w) return null;
  if (y < row.y + ROW_HEAD) return { level: 'row', group: row };
  for (const rk of row.racks) {
    if (x < rk.x || x >= rk.x + rk.w || y < rk.y || y >= rk.y + rk.h) continue;
    const rack = { level: 'rack', group: rk };
    const local = Math.floor((y - rk.cellsY) / g.pitch);
    if (y < rk.cellsY || local >= rk.per) return rack;
    const relX = x - rk.x - g.pad;
    const j = Math.floor(relX / (rk.bandW + g.bandGap));
    const inBand = relX - j * (rk.bandW + g.bandGap);
    const l = j * rk.per + local;
    if (j < 0 || j >= rk.bands || inBand >= rk.bandW || l >= rk.lines) return rack;
    if (inBand < g.hostW) return { level: 'host', group: rk.lineHost[l] };
    const col = Math.floor((inBand - g.hostW) / g.pitch);
    const inCell = inBand - g.hostW - col * g.pitch < g.cs && y - rk.cellsY - local * g.pitch < g.cs;
    const pos = rk.lineStart[l] + col;
    if (inCell && pos < rk.lineEnd[l]) return { level: 'gpu', pos };
    return rack;
  }
  return { level: 'row', group: row };
}

/** The label box of a group, in CSS px of the canvas (for the test hook). */
export function labelBox(g, level, group) {
  if (level === 'row') return { x: MARGIN, y: group.y, w: Math.min(200, group.w), h: ROW_HEAD };
  if (level === 'rack') {
    if (g.rackHead === 0) return { x: group.x, y: group.y, w: group.w, h: group.h };
    return { x: group.x + g.pad, y: group.y, w: group.w - 2 * g.pad, h: g.rackHead };
  }
  if (level === 'host' && g.hostW > 0) {
    const [x, y] = hostLabelOrigin(g, group);
    return { x, y, w: g.hostW - 6, h: g.cs };
  }
  return null;
}
