/*
 * xfer payload authentication (internal to src/xfer): a one-time Poly1305 tag over each
 * layer's bytes in stream order, under keys only the two ends of a transfer can derive.
 *
 *   K        = HMAC-SHA256(token, "pagekv-xfer-v5" || nonce[16] || request_id (u64 LE) ||
 *                          n_blocks (u32 LE) || layers (u32 LE) || head_lo (u32 LE) ||
 *                          head_n (u32 LE))
 *   keys     = ChaCha20(K, counter 0, iv 0) keystream, 32 bytes a layer: layer l's
 *              Poly1305 key (r || s) is bytes [32 l, 32 l + 32)
 *   tag[l]   = Poly1305(keys[l], the layer's stream bytes)
 *
 * The token is the registration's 128-bit secret; the nonce is drawn by the consumer for
 * every read (unique per read: a random agent prefix and a counter) and travels in READ,
 * so no two reads share a key and no Poly1305 key ever signs two messages. The head range
 * is bound too: a slice's bytes cannot pass as another slice's. A party that
 * can put bytes into a read's receives (a peer that guessed its xfer id) but does not
 * hold the token cannot produce a tag the consumer accepts.
 *
 * Contexts are per thread (the progress thread and each copy worker own one): OpenSSL
 * contexts are not shared between threads.
 *
 * Part of the module interface (xfer/xfer.h includes it): the lean pull
 * (support/lean_pull.c) moves its reference flow with the same keys, MAC and copy loops,
 * so its figure is the bound of a flow that must MAC.
 */
#ifndef PKV_XFER_MAC_H
#define PKV_XFER_MAC_H

#include "pagekv/xfer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define XF_MAC_TAG_BYTES   16u
#define XF_MAC_KEY_BYTES   32u
#define XF_MAC_NONCE_BYTES 16u

typedef struct xf_mac xf_mac_t;

/* One thread's contexts: Poly1305, HMAC-SHA256 and ChaCha20. NULL: out of memory or the
 * provider lacks an algorithm (logged). */
xf_mac_t *xf_mac_create(void);
void xf_mac_destroy(xf_mac_t *m);

/* Derive the per-layer keys of one transfer into keys[0 .. 32 * layers). PKV_OK or
 * PKV_ERR_IO (an OpenSSL failure). */
int xf_mac_keys(xf_mac_t *m, const uint8_t token[PKV_XFER_TOKEN_BYTES],
                const uint8_t nonce[XF_MAC_NONCE_BYTES], uint64_t request_id, uint32_t n_blocks,
                uint32_t layers, uint32_t head_lo, uint32_t head_n, uint8_t *keys);

/* One tag: begin with a layer's key, update over its bytes in stream order (any split),
 * end. xf_mac_end is false when OpenSSL failed anywhere in between (the tag is then
 * zeroed and must not be trusted: a consumer ends the read corrupt). */
void xf_mac_begin(xf_mac_t *m, const uint8_t key[XF_MAC_KEY_BYTES]);
void xf_mac_update(xf_mac_t *m, const void *p, size_t n);
bool xf_mac_end(xf_mac_t *m, uint8_t tag[XF_MAC_TAG_BYTES]);

/* Bytes copied, then MACed, at a time: the MAC reads them while they are in L1. */
#define XF_MAC_STEP 4096u

/* dst <- src (n bytes) with the source's bytes MACed into the current tag in stream order,
 * XF_MAC_STEP bytes at a time right after they were copied (the producer's staging copy:
 * the pool is its own). Streaming stores when `nt`: the caller fences
 * (pkv_xfer_sum_fence) before anyone is told the bytes are there. */
void xf_mac_copy(xf_mac_t *m, void *dst, const void *src, size_t n, bool nt);

/* dst <- src (n bytes) through an L1 bounce buffer, MACing the bounced bytes: what is MACed
 * is exactly what is stored even while another process writes src (a peer's shared
 * arena). Streaming stores into dst (fence as above). */
void xf_mac_copy_in(xf_mac_t *m, void *dst, const void *src, size_t n);

/* Constant-time tag comparison. */
bool xf_mac_equal(const uint8_t *x, const uint8_t *y);

#endif
