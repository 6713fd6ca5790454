/* xfer wire format, handles, payload checksum and MAC; replays the fuzz corpus. */
#include "tests/support/testutil.h"

#include "xfer/sum.h"
#include "xfer/wire.h"

#include <stdio.h>
#include <string.h>

/* The fuzz target's properties: its round-trip checks trap on a violation. */
#include "tests/fuzz/props.h"

static const pkv_geometry_t GEO = {
    .layers = 4, .kv_heads = 2, .head_dim = 64, .block_tokens = 16, .dtype = PKV_DTYPE_F16};

static xf_wire_read_t sample_read(void)
{
    xf_wire_read_t r;
    memset(&r, 0, sizeof(r));
    r.xfer_id = 77;
    r.request_id = 123456789;
    for (int i = 0; i < PKV_XFER_TOKEN_BYTES; i++) r.token[i] = (uint8_t)(i * 7 + 1);
    for (int i = 0; i < (int)XF_WIRE_NONCE_BYTES; i++) r.nonce[i] = (uint8_t)(i * 5 + 3);
    for (int i = 0; i < (int)XF_WIRE_DIGEST_BYTES; i++) r.digest[i] = (uint8_t)(i * 3 + 2);
    r.budget_ns = 5000000000ull;
    r.geo = GEO;
    r.chunk_bytes = 1 << 20;
    r.head_n = GEO.kv_heads; /* every head */
    r.reads_total = 1;
    return r;
}

START_TEST(read_roundtrip_coalesces_runs)
{
    uint32_t blocks[] = {5, 6, 7, 100, 9, 10, 3};
    xf_wire_read_t r = sample_read();
    ck_assert_uint_eq(xf_wire_count_runs(blocks, 7), 4);
    uint8_t buf[512];
    size_t len;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 7, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_uint_eq(len, xf_wire_read_bytes(4));
    xf_wire_msg_t m;
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_int_eq(m.type, XF_WIRE_READ);
    ck_assert_uint_eq(m.u.read.xfer_id, 77);
    ck_assert_uint_eq(m.u.read.request_id, 123456789);
    ck_assert_mem_eq(m.u.read.token, r.token, PKV_XFER_TOKEN_BYTES);
    ck_assert_mem_eq(m.u.read.nonce, r.nonce, XF_WIRE_NONCE_BYTES);
    ck_assert_mem_eq(m.u.read.digest, r.digest, XF_WIRE_DIGEST_BYTES);
    ck_assert_uint_eq(m.u.read.budget_ns, 5000000000ull);
    ck_assert_uint_eq(m.u.read.n_runs, 4);
    ck_assert_uint_eq(m.u.read.n_blocks, 7);
    uint32_t first, count, k = 0;
    for (uint32_t i = 0; i < m.u.read.n_runs; i++) {
        xf_wire_read_run(&m.u.read, i, &first, &count);
        for (uint32_t j = 0; j < count; j++) ck_assert_uint_eq(first + j, blocks[k++]);
    }
    ck_assert_uint_eq(k, 7);
    /* Too small a buffer: NOSPACE, nothing claimed. */
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 7, buf, len - 1, &len), PKV_ERR_NOSPACE);
}
END_TEST

START_TEST(every_truncation_is_rejected)
{
    uint32_t blocks[] = {1, 2, 3, 9};
    xf_wire_read_t r = sample_read();
    uint8_t buf[512];
    size_t len;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 4, buf, sizeof(buf), &len), PKV_OK);
    xf_wire_msg_t m;
    for (size_t n = 0; n < len; n++) ck_assert_int_eq(xf_wire_decode(buf, n, &m), PKV_ERR_PROTO);
    /* One byte too many: the body length no longer matches. */
    buf[len] = 0;
    ck_assert_int_eq(xf_wire_decode(buf, len + 1, &m), PKV_ERR_PROTO);
}
END_TEST

