/*
 * Writes the seed corpus of fuzz_tier (tests/fuzz/corpus/tier): segments made by the tier's
 * own writer, then variants a crash or a bad disk leaves: unsealed, torn mid-record, a
 * flipped payload, header, index or footer byte, the footer cut off, empty.
 *
 *   make && cc -Iinclude -Isrc -I. -D_GNU_SOURCE tests/fuzz/make_tier_corpus.c \
 *      build/libpagekv.a $(pkg-config --libs libxxhash) -lm -pthread -o /tmp/make_tier_corpus
 *   /tmp/make_tier_corpus tests/fuzz/corpus/tier
 */
#include "core/core.h"
#include "tier/tier.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static uint8_t *segment(int dirfd, uint64_t seq, uint32_t n, uint32_t max_len, bool seal,
                        size_t *len)
{
    uint64_t rng = seq * 7919;
    pkv_tier_record_t r = {.payload_len = 0};
    for (int i = 0; i < 32; i++) r.layout[i] = (uint8_t)pkv_splitmix64(&rng);
    pkv_tier_seg_t *s;
    if (pkv_tier_seg_create(dirfd, seq, r.layout, &s)) exit(1);
    uint8_t payload[4096];
    for (uint32_t i = 0; i < n; i++) {
        memcpy(r.parent, r.key, sizeof(r.key));
        r.tenant = i % 3;
        for (int b = 0; b < 32; b++) r.key[b] = (uint8_t)pkv_splitmix64(&rng);
        r.payload_len = pkv_splitmix64(&rng) % (max_len + 1);
        for (uint64_t b = 0; b < r.payload_len; b++) payload[b] = (uint8_t)pkv_splitmix64(&rng);
        pkv_tier_entry_t e;
        if (pkv_tier_seg_append(s, &r, payload, &e)) exit(1);
    }
    if (seal && pkv_tier_seg_seal(s)) exit(1);
    pkv_tier_seg_close(s);
    char name[PKV_TIER_SEG_NAME_MAX];
    pkv_tier_seg_name(seq, name);
    int fd = openat(dirfd, name, O_RDONLY);
    struct stat st;
    fstat(fd, &st);
    uint8_t *buf = malloc((size_t)st.st_size + 1);
    if (pread(fd, buf, (size_t)st.st_size, 0) != st.st_size) exit(1);
    close(fd);
    unlinkat(dirfd, name, 0);
    *len = (size_t)st.st_size;
    return buf;
}

static void put(const char *dir, const char *name, const uint8_t *b, size_t n)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(b, 1, n, f) != n) exit(1);
    fclose(f);
}

int main(int argc, char **argv)
{
    if (argc != 2) return 2;
    char tmp[] = "/tmp/pkv-tier-corpus-XXXXXX";
    if (!mkdtemp(tmp)) return 1;
    int dirfd = open(tmp, O_RDONLY | O_DIRECTORY);
    size_t n;
    uint8_t *b = segment(dirfd, 1, 8, 300, true, &n);
    put(argv[1], "sealed", b, n);
    b[n - 20] ^= 1;
    put(argv[1], "sealed-footer-flipped", b, n);
    b[n - 20] ^= 1;
    b[n - 80 - 30] ^= 1;
    put(argv[1], "sealed-index-flipped", b, n);
    b[n - 80 - 30] ^= 1;
    put(argv[1], "sealed-footer-cut", b, n - 40);
    b[200] ^= 1;
    put(argv[1], "sealed-payload-flipped", b, n);
    free(b);
    b = segment(dirfd, 2, 10, 500, false, &n);
    put(argv[1], "unsealed", b, n);
    put(argv[1], "unsealed-torn", b, n - 77);
    b[60] ^= 1;
    put(argv[1], "unsealed-header-flipped", b, n);
    free(b);
    b = segment(dirfd, 3, 3, 0, true, &n);
    put(argv[1], "sealed-empty-payloads", b, n);
    free(b);
    b = segment(dirfd, 4, 0, 0, true, &n);
    put(argv[1], "sealed-no-records", b, n);
    free(b);
    put(argv[1], "empty", (const uint8_t *)"", 0);
    close(dirfd);
    rmdir(tmp);
    return 0;
}
