// Measures the fleet view at scale and prints the figures; asserts nothing
// (the house rule: performance is measured by benchmarks, not timed tests).
//
//   GPULSE_UI_URL=http://127.0.0.1:7401 node benches/ui/measure.mjs [10000 100000 ... | real]
//
// `real` measures the server's own fleet instead (its real data API, e.g. a
// `gpulse serve` loaded by `gpulse-bench ingest --gpus 10000`).
//
// A running `gpulse serve` or `gpulse demo` serves the real UI; the fleet API
// calls are answered in the browser with a synthetic fleet of each size
// (tests/ui/synthetic.mjs), so no server needs that many GPUs. Needs
// `npm install --prefix tests/ui` (playwright-core) and /usr/bin/chromium.
// Figures per size:
//   first paint      ms from navigation start to window.gpulse.ready
//   refresh          main-thread ms of one live refresh (JSON parse + recolour), median of 3
//   recolour         ms of the last repaint of every cell
//   replay           steps/s over 30 scrubber steps, one rendered frame each, and ms per step

import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';
import { fakeFleet } from '../../tests/ui/synthetic.mjs';

const require = createRequire(fileURLToPath(new URL('../../tests/ui/package.json', import.meta.url)));
const { chromium } = require('playwright-core');

const BASE = (process.env.GPULSE_UI_URL || '').replace(/\/+$/, '');
if (!BASE) {
  console.error('set GPULSE_UI_URL to a running gpulse node (e.g. http://127.0.0.1:7401)');
  process.exit(2);
}
const sizes = process.argv.slice(2).map((a) => (a === 'real' ? 0 : Number(a))).filter((n) => n >= 0);
if (!sizes.length) sizes.push(10000, 100000);

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

async function measure(browser, n) {
  const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
  if (n > 0) await fakeFleet(page, n);
  else n = `${(await (await fetch(`${BASE}/api/v1/fleet/layout`)).json()).data.gpus} (real)`;
  await page.goto(`${BASE}/#/`);
  await page.waitForFunction(() => window.gpulse && window.gpulse.ready);
  const firstPaint = await page.evaluate(() => window.gpulse.ready.then(() => performance.now()));

  // Live refreshes come every 5 s; take three.
  const refresh = [];
  for (let k = 0; k < 3; k++) {
    const t0 = await page.evaluate(() => window.gpulse.frameTime);
    await page.waitForFunction((t) => window.gpulse.frameTime !== t, t0, { timeout: 15000 });
    refresh.push(await page.evaluate(() => window.gpulse.stats.refreshMs));
  }
  const recolour = await page.evaluate(() => window.gpulse.stats.paintMs);

  await page.locator('select.color-select').selectOption('DCGM_FI_DEV_GPU_TEMP');
  await page.locator('button.replay-toggle').click();
  await page.locator('.replay[data-state="ready"]').waitFor({ timeout: 60000 });
  const fps = await page.evaluate(async () => {
    const s = document.querySelector('input.replay-scrubber');
    const frame = () => new Promise((r) => requestAnimationFrame(() => r()));
    await frame();
    const start = performance.now();
    for (let k = 0; k < 30; k++) {
      s.value = String(k);
      s.dispatchEvent(new Event('input', { bubbles: true }));
      await frame();
    }
    return 30000 / (performance.now() - start);
  });
  const stepMs = await page.evaluate(() => window.gpulse.stats.stepMs);
  await page.close();
  return { n, firstPaint, refresh: median(refresh), recolour, fps, stepMs };
}

const browser = await chromium.launch({
  executablePath: '/usr/bin/chromium',
  headless: true,
  args: ['--no-sandbox', '--disable-background-networking', '--disable-dev-shm-usage'],
});
try {
  console.log('GPUs      first paint   refresh (main thread)   recolour   replay');
  for (const n of sizes) {
    const r = await measure(browser, n);
    console.log(
      `${String(r.n).padEnd(9)} ${`${r.firstPaint.toFixed(0)} ms`.padEnd(13)} ${`${r.refresh.toFixed(1)} ms`.padEnd(23)} ${`${r.recolour.toFixed(1)} ms`.padEnd(10)} ${r.fps.toFixed(1)} steps/s (${r.stepMs.toFixed(1)} ms/step)`,
    );
  }
} finally {
  await browser.close();
}
