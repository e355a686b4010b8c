// Health list and drift page: the seeded XID 48 event is listed, filters and
// sorting work, its link opens the GPU page; the drift page renders its tables.

import test from 'node:test';
import assert from 'node:assert/strict';
import { FACTS, skipWithoutServer, withPage, open, waitReady, fetchLayout, findGpu, shot } from './helpers.mjs';

test('health: the XID 48 event is listed and its link opens the GPU', { timeout: 60000 }, async (t) => {
  if (skipWithoutServer(t)) return;
  const L = await fetchLayout();
  const critical = findGpu(L, FACTS.critical.host, FACTS.critical.gpu);
  await withPage(async (page) => {
    await open(page, '#/health');
    const row = page.locator('tr[data-kind="xid"][data-xid="48"]', { hasText: FACTS.critical.host });
    await row.first().waitFor({ timeout: 10000 });
    assert.ok((await row.first().textContent()).includes('critical'), 'XID 48 is critical');
    await shot(page, 'health.png');

    // Filters: critical only, kind xid, active only; the event stays.
    await page.locator('select.filter-severity').selectOption('critical');
    await page.locator('select.filter-kind').selectOption('xid');
    await page.locator('input.active-only').check();
    const sev = await page.locator('tbody tr .sev').allTextContents();
    assert.ok(sev.length > 0 && sev.every((s) => s === 'critical'), `only critical rows (${sev})`);
    assert.ok(await row.count(), 'the XID 48 event passes the filters');
    assert.match(new URL(page.url()).hash, /severity=critical/, 'filters are in the URL');

    // Sorting by xid: a numeric column sorts descending first, then ascending.
    const xids = async () => (await page.locator('tbody tr').evaluateAll((trs) => trs.map((tr) => tr.dataset.xid))).map(Number);
    await page.locator('th[data-col="xid"]').click();
    const desc = await xids();
    assert.deepEqual(desc, [...desc].sort((a, b) => b - a), 'sorted by xid, descending');
    await page.locator('th[data-col="xid"]').click();
    const asc = await xids();
    assert.deepEqual(asc, [...asc].sort((a, b) => a - b), 'sorted by xid, ascending');
    assert.equal(await page.locator('th[data-col="xid"]').getAttribute('aria-sort'), 'ascending');

    await row.first().locator('a.gpu-link').click();
    await waitReady(page, `#/gpu/${encodeURIComponent(critical.uuid)}`);
    assert.ok((await page.locator('.gpu-header').textContent()).includes(critical.uuid));
  });
});

test('drift: driver and VBIOS versions with the majority marked', { timeout: 60000 }, async (t) => {
  if (skipWithoutServer(t)) return;
  await withPage(async (page) => {
    await open(page, '#/drift');
    assert.equal(await page.locator('.drift-card').count(), 2, 'driver and VBIOS tables');
    assert.equal(await page.locator('.drift-card .badge-majority').count(), 2, 'one majority each');
    const gpus = await page.locator('.drift-card[data-field="driver_version"] tbody td.num:nth-child(2)').allTextContents();
    assert.ok(gpus.map(Number).reduce((a, b) => a + b, 0) > 0, 'GPUs counted per version');
    // Every GPU listed as differing links to its page.
    const links = await page.locator('.drift-table a.gpu-link').evaluateAll((as) => as.map((a) => a.getAttribute('href')));
    assert.ok(links.every((h) => h.startsWith('#/gpu/')));
    await shot(page, 'drift.png');
  });
});
