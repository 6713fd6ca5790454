/*
 * pagekv tokenizer: the BPE trainer that generates src/tokenizer/bpe_merges.c, an
 * encode command for looking at what the tokenizer does, and `pagekv bench tokenizer`.
 *
 * Training (deterministic: same files in the same order -> same table, byte for byte):
 * the corpus is cut into pieces with the encoder's own pre-tokenizer, identical pieces
 * are counted once with their frequency, and then each round merges the most frequent
 * adjacent pair (ties: the numerically smallest (left, right) pair), updating the pair
 * counts only in the words that contain it (an index from pair to words). A lazy
 * max-heap finds the best pair: counts that fall leave stale entries, which are
 * re-pushed with their current count when they surface.
 */
#include "support/cli.h"
#include "tools/commands.h"

#include "pagekv/tokenizer.h"
#include "tokenizer/tokenizer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- small growable arrays ------------------------------------------------------------ */
static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "pagekv tokenizer: out of memory\n");
        exit(1);
    }
    return q;
}

static int read_file(const char *path, uint8_t **data, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    size_t cap = 1 << 16, n = 0;
    uint8_t *buf = xrealloc(NULL, cap);
    for (;;) {
        if (n == cap) buf = xrealloc(buf, cap *= 2);
        size_t r = fread(buf + n, 1, cap - n, f);
        if (r == 0) break;
        n += r;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return -1;
    }
    *data = buf;
    *len = n;
    return 0;
}

/* ---- trainer state ---------------------------------------------------------------------- */
struct word {
    int32_t *sym;
    uint32_t n;
    uint64_t freq;
};

struct pair_stat {
    uint64_t key;
    int64_t count;
    int32_t *where; /* word indices that contained the pair at some point (may be stale) */
    uint32_t where_n, where_cap;
    uint32_t stamp; /* last round that touched it + 1 */
};

struct heap_entry {
    int64_t count;
    uint64_t key;
};

struct trainer {
    struct word *words;
    size_t nwords;
    struct pair_stat *pairs;
    size_t npairs, pairs_cap;
    uint32_t *slots; /* pair index + 1 */
    size_t slot_mask;
    struct heap_entry *heap;
    size_t heap_n, heap_cap;
    uint32_t *touched;
    size_t touched_n, touched_cap;
};

static bool heap_less(struct heap_entry a, struct heap_entry b) /* a before b */
{
    return a.count > b.count || (a.count == b.count && a.key < b.key);
}

static void heap_push(struct trainer *tr, struct heap_entry e)
{
    if (tr->heap_n == tr->heap_cap) {
        tr->heap_cap = tr->heap_cap ? tr->heap_cap * 2 : 1024;
        tr->heap = xrealloc(tr->heap, tr->heap_cap * sizeof(*tr->heap));
    }
    size_t i = tr->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(e, tr->heap[p])) break;
        tr->heap[i] = tr->heap[p];
        i = p;
    }
    tr->heap[i] = e;
}

static struct heap_entry heap_pop(struct trainer *tr)
{
    struct heap_entry top = tr->heap[0], last = tr->heap[--tr->heap_n];
    size_t i = 0, n = tr->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_less(tr->heap[c + 1], tr->heap[c])) c++;
        if (!heap_less(tr->heap[c], last)) break;
        tr->heap[i] = tr->heap[c];
        i = c;
    }
    if (n) tr->heap[i] = last;
    return top;
}

static void pair_rehash(struct trainer *tr)
{
    size_t cap = (tr->slot_mask + 1) * 2;
    if (cap < 1024) cap = 1024;
    free(tr->slots);
    tr->slots = calloc(cap, sizeof(uint32_t));
    if (!tr->slots) {
        fprintf(stderr, "pagekv tokenizer: out of memory\n");
        exit(1);
    }
    tr->slot_mask = cap - 1;
    for (size_t i = 0; i < tr->npairs; i++) {
        size_t h = pkv_tokenizer_mix64(tr->pairs[i].key) & tr->slot_mask;
        while (tr->slots[h]) h = (h + 1) & tr->slot_mask;
        tr->slots[h] = (uint32_t)i + 1;
    }
}

