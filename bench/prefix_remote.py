#!/usr/bin/env python3
"""Issue 77's targets for kvq serve --prefix-cache-remote: two replicas and one
redis-server on loopback, tinydoc-q8_0 on the CPU.

  ttft      a 1,700-token prefix prefilled on replica A; replica B's first request
            sharing it against a cold prefill of the same length on B (median of
            --reps runs, side by side), for the default KV config and --kv-bits 8,4
  bytes     bytes written to the store per cached token, --kv-bits 8,4 against f16
            (the servers' counters and the store's MEMORY USAGE)
  partial   B holds the first 1,000 tokens of a 1,700-token prefix that A prefilled:
            the bytes B reads for its hit (only the blocks it lacks) and its TTFT
  kill      64 streams, a third sharing prefixes, over both replicas; the store is
            killed mid-load and restarted: every request must complete; reports how
            long after the restart the first remote hit came
  crafted   1,000 crafted or foreign values under replica B's keys: none served

  python3 bench/prefix_remote.py --kvq build/kvq [--baseline OLD/kvq] [--phases ttft,bytes,partial,kill,crafted]

With --baseline, the ttft, bytes, partial and kill phases run each setting with the
baseline binary, then with --kvq, in the same run (crafted: --kvq only, its values
are planted in the layout of this version's store).
"""
import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server"))
import resp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


LIVE = []  # processes to stop on the way out (an exception included)


class Store:
    def __init__(self, tmp, port=None):
        self.tmp, self.port = tmp, port or free_port()
        self.start()

    def start(self):
        self.p = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", self.tmp, "--maxmemory", "1gb",
                                   "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
        LIVE.append(self.p)
        for _ in range(200):
            try:
                resp.Redis(self.port).cmd("PING")
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self):
        self.p.kill()
        self.p.wait()

    def key_memory(self):
        """Bytes the store spends on kvq's keys (MEMORY USAGE)."""
        r = resp.Redis(self.port)
        return sum(r.cmd("MEMORY", "USAGE", k, "SAMPLES", "0") for k in r.keys("kvq:*"))


class Replica:
    def __init__(self, kvq, model, tmp, name, args):
        self.log = open(os.path.join(tmp, name + ".log"), "w+")
        self.p = subprocess.Popen([kvq, "serve", "-m", model, "--host", "127.0.0.1", "--port", "0"] + args,
                                  stdout=self.log, stderr=subprocess.STDOUT)
        LIVE.append(self.p)
        for _ in range(600):
            self.log.seek(0)
            text = self.log.read()
            if "listening on http://" in text:
                self.port = int(text.split("listening on http://")[1].split(":")[1].split()[0])
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("replica %s did not start:\n%s" % (name, text))

    def last_remote_hit_ms(self):
        """The ms of the log's last cache_remote_hit line (this version: the lookup,
        fetch and append; the baseline's: decoding the fetched entry), or None."""
        self.log.seek(0)
        hits = [ln for ln in self.log.read().splitlines() if "cache_remote_hit" in ln]
        return float(hits[-1].rsplit("ms=", 1)[1]) if hits else None

    def stop(self):
        """The exit status, and whether the log holds a sanitizer report."""
        self.p.send_signal(signal.SIGTERM)
        rc = self.p.wait()
        self.log.seek(0)
        text = self.log.read()
        return rc, "Sanitizer" in text or "runtime error:" in text

    def metric(self, name):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        c.request("GET", "/metrics")
        for line in c.getresponse().read().decode().splitlines():
            if line.startswith("kvq_" + name + " "):
                return float(line.split()[1])
        return None

    def wait_metric(self, name, at_least, seconds=30):
        end = time.time() + seconds
        while time.time() < end:
            if (self.metric(name) or 0) >= at_least:
                return True
            time.sleep(0.05)
        return False

    def complete(self, tokens, key, max_tokens=4, stream=True):
        """(seconds to the first token, or to the answer without stream; answer or None)"""
        body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                "prompt_cache_key": key}
        if stream:
            body["stream_options"] = {"include_usage": True}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return time.perf_counter() - t0, None
        if not stream:
            return time.perf_counter() - t0, json.loads(r.read())
        first, usage, text = None, None, ""
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("text") and first is None:
                first = time.perf_counter() - t0
            text += "".join(ch.get("text", "") for ch in ev.get("choices", []))
            usage = ev.get("usage") or usage
        return first, {"usage": usage, "text": text}


def tokenize(rep, text):
    c = http.client.HTTPConnection("127.0.0.1", rep.port, timeout=60)
    c.request("POST", "/tokenize", json.dumps({"content": text}), {"Content-Type": "application/json"})
    return json.loads(c.getresponse().read())["tokens"]


