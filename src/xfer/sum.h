/*
 * xfer payload checksum (part of the module interface through xfer/xfer.h, which is what
 * other modules include): a Fletcher-style sum over 64-bit words in four
 * interleaved lanes, fused with the copy that moves the bytes anyway (pool <-> staging),
 * so verifying costs little beyond the copy. It detects every single-word change and
 * reorderings of words; it is an integrity check, not a MAC (the token guards access).
 *
 * Streaming: update() over any split of a byte stream gives the same result as one
 * update() over the whole, so producer and consumer may cut a layer differently.
 */
#ifndef PKV_XFER_SUM_H
#define PKV_XFER_SUM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t a[4], b[4]; /* lane sums and sums of sums */
    uint64_t total;      /* bytes consumed */
    uint8_t carry[32];   /* bytes of an incomplete 32-byte group */
    uint32_t ncarry;
} pkv_xfer_sum_t;

void pkv_xfer_sum_init(pkv_xfer_sum_t *s);
void pkv_xfer_sum_update(pkv_xfer_sum_t *s, const void *p, size_t n);
/* memcpy(dst, src, n) and update(s, src, n) in one pass. */
void pkv_xfer_sum_copy(pkv_xfer_sum_t *s, void *dst, const void *src, size_t n);
/* The same, storing around the cache where it can (dst is not read again soon: a pool
 * block being filled). Those stores are weakly ordered: call pkv_xfer_sum_fence() before
 * telling anyone (another thread, process or a UCX send) that the bytes are there. */
void pkv_xfer_sum_copy_nt(pkv_xfer_sum_t *s, void *dst, const void *src, size_t n);
/* memcpy(dst, src, n) (no overlap), through vector registers where the CPU has AVX2: for
 * copies out of a peer's staging. glibc 2.36 copies more than 2112 bytes with `rep movsb`
 * (its x86_rep_movsb_threshold on this AMD EPYC); a consumer's 4 KiB copies out of the
 * shared arena ran at about half the rate of this loop there (docs/design/xfer.md). */
void pkv_xfer_copy(void *dst, const void *src, size_t n);
/* Order every copy_nt store before the stores that follow (an sfence). */
void pkv_xfer_sum_fence(void);
uint64_t pkv_xfer_sum_final(const pkv_xfer_sum_t *s);
/* Tests: use the scalar loop even where the CPU has AVX2 (the two must agree). Not
 * thread-safe: call before any sum runs. */
void pkv_xfer_sum_force_scalar(bool on);

#endif
