"""A minimal Redis client (RESP2 over TCP) for the remote prefix-cache tests and
benchmark: they read and overwrite kvq's binary values, which redis-cli cannot do
byte for byte, and plant crafted values under the keys a server will read.
"""
import random
import socket


class Redis:
    def __init__(self, port, host="127.0.0.1"):
        self.s = socket.create_connection((host, port), timeout=10)
        self.f = self.s.makefile("rb")

    def cmd(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.s.sendall(b"".join(out))
        return self._reply()

    def _reply(self):
        line = self.f.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise RuntimeError("bad reply %r" % line)

    def keys(self, pattern):
        found, cursor = [], b"0"
        while True:
            cursor, batch = self.cmd("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
            found += batch
            if cursor in (b"0", "0"):
                return found


def crafted_values(good, count, seed=1):
    """count values that must all be refused: variations of a good value (a kvq
    entry with its header) and plain junk."""
    rng = random.Random(seed)
    hl = 12 + int.from_bytes(good[8:12], "little")
    out = []
    for i in range(count):
        kind = i % 8
        v = bytearray(good)
        if kind == 0:  # one byte flipped in the KV rows: the checksum fails
            v[rng.randrange(hl + 64, len(v))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncated
            v = v[: rng.randrange(0, len(v))]
        elif kind == 2:  # random bytes of the same length
            v = bytearray(rng.getrandbits(8) for _ in range(min(len(v), 4096)))
        elif kind == 3:  # another namespace in the header
            v = v[:8] + (3).to_bytes(4, "little") + b"xyz" + v[hl:]
        elif kind == 4:  # a header claiming a huge namespace
            v[8:12] = (0xFFFFFFF0).to_bytes(4, "little")
        elif kind == 5:  # the file's magic broken
            v[hl] ^= 0xFF
        elif kind == 6:  # the header alone
            v = v[:hl]
        else:  # a token id changed (the checksum then fails too)
            v[hl + 88 + 4 * rng.randrange(16)] ^= 0x7F
        out.append(bytes(v))
    return out


FNV_BASIS, FNV_PRIME, MASK = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


def fnv1a(h, data):
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK
    return h


def index_keys(space, ns, tokens, block=64):
    """The index keys kvq serve (src/server/prefix_remote.c) asks for, shortest
    first, for a prompt's tokens in namespace ns of the space (a hex string read
    from the keys of a server of the same model and KV formats)."""
    nsb = ns.encode()
    prefix = b"kvq:%s:%016x:" % (space.encode(), fnv1a(FNV_BASIS, nsb))
    h = fnv1a(fnv1a(FNV_BASIS, int(space, 16).to_bytes(8, "little")), nsb + b"\0")
    keys = []
    for i in range(len(tokens) // block):
        h = fnv1a(h, b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[i * block:(i + 1) * block]))
        keys.append(prefix + b"b:%016x" % h)
    return prefix, keys


def plant(r, space, ns, tokens, values):
    """Puts values (at most one per 64-token block of tokens) under entry keys that
    the prompt's longest index keys point at, as a replica's entries would be.
    Returns the entry keys."""
    prefix, keys = index_keys(space, ns, tokens)
    entries = []
    for i, (k, v) in enumerate(zip(keys[::-1], values)):
        eid = b"%016x-%d" % (fnv1a(FNV_BASIS, k + b"%d" % i), len(tokens))
        entries.append(prefix + b"e:" + eid)
        r.cmd("SET", entries[-1], v)
        r.cmd("SET", k, eid)
    return entries

