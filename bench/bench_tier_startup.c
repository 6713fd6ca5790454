/*
 * `pagekv bench tiers --startup`: what a directory of records adds to the disk tier's
 * start. It writes N synthetic records (the tiny preset's block size by default: 4 KiB)
 * into sealed segments of the size the tier itself would cut for a cap just above them,
 * then opens the tier on that directory and on an empty one, alternately, R times each,
 * and reports the medians and their difference against the target (<= 1 s). Each open of
 * the full directory must index every record (checked: a short count fails the run).
 * With --drop-caches the page cache is emptied before each open (root), so the indexes
 * come from the disk, not from memory.
 */
#include "support/bench.h"
#include "support/cli.h"
#include "support/report.h"
#include "tools/commands.h"

#include "core/core.h"
#include "tier/tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CMD "bench tiers --startup"

typedef struct {
    uint64_t records, record_bytes, runs;
    const char *base, *json;
    bool drop_caches;
} startup_opts_t;

static const uint8_t layout[PKV_TIER_HASH_BYTES] = {'b', 'e', 'n', 'c', 'h'};

static int no_source(void *arg, const uint8_t key[PKV_TIER_HASH_BYTES], void *buf, uint64_t len)
{
    (void)arg, (void)key, (void)buf, (void)len;
    return PKV_ERR_NOTFOUND;
}

static uint64_t cap_for(const startup_opts_t *o)
{
    uint64_t rec = PKV_TIER_HEADER_BYTES + o->record_bytes + PKV_TIER_ENTRY_BYTES;
    return o->records * rec + o->records * rec / 8 + (64ull << 20);
}

/* Fill dir with o->records records in segments sealed past the tier's own segment size. */
static int write_records(const char *dir, const startup_opts_t *o, uint32_t *segments)
{
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return PKV_ERR_IO;
    uint64_t seg_bytes = PKV_MIN(cap_for(o) / 8, 256ull << 20);
    uint8_t *payload = malloc(o->record_bytes);
    pkv_tier_seg_t *s = NULL;
    int rc = payload ? PKV_OK : PKV_ERR_NOMEM;
    *segments = 0;
    pkv_tier_record_t r = {.payload_len = o->record_bytes};
    memcpy(r.layout, layout, sizeof layout);
    for (uint64_t i = 0; rc == PKV_OK && i < o->records; i++) {
        if (!s && (rc = pkv_tier_seg_create(dfd, ++*segments, layout, &s))) break;
        memcpy(r.parent, r.key, sizeof r.key);
        memset(r.key, 0, sizeof r.key);
        memcpy(r.key, &i, sizeof i);
        memset(payload, (int)(i & 0xff), o->record_bytes);
        pkv_tier_entry_t e;
        rc = pkv_tier_seg_append(s, &r, payload, &e);
        if (rc == PKV_OK && pkv_tier_seg_bytes(s) >= seg_bytes) {
            rc = pkv_tier_seg_seal(s);
            pkv_tier_seg_close(s);
            s = NULL;
        }
    }
    if (s && rc == PKV_OK) rc = pkv_tier_seg_seal(s);
    pkv_tier_seg_close(s);
    free(payload);
    close(dfd);
    return rc;
}

static void drop_page_cache(void)
{
    sync();
    int fd = open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (write(fd, "3", 1) != 1) fprintf(stderr, "pagekv " CMD ": cannot drop caches\n");
    close(fd);
}

/* Seconds to open the tier on dir (its stats in *st), closed after timing. */
static double time_open(const char *dir, const startup_opts_t *o, pkv_tier_stats_t *st)
{
    if (o->drop_caches) drop_page_cache();
    pkv_tier_config_t cfg = {
        .dir = dir, .max_bytes = cap_for(o), .record_bytes = o->record_bytes, .source = no_source};
    memcpy(cfg.layout, layout, sizeof layout);
    pkv_tier_t *t;
    uint64_t t0 = pkv_now_ns();
    int rc = pkv_tier_open(&cfg, &t);
    double s = (double)(pkv_now_ns() - t0) / 1e9;
    if (rc) {
        fprintf(stderr, "pagekv " CMD ": open %s: %s\n", dir, pkv_status_str(rc));
        return -1;
    }
    pkv_tier_stats(t, st);
    pkv_tier_close(t);
    return s;
}

static void remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    int dfd = dirfd(d);
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.') unlinkat(dfd, e->d_name, 0);
    closedir(d);
    rmdir(dir);
}

