// Shared helpers of the browser tests: the environment the Rust test sets, a
// browser page that records console errors, warnings, page errors and dialogs,
// and reading the colour a person sees from a screenshot (a small PNG decoder,
// so that playwright-core stays the only dependency).

import assert from 'node:assert/strict';
import { inflateSync } from 'node:zlib';
import { join } from 'node:path';
import { mkdirSync } from 'node:fs';

export const BASE = (process.env.GPULSE_UI_URL || '').replace(/\/+$/, '');
export const FACTS = process.env.GPULSE_UI_FACTS ? JSON.parse(process.env.GPULSE_UI_FACTS) : null;
export const SHOTS = process.env.GPULSE_UI_SHOTS || '';

export const COLORS = {
  ok: [0x2e, 0x9d, 0x57],
  warning: [0xf2, 0xa9, 0x00],
  critical: [0xd6, 0x27, 0x28],
  no_data: [0x4a, 0x4f, 0x57],
  lost: [0x7b, 0x2c, 0xbf],
};

/**
 * Skips the test (and says why) when no server is given, or when the test
 * needs the demo's seeded GPUs and GPULSE_UI_FACTS is not set. Returns true if skipped.
 */
export function skipWithoutServer(t, { facts = true } = {}) {
  if (!BASE) {
    t.skip('GPULSE_UI_URL is not set: these tests need a running `gpulse demo` (the Rust UI test starts one and sets it)');
    return true;
  }
  if (facts && !FACTS) {
    t.skip('GPULSE_UI_FACTS is not set: the tests need the seeded GPUs of the demo');
    return true;
  }
  return false;
}

/**
 * Runs fn(page, problems) in a fresh headless Chromium, then asserts that no
 * console error or warning, page error or dialog (an alert from injected
 * markup would be one) happened anywhere along the way.
 */
export async function withPage(fn, { viewport = { width: 1400, height: 900 }, allowWarnings = [] } = {}) {
  // Imported here, so that without a server the tests skip even before `npm install`.
  const { chromium } = await import('playwright-core');
  const browser = await chromium.launch({
    executablePath: '/usr/bin/chromium',
    headless: true,
    args: ['--no-sandbox', '--disable-background-networking', '--disable-dev-shm-usage'],
  });
  const problems = [];
  try {
    const context = await browser.newContext({ viewport, deviceScaleFactor: 1 });
    const page = await context.newPage();
    page.on('console', (m) => {
      const type = m.type();
      if (type === 'error' || type === 'warning') {
        const text = m.text();
        if (!allowWarnings.some((re) => re.test(text))) problems.push(`console ${type}: ${text}`);
      }
    });
    page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
    page.on('dialog', (d) => {
      problems.push(`dialog (${d.type()}): ${d.message()}`);
      d.dismiss().catch(() => {});
    });
    await fn(page, problems);
    assert.deepEqual(problems, [], 'no console errors, warnings, page errors or dialogs');
  } finally {
    await browser.close();
  }
}

/** Opens a route of the UI and waits for its first paint (window.gpulse.ready). */
export async function open(page, hash) {
  await page.goto(`${BASE}/${hash}`);
  await waitReady(page, hash);
}

/** Waits until the router has handled `hash` and the view has painted. */
export async function waitReady(page, hash) {
  await page.waitForFunction((h) => window.gpulse && window.gpulse.route === h && window.gpulse.ready, hash, { timeout: 20000 });
  await page.evaluate(() => window.gpulse.ready);
}

/** The fleet layout from the data API (not from the page). */
export async function fetchLayout() {
  const res = await fetch(`${BASE}/api/v1/fleet/layout`);
  assert.equal(res.status, 200, 'GET /api/v1/fleet/layout');
  const body = await res.json();
  return body.data;
}

/** The GPU of `host` with index `gpu`: {uuid, row, rack, cluster, host, gpu}. */
export function findGpu(L, host, gpu) {
  for (let i = 0; i < L.uuid.length; i++) {
    if (L.host[i] === host && (gpu === undefined || Number(L.gpu[i]) === Number(gpu))) {
      return { i, uuid: L.uuid[i], row: L.row[i], rack: L.rack[i], cluster: L.cluster[i], host: L.host[i], gpu: L.gpu[i] };
    }
  }
  assert.fail(`GPU ${gpu} of host ${JSON.stringify(host)} is not in the layout`);
}

/** The fleet hash of a zoom, built like the UI builds it. */
export function zoomHash(filter) {
  return `#/?${new URLSearchParams(filter)}`;
}

/** The centre of the cell of `uuid` in viewport CSS px, or null if not drawn. */
export async function cellCentre(page, uuid) {
  const r = await page.evaluate((u) => window.gpulse.cellRect(u), uuid);
  if (!r) return null;
  return { x: r.x + r.w / 2, y: r.y + r.h / 2 };
}

