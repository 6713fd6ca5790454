/*
 * llama2c: load a karpathy/llama2.c checkpoint (legacy "version 0" export).
 *
 * File layout (little-endian):
 *   int32 dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
 *     (vocab_size < 0 means the classifier is stored separately: "unshared")
 *   f32 token_embedding (vocab, dim)
 *   f32 rms_att (L, dim)
 *   f32 wq (L, dim, dim)          row-major (out, in): out = n_heads * head_size = dim
 *   f32 wk (L, kv_dim, dim)       kv_dim = n_kv_heads * head_size, head_size = dim / n_heads
 *   f32 wv (L, kv_dim, dim)
 *   f32 wo (L, dim, dim)
 *   f32 rms_ffn (L, dim)
 *   f32 w1 (L, hidden, dim)
 *   f32 w2 (L, dim, hidden)
 *   f32 w3 (L, hidden, dim)
 *   f32 rms_final (dim)
 *   f32 freq_cis_real (seq_len, head_size / 2), freq_cis_imag (same)   unused (RoPE is
 *       recomputed with theta 10000, as llama2.c's run.c does)
 *   f32 wcls (vocab, dim)         only when unshared
 * The file size must equal exactly what the header implies. Matrices are transposed
 * into the model's input-major layout while loading.
 */
#include "model/model_int.h"

#include "core/core.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define HEADER_BYTES 28u

/* dst (in, ld) <- transpose of src (out, in). */
static void transpose_into(float *dst, size_t ld, const float *src, size_t out, size_t in)
{
    for (size_t o = 0; o < out; o++)
        for (size_t i = 0; i < in; i++) dst[i * ld + o] = src[o * in + i];
}

/* Validate the header and the size; fills cfg and *shared. */
static int check_header(const char *path, const unsigned char *data, size_t len, size_t have,
                        pkv_model_config_t *cfg, bool *shared)
{
    if (have < HEADER_BYTES || len < HEADER_BYTES) {
        PKV_LOGE("model", "checkpoint %s: %zu bytes, shorter than the %u-byte header", path, len,
                 HEADER_BYTES);
        return PKV_ERR_CORRUPT;
    }
    int32_t h[7];
    memcpy(h, data, sizeof(h));
    static const char *const names[7] = {"dim",        "hidden_dim", "n_layers", "n_heads",
                                         "n_kv_heads", "vocab_size", "seq_len"};
    static const int32_t limits[7] = {65536, 262144, 1024, 1024, 1024, 1 << 22, 1 << 22};
    for (int i = 0; i < 7; i++) {
        int64_t v = i == 5 ? llabs((long long)h[i]) : h[i];
        if (v <= 0 || v > limits[i]) {
            PKV_LOGE("model", "checkpoint %s: header field %s = %d out of range [1, %d]", path,
                     names[i], h[i], limits[i]);
            return PKV_ERR_CORRUPT;
        }
    }
    int32_t dim = h[0], hidden = h[1], L = h[2], nh = h[3], nkv = h[4], seq = h[6];
    int32_t vocab = h[5] < 0 ? -h[5] : h[5];
    if (dim % nh) {
        PKV_LOGE("model", "checkpoint %s: dim %d is not a multiple of n_heads %d", path, dim, nh);
        return PKV_ERR_CORRUPT;
    }
    if (nkv > nh || nh % nkv) {
        PKV_LOGE("model", "checkpoint %s: n_heads %d is not a multiple of n_kv_heads %d", path, nh,
                 nkv);
        return PKV_ERR_CORRUPT;
    }
    int32_t hs = dim / nh;
    if (hs % 2) {
        PKV_LOGE("model", "checkpoint %s: head size %d is odd (RoPE rotates pairs)", path, hs);
        return PKV_ERR_CORRUPT;
    }
    uint64_t D = (uint64_t)dim, H = (uint64_t)hidden, V = (uint64_t)vocab, kvd = (uint64_t)nkv * hs;
    uint64_t floats = V * D + (uint64_t)L * (D + D * D + 2 * kvd * D + D * D + D + 3 * D * H) + D +
                      (uint64_t)seq * (uint64_t)hs + (h[5] < 0 ? V * D : 0);
    uint64_t want = HEADER_BYTES + floats * 4;
    if ((uint64_t)len != want) {
        PKV_LOGE("model",
                 "checkpoint %s: header (dim %d, hidden %d, layers %d, heads %d/%d, vocab %d, "
                 "seq %d) implies %llu bytes, the file has %zu (%s)",
                 path, dim, hidden, L, nh, nkv, h[5], seq, (unsigned long long)want, len,
                 (uint64_t)len < want ? "truncated" : "trailing bytes");
        return PKV_ERR_CORRUPT;
    }
    *cfg = (pkv_model_config_t){.dim = (uint32_t)dim,
                                .hidden_dim = (uint32_t)hidden,
                                .n_layers = (uint32_t)L,
                                .n_heads = (uint32_t)nh,
                                .n_kv_heads = (uint32_t)nkv,
                                .head_dim = (uint32_t)hs,
                                .vocab_size = (uint32_t)vocab,
                                .max_seq_len = (uint32_t)seq,
                                .rope_theta = 10000.0f,
                                .norm_eps = 1e-5f};
    *shared = h[5] > 0;
    return PKV_OK;
}

