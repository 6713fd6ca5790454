/* The llama2.c checkpoint loader's fuzz properties (see tests/fuzz/props.h,
 * fuzz_checkpoint.c).
 *
 * The input is a checkpoint file, loaded through pkv_model_load_llama2c from a memfd.
 * A reference reading of the format (src/model/llama2c.c's header comment) says whether
 * the file is valid; the loader must agree: PKV_OK exactly for valid files, otherwise
 * PKV_ERR_CORRUPT (never a crash, a leak or another status). A loaded model is checked
 * against the file: its configuration equals the header, and every tensor holds the
 * file's floats, transposed where the model keeps input-major rows. */
#include "props.h"

#include "model/model_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) abort();                                                                      \
    } while (0)

typedef struct {
    int32_t dim, hidden, layers, heads, kv_heads, vocab, seq; /* vocab < 0: unshared */
} ckpt_header_t;

static int32_t rd_i32(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The reference: is this a valid version-0 checkpoint? Fills *h when it is. */
static bool ckpt_valid(const uint8_t *d, size_t n, ckpt_header_t *h)
{
    if (n < 28) return false;
    int32_t f[7];
    for (int i = 0; i < 7; i++) f[i] = rd_i32(d + 4 * i);
    static const int64_t max[7] = {65536, 262144, 1024, 1024, 1024, 1 << 22, 1 << 22};
    for (int i = 0; i < 7; i++) {
        int64_t v = i == 5 && f[i] < 0 ? -(int64_t)f[i] : f[i];
        if (v < 1 || v > max[i]) return false;
    }
    *h = (ckpt_header_t){f[0], f[1], f[2], f[3], f[4], f[5], f[6]};
    if (h->dim % h->heads || h->heads % h->kv_heads || (h->dim / h->heads) % 2) return false;
    uint64_t D = (uint64_t)h->dim, H = (uint64_t)h->hidden, L = (uint64_t)h->layers;
    uint64_t V = (uint64_t)(h->vocab < 0 ? -h->vocab : h->vocab), hs = D / (uint64_t)h->heads;
    uint64_t kvd = (uint64_t)h->kv_heads * hs;
    uint64_t floats = V * D + L * D + L * D * D + 2 * L * kvd * D + L * D * D + L * D +
                      3 * L * H * D + D + (uint64_t)h->seq * hs + (h->vocab < 0 ? V * D : 0);
    if ((uint64_t)n != 28 + 4 * floats) return false;
    for (size_t i = 28; i < n; i += 4) {
        float w;
        memcpy(&w, d + i, 4);
        if (!isfinite(w)) return false;
    }
    return true;
}

/* src (rows, cols) of the file, row-major, equals dst read as dst[c * ld + r]
 * (transposed) or dst[r * cols + c] (ld 0: copied as is). Advances *src. */
static void same_tensor(const float **src, const float *dst, size_t rows, size_t cols, size_t ld)
{
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++)
            FUZZ_CHECK((*src)[r * cols + c] == (ld ? dst[c * ld + r] : dst[r * cols + c]));
    *src += rows * cols;
}

static void check_model(const pkv_model_t *m, const ckpt_header_t *h, const uint8_t *d, size_t n)
{
    const pkv_model_config_t *c = pkv_model_config(m);
    size_t D = (size_t)h->dim, H = (size_t)h->hidden, L = (size_t)h->layers;
    size_t V = (size_t)(h->vocab < 0 ? -h->vocab : h->vocab), hs = D / (size_t)h->heads;
    size_t kvd = (size_t)h->kv_heads * hs, nf = (n - 28) / 4;
    FUZZ_CHECK(c->dim == D && c->hidden_dim == H && c->n_layers == L && c->vocab_size == V);
    FUZZ_CHECK(c->n_heads == (uint32_t)h->heads && c->n_kv_heads == (uint32_t)h->kv_heads);
    FUZZ_CHECK(c->head_dim == hs && c->max_seq_len == (uint32_t)h->seq);
    float *w = malloc(nf * sizeof(float) + 1); /* the file's floats, aligned */
    FUZZ_CHECK(w);
    memcpy(w, d + 28, nf * sizeof(float));
    const float *p = w, *emb = w;
    same_tensor(&p, m->emb, V, D, 0);
    for (size_t l = 0; l < L; l++) same_tensor(&p, m->layers[l].rms_att, 1, D, 0);
    for (size_t l = 0; l < L; l++) same_tensor(&p, m->layers[l].wqkv, D, D, m->ld_qkv);
    for (size_t l = 0; l < L; l++) same_tensor(&p, m->layers[l].wqkv + D, kvd, D, m->ld_qkv);
    for (size_t l = 0; l < L; l++) same_tensor(&p, m->layers[l].wqkv + D + kvd, kvd, D, m->ld_qkv);
    for (size_t l = 0; l < L; l++) same_tensor(&p, m->layers[l].wo, D, D, m->ld_d);
    for (size_t l = 0; l < L; l++) same_tensor(&p, m->layers[l].rms_ffn, 1, D, 0);
    for (size_t l = 0; l < L; l++) same_tensor(&p, m->layers[l].w13, H, D, m->ld_h2);
    for (size_t l = 0; l < L; l++) same_tensor(&p, m->layers[l].w2, D, H, m->ld_d);
    for (size_t l = 0; l < L; l++) same_tensor(&p, m->layers[l].w13 + H, H, D, m->ld_h2);
    same_tensor(&p, m->rms_final, 1, D, 0);
    p += (size_t)h->seq * hs; /* freq_cis: unused */
    const float *cls = h->vocab > 0 ? emb : p;
    same_tensor(&cls, m->wcls, V, D, m->ld_v);
    FUZZ_CHECK((size_t)((h->vocab > 0 ? p : cls) - w) == nf);
    free(w);
}

int pkv_fuzz_checkpoint(const uint8_t *data, size_t size)
{
    int fd = memfd_create("pkv-fuzz-checkpoint", MFD_CLOEXEC);
    FUZZ_CHECK(fd >= 0);
    for (size_t off = 0; off < size;) {
        ssize_t w = write(fd, data + off, size - off);
        FUZZ_CHECK(w > 0);
        off += (size_t)w;
    }
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    /* one thread and a small chunk: the scratch stays small, no pool thread per input */
    pkv_model_runtime_t rt = {.threads = 1, .chunk_tokens = 4};
    pkv_model_t *m = NULL;
    pkv_fuzz_quiet_logs(true);
    int rc = pkv_model_load_llama2c(path, &rt, &m);
    pkv_fuzz_quiet_logs(false);
    close(fd);
    ckpt_header_t h = {0};
    bool valid = ckpt_valid(data, size, &h);
    FUZZ_CHECK(rc == (valid ? PKV_OK : PKV_ERR_CORRUPT));
    FUZZ_CHECK((rc == PKV_OK) == (m != NULL));
    if (m) check_model(m, &h, data, size);
    pkv_model_destroy(m);
    return rc;
}
