// Client side of tests/test_server.sh: node client.mjs MODE PORT [ARGS]. Prints
// "ok: ..." / "FAIL: ..." lines; exits 1 when anything failed.
import { readFileSync } from 'node:fs';

const [mode, port, ...args] = process.argv.slice(2);
const base = `http://127.0.0.1:${port}`;
let failed = 0;
const ok = (cond, what, detail = '') => {
  if (cond) console.log(`ok: ${what}`);
  else { failed++; console.log(`FAIL: ${what} ${detail}`); }
};

async function post(path, body) {
  const r = await fetch(base + path, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
  return { status: r.status, json: await r.json() };
}

async function metrics() {
  const text = await (await fetch(base + '/metrics')).text();
  const m = {};
  for (const line of text.split('\n')) if (line && !line.startsWith('#')) { const [k, v] = line.split(' '); m[k] = Number(v); }
  return m;
}

// The official client: chat, completions, streaming, usage, errors.
async function official(key) {
  const { default: OpenAI } = await import('openai');
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: key, maxRetries: 0, timeout: 60000 });
  const models = await client.models.list();
  const model = models.data[0]?.id;
  ok(model === 'tinydoc-q8_0', 'models.list names the model', model);

  const messages = [{ role: 'system', content: 'You answer questions about PostgreSQL.' },
                    { role: 'user', content: 'How do I create an index?' }];
  const chat = await client.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0 });
  const content = chat.choices[0].message.content;
  ok(typeof content === 'string' && chat.choices[0].message.role === 'assistant', 'chat completion has content');
  ok(['stop', 'length'].includes(chat.choices[0].finish_reason), 'chat finish_reason', chat.choices[0].finish_reason);
  const u = chat.usage;
  ok(u.prompt_tokens > 10 && u.completion_tokens > 0 && u.total_tokens === u.prompt_tokens + u.completion_tokens &&
     typeof u.prompt_tokens_details.cached_tokens === 'number', 'chat usage', JSON.stringify(u));

  const stream = await client.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0, stream: true,
                                                       stream_options: { include_usage: true } });
  let text = '', first = null, finish = null, usage = null, chunks = 0;
  for await (const c of stream) {
    chunks++;
    if (first === null) first = c;
    if (c.usage) { usage = c.usage; ok(c.choices.length === 0, 'usage chunk has choices []'); continue; }
    text += c.choices[0].delta.content ?? '';
    if (c.choices[0].finish_reason) finish = c.choices[0].finish_reason;
  }
  ok(first?.choices[0]?.delta?.role === 'assistant', 'first stream chunk carries the role');
  ok(text === content, 'streamed chat text equals the non-streamed one', JSON.stringify([text, content]));
  ok(finish === chat.choices[0].finish_reason, 'stream finish_reason', finish);
  ok(usage && usage.completion_tokens === u.completion_tokens && usage.prompt_tokens === u.prompt_tokens,
     'stream usage', JSON.stringify(usage));

  const prompt = 'PostgreSQL supports several index types, including B-tree, hash, GiST and GIN. To create an index, use';
  const comp = await client.completions.create({ model, prompt, max_tokens: 20, temperature: 0 });
  const ctext = comp.choices[0].text;
  ok(ctext.length > 0 && comp.usage.completion_tokens > 0, 'completion', JSON.stringify(comp.choices[0]));
  let stext = '', susage = null;
  for await (const c of await client.completions.create({ model, prompt, max_tokens: 20, temperature: 0, stream: true,
                                                         stream_options: { include_usage: true } })) {
    if (c.usage) susage = c.usage;
    else stext += c.choices[0].text;
  }
  ok(stext === ctext, 'streamed completion equals the non-streamed one', JSON.stringify([stext, ctext]));
  ok(susage?.completion_tokens === comp.usage.completion_tokens, 'completion stream usage');

  // a stop string inside the greedy text cuts it there
  const words = ctext.trim().split(/\s+/);
  if (words.length >= 3) {
    const stop = words[2];
    const cut = await client.completions.create({ model, prompt, max_tokens: 20, temperature: 0, stop: [stop] });
    ok(cut.choices[0].text === ctext.slice(0, ctext.indexOf(stop)) && cut.choices[0].finish_reason === 'stop',
       'stop string cuts the text', JSON.stringify([stop, cut.choices[0].text]));
    let st = '';
    for await (const c of await client.completions.create({ model, prompt, max_tokens: 20, temperature: 0, stop, stream: true }))
      st += c.choices[0].text;
    ok(st === cut.choices[0].text, 'streamed stop string cuts the same', JSON.stringify(st));
  }
  const seeded = [];
  for (let i = 0; i < 2; i++)
    seeded.push((await client.completions.create({ model, prompt, max_tokens: 12, temperature: 0.9, top_p: 0.9, seed: 7 })).choices[0].text);
  ok(seeded[0] === seeded[1], 'same seed, same sampled text');

  await logprobs(client, model, messages, prompt);

  for (const [what, fn, status] of [
    ['n above 128 is a 400', () => client.completions.create({ model, prompt, n: 129 }), 400],
    ['top_logprobs 21 is a 400', () => client.chat.completions.create({ model, messages, logprobs: true, top_logprobs: 21 }), 400],
    ['top_logprobs without logprobs is a 400', () => client.chat.completions.create({ model, messages, top_logprobs: 2 }), 400],
    ['completions logprobs 21 is a 400', () => client.completions.create({ model, prompt, logprobs: 21 }), 400],
    ['bad temperature is a 400', () => client.chat.completions.create({ model, messages, temperature: 5 }), 400],
    ['wrong API key is a 401', () => new OpenAI({ baseURL: `${base}/v1`, apiKey: 'wrong', maxRetries: 0 }).models.list(), 401],
  ]) {
    try { await fn(); ok(false, what, 'no error'); }
    catch (e) { ok(e.status === status && typeof e.message === 'string' && e.error?.message, what, `${e.status} ${e.message}`); }
  }
}