static struct pair_stat *pair_get(struct trainer *tr, uint64_t key, bool create)
{
    if (!tr->slots) pair_rehash(tr);
    size_t h = pkv_tokenizer_mix64(key) & tr->slot_mask;
    while (tr->slots[h]) {
        struct pair_stat *p = &tr->pairs[tr->slots[h] - 1];
        if (p->key == key) return p;
        h = (h + 1) & tr->slot_mask;
    }
    if (!create) return NULL;
    if (tr->npairs == tr->pairs_cap) {
        tr->pairs_cap = tr->pairs_cap ? tr->pairs_cap * 2 : 4096;
        tr->pairs = xrealloc(tr->pairs, tr->pairs_cap * sizeof(*tr->pairs));
    }
    struct pair_stat *p = &tr->pairs[tr->npairs];
    memset(p, 0, sizeof(*p));
    p->key = key;
    tr->slots[h] = (uint32_t)++tr->npairs;
    if (tr->npairs * 2 > tr->slot_mask) {
        pair_rehash(tr);
        p = &tr->pairs[tr->npairs - 1];
    }
    return p;
}

static void pair_add(struct trainer *tr, uint64_t key, int64_t delta, int32_t w, uint32_t round)
{
    struct pair_stat *p = pair_get(tr, key, true);
    p->count += delta;
    if (delta > 0 && (p->where_n == 0 || p->where[p->where_n - 1] != w)) {
        if (p->where_n == p->where_cap) {
            p->where_cap = p->where_cap ? p->where_cap * 2 : 4;
            p->where = xrealloc(p->where, p->where_cap * sizeof(int32_t));
        }
        p->where[p->where_n++] = w;
    }
    if (p->stamp != round + 1) {
        p->stamp = round + 1;
        if (tr->touched_n == tr->touched_cap) {
            tr->touched_cap = tr->touched_cap ? tr->touched_cap * 2 : 1024;
            tr->touched = xrealloc(tr->touched, tr->touched_cap * sizeof(uint32_t));
        }
        tr->touched[tr->touched_n++] = (uint32_t)(p - tr->pairs);
    }
}

static void word_pairs(struct trainer *tr, int32_t w, int sign, uint32_t round)
{
    struct word *wd = &tr->words[w];
    for (uint32_t i = 0; i + 1 < wd->n; i++)
        pair_add(tr, pkv_tokenizer_pair_key((uint32_t)wd->sym[i], (uint32_t)wd->sym[i + 1]),
                 sign * (int64_t)wd->freq, w, round);
}

/* Merge the pair `p` into id 256 + r in every word that holds it, keeping the pair
 * counts and the heap current. */
static void apply_merge(struct trainer *tr, struct pair_stat *p, uint32_t r)
{
    uint32_t a = (uint32_t)(p->key >> 32), b = (uint32_t)p->key;
    int32_t id = 256 + (int32_t)r;
    /* take the word list: merging changes the table (pair_get may reallocate) */
    int32_t *where = p->where;
    uint32_t where_n = p->where_n;
    p->where = NULL;
    p->where_n = p->where_cap = 0;
    for (uint32_t k = 0; k < where_n; k++) {
        int32_t w = where[k];
        if (k > 0 && where[k - 1] == w) continue;
        struct word *wd = &tr->words[w];
        bool has = false;
        for (uint32_t i = 0; i + 1 < wd->n && !has; i++)
            has = (uint32_t)wd->sym[i] == a && (uint32_t)wd->sym[i + 1] == b;
        if (!has) continue;
        word_pairs(tr, w, -1, r + 1);
        uint32_t o = 0;
        for (uint32_t i = 0; i < wd->n;) {
            if (i + 1 < wd->n && (uint32_t)wd->sym[i] == a && (uint32_t)wd->sym[i + 1] == b) {
                wd->sym[o++] = id;
                i += 2;
            } else {
                wd->sym[o++] = wd->sym[i++];
            }
        }
        wd->n = o;
        word_pairs(tr, w, +1, r + 1);
    }
    free(where);
    for (size_t i = 0; i < tr->touched_n; i++) {
        struct pair_stat *q = &tr->pairs[tr->touched[i]];
        if (q->count > 0) heap_push(tr, (struct heap_entry){q->count, q->key});
    }
    tr->touched_n = 0;
}