static int parse(int argc, char **argv, startup_opts_t *o)
{
    *o = (startup_opts_t){.records = 100000, .record_bytes = 4096, .runs = 3, .base = "/var/tmp"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--startup")) continue;
        if (!strcmp(a, "--drop-caches")) {
            o->drop_caches = true;
            continue;
        }
        if (!v) return pkv_cli_usage_error(CMD, "unknown option or missing value '%s'", a);
        i++;
        if (!strcmp(a, "--records")) {
            if (pkv_cli_parse_u64(v, 1, 10000000, &o->records))
                return pkv_cli_usage_error(CMD, "--records takes 1..10000000");
        } else if (!strcmp(a, "--record-bytes")) {
            if (pkv_cli_parse_bytes(v, &o->record_bytes) || o->record_bytes < 64 ||
                o->record_bytes > (64u << 20))
                return pkv_cli_usage_error(CMD, "--record-bytes takes 64..64M");
        } else if (!strcmp(a, "--runs")) {
            if (pkv_cli_parse_u64(v, 1, 100, &o->runs))
                return pkv_cli_usage_error(CMD, "--runs takes 1..100");
        } else if (!strcmp(a, "--dir")) {
            o->base = v;
        } else if (!strcmp(a, "--json")) {
            o->json = v;
        } else {
            return pkv_cli_usage_error(CMD, "unknown option '%s'", a);
        }
    }
    return 0;
}

static int report(const startup_opts_t *o, const double *full, const double *empty,
                  const pkv_tier_stats_t *st, uint32_t segments)
{
    double mf = pkv_bench_median(full, o->runs), me = pkv_bench_median(empty, o->runs);
    double added = mf - me;
    bool met = added <= 1.0;
    printf("## pagekv bench tiers --startup (%llu records of %llu bytes, %u sealed segments, "
           "%.1f MiB; page cache %s)\n\n",
           (unsigned long long)o->records, (unsigned long long)o->record_bytes, segments,
           (double)st->bytes / 1048576.0, o->drop_caches ? "dropped before each open" : "warm");
    printf("| metric | value | target | met |\n|---|---|---|---|\n");
    printf("| open, %llu records (median of %llu) | %.3f s | | |\n", (unsigned long long)o->records,
           (unsigned long long)o->runs, mf);
    printf("| open, empty directory (median of %llu) | %.3f s | | |\n", (unsigned long long)o->runs,
           me);
    printf("| added by the records | %.3f s | <= 1 s | %s |\n", added, met ? "yes" : "no");
    if (!o->json) return 0;
    json_t *runs_full = json_array(), *runs_empty = json_array();
    for (uint64_t i = 0; i < o->runs; i++) {
        json_array_append_new(runs_full, json_real(full[i]));
        json_array_append_new(runs_empty, json_real(empty[i]));
    }
    json_t *doc = json_pack(
        "{s:I,s:I,s:i,s:I,s:b,s:o,s:o,s:f,s:f,s:f,s:b}", "records", (json_int_t)o->records,
        "record_bytes", (json_int_t)o->record_bytes, "segments", (int)segments, "bytes",
        (json_int_t)st->bytes, "drop_caches", o->drop_caches, "open_s", runs_full, "empty_open_s",
        runs_empty, "open_s_median", mf, "empty_open_s_median", me, "added_s", added, "met", met);
    int rc = pkv_report_write_json(CMD, o->json, doc);
    json_decref(doc);
    return rc ? 1 : 0;
}

int pkv_bench_tier_startup(int argc, char **argv)
{
    startup_opts_t o;
    int rc = parse(argc, argv, &o);
    if (rc) return rc;
    char full_dir[4096], empty_dir[4096];
    snprintf(full_dir, sizeof full_dir, "%s/pkv-startup-XXXXXX", o.base);
    snprintf(empty_dir, sizeof empty_dir, "%s/pkv-startup-XXXXXX", o.base);
    if (!mkdtemp(full_dir) || !mkdtemp(empty_dir)) {
        fprintf(stderr, "pagekv " CMD ": cannot make a directory under %s\n", o.base);
        if (full_dir[strlen(full_dir) - 1] != 'X') rmdir(full_dir);
        return 1;
    }
    uint32_t segments = 0;
    double *full = calloc(o.runs, sizeof(double)), *empty = calloc(o.runs, sizeof(double));
    pkv_tier_stats_t st = {0}, st_empty;
    if (pkv_cli_progress_enabled()) fprintf(stderr, CMD ": writing records...\r");
    rc = full && empty ? write_records(full_dir, &o, &segments) : PKV_ERR_NOMEM;
    if (rc) fprintf(stderr, "pagekv " CMD ": writing records: %s\n", pkv_status_str(rc));
    for (uint64_t i = 0; rc == PKV_OK && i < o.runs; i++) {
        empty[i] = time_open(empty_dir, &o, &st_empty);
        full[i] = time_open(full_dir, &o, &st);
        if (empty[i] < 0 || full[i] < 0)
            rc = PKV_ERR_IO;
        else if (st.records != o.records) {
            fprintf(stderr, "pagekv " CMD ": the tier indexed %llu of %llu records\n",
                    (unsigned long long)st.records, (unsigned long long)o.records);
            rc = PKV_ERR_CORRUPT;
        }
    }
    if (rc == PKV_OK) rc = report(&o, full, empty, &st, segments);
    free(full);
    free(empty);
    remove_dir(full_dir);
    remove_dir(empty_dir);
    return rc ? 1 : 0;
}
