#!/usr/bin/env python3
"""Write the seed corpora for tests/fuzz/fuzz_checkpoint.c, fuzz_tokbin.c and fuzz_sse.c.

checkpoint/  llama2.c checkpoints (legacy version 0): ok-* must load, bad-* must not
tokbin/      a mode byte, then (mode 0) a little-endian i16 vocabulary size, then a
             llama2.c tokenizer.bin (mode 1: the size is the number of entries):
             ok-* must load, bad-* must not
sse/         a byte choosing how the stream is cut, then an upstream SSE stream
The replaying tests (test_model, test_tokenizer, test_router) check the prefixes.
Usage: tests/fuzz/make_loader_corpus.py tests/fuzz/corpus
"""
import os
import struct
import sys


def checkpoint(dim=4, hidden=3, layers=1, heads=2, kv_heads=1, vocab=5, seq=3, unshared=False,
               extra=0, bad_float=None, header=None):
    hs = dim // heads
    kvd = kv_heads * hs
    floats = (vocab * dim + layers * (dim + dim * dim + 2 * kvd * dim + dim * dim + dim +
                                      3 * dim * hidden) + dim + seq * hs +
              (vocab * dim if unshared else 0))
    w = [((i * 37) % 101 - 50) / 64.0 for i in range(floats + extra)]
    if bad_float is not None:
        w[len(w) // 2] = bad_float
    h = header or (dim, hidden, layers, heads, kv_heads, -vocab if unshared else vocab, seq)
    return struct.pack('<7i', *h) + struct.pack('<%df' % len(w), *w)


def tokbin(pieces, max_len=None, scores=None):
    max_len = max_len if max_len is not None else max([len(p) for p in pieces] + [1])
    b = struct.pack('<i', max_len)
    for i, p in enumerate(pieces):
        b += struct.pack('<fi', scores[i] if scores else -float(i), len(p)) + p
    return b


BASE = [b'<unk>', b'<s>', b'</s>']
BYTES = [b'<0x%02X>' % i for i in range(256)]
WORDS = [b' ', b'h', b'e', b'l', b'o', b'he', b'll', b'hell', b'hello', b' w', b'or', b'ld',
         b' world', b'\xc3\xa9']


def checkpoints():
    nan = float('nan')
    return {
        'ok-tiny-shared': checkpoint(),
        'ok-tiny-unshared': checkpoint(unshared=True),
        'ok-two-layers-gqa': checkpoint(dim=8, hidden=5, layers=2, heads=4, kv_heads=2, vocab=7),
        'ok-mha': checkpoint(dim=4, heads=2, kv_heads=2, seq=1),
        'bad-empty': b'',
        'bad-short-header': checkpoint()[:20],
        'bad-truncated': checkpoint()[:-4],
        'bad-trailing': checkpoint(extra=1),
        'bad-nan-weight': checkpoint(bad_float=nan),
        'bad-inf-weight': checkpoint(bad_float=float('inf')),
        'bad-odd-head-size': checkpoint(dim=6, heads=2, kv_heads=1),
        'bad-kv-heads-not-divisor': checkpoint(dim=12, heads=3, kv_heads=2),
        'bad-zero-layers': checkpoint(header=(4, 3, 0, 2, 1, 5, 3)),
        'bad-negative-dim': checkpoint(header=(-4, 3, 1, 2, 1, 5, 3)),
        'bad-huge-vocab': checkpoint(header=(4, 3, 1, 2, 1, 1 << 23, 3)),
    }


def tokbins():
    small = BASE + WORDS
    full = BASE + BYTES + WORDS
    def sized(pieces, **kw):
        return b'\x00' + struct.pack('<h', len(pieces)) + tokbin(pieces, **kw)
    return {
        'ok-small': sized(small),
        'ok-small-walked': b'\x01' + tokbin(small),
        'ok-bytes-full': sized(full),
        'ok-bytes-lower-hex': sized(BASE + [b'<0x%02x>' % i for i in range(256)] + WORDS),
        'ok-empty-pieces': sized(BASE + [b'', b'a', b'', b'ab']),
        'ok-duplicates': sized(BASE + [b'a', b'a', b'b', b'ab', b'ab']),
        'ok-equal-scores': sized(small, scores=[0.0] * len(small)),
        'bad-vocab-too-small': b'\x00' + struct.pack('<h', 2) + tokbin(BASE[:2]),
        'bad-vocab-negative': b'\x00' + struct.pack('<h', -5) + tokbin(small),
        'bad-vocab-too-large': b'\x00' + struct.pack('<h', len(small) + 1) + tokbin(small),
        'bad-trailing': b'\x00' + struct.pack('<h', len(small) - 1) + tokbin(small),
        'bad-truncated': sized(small)[:-3],
        'bad-max-len-zero': sized(small, max_len=0),
        'bad-piece-over-max': sized(small, max_len=3),
        'bad-nan-score': sized(small, scores=[float('nan')] + [0.0] * (len(small) - 1)),
        'bad-header-only': b'\x00' + struct.pack('<h', 3) + struct.pack('<i', 8),
    }


def sse():
    ev = lambda d: b'data: ' + d + b'\n\n'
    chunk = ev(b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi"}]}')
    done = ev(b'[DONE]')
    return {
        'stream-complete': b'\x00' + chunk * 3 + done,
        'stream-cut-tiny': b'\x07' + chunk * 2 + done,
        'stream-partial-tail': b'\x11' + chunk + b'data: {"choi',
        'stream-error-event': b'\x23' + chunk + ev(b'{"error":{"message":"x","code":"y"}}'),
        'stream-newline-runs': b'\x05' + b'\n\n\n\ndata: a\n\n\n' + b'\n' * 7,
        'stream-crlf': b'\x09' + b'data: a\r\n\r\ndata: b\r\n\r\n',
        'stream-comments-and-fields': b'\x13' + b': ping\n\nevent: x\nid: 1\ndata: y\n\n',
        'stream-empty': b'\x00',
        # found by fuzz_sse: a '\n' in a later piece than the event it follows
        'stream-newline-after-event': bytes.fromhex(
            '05' + 'd9' * 22 + 'b0000011b53a2061') + b'\n' * 10,
    }


def main(out):
    for sub, files in (('checkpoint', checkpoints()), ('tokbin', tokbins()), ('sse', sse())):
        d = os.path.join(out, sub)
        os.makedirs(d, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(d, name), 'wb') as f:
                f.write(data)


if __name__ == '__main__':
    main(sys.argv[1] if len(sys.argv) > 1 else 'tests/fuzz/corpus')