/* Counting identical pieces: an open-addressing map from piece bytes to a word. */
struct piece_map {
    uint32_t *slots; /* word index + 1 */
    size_t mask;
};

static uint64_t bytes_hash(const uint8_t *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return pkv_tokenizer_mix64(h);
}

static void count_piece(struct trainer *tr, struct piece_map *pm, size_t *words_cap,
                        const uint8_t *p, size_t n)
{
    if ((tr->nwords + 1) * 2 > pm->mask) {
        size_t cap = pm->mask ? (pm->mask + 1) * 2 : 1 << 16;
        uint32_t *slots = calloc(cap, sizeof(uint32_t));
        if (!slots) exit(1);
        for (size_t i = 0; i < tr->nwords; i++) {
            struct word *wd = &tr->words[i];
            uint8_t tmp[4096];
            for (uint32_t k = 0; k < wd->n; k++) tmp[k] = (uint8_t)wd->sym[k];
            size_t h = bytes_hash(tmp, wd->n) & (cap - 1);
            while (slots[h]) h = (h + 1) & (cap - 1);
            slots[h] = (uint32_t)i + 1;
        }
        free(pm->slots);
        pm->slots = slots;
        pm->mask = cap - 1;
    }
    size_t h = bytes_hash(p, n) & pm->mask;
    while (pm->slots[h]) {
        struct word *wd = &tr->words[pm->slots[h] - 1];
        bool eq = wd->n == n;
        for (uint32_t k = 0; eq && k < n; k++) eq = wd->sym[k] == p[k];
        if (eq) {
            wd->freq++;
            return;
        }
        h = (h + 1) & pm->mask;
    }
    if (tr->nwords == *words_cap) {
        *words_cap = *words_cap ? *words_cap * 2 : 4096;
        tr->words = xrealloc(tr->words, *words_cap * sizeof(*tr->words));
    }
    struct word *wd = &tr->words[tr->nwords];
    wd->sym = xrealloc(NULL, n * sizeof(int32_t));
    for (size_t k = 0; k < n; k++) wd->sym[k] = p[k];
    wd->n = (uint32_t)n;
    wd->freq = 1;
    pm->slots[h] = (uint32_t)++tr->nwords;
}

/* Pieces longer than this are left out of training (ASCII art, long rules). */
#define TRAIN_MAX_PIECE 64

/* `tokenizer train`'s command line; argv[first_file..argc) are the corpus files. */
struct train_args {
    uint64_t merges;
    const char *out_path;
    bool seed_digits;
    int first_file;
};

/* The corpus as read: its size and FNV-1a-64 over every file in order. */
struct corpus_sum {
    uint64_t bytes, hash;
};

/* The merge table: merge r makes id 256 + r from pair[r], seen count[r] times when made. */
struct merge_table {
    uint16_t (*pair)[2];
    uint64_t *count;
    uint64_t cap; /* --merges */
    uint32_t n;   /* merges made */
};

/* 0, or the exit status of the usage error it printed. */
static int train_parse(int argc, char **argv, struct train_args *a)
{
    *a = (struct train_args){.first_file = argc};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--merges") && i + 1 < argc) {
            if (pkv_cli_parse_u64(argv[++i], 1, 60000, &a->merges))
                return pkv_cli_usage_error("tokenizer train", "bad --merges %s", argv[i]);
        } else if (!strcmp(argv[i], "--out") && i + 1 < argc) {
            a->out_path = argv[++i];
        } else if (!strcmp(argv[i], "--seed-digits")) {
            a->seed_digits = true;
        } else if (argv[i][0] == '-' && argv[i][1] == '-') {
            return pkv_cli_usage_error("tokenizer train", "unknown option %s", argv[i]);
        } else {
            a->first_file = i;
            break;
        }
    }
    if (!a->merges || !a->out_path || a->first_file >= argc)
        return pkv_cli_usage_error("tokenizer train",
                                   "usage: pagekv tokenizer train --merges N --out FILE "
                                   "[--seed-digits] CORPUS...");
    return 0;
}

/* Every corpus file cut into pieces and counted into tr's words; then every word's pairs
 * counted and heaped. 0, or 1 with the error printed. */
