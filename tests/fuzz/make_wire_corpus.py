#!/usr/bin/env python3
"""Write the seed corpus for tests/fuzz/fuzz_wire.c: an independent encoding of wire v5.

ok-*   must decode (tests/test_xfer_wire.c asserts it)
bad-*  must be rejected
Files found by fuzzing are added as crash-free inputs without a prefix rule (when the
version changed, those of the old one were restamped, so they still reach the decoder).
Usage: tests/fuzz/make_wire_corpus.py tests/fuzz/corpus/wire
"""
import os
import struct
import sys

MAGIC = 0x58564B50
READ, DATA, ACK, FAIL, HB, CLOSE, HELLO = 1, 2, 3, 4, 5, 6, 7
TIMEOUT, PEER_LOST, NOFIT, REJECTED, CANCELLED, CORRUPT, SHUTDOWN = -5, -11, -4, -12, -7, -13, -6


def msg(t, body, version=5, flags=0, body_len=None):
    bl = len(body) if body_len is None else body_len
    return struct.pack('<IBBHI', MAGIC, version, t, flags, bl) + body


def read_body(xfer=7, req=42, token=bytes(range(16)), budget=10**9, geo=(4, 2, 64, 16, 1),
              chunk=1 << 20, runs=((10, 3), (20, 1)), flags=0, nonce=bytes(range(16, 32)),
              digest=bytes(range(32, 48)), heads=None, reads=(1, 0), reserved=0):
    if heads is None:  # v5: every head, or none for a release
        heads = (0, 0) if flags & 4 else (0, geo[1])
    b = struct.pack('<QQ', xfer, req) + token + nonce + digest + struct.pack('<Q', budget)
    b += struct.pack('<5I', *geo) + struct.pack('<II', chunk, flags)
    b += struct.pack('<IIHHI', heads[0], heads[1], reads[0], reads[1], reserved)
    b += struct.pack('<I', len(runs))
    for f, c in runs:
        b += struct.pack('<II', f, c)
    return b


def fail_body(xfer=7, req=42, reason=REJECTED, text=b'bad token', why=0):
    return struct.pack('<QQiHH', xfer, req, reason, len(text), why) + text


def mac(x):
    """A 16-byte tag standing for x (v4: Poly1305 tags instead of v3's u64 checksums)."""
    return struct.pack('<QQ', x, x ^ 0x5a5a) if x else bytes(16)


def hello_body(agent=0xabcdef, ident=b'pagekv-0123456789abcdef0123456789abcdef', r32=0,
               model=b'llama-3.2-1b', geo=(16, 8, 64, 16, 2), tp=2, rank=1, heads=(4, 4), wire=5,
               model_len=None):
    ml = len(model) if model_len is None else model_len
    b = struct.pack('<QHHI', agent, len(ident), ml, r32) + struct.pack('<5I', *geo)
    b += struct.pack('<5I', tp, rank, heads[0], heads[1], wire)
    return b + ident + model


def data_body(xfer=7, layer=3, flags=0, nbytes=65536, checksum=0x1234, pieces=None, reserved=0,
              sums=None):
    b = struct.pack('<QIIQ', xfer, layer, flags, nbytes) + mac(checksum)
    if pieces is not None:
        b += struct.pack('<II', len(pieces), reserved)
        for off, ln in pieces:
            b += struct.pack('<QQ', off, ln)
    if sums is not None:
        b += struct.pack('<II', len(sums), reserved)
        for x in sums:
            b += mac(x)
    return b


def handle(req=42, token=bytes(16), addr=b'127.0.0.1:4000', geo=(4, 2, 64, 16, 1), blocks=(1, 2, 3),
           version=1, local=None, flags=None):
    if flags is None:
        flags = 1 if local else 0
    b = struct.pack('<IBBH', 0x48564B50, version, len(addr), flags) + struct.pack('<Q', req) + token
    b += struct.pack('<5I', *geo) + struct.pack('<I', len(blocks))
    if local:
        pid, fd, size, ino, boot = local
        b += struct.pack('<IIQQ', pid, fd, size, ino) + boot
    b += addr
    for x in blocks:
        b += struct.pack('<I', x)
    return b


