// A node started with --auth-file (tests/ui.rs starts one with two simulated
// GPUs): the UI asks for a token once, then shows the fleet; calls racing the
// prompt take the token it got, and a reload in the same tab asks nothing.
// Not a *.test.mjs: it runs against its own node, not the demo.

import test from 'node:test';
import assert from 'node:assert/strict';

const BASE = (process.env.GPULSE_UI_AUTH_URL || '').replace(/\/+$/, '');
const TOKEN = process.env.GPULSE_UI_TOKEN || '';
const GPUS = Number(process.env.GPULSE_UI_GPUS || 0);

test('asks for a token once, then shows the fleet', { timeout: 60000 }, async (t) => {
  if (!BASE || !TOKEN || !GPUS) {
    t.skip('GPULSE_UI_AUTH_URL, GPULSE_UI_TOKEN and GPULSE_UI_GPUS are not set (tests/ui.rs sets them)');
    return;
  }
  const { chromium } = await import('playwright-core');
  const browser = await chromium.launch({
    executablePath: '/usr/bin/chromium',
    headless: true,
    args: ['--no-sandbox', '--disable-background-networking', '--disable-dev-shm-usage'],
  });
  try {
    const page = await (await browser.newContext()).newPage();
    const prompts = [];
    page.on('dialog', async (d) => {
      prompts.push(`${d.type()}: ${d.message()}`);
      await d.accept(TOKEN);
    });
    const unauthorized = [];
    page.on('response', (r) => {
      if (r.status() === 401) unauthorized.push(new URL(r.url()).pathname);
    });
    await page.goto(`${BASE}/#/`);
    await page.waitForFunction((n) => document.getElementById('status').textContent.includes(`${n} GPUs`), GPUS, { timeout: 20000 });
    assert.equal(prompts.length, 1, `one prompt: ${JSON.stringify(prompts)}`);
    assert.match(prompts[0], /^prompt: .*token with the read scope/);
    assert.ok(unauthorized.length >= 1, 'the first call was refused');
    assert.doesNotMatch(await page.locator('#status').textContent(), /error/);

    await page.reload();
    await page.waitForFunction((n) => document.getElementById('status').textContent.includes(`${n} GPUs`), GPUS, { timeout: 20000 });
    assert.equal(prompts.length, 1, 'the tab keeps its token across a reload');
  } finally {
    await browser.close();
  }
});
