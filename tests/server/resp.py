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


def header_len(value):
    """The length of the header (src/server/prefix_remote.c) in front of a block."""
    return 12 + int.from_bytes(value[8:12], "little") + 8


def crafted_values(good, count, seed=1):
    """count values that must all be refused: variations of a good value (a kvq
    block with its header) and plain junk."""
    rng = random.Random(seed)
    hl = header_len(good)
    out = []
    for i in range(count):
        kind = i % 9
        v = bytearray(good)
        if kind == 0:  # one byte flipped in the KV rows: the checksum fails
            v[rng.randrange(hl + 400, len(v))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncated
            v = v[: rng.randrange(0, len(v))]
        elif kind == 2:  # random bytes of the same length
            v = bytearray(rng.getrandbits(8) for _ in range(min(len(v), 4096)))
        elif kind == 3:  # another namespace in the header
            v = v[:8] + (3).to_bytes(4, "little") + b"xyz" + v[hl - 8:]
        elif kind == 4:  # a header claiming a huge namespace
            v[8:12] = (0xFFFFFFF0).to_bytes(4, "little")
        elif kind == 5:  # the block's magic broken
            v[hl] ^= 0xFF
        elif kind == 6:  # the header alone
            v = v[:hl]
        elif kind == 7:  # another key's chain in the header (a value copied under another key)
            v[hl - 8] ^= 0x5A
        else:  # a token id changed (the checksum then fails too)
            v[hl + 80 + 4 * rng.randrange(16)] ^= 0x7F
        out.append(bytes(v))
    return out


FNV_BASIS, FNV_PRIME, MASK = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


def fnv1a(h, data):
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK
    return h


def block_keys(space, ns, tokens, block=64):
    """The keys kvq serve (src/server/prefix_remote.c) keeps a prompt's blocks under
    in namespace ns of the space (a hex string read from the keys of a server of the
    same model and KV formats), first block first, and their chain hashes."""
    nsb = ns.encode()
    prefix = b"kvq:%s:%016x:" % (space.encode(), fnv1a(FNV_BASIS, nsb))
    h = fnv1a(fnv1a(FNV_BASIS, int(space, 16).to_bytes(8, "little")), nsb + b"\0")
    keys, chains = [], []
    for i in range(len(tokens) // block):
        h = fnv1a(h, b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[i * block:(i + 1) * block]))
        keys.append(prefix + b"k:%016x" % h)
        chains.append(h)
    return keys, chains


def rewrap(value, ns, chain):
    """A block's value with the header of another namespace and key: what a good
    block of that key would be."""
    nsb = ns.encode()
    return value[:8] + len(nsb).to_bytes(4, "little") + nsb + chain.to_bytes(8, "little") + value[header_len(value):]


def plant(r, space, ns, tokens, value):
    """Puts value under the key of the first block of tokens in namespace ns, where a
    lookup reads first. Returns the key."""
    key = block_keys(space, ns, tokens)[0][0]
    r.cmd("SET", key, value)
    return key
