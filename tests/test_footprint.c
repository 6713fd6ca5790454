/*
 * The pure pieces of `pagekv bench footprint` (support/footprint.c, in the support
 * library the bench and the tests link): filler determinism and
 * exact lengths, its characters per token under the builtin tokenizer, trace windows,
 * the workload's minimum KV, and the SVG writer producing well-formed XML. The bench
 * itself (server processes, minutes of load) stays out of the suite.
 */
#include "support/filler.h"
#include "support/footprint.h"

#include "pagekv/tokenizer.h"
#include "tests/support/testutil.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

START_TEST(filler_exact_and_deterministic)
{
    static const size_t lens[] = {0, 1, 37, 1000, 2000, 16000};
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        size_t n = lens[i];
        char *a = malloc(n + 1), *b = malloc(n + 1);
        ck_assert_ptr_nonnull(a);
        ck_assert_ptr_nonnull(b);
        memset(a, 'x', n + 1);
        pkv_fp_filler(a, n, 7);
        pkv_fp_filler(b, n, 7);
        ck_assert_uint_eq(strlen(a), n);
        ck_assert_int_eq(memcmp(a, b, n + 1), 0);
        for (size_t k = 0; k < n; k++) PKV_CHECK(isprint((unsigned char)a[k]));
        free(a);
        free(b);
    }
    /* A prefix of a longer filler is the shorter filler. */
    char big[4001], small[1001];
    pkv_fp_filler(big, 4000, 3);
    pkv_fp_filler(small, 1000, 3);
    ck_assert_int_eq(memcmp(big, small, 1000), 0);
    /* Starts with a numbered sentence. */
    ck_assert_int_eq(strncmp(big, "Sentence ", 9), 0);
}
END_TEST

START_TEST(filler_seeds_differ_from_the_start)
{
    /* Distinct seeds must not share a token-level prefix longer than a few words (the
     * distinct_burst and churn prompts would otherwise share cached blocks). */
    char a[201], b[201];
    for (uint64_t s = 0; s < 64; s++) {
        pkv_fp_filler(a, 200, 1000 + s);
        pkv_fp_filler(b, 200, 1000 + s + 1);
        size_t same = 0;
        while (same < 200 && a[same] == b[same]) same++;
        ck_assert_msg(same < 16, "seeds %llu and %llu share %zu leading chars",
                      (unsigned long long)(1000 + s), (unsigned long long)(1001 + s), same);
    }
}
END_TEST

START_TEST(filler_numbering)
{
    /* support/filler.c numbers sentences from `first`; the footprint filler derives it from
     * the seed, with the same words for the same seed. */
    char a[301], b[301];
    pkv_filler_write(a, 300, 5, 1);
    ck_assert_int_eq(strncmp(a, "Sentence 1: the ", 16), 0);
    ck_assert_ptr_nonnull(strstr(a, ". Sentence 2: the "));
    pkv_fp_filler(b, 300, 5);
    ck_assert_int_eq(strncmp(b, "Sentence 501: the ", 18), 0);
    /* The first sentence's words are the same. */
    const char *wa = strchr(a, ':'), *wb = strchr(b, ':');
    size_t la = (size_t)(strstr(a, ". ") - wa), lb = (size_t)(strstr(b, ". ") - wb);
    ck_assert_uint_eq(la, lb);
    ck_assert_int_eq(memcmp(wa, wb, la), 0);
    char *c = pkv_filler_alloc(300, 5, 501), *d = pkv_fp_filler_alloc(300, 5);
    ck_assert_ptr_nonnull(c);
    ck_assert_ptr_nonnull(d);
    ck_assert_str_eq(c, b);
    ck_assert_str_eq(d, b);
    free(c);
    free(d);
}
END_TEST

START_TEST(filler_chars_per_token)
{
    /* The bench sizes its ~3.7k-token system prompt from this ratio; keep it in the
     * tokenizer's documented range for filler. */
    pkv_tok_t *tok = NULL;
    ck_assert_int_eq(pkv_tok_create_builtin(&tok), PKV_OK);
    char *s = malloc(16001);
    ck_assert_ptr_nonnull(s);
    pkv_fp_filler(s, 16000, 1);
    int32_t *ids = NULL;
    size_t n = 0;
    ck_assert_int_eq(pkv_tok_encode_alloc(tok, s, 16000, false, &ids, &n), PKV_OK);
    double cpt = 16000.0 / (double)n;
    ck_assert_msg(cpt >= 3.0 && cpt <= 5.5, "chars/token %.3f", cpt);
    free(ids);
    free(s);
    pkv_tok_destroy(tok);
}
END_TEST

