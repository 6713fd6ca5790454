/*
 * xfer payload authentication: see mac.h. Everything goes through OpenSSL 3's EVP
 * interfaces with the algorithms fetched once per context (a fetch costs microseconds,
 * an init with a new key tens of nanoseconds).
 */
#include "xfer/mac.h"

#include "core/core.h"
#include "xfer/sum.h"

#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <stdlib.h>
#include <string.h>

#define XF_MOD "xfer"

struct xf_mac {
    EVP_MAC *poly, *hmac;
    EVP_MAC_CTX *pctx, *hctx;
    EVP_CIPHER *chacha;
    EVP_CIPHER_CTX *cctx;
    bool failed; /* the current tag's computation failed: it ends all-zero */
};

xf_mac_t *xf_mac_create(void)
{
    xf_mac_t *m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    char digest[] = "SHA256";
    OSSL_PARAM prm[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                        OSSL_PARAM_construct_end()};
    m->poly = EVP_MAC_fetch(NULL, "POLY1305", NULL);
    m->hmac = EVP_MAC_fetch(NULL, "HMAC", NULL);
    m->chacha = EVP_CIPHER_fetch(NULL, "ChaCha20", NULL);
    m->pctx = m->poly ? EVP_MAC_CTX_new(m->poly) : NULL;
    m->hctx = m->hmac ? EVP_MAC_CTX_new(m->hmac) : NULL;
    m->cctx = EVP_CIPHER_CTX_new();
    if (!m->pctx || !m->hctx || !m->chacha || !m->cctx || !EVP_MAC_CTX_set_params(m->hctx, prm)) {
        PKV_LOGE(XF_MOD, "OpenSSL lacks Poly1305, HMAC-SHA256 or ChaCha20");
        xf_mac_destroy(m);
        return NULL;
    }
    return m;
}

void xf_mac_destroy(xf_mac_t *m)
{
    if (!m) return;
    EVP_MAC_CTX_free(m->pctx);
    EVP_MAC_CTX_free(m->hctx);
    EVP_CIPHER_CTX_free(m->cctx);
    EVP_MAC_free(m->poly);
    EVP_MAC_free(m->hmac);
    EVP_CIPHER_free(m->chacha);
    free(m);
}

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

int xf_mac_keys(xf_mac_t *m, const uint8_t token[PKV_XFER_TOKEN_BYTES],
                const uint8_t nonce[XF_MAC_NONCE_BYTES], uint64_t request_id, uint32_t n_blocks,
                uint32_t layers, uint32_t head_lo, uint32_t head_n, uint8_t *keys)
{
    static const char label[] = "pagekv-xfer-v5";
    uint8_t info[sizeof(label) - 1 + XF_MAC_NONCE_BYTES + 24], k[32], iv[16] = {0};
    size_t at = sizeof(label) - 1, klen = 0;
    memcpy(info, label, at);
    memcpy(info + at, nonce, XF_MAC_NONCE_BYTES);
    at += XF_MAC_NONCE_BYTES;
    put_le(info + at, request_id, 8);
    put_le(info + at + 8, n_blocks, 4);
    put_le(info + at + 12, layers, 4);
    put_le(info + at + 16, head_lo, 4);
    put_le(info + at + 20, head_n, 4);
    size_t n = (size_t)layers * XF_MAC_KEY_BYTES;
    int outl = 0;
    int ok = EVP_MAC_init(m->hctx, token, PKV_XFER_TOKEN_BYTES, NULL) &&
             EVP_MAC_update(m->hctx, info, sizeof(info)) &&
             EVP_MAC_final(m->hctx, k, &klen, sizeof(k)) && klen == sizeof(k) &&
             EVP_EncryptInit_ex2(m->cctx, m->chacha, k, iv, NULL);
    memset(keys, 0, n);
    /* ChaCha20 over zeros is its keystream (n < 2^17 bytes: fits an int) */
    ok = ok && EVP_EncryptUpdate(m->cctx, keys, &outl, keys, (int)n) && (size_t)outl == n;
    OPENSSL_cleanse(k, sizeof(k));
    if (!ok) {
        PKV_LOGE(XF_MOD, "deriving a transfer's MAC keys failed");
        return PKV_ERR_IO;
    }
    return PKV_OK;
}

void xf_mac_begin(xf_mac_t *m, const uint8_t key[XF_MAC_KEY_BYTES])
{
    m->failed = !EVP_MAC_init(m->pctx, key, XF_MAC_KEY_BYTES, NULL);
}

void xf_mac_update(xf_mac_t *m, const void *p, size_t n)
{
    if (!m->failed && n) m->failed = !EVP_MAC_update(m->pctx, p, n);
}

bool xf_mac_end(xf_mac_t *m, uint8_t tag[XF_MAC_TAG_BYTES])
{
    size_t len = 0;
    if (m->failed || !EVP_MAC_final(m->pctx, tag, &len, XF_MAC_TAG_BYTES) ||
        len != XF_MAC_TAG_BYTES) {
        memset(tag, 0, XF_MAC_TAG_BYTES);
        return false;
    }
    return true;
}

void xf_mac_copy(xf_mac_t *m, void *dst, const void *src, size_t n, bool nt)
{
    pkv_xfer_sum_t sum; /* the copy loops' checksum, not used: the MAC is the check */
    pkv_xfer_sum_init(&sum);
    uint8_t *d = dst;
    const uint8_t *s = src;
    while (n) {
        size_t k = PKV_MIN(n, (size_t)XF_MAC_STEP);
        if (nt)
            pkv_xfer_sum_copy_nt(&sum, d, s, k);
        else
            pkv_xfer_sum_copy(&sum, d, s, k);
        xf_mac_update(m, s, k);
        d += k, s += k, n -= k;
    }
}

void xf_mac_copy_in(xf_mac_t *m, void *dst, const void *src, size_t n)
{
    pkv_xfer_sum_t sum;
    pkv_xfer_sum_init(&sum);
    _Alignas(64) uint8_t bounce[XF_MAC_STEP];
    uint8_t *d = dst;
    const uint8_t *s = src;
    while (n) {
        size_t k = PKV_MIN(n, (size_t)XF_MAC_STEP);
        pkv_xfer_copy(bounce, s, k); /* once out of the shared mapping */
        xf_mac_update(m, bounce, k);
        pkv_xfer_sum_copy_nt(&sum, d, bounce, k);
        d += k, s += k, n -= k;
    }
}

bool xf_mac_equal(const uint8_t *x, const uint8_t *y)
{
    return CRYPTO_memcmp(x, y, XF_MAC_TAG_BYTES) == 0;
}