static int train_read_corpus(struct trainer *tr, char **files, int n_files, struct corpus_sum *cs)
{
    struct piece_map pm = {0};
    size_t words_cap = 0;
    for (int i = 0; i < n_files; i++) {
        uint8_t *data;
        size_t len;
        if (read_file(files[i], &data, &len)) {
            fprintf(stderr, "pagekv tokenizer train: cannot read %s: %s\n", files[i],
                    strerror(errno));
            free(pm.slots);
            return 1;
        }
        for (size_t k = 0; k < len; k++) cs->hash = (cs->hash ^ data[k]) * 0x100000001b3ull;
        cs->bytes += len;
        for (size_t k = 0; k < len;) {
            size_t m = pkv_tokenizer_piece_len(data, len, k);
            if (m >= 2 && m <= TRAIN_MAX_PIECE) count_piece(tr, &pm, &words_cap, data + k, m);
            k += m;
        }
        free(data);
    }
    free(pm.slots);
    fprintf(stderr, "train: %llu bytes, %zu distinct pieces\n", (unsigned long long)cs->bytes,
            tr->nwords);
    for (size_t w = 0; w < tr->nwords; w++) word_pairs(tr, (int32_t)w, +1, 0);
    for (size_t i = 0; i < tr->touched_n; i++)
        heap_push(tr, (struct heap_entry){tr->pairs[tr->touched[i]].count,
                                          tr->pairs[tr->touched[i]].key});
    tr->touched_n = 0;
    return 0;
}

/* Merge (left, right) as the table's next entry, whatever its count. */
static void train_merge_pair(struct trainer *tr, struct merge_table *mt, uint32_t left,
                             uint32_t right)
{
    uint32_t r = mt->n++;
    mt->pair[r][0] = (uint16_t)left;
    mt->pair[r][1] = (uint16_t)right;
    struct pair_stat *p = pair_get(tr, pkv_tokenizer_pair_key(left, right), true);
    mt->count[r] = p->count > 0 ? (uint64_t)p->count : 0;
    apply_merge(tr, p, r);
}

/* --seed-digits: every group of 1-3 digits, with or without its leading space, is one token
 * (as in GPT-4 / Llama 3 style vocabularies): 2210 merges ranked first, each built from the
 * pair the encoder forms first (the lower-ranked of "ab"/"bc"). 0, or 1 with the error
 * printed. */
static int train_seed_digits(struct trainer *tr, struct merge_table *mt)
{
    uint32_t dd[100], ddd[1000];
    uint32_t seeds[2210][2], ns = 0, next = 256;
    for (uint32_t v = 0; v < 100; v++) {
        seeds[ns][0] = '0' + v / 10, seeds[ns++][1] = '0' + v % 10;
        dd[v] = next++;
    }
    for (uint32_t v = 0; v < 1000; v++) {
        uint32_t a = v / 100, b = v / 10 % 10, c = v % 10;
        if (10 * a + b <= 10 * b + c)
            seeds[ns][0] = dd[10 * a + b], seeds[ns++][1] = '0' + c;
        else
            seeds[ns][0] = '0' + a, seeds[ns++][1] = dd[10 * b + c];
        ddd[v] = next++;
    }
    for (uint32_t v = 0; v < 10; v++) seeds[ns][0] = ' ', seeds[ns++][1] = '0' + v;
    for (uint32_t v = 0; v < 100; v++) seeds[ns][0] = ' ', seeds[ns++][1] = dd[v];
    for (uint32_t v = 0; v < 1000; v++) seeds[ns][0] = ' ', seeds[ns++][1] = ddd[v];
    if (ns > mt->cap) {
        fprintf(stderr, "pagekv tokenizer train: --seed-digits needs --merges >= %u\n", ns);
        return 1;
    }
    for (uint32_t s = 0; s < ns; s++) train_merge_pair(tr, mt, seeds[s][0], seeds[s][1]);
    return 0;
}

/* The most frequent pair (the heap's order breaks ties), stale heap entries re-pushed with
 * their current count on the way; NULL when no pair is left. */
