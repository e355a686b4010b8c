// Fleet view: the colours a person sees for the seeded GPUs, the tooltip, zoom
// by clicking a rack label, the back button, and the click through to a GPU
// page whose temperature chart has data.

import test from 'node:test';
import assert from 'node:assert/strict';
import { FACTS, COLORS, skipWithoutServer, withPage, open, waitReady, fetchLayout, findGpu, cellColor, cellCentre, waitCellColor, near, distance, hex, eventually, shot, zoomHash } from './helpers.mjs';

test('fleet: critical, lost and healthy GPUs are shown in their colours', { timeout: 60000 }, async (t) => {
  if (skipWithoutServer(t)) return;
  const L = await fetchLayout();
  const critical = findGpu(L, FACTS.critical.host, FACTS.critical.gpu);
  const lost = findGpu(L, FACTS.lost.host, FACTS.lost.gpu);
  const healthy = findGpu(L, FACTS.healthy.host, FACTS.healthy.gpu);
  await withPage(async (page) => {
    await open(page, '#/');
    // The live refresh runs every 5 s: give a state that is still settling two rounds.
    await waitCellColor(page, critical.uuid, COLORS.critical, 'critical GPU (XID 48)');
    await waitCellColor(page, lost.uuid, COLORS.lost, 'lost GPU (XID 79)');
    const h = await cellColor(page, healthy.uuid);
    assert.ok(distance(h, COLORS.critical) > 60, `healthy GPU is not critical-coloured (got ${hex(h)})`);
    assert.ok(near(h, COLORS.ok, 12), `healthy GPU is ok-coloured (got ${hex(h)})`);
    // The legend names the five states.
    const legend = await page.locator('.legend').textContent();
    for (const s of ['ok', 'warning', 'critical', 'no data', 'lost']) assert.ok(legend.includes(s), `legend lists "${s}"`);
    await shot(page, 'fleet.png');
  });
});

test('fleet: hovering the critical GPU shows its host and XID event', { timeout: 60000 }, async (t) => {
  if (skipWithoutServer(t)) return;
  const L = await fetchLayout();
  const critical = findGpu(L, FACTS.critical.host, FACTS.critical.gpu);
  await withPage(async (page) => {
    await open(page, '#/');
    const c = await cellCentre(page, critical.uuid);
    assert.ok(c, 'critical GPU drawn');
    // The tooltip lists events from /api/v1/health, polled by the page.
    await eventually(
      async () => {
        await page.mouse.move(c.x + 1, c.y + 1);
        await page.mouse.move(c.x, c.y);
        const tip = page.locator('#tooltip');
        if (!(await tip.isVisible())) return false;
        const text = await tip.textContent();
        return text.includes(FACTS.critical.host) && text.includes(critical.uuid) && /xid/i.test(text) && text.includes('48');
      },
      { message: 'tooltip with host, UUID and "xid 48"' },
    );
  });
});

test('fleet: rack label zooms, back returns, a GPU click opens its page with data', { timeout: 60000 }, async (t) => {
  if (skipWithoutServer(t)) return;
  const L = await fetchLayout();
  const critical = findGpu(L, FACTS.critical.host, FACTS.critical.gpu);
  await withPage(async (page) => {
    await open(page, '#/');
    const r = await page.evaluate((name) => window.gpulse.labelRect('rack', name), critical.rack);
    assert.ok(r, `rack label ${critical.rack} drawn`);
    await page.mouse.click(r.x + Math.min(20, r.w / 2), r.y + r.h / 2);
    await eventually(async () => (await page.locator('.breadcrumb .current').textContent()) === critical.rack, { message: 'breadcrumb shows the rack' });
    const expectHash = zoomHash({ ...(L.cluster.some((c) => c !== critical.cluster) ? { cluster: critical.cluster } : {}), row: critical.row, rack: critical.rack });
    assert.equal(new URL(page.url()).hash, expectHash, 'the zoom is in the URL');
    await waitReady(page, expectHash);
    // Zoomed: only this rack's GPUs are drawn.
    const other = L.uuid.find((u, i) => L.rack[i] !== critical.rack);
    if (other) assert.equal(await page.evaluate((u) => window.gpulse.cellRect(u), other), null, 'GPUs of other racks are not drawn');
    await shot(page, 'drilldown.png');

    // The breadcrumb leads back up; the back button returns to the zoom.
    await page.locator('.breadcrumb a', { hasText: 'Fleet' }).click();
    await waitReady(page, '#/');
    await page.goBack();
    await waitReady(page, expectHash);
    assert.equal(await page.locator('.breadcrumb .current').textContent(), critical.rack);

    const c = await cellCentre(page, critical.uuid);
    await page.mouse.click(c.x, c.y);
    const gpuHash = `#/gpu/${encodeURIComponent(critical.uuid)}`;
    await waitReady(page, gpuHash);
    assert.ok((await page.locator('.gpu-header').textContent()).includes(FACTS.critical.host), 'GPU page names the host');
    const temp = page.locator('.chart[data-metric="DCGM_FI_DEV_GPU_TEMP"]');
    assert.equal(await temp.getAttribute('data-state'), 'ready', 'temperature chart loaded');
    const points = Number(await temp.getAttribute('data-points'));
    assert.ok(points > 0, `temperature chart has data (${points} points)`);
    assert.match(await temp.locator('.chart-points').textContent(), /^[1-9]\d* points?$/);
    assert.match(await temp.locator('.chart-source').textContent(), /^raw/);
    // The inventory and the health events of this GPU.
    assert.ok((await page.locator('.inventory').textContent()).includes('driver'), 'inventory shown');
    await eventually(async () => (await page.locator('.events').textContent()).includes('48'), { message: 'GPU page lists the XID 48 event' });
    await shot(page, 'gpu.png');

    // The 7-day range reads the rollups through SQL and says so.
    await page.locator('.range-bar a', { hasText: '7 d' }).click();
    await waitReady(page, `${gpuHash}?range=7d`);
    await eventually(async () => /^rollup/.test(await temp.locator('.chart-source').textContent()), { message: '7 d chart from rollups' });
  });
});