int pkv_model_load_llama2c(const char *path, const pkv_model_runtime_t *rt, pkv_model_t **out)
{
    if (!path || !out) return PKV_ERR_INVALID;
    FILE *f = fopen(path, "rb");
    if (!f) {
        PKV_LOGE("model", "cannot open checkpoint %s: %s", path, strerror(errno));
        return PKV_ERR_IO;
    }
    int rc = PKV_ERR_IO;
    float *w = NULL;
    pkv_model_t *m = NULL;
    struct stat st;
    if (fstat(fileno(f), &st) || !S_ISREG(st.st_mode)) {
        PKV_LOGE("model", "checkpoint %s is not a regular file", path);
        goto out;
    }
    size_t len = (size_t)st.st_size;
    unsigned char hdr[HEADER_BYTES];
    size_t have = fread(hdr, 1, sizeof(hdr), f);
    pkv_model_config_t cfg;
    bool shared;
    if ((rc = check_header(path, hdr, len, have, &cfg, &shared))) goto out;
    size_t nf = (len - HEADER_BYTES) / 4;
    if (!(w = malloc(nf * sizeof(float)))) {
        PKV_LOGE("model", "checkpoint %s: cannot allocate %zu bytes", path, nf * sizeof(float));
        rc = PKV_ERR_NOMEM;
        goto out;
    }
    if (fread(w, sizeof(float), nf, f) != nf) {
        PKV_LOGE("model", "checkpoint %s: short read", path);
        rc = PKV_ERR_IO;
        goto out;
    }
    /* Weights must be finite: NaN or Inf means a corrupt or foreign file. */
    for (size_t i = 0; i < nf; i++) {
        if (!isfinite(w[i])) {
            PKV_LOGE("model", "checkpoint %s: weight %zu (byte offset %zu) is not finite", path, i,
                     HEADER_BYTES + 4 * i);
            rc = PKV_ERR_CORRUPT;
            goto out;
        }
    }
    if ((rc = model_alloc(&cfg, rt, &m))) goto out;
    size_t D = cfg.dim, H = cfg.hidden_dim, V = cfg.vocab_size, L = cfg.n_layers;
    size_t kvd = m->kvdim, qd = m->qdim;
    const float *p = w;
    memcpy(m->emb, p, V * D * sizeof(float));
    const float *emb = p;
    p += V * D;
    for (size_t l = 0; l < L; l++) memcpy(m->layers[l].rms_att, p + l * D, D * sizeof(float));
    p += L * D;
    for (size_t l = 0; l < L; l++)
        transpose_into(m->layers[l].wqkv, m->ld_qkv, p + l * qd * D, qd, D);
    p += L * qd * D;
    for (size_t l = 0; l < L; l++)
        transpose_into(m->layers[l].wqkv + qd, m->ld_qkv, p + l * kvd * D, kvd, D);
    p += L * kvd * D;
    for (size_t l = 0; l < L; l++)
        transpose_into(m->layers[l].wqkv + qd + kvd, m->ld_qkv, p + l * kvd * D, kvd, D);
    p += L * kvd * D;
    for (size_t l = 0; l < L; l++) transpose_into(m->layers[l].wo, m->ld_d, p + l * D * qd, D, qd);
    p += L * D * qd;
    for (size_t l = 0; l < L; l++) memcpy(m->layers[l].rms_ffn, p + l * D, D * sizeof(float));
    p += L * D;
    for (size_t l = 0; l < L; l++) transpose_into(m->layers[l].w13, m->ld_h2, p + l * H * D, H, D);
    p += L * H * D;
    for (size_t l = 0; l < L; l++) transpose_into(m->layers[l].w2, m->ld_d, p + l * D * H, D, H);
    p += L * D * H;
    for (size_t l = 0; l < L; l++)
        transpose_into(m->layers[l].w13 + H, m->ld_h2, p + l * H * D, H, D);
    p += L * H * D;
    memcpy(m->rms_final, p, D * sizeof(float));
    p += D;
    p += (size_t)cfg.max_seq_len * cfg.head_dim; /* freq_cis real + imag */
    const float *cls = shared ? emb : p;
    if (!shared) p += V * D;
    PKV_ASSERT((size_t)(p - w) == nf);
    transpose_into(m->wcls, m->ld_v, cls, V, D);
    *out = m;
    m = NULL;
    rc = PKV_OK;
out:
    free(w);
    pkv_model_destroy(m);
    fclose(f);
    return rc;
}