START_TEST(window_peak_and_last)
{
    pkv_fp_sample_t s[] = {{10, 5}, {20, 9}, {30, 7}, {40, 3}, {50, 8}};
    pkv_fp_window_t w = pkv_fp_window(s, 5, 20, 50);
    ck_assert_uint_eq(w.peak_bytes, 9);
    ck_assert_uint_eq(w.last_bytes, 3);
    ck_assert_uint_eq(w.n_samples, 3);
    w = pkv_fp_window(s, 5, 41, 50);
    ck_assert_uint_eq(w.n_samples, 0);
    ck_assert_uint_eq(w.peak_bytes, 0);
    w = pkv_fp_window(s, 5, 0, 1000);
    ck_assert_uint_eq(w.peak_bytes, 9);
    ck_assert_uint_eq(w.last_bytes, 8);
}
END_TEST

START_TEST(kv_min_shared_and_distinct)
{
    const uint64_t tb = 32768; /* llama-3.2-1b f16: bytes per token */
    /* One request of 100 prompt + 28 generated: 127 positions -> 8 blocks of 16. */
    pkv_fp_req_t one = {100, 28, 0, 0, false};
    ck_assert_uint_eq(pkv_fp_kv_min_bytes(&one, 1, 16, tb), 8 * 16 * tb);
    /* A burst of 3 sharing a 64-token cached prefix (4 blocks): 4 + 3 x ceil((80+10-1-64)/16)
     * = 4 + 3 x 2 = 10 blocks. */
    pkv_fp_req_t burst[] = {{80, 10, 64, 1, true}, {80, 10, 64, 1, true}, {80, 10, 64, 1, true}};
    ck_assert_uint_eq(pkv_fp_kv_min_bytes(burst, 3, 16, tb), 10 * 16 * tb);
    /* Without the shared flag, each is counted whole: 3 x ceil(89/16) = 18 blocks. */
    for (int i = 0; i < 3; i++) burst[i].shared_prefix = false;
    ck_assert_uint_eq(pkv_fp_kv_min_bytes(burst, 3, 16, tb), 18 * 16 * tb);
    /* Sequential groups: the largest one. A warm-up (group 0) and the burst (group 1). */
    pkv_fp_req_t mixed[] = {{500, 8, 0, 0, false}, {80, 10, 64, 1, true}, {80, 10, 64, 1, true}};
    ck_assert_uint_eq(pkv_fp_kv_min_bytes(mixed, 3, 16, tb), 32 * 16 * tb); /* ceil(507/16) */
    /* The smallest cached count of a shared group is what is held once. */
    pkv_fp_req_t uneven[] = {{80, 1, 64, 2, true}, {80, 1, 48, 2, true}};
    /* shared 48 (3 blocks) + 2 x ceil((80-48)/16) = 3 + 4 = 7 */
    ck_assert_uint_eq(pkv_fp_kv_min_bytes(uneven, 2, 16, tb), 7 * 16 * tb);
    ck_assert_uint_eq(pkv_fp_kv_min_bytes(NULL, 0, 16, tb), 0);
    ck_assert_uint_eq(pkv_fp_kv_min_bytes(&one, 1, 0, tb), 0);
}
END_TEST

START_TEST(nice_steps)
{
    ck_assert(fabs(pkv_fp_nice_step(1000, 10) - 100) < 1e-9);
    ck_assert(fabs(pkv_fp_nice_step(37, 8) - 5) < 1e-9);
    ck_assert(fabs(pkv_fp_nice_step(0.3, 3) - 0.1) < 1e-12);
    ck_assert(fabs(pkv_fp_nice_step(1500, 8) - 200) < 1e-9);
    ck_assert(pkv_fp_nice_step(0, 5) == 1);
}
END_TEST

/* A minimal XML well-formedness check: balanced tags, quoted attributes, known entities,
 * one root element named svg. */