START_TEST(versions_and_types_are_checked)
{
    xf_wire_heartbeat_t h = {.agent_id = 1, .seq = 2};
    uint8_t buf[64];
    size_t len;
    xf_wire_msg_t m;
    ck_assert_int_eq(xf_wire_encode_heartbeat(&h, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_uint_eq(m.u.hb.seq, 2);
    for (int v = 0; v < 256; v++) { /* a heartbeat of another version is not decoded */
        buf[4] = (uint8_t)v;
        ck_assert_int_eq(xf_wire_decode(buf, len, &m),
                         v == XF_WIRE_VERSION ? PKV_OK : PKV_ERR_PROTO);
    }
    buf[4] = XF_WIRE_VERSION;
    for (int t = 0; t < 256; t++) {
        buf[5] = (uint8_t)t;
        int rc = xf_wire_decode(buf, len, &m);
        if (t < XF_WIRE_READ || t > XF_WIRE_HELLO) ck_assert_int_eq(rc, PKV_ERR_PROTO);
    }
    buf[5] = XF_WIRE_HEARTBEAT;
    buf[6] = 1; /* flags must be zero */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    buf[6] = 0;
    buf[0] ^= 1; /* magic */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    ck_assert_int_eq(xf_wire_decode(NULL, 0, &m), PKV_ERR_PROTO);
}
END_TEST

/* What every version keeps: another version's READ / DATA / ACK is not decoded, but
 * peek_foreign names its version, type and xfer_id; a FAIL or CLOSE of any version
 * decodes. */
START_TEST(other_versions_are_peeked_and_their_fail_decodes)
{
    uint32_t blocks[3] = {4, 5, 9};
    xf_wire_read_t r = sample_read();
    xf_wire_data_t d = {.xfer_id = 77, .layer = 1, .bytes = 4096, .mac = {5}};
    xf_wire_ack_t k = {.xfer_id = 78, .request_id = 3, .bytes = 10};
    xf_wire_heartbeat_t hb = {.agent_id = 1, .seq = 2};
    uint8_t msg[4][256];
    size_t len[4];
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 3, msg[0], 256, &len[0]), PKV_OK);
    ck_assert_int_eq(xf_wire_encode_data(&d, NULL, 0, NULL, 0, msg[1], 256, &len[1]), PKV_OK);
    ck_assert_int_eq(xf_wire_encode_ack(&k, msg[2], 256, &len[2]), PKV_OK);
    ck_assert_int_eq(xf_wire_encode_heartbeat(&hb, msg[3], 256, &len[3]), PKV_OK);
    const uint8_t type[4] = {XF_WIRE_READ, XF_WIRE_DATA, XF_WIRE_ACK, XF_WIRE_HEARTBEAT};
    const uint64_t id[4] = {r.xfer_id, 77, 78, 0};
    xf_wire_msg_t m;
    xf_wire_foreign_t f;
    for (int i = 0; i < 4; i++) {
        /* ours: decoded, not foreign; peek (any version) still names it */
        ck_assert_int_eq(xf_wire_peek_foreign(msg[i], len[i], &f), PKV_ERR_PROTO);
        memset(&f, 0xee, sizeof(f));
        ck_assert_int_eq(xf_wire_peek(msg[i], len[i], &f), PKV_OK);
        ck_assert_uint_eq(f.version, XF_WIRE_VERSION);
        ck_assert_uint_eq(f.type, type[i]);
        ck_assert_uint_eq(f.xfer_id, id[i]);
        ck_assert_int_eq(xf_wire_peek(msg[i], len[i] - 1, &f), PKV_ERR_PROTO);
        for (int v = 1; v < 256; v += 3) {
            if (v == XF_WIRE_VERSION) continue;
            msg[i][4] = (uint8_t)v;
            ck_assert_int_eq(xf_wire_decode(msg[i], len[i], &m), PKV_ERR_PROTO);
            memset(&f, 0xee, sizeof(f));
            ck_assert_int_eq(xf_wire_peek_foreign(msg[i], len[i], &f), PKV_OK);
            ck_assert_uint_eq(f.version, v);
            ck_assert_uint_eq(f.type, type[i]);
            ck_assert_uint_eq(f.xfer_id, id[i]);
        }
        /* not a message at all: version 0, bad magic, flags, a body of the wrong length */
        msg[i][4] = 0;
        ck_assert_int_eq(xf_wire_peek_foreign(msg[i], len[i], &f), PKV_ERR_PROTO);
        msg[i][4] = 9;
        msg[i][0] ^= 1;
        ck_assert_int_eq(xf_wire_peek_foreign(msg[i], len[i], &f), PKV_ERR_PROTO);
        msg[i][0] ^= 1;
        msg[i][6] = 1;
        ck_assert_int_eq(xf_wire_peek_foreign(msg[i], len[i], &f), PKV_ERR_PROTO);
        msg[i][6] = 0;
        ck_assert_int_eq(xf_wire_peek_foreign(msg[i], len[i] - 1, &f), PKV_ERR_PROTO);
        ck_assert_int_eq(xf_wire_peek_foreign(msg[i], 11, &f), PKV_ERR_PROTO);
    }
    /* an xfer_id out of range is no transfer's */
    memset(msg[2] + XF_WIRE_HEADER_BYTES, 0xff, 8);
    ck_assert_int_eq(xf_wire_peek_foreign(msg[2], len[2], &f), PKV_OK);
    ck_assert_uint_eq(f.xfer_id, 0);

    xf_wire_fail_t fl = {.xfer_id = 12, .request_id = 34, .reason = PKV_ERR_REJECTED};
    snprintf(fl.text, sizeof(fl.text), "wire version 2");
    uint8_t fb[256];
    size_t fn;
    ck_assert_int_eq(xf_wire_encode_fail(&fl, fb, sizeof(fb), &fn), PKV_OK);
    for (int v = 0; v < 256; v++) {
        fb[4] = (uint8_t)v;
        memset(&m, 0, sizeof(m));
        ck_assert_int_eq(xf_wire_decode(fb, fn, &m), v ? PKV_OK : PKV_ERR_PROTO);
        if (!v) continue;
        ck_assert_uint_eq(m.type, XF_WIRE_FAIL);
        ck_assert_uint_eq(m.u.fail.xfer_id, 12);
        ck_assert_uint_eq(m.u.fail.request_id, 34);
        ck_assert_int_eq(m.u.fail.reason, PKV_ERR_REJECTED);
        ck_assert_str_eq(m.u.fail.text, "wire version 2");
        /* also peeked, by its xfer_id, for a FAIL of another version we could not decode */
        xf_wire_foreign_t ff;
        ck_assert_int_eq(xf_wire_peek_foreign(fb, fn, &ff),
                         v == XF_WIRE_VERSION ? PKV_ERR_PROTO : PKV_OK);
        if (v != XF_WIRE_VERSION) ck_assert_uint_eq(ff.xfer_id, 12);
    }
    xf_wire_close_t cl = {.agent_id = 99, .flags = XF_WIRE_CLOSE_REPLY};
    ck_assert_int_eq(xf_wire_encode_close(&cl, fb, sizeof(fb), &fn), PKV_OK);
    for (int v = 0; v < 256; v++) {
        fb[4] = (uint8_t)v;
        memset(&m, 0, sizeof(m));
        ck_assert_int_eq(xf_wire_decode(fb, fn, &m), v ? PKV_OK : PKV_ERR_PROTO);
        if (!v) continue;
        ck_assert_uint_eq(m.type, XF_WIRE_CLOSE);
        ck_assert_uint_eq(m.u.close.agent_id, 99);
        ck_assert_uint_eq(m.u.close.flags, XF_WIRE_CLOSE_REPLY);
    }
}
END_TEST

/* The digest of a handle's block ids: SHA-256 over u32 n and the ids, little-endian, cut
 * to 16 bytes (values computed independently: Python hashlib); any change of an id, the
 * order or the count changes it. */
START_TEST(blocks_digest_covers_ids_order_and_count)
{
    static const uint8_t want[XF_WIRE_DIGEST_BYTES] = {0x37, 0x4d, 0x42, 0x9e, 0xe1, 0x74,
                                                       0x76, 0x2e, 0x85, 0xd1, 0x4e, 0xa4,
                                                       0x94, 0xb5, 0x0c, 0x91};
    uint32_t b[300];
    for (uint32_t i = 0; i < 300; i++) b[i] = i + 1;
    uint8_t d[XF_WIRE_DIGEST_BYTES], e[XF_WIRE_DIGEST_BYTES];
    ck_assert_int_eq(xf_wire_blocks_digest(b, 3, d), PKV_OK);
    ck_assert_mem_eq(d, want, sizeof(want));
    ck_assert_int_eq(xf_wire_blocks_digest(b, 300, d), PKV_OK); /* across the 256-id steps */
    static const uint8_t want300[XF_WIRE_DIGEST_BYTES] = {0x9d, 0x71, 0xd7, 0xa4, 0x2f, 0x3a,
                                                          0xd8, 0x87, 0x1c, 0xa3, 0x63, 0xb6,
                                                          0xac, 0x8f, 0xbd, 0x2e};
    ck_assert_mem_eq(d, want300, sizeof(want300));
    b[299] ^= 1;
    ck_assert_int_eq(xf_wire_blocks_digest(b, 300, e), PKV_OK);
    ck_assert(memcmp(d, e, sizeof(d)));
    b[299] ^= 1;
    ck_assert_int_eq(xf_wire_blocks_digest(b, 299, e), PKV_OK);
    ck_assert(memcmp(d, e, sizeof(d)));
    uint32_t t = b[0];
    b[0] = b[1];
    b[1] = t;
    ck_assert_int_eq(xf_wire_blocks_digest(b, 300, e), PKV_OK);
    ck_assert(memcmp(d, e, sizeof(d)));
}
END_TEST