static struct pair_stat *train_best_pair(struct trainer *tr)
{
    while (tr->heap_n) {
        struct heap_entry e = heap_pop(tr);
        struct pair_stat *p = pair_get(tr, e.key, false);
        if (!p || p->count <= 0) continue;
        if (p->count != e.count) {
            heap_push(tr, (struct heap_entry){p->count, p->key});
            continue;
        }
        return p;
    }
    return NULL;
}

/* Merge the best pair until the table is full or no pair is seen twice. 0, or 1 with the
 * error printed when the table could not be filled. */
static int train_merges(struct trainer *tr, struct merge_table *mt)
{
    while (mt->n < mt->cap) {
        struct pair_stat *best = train_best_pair(tr);
        if (!best || best->count < 2) break;
        uint32_t r = mt->n++;
        mt->pair[r][0] = (uint16_t)(best->key >> 32);
        mt->pair[r][1] = (uint16_t)best->key;
        mt->count[r] = (uint64_t)best->count;
        apply_merge(tr, best, r);
    }
    if (mt->n < mt->cap) {
        fprintf(stderr, "pagekv tokenizer train: only %llu merges with count >= 2 (asked %llu)\n",
                (unsigned long long)mt->n, (unsigned long long)mt->cap);
        return 1;
    }
    return 0;
}

/* The generated C file (bpe_merges.c's form). 0, or 1 with the error printed. */
static int train_write(const struct train_args *a, char **argv, int argc,
                       const struct corpus_sum *cs, const struct merge_table *mt)
{
    FILE *f = fopen(a->out_path, "w");
    if (!f) {
        fprintf(stderr, "pagekv tokenizer train: cannot write %s: %s\n", a->out_path,
                strerror(errno));
        return 1;
    }
    fprintf(f, "/*\n * GENERATED by `pagekv tokenizer train` (scripts/gen-bpe-merges.sh); do not "
               "edit.\n *\n");
    fprintf(f, " * The builtin BPE's merge table: merge r makes id 256 + r from (left, right).\n");
    fprintf(f, " * Corpus: %d files, %llu bytes, FNV-1a-64 %016llx:\n", argc - a->first_file,
            (unsigned long long)cs->bytes, (unsigned long long)cs->hash);
    for (int i = a->first_file; i < argc; i++) fprintf(f, " *   %s\n", argv[i]);
    if (a->seed_digits)
        fprintf(f, " * Merges 256..2465 are the seeded digit groups (--seed-digits).\n");
    fprintf(f, " */\n#include \"tokenizer/tokenizer_int.h\"\n\n");
    fprintf(f, "const uint32_t tok_bpe_merge_count = %llu;\n\n", (unsigned long long)mt->cap);
    fprintf(f, "/* clang-format off */\nconst uint16_t tok_bpe_merges[][2] = {\n");
    for (uint64_t m = 0; m < mt->cap; m++)
        fprintf(f, "    {%u, %u}, /* %llu: count %llu */\n", mt->pair[m][0], mt->pair[m][1],
                (unsigned long long)m + 256, (unsigned long long)mt->count[m]);
    fprintf(f, "};\n/* clang-format on */\n");
    if (fclose(f) != 0) {
        fprintf(stderr, "pagekv tokenizer train: write %s failed\n", a->out_path);
        return 1;
    }
    fprintf(stderr, "train: wrote %llu merges to %s (last count %llu)\n",
            (unsigned long long)mt->cap, a->out_path, (unsigned long long)mt->count[mt->cap - 1]);
    return 0;
}

static void trainer_free(struct trainer *tr)
{
    for (size_t w = 0; w < tr->nwords; w++) free(tr->words[w].sym);
    for (size_t p = 0; p < tr->npairs; p++) free(tr->pairs[p].where);
    free(tr->words);
    free(tr->pairs);
    free(tr->slots);
    free(tr->heap);
    free(tr->touched);
}