static void check_xml(const char *x)
{
    const char *stack[64];
    size_t depth = 0, roots = 0;
    const char *p = x;
    if (!strncmp(p, "<?xml", 5)) {
        p = strstr(p, "?>");
        ck_assert_ptr_nonnull(p);
        p += 2;
    }
    while (*p) {
        if (*p == '&') {
            static const char *ents[] = {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"};
            bool ok = false;
            for (int i = 0; i < 5; i++) ok |= !strncmp(p, ents[i], strlen(ents[i]));
            ck_assert_msg(ok, "bad entity at: %.20s", p);
            p++;
            continue;
        }
        if (*p == '>') ck_abort_msg("stray '>' at: %.20s", p);
        if (*p != '<') {
            p++;
            continue;
        }
        bool close = p[1] == '/';
        const char *name = p + (close ? 2 : 1);
        size_t nlen = strspn(name, "abcdefghijklmnopqrstuvwxyz");
        ck_assert_msg(nlen > 0, "bad tag at: %.20s", p);
        const char *q = name + nlen;
        bool in_quote = false;
        while (*q && (in_quote || *q != '>')) {
            if (*q == '"') in_quote = !in_quote;
            ck_assert_msg(in_quote || *q != '<', "'<' inside a tag at: %.20s", p);
            q++;
        }
        ck_assert_msg(*q == '>', "unterminated tag at: %.20s", p);
        bool self = q[-1] == '/';
        if (close) {
            ck_assert_msg(depth > 0, "close without open at: %.20s", p);
            depth--;
            ck_assert_msg(!strncmp(stack[depth], name, nlen) &&
                              !isalpha((unsigned char)stack[depth][nlen]),
                          "mismatched close at: %.20s", p);
        } else if (!self) {
            if (depth == 0) roots++;
            ck_assert_uint_lt(depth, 64);
            stack[depth++] = name;
        } else if (depth == 0) {
            roots++;
        }
        p = q + 1;
    }
    ck_assert_uint_eq(depth, 0);
    ck_assert_uint_eq(roots, 1);
}

START_TEST(svg_well_formed)
{
    double x1[] = {0, 1, 2, 3, 4}, y1[] = {100, 150, 400, 380, 120};
    double x2[] = {0, 1.5, 3, 4.5}, y2[] = {100, 900, 1200, 300};
    double nan_x[] = {0, NAN, 2}, nan_y[] = {1, 2, INFINITY};
    pkv_fp_series_t s[] = {{"paged VmRSS", "#1f5fbf", false, x1, y1, 5},
                           {"dense <VmRSS> & \"more\"", "#d03a1f", true, x2, y2, 4},
                           {"with NaN", "#000000", false, nan_x, nan_y, 3},
                           {"empty", "#00ff00", false, NULL, NULL, 0}};
    pkv_fp_mark_t m[] = {{5.0, "scenario starts", "#555555"}, {NAN, "skipped", "#555555"}};
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(pkv_fp_svg_write(f, "memory: a < b & c", s, 4, m, 2), 0);
    fclose(f);
    ck_assert_ptr_nonnull(strstr(buf, "<svg"));
    ck_assert_ptr_nonnull(strstr(buf, "</svg>"));
    ck_assert_ptr_null(strstr(buf, "nan"));
    ck_assert_ptr_null(strstr(buf, "inf"));
    ck_assert_ptr_nonnull(strstr(buf, "memory: a &lt; b &amp; c"));
    ck_assert_ptr_nonnull(strstr(buf, "dense &lt;VmRSS&gt; &amp; &quot;more&quot;"));
    /* 4 series -> 4 polylines; the mark at NaN is skipped. */
    size_t poly = 0;
    for (const char *p = buf; (p = strstr(p, "<polyline")); p++) poly++;
    ck_assert_uint_eq(poly, 4);
    ck_assert_ptr_null(strstr(buf, "skipped"));
    check_xml(buf);
    free(buf);
    /* No series at all still gives a valid (empty) plot. */
    f = open_memstream(&buf, &len);
    ck_assert_int_eq(pkv_fp_svg_write(f, "empty", NULL, 0, NULL, 0), 0);
    fclose(f);
    check_xml(buf);
    free(buf);
}
END_TEST

static Suite *footprint_suite(void)
{
    Suite *s = suite_create("footprint");
    TCase *tc = tcase_create("pure");
    tcase_add_test(tc, filler_exact_and_deterministic);
    tcase_add_test(tc, filler_seeds_differ_from_the_start);
    tcase_add_test(tc, filler_numbering);
    tcase_add_test(tc, filler_chars_per_token);
    tcase_add_test(tc, window_peak_and_last);
    tcase_add_test(tc, kv_min_shared_and_distinct);
    tcase_add_test(tc, nice_steps);
    tcase_add_test(tc, svg_well_formed);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(footprint_suite)
