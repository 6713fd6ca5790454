/*
 * What a transfer-harness case is and what it must yield (see xfer_harness.h): the fault
 * cases' names, the outcomes each allows, which side survives to report, a small case's
 * defaults, and the seeded data pattern every byte is checked against.
 */
#include "support/xfer_harness.h"

#include "core/core.h"

#include <stdlib.h>
#include <string.h>

static const char *const fault_names[XH_NFAULTS] = {
    [XH_NONE] = "none",
    [XH_PRODUCER_KILLED_BEFORE] = "producer killed before data",
    [XH_PRODUCER_KILLED_DURING] = "producer killed during data",
    [XH_PRODUCER_KILLED_AFTER] = "producer killed after data",
    [XH_CONSUMER_KILLED_DURING] = "consumer killed during data",
    [XH_PRODUCER_STOPPED] = "producer SIGSTOPped",
    [XH_STAGING_FULL_CONSUMER] = "staging exhausted (consumer)",
    [XH_STAGING_FULL_PRODUCER] = "staging exhausted (producer)",
    [XH_NOFIT_CONSUMER] = "staging too small (consumer)",
    [XH_NOFIT_PRODUCER] = "staging too small (producer)",
    [XH_DEADLINE] = "deadline expiry",
    [XH_WRONG_TOKEN] = "wrong token",
    [XH_UNKNOWN_REQUEST] = "unknown request",
    [XH_CORRUPT] = "corrupted payload",
    [XH_SHUTDOWN_CONSUMER] = "shutdown mid-transfer (consumer)",
    [XH_SHUTDOWN_PRODUCER] = "shutdown mid-transfer (producer)",
    [XH_CANCEL] = "cancel mid-transfer",
    [XH_CONSUMER_STOPPED] = "consumer SIGSTOPped",
    [XH_PRODUCER_KILLED_STAGING] = "producer killed while staging",
    [XH_FORGED] = "forged payload (MAC without the token)",
};

const char *xh_fault_name(xh_fault_t f)
{
    return f < XH_NFAULTS ? fault_names[f] : "?";
}

bool xh_outcome_expected(const xh_case_t *c, int oc)
{
    switch (c->fault) {
    case XH_NONE:
        return oc == PKV_OK;
    case XH_PRODUCER_KILLED_BEFORE:
    case XH_PRODUCER_KILLED_DURING:
    case XH_PRODUCER_KILLED_STAGING:
    case XH_PRODUCER_STOPPED:
    case XH_SHUTDOWN_PRODUCER:
        return oc == PKV_ERR_PEER_LOST;
    /* The producer dies after its last chunk left (its DATAs may still be queued in its
     * UCX) and before the ACK: the consumer may store every byte first (ok, and
     * check_accounting / fault_check then compare every byte) or see the death first
     * (peer_lost). Both are right; what it must never do is end ok with wrong bytes. */
    case XH_PRODUCER_KILLED_AFTER:
        return oc == PKV_OK || oc == PKV_ERR_PEER_LOST;
    case XH_CONSUMER_KILLED_DURING:
    case XH_CONSUMER_STOPPED:
        return false; /* the consumer reports nothing */
    /* Shared arena: the consumer copies from the producer's staging and needs none. */
    case XH_STAGING_FULL_CONSUMER:
        return oc == (c->shared ? PKV_OK : PKV_ERR_TIMEOUT);
    case XH_NOFIT_CONSUMER:
        return oc == (c->shared ? PKV_OK : PKV_ERR_NOFIT);
    case XH_STAGING_FULL_PRODUCER:
    case XH_DEADLINE:
        return oc == PKV_ERR_TIMEOUT;
    case XH_NOFIT_PRODUCER:
        return oc == PKV_ERR_NOFIT;
    case XH_WRONG_TOKEN:
    case XH_UNKNOWN_REQUEST:
        return oc == PKV_ERR_REJECTED;
    case XH_CORRUPT:
    case XH_FORGED:
        return oc == PKV_ERR_CORRUPT;
    case XH_SHUTDOWN_CONSUMER:
        return oc == PKV_ERR_SHUTDOWN;
    case XH_CANCEL:
        return oc == PKV_ERR_CANCELLED;
    default:
        return false;
    }
}

bool xh_producer_reports(xh_fault_t f)
{
    return f != XH_PRODUCER_KILLED_BEFORE && f != XH_PRODUCER_KILLED_DURING &&
           f != XH_PRODUCER_KILLED_AFTER && f != XH_PRODUCER_STOPPED &&
           f != XH_PRODUCER_KILLED_STAGING;
}

bool xh_consumer_reports(xh_fault_t f)
{
    return f != XH_CONSUMER_KILLED_DURING && f != XH_CONSUMER_STOPPED;
}

void xh_case_default(xh_case_t *c)
{
    memset(c, 0, sizeof(*c));
    c->geo = (pkv_geometry_t){
        .layers = 8, .kv_heads = 2, .head_dim = 64, .block_tokens = 16, .dtype = PKV_DTYPE_F16};
    c->n_tokens = 512; /* 32 blocks of 64 KiB: 2 MiB, 256 KiB per layer */
    c->n_requests = 1;
    c->chunk_bytes = 0; /* the agent's default */
    c->page_bytes = 64 << 10;
    c->deadline_ms = 4000;
    c->seed = 1;
}

/* ---- the data pattern ----------------------------------------------------------------- */
/* Bytes of one head row (K or V) of position pos in layer l of request r. */
static void pattern_row(uint64_t seed, uint32_t r, uint32_t pos, uint32_t l, uint32_t kv,
                        uint32_t h, uint8_t *out, size_t n)
{
    uint64_t s = seed ^ ((uint64_t)r << 48) ^ ((uint64_t)pos << 20) ^ ((uint64_t)l << 8) ^
                 ((uint64_t)kv << 7) ^ h;
    pkv_splitmix64(&s);
    for (size_t i = 0; i < n; i += 8) {
        uint64_t w = pkv_splitmix64(&s);
        memcpy(out + i, &w, PKV_MIN((size_t)8, n - i));
    }
}

uint32_t xh_pattern_apply(pkv_seq_t *seq, const pkv_geometry_t *g, uint64_t seed, uint32_t r,
                          uint32_t n_tokens, bool fill)
{
    size_t row = pkv_dtype_row_bytes(g->dtype, g->head_dim);
    uint8_t *buf = malloc(row);
    uint32_t bad = 0;
    for (uint32_t pos = 0; pos < n_tokens; pos++) {
        bool pos_bad = false;
        for (uint32_t l = 0; l < g->layers; l++) {
            void *k, *v;
            size_t hs;
            pkv_seq_slot(seq, pos, l, &k, &v, &hs);
            for (uint32_t kv = 0; kv < 2; kv++) {
                uint8_t *base = kv ? v : k;
                for (uint32_t h = 0; h < g->kv_heads; h++) {
                    uint8_t *dst = base + (size_t)h * hs;
                    pattern_row(seed, r, pos, l, kv, h, buf, row);
                    if (fill)
                        memcpy(dst, buf, row);
                    else if (memcmp(dst, buf, row))
                        pos_bad = true;
                }
            }
        }
        bad += pos_bad;
    }
    free(buf);
    return bad;
}
