"""A minimal Redis client (RESP2 over TCP) for the remote prefix-cache tests and
benchmark: they read and overwrite kvq's binary values, which redis-cli cannot do
byte for byte, and plant crafted values under the keys a server will read.
"""
import random
import socket
import struct


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
    """count values that must all be refused, each with how plant() should file it:
    variations of a good value (a kvq block with its header) and plain junk. "rewrap":
    the header made right for the key (the block's own checks must refuse it),
    "rechain": the header names another key, "as-is": the header is what is wrong."""
    rng = random.Random(seed)
    hl = header_len(good)
    body = good[hl:]
    out = []
    for i in range(count):
        kind = i % 11
        v, mode = bytearray(body), "rewrap"
        if kind == 0:  # one byte flipped in the KV rows: the checksum fails
            v[rng.randrange(400, len(v))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncated
            v = v[: rng.randrange(0, len(v))]
        elif kind == 2:  # random bytes of the same length
            v, mode = bytearray(rng.getrandbits(8) for _ in range(min(len(good), 4096))), "as-is"
        elif kind == 3:  # another namespace in the header
            v, mode = good[:8] + (3).to_bytes(4, "little") + b"xyz" + good[hl - 8:], "as-is"
        elif kind == 4:  # a header claiming a huge namespace
            v, mode = bytearray(good), "as-is"
            v[8:12] = (0xFFFFFFF0).to_bytes(4, "little")
        elif kind == 5:  # the block's magic broken
            v[0] ^= 0xFF
        elif kind == 6:  # the header alone
            v = b""
        elif kind == 7:  # a good block under another key (its header names its own)
            mode = "rechain"
        elif kind == 8:  # a token id changed (the checksum then fails too)
            v[80 + 4 * rng.randrange(64)] ^= 0x7F
        elif kind == 9:  # a token id changed, the checksum made right
            v[80 + 4 * rng.randrange(64)] ^= 0x01
            v[-8:] = block_checksum(bytes(v[:-8])).to_bytes(8, "little")
        else:  # a NaN in the first layer's offsets (or sink count), the checksum made right
            v[364:368] = (0x7FC00000).to_bytes(4, "little")
            v[-8:] = block_checksum(bytes(v[:-8])).to_bytes(8, "little")
        out.append((bytes(v), mode))
    return out


FNV_BASIS, FNV_PRIME, MASK = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


def fnv1a(h, data):
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK
    return h


def block_checksum(data):
    """A block's checksum (src/engine/seq_blocks.c): FNV-1a 64 over little-endian
    64-bit words, the last len % 8 bytes one at a time."""
    h, n = FNV_BASIS, len(data) // 8 * 8
    for (w,) in struct.iter_unpack("<Q", data[:n]):
        h = ((h ^ w) * FNV_PRIME) & MASK
    return fnv1a(h, data[n:])


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


def plant(r, space, ns, tokens, value, mode="as-is"):
    """Puts value (a block's bytes for "rewrap" and "rechain", see crafted_values)
    under the key of the first block of tokens in namespace ns, where a lookup reads
    first. Returns the key and the value."""
    keys, chains = block_keys(space, ns, tokens)
    if mode != "as-is":
        value = rewrap(b"KVQPCR2\0" + bytes(12) + value, ns, chains[0] ^ (mode == "rechain"))
    r.cmd("SET", keys[0], value)
    return keys[0], value