// logprobs / top_logprobs, streamed and not, chat and legacy completions: greedy
// tokens are the most likely ones, every value is finite and <= 0, one entry per
// generated token, streaming gives the same entries.
async function logprobs(client, model, messages, prompt) {
  const finiteLp = (x) => typeof x === 'number' && Number.isFinite(x) && x <= 0;
  const K = 5;
  const chat = await client.chat.completions.create({ model, messages, max_tokens: 16, temperature: 0, logprobs: true, top_logprobs: K });
  const content = chat.choices[0].logprobs?.content ?? [];
  ok(content.length === chat.usage.completion_tokens && content.length > 0, 'chat logprobs: one entry per token',
     `${content.length} vs ${chat.usage.completion_tokens}`);
  ok(content.every((e) => finiteLp(e.logprob) && e.top_logprobs.length === K && e.top_logprobs.every((t) => finiteLp(t.logprob))),
     'chat logprobs are finite, <= 0, with top_logprobs', JSON.stringify(content[0]));
  ok(content.every((e) => e.logprob === Math.max(...e.top_logprobs.map((t) => t.logprob)) && e.token === e.top_logprobs[0].token),
     'greedy token is the most likely of top_logprobs', JSON.stringify(content.map((e) => [e.token, e.logprob, e.top_logprobs[0]])));
  ok(content.every((e) => e.top_logprobs.every((t, i) => i === 0 || t.logprob <= e.top_logprobs[i - 1].logprob)),
     'top_logprobs sorted, most likely first');
  ok(content.every((e) => Buffer.from(e.bytes).toString('utf8') === e.token || e.token.includes('\ufffd')),
     'bytes spell the token');
  ok(content.some((e) => e.logprob < 0) && content.every((e) => Math.exp(e.top_logprobs.reduce((a, t) => Math.max(a, t.logprob), -1e9)) <= 1),
     'probabilities below 1 somewhere (not all one-hot)');
  const text = chat.choices[0].message.content;
  ok(content.map((e) => e.token).join('').trim() === text.trim(), 'chat logprob tokens spell the content',
     JSON.stringify([content.map((e) => e.token).join(''), text]));
  const plain = await client.chat.completions.create({ model, messages, max_tokens: 4, temperature: 0 });
  ok(plain.choices[0].logprobs === null, 'no logprobs unless asked');

  let streamed = [];
  for await (const c of await client.chat.completions.create({ model, messages, max_tokens: 16, temperature: 0, stream: true,
                                                              logprobs: true, top_logprobs: K }))
    streamed = streamed.concat(c.choices[0]?.logprobs?.content ?? []);
  ok(JSON.stringify(streamed) === JSON.stringify(content), 'streamed chat logprobs equal the non-streamed ones',
     JSON.stringify([streamed.length, content.length]));

  const comp = await client.completions.create({ model, prompt, max_tokens: 12, temperature: 0, logprobs: 3 });
  const lp = comp.choices[0].logprobs;
  ok(lp && lp.tokens.length === comp.usage.completion_tokens && lp.token_logprobs.length === lp.tokens.length &&
     lp.top_logprobs.length === lp.tokens.length && lp.text_offset.length === lp.tokens.length,
     'completion logprobs: parallel lists, one per token', JSON.stringify(lp));
  ok(lp.token_logprobs.every(finiteLp) && lp.top_logprobs.every((d) => Object.keys(d).length >= 1 && Object.keys(d).length <= 3 &&
     Object.values(d).every(finiteLp)), 'completion logprobs finite, <= 0, up to 3 alternatives');
  ok(lp.top_logprobs.every((d, i) => Math.max(...Object.values(d)) === lp.token_logprobs[i] && d[lp.tokens[i]] === lp.token_logprobs[i]),
     'completion: greedy token is the most likely');
  ok(lp.text_offset[0] === 0 && lp.text_offset.every((o, i) => i === 0 || o >= lp.text_offset[i - 1]) &&
     lp.text_offset.every((o) => o <= comp.choices[0].text.length), 'text_offset grows within the text', JSON.stringify(lp.text_offset));
  let stoks = [], svals = [];
  for await (const c of await client.completions.create({ model, prompt, max_tokens: 12, temperature: 0, logprobs: 3, stream: true })) {
    const l = c.choices[0]?.logprobs;
    if (l) { stoks = stoks.concat(l.tokens); svals = svals.concat(l.token_logprobs); }
  }
  ok(JSON.stringify([stoks, svals]) === JSON.stringify([lp.tokens, lp.token_logprobs]), 'streamed completion logprobs equal',
     JSON.stringify([stoks, lp.tokens]));
  // sampling at a high temperature reports the model's distribution, not the sampler's
  const hot = await client.completions.create({ model, prompt, max_tokens: 1, temperature: 2, top_k: 1, logprobs: 1, seed: 3 });
  ok(hot.choices[0].logprobs.token_logprobs[0] === lp.token_logprobs[0], 'logprobs ignore temperature (raw logits)',
     JSON.stringify([hot.choices[0].logprobs, lp.token_logprobs[0]]));
}

