// Replay: over the last hour coloured by temperature, the GPU whose backfilled
// temperature went from 35 °C to 85 °C half an hour ago looks different early
// and late; scrubbing makes no request; "Live" resumes the live refresh.

import test from 'node:test';
import assert from 'node:assert/strict';
import { FACTS, COLORS, skipWithoutServer, withPage, open, fetchLayout, findGpu, cellColor, distance, hex, eventually, shot } from './helpers.mjs';

test('replay: the heated GPU changes colour between an early and a late step', { timeout: 60000 }, async (t) => {
  if (skipWithoutServer(t)) return;
  const L = await fetchLayout();
  const heated = findGpu(L, FACTS.heated.host, FACTS.heated.gpu);
  await withPage(async (page) => {
    await open(page, '#/');
    // As a user would: pick the metric, the range, press Replay.
    await page.locator('select.color-select').selectOption('DCGM_FI_DEV_GPU_TEMP');
    await eventually(async () => (await page.locator('.legend').textContent()).includes('Temperature'), { message: 'temperature legend' });
    await page.locator('select.replay-range').selectOption('hour');
    await page.locator('button.replay-toggle').click();
    await page.locator('.replay[data-state="ready"]').waitFor({ timeout: 30000 });

    const requests = [];
    page.on('request', (r) => {
      if (r.url().includes('/api/v1/fleet/')) requests.push(r.url());
    });
    const scrubber = page.locator('input.replay-scrubber');
    const steps = Number(await scrubber.getAttribute('max')) + 1;
    assert.ok(steps >= 50, `an hour at 60 s steps (${steps} steps)`);

    // Early: 8 steps in (about 52 minutes ago: 35 °C). Late: 15 steps from the
    // end (about 15 minutes ago: 85 °C; not the newest steps, so that a server
    // seeded a few minutes before the test still has data there).
    const r = await page.evaluate((u) => window.gpulse.cellRect(u), heated.uuid);
    const tooltip = page.locator('#tooltip');
    await scrubber.focus();
    await page.keyboard.press('Home');
    for (let k = 0; k < 8; k++) await page.keyboard.press('ArrowRight');
    assert.equal(await scrubber.inputValue(), '8');
    const earlyT = await page.evaluate(() => window.gpulse.frameTime);
    const early = await cellColor(page, heated.uuid);
    assert.match(await page.locator('.replay-time').textContent(), /\(9\/\d+\)/);
    // Hovering in replay shows the value of the step on screen.
    await page.mouse.move(r.x + r.w / 2, r.y + r.h / 2);
    await eventually(async () => /Temperature: 3\d(\.\d)? °C/.test(await tooltip.textContent()), { message: 'tooltip shows about 35 °C early' });

    await page.keyboard.press('End');
    for (let k = 0; k < 15; k++) await page.keyboard.press('ArrowLeft');
    const lateT = await page.evaluate(() => window.gpulse.frameTime);
    await eventually(async () => /Temperature: 8\d(\.\d)? °C/.test(await tooltip.textContent()), { message: 'tooltip shows about 85 °C late' });
    await page.mouse.move(0, 0);
    const late = await cellColor(page, heated.uuid);
    assert.ok(lateT - earlyT >= 30 * 60e3, `frame time moved by the steps (${earlyT} -> ${lateT})`);
    for (const [what, c] of [['early', early], ['late', late]]) assert.ok(distance(c, COLORS.no_data) > 20, `${what} colour ${hex(c)} is a temperature, not "no data"`);
    assert.ok(distance(early, late) > 40, `heated GPU early ${hex(early)} differs from late ${hex(late)}`);
    assert.deepEqual(requests, [], 'scrubbing made no fleet request');
    await shot(page, 'replay.png');

    // Play at 10x moves the scrubber by itself; then back to live.
    await page.keyboard.press('Home');
    await page.locator('select.replay-speed').selectOption('10');
    await page.locator('button.replay-play').click();
    await eventually(async () => Number(await scrubber.inputValue()) >= 5, { timeoutMs: 5000, message: 'playback advances' });
    await page.locator('button.replay-play').click();
    await page.locator('button.replay-toggle', { hasText: 'Live' }).click();
    await page.locator('.replay[data-state="live"]').waitFor();
    await eventually(async () => Math.abs((await page.evaluate(() => window.gpulse.frameTime)) - Date.now()) < 60e3, { message: 'live frame on screen again' });
  });
});
