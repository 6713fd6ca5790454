/* The xfer wire decoder's fuzz properties (see tests/fuzz/props.h, fuzz_wire.c). */
#include "props.h"

#include "xfer/wire.h"

#include <stdlib.h>
#include <string.h>

#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) __builtin_trap();                                                             \
    } while (0)

static void expand_runs(const xf_wire_read_t *r, uint32_t *out)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < r->n_runs; i++) {
        uint32_t first, count;
        xf_wire_read_run(r, i, &first, &count);
        for (uint32_t j = 0; j < count; j++) out[k++] = first + j;
    }
}

static void check_roundtrip(const uint8_t *data, size_t size, const xf_wire_msg_t *m)
{
    size_t cap = size + 64, len = 0;
    uint8_t *buf = malloc(cap);
    FUZZ_CHECK(buf);
    int rc = PKV_ERR_INVALID;
    uint32_t *blocks = NULL;
    switch (m->type) {
    case XF_WIRE_READ:
        blocks = malloc(sizeof(uint32_t) * (m->u.read.n_blocks ? m->u.read.n_blocks : 1));
        FUZZ_CHECK(blocks);
        expand_runs(&m->u.read, blocks);
        rc = xf_wire_encode_read(&m->u.read, blocks, m->u.read.n_blocks, buf, cap, &len);
        break;
    case XF_WIRE_DATA: {
        const xf_wire_data_t *d = &m->u.data;
        uint32_t n = 2 * d->n_pieces;
        uint64_t *items = n ? malloc(8 * (size_t)n) : NULL;
        FUZZ_CHECK(!n || items);
        for (uint32_t i = 0; i < d->n_pieces; i++)
            xf_wire_data_piece(d, i, &items[2 * i], &items[2 * i + 1]);
        rc = xf_wire_encode_data(d, d->n_pieces ? items : NULL, d->n_pieces,
                                 d->n_macs ? xf_wire_data_mac(d, 0) : NULL, d->n_macs, buf, cap,
                                 &len);
        free(items);
        break;
    }
    case XF_WIRE_HELLO:
        rc = xf_wire_encode_hello(&m->u.hello, buf, cap, &len);
        break;
    case XF_WIRE_ACK:
        rc = xf_wire_encode_ack(&m->u.ack, buf, cap, &len);
        break;
    case XF_WIRE_FAIL:
        rc = xf_wire_encode_fail(&m->u.fail, buf, cap, &len);
        break;
    case XF_WIRE_CLOSE:
        rc = xf_wire_encode_close(&m->u.close, buf, cap, &len);
        break;
    case XF_WIRE_HEARTBEAT:
        rc = xf_wire_encode_heartbeat(&m->u.hb, buf, cap, &len);
        break;
    default:
        FUZZ_CHECK(0);
    }
    FUZZ_CHECK(rc == PKV_OK); /* whatever we accept we can also send */
    xf_wire_msg_t m2;
    FUZZ_CHECK(xf_wire_decode(buf, len, &m2) == PKV_OK);
    FUZZ_CHECK(m2.type == m->type);
    if (m->type == XF_WIRE_READ) {
        const xf_wire_read_t *x = &m->u.read, *y = &m2.u.read;
        FUZZ_CHECK(x->xfer_id == y->xfer_id && x->request_id == y->request_id);
        FUZZ_CHECK(!memcmp(x->token, y->token, sizeof(x->token)));
        FUZZ_CHECK(!memcmp(x->nonce, y->nonce, sizeof(x->nonce)) && x->flags == y->flags);
        FUZZ_CHECK(!memcmp(x->digest, y->digest, sizeof(x->digest)));
        FUZZ_CHECK(x->budget_ns == y->budget_ns && x->chunk_bytes == y->chunk_bytes);
        FUZZ_CHECK(!memcmp(&x->geo, &y->geo, sizeof(x->geo)));
        FUZZ_CHECK(x->n_blocks == y->n_blocks && y->n_runs <= x->n_runs);
        uint32_t *b2 = malloc(sizeof(uint32_t) * y->n_blocks);
        FUZZ_CHECK(b2);
        expand_runs(y, b2);
        FUZZ_CHECK(!memcmp(blocks, b2, sizeof(uint32_t) * y->n_blocks));
        free(b2);
    } else {
        /* Fixed layouts and canonical text: the bytes themselves must match, but for the
         * version (a FAIL or CLOSE of any version decodes; we send ours). */
        FUZZ_CHECK(len == size && !memcmp(buf, data, 4) && !memcmp(buf + 5, data + 5, size - 5));
        FUZZ_CHECK(data[4] == XF_WIRE_VERSION || m->type == XF_WIRE_FAIL ||
                   m->type == XF_WIRE_CLOSE);
    }
    free(blocks);
    free(buf);
}

void pkv_fuzz_wire(const uint8_t *data, size_t size)
{
    xf_wire_msg_t m;
    bool ours = xf_wire_decode(data, size, &m) == PKV_OK;
    if (ours) check_roundtrip(data, size, &m);
    xf_wire_foreign_t f;
    if (xf_wire_peek_foreign(data, size, &f) == PKV_OK) {
        /* another version's: never one we decode, but a FAIL or a CLOSE */
        FUZZ_CHECK(f.version != 0 && f.version != XF_WIRE_VERSION && f.version == data[4]);
        FUZZ_CHECK(!ours || f.type == XF_WIRE_FAIL || f.type == XF_WIRE_CLOSE);
        FUZZ_CHECK(f.xfer_id < (1ull << XF_WIRE_XFER_ID_BITS));
    }

    pkv_xfer_handle_t *h = NULL;
    if (pkv_xfer_handle_decode(data, size, &h) == PKV_OK) {
        size_t need = pkv_xfer_handle_bytes(h), len = 0;
        FUZZ_CHECK(need == size);
        uint8_t *buf = malloc(need);
        FUZZ_CHECK(buf);
        FUZZ_CHECK(pkv_xfer_handle_encode(h, buf, need, &len) == PKV_OK);
        FUZZ_CHECK(len == size && !memcmp(buf, data, size));
        free(buf);
        pkv_xfer_handle_free(h);
    }
}