const prompts = (() => {
  const words = readFileSync(args[0] ?? '/dev/null', 'utf8').split(/\s+/).filter(Boolean);
  return [3, 40, 7, 260, 120, 17, 300, 64].map((n, i) => words.slice(i * 50, i * 50 + n).join(' '));
});

async function complete(prompt, max_tokens = 24) {
  const r = await post('/v1/completions', { prompt, max_tokens, temperature: 0 });
  if (r.status !== 200) throw new Error(JSON.stringify(r.json));
  return r.json.choices[0].text;
}

// 8 greedy requests of different lengths at once give what each gives alone.
async function concurrent() {
  const ps = prompts();
  const alone = [];
  for (const p of ps) alone.push(await complete(p));
  const together = await Promise.all(ps.map((p) => complete(p)));
  ok(alone.every((t) => t.length > 0), 'every answer has text');
  for (let i = 0; i < ps.length; i++)
    ok(together[i] === alone[i], `concurrent request ${i} equals its run alone`, JSON.stringify([together[i], alone[i]]));
}

// One request with a long shared prefix: prints {"text", "cached"} for the shell to compare.
async function prefix() {
  const body = readFileSync(args[0], 'utf8');
  const r = await post('/v1/chat/completions', {
    messages: [{ role: 'system', content: body }, { role: 'user', content: args[1] }], max_tokens: 24, temperature: 0,
  });
  if (r.status !== 200) { console.log(`FAIL: ${JSON.stringify(r.json)}`); process.exit(1); }
  console.log(JSON.stringify({ text: r.json.choices[0].message.content, cached: r.json.usage.prompt_tokens_details.cached_tokens,
                               prompt: r.json.usage.prompt_tokens }));
}

// 32 streams, a third of them dropped mid-stream: the rest complete, memory comes back.
async function disconnect() {
  const words = readFileSync(args[0], 'utf8').split(/\s+/).filter(Boolean);
  const ps = [...Array(8).keys()].map((i) => words.slice(i * 40, i * 40 + 10 + 5 * i).join(' '));
  const run = async (i) => {
    const r = await stream('/v1/chat/completions', {
      messages: [{ role: 'user', content: ps[i % ps.length] }], max_tokens: 40, temperature: 0, stream: true,
    }, i % 3 === 0 ? 3 : 0);
    if (r.aborted) return r;
    return { i, aborted: false, done: r.raw.includes('data: [DONE]'), finished: /"finish_reason":"(stop|length)"/.test(r.raw) };
  };
  const results = await Promise.all([...Array(32).keys()].map(run));
  const kept = results.filter((r) => !r.aborted);
  ok(results.filter((r) => r.aborted).length === 11, 'a third of the streams were dropped');
  ok(kept.length === 21 && kept.every((r) => r.done && r.finished), 'every other stream completed',
     JSON.stringify(kept));
  let m;
  for (let t = 0; t < 100; t++) {
    m = await metrics();
    if (m.kvq_running_sequences === 0 && m.kvq_queue_length === 0 && m.kvq_kv_blocks_in_use === 0) break;
    await new Promise((res) => setTimeout(res, 100));
  }
  ok(m.kvq_running_sequences === 0 && m.kvq_queue_length === 0, 'no request left running or queued', JSON.stringify(m));
  ok(m.kvq_kv_blocks_in_use === 0 && m.kvq_kv_bytes_in_use === 0, 'KV blocks in use back to zero', JSON.stringify(m));
  ok(typeof (await complete('The kernel', 4)) === 'string', 'the server still answers');
}


// A stream's raw SSE text ({aborted} when dropped after `dropAfter` events).
async function stream(path, body, dropAfter = 0) {
  const ac = new AbortController();
  const r = await fetch(base + path, {
    method: 'POST', signal: ac.signal, headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
  });
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let raw = '';
  for (;;) {
    let chunk;
    try { chunk = await reader.read(); } catch (e) { return { aborted: true }; }
    if (chunk.done) break;
    raw += dec.decode(chunk.value, { stream: true });
    if (dropAfter && raw.split('\n\n').length - 1 >= dropAfter) { ac.abort(); return { aborted: true }; }
  }
  return { aborted: false, raw };
}

// A streamed greedy completion's text.
async function streamText(prompt, max_tokens, dropAfter = 0) {
  const r = await stream('/v1/completions', { prompt, max_tokens, temperature: 0, stream: true }, dropAfter);
  if (r.aborted) return r;
  let text = '';
  for (const ev of r.raw.split('\n\n')) {
    const line = ev.split('\n').find((l) => l.startsWith('data: '));
    if (!line || line === 'data: [DONE]') continue;
    text += JSON.parse(line.slice(6)).choices?.[0]?.text ?? '';
  }
  return { aborted: false, done: r.raw.includes('data: [DONE]'), text };
}

