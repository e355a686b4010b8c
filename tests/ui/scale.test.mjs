// Scale: the demo has 128 GPUs, so these tests answer the fleet API calls in
// the browser (page.route) with synthetic fleets of 10,000 and 100,000 GPUs.
// The UI itself is the real one, served by the real server. They check that
// the view works at that size (paint, colours, hover, live refresh, replay,
// zoom). Timings are not asserted here (performance is measured by
// benchmarks, not timed assertions): benches/ui/measure.mjs prints them.

import test from 'node:test';
import assert from 'node:assert/strict';
import { skipWithoutServer, withPage, open, waitReady, cellCentre, pixelAt, near, COLORS, eventually } from './helpers.mjs';
import { fakeFleet } from './synthetic.mjs';

test('scale: 10,000 GPUs paint, refresh live and replay', { timeout: 60000 }, async (t) => {
  if (skipWithoutServer(t, { facts: false })) return;
  await withPage(async (page) => {
    const L = await fakeFleet(page, 10000);
    await open(page, '#/');
    const c = await cellCentre(page, L.uuid[0]);
    assert.ok(near(await pixelAt(page, c.x, c.y), COLORS.critical, 12), 'GPU 0 drawn critical');
    const last = await cellCentre(page, L.uuid[L.uuid.length - 1]);
    assert.ok(last, 'the last GPU is drawn too');

    // The next live refresh (5 s) puts a new frame on screen.
    const t0 = await page.evaluate(() => window.gpulse.frameTime);
    await eventually(async () => (await page.evaluate(() => window.gpulse.frameTime)) !== t0, { timeoutMs: 12000, message: 'a live refresh' });

    // Replay: 60 steps fetched once; moving the scrubber changes the frame on screen.
    await page.locator('select.color-select').selectOption('DCGM_FI_DEV_GPU_TEMP');
    await page.locator('button.replay-toggle').click();
    await page.locator('.replay[data-state="ready"]').waitFor({ timeout: 20000 });
    const times = await page.evaluate(() => {
      const s = document.querySelector('input.replay-scrubber');
      const out = [];
      for (const k of [0, 30, 59]) {
        s.value = String(k);
        s.dispatchEvent(new Event('input', { bubbles: true }));
        out.push(window.gpulse.frameTime);
      }
      return out;
    });
    assert.deepEqual([times[1] - times[0], times[2] - times[0]], [30 * 60000, 59 * 60000], 'replay steps are 60 s apart');
    const hot = await cellCentre(page, L.uuid[0]);
    assert.ok(hot, 'GPU 0 drawn in replay');
  });
});

test('scale: 100,000 GPUs stay usable (paint, hover, zoom)', { timeout: 60000 }, async (t) => {
  if (skipWithoutServer(t, { facts: false })) return;
  await withPage(async (page) => {
    const L = await fakeFleet(page, 100000);
    await open(page, '#/');
    const c = await cellCentre(page, L.uuid[0]);
    assert.ok(c, 'GPU 0 drawn');
    assert.ok(near(await pixelAt(page, c.x, c.y), COLORS.critical, 12), 'GPU 0 drawn critical');
    await page.mouse.move(c.x, c.y);
    await eventually(async () => (await page.locator('#tooltip').textContent()).includes(L.uuid[0]), { message: 'tooltip over a cell' });
    // Zoom to a rack through the URL: 256 GPUs, large cells.
    const hash = `#/?${new URLSearchParams({ row: L.row[50000], rack: L.rack[50000] })}`;
    await page.evaluate((h) => {
      location.hash = h;
    }, hash);
    await waitReady(page, hash);
    assert.equal(await page.locator('.breadcrumb .current').textContent(), L.rack[50000]);
    const r = await page.evaluate((u) => window.gpulse.cellRect(u), L.uuid[50000]);
    assert.ok(r && r.w >= 10, `zoomed cells are large (${r && r.w} px)`);
  });
});
