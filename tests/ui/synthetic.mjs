// Synthetic fleets for the scale tests and benches/ui/measure.mjs: the fleet
// API answered in the browser (page.route), so any size can be tried against
// the real UI served by a real server.

/** A fleet of n GPUs: 8 per host, 32 hosts per rack, 10 racks per row. */
export function syntheticLayout(n) {
  const d = { version: `synthetic-${n}`, gpus: n, uuid: [], host: [], gpu: [], rack: [], row: [], cluster: [] };
  for (let i = 0; i < n; i++) {
    const host = Math.floor(i / 8);
    const rack = Math.floor(host / 32);
    const row = Math.floor(rack / 10);
    d.uuid.push(`GPU-${String(i).padStart(8, '0')}-0000-0000-0000-000000000000`);
    d.host.push(`node-r${row}k${rack}-${String(host % 32).padStart(2, '0')}`);
    d.gpu.push(i % 8);
    d.rack.push(`rack-${row}-${rack}`);
    d.row.push(`row-${row}`);
    d.cluster.push('synthetic');
  }
  return d;
}

// Deterministic pseudo-random values, so a run is repeatable.
export function values(n, color, seed) {
  let s = seed >>> 0 || 1;
  const rnd = () => ((s = (s * 1664525 + 1013904223) >>> 0) / 2 ** 32);
  const out = new Array(n);
  for (let i = 0; i < n; i++) {
    if (color === 'health') {
      const r = rnd();
      out[i] = r < 0.9 ? 0 : r < 0.95 ? 1 : r < 0.97 ? 2 : r < 0.99 ? 3 : 4;
    } else out[i] = rnd() < 0.02 ? null : Math.round((25 + rnd() * 70) * 10) / 10;
  }
  out[0] = color === 'health' ? 2 : 95; // GPU 0 is known: critical / hot
  return out;
}

export async function fakeFleet(page, n) {
  const L = syntheticLayout(n);
  const layoutBody = JSON.stringify({ status: 'success', data: L });
  let seq = 0;
  const json = (route, body) => route.fulfill({ status: 200, contentType: 'application/json', body: typeof body === 'string' ? body : JSON.stringify(body) });
  await page.route(/\/api\/v1\/fleet\/layout$/, (route) => json(route, layoutBody));
  await page.route(/\/api\/v1\/fleet\/frame\?/, (route) => {
    const color = new URL(route.request().url()).searchParams.get('color') || 'health';
    json(route, { status: 'success', data: { version: L.version, color, time_ms: Date.now(), values: values(n, color, ++seq) } });
  });
  await page.route(/\/api\/v1\/fleet\/frames\?/, (route) => {
    const u = new URL(route.request().url()).searchParams;
    const color = u.get('color') || 'health';
    const start = Number(u.get('start'));
    const steps = 60;
    const rows = [];
    for (let k = 0; k < steps; k++) rows.push(values(n, color, k + 1));
    json(route, { status: 'success', data: { version: L.version, color, start_ms: start * 1000, step_ms: 60000, steps, tier: '1m', values: rows } });
  });
  await page.route(/\/api\/v1\/health$/, (route) =>
    json(route, { status: 'success', data: { gpus: n, states: { ok: n }, not_ok: { uuid: [], host: [], state: [] }, active: [] } }),
  );
  return L;
}