// 256 greedy streams at once: prompts of 2 to 151 words, a quarter behind a shared
// 150-word prefix, every eighth stream dropped after its first events. Every stream
// that completes gives what its request gives alone, one at a time; nothing is left
// running after. With `hits` (a server whose prefix cache keeps entries live) the
// shared prefix and the requests' own earlier runs come from the cache.
async function many() {
  const words = readFileSync(args[0], 'utf8').split(/\s+/).filter(Boolean);
  const shared = words.slice(1000, 1150).join(' ');
  const ps = [...Array(256).keys()].map((i) => {
    const n = 2 + (i * 37) % 150, own = words.slice(2000 + 13 * i, 2000 + 13 * i + n).join(' ');
    return i % 4 === 1 ? `${shared} ${own}` : own;
  });
  const before = await metrics();
  const alone = [];
  for (const p of ps) alone.push(await complete(p, 12));
  const runs = await Promise.all(ps.map((p, i) => streamText(p, 12, i % 8 === 3 ? 3 : 0)));
  const kept = runs.map((r, i) => ({ ...r, i })).filter((r) => !r.aborted);
  ok(kept.length === 224 && kept.every((r) => r.done), '224 of 256 concurrent streams completed (32 dropped)',
     JSON.stringify(kept.filter((r) => !r.done).slice(0, 3)));
  const differ = kept.filter((r) => r.text !== alone[r.i]);
  ok(differ.length === 0, `each completed stream equals its request alone (${differ.length} differ)`,
     JSON.stringify(differ.slice(0, 3).map((r) => [r.i, r.text, alone[r.i]])));
  let m;
  for (let t = 0; t < 100; t++) {
    m = await metrics();
    if (m.kvq_running_sequences === 0 && m.kvq_queue_length === 0) break;
    await new Promise((res) => setTimeout(res, 100));
  }
  ok(m.kvq_running_sequences === 0 && m.kvq_queue_length === 0, 'no request left running or queued', JSON.stringify(m));
  if (args[1] === 'hits')
    ok(m.kvq_prefix_cache_hits_total - before.kvq_prefix_cache_hits_total >= 64, 'the prompts were served from the cache',
       `${m.kvq_prefix_cache_hits_total - before.kvq_prefix_cache_hits_total} hits`);
}