START_TEST(read_limits_are_enforced)
{
    xf_wire_read_t r = sample_read();
    uint32_t blocks[] = {1, 2};
    uint8_t buf[512];
    size_t len;
    r.xfer_id = 0;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 2, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    r = sample_read();
    r.xfer_id = 1ull << XF_WIRE_XFER_ID_BITS;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 2, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    r = sample_read();
    r.chunk_bytes = 100;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 2, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    r = sample_read();
    r.geo.dtype = (pkv_dtype_t)7;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 2, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    r = sample_read();
    r.geo.layers = XF_WIRE_MAX_LAYERS + 1;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 2, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    /* Decoder side: patch a valid message's run count to lie. */
    r = sample_read();
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 2, buf, sizeof(buf), &len), PKV_OK);
    xf_wire_msg_t m;
    size_t nruns_at = XF_WIRE_HEADER_BYTES + 100;
    buf[nruns_at] = 2;
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    buf[nruns_at] = 1;
    buf[nruns_at + 8] = 0; /* run count 0 */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
}
END_TEST

/* Encode a DATA, check its size, decode it and check every field came back. */
static void data_roundtrip(const xf_wire_data_t *d, const uint64_t *pieces, uint32_t np,
                           const uint8_t *macs, uint32_t ns, uint8_t *buf, size_t cap, size_t *len,
                           xf_wire_msg_t *m)
{
    ck_assert_int_eq(xf_wire_encode_data(d, pieces, np, macs, ns, buf, cap, len), PKV_OK);
    ck_assert_uint_eq(*len, xf_wire_data_bytes(np, ns));
    ck_assert_int_eq(xf_wire_decode(buf, *len, m), PKV_OK);
    ck_assert_uint_eq(m->u.data.flags, d->flags);
    ck_assert_uint_eq(m->u.data.layer, d->layer);
    ck_assert_uint_eq(m->u.data.bytes, d->bytes);
    ck_assert_mem_eq(m->u.data.mac, d->mac, XF_WIRE_MAC_BYTES);
    ck_assert_uint_eq(m->u.data.n_pieces, np);
    ck_assert_uint_eq(m->u.data.n_macs, ns);
    for (uint32_t i = 0; i < np; i++) {
        uint64_t off, l;
        xf_wire_data_piece(&m->u.data, i, &off, &l);
        ck_assert_uint_eq(off, pieces[2 * i]);
        ck_assert_uint_eq(l, pieces[2 * i + 1]);
    }
    for (uint32_t i = 0; i < ns; i++)
        ck_assert_mem_eq(xf_wire_data_mac(&m->u.data, i), macs + XF_WIRE_MAC_BYTES * i,
                         XF_WIRE_MAC_BYTES);
}

/* The encoder refuses this DATA. */
static void data_refused(const xf_wire_data_t *d, const uint64_t *pieces, uint32_t np,
                         const uint8_t *macs, uint32_t ns)
{
    uint8_t buf[256];
    size_t len;
    ck_assert_int_eq(xf_wire_encode_data(d, pieces, np, macs, ns, buf, sizeof(buf), &len),
                     PKV_ERR_INVALID);
}