static int cmd_train(int argc, char **argv)
{
    struct train_args a;
    int rc = train_parse(argc, argv, &a);
    if (rc) return rc;
    struct trainer tr = {0};
    struct corpus_sum cs = {0, 0xcbf29ce484222325ull};
    struct merge_table mt = {.cap = a.merges};
    rc = train_read_corpus(&tr, argv + a.first_file, argc - a.first_file, &cs);
    if (rc) goto done;
    mt.pair = xrealloc(NULL, mt.cap * sizeof(*mt.pair));
    mt.count = xrealloc(NULL, mt.cap * sizeof(uint64_t));
    if (a.seed_digits && (rc = train_seed_digits(&tr, &mt))) goto done;
    rc = train_merges(&tr, &mt);
    if (!rc) rc = train_write(&a, argv, argc, &cs, &mt);
done:
    free(mt.count);
    free(mt.pair);
    trainer_free(&tr);
    return rc;
}

/* ---- encode ------------------------------------------------------------------------------ */
static int cmd_encode(int argc, char **argv)
{
    const char *l2c = NULL, *file = NULL, *text = NULL;
    uint64_t vocab = 0;
    bool ids = false, pieces = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--llama2c") && i + 1 < argc) {
            l2c = argv[++i];
        } else if (!strcmp(argv[i], "--vocab-size") && i + 1 < argc) {
            if (pkv_cli_parse_u64(argv[++i], 3, 1 << 22, &vocab))
                return pkv_cli_usage_error("tokenizer encode", "bad --vocab-size %s", argv[i]);
        } else if (!strcmp(argv[i], "--file") && i + 1 < argc) {
            file = argv[++i];
        } else if (!strcmp(argv[i], "--ids")) {
            ids = true;
        } else if (!strcmp(argv[i], "--pieces")) {
            pieces = true;
        } else if (argv[i][0] == '-' && argv[i][1] == '-') {
            return pkv_cli_usage_error("tokenizer encode", "unknown option %s", argv[i]);
        } else if (!text) {
            text = argv[i];
        } else {
            return pkv_cli_usage_error("tokenizer encode", "one TEXT only");
        }
    }
    if (!!file == !!text || (l2c && !vocab))
        return pkv_cli_usage_error("tokenizer encode",
                                   "usage: pagekv tokenizer encode [--llama2c FILE --vocab-size N] "
                                   "[--ids|--pieces] (TEXT | --file PATH)");
    uint8_t *data = NULL;
    size_t len;
    if (file) {
        if (read_file(file, &data, &len)) {
            fprintf(stderr, "pagekv tokenizer encode: cannot read %s: %s\n", file, strerror(errno));
            return 1;
        }
    } else {
        len = strlen(text);
    }
    const char *src = file ? (const char *)data : text;
    pkv_tok_t *tok = NULL;
    int rc = l2c ? pkv_tok_load_llama2c(l2c, (int32_t)vocab, &tok) : pkv_tok_create_builtin(&tok);
    if (rc) {
        fprintf(stderr, "pagekv tokenizer encode: tokenizer: %s\n", pkv_status_str(rc));
        free(data);
        return 1;
    }
    int32_t *out = NULL;
    size_t n = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    rc = pkv_tok_encode_alloc(tok, src, len, false, &out, &n);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (rc) {
        fprintf(stderr, "pagekv tokenizer encode: %s\n", pkv_status_str(rc));
        pkv_tok_destroy(tok);
        free(data);
        return 1;
    }
    for (size_t i = 0; i < n && (ids || pieces); i++) {
        if (ids) {
            printf("%s%d", i ? " " : "", (int)out[i]);
        } else {
            const char *p;
            size_t l;
            pkv_tok_piece(tok, out[i], &p, &l);
            printf("%s%.*s", i ? "|" : "", (int)l, p);
        }
    }
    if (ids || pieces) printf("\n");
    double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    fprintf(stderr, "%zu bytes -> %zu tokens (%.3f bytes/token, vocab %d) in %.3f ms\n", len, n,
            n ? (double)len / (double)n : 0.0, (int)pkv_tok_vocab_size(tok), ms);
    free(out);
    pkv_tok_destroy(tok);
    free(data);
    return 0;
}

int pkv_cmd_tokenizer(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "train")) return cmd_train(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "encode")) return cmd_encode(argc - 1, argv + 1);
    fprintf(stderr,
            "usage: pagekv tokenizer train --merges N --out FILE [--seed-digits] CORPUS...\n"
            "       pagekv tokenizer encode [--llama2c FILE --vocab-size N] "
            "[--ids|--pieces] (TEXT | --file PATH)\n");
    return 2;
}