// The fields beyond plain chat and completions, on tinydoc-f16 against transformers'
// logits and greedy continuations (../shared/refs/tinydoc): llama-server's endpoints,
// logit_bias, penalties, stop_token_ids, ignore_eos, min_tokens, n, echo, prompt lists
// and token ids, embeddings, extension fields.
async function extensions(refsDir) {
  const { default: OpenAI } = await import('openai');
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'none', maxRetries: 0, timeout: 60000 });
  const model = (await client.models.list()).data[0].id;
  const refs = JSON.parse(readFileSync(`${refsDir}/refs.json`, 'utf8')).prompts;
  const V = 8192;
  const row = (i, k) => {
    const b = readFileSync(`${refsDir}/logits_${i}.f32`);
    return new Float32Array(b.buffer, b.byteOffset, b.length / 4).subarray(k * V, (k + 1) * V);
  };
  const argmax = (x, skip = -1) => { let m = -1; for (let v = 0; v < x.length; v++) if (v !== skip && (m < 0 || x[v] > x[m])) m = v; return m; };
  const detok = async (tokens) => (await post('/detokenize', { tokens })).json.content;
  const greedy = async (prompt, extra = {}) => client.completions.create({ model, prompt, temperature: 0, ...extra });
  const J = JSON.stringify;

  // llama-server's endpoints
  for (const r of refs) {
    const t = await post('/tokenize', { content: r.text, add_special: true });
    ok(J(t.json.tokens) === J(r.token_ids_with_bos), `/tokenize gives transformers' ids: ${J(r.text)}`, J(t.json));
    const d = await post('/detokenize', { tokens: r.token_ids_with_bos.slice(1) });
    // as llama-server's: the pieces joined, SentencePiece's prefix space kept
    ok(d.json.content === ' ' + r.text, '/detokenize gives the text back', J(d.json));
  }
  const wp = await post('/tokenize', { content: 'kernel é', with_pieces: true });
  ok(wp.json.tokens.every((p) => Number.isInteger(p.id) && (typeof p.piece === 'string' || Array.isArray(p.piece))) &&
     wp.json.tokens.map((p) => p.piece).join('').trim() === 'kernel é', '/tokenize with_pieces', J(wp.json));
  const at = await post('/apply-template', { messages: [{ role: 'system', content: 'S' }, { role: 'user', content: 'hi' }] });
  ok(at.json.prompt === '<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n',
     '/apply-template renders the messages (ChatML here)', J(at.json));
  const tt = await post('/apply-template', { messages: [{ role: 'user', content: 'hi' }],
    tools: [{ type: 'function', function: { name: 'get_weather', parameters: { type: 'object' } } }] });
  ok(tt.json.prompt?.startsWith('<|im_start|>system\n') && tt.json.prompt.includes('<tools>') &&
     tt.json.prompt.includes('"get_weather"') && tt.json.prompt.endsWith('<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n'),
     '/apply-template writes the tools in as a completion would', J(tt.json));
  ok((await post('/detokenize', { tokens: [V] })).status === 400, '/detokenize of an id outside the vocabulary is a 400');

  // the greedy token, and the second best once logit_bias -100 takes it away
  for (let i = 0; i < refs.length; i++) {
    const ids = refs[i].token_ids_with_bos, last = row(i, ids.length - 1);
    const best = argmax(last), second = argmax(last, best);
    const a = await greedy(ids, { max_tokens: 1 });
    const b = await greedy(ids, { max_tokens: 1, logit_bias: { [best]: -100 } });
    ok(best === refs[i].greedy_next_ids[0] && a.choices[0].text === await detok([best]), `prompt ${i}: greedy token ${best}`,
       J(a.choices[0].text));
    ok(b.choices[0].text === await detok([second]), `prompt ${i}: logit_bias -100 on it gives the second best, ${second}`,
       J([b.choices[0].text, await detok([second])]));
  }

  // prompt as token ids: the reference's greedy continuation, up to its EOS
  const r0 = refs[0], ids0 = r0.token_ids_with_bos, next0 = r0.greedy_next_ids;
  const g = await greedy(ids0, { max_tokens: 40 });
  ok(g.choices[0].text === r0.greedy_next_text && g.choices[0].finish_reason === 'stop' &&
     g.usage.completion_tokens === next0.length - 1 && g.usage.prompt_tokens === ids0.length,
     'token-id prompt: transformers\' greedy continuation', J([g.choices[0].text, g.usage]));
  // stop_token_ids: the fourth token of that continuation ends it
  const s = await greedy(ids0, { max_tokens: 40, stop_token_ids: [next0[3]] });
  ok(s.choices[0].text === await detok(next0.slice(0, 3)) && s.choices[0].finish_reason === 'stop' &&
     s.usage.completion_tokens === 3, 'stop_token_ids ends the answer before that token', J([s.choices[0], s.usage]));
  // ignore_eos: the same tokens, then on past the EOS to max_tokens
  const ie = await greedy(ids0, { max_tokens: 30, ignore_eos: true });
  ok(ie.usage.completion_tokens === 30 && ie.choices[0].finish_reason === 'length' &&
     ie.choices[0].text.startsWith(r0.greedy_next_text), 'ignore_eos runs to max_tokens', J([ie.choices[0].text, ie.usage]));
  const mt = await greedy(ids0, { max_tokens: 40, min_tokens: 25 });
  ok(mt.usage.completion_tokens >= 25 && mt.choices[0].text.startsWith(r0.greedy_next_text), 'min_tokens: at least 25 tokens',
     J(mt.usage));
  const ms = await greedy(ids0, { max_tokens: 40, min_tokens: 6, stop_token_ids: [next0[3]], stop: [r0.greedy_next_text.slice(0, 4)] });
  ok(ms.usage.completion_tokens >= 6 && ms.choices[0].text.startsWith(await detok(next0.slice(0, 3))),
     'min_tokens holds off stop tokens and stop strings', J([ms.choices[0].text, ms.usage]));

  // penalties: at a position k where the model's argmax is the prompt's next token t,
  // the prompt ids[0..k] makes t the first answer token and row k + 1 the logits after
  // it. A bias B makes t win the second step by 1.0; frequency + presence penalties of
  // 2.0 for its one occurrence make the runner-up win by 1.0.
  let k = -1;
  for (let j = ids0.length - 3; j > 0 && k < 0; j--) {
    const t = ids0[j + 1], r2 = row(0, j + 1);
    if (argmax(row(0, j)) === t && argmax(r2) !== t) k = j;
  }
  if (k < 0) ok(false, 'a position for the penalty test');
  else {
    const t = ids0[k + 1], r2 = row(0, k + 1), other = argmax(r2, t);
    const B = r2[other] - r2[t] + 1.0, prompt = ids0.slice(0, k + 1);
    const run = async (extra) => (await greedy(prompt, { max_tokens: 2, logit_bias: { [t]: B }, ...extra })).choices[0].text;
    const tt = await detok([t, t]), to = await detok([t, other]);
    ok(await run({}) === tt, `bias ${B.toFixed(3)} repeats token ${t}`, J(await run({})));
    ok(await run({ frequency_penalty: 1.5, presence_penalty: 0.5 }) === to, `frequency + presence penalty 2.0 give ${other} instead`);
    ok(await run({ presence_penalty: 2.0 }) === to, 'presence penalty 2.0 alone');
    ok(await run({ frequency_penalty: 0.5 }) === tt, 'frequency penalty 0.5 leaves it ahead');
    ok(await run({ presence_penalty: -1.0, frequency_penalty: -1.0 }) === tt, 'negative penalties favour it');
  }

  // n = 3 at temperature 0: three equal choices, the n = 1 text; the prompt read once
  const prompt = r0.text;
  const one = await greedy(prompt, { max_tokens: 12 });
  const before = (await metrics()).kvq_prompt_tokens_total;
  const three = await greedy(prompt, { max_tokens: 12, n: 3 });
  const after = (await metrics()).kvq_prompt_tokens_total;
  ok(three.choices.length === 3 && three.choices.every((c, i) => c.index === i && c.text === one.choices[0].text),
     'n=3: three choices equal to the n=1 text', J(three.choices));
  ok(three.usage.prompt_tokens === one.usage.prompt_tokens && three.usage.completion_tokens === 3 * one.usage.completion_tokens,
     'n=3 usage: the prompt once, the answers thrice', J(three.usage));
  ok(after - before === one.usage.prompt_tokens, 'n=3: the prompt is read by one sequence (the others fork it)', `${after - before}`);
  const texts = ['', '', ''];
  for await (const c of await greedy(prompt, { max_tokens: 12, n: 3, stream: true }))
    for (const ch of c.choices) texts[ch.index] += ch.text;
  ok(texts.every((x) => x === one.choices[0].text), 'n=3 streamed', J(texts));
  const messages = [{ role: 'user', content: 'How do I list files?' }];
  const chat1 = await client.chat.completions.create({ model, messages, max_tokens: 10, temperature: 0 });
  const chat3 = await client.chat.completions.create({ model, messages, max_tokens: 10, temperature: 0, n: 3 });
  ok(chat3.choices.length === 3 && chat3.choices.every((c, i) => c.index === i && c.message.content === chat1.choices[0].message.content),
     'chat n=3', J(chat3.choices));
  const ctexts = ['', '', ''];
  for await (const c of await client.chat.completions.create({ model, messages, max_tokens: 10, temperature: 0, n: 3, stream: true }))
    for (const ch of c.choices) ctexts[ch.index] += ch.delta.content ?? '';
  ok(ctexts.every((x) => x === chat1.choices[0].message.content), 'chat n=3 streamed', J(ctexts));
  const hot = async () => (await client.completions.create({ model, prompt, max_tokens: 16, temperature: 1, n: 3, seed: 5 })).choices.map((c) => c.text);
  const h1 = await hot(), h2 = await hot();
  ok(new Set(h1).size > 1 && J(h1) === J(h2), 'n=3 sampled: the choices differ, the same seed repeats them', J(h1));

  // echo: the prompt before the answer
  const e = await greedy(prompt, { max_tokens: 12, echo: true });
  ok(e.choices[0].text === prompt + one.choices[0].text, 'echo', J(e.choices[0].text));
  let et = '';
  for await (const c of await greedy(prompt, { max_tokens: 12, echo: true, stream: true })) et += c.choices[0].text;
  ok(et === e.choices[0].text, 'echo streamed', J(et));
  const eid = await greedy(ids0, { max_tokens: 2, echo: true });
  ok(eid.choices[0].text === await detok(ids0) + (await greedy(ids0, { max_tokens: 2 })).choices[0].text, 'echo of token ids');

  // a list of prompts: one choice per prompt (n each), in order
  const ps = [refs[1].text, refs[3].text];
  const singles = [];
  for (const p of ps) singles.push((await greedy(p, { max_tokens: 8 })).choices[0].text);
  const list = await greedy(ps, { max_tokens: 8, n: 2 });
  ok(list.choices.length === 4 && list.choices.every((c, i) => c.index === i && c.text === singles[Math.floor(i / 2)]),
     'prompt list x n=2', J(list.choices));
  const idl = await greedy([refs[1].token_ids_with_bos, refs[3].token_ids_with_bos], { max_tokens: 8 });
  ok(idl.choices.length === 2 && idl.choices.every((c, i) => c.text === singles[i]), 'a list of token-id prompts', J(idl.choices));
  const lt = ['', ''];
  for await (const c of await greedy(ps, { max_tokens: 8, stream: true })) for (const ch of c.choices) lt[ch.index] += ch.text;
  ok(J(lt) === J(singles), 'prompt list streamed', J(lt));

  // embeddings (the client asks for base64 and decodes it)
  const emb = await client.embeddings.create({ model, input: [refs[0].text, refs[1].text] });
  const norm = (v) => Math.sqrt(v.reduce((a, x) => a + x * x, 0));
  ok(emb.data.length === 2 && emb.data.every((d, i) => d.index === i && d.embedding.length === 512 && Math.abs(norm(d.embedding) - 1) < 1e-5),
     'embeddings: two unit vectors of 512', J(emb.data.map((d) => [d.index, d.embedding.length, norm(d.embedding)])));
  ok(emb.usage.prompt_tokens === refs[0].token_ids_with_bos.length + refs[1].token_ids_with_bos.length, 'embeddings usage', J(emb.usage));
  const fl = await post('/v1/embeddings', { input: refs[0].token_ids_with_bos, encoding_format: 'float' });
  ok(fl.json.data[0].embedding.every((x, j) => Math.abs(x - emb.data[0].embedding[j]) < 1e-6),
     'token-id input as floats equals the text input in base64');
  const dot = emb.data[0].embedding.reduce((a, x, j) => a + x * emb.data[1].embedding[j], 0);
  ok(dot < 0.999, 'different texts, different embeddings', `${dot}`);

  // fields of vLLM and llama.cpp: accepted (ignored ones too), malformed ones refused
  const x = await post('/v1/completions', { prompt, max_tokens: 2, ignore_eos: true, cache_prompt: true, typical_p: 1, frobnicate: { a: 1 } });
  ok(x.status === 200 && x.json.usage.completion_tokens === 2, 'extension and unknown fields are accepted', J(x.json));
  const np = await post('/v1/completions', { prompt: ids0, n_predict: 3, ignore_eos: true, temperature: 0 });
  ok(np.json.usage?.completion_tokens === 3, "llama.cpp's n_predict", J(np.json));
  for (const [body, param] of [[{ typical_p: 'x' }, 'typical_p'], [{ logit_bias: { [V]: 1 } }, 'logit_bias'],
    [{ stop_token_ids: [V] }, 'stop_token_ids'], [{ prompt: [[1, V]] }, 'prompt'], [{ n: 17 }, null], [{ presence_penalty: 2.5 }, 'presence_penalty']]) {
    const r = await post('/v1/completions', { prompt, max_tokens: 2, ...body });
    ok(r.status === 400 && (param === null || r.json.error.param === param), `400 for ${J(body)}`, J([r.status, r.json]));
  }
}