def ttft(a, b, corpus, label, reps, store):
    """Returns (cold, hit) medians in seconds, A's bytes and tokens written, and the
    store's bytes per token written (A's entries and B's)."""
    cold, hit, read, fetch = [], [], [], []
    for i in range(reps):
        base = 100000 + i * 7000
        prefix = [1] + corpus[base:base + 1699]  # BOS and 1,699 tokens
        written = a.metric("prefix_cache_remote_tokens_written_total")
        a.complete(prefix + corpus[base + 1699:base + 1719], "shared")
        if not a.wait_metric("prefix_cache_remote_tokens_written_total", written + 1719 // 64 * 64):
            raise RuntimeError("A did not publish its entry")
        t_cold, _ = b.complete([1] + corpus[base + 3000:base + 4719], "cold")  # same length, nothing shared
        r0 = b.metric("prefix_cache_remote_bytes_read_total")
        t_hit, ans = b.complete(prefix + corpus[base + 2000:base + 2020], "shared")
        read.append(b.metric("prefix_cache_remote_bytes_read_total") - r0)
        fetch.append(b.last_remote_hit_ms() or float("nan"))
        cached = ans["usage"]["prompt_tokens_details"]["cached_tokens"]
        print("  %-26s run %d: cold %.1f ms, hit %.1f ms (%d cached tokens)" % (label, i + 1, t_cold * 1e3,
                                                                              t_hit * 1e3, cached))
        cold.append(t_cold)
        hit.append(t_hit)
    return statistics.median(cold), statistics.median(hit), statistics.median(read), statistics.median(fetch), a.metric(
        "prefix_cache_remote_bytes_written_total"), a.metric("prefix_cache_remote_tokens_written_total"), \
        store.key_memory() / sum(r.metric("prefix_cache_remote_tokens_written_total") for r in (a, b))


def binaries(o):
    """(label, path) of the binaries a phase compares."""
    return [("before", o.baseline), ("after", o.kvq)] if o.baseline else [("", o.kvq)]


def replicas(o, tmp, kv, bin_path, c=4096):
    store = Store(tmp)
    common = ["-t", str(o.threads), "-c", str(c), "--max-num-seqs", "4",
              "--prefix-cache-remote", "redis://127.0.0.1:%d" % store.port] + kv
    return store, Replica(bin_path, o.model, tmp, "A", common), Replica(bin_path, o.model, tmp, "B", common)


def phase_ttft_bytes(o, corpus, tmp, phases):
    configs = [("default (f16, stored 8-bit)", []), ("--kv-bits 8,4", ["--kv-bits", "8,4"]),
               ("f16 entries (16-bit cache)", ["--kv-bits", "16", "--prefix-cache-bits", "16"])]
    per_token = {}
    for label, kv in configs:
        if "ttft" not in phases and not label.startswith(("--kv", "f16")):
            continue
        for tag, bin_path in binaries(o):
            store, a, b = replicas(o, tmp, kv, bin_path)
            name = ("%s %s" % (tag, label)).strip()
            try:
                c, h, rd, fm, bw, tw, mem = ttft(a, b, corpus, name, o.reps, store)
            finally:
                a.stop()
                b.stop()
                store.kill()
            per_token[(tag, label)] = (bw / tw, mem)
            print("%-35s TTFT cold %.1f ms, remote hit %.1f ms: %.1fx lower; hit read %.0f bytes (%.1f ms in the log); "
                  "written %.0f bytes/token (store: %.0f)" % (name, c * 1e3, h * 1e3, c / h, rd, fm, bw / tw, mem))
    if "bytes" in phases:
        for tag, _ in binaries(o):
            q, f = per_token[(tag, "--kv-bits 8,4")], per_token[(tag, "f16 entries (16-bit cache)")]
            print("%s bytes per cached token, 8,4 / f16: %.1f%% (counters), %.1f%% (the store's MEMORY USAGE)"
                  % (tag or "", 100 * q[0] / f[0], 100 * q[1] / f[1]))


def phase_partial(o, corpus, tmp):
    for tag, bin_path in binaries(o):
        store, a, b = replicas(o, tmp, [], bin_path)
        read, cached, hit = [], [], []
        try:
            for i in range(o.reps):
                base, key = 150000 + i * 7000, "p%d" % i
                prefix = [1] + corpus[base:base + 1699]
                b.complete(prefix[:1000] + corpus[base + 5000:base + 5020], key)  # B holds 1,000 tokens of it
                written = a.metric("prefix_cache_remote_tokens_written_total")
                a.complete(prefix + corpus[base + 1699:base + 1719], key)
                if not a.wait_metric("prefix_cache_remote_tokens_written_total", written + 64):
                    raise RuntimeError("A did not publish its entry")
                time.sleep(1)  # the rest of its publication
                r0 = b.metric("prefix_cache_remote_bytes_read_total")
                t, ans = b.complete(prefix + corpus[base + 2000:base + 2020], key)
                read.append(b.metric("prefix_cache_remote_bytes_read_total") - r0)
                cached.append(ans["usage"]["prompt_tokens_details"]["cached_tokens"])
                hit.append(t)
        finally:
            a.stop()
            b.stop()
            store.kill()
        print("%-35s B holds 1,000 of A's 1,700 prefix tokens: its hit read %.0f bytes (%d cached tokens), TTFT %.1f "
              "ms (medians of %d)" % (("%s partial" % tag).strip(), statistics.median(read), statistics.median(cached),
                                      statistics.median(hit) * 1e3, o.reps))


def phase_kill(o, corpus, tmp):
    for tag, bin_path in binaries(o):
        if tag:
            print(tag + ":")
        kill_run(o, bin_path, corpus, tmp)


def kill_run(o, kvq, corpus, tmp):
    store = Store(tmp)
    common = ["-t", "1", "-c", "1024", "--max-num-seqs", "16", "--kv-bits", "8,4",
              "--prefix-cache-remote", "redis://127.0.0.1:%d" % store.port]
    reps = [Replica(kvq, o.model, tmp, n, common) for n in ("A", "B")]
    n_req, streams, gap = o.kill_requests, 64, 99
    results, lock, next_i = [None] * n_req, threading.Lock(), [0]
    events = {}

    def route(i):
        """(replica, prompt): every third request shares a 256-token prefix: requests
        i = 0 (mod 6) prefill a new one on A, requests i = 3 (mod 6) reuse the one of
        request i - 99 on B (once it is long done); 32 tokens of their own follow."""
        if i % 3:
            s = 40000 + i * 300
            return i % 2, [1] + corpus[s:s + 287]
        first = i % 6 == 0 or i < gap
        s = 200000 + (i if first else i - gap) * 256
        return (0 if first else 1), [1] + corpus[s:s + 255] + corpus[10000 + i * 32:10000 + i * 32 + 32]

    def worker():
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= n_req:
                return
            r, prompt = route(i)
            try:
                _, ans = reps[r].complete(prompt, "load", max_tokens=4, stream=False)
                results[i] = ans is not None and bool(ans["choices"][0]["text"])
            except Exception as e:  # noqa: BLE001
                results[i] = False
                print("  request %d: %s" % (i, e))

    threads = [threading.Thread(target=worker) for _ in range(streams)]
    t0 = time.time()
    for t in threads:
        t.start()

    def hits():
        return sum(r.metric("prefix_cache_remote_hits_total") for r in reps)

    def wait_done(n):
        while sum(x is not None for x in results) < n:
            time.sleep(0.05)

    wait_done(n_req // 4)
    events["hits_before_kill"] = hits()
    store.kill()
    events["killed"] = time.time() - t0
    wait_done(n_req // 2)
    events["hits_while_down"] = hits() - events["hits_before_kill"]
    events["up_while_down"] = [r.metric("prefix_cache_remote_up") for r in reps]
    store.start()
    restarted = time.time()
    events["restarted"] = restarted - t0
    base = hits()
    while any(t.is_alive() for t in threads) and "first_hit_after" not in events:
        if "up_after" not in events and all(r.metric("prefix_cache_remote_up") == 1 for r in reps):
            events["up_after"] = time.time() - restarted
        if hits() > base:
            events["first_hit_after"] = time.time() - restarted
        time.sleep(0.05)
    for t in threads:
        t.join()
    events["done"] = time.time() - t0
    events["hits_after"] = hits() - base
    errs = [r.metric("prefix_cache_remote_errors_total") for r in reps]
    for r in reps:
        r.stop()
    store.kill()
    ok = sum(1 for x in results if x)
    fmt = lambda k: "%.2f s" % events[k] if k in events else "never"  # noqa: E731
    print("kill: %d streams, %d requests (a third sharing prefixes across the replicas): %d completed with text, "
          "%d failed" % (streams, n_req, ok, n_req - ok))
    print("  remote hits before the kill: %d; store killed at %.1f s (hits while down: %d, up gauges %s), restarted "
          "at %.1f s; both replicas reach it again %s after the restart, first remote hit %s after it, %d hits after "
          "it in all; done at %.1f s; store errors counted per replica %s"
          % (events["hits_before_kill"], events["killed"], events["hits_while_down"], events["up_while_down"],
             events["restarted"], fmt("up_after"), fmt("first_hit_after"), events["hits_after"], events["done"], errs))


def phase_crafted(o, corpus, tmp):
    store = Store(tmp)
    common = ["-t", str(o.threads), "-c", "1024", "--max-num-seqs", "16", "--kv-bits", "8,4",
              "--prefix-cache-remote", "redis://127.0.0.1:%d" % store.port]
    r = resp.Redis(store.port)
    toks = [1] + corpus[260000:260000 + 128]  # 2 blocks of 64: each crafted value costs B a cold prefill

    def publish(name, args):
        rep = Replica(o.kvq, o.model, tmp, name, args)
        rep.complete(toks + [13], "x")
        if not rep.wait_metric("prefix_cache_remote_tokens_written_total", 1):
            rep.log.seek(0)
            raise RuntimeError("%s did not publish:\n%s" % (name, rep.log.read()))
        return rep

    a = publish("A", common)
    a_space = r.keys("kvq:*:k:*")[0].split(b":")[1].decode()
    publish("F", common[:-4] + ["--kv-bits", "8"] + common[-2:]).stop()  # another KV format: foreign values
    good = r.cmd("GET", resp.block_keys(a_space, "x", toks)[0][0])
    foreign = r.cmd("GET", next(k for k in r.keys("kvq:*:k:*") if k.split(b":")[1].decode() != a_space))
    b = Replica(o.kvq, o.model, tmp, "B", common)
    real = b.complete(toks + [13], "x", stream=False)[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    # one value per namespace, under its first block's key (where a lookup reads first)
    values = resp.crafted_values(good, 900) + [(foreign[resp.header_len(foreign):], "rewrap")] * 100
    groups = list(range(len(values)))
    for i, (v, mode) in enumerate(values):
        resp.plant(r, a_space, "t%d" % i, toks, v, mode)
    served, failed = [0], [0]
    lock = threading.Lock()
    todo = list(range(len(groups)))

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            _, ans = b.complete(toks + [13], "t%d" % i, max_tokens=2, stream=False)
            with lock:
                if ans is None:
                    failed[0] += 1
                elif ans["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                    served[0] += 1

    t0 = time.time()
    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rejected = b.metric("prefix_cache_remote_rejected_total")
    hits = b.metric("prefix_cache_remote_hits_total")
    a.stop()
    b_rc, b_sanitizer = b.stop()
    store.kill()
    print("crafted: %d values (900 crafted, 100 foreign) over %d namespaces in %.1f s: %d requests served a cached "
          "prefix, %d failed; B rejected %d, remote hits %d (1 expected: A's real blocks, %d tokens); B exited with "
          "status %d, %s" % (len(values), len(groups), time.time() - t0, served[0], failed[0], rejected, hits, real,
                             b_rc, "a sanitizer report in its log" if b_sanitizer else "no sanitizer report"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvq", default=os.path.join(HERE, "..", "build", "kvq"))
    ap.add_argument("--model", default=os.path.join(HERE, "..", "..", "shared", "models", "tinydoc-q8_0.gguf"))
    ap.add_argument("--text", default=os.path.join(HERE, "..", "..", "shared", "data", "wikitext2-test.txt"))
    ap.add_argument("--baseline", help="another kvq binary to run side by side (ttft, bytes, partial, kill)")
    ap.add_argument("--phases", default="ttft,bytes,partial,kill,crafted")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kill-requests", type=int, default=384)
    o = ap.parse_args()
    if not shutil.which("redis-server"):
        sys.exit("redis-server is not installed (scripts/install-deps.sh installs it)")
    phases = o.phases.split(",")
    tmp = tempfile.mkdtemp(prefix="kvq-remote-bench-")
    try:
        tok = Replica(o.kvq, o.model, tmp, "tokenizer", ["-t", "1", "--prefix-cache-mb", "0"])
        corpus = tokenize(tok, open(o.text).read())
        tok.stop()
        if len(corpus) < 262000:
            sys.exit("%s holds %d tokens; the phases need 262,000" % (o.text, len(corpus)))
        if "ttft" in phases or "bytes" in phases:
            phase_ttft_bytes(o, corpus, tmp, phases)
        if "partial" in phases:
            phase_partial(o, corpus, tmp)
        if "kill" in phases:
            phase_kill(o, corpus, tmp)
        if "crafted" in phases:
            phase_crafted(o, corpus, tmp)
    finally:
        for p in LIVE:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
