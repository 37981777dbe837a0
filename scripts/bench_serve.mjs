#!/usr/bin/env node
// Load generator for kvq serve (or any OpenAI-compatible server): N concurrent
// clients stream chat completions and the run reports requests/s, aggregate
// tokens/s, p50/p99 time to first token and inter-token latency, the prefix-cache
// hit rate from usage.prompt_tokens_details.cached_tokens, and the peak of
// kvq_kv_bytes_in_use seen on /metrics.
//
//   node scripts/bench_serve.mjs --url http://127.0.0.1:8080 --text ../shared/data/wikitext2-test.txt \
//        --clients 4 --requests 16 --prompt-words 500 --max-tokens 128 [--shared-words 400] [--json]
//
// --shared-words W gives every request the same W-word system prompt (then
// --prompt-words more words of its own), the workload a prefix cache is for.
import { readFileSync } from 'node:fs';

const opt = { url: 'http://127.0.0.1:8080', text: '../shared/data/wikitext2-test.txt', clients: 4, requests: 16,
              'prompt-words': 500, 'max-tokens': 128, 'shared-words': 0, json: false };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; i++) {
  const k = argv[i].replace(/^--/, '');
  if (!(k in opt)) { console.error(`unknown option ${argv[i]}`); process.exit(1); }
  opt[k] = typeof opt[k] === 'boolean' ? true : typeof opt[k] === 'number' ? Number(argv[++i]) : argv[++i];
}
const words = readFileSync(opt.text, 'utf8').split(/\s+/).filter(Boolean);
const shared = words.slice(0, opt['shared-words']).join(' ');
const own = (i) => { const at = 5000 + i * opt['prompt-words']; return words.slice(at, at + opt['prompt-words']).join(' '); };

async function one(i) {
  const messages = shared ? [{ role: 'system', content: shared }, { role: 'user', content: own(i) }]
                          : [{ role: 'user', content: own(i) }];
  const t0 = performance.now();
  const r = await fetch(`${opt.url}/v1/chat/completions`, {
    method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ messages, max_tokens: opt['max-tokens'], temperature: 0, stream: true,
                           stream_options: { include_usage: true } }),
  });
  if (!r.ok) throw new Error(`HTTP ${r.status}: ${await r.text()}`);
  const dec = new TextDecoder();
  let buf = '', first = 0, last = 0, usage = null;
  const gaps = [];
  for await (const part of r.body) {
    buf += dec.decode(part, { stream: true });
    let end;
    while ((end = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, end); buf = buf.slice(end + 2);
      if (!ev.startsWith('data: ') || ev === 'data: [DONE]') continue;
      const c = JSON.parse(ev.slice(6));
      if (c.usage) { usage = c.usage; continue; }
      if (!c.choices[0]?.delta?.content) continue;
      const now = performance.now();
      if (!first) first = now; else gaps.push(now - last);
      last = now;
    }
  }
  return { ttft: first - t0, gaps, usage };
}

const pct = (xs, p) => { if (!xs.length) return NaN; const s = [...xs].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor(p / 100 * s.length))]; };
let peakKv = 0, polling = true;
const poll = (async () => {
  while (polling) {
    try {
      const m = await (await fetch(`${opt.url}/metrics`)).text();
      const v = Number((m.match(/^kvq_kv_bytes_in_use (\S+)/m) || [])[1]);
      if (v > peakKv) peakKv = v;
    } catch { /* not a kvq server */ }
    await new Promise((res) => setTimeout(res, 100));
  }
})();

const t0 = performance.now();
let next = 0;
const results = [];
await Promise.all([...Array(opt.clients)].map(async () => {
  while (next < opt.requests) results.push(await one(next++));
}));
const wall = (performance.now() - t0) / 1000;
polling = false;
await poll;
const gen = results.reduce((a, r) => a + (r.usage?.completion_tokens ?? 0), 0);
const prompt = results.reduce((a, r) => a + (r.usage?.prompt_tokens ?? 0), 0);
const cached = results.reduce((a, r) => a + (r.usage?.prompt_tokens_details?.cached_tokens ?? 0), 0);
const ttft = results.map((r) => r.ttft), itl = results.flatMap((r) => r.gaps);
const out = {
  clients: opt.clients, requests: results.length, prompt_tokens_avg: Math.round(prompt / results.length),
  completion_tokens: gen, wall_s: +wall.toFixed(2), requests_per_s: +(results.length / wall).toFixed(3),
  tokens_per_s: +(gen / wall).toFixed(1), ttft_p50_ms: +pct(ttft, 50).toFixed(1), ttft_p99_ms: +pct(ttft, 99).toFixed(1),
  itl_p50_ms: +pct(itl, 50).toFixed(2), itl_p99_ms: +pct(itl, 99).toFixed(2),
  cache_hit_rate: +(cached / prompt).toFixed(3), peak_kv_mib: +(peakKv / 1048576).toFixed(1),
};
if (opt.json) console.log(JSON.stringify(out));
else for (const [k, v] of Object.entries(out)) console.log(`${k.padEnd(18)} ${v}`);
