"""Hostile and careless HTTP clients against kvq serve (issue 72), raw sockets on
loopback. Each check prints 'ok: ...' or 'FAIL: ...'; every socket has a time limit.
usage: hostile.py MODE PORT [ARGS...]"""
import json
import os
import signal
import socket
import sys
import time

port = int(sys.argv[2])
asan = os.environ.get('KVQ_ASAN') == '1'  # RSS means little under AddressSanitizer
args = sys.argv[3:]
failed = 0


def check(cond, what, detail=''):
    global failed
    if cond:
        print('ok: ' + what)
    else:
        failed += 1
        print('FAIL: ' + what + (': ' + str(detail) if detail else ''))


def connect(src='127.0.0.1', timeout=10):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.bind((src, 0))
    s.connect(('127.0.0.1', port))
    return s


def read_all(s):
    """Bytes until EOF, the time limit (socket.timeout) or a reset."""
    data = b''
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            data += b
    except (socket.timeout, ConnectionError) as e:
        data += ('<%s>' % type(e).__name__).encode()
    return data


def final_status(data):
    """The status of the final response, interim 1xx ones skipped; None if none."""
    while data.startswith(b'HTTP/1.'):
        head, _, rest = data.partition(b'\r\n\r\n')
        code = int(head.split(b' ', 2)[1])
        if code >= 200:
            return code, rest
        data = rest
    return None, data


def request(method, path, body=b'', headers=()):
    h = '%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n' % (method, path)
    if body or method == 'POST':
        h += 'Content-Type: application/json\r\nContent-Length: %d\r\n' % len(body)
    h += ''.join('%s\r\n' % x for x in headers) + '\r\n'
    return h.encode() + body


def exchange(raw, half_close=False, timeout=30):
    try:
        s = connect(timeout=timeout)
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        data = read_all(s)
        s.close()
        return final_status(data)
    except OSError as e:
        return None, repr(e).encode()


def completion(max_tokens=4, stream=False, prompt='The kernel'):
    """A greedy completion; 'Once upon a time' runs to max_tokens (900 at least) on tinydoc."""
    return json.dumps({'prompt': prompt, 'max_tokens': max_tokens, 'temperature': 0,
                       'stream': stream}).encode()


def normal_requests(n, what):
    """n requests from 127.0.0.1 (health and short completions), all answered 200."""
    good = 0
    for i in range(n):
        raw = request('GET', '/health') if i % 2 else request('POST', '/v1/completions', completion(2))
        code, _ = exchange(raw, timeout=20)
        good += code == 200
    check(good == n, '%s: %d of %d normal requests served' % (what, good, n))


def hold(n, sources, partial):
    """n connections spread over the source addresses, each idle after sending a part
    of a request (nothing, some header lines, or headers and part of a body)."""
    held = []
    for i in range(n):
        s = connect(sources[i % len(sources)])
        kind = i % 3 if partial else 0
        if kind == 1:
            s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\n')
        elif kind == 2:
            s.sendall(request('POST', '/v1/completions', b'{"prompt": "a"}')[:-8])
        held.append(s)
    return held


def closed_by_server(s, limit):
    s.settimeout(limit)
    try:
        return s.recv(1) == b''
    except ConnectionError:
        return True
    except socket.timeout:
        return False


def slowloris():
    """ARGS: N_IDLE. N_IDLE connections held from 127.0.0.2-5 while normal clients
    are served from 127.0.0.1."""
    n = int(args[0])
    held = hold(n, ['127.0.0.%d' % i for i in range(2, 6)], True)
    time.sleep(0.5)
    normal_requests(20, '%d idle connections held' % n)
    alive = sum(1 for s in held[:50] if not closed_by_server(s, 0.01))
    check(alive == 50, 'the idle connections are still open (no timeout yet)', alive)
    for s in held:
        s.close()


