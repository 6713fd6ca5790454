/*
 * pagekv bench tokenizer: the builtin tokenizer on 16,000 characters of numbered-sentence
 * filler (support/filler.c, seeded; the serving benchmarks' filler) and
 * optionally on a file: tokens, characters per token, and encode / decode time
 * (median and min of --runs runs, each one full encode of the text).
 */
#include "support/cli.h"
#include "support/filler.h"
#include "tools/commands.h"

#include "core/core.h"
#include "pagekv/tokenizer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

struct text_result {
    size_t chars, tokens;
    double enc_med_ms, enc_min_ms, dec_med_ms;
};

static int bench_text(const pkv_tok_t *tok, const char *text, size_t len, unsigned runs,
                      struct text_result *res)
{
    uint64_t *enc = calloc(runs, sizeof(uint64_t)), *dec = calloc(runs, sizeof(uint64_t));
    int rc = (enc && dec) ? PKV_OK : PKV_ERR_NOMEM;
    size_t n = 0;
    for (unsigned r = 0; r < runs && !rc; r++) {
        int32_t *ids = NULL;
        char *back = NULL;
        size_t blen = 0;
        uint64_t t0 = pkv_now_ns();
        rc = pkv_tok_encode_alloc(tok, text, len, false, &ids, &n);
        uint64_t t1 = pkv_now_ns();
        if (!rc) rc = pkv_tok_decode(tok, ids, n, &back, &blen);
        uint64_t t2 = pkv_now_ns();
        if (!rc && (blen != len || memcmp(back, text, len))) {
            fprintf(stderr, "pagekv bench tokenizer: round trip FAILED\n");
            rc = PKV_ERR_CORRUPT;
        }
        enc[r] = t1 - t0;
        dec[r] = t2 - t1;
        free(ids);
        free(back);
    }
    if (!rc) {
        qsort(enc, runs, sizeof(uint64_t), cmp_u64);
        qsort(dec, runs, sizeof(uint64_t), cmp_u64);
        res->chars = len;
        res->tokens = n;
        res->enc_med_ms = (double)enc[runs / 2] / 1e6;
        res->enc_min_ms = (double)enc[0] / 1e6;
        res->dec_med_ms = (double)dec[runs / 2] / 1e6;
    }
    free(enc);
    free(dec);
    return rc;
}

int pkv_bench_tokenizer(int argc, char **argv)
{
    uint64_t runs = 31, chars = 16000;
    const char *json = NULL, *file = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            if (pkv_cli_parse_u64(argv[++i], 1, 100000, &runs))
                return pkv_cli_usage_error("bench tokenizer", "bad --runs %s", argv[i]);
        } else if (!strcmp(argv[i], "--chars") && i + 1 < argc) {
            if (pkv_cli_parse_u64(argv[++i], 1, 1 << 26, &chars))
                return pkv_cli_usage_error("bench tokenizer", "bad --chars %s", argv[i]);
        } else if (!strcmp(argv[i], "--json") && i + 1 < argc) {
            json = argv[++i];
        } else if (!strcmp(argv[i], "--file") && i + 1 < argc) {
            file = argv[++i];
        } else {
            fprintf(stderr, "usage: pagekv bench tokenizer [--runs N] [--chars N] [--file PATH] "
                            "[--json FILE]\n");
            return 2;
        }
    }
    pkv_tok_t *tok = NULL;
    int rc = pkv_tok_create_builtin(&tok);
    if (rc) {
        fprintf(stderr, "pagekv bench tokenizer: %s\n", pkv_status_str(rc));
        return 1;
    }
    char *filler = pkv_filler_alloc((size_t)chars, 42, 1);
    char *ftext = NULL;
    size_t flen = 0;
    if (file) {
        FILE *f = fopen(file, "rb");
        if (!f) {
            fprintf(stderr, "pagekv bench tokenizer: %s: %s\n", file, strerror(errno));
            rc = PKV_ERR_IO;
        } else {
            size_t cap = 1 << 16;
            ftext = malloc(cap);
            for (size_t r; ftext && (r = fread(ftext + flen, 1, cap - flen, f)) > 0;) {
                flen += r;
                if (flen < cap) continue;
                char *grown = realloc(ftext, cap *= 2);
                if (!grown) free(ftext);
                ftext = grown;
            }
            fclose(f);
            if (!ftext) rc = PKV_ERR_NOMEM;
        }
    }
    struct text_result fr = {0}, xr = {0};
    if (!rc)
        rc = filler ? bench_text(tok, filler, (size_t)chars, (unsigned)runs, &fr) : PKV_ERR_NOMEM;
    if (!rc && ftext) rc = bench_text(tok, ftext, flen, (unsigned)runs, &xr);
    if (rc) {
        fprintf(stderr, "pagekv bench tokenizer: %s\n", pkv_status_str(rc));
        goto done;
    }
    printf("## tokenizer (builtin BPE, vocab %d), %llu runs, median (min)\n\n",
           (int)pkv_tok_vocab_size(tok), (unsigned long long)runs);
    printf("| text | chars | tokens | chars/token | encode ms | encode MB/s | decode ms |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|\n");
    printf("| filler | %zu | %zu | %.3f | %.3f (%.3f) | %.1f | %.3f |\n", fr.chars, fr.tokens,
           (double)fr.chars / (double)fr.tokens, fr.enc_med_ms, fr.enc_min_ms,
           (double)fr.chars / 1e3 / fr.enc_med_ms, fr.dec_med_ms);
    if (ftext)
        printf("| %s | %zu | %zu | %.3f | %.3f (%.3f) | %.1f | %.3f |\n", file, xr.chars, xr.tokens,
               xr.tokens ? (double)xr.chars / (double)xr.tokens : 0.0, xr.enc_med_ms, xr.enc_min_ms,
               (double)xr.chars / 1e3 / xr.enc_med_ms, xr.dec_med_ms);
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            fprintf(stderr, "pagekv bench tokenizer: %s: %s\n", json, strerror(errno));
            rc = PKV_ERR_IO;
            goto done;
        }
        fprintf(f,
                "{\"vocab_size\": %d, \"runs\": %llu, \"filler_chars\": %zu, \"filler_tokens\": "
                "%zu, \"filler_chars_per_token\": %.4f, \"encode_ms_median\": %.4f, "
                "\"encode_ms_min\": %.4f, \"decode_ms_median\": %.4f}\n",
                (int)pkv_tok_vocab_size(tok), (unsigned long long)runs, fr.chars, fr.tokens,
                (double)fr.chars / (double)fr.tokens, fr.enc_med_ms, fr.enc_min_ms, fr.dec_med_ms);
        if (fclose(f) != 0) rc = PKV_ERR_IO;
    }
done:
    free(ftext);
    free(filler);
    pkv_tok_destroy(tok);
    return rc ? 1 : 0;
}