def main(out):
    os.makedirs(out, exist_ok=True)
    seeds = {
        'ok-read': msg(READ, read_body()),
        'ok-read-one-run': msg(READ, read_body(runs=((0, 1),))),
        'ok-read-f32': msg(READ, read_body(geo=(32, 8, 128, 16, 0), runs=((5, 100), (1000, 7)))),
        'ok-data': msg(DATA, data_body()),
        'ok-data-shared': msg(DATA, data_body(flags=1, nbytes=12288, pieces=((4096, 8192), (65536, 4096)))),
        'ok-read-shared': msg(READ, read_body(flags=1)),
        'ok-read-whole': msg(READ, read_body(flags=2)),
        # v4: a token-only release names no blocks, and no other flag
        'ok-read-release': msg(READ, read_body(flags=4, runs=())),
        'bad-read-release-runs': msg(READ, read_body(flags=4)),
        'bad-read-release-whole': msg(READ, read_body(flags=6, runs=())),
        'bad-read-release-chunk': msg(READ, read_body(flags=4, runs=(), chunk=100)),
        'ok-hello': msg(HELLO, hello_body()),
        'ok-hello-empty': msg(HELLO, hello_body(ident=b'', model=b'')),
        'ok-hello-tp1': msg(HELLO, hello_body(tp=1, rank=0, heads=(0, 8))),
        'ok-hello-replicated': msg(HELLO, hello_body(geo=(4, 2, 64, 16, 0), tp=8, rank=7,
                                                     heads=(1, 1))),
        'bad-hello-long': msg(HELLO, hello_body(ident=b'x' * 64)),
        'bad-hello-unprintable': msg(HELLO, hello_body(ident=b'a\tb')),
        'bad-hello-reserved': msg(HELLO, hello_body(r32=1)),
        'bad-hello-len-lies': msg(HELLO, hello_body()[:-1]),
        # v5: the layout descriptor
        'bad-hello-model-long': msg(HELLO, hello_body(model=b'm' * 64)),
        'bad-hello-model-unprintable': msg(HELLO, hello_body(model=b'a\x7fb')),
        'bad-hello-model-len-lies': msg(HELLO, hello_body(model_len=13)),
        'bad-hello-tp-zero': msg(HELLO, hello_body(tp=0, rank=0)),
        'bad-hello-tp-above-cap': msg(HELLO, hello_body(tp=65, rank=0)),
        'bad-hello-rank': msg(HELLO, hello_body(tp=2, rank=2)),
        'bad-hello-no-heads': msg(HELLO, hello_body(heads=(0, 0))),
        'bad-hello-heads-beyond': msg(HELLO, hello_body(heads=(6, 4))),
        'bad-hello-geometry': msg(HELLO, hello_body(geo=(0, 8, 64, 16, 2))),
        'bad-hello-dtype': msg(HELLO, hello_body(geo=(16, 8, 64, 16, 5))),
        'bad-hello-wire': msg(HELLO, hello_body(wire=4)),
        'foreign-hello-v4': msg(HELLO, struct.pack('<QHHI', 1, 3, 0, 0) + b'abc', version=4),
        'ok-read-heads': msg(READ, read_body(heads=(2, 3), geo=(4, 8, 64, 16, 1))),
        'ok-read-reads': msg(READ, read_body(reads=(8, 7))),
        'ok-read-release-reads': msg(READ, read_body(flags=4, runs=(), reads=(2, 1))),
        'bad-read-heads-none': msg(READ, read_body(heads=(0, 0))),
        'bad-read-heads-beyond': msg(READ, read_body(heads=(1, 2))),
        'bad-read-heads-wrap': msg(READ, read_body(heads=(0xFFFFFFFF, 2))),
        'bad-read-release-heads': msg(READ, read_body(flags=4, runs=(), heads=(0, 2))),
        'bad-read-reads-zero': msg(READ, read_body(reads=(0, 0))),
        'bad-read-reads-index': msg(READ, read_body(reads=(2, 2))),
        'bad-read-reads-above-cap': msg(READ, read_body(reads=(1025, 0))),
        'bad-read-reserved': msg(READ, read_body(reserved=1)),
        'ok-fail-why-layout': msg(FAIL, fail_body(why=2, text=b'layout')),
        'foreign-hello-v3': msg(HELLO, hello_body(), version=3),
        # v3: LAYERS only with SHARED (a whole stream through UCX has a checksum trailer)
        'bad-data-layers-without-shared': msg(DATA, data_body(layer=0, flags=2, checksum=0,
                                                              sums=(1, 2, 3, 4))),
        'bad-data-layers-checksum': msg(DATA, data_body(layer=0, flags=3, nbytes=4096,
                                                        pieces=((0, 8192),), sums=(1, 2))),
        'bad-data-layers-none': msg(DATA, data_body(layer=0, flags=3, nbytes=4096, checksum=0,
                                                    pieces=((0, 4096),), sums=())),
        'bad-data-layers-beyond': msg(DATA, data_body(layer=4095, flags=3, nbytes=4096, checksum=0,
                                                      pieces=((0, 8192),), sums=(1, 2))),
        'bad-data-layers-count-lies': msg(DATA, data_body(layer=0, flags=3, nbytes=4096, checksum=0,
                                                          pieces=((0, 8192),), sums=(1, 2))[:-16]),
        'ok-data-shared-layers': msg(DATA, data_body(layer=0, flags=3, nbytes=4096, checksum=0,
                                                     pieces=((0, 8192), (65536, 4096)),
                                                     sums=(1, 2, 3))),
        'ok-read-shared-whole': msg(READ, read_body(flags=3)),
        'bad-data-shared-layers-sum': msg(DATA, data_body(layer=0, flags=3, nbytes=4096, checksum=0,
                                                          pieces=((0, 8192),), sums=(1, 2, 3))),
        'bad-data-shared-layers-no-sums': msg(DATA, data_body(layer=0, flags=3, nbytes=4096,
                                                              checksum=0, pieces=((0, 4096),))),
        'bad-data-shared-layers-no-pieces': msg(DATA, data_body(layer=0, flags=3, checksum=0,
                                                                sums=(1,))),
        'ok-handle-local': handle(local=(1234, 7, 1 << 26, 99, bytes(range(16)))),
        'ok-ack': msg(ACK, struct.pack('<QQQ', 7, 42, 1 << 20)),
        'ok-fail': msg(FAIL, fail_body()),
        # v4: READ carries a digest of the handle's block ids; FAIL's why (0 through v3)
        'ok-fail-why-blocks': msg(FAIL, fail_body(why=1, text=b'block ids')),
        'bad-fail-why-unknown': msg(FAIL, fail_body(why=3)),
        'bad-read-no-digest': msg(READ, read_body()[:48] + read_body()[64:]),
        'ok-fail-empty': msg(FAIL, fail_body(reason=TIMEOUT, text=b'')),
        'ok-fail-shutdown': msg(FAIL, fail_body(xfer=0, reason=SHUTDOWN, text=b'bye')),
        'ok-heartbeat': msg(HB, struct.pack('<QQ', 0xabcdef, 9)),
        'ok-close': msg(CLOSE, struct.pack('<QII', 0xabcdef, 0, 0)),
        'ok-close-reply': msg(CLOSE, struct.pack('<QII', 0xabcdef, 1, 0)),
        'bad-close-flags': msg(CLOSE, struct.pack('<QII', 1, 2, 0)),
        'bad-close-reserved': msg(CLOSE, struct.pack('<QII', 1, 0, 1)),
        'bad-close-short': msg(CLOSE, struct.pack('<QI', 1, 0)),
        'ok-handle': handle(),
        'ok-handle-v6': handle(addr=b'[::1]:5000', blocks=tuple(range(100))),
        'bad-empty': b'',
        'bad-short-header': msg(HB, b'')[:7],
        'bad-magic': b'XXXX' + msg(HB, struct.pack('<QQ', 1, 1))[4:],
        'bad-version-1': msg(HB, struct.pack('<QQ', 1, 1), version=1),
        'bad-version-2': msg(HB, struct.pack('<QQ', 1, 1), version=2),
        'bad-version-3': msg(HB, struct.pack('<QQ', 1, 1), version=3),
        'bad-version-4': msg(HB, struct.pack('<QQ', 1, 1), version=4),
        'bad-version-6': msg(HB, struct.pack('<QQ', 1, 1), version=6),
        'bad-version-0': msg(HB, struct.pack('<QQ', 1, 1), version=0),
        'foreign-read-v2': msg(READ, read_body(), version=2),
        'foreign-data-v2-layers': msg(DATA, data_body(layer=0, flags=2, checksum=0,
                                                      sums=(1, 2, 3, 4)), version=2),
        'foreign-data-v1': msg(DATA, data_body(), version=1),
        'foreign-ack-v9-id-beyond': msg(ACK, struct.pack('<QQQ', 1 << 40, 42, 1), version=9),
        'foreign-read-v6-short': msg(READ, b'\1\2\3', version=6),
        'foreign-read-v4': msg(READ, read_body()[:96] + read_body()[112:], version=4),
        'foreign-read-v3': msg(READ, read_body()[:32] + read_body()[64:], version=3),
        'ok-fail-v1': msg(FAIL, fail_body(), version=1),
        'ok-fail-v200': msg(FAIL, fail_body(text=b'wire version 2'), version=200),
        'bad-fail-v0': msg(FAIL, fail_body(), version=0),
        'ok-close-reply-v1': msg(CLOSE, struct.pack('<QII', 0xabcdef, 1, 0), version=1),
        'ok-close-v9': msg(CLOSE, struct.pack('<QII', 0xabcdef, 0, 0), version=9),
        'bad-flags': msg(HB, struct.pack('<QQ', 1, 1), flags=1),
        'bad-type': msg(99, b''),
        'bad-body-len-long': msg(HB, struct.pack('<QQ', 1, 1), body_len=17),
        'bad-body-len-short': msg(HB, struct.pack('<QQ', 1, 1), body_len=15),
        'bad-hb-trailing': msg(HB, struct.pack('<QQB', 1, 1, 0)),
        'bad-read-zero-id': msg(READ, read_body(xfer=0)),
        'bad-read-id-too-big': msg(READ, read_body(xfer=1 << 38)),
        'bad-read-no-runs': msg(READ, read_body(runs=())),
        'bad-read-zero-count': msg(READ, read_body(runs=((1, 0),))),
        'bad-read-run-wraps': msg(READ, read_body(runs=((0xFFFFFFFF, 2),))),
        'bad-read-runs-count-lies': msg(READ, read_body()[:-8]),
        'bad-read-too-many-blocks': msg(READ, read_body(runs=((0, 1 << 20), (1 << 21, 1)))),
        'bad-read-dtype': msg(READ, read_body(geo=(4, 2, 64, 16, 5))),
        'bad-read-zero-layers': msg(READ, read_body(geo=(0, 2, 64, 16, 1))),
        'bad-read-huge-geometry': msg(READ, read_body(geo=(4096, 4096, 65536, 65536, 0))),
        'bad-read-chunk-small': msg(READ, read_body(chunk=100)),
        'bad-read-budget': msg(READ, read_body(budget=1 << 62)),
        'bad-read-too-many-chunks': msg(READ, read_body(geo=(4096, 1, 1024, 1, 0), chunk=4096,
                                                        runs=((0, 1 << 12),))),
        'bad-data-flags': msg(DATA, data_body(flags=4)),
        'bad-data-layer': msg(DATA, data_body(layer=5000)),
        'bad-data-shared-no-pieces': msg(DATA, data_body(flags=1)),
        'bad-data-pieces-sum': msg(DATA, data_body(flags=1, nbytes=5, pieces=((0, 4),))),
        'bad-data-piece-empty': msg(DATA, data_body(flags=1, nbytes=4, pieces=((0, 4), (8, 0)))),
        'bad-data-piece-reserved': msg(DATA, data_body(flags=1, nbytes=4, pieces=((0, 4),), reserved=1)),
        'bad-data-piece-beyond': msg(DATA, data_body(flags=1, nbytes=4, pieces=(((1 << 44) - 2, 4),))),
        'bad-data-plain-trailing': msg(DATA, data_body() + b'\0' * 8),
        'bad-read-flags': msg(READ, read_body(flags=8)),
        'bad-handle-flags': handle(flags=2),
        'bad-handle-local-pid': handle(local=(0, 7, 1 << 26, 99, bytes(16))),
        'bad-handle-local-size': handle(local=(5, 7, 100, 99, bytes(16))),
        'bad-handle-local-truncated': handle(local=(5, 7, 1 << 26, 99, bytes(16)))[:-20],
        'bad-ack-zero-id': msg(ACK, struct.pack('<QQQ', 0, 42, 1)),
        'bad-fail-reason': msg(FAIL, fail_body(reason=0)),
        'bad-fail-reason-unknown': msg(FAIL, fail_body(reason=-99)),
        'bad-fail-text-unprintable': msg(FAIL, fail_body(text=b'a\nb')),
        'bad-fail-text-long': msg(FAIL, fail_body(text=b'x' * 129)),
        'bad-fail-text-len-lies': msg(FAIL, fail_body()[:-1]),
        'bad-handle-version': handle(version=2),
        'bad-handle-addr': handle(addr=b'host name:1'),
        'bad-handle-port': handle(addr=b'127.0.0.1:70000'),
        'bad-handle-no-blocks': handle(blocks=()),
        'bad-handle-truncated': handle()[:-1],
    }
    for name, data in seeds.items():
        with open(os.path.join(out, name), 'wb') as f:
            f.write(data)


if __name__ == '__main__':
    main(sys.argv[1] if len(sys.argv) > 1 else 'tests/fuzz/corpus/wire')
