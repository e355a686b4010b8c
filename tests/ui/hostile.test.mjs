// A host named `<img src=x onerror=alert(1)>` is shown as those characters in
// the breadcrumb, the tooltip and the GPU page, never as markup: no <img> with
// src "x" exists and no alert fires (withPage fails on any dialog).

import test from 'node:test';
import assert from 'node:assert/strict';
import { FACTS, skipWithoutServer, withPage, open, fetchLayout, findGpu, cellCentre, eventually, zoomHash } from './helpers.mjs';

test('hostile host name is text everywhere', { timeout: 60000 }, async (t) => {
  if (skipWithoutServer(t)) return;
  const L = await fetchLayout();
  const name = FACTS.hostile_host;
  const g = findGpu(L, name);
  const noImg = async (page) => assert.equal(await page.evaluate(() => document.querySelectorAll('img[src="x"], img').length), 0, 'no <img> injected');
  await withPage(async (page) => {
    const filter = { ...(L.cluster.some((c) => c !== g.cluster) ? { cluster: g.cluster } : {}), row: g.row, rack: g.rack, host: name };
    await open(page, zoomHash(filter));
    assert.equal(await page.locator('.breadcrumb .current').textContent(), name, 'breadcrumb shows the literal name');
    const c = await cellCentre(page, g.uuid);
    assert.ok(c, 'its GPU is drawn');
    await page.mouse.move(c.x, c.y);
    await eventually(async () => (await page.locator('#tooltip').textContent()).includes(name), { message: 'tooltip shows the literal name' });
    await noImg(page);

    await open(page, `#/gpu/${encodeURIComponent(g.uuid)}`);
    assert.ok((await page.locator('.gpu-header').textContent()).includes(name), 'GPU page header shows the literal name');
    await noImg(page);

    // The whole fleet, the health list and drift with it in the data.
    for (const hash of ['#/', '#/health', '#/drift']) {
      await open(page, hash);
      await noImg(page);
    }
  });
});