// response_format and tools through the official client, streamed and not.
async function structured(key) {
  const { default: OpenAI } = await import('openai');
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: key, maxRetries: 0, timeout: 120000 });
  const model = 'tinydoc';
  const person = { type: 'object', additionalProperties: false, required: ['name', 'age', 'tags'],
                   properties: { name: { type: 'string', maxLength: 24 }, age: { type: 'integer' },
                                 tags: { type: 'array', items: { enum: ['a', 'b', 'c'] }, maxItems: 3 } } };
  const isPerson = (v) => v && typeof v === 'object' && Object.keys(v).every((k) => k in person.properties) &&
    typeof v.name === 'string' && v.name.length <= 24 && Number.isInteger(v.age) && Array.isArray(v.tags) &&
    v.tags.length <= 3 && v.tags.every((t) => ['a', 'b', 'c'].includes(t));
  const messages = [{ role: 'user', content: 'Describe a person as JSON.' }];
  const response_format = { type: 'json_schema', json_schema: { name: 'person', strict: true, schema: person } };
  for (const seed of [1, 2, 3]) {
    const r = await client.chat.completions.create({ model, messages, response_format, seed, temperature: 0.8, max_tokens: 300 });
    const text = r.choices[0].message.content;
    let v = null;
    try { v = JSON.parse(text); } catch { /* reported below */ }
    ok(r.choices[0].finish_reason === 'stop' && isPerson(v), `json_schema output follows the schema (seed ${seed})`, text);
  }
  // any object: its strings are unbounded, so a seed's text may run to max_tokens ("length")
  let complete = 0;
  for (const seed of [4, 5, 6, 7]) {
    let text = '', finish = null;
    for await (const c of await client.chat.completions.create({ model, messages, response_format: { type: 'json_object' },
                                                                 seed, temperature: 0.8, max_tokens: 200, stream: true })) {
      text += c.choices[0]?.delta?.content ?? '';
      finish = c.choices[0]?.finish_reason ?? finish;
    }
    if (finish !== 'stop') continue;
    complete++;
    let obj = null;
    try { obj = JSON.parse(text); } catch { /* reported below */ }
    ok(obj !== null && typeof obj === 'object' && !Array.isArray(obj), `streamed json_object output is a JSON object (seed ${seed})`, text);
  }
  ok(complete > 0, 'some json_object streams complete');
  const comp = await client.completions.create({ model, prompt: 'The settings, as JSON:', max_tokens: 300, seed: 5,
                                                 temperature: 0.8, response_format: { type: 'json_schema', json_schema: { name: 'p', schema: person } } });
  let cv = null;
  try { cv = JSON.parse(comp.choices[0].text); } catch { /* reported below */ }
  ok(isPerson(cv), 'completions follow response_format too', comp.choices[0].text);
  // each choice its own grammar: n = 3, a list of two prompts x n = 2, streamed too
  const parsed = (t) => { try { return JSON.parse(t); } catch { return null; } };
  const rf = { type: 'json_schema', json_schema: { name: 'p', schema: person } };
  const c3 = await client.chat.completions.create({ model, messages, response_format: rf, seed: 9, temperature: 0.8,
                                                    max_tokens: 300, n: 3 });
  ok(c3.choices.length === 3 && c3.choices.every((c, i) => c.index === i && c.finish_reason === 'stop' && isPerson(parsed(c.message.content))) &&
     new Set(c3.choices.map((c) => c.message.content)).size > 1, 'n=3: every choice follows the schema (and they differ)',
     JSON.stringify(c3.choices));
  const texts = ['', '', '', ''];
  for await (const c of await client.completions.create({ model, prompt: ['The settings, as JSON:', 'A person:'], n: 2, seed: 10,
                                                          temperature: 0.8, max_tokens: 300, response_format: rf, stream: true }))
    for (const ch of c.choices) texts[ch.index] += ch.text;
  ok(texts.every((t) => isPerson(parsed(t))), 'two prompts x n=2 streamed: every choice follows the schema', JSON.stringify(texts));
  // llama.cpp's json_schema and vLLM's guided_json (as text) apply as response_format does
  for (const field of ['json_schema', 'guided_json']) {
    const r = await client.completions.create({ model, prompt: 'A person:', max_tokens: 300, seed: 13, temperature: 0.8,
                                                [field]: field === 'guided_json' ? JSON.stringify(person) : person });
    ok(r.choices[0].finish_reason === 'stop' && isPerson(parsed(r.choices[0].text)), `${field} constrains the output`,
       r.choices[0].text);
  }
  // the grammar over bans (ignore_eos: the sampler's bans-only path), logit_bias and penalties
  const boost = (await (await fetch(`${base}/tokenize`, { method: 'POST', headers: { authorization: `Bearer ${key}` },
                                                          body: JSON.stringify({ content: ' Hello world! The end.' }) })).json()).tokens;
  for (const extra of [{ ignore_eos: true }, { ignore_eos: true, min_tokens: 5, temperature: 0 },
                       { logit_bias: Object.fromEntries(boost.map((t) => [t, 100])), frequency_penalty: 1 }]) {
    const r = await client.chat.completions.create({ model, messages, response_format: rf, seed: 11, temperature: 1,
                                                     max_tokens: 300, n: 2, ...extra });
    ok(r.choices.every((c) => c.finish_reason === 'stop' && isPerson(parsed(c.message.content))),
       `the schema holds with ${JSON.stringify(extra).slice(0, 60)}`, JSON.stringify(r.choices));
  }
  try {
    await client.chat.completions.create({ model, messages, response_format: { type: 'json_schema',
      json_schema: { name: 'x', schema: { type: 'string', pattern: '^a+$' } } } });
    ok(false, 'an unsupported schema keyword is refused');
  } catch (e) {
    ok(e.status === 400 && /pattern/.test(e.message), 'an unsupported schema keyword is a 400 naming it', e.message);
  }

  const tools = [
    { type: 'function', function: { name: 'get_weather', description: 'The weather in a city',
      parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 20 }, unit: { enum: ['celsius', 'fahrenheit'] } },
                    required: ['city', 'unit'], additionalProperties: false } } },
    { type: 'function', function: { name: 'add', description: 'Adds two integers',
      parameters: { type: 'object', properties: { a: { type: 'integer' }, b: { type: 'integer' } }, required: ['a', 'b'] } } },
  ];
  const ask = [{ role: 'system', content: 'You call tools.' }, { role: 'user', content: 'What is the weather in Paris?' }];
  const validCall = (c) => {
    const args = JSON.parse(c.function.arguments);
    return c.type === 'function' && /^call_/.test(c.id) && (c.function.name === 'get_weather'
      ? typeof args.city === 'string' && ['celsius', 'fahrenheit'].includes(args.unit)
      : c.function.name === 'add' && Number.isInteger(args.a) && Number.isInteger(args.b));
  };
  const req = await client.chat.completions.create({ model, messages: ask, tools, tool_choice: 'required', seed: 6,
                                                     temperature: 0.8, max_tokens: 300 });
  const calls = req.choices[0].message.tool_calls ?? [];
  ok(req.choices[0].finish_reason === 'tool_calls' && calls.length === 1 && validCall(calls[0]),
     "tool_choice 'required' gives a valid call", JSON.stringify(req.choices[0]));
  const named = await client.chat.completions.create({ model, messages: ask, tools, seed: 7, temperature: 0.8, max_tokens: 300,
                                                       tool_choice: { type: 'function', function: { name: 'add' } } });
  const nc = named.choices[0].message.tool_calls ?? [];
  ok(nc.length === 1 && nc[0].function.name === 'add' && validCall(nc[0]), 'a named tool_choice calls that function',
     JSON.stringify(named.choices[0]));
  // streamed: the calls come as delta.tool_calls, put together by index
  const acc = [];
  let finish = null, streamedContent = '';
  for await (const c of await client.chat.completions.create({ model, messages: ask, tools, seed: 6, temperature: 0.8,
                                                               max_tokens: 300, tool_choice: 'required', stream: true })) {
    const d = c.choices[0]?.delta ?? {};
    streamedContent += d.content ?? '';
    for (const t of d.tool_calls ?? []) {
      acc[t.index] ??= { id: '', type: 'function', function: { name: '', arguments: '' } };
      if (t.id) acc[t.index].id = t.id;
      if (t.function?.name) acc[t.index].function.name += t.function.name;
      if (t.function?.arguments) acc[t.index].function.arguments += t.function.arguments;
    }
    if (c.choices[0]?.finish_reason) finish = c.choices[0].finish_reason;
  }
  ok(finish === 'tool_calls' && acc.length === 1 && validCall(acc[0]) && streamedContent === '',
     'streamed tool call', JSON.stringify([finish, acc, streamedContent]));
  ok(acc[0]?.function.name === calls[0]?.function.name && acc[0]?.function.arguments === calls[0]?.function.arguments,
     'the streamed call equals the non-streamed one (same seed)', JSON.stringify([acc[0], calls[0]]));
  // n = 2: each choice its own forced call, streamed as each choice's delta.tool_calls
  const two = await client.chat.completions.create({ model, messages: ask, tools, tool_choice: 'required', seed: 12,
                                                     temperature: 0.8, max_tokens: 300, n: 2 });
  ok(two.choices.length === 2 && two.choices.every((c, i) => c.index === i && c.finish_reason === 'tool_calls' &&
     c.message.tool_calls?.length === 1 && validCall(c.message.tool_calls[0])), 'n=2: a valid call in each choice',
     JSON.stringify(two.choices));
  const acc2 = [[], []], fin2 = [null, null];
  for await (const c of await client.chat.completions.create({ model, messages: ask, tools, tool_choice: 'required', seed: 12,
                                                               temperature: 0.8, max_tokens: 300, n: 2, stream: true }))
    for (const ch of c.choices) {
      for (const t of ch.delta?.tool_calls ?? []) acc2[ch.index][t.index] = t;
      if (ch.finish_reason) fin2[ch.index] = ch.finish_reason;
    }
  ok(fin2.every((f) => f === 'tool_calls') && acc2.every((a, i) => a.length === 1 &&
     a[0].function.name === two.choices[i].message.tool_calls?.[0]?.function.name &&
     a[0].function.arguments === two.choices[i].message.tool_calls?.[0]?.function.arguments),
     'n=2 streamed: each choice\'s call equals the non-streamed one', JSON.stringify([fin2, acc2]));
  // auto: content or calls, whichever the model writes, each well formed
  for (const stream of [false, true]) {
    const r = await client.chat.completions.create({ model, messages: ask, tools, seed: 8, temperature: 0.8, max_tokens: 40, stream });
    if (!stream) {
      const m = r.choices[0].message;
      ok(r.choices[0].finish_reason === 'tool_calls' ? (m.tool_calls ?? []).every(validCall) : typeof m.content === 'string',
         "tool_choice 'auto' answers", JSON.stringify(r.choices[0]));
    } else {
      let n = 0;
      for await (const c of r) n += c.choices.length;
      ok(n > 0, "tool_choice 'auto' streams");
    }
  }
  // the conversation goes on with the call and its result
  const follow = await client.chat.completions.create({ model, tools, max_tokens: 8, temperature: 0, messages: [...ask,
    { role: 'assistant', content: null, tool_calls: [calls[0]] },
    { role: 'tool', tool_call_id: calls[0]?.id, content: '{"temperature": 21}' }] });
  ok(typeof follow.choices[0].message.content === 'string' || follow.choices[0].message.tool_calls,
     'a tool result continues the conversation');
  try {
    await client.chat.completions.create({ model, messages: ask, tools, tool_choice: { type: 'function', function: { name: 'nope' } } });
    ok(false, 'a tool_choice naming an unknown function is refused');
  } catch (e) {
    ok(e.status === 400 && /nope/.test(e.message), 'a tool_choice naming an unknown function is a 400', e.message);
  }
}

const modes = { official: () => official(args[0]), extensions: () => extensions(args[0]),
                structured: () => structured(args[0]), concurrent, prefix, disconnect, many };
try { await modes[mode](); }
catch (e) { failed++; console.log(`FAIL: ${mode}: ${e.stack ?? e}`); }
process.exit(failed ? 1 : 0);