def idle_timeout():
    """Server started with --timeout 1: idle and half-sent requests are closed."""
    held = hold(6, ['127.0.0.2'], True)
    closed = sum(1 for s in held if closed_by_server(s, 15))
    check(closed == 6, 'idle connections are closed after --timeout', '%d of 6' % closed)
    # a request that takes longer than the timeout to generate is still answered
    code, body = exchange(request('POST', '/v1/completions', completion(300, prompt='Once upon a time')), timeout=60)
    check(code == 200 and b'"choices"' in body, 'a generation longer than --timeout is answered', code)


def per_ip():
    """ARGS: CAP. CAP connections from one address; one more is refused, other
    addresses are still served."""
    cap = int(args[0])
    held = hold(cap, ['127.0.0.7'], False)
    time.sleep(0.3)
    extra = connect('127.0.0.7')
    try:
        extra.sendall(request('GET', '/health'))
        data = read_all(extra)
    except ConnectionError:
        data = b''
    check(not data.startswith(b'HTTP/1.1 200'), 'connection %d from one address is refused' % (cap + 1), data[:40])
    normal_requests(4, 'with one address at its cap')
    for s in held:
        s.close()


def rss_kib(pid):
    with open('/proc/%d/status' % pid) as f:
        return int(next(x for x in f if x.startswith('VmRSS')).split()[1])