START_TEST(shared_data_and_read_flags)
{
    uint64_t pieces[] = {4096, 8192, 65536, 4096};
    xf_wire_data_t d = {
        .xfer_id = 5, .layer = 2, .flags = XF_WIRE_DATA_SHARED, .bytes = 12288, .mac = {77}};
    uint8_t buf[256];
    size_t len;
    xf_wire_msg_t m;
    data_roundtrip(&d, pieces, 2, NULL, 0, buf, sizeof(buf), &len, &m);
    /* pieces must add up to the layer's bytes */
    d.bytes = 12289;
    ck_assert_int_eq(xf_wire_encode_data(&d, pieces, 2, NULL, 0, buf, sizeof(buf), &len),
                     PKV_ERR_INVALID);
    buf[XF_WIRE_HEADER_BYTES + 16] ^= 1; /* bytes field no longer matches the pieces */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    /* a plain DATA carries no pieces; unknown flags are rejected */
    d.flags = 0;
    d.bytes = 12288;
    ck_assert_int_eq(xf_wire_encode_data(&d, pieces, 2, NULL, 0, buf, sizeof(buf), &len),
                     PKV_ERR_INVALID);
    ck_assert_int_eq(xf_wire_encode_data(&d, NULL, 0, NULL, 0, buf, sizeof(buf), &len), PKV_OK);
    buf[XF_WIRE_HEADER_BYTES + 12] = 4;
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    buf[XF_WIRE_HEADER_BYTES + 12] = 3; /* SHARED and LAYERS, but neither trailer */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    xf_wire_read_t r = sample_read();
    uint32_t blocks[] = {1};
    const uint32_t flags[] = {XF_WIRE_READ_SHARED, XF_WIRE_READ_WHOLE,
                              XF_WIRE_READ_SHARED | XF_WIRE_READ_WHOLE};
    for (int i = 0; i < 3; i++) {
        r.flags = flags[i];
        ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 1, buf, sizeof(buf), &len), PKV_OK);
        ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
        ck_assert_uint_eq(m.u.read.flags, flags[i]);
    }
    r.flags = 8;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 1, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    buf[XF_WIRE_HEADER_BYTES + 96] = 8; /* READ flags field: a bit v4 does not know */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    buf[XF_WIRE_HEADER_BYTES + 96] = XF_WIRE_READ_RELEASE; /* a release names no blocks */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    /* RELEASE: no runs, no other flag, no heads (v5) */
    r.flags = XF_WIRE_READ_RELEASE;
    ck_assert_int_eq(xf_wire_encode_read(&r, NULL, 0, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    r.head_n = 0;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 1, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    ck_assert_int_eq(xf_wire_encode_read(&r, NULL, 0, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_uint_eq(len, xf_wire_read_bytes(0));
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_uint_eq(m.u.read.flags, XF_WIRE_READ_RELEASE);
    ck_assert_uint_eq(m.u.read.n_blocks, 0);
    buf[XF_WIRE_HEADER_BYTES + 96] |= XF_WIRE_READ_WHOLE;
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    r.flags = 0; /* and no plan without RELEASE */
    r.head_n = GEO.kv_heads;
    ck_assert_int_eq(xf_wire_encode_read(&r, NULL, 0, buf, sizeof(buf), &len), PKV_ERR_INVALID);
}
END_TEST

/* A shared whole stream's DATA: layers from 0, 4096 bytes each, the sums in the trailer. */
static xf_wire_data_t shared_layers_data(void)
{
    return (xf_wire_data_t){.xfer_id = 9,
                            .layer = 0,
                            .flags = XF_WIRE_DATA_SHARED | XF_WIRE_DATA_LAYERS,
                            .bytes = 4096};
}

/* Three layers' tags, each of its own bytes. */
static void sample_macs(uint8_t *macs, int n)
{
    for (int i = 0; i < n * (int)XF_WIRE_MAC_BYTES; i++) macs[i] = (uint8_t)(11 * (i + 1));
}

/* One DATA with every layer's MAC (whole-stream reads). */
START_TEST(data_layers_only_with_shared)
{
    /* v3 and v4: a DATA carries every layer's MAC (LAYERS) only with the arena pieces of a
     * shared whole stream; a whole stream through UCX has a trailer instead. */
    uint64_t pieces[] = {0, 12288};
    uint8_t sums[3 * XF_WIRE_MAC_BYTES];
    sample_macs(sums, 3);
    xf_wire_data_t d = shared_layers_data();
    uint8_t buf[256];
    size_t len;
    xf_wire_msg_t m;
    data_roundtrip(&d, pieces, 1, sums, 3, buf, sizeof(buf), &len, &m);
    /* the count must match the body; a checksum in the base field is refused */
    ck_assert_int_eq(xf_wire_decode(buf, len - XF_WIRE_MAC_BYTES, &m), PKV_ERR_PROTO);
    size_t n_at = XF_WIRE_HEADER_BYTES + 40 + 8 + 16; /* base, pieces header, one piece */
    buf[n_at] = 4;
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    buf[n_at] = 0;
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    buf[n_at] = 3;
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    buf[XF_WIRE_HEADER_BYTES + 24] = 1; /* base MAC */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    d.mac[0] = 1;
    data_refused(&d, pieces, 1, sums, 3);
    d.mac[0] = 0;
    d.layer = XF_WIRE_MAX_LAYERS - 2; /* layers past the limit */
    data_refused(&d, pieces, 1, sums, 3);
    /* LAYERS without SHARED: refused by the encoder, malformed to the decoder */
    d.layer = 0;
    d.flags = XF_WIRE_DATA_LAYERS;
    data_refused(&d, NULL, 0, sums, 3);
    data_refused(&d, NULL, 0, NULL, 0);
    /* what v2 sent after a whole stream's last chunk: the same sums, no pieces */
    uint8_t v2[XF_WIRE_HEADER_BYTES + 64] = {0};
    memcpy(v2, buf, XF_WIRE_HEADER_BYTES);
    v2[8] = 64; /* body_len */
    uint8_t *body = v2 + XF_WIRE_HEADER_BYTES;
    body[0] = 9;                    /* xfer_id */
    body[12] = XF_WIRE_DATA_LAYERS; /* flags */
    body[17] = 0x10;                /* bytes 4096 */
    body[32] = 3;                   /* n */
    for (int i = 0; i < 3; i++) body[40 + 8 * i] = (uint8_t)(11 * (i + 1));
    ck_assert_int_eq(xf_wire_decode(v2, sizeof(v2), &m), PKV_ERR_PROTO);
    body[12] = 0; /* the same bytes as a plain DATA are malformed too: a trailer too many */
    ck_assert_int_eq(xf_wire_decode(v2, sizeof(v2), &m), PKV_ERR_PROTO);
}
END_TEST

/* A small same-host read's one DATA: the whole stream's arena pieces and every layer's
 * checksum. */
START_TEST(shared_data_for_every_layer)
{
    uint64_t pieces[] = {0, 8192, 65536, 4096};
    uint8_t sums[3 * XF_WIRE_MAC_BYTES];
    sample_macs(sums, 3);
    xf_wire_data_t d = shared_layers_data();
    uint8_t buf[256];
    size_t len;
    xf_wire_msg_t m;
    data_roundtrip(&d, pieces, 2, sums, 3, buf, sizeof(buf), &len, &m);
    /* the pieces must cover every announced layer: 3 x 4096 bytes */
    buf[XF_WIRE_HEADER_BYTES + 16] ^= 1; /* bytes */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    d.bytes = 3000;
    data_refused(&d, pieces, 2, sums, 3);
    d.bytes = 4096;
    data_refused(&d, pieces, 2, sums, 2);
    /* both trailers are needed: SHARED | LAYERS with only the pieces is malformed */
    data_refused(&d, pieces, 2, NULL, 0);
    data_refused(&d, NULL, 0, sums, 3);
    d.flags = XF_WIRE_DATA_SHARED;
    d.bytes = 12288;
    ck_assert_int_eq(xf_wire_encode_data(&d, pieces, 2, NULL, 0, buf, sizeof(buf), &len), PKV_OK);
    buf[XF_WIRE_HEADER_BYTES + 12] = XF_WIRE_DATA_SHARED | XF_WIRE_DATA_LAYERS;
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
}
END_TEST

START_TEST(fail_carries_reason_and_text)
{
    xf_wire_fail_t f;
    memset(&f, 0, sizeof(f));
    f.xfer_id = 9;
    f.request_id = 10;
    f.reason = PKV_ERR_NOFIT;
    snprintf(f.text, sizeof(f.text), "staging full");
    uint8_t buf[256];
    size_t len;
    ck_assert_int_eq(xf_wire_encode_fail(&f, buf, sizeof(buf), &len), PKV_OK);
    xf_wire_msg_t m;
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_int_eq(m.u.fail.reason, PKV_ERR_NOFIT);
    ck_assert_str_eq(m.u.fail.text, "staging full");
    ck_assert_uint_eq(m.u.fail.why, 0);
    f.why = XF_WIRE_WHY_BLOCKS; /* the producer says what it refused */
    ck_assert_int_eq(xf_wire_encode_fail(&f, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_uint_eq(m.u.fail.why, XF_WIRE_WHY_BLOCKS);
    buf[XF_WIRE_HEADER_BYTES + 22] = XF_WIRE_WHY_MAX + 1; /* a why this version does not know */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    f.why = XF_WIRE_WHY_MAX + 1;
    ck_assert_int_eq(xf_wire_encode_fail(&f, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    f.why = 0;
    f.reason = PKV_OK; /* not a failure reason */
    ck_assert_int_eq(xf_wire_encode_fail(&f, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    f.reason = PKV_ERR_CORRUPT;
    f.text[3] = '\n';
    ck_assert_int_eq(xf_wire_encode_fail(&f, buf, sizeof(buf), &len), PKV_ERR_INVALID);
}
END_TEST

START_TEST(handle_roundtrip_and_rejects)
{
    uint32_t n = 37;
    pkv_xfer_handle_t *h = calloc(1, sizeof(*h) + 4 * n);
    h->request_id = 555;
    for (int i = 0; i < PKV_XFER_TOKEN_BYTES; i++) h->token[i] = (uint8_t)(255 - i);
    snprintf(h->addr, sizeof(h->addr), "10.250.0.1:40123");
    h->geo = GEO;
    h->n_blocks = n;
    for (uint32_t i = 0; i < n; i++) h->blocks[i] = i * 3 + 1;
    size_t need = pkv_xfer_handle_bytes(h), len;
    ck_assert_uint_gt(need, 0);
    uint8_t *buf = malloc(need);
    ck_assert_int_eq(pkv_xfer_handle_encode(h, buf, need - 1, &len), PKV_ERR_NOSPACE);
    ck_assert_int_eq(pkv_xfer_handle_encode(h, buf, need, &len), PKV_OK);
    ck_assert_uint_eq(len, need);
    pkv_xfer_handle_t *g = NULL;
    ck_assert_int_eq(pkv_xfer_handle_decode(buf, len, &g), PKV_OK);
    ck_assert_uint_eq(g->request_id, 555);
    ck_assert_str_eq(g->addr, "10.250.0.1:40123");
    ck_assert_mem_eq(g->token, h->token, PKV_XFER_TOKEN_BYTES);
    ck_assert_uint_eq(g->n_blocks, n);
    ck_assert_mem_eq(g->blocks, h->blocks, 4 * n);
    ck_assert(!g->local.present);
    pkv_xfer_handle_free(g);
    /* with the same-host section */
    h->local.present = true;
    h->local.pid = 4242;
    h->local.fd = 17;
    h->local.arena_bytes = 1 << 26;
    h->local.ino = 99;
    h->local.boot_id[3] = 0xab;
    size_t need2 = pkv_xfer_handle_bytes(h);
    ck_assert_uint_eq(need2, need + 40);
    uint8_t *buf2 = malloc(need2);
    size_t len2;
    ck_assert_int_eq(pkv_xfer_handle_encode(h, buf2, need2, &len2), PKV_OK);
    ck_assert_int_eq(pkv_xfer_handle_decode(buf2, len2, &g), PKV_OK);
    ck_assert(g->local.present);
    ck_assert_uint_eq(g->local.pid, 4242);
    ck_assert_int_eq(g->local.fd, 17);
    ck_assert_uint_eq(g->local.ino, 99);
    ck_assert_uint_eq(g->local.boot_id[3], 0xab);
    pkv_xfer_handle_free(g);
    free(buf2);
    h->local.present = false;
    for (size_t k = 0; k < len; k++) {
        g = NULL;
        ck_assert_int_eq(pkv_xfer_handle_decode(buf, k, &g), PKV_ERR_PROTO);
        ck_assert_ptr_null(g);
    }
    snprintf(h->addr, sizeof(h->addr), "no port");
    ck_assert_uint_eq(pkv_xfer_handle_bytes(h), 0);
    ck_assert_int_eq(pkv_xfer_handle_encode(h, buf, need, &len), PKV_ERR_INVALID);
    ck_assert(xf_wire_addr_valid("[::1]:80"));
    ck_assert(!xf_wire_addr_valid("127.0.0.1:0"));
    ck_assert(!xf_wire_addr_valid("127.0.0.1:99999"));
    ck_assert(!xf_wire_addr_valid(":80"));
    free(buf);
    free(h);
}
END_TEST

START_TEST(checksum_streams_and_detects_flips)
{
    uint64_t seed = pkv_test_seed(0x5eed);
    enum { N = 100003 };
    uint8_t *a = malloc(N), *b0 = aligned_alloc(64, (N + 8 + 63) / 64 * 64), *b = b0;
    for (size_t i = 0; i < N; i++) a[i] = (uint8_t)pkv_test_rand(&seed);
    pkv_xfer_sum_t s;
    pkv_xfer_sum_init(&s);
    pkv_xfer_sum_update(&s, a, N);
    uint64_t whole = pkv_xfer_sum_final(&s);
    for (int trial = 0; trial < 60; trial++) {
        /* Any split, copy or not, cache-bypassing or not (destinations 32-byte aligned or
         * 8 bytes off), gives the same sum, and the copy is exact. */
        b = b0 + (trial / 3 % 2) * 8;
        pkv_xfer_sum_init(&s);
        memset(b, 0, N);
        for (size_t off = 0; off < N;) {
            size_t k = 1 + pkv_test_below(&seed, 5000);
            if (trial % 3 == 2 && k > 32) k &= ~(size_t)31; /* mostly aligned runs */
            if (k > N - off) k = N - off;
            if (trial % 3 == 1)
                pkv_xfer_sum_copy(&s, b + off, a + off, k);
            else if (trial % 3 == 2)
                pkv_xfer_sum_copy_nt(&s, b + off, a + off, k);
            else
                pkv_xfer_sum_update(&s, a + off, k), pkv_xfer_copy(b + off, a + off, k);
            off += k;
        }
        pkv_xfer_sum_fence();
        ck_assert_uint_eq(pkv_xfer_sum_final(&s), whole);
        ck_assert_mem_eq(a, b, N);
    }
    /* pkv_xfer_copy writes exactly n bytes, whatever n and the alignments */
    for (size_t n = 0; n < 600; n += 1 + n / 8)
        for (size_t mis = 0; mis < 3; mis++) {
            memset(b0, 0xa5, n + 64);
            pkv_xfer_copy(b0 + mis, a + 5, n);
            ck_assert_mem_eq(b0 + mis, a + 5, n);
            for (size_t i = 0; i < mis; i++) ck_assert_uint_eq(b0[i], 0xa5);
            for (size_t i = mis + n; i < n + 64; i++) ck_assert_uint_eq(b0[i], 0xa5);
        }
    for (int trial = 0; trial < 200; trial++) {
        size_t at = pkv_test_below(&seed, N);
        uint8_t bit = (uint8_t)(1u << pkv_test_below(&seed, 8));
        a[at] ^= bit;
        pkv_xfer_sum_init(&s);
        pkv_xfer_sum_update(&s, a, N);
        ck_assert_uint_ne(pkv_xfer_sum_final(&s), whole);
        a[at] ^= bit;
    }
    /* Swapping two different 8-byte words in the same lane changes the sum. */
    memcpy(b, a, N);
    uint64_t w0, w1;
    memcpy(&w0, b, 8);
    memcpy(&w1, b + 32, 8);
    if (w0 != w1) {
        memcpy(b, &w1, 8);
        memcpy(b + 32, &w0, 8);
        pkv_xfer_sum_init(&s);
        pkv_xfer_sum_update(&s, b, N);
        ck_assert_uint_ne(pkv_xfer_sum_final(&s), whole);
    }
    free(a);
    free(b0);
}
END_TEST

/* The checksum is part of the wire format: a producer and a consumer on different CPUs
 * (one with AVX2, one without) must agree. These values were computed by the original
 * scalar implementation; the vector path must give them bit for bit. */
START_TEST(checksum_matches_recorded_values)
{
    enum { N = 100003 };
    static const struct {
        size_t n;
        uint64_t sum;
    } want[] = {{0, 0x441eff7a3186c896ull},  {1, 0x10e85695929001bdull},
                {31, 0xb03d211a44daf9b8ull}, {32, 0x5e7057debc9c95d5ull},
                {33, 0xe1bf01022c4636a7ull}, {4096, 0xd36de97aee583735ull},
                {N, 0xb9d6bb4b660f0cadull}};
    uint8_t *a = malloc(N), *b = aligned_alloc(64, (N + 1 + 63) / 64 * 64);
    for (size_t i = 0; i < N; i++) a[i] = (uint8_t)(i * 131u + 7u + (i >> 9));
    for (int scalar = 0; scalar < 2; scalar++) { /* the CPU's fastest path, then scalar */
        pkv_xfer_sum_force_scalar(scalar);
        for (size_t k = 0; k < sizeof(want) / sizeof(want[0]); k++) {
            pkv_xfer_sum_t s;
            pkv_xfer_sum_init(&s);
            pkv_xfer_sum_update(&s, a, want[k].n);
            ck_assert_uint_eq(pkv_xfer_sum_final(&s), want[k].sum);
            pkv_xfer_sum_init(&s);
            pkv_xfer_sum_copy(&s, b, a, want[k].n);
            ck_assert_uint_eq(pkv_xfer_sum_final(&s), want[k].sum);
            for (size_t mis = 0; mis < 2; mis++) { /* 32-aligned destination, then not */
                memset(b, 0, N + 1);
                pkv_xfer_sum_init(&s);
                pkv_xfer_sum_copy_nt(&s, b + mis, a, want[k].n);
                pkv_xfer_sum_fence();
                ck_assert_uint_eq(pkv_xfer_sum_final(&s), want[k].sum);
                ck_assert_mem_eq(b + mis, a, want[k].n);
            }
        }
    }
    pkv_xfer_sum_force_scalar(false);
    free(a);
    free(b);
}
END_TEST

typedef struct {
    int ok, bad;
} corpus_tally_t;

static void replay_wire(const char *name, const uint8_t *buf, size_t n, void *arg)
{
    corpus_tally_t *t = arg;
    pkv_fuzz_wire(buf, n); /* traps on a round-trip violation */
    xf_wire_msg_t m;
    pkv_xfer_handle_t *h = NULL;
    bool decodes =
        xf_wire_decode(buf, n, &m) == PKV_OK || pkv_xfer_handle_decode(buf, n, &h) == PKV_OK;
    pkv_xfer_handle_free(h);
    if (!strncmp(name, "ok-", 3)) {
        ck_assert_msg(decodes, "%s should decode", name);
        t->ok++;
    } else if (!strncmp(name, "bad-", 4)) {
        ck_assert_msg(!decodes, "%s should be rejected", name);
        t->bad++;
    }
}

START_TEST(fuzz_corpus_replays)
{
    corpus_tally_t t = {0, 0};
    uint32_t files =
        pkv_test_corpus_each("XF_WIRE_CORPUS", "tests/fuzz/corpus/wire", replay_wire, &t);
    ck_assert_int_ge(t.ok, 10);
    ck_assert_int_ge(t.bad, 30);
    ck_assert_uint_ge(files, (uint32_t)(t.ok + t.bad));
}
END_TEST

/* v5 READ: a head range and which of reads_total it is round-trip; the encoder refuses and
 * the decoder rejects every bad value: no heads, a range past kv_heads (or wrapping),
 * heads on a release, reads_total 0 or above the cap, read_index not below it, the reserved
 * word. The slice bounds the transfer's size (a slice of a geometry too big whole fits). */
START_TEST(read_heads_and_reads_roundtrip_and_bounds)
{
    uint32_t blocks[] = {4, 5, 9};
    uint8_t buf[512];
    size_t len;
    xf_wire_msg_t m;
    xf_wire_read_t r = sample_read();
    r.geo.kv_heads = 8;
    r.head_lo = 2;
    r.head_n = 3;
    r.reads_total = 8;
    r.read_index = 7;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 3, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_uint_eq(m.u.read.head_lo, 2);
    ck_assert_uint_eq(m.u.read.head_n, 3);
    ck_assert_uint_eq(m.u.read.reads_total, 8);
    ck_assert_uint_eq(m.u.read.read_index, 7);
    ck_assert_uint_eq(m.u.read.n_blocks, 3);
    /* the fields in place (body offsets 100.., after the flags at 96) */
    const size_t at = XF_WIRE_HEADER_BYTES + 100;
    ck_assert_uint_eq(buf[at], 2);
    ck_assert_uint_eq(buf[at + 4], 3);
    ck_assert_uint_eq(buf[at + 8], 8);
    ck_assert_uint_eq(buf[at + 10], 7);
    struct {
        size_t off;
        uint8_t v;
    } bad[] = {
        {at + 4, 0},    /* head_n 0 */
        {at, 6},        /* 6 + 3 > 8 heads */
        {at + 3, 0xff}, /* head_lo wraps */
        {at + 8, 0},    /* reads_total 0 */
        {at + 10, 8},   /* read_index == reads_total */
        {at + 9, 0x04}, /* reads_total 1032 > cap */
        {at + 12, 1},   /* reserved */
    };
    for (size_t i = 0; i < PKV_ARRAY_LEN(bad); i++) {
        uint8_t copy[512];
        memcpy(copy, buf, len);
        copy[bad[i].off] = bad[i].v;
        ck_assert_msg(xf_wire_decode(copy, len, &m) == PKV_ERR_PROTO, "bad %zu", i);
    }
    xf_wire_read_t e = r;
    e.head_n = 0;
    ck_assert_int_eq(xf_wire_encode_read(&e, blocks, 3, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = r;
    e.head_lo = 6;
    ck_assert_int_eq(xf_wire_encode_read(&e, blocks, 3, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = r;
    e.head_lo = UINT32_MAX;
    ck_assert_int_eq(xf_wire_encode_read(&e, blocks, 3, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = r;
    e.reads_total = 0;
    e.read_index = 0;
    ck_assert_int_eq(xf_wire_encode_read(&e, blocks, 3, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = r;
    e.reads_total = XF_WIRE_MAX_READS + 1;
    ck_assert_int_eq(xf_wire_encode_read(&e, blocks, 3, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = r;
    e.read_index = 8;
    ck_assert_int_eq(xf_wire_encode_read(&e, blocks, 3, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    /* a release: no heads, but its place among the reads */
    e = r;
    e.flags = XF_WIRE_READ_RELEASE;
    ck_assert_int_eq(xf_wire_encode_read(&e, NULL, 0, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e.head_lo = e.head_n = 0;
    ck_assert_int_eq(xf_wire_encode_read(&e, NULL, 0, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_uint_eq(m.u.read.reads_total, 8);
    buf[at + 4] = 1; /* a release naming a head */
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    /* the slice's bytes bound the transfer: 16 blocks of every head would be 2^24 chunks of
     * 4 KiB (too many), of one head 2^18 */
    e = sample_read();
    e.geo = (pkv_geometry_t){.layers = 4096,
                             .kv_heads = 64,
                             .head_dim = 128,
                             .block_tokens = 16,
                             .dtype = PKV_DTYPE_F32};
    e.head_n = 64;
    e.chunk_bytes = 4096;
    uint32_t sixteen[16];
    for (uint32_t i = 0; i < 16; i++) sixteen[i] = 100 + i;
    ck_assert_int_eq(xf_wire_encode_read(&e, sixteen, 16, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e.head_lo = 63;
    e.head_n = 1;
    ck_assert_int_eq(xf_wire_encode_read(&e, sixteen, 16, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
}
END_TEST

/* Patch the first little-endian u32 `from` in buf[0..len) to `to`; false if absent. */
static bool patch_u32(uint8_t *buf, size_t len, uint32_t from, uint32_t to)
{
    for (size_t i = 0; i + 4 <= len; i++) {
        uint32_t v;
        memcpy(&v, buf + i, 4);
        if (v == from) {
            memcpy(buf + i, &to, 4);
            return true;
        }
    }
    return false;
}

static xf_wire_hello_t sample_hello(void)
{
    xf_wire_hello_t h;
    memset(&h, 0, sizeof(h));
    h.agent_id = 0x1234;
    snprintf(h.identity, sizeof(h.identity), "prefill-0");
    snprintf(h.layout.model_id, sizeof(h.layout.model_id), "llama-3.2-1b");
    h.layout.geo = (pkv_geometry_t){
        .layers = 16, .kv_heads = 8, .head_dim = 64, .block_tokens = 16, .dtype = PKV_DTYPE_BF16};
    h.layout.tp = 2;
    h.layout.rank = 1;
    h.layout.head_lo = 4;
    h.layout.head_n = 4;
    h.layout.wire = XF_WIRE_VERSION;
    return h;
}

/* int8 goes on the wire with its row format (2: eight lane-group scales) in the dtype word:
 * READ and HELLO round-trip it, and the plain int8 code of a format-1 agent is refused
 * (PROTO), so two agents of different int8 formats never read each other's rows. */
START_TEST(int8_carries_its_row_format)
{
    uint8_t buf[512];
    size_t len;
    xf_wire_msg_t m;
    uint32_t blocks[] = {1, 2};
    xf_wire_read_t r = sample_read();
    r.geo.dtype = PKV_DTYPE_INT8;
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 2, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_int_eq(m.u.read.geo.dtype, PKV_DTYPE_INT8);
    ck_assert(patch_u32(buf, len, 0x203, PKV_DTYPE_INT8));
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    xf_wire_hello_t h = sample_hello();
    h.layout.geo.dtype = PKV_DTYPE_INT8;
    ck_assert_int_eq(xf_wire_encode_hello(&h, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_int_eq(m.u.hello.layout.geo.dtype, PKV_DTYPE_INT8);
    ck_assert(patch_u32(buf, len, 0x203, PKV_DTYPE_INT8));
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
    /* fp8 carries no revision: one there is refused too */
    ck_assert_int_eq(xf_wire_encode_read(&r, blocks, 2, buf, sizeof(buf), &len), PKV_OK);
    ck_assert(patch_u32(buf, len, 0x203, PKV_DTYPE_FP8 | 2u << 8));
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_ERR_PROTO);
}
END_TEST

/* v5 HELLO: the layout descriptor round-trips; every bad value is refused by the encoder
 * and rejected by the decoder (model id too long or unprintable, geometry, tp 0 or above
 * the cap, rank >= tp, no heads, heads past kv_heads, another wire version, the reserved
 * word, lengths that lie). */
START_TEST(hello_layout_roundtrip_and_bounds)
{
    uint8_t buf[256];
    size_t len;
    xf_wire_msg_t m;
    xf_wire_hello_t h = sample_hello();
    ck_assert_int_eq(xf_wire_encode_hello(&h, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_uint_eq(len, XF_WIRE_HEADER_BYTES + 56 + 9 + 12);
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_uint_eq(m.type, XF_WIRE_HELLO);
    ck_assert_str_eq(m.u.hello.identity, "prefill-0");
    ck_assert_str_eq(m.u.hello.layout.model_id, "llama-3.2-1b");
    ck_assert(!memcmp(&m.u.hello.layout.geo, &h.layout.geo, sizeof(h.layout.geo)));
    ck_assert_uint_eq(m.u.hello.layout.tp, 2);
    ck_assert_uint_eq(m.u.hello.layout.rank, 1);
    ck_assert_uint_eq(m.u.hello.layout.head_lo, 4);
    ck_assert_uint_eq(m.u.hello.layout.head_n, 4);
    ck_assert_uint_eq(m.u.hello.layout.wire, XF_WIRE_VERSION);
    ck_assert_int_eq(xf_wire_encode_hello(&h, buf, len - 1, &len), PKV_ERR_NOSPACE);
    ck_assert_int_eq(xf_wire_encode_hello(&h, buf, sizeof(buf), &len), PKV_OK);
    /* bytes at body offsets: 10 model_len, 12 reserved, 16.. geometry, 36 tp, 40 rank,
     * 44 head_lo, 48 head_n, 52 wire */
    const size_t b = XF_WIRE_HEADER_BYTES;
    struct {
        size_t off;
        uint8_t v;
    } bad[] = {
        {b + 10, 13}, {b + 10, 64}, {b + 12, 1},     {b + 16, 0}, {b + 32, 5},
        {b + 36, 0},  {b + 36, 65}, {b + 40, 2},     {b + 48, 0}, {b + 44, 5},
        {b + 52, 4},  {b + 52, 6},  {len - 1, 0x7f}, /* the model id's last character */
    };
    for (size_t i = 0; i < PKV_ARRAY_LEN(bad); i++) {
        uint8_t copy[256];
        memcpy(copy, buf, len);
        copy[bad[i].off] = bad[i].v;
        ck_assert_msg(xf_wire_decode(copy, len, &m) == PKV_ERR_PROTO, "bad %zu", i);
    }
    xf_wire_hello_t e = sample_hello();
    memset(e.layout.model_id, 'm', sizeof(e.layout.model_id)); /* no NUL: 64 characters */
    ck_assert_int_eq(xf_wire_encode_hello(&e, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = sample_hello();
    e.layout.model_id[3] = '\n';
    ck_assert_int_eq(xf_wire_encode_hello(&e, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = sample_hello();
    e.layout.tp = 0;
    ck_assert_int_eq(xf_wire_encode_hello(&e, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = sample_hello();
    e.layout.tp = XF_WIRE_MAX_TP + 1;
    ck_assert_int_eq(xf_wire_encode_hello(&e, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = sample_hello();
    e.layout.rank = 2;
    ck_assert_int_eq(xf_wire_encode_hello(&e, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = sample_hello();
    e.layout.head_n = 0;
    ck_assert_int_eq(xf_wire_encode_hello(&e, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = sample_hello();
    e.layout.head_lo = UINT32_MAX;
    ck_assert_int_eq(xf_wire_encode_hello(&e, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = sample_hello();
    e.layout.wire = XF_WIRE_VERSION - 1;
    ck_assert_int_eq(xf_wire_encode_hello(&e, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    e = sample_hello();
    e.layout.geo.head_dim = 0;
    ck_assert_int_eq(xf_wire_encode_hello(&e, buf, sizeof(buf), &len), PKV_ERR_INVALID);
    /* replicated heads (tp above kv_heads): one head a rank, valid */
    e = sample_hello();
    e.layout.geo.kv_heads = 2;
    e.layout.tp = 8;
    e.layout.rank = 7;
    e.layout.head_lo = 1;
    e.layout.head_n = 1;
    ck_assert_int_eq(xf_wire_encode_hello(&e, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    /* FAIL why LAYOUT (v5) */
    xf_wire_fail_t f = {
        .xfer_id = 3, .request_id = 4, .reason = PKV_ERR_REJECTED, .why = XF_WIRE_WHY_LAYOUT};
    snprintf(f.text, sizeof(f.text), "layout");
    ck_assert_int_eq(xf_wire_encode_fail(&f, buf, sizeof(buf), &len), PKV_OK);
    ck_assert_int_eq(xf_wire_decode(buf, len, &m), PKV_OK);
    ck_assert_uint_eq(m.u.fail.why, XF_WIRE_WHY_LAYOUT);
    f.why = XF_WIRE_WHY_MAX + 1;
    ck_assert_int_eq(xf_wire_encode_fail(&f, buf, sizeof(buf), &len), PKV_ERR_INVALID);
}
END_TEST

static Suite *wire_suite(void)
{
    Suite *s = suite_create("xfer_wire");
    TCase *tc = tcase_create("wire");
    tcase_add_test(tc, read_roundtrip_coalesces_runs);
    tcase_add_test(tc, every_truncation_is_rejected);
    tcase_add_test(tc, versions_and_types_are_checked);
    tcase_add_test(tc, read_limits_are_enforced);
    tcase_add_test(tc, shared_data_and_read_flags);
    tcase_add_test(tc, data_layers_only_with_shared);
    tcase_add_test(tc, shared_data_for_every_layer);
    tcase_add_test(tc, fail_carries_reason_and_text);
    tcase_add_test(tc, other_versions_are_peeked_and_their_fail_decodes);
    tcase_add_test(tc, handle_roundtrip_and_rejects);
    tcase_add_test(tc, checksum_streams_and_detects_flips);
    tcase_add_test(tc, checksum_matches_recorded_values);
    tcase_add_test(tc, fuzz_corpus_replays);
    tcase_add_test(tc, blocks_digest_covers_ids_order_and_count);
    tcase_add_test(tc, read_heads_and_reads_roundtrip_and_bounds);
    tcase_add_test(tc, hello_layout_roundtrip_and_bounds);
    tcase_add_test(tc, int8_carries_its_row_format);
    suite_add_tcase(s, tc);
    return s;
}
PKV_TEST_MAIN(wire_suite)