/** The colour at a viewport point, read from a screenshot: [r, g, b]. */
export async function pixelAt(page, x, y) {
  const png = await page.screenshot({ clip: { x: Math.floor(x) - 1, y: Math.floor(y) - 1, width: 3, height: 3 } });
  const img = decodePng(png);
  const o = (1 * img.width + 1) * 4;
  return [img.data[o], img.data[o + 1], img.data[o + 2]];
}

/** The colour a person sees at the centre of the GPU's cell. */
export async function cellColor(page, uuid) {
  const c = await cellCentre(page, uuid);
  assert.ok(c, `the cell of ${uuid} is drawn`);
  return pixelAt(page, c.x, c.y);
}

/** Waits until the GPU's cell shows `want` (within tol per channel); fails with the last colour seen. */
export async function waitCellColor(page, uuid, want, label, tol = 12) {
  let seen = null;
  await eventually(
    async () => {
      seen = await cellColor(page, uuid);
      return near(seen, want, tol);
    },
    { message: `${label} painted ${hex(want)}` },
  ).catch((e) => {
    throw new assert.AssertionError({ message: `${e.message}; last colour seen ${seen ? hex(seen) : 'none'}` });
  });
}

export const near = (a, b, tol = 10) => a.every((v, k) => Math.abs(v - b[k]) <= tol);
export const distance = (a, b) => Math.max(...a.map((v, k) => Math.abs(v - b[k])));
export const hex = (c) => `#${c.map((v) => v.toString(16).padStart(2, '0')).join('')}`;

/** Polls fn until it returns a truthy value (returned), or fails after timeoutMs. */
export async function eventually(fn, { timeoutMs = 15000, intervalMs = 250, message = 'condition' } = {}) {
  const end = Date.now() + timeoutMs;
  let last;
  for (;;) {
    try {
      last = await fn();
      if (last) return last;
    } catch (e) {
      last = e;
    }
    if (Date.now() > end) assert.fail(`${message} did not hold within ${timeoutMs} ms (last: ${last instanceof Error ? last.message : JSON.stringify(last)})`);
    await new Promise((r) => setTimeout(r, intervalMs));
  }
}

/** Saves a full-page screenshot under GPULSE_UI_SHOTS, if set. */
export async function shot(page, name) {
  if (!SHOTS) return;
  mkdirSync(SHOTS, { recursive: true });
  await page.mouse.move(0, 0);
  await page.screenshot({ path: join(SHOTS, name) });
}

/** Decodes an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes) to RGBA. */
export function decodePng(buf) {
  assert.equal(buf.readUInt32BE(0), 0x89504e47, 'PNG signature');
  let off = 8;
  let width = 0;
  let height = 0;
  let colorType = 0;
  const idat = [];
  while (off < buf.length) {
    const len = buf.readUInt32BE(off);
    const type = buf.toString('latin1', off + 4, off + 8);
    const data = buf.subarray(off + 8, off + 8 + len);
    if (type === 'IHDR') {
      width = data.readUInt32BE(0);
      height = data.readUInt32BE(4);
      assert.equal(data[8], 8, 'PNG bit depth 8');
      colorType = data[9];
      assert.ok(colorType === 2 || colorType === 6, `PNG colour type ${colorType}`);
      assert.equal(data[12], 0, 'PNG not interlaced');
    } else if (type === 'IDAT') idat.push(data);
    else if (type === 'IEND') break;
    off += 12 + len;
  }
  const bpp = colorType === 6 ? 4 : 3;
  const raw = inflateSync(Buffer.concat(idat));
  const stride = width * bpp;
  const px = Buffer.alloc(height * stride);
  for (let y = 0; y < height; y++) {
    const filter = raw[y * (stride + 1)];
    const src = raw.subarray(y * (stride + 1) + 1, (y + 1) * (stride + 1));
    const cur = px.subarray(y * stride, (y + 1) * stride);
    const prev = y > 0 ? px.subarray((y - 1) * stride, y * stride) : Buffer.alloc(stride);
    for (let x = 0; x < stride; x++) {
      const a = x >= bpp ? cur[x - bpp] : 0;
      const b = prev[x];
      const c = x >= bpp ? prev[x - bpp] : 0;
      let v = src[x];
      if (filter === 1) v += a;
      else if (filter === 2) v += b;
      else if (filter === 3) v += (a + b) >> 1;
      else if (filter === 4) {
        const p = a + b - c;
        const pa = Math.abs(p - a);
        const pb = Math.abs(p - b);
        const pc = Math.abs(p - c);
        v += pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
      }
      cur[x] = v & 0xff;
    }
  }
  const data = Buffer.alloc(width * height * 4);
  for (let i = 0; i < width * height; i++) {
    data[i * 4] = px[i * bpp];
    data[i * 4 + 1] = px[i * bpp + 1];
    data[i * 4 + 2] = px[i * bpp + 2];
    data[i * 4 + 3] = bpp === 4 ? px[i * bpp + 3] : 255;
  }
  return { width, height, data };
}
