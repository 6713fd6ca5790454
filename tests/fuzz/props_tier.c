/* The disk tier's segment parser's fuzz properties (see tests/fuzz/props.h, fuzz_tier.c). */
#include "props.h"

#include "tier/tier.h"

#include <stdlib.h>
#include <string.h>

#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) __builtin_trap();                                                             \
    } while (0)

/* Whatever the bytes, the parser returns entries that lie back to back from offset 0
 * inside the input; a scanned segment's every entry is a record that checks out in full
 * (a sealed one's index is trusted only for where records lie: each load checks its
 * record); re-sealing what was found parses back to the same entries. */
void pkv_fuzz_tier(const uint8_t *data, size_t size)
{
    pkv_tier_seg_info_t in;
    int rc = pkv_tier_seg_parse(data, size, &in);
    FUZZ_CHECK(rc == PKV_OK || rc == PKV_ERR_NOMEM);
    if (rc) return;
    uint64_t at = 0;
    for (uint32_t i = 0; i < in.n; i++) {
        const pkv_tier_entry_t *e = &in.entries[i];
        FUZZ_CHECK(e->offset == at);
        at += PKV_TIER_HEADER_BYTES + (uint64_t)e->payload_len;
        FUZZ_CHECK(at <= size);
        pkv_tier_record_t r;
        int ok = pkv_tier_record_check(data + e->offset, data + e->offset + PKV_TIER_HEADER_BYTES,
                                       e->payload_len, &r);
        if (!in.sealed) {
            FUZZ_CHECK(ok == PKV_OK);
            FUZZ_CHECK(!memcmp(r.key, e->key, PKV_TIER_HASH_BYTES));
            FUZZ_CHECK(!memcmp(r.layout, in.layout, PKV_TIER_HASH_BYTES));
        }
    }
    FUZZ_CHECK(in.sealed ? in.corrupt == 0 : in.corrupt <= 1);
    FUZZ_CHECK(in.sealed || (at == size) == (in.corrupt == 0));
    pkv_tier_seg_info_fini(&in);
}