def early():
    """ARGS: KEY PIDFILE. Answers decided by the headers come before any body is sent."""
    key, pid = args[0], int(open(args[1]).read())
    big = 'Content-Length: 9000000\r\n'
    for what, hdrs, want in [
            ('no API key, 8 MB declared', ['Content-Length: 8388607'], 401),
            ('wrong API key, 8 MB declared', ['Content-Length: 8388607', 'Authorization: Bearer nope'], 401),
            ('9000000 bytes declared over --max-body-mb 8', [big.strip(), 'Authorization: Bearer ' + key], 413),
            ('9000000 bytes declared with Expect: 100-continue',
             [big.strip(), 'Authorization: Bearer ' + key, 'Expect: 100-continue'], 413)]:
        raw = ('POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s\r\n\r\n'
               % '\r\n'.join(hdrs)).encode()
        code, body = exchange(raw, timeout=10)
        check(code == want and b'"error"' in body, '%s: %s at once, no body sent' % (what, want), (code, body[:80]))
    # llama-server's endpoints and embeddings go through the same checks
    for path in ['/tokenize', '/detokenize', '/apply-template', '/v1/embeddings']:
        for what, hdrs, want in [('no API key', ['Content-Length: 8388607'], 401),
                                 ('9000000 bytes declared', [big.strip(), 'Authorization: Bearer ' + key], 413)]:
            raw = ('POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s\r\n\r\n'
                   % (path, '\r\n'.join(hdrs))).encode()
            code, body = exchange(raw, timeout=10)
            check(code == want and b'"error"' in body, '%s %s: %s at once' % (path, what, want), (code, body[:80]))
    # 40 clients without a key each send most of an 8 MB body and stay: none is stored
    chunk, held, rss0 = b'x' * 65536, [], rss_kib(pid)
    for _ in range(40):
        s = connect(timeout=5)
        held.append(s)
        try:
            s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 8388607\r\n\r\n')
            for _ in range(127):
                s.sendall(chunk)
        except OSError:
            pass
    time.sleep(0.3)
    grown = rss_kib(pid) - rss0
    for s in held:
        s.close()
    if not asan:
        check(grown < 32768, 'refused bodies are not stored (RSS %+d MiB)' % (grown // 1024))
    # a header cut at a NUL after the right key, a path cut at %00
    raw = b'GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer ' + key.encode() + \
        b'\x00junk\r\n\r\n'
    code, _ = exchange(raw)
    check(code in (400, 401), 'an API key header cut at a NUL is not accepted', code)
    code, _ = exchange(request('GET', '/health%00/v1/models', headers=['Authorization: Bearer ' + key]))
    check(code == 404, '/health%00/v1/models is not /health', code)
    k = key.encode()
    for what, raw in [
            ('as the last header', b'GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ' + k + b'\r\n\r\n'),
            ('as the first header', b'GET /v1/models HTTP/1.1\r\nAuthorization: Bearer ' + k + b'\r\nHost: x\r\n\r\n'),
            ('with bare LF line ends', b'GET /v1/models HTTP/1.1\nAuthorization: Bearer ' + k + b'\nHost: x\n\n'),
            ('with no space after the colon', b'GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization:Bearer ' + k +
             b'\r\nAccept: */*\r\n\r\n')]:
        try:
            s = connect()
            s.sendall(raw)
            head = s.recv(64)
            s.close()
        except OSError as e:
            head = repr(e).encode()
        check(head.startswith(b'HTTP/1.1 200'), 'the right key ' + what, head)


def half_close():
    """A client that shuts down its sending side after a complete request is answered;
    one that closes entirely has its sequence freed."""
    code, body = exchange(request('POST', '/v1/completions', completion(8)), half_close=True)
    check(code == 200 and b'"finish_reason"' in body, 'a half-closed non-streaming request is answered', (code, body[:200]))
    # a prompt whose prefill outlasts the stream's first wait for output
    code, body = exchange(request('POST', '/v1/completions', completion(30, True, 'Once upon a time, ' * 100)),
                          half_close=True)
    check(code == 200 and b'data: [DONE]' in body and b'"finish_reason":"length"' in body,
          'a half-closed stream is answered to [DONE]', (code, body[-200:]))
    raw = request('POST', '/v1/completions', completion(8)).replace(b'HTTP/1.1', b'HTTP/1.0')
    code, body = exchange(raw, half_close=True)
    check(code == 200 and b'"finish_reason"' in body, 'a half-closed HTTP/1.0 request is answered', (code, body[:200]))
    # clients gone entirely during a long request, plain or streamed (still in its
    # prefill): their sequences are freed (the shell counts the log lines)
    for stream, prompt in [(False, 'Once upon a time'), (True, 'Once upon a time, ' * 60)]:
        s = connect()
        s.sendall(request('POST', '/v1/completions', completion(600, stream, prompt)))
        time.sleep(0.3)
        s.close()
        time.sleep(0.7)


def stream_until_signal():
    """ARGS: PIDFILE MAX_TOKENS WANT [N]. Starts a stream, sends SIGTERM to the server after
    its first content chunk, reads to the end. WANT: 'finish' (completes normally) or
    'cut' (an error event, then [DONE]). N: a list of two prompts with n = N choices each."""
    pid, max_tokens, want = int(open(args[0]).read()), int(args[1]), args[2]
    body = completion(max_tokens, True, 'Once upon a time')
    if len(args) > 3:
        q = json.loads(body)
        q.update(prompt=['Once upon a time', 'Once upon a time, there'], n=int(args[3]))
        body = json.dumps(q).encode()
    s = connect(timeout=60)
    # HTTP/1.0: the events come unchunked, the end of the stream is the end of the connection
    s.sendall(request('POST', '/v1/completions', body).replace(b'HTTP/1.1', b'HTTP/1.0'))
    data = b''
    while data.count(b'data: {') < 2:
        b = s.recv(65536)
        if not b:
            break
        data += b
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.3)
    try:
        refused = False
        connect(timeout=2).close()
    except ConnectionRefusedError:
        refused = True
    check(refused, 'no new connections once stopping')
    data += read_all(s)
    events = [e for e in data.split(b'\n\n') if e.startswith(b'data: ')]
    check(events and events[-1] == b'data: [DONE]' and events.count(b'data: [DONE]') == 1,
          'the stream ends with [DONE], once', data[-200:])
    if want == 'finish':
        check(len(events) > 1 and b'"finish_reason":"length"' in events[-2], 'the running stream finished', events[-2:])
    else:
        check(len(events) > 1 and b'"error"' in events[-2] and b'shutting down' in events[-2],
              'the cut stream gets an error event', events[-2:])


modes = {'slowloris': slowloris, 'idle-timeout': idle_timeout, 'per-ip': per_ip, 'early': early,
         'half-close': half_close, 'signal': stream_until_signal}
modes[sys.argv[1]]()
sys.exit(1 if failed else 0)
