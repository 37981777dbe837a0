#!/usr/bin/env python3
"""Copies a GGUF file adding string keys to its metadata, e.g.
  gguf_with_template.py IN OUT tokenizer.chat_template=FILE [KEY=FILE...]
(each value read from FILE). Tensor data is copied unchanged, realigned."""
import struct
import sys

SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def skip_value(buf, pos, vtype):
    if vtype in SCALAR:
        return pos + SCALAR[vtype]
    if vtype == 8:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    if vtype == 9:
        etype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        for _ in range(n):
            pos = skip_value(buf, pos, etype)
        return pos
    raise ValueError("unknown GGUF value type %d" % vtype)


def gguf_string(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def main():
    src, dst = sys.argv[1], sys.argv[2]
    added = []
    for arg in sys.argv[3:]:
        key, path = arg.split("=", 1)
        with open(path, encoding="utf-8") as f:
            added.append((key, f.read()))
    with open(src, "rb") as f:
        buf = f.read()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    assert magic == b"GGUF" and version == 3
    pos = 24
    alignment = 32
    for _ in range(n_kv):
        (klen,) = struct.unpack_from("<Q", buf, pos)
        key = buf[pos + 8:pos + 8 + klen].decode()
        pos += 8 + klen
        (vtype,) = struct.unpack_from("<I", buf, pos)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, pos + 4)
        pos = skip_value(buf, pos + 4, vtype)
    kv_end = pos
    for _ in range(n_tensors):
        (nlen,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + nlen
        (ndims,) = struct.unpack_from("<I", buf, pos)
        pos += 4 + 8 * ndims + 4 + 8
    infos_end = pos
    data_start = (infos_end + alignment - 1) // alignment * alignment
    new_kv = b"".join(gguf_string(k) + struct.pack("<I", 8) + gguf_string(v) for k, v in added)
    head = struct.pack("<4sIQQ", magic, version, n_tensors, n_kv + len(added)) + buf[24:kv_end] + new_kv
    head += buf[kv_end:infos_end]
    head += b"\0" * ((-len(head)) % alignment)
    with open(dst, "wb") as f:
        f.write(head)
        f.write(buf[data_start:])


if __name__ == "__main__":
    main()
