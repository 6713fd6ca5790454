/*
 * The disk tier through the server (src/tier/, src/server/tier.c; docs/design/tier.md):
 * every case asks the same prompts of a server with the tier and of one without it (same
 * weights, tiny preset, 256-token blocks, a fixed sampling seed) and checks the answers
 * and the prompt's KV (/v1/cache/digest) bitwise equal, that nothing stays live or
 * pinned, that the server answers /health, and that /v1/cache/stats "disk" and /metrics
 * pagekv_kv_tier_* say what happened. Cases: a prefix evicted from memory loads back (hit
 * counted once, bytes = the directory's file sizes, files 0600, nothing else in the
 * directory); warm after a restart; kill -9 while writing, then a restart; a flipped byte
 * in a payload and in a header (quarantined, and still after a restart); a segment
 * truncated mid-record; a full disk (fault site, watermark, a cap below a record, a small
 * cap); a read-only directory (a read-only bind mount in a mount namespace of the test's
 * own); another layout's directory (left alone), an int8 server's beside a bf16 server's
 * records; reads past the load deadline and the
 * load-or-recompute
 * decision; an I/O error on read; two servers on one directory; tenants (cache_salt),
 * purge and reset.
 */
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"

#include "pagekv/pagekv.h"
#include "pagekv/server.h"
#include "tier/tier.h"

#include <curl/curl.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define BT      256u          /* tokens per block */
#define NPROMPT (4 * BT + 60) /* 4 full blocks keyed, the rest computed */
#define BLOCKS  4u            /* full blocks of a prompt */
#define PAYLOAD (BT * 256u)   /* tiny, f16: 256 bytes a token */
#define REC     (PKV_TIER_HEADER_BYTES + PAYLOAD)
#define HOST    "127.0.0.1"
#define MAXTOK  8

/* ---- servers ----------------------------------------------------------------------------- */

typedef struct {
    pkv_server_t *s;
    uint16_t port;
} srv_t;

/* A tier server on dir (NULL: no tier) with KV of dtype dt. */
static pkv_server_config_t config_dt(const char *dir, pkv_dtype_t dt)
{
    return (pkv_server_config_t){.threads = 1,
                                 .preset = "tiny",
                                 .block_tokens = BT,
                                 .kv_dtype = dt,
                                 .max_context = 2048,
                                 .budget_mode = PKV_SERVER_BUDGET_BYTES,
                                 .budget_bytes = 32u << 20,
                                 .cache_max_mode = PKV_SERVER_BUDGET_NONE,
                                 .cache_idle_ms = PKV_SERVER_NEVER,
                                 .no_memory_watch = true,
                                 .kv_disk_dir = dir,
                                 .kv_disk_bytes = 64u << 20,
                                 .kv_disk_min_free = UINT64_MAX};
}

static pkv_server_config_t config(const char *dir)
{
    return config_dt(dir, PKV_DTYPE_F16);
}

static void srv_start(srv_t *v, const pkv_server_config_t *cfg)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    v->s = NULL;
    ck_assert_int_eq(pkv_server_create(cfg, &v->s), PKV_OK);
    v->port = pkv_server_port(v->s);
}

static void srv_stop(srv_t *v)
{
    pkv_server_destroy(v->s);
    v->s = NULL;
}

/* A fresh directory for a tier (not created: the server makes it 0700), on a tmpfs where
 * there is one: a read there costs microseconds against milliseconds to compute a block, so
 * the load-or-recompute estimate always loads, however busy the machine's disk is (the
 * tests that want a recompute make the reads slow themselves). */
static void tmpdir(char *dir, size_t n)
{
    char base[64];
    struct stat sb;
    snprintf(base, sizeof(base), "%s/pkv-tsrv-XXXXXX",
             stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) ? "/dev/shm" : "/tmp");
    ck_assert_ptr_nonnull(mkdtemp(base));
    snprintf(dir, n, "%s/kv", base);
}

/* Remove a tmpdir() directory with its base. */
static void rm_tree(const char *dir)
{
    char base[300];
    snprintf(base, sizeof(base), "%s", dir);
    char *slash = strrchr(base, '/');
    if (slash) *slash = 0;
    pkv_test_rm_tree(base);
}

/* ---- requests ------------------------------------------------------------------------------ */

static json_t *prompt_ids(uint32_t id)
{
    json_t *ids = json_array();
    uint64_t st = 0x7e57000u + id;
    for (uint32_t i = 0; i < NPROMPT; i++)
        json_array_append_new(ids, json_integer(10 + (json_int_t)pkv_test_below(&st, 200)));
    return ids;
}

static json_t *post(uint16_t port, const char *path, json_t *body, long *status)
{
    char *b = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    ts_resp_t r;
    ck_assert_int_eq(ts_http(HOST, port, "POST", path, b, "Content-Type: application/json", 60, &r),
                     CURLE_OK);
    free(b);
    *status = r.status;
    json_t *doc = json_loadb(r.body ? r.body : "", r.len, 0, NULL);
    ck_assert_msg(doc, "%s: not JSON: %s", path, r.body ? r.body : "");
    ts_resp_free(&r);
    return doc;
}

typedef struct {
    char text[256];
    long long cached, disk; /* usage.prompt_tokens_details; disk -1 when absent */
    double seconds;
} answer_t;

/* Prompt `id` under `salt` (NULL: none), MAXTOK tokens sampled with a fixed seed. */
static answer_t ask(uint16_t port, uint32_t id, const char *salt)
{
    json_t *req = json_pack("{s:s, s:o, s:i, s:f, s:i}", "model", "tiny", "prompt", prompt_ids(id),
                            "max_tokens", MAXTOK, "temperature", 1.0, "seed", 4242);
    if (salt) json_object_set_new(req, "cache_salt", json_string(salt));
    long st;
    uint64_t t0 = pkv_now_ns();
    json_t *doc = post(port, "/v1/completions", req, &st);
    answer_t a = {.seconds = (double)(pkv_now_ns() - t0) / 1e9};
    ck_assert_msg(st == 200, "status %ld", st);
    snprintf(a.text, sizeof(a.text), "%s", ts_js(doc, "choices.0.text"));
    ck_assert_int_eq(ts_ji(doc, "usage.completion_tokens"), MAXTOK);
    a.cached = ts_ji(doc, "usage.prompt_tokens_details.cached_tokens");
    json_t *d = ts_jp(doc, "usage.prompt_tokens_details.cached_tokens_disk");
    a.disk = d ? json_integer_value(d) : -1;
    json_decref(doc);
    return a;
}

/* The SHA-256 of each KV head over the prompt's cached blocks (/v1/cache/digest). */
static char *digest(uint16_t port, uint32_t id, const char *salt, long long *matched)
{
    json_t *req = json_pack("{s:s, s:o}", "model", "tiny", "prompt", prompt_ids(id));
    if (salt) json_object_set_new(req, "cache_salt", json_string(salt));
    long st;
    json_t *doc = post(port, "/v1/cache/digest", req, &st);
    ck_assert_int_eq(st, 200);
    *matched = ts_ji(doc, "matched_tokens");
    char *s = json_dumps(ts_jp(doc, "ranks"), JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(doc);
    return s;
}

/* The reference: a server without the tier, same weights and sampling. */
typedef struct {
    srv_t ref;
} ref_t;

static void ref_start_dt(ref_t *r, pkv_dtype_t dt)
{
    pkv_server_config_t c = config_dt(NULL, dt);
    srv_start(&r->ref, &c);
}

static void ref_start(ref_t *r)
{
    ref_start_dt(r, PKV_DTYPE_F16);
}

/* Prompt `id` asked of the tier server `port`: the answer, and the KV of its full blocks,
 * bitwise the reference's. */
static answer_t ask_same(ref_t *r, uint16_t port, uint32_t id, const char *salt)
{
    answer_t a = ask(port, id, salt), want = ask(r->ref.port, id, salt);
    ck_assert_str_eq(a.text, want.text);
    long long m1, m2;
    char *d1 = digest(port, id, salt, &m1), *d2 = digest(r->ref.port, id, salt, &m2);
    ck_assert_int_eq(m1, BLOCKS * BT);
    ck_assert_int_eq(m2, BLOCKS * BT);
    ck_assert_str_eq(d1, d2);
    free(d1);
    free(d2);
    return a;
}

static void reset(uint16_t port, const char *body, long want)
{
    json_t *b = json_loads(body, 0, NULL);
    ck_assert_ptr_nonnull(b);
    long st;
    json_t *doc = post(port, "/v1/cache/reset", b, &st);
    ck_assert_msg(st == want, "reset %s: %ld", body, st);
    json_decref(doc);
}

/* ---- what the server says ------------------------------------------------------------------ */

static json_t *stats(uint16_t port)
{
    return ts_get_json(HOST, port, "/v1/cache/stats");
}

static long long disk(json_t *st, const char *field)
{
    char p[96];
    snprintf(p, sizeof(p), "disk.%s", field);
    return ts_ji(st, p);
}

static long long disk_now(uint16_t port, const char *field)
{
    json_t *st = stats(port);
    long long v = disk(st, field);
    json_decref(st);
    return v;
}

/* The value of the sample `name` (with its labels) in /metrics. */
static double metric(uint16_t port, const char *name)
{
    ts_resp_t r;
    ck_assert_int_eq(ts_http(HOST, port, "GET", "/metrics", NULL, NULL, 30, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 200);
    char want[256];
    snprintf(want, sizeof(want), "\n%s ", name);
    const char *p = strstr(r.body, want);
    ck_assert_msg(p, "no %s in /metrics", name);
    double v = strtod(p + strlen(want), NULL);
    ts_resp_free(&r);
    return v;
}

/* Wait (10 s at most) until the writer is idle with `blocks` loadable records. */
static void wait_blocks(uint16_t port, long long blocks)
{
    uint64_t deadline = pkv_deadline_after_ns(10000000000ull);
    long long b = -1, q = -1;
    while (pkv_now_ns() < deadline) {
        json_t *st = stats(port);
        b = disk(st, "blocks"), q = disk(st, "queued");
        json_decref(st);
        if (b == blocks && q == 0) return;
        usleep(20000);
    }
    ck_abort_msg("the tier holds %lld blocks (%lld queued), not %lld", b, q, blocks);
}

/* Nothing live, pinned, in flight or queued (within 10 s: a loader may still be freeing an
 * abandoned job's blocks); the server healthy. The stats then. */
static json_t *settled(uint16_t port)
{
    uint64_t deadline = pkv_deadline_after_ns(10000000000ull);
    for (;;) {
        json_t *st = stats(port);
        bool quiet = ts_ji(st, "blocks.live") == 0 && ts_ji(st, "sequences") == 0 &&
                     ts_ji(st, "requests.in_flight") == 0 && disk(st, "queued") == 0;
        if (quiet || pkv_now_ns() > deadline) {
            ck_assert_msg(quiet, "blocks live %lld, sequences %lld, in flight %lld, queued %lld",
                          ts_ji(st, "blocks.live"), ts_ji(st, "sequences"),
                          ts_ji(st, "requests.in_flight"), disk(st, "queued"));
            ts_resp_t r;
            ck_assert_int_eq(ts_http(HOST, port, "GET", "/health", NULL, NULL, 10, &r), CURLE_OK);
            ck_assert_int_eq(r.status, 200);
            ts_resp_free(&r);
            return st;
        }
        json_decref(st);
        usleep(20000);
    }
}

/* The directory holds only segments, each 0600: the sum of their sizes. */
static uint64_t dir_bytes(const char *dir)
{
    DIR *d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    uint64_t sum = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        char p[512];
        snprintf(p, sizeof(p), "%s/%s", dir, de->d_name);
        struct stat sb;
        uint64_t seq;
        ck_assert_int_eq(lstat(p, &sb), 0);
        ck_assert_msg(S_ISREG(sb.st_mode) && pkv_tier_seg_seq(de->d_name, &seq),
                      "%s is not the tier's", p);
        ck_assert_msg((sb.st_mode & 07777) == 0600, "%s has mode %o", p, sb.st_mode & 07777);
        sum += (uint64_t)sb.st_size;
    }
    closedir(d);
    return sum;
}

/* The tier's bytes, in both reports, equal the directory's. */
static void bytes_match(uint16_t port, const char *dir)
{
    uint64_t du = dir_bytes(dir);
    ck_assert_int_eq(disk_now(port, "bytes"), (long long)du);
    ck_assert_int_eq((long long)metric(port, "pagekv_kv_tier_bytes{tier=\"disk\"}"), (long long)du);
}

/* Segment files by sequence: the path of the k-th (0: oldest). */
static void seg_path(const char *dir, uint32_t k, char *out, size_t n)
{
    struct dirent **list;
    int m = scandir(dir, &list, NULL, alphasort), found = 0;
    ck_assert_int_ge(m, 0);
    for (int i = 0; i < m; i++) {
        uint64_t seq;
        if (pkv_tier_seg_seq(list[i]->d_name, &seq) && (uint32_t)found++ == k)
            ck_assert_int_lt(snprintf(out, n, "%s/%s", dir, list[i]->d_name), (int)n);
        free(list[i]);
    }
    free(list);
    ck_assert_msg(found > (int)k, "no segment %u in %s", k, dir);
}

static uint32_t seg_count(const char *dir)
{
    DIR *d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    uint32_t n = 0;
    struct dirent *de;
    uint64_t seq;
    while ((de = readdir(d))) n += pkv_tier_seg_seq(de->d_name, &seq);
    closedir(d);
    return n;
}

static void flip(const char *path, uint64_t off)
{
    int fd = open(path, O_RDWR);
    ck_assert_int_ge(fd, 0);
    uint8_t b;
    ck_assert_int_eq(pread(fd, &b, 1, (off_t)off), 1);
    b ^= 0x40;
    ck_assert_int_eq(pwrite(fd, &b, 1, (off_t)off), 1);
    close(fd);
}

static uint64_t file_size(const char *path)
{
    struct stat sb;
    ck_assert_int_eq(stat(path, &sb), 0);
    return (uint64_t)sb.st_size;
}

/* A server of KV dtype dt on dir that wrote prompts [lo, hi) (each written, then a clean
 * stop: sealed); r: the reference of that dtype. */
static void seed_dir_dt(ref_t *r, const char *dir, uint32_t lo, uint32_t hi, pkv_dtype_t dt)
{
    pkv_server_config_t c = config_dt(dir, dt);
    srv_t a;
    srv_start(&a, &c);
    long long start = disk_now(a.port, "blocks");
    for (uint32_t i = lo; i < hi; i++) {
        answer_t x = ask_same(r, a.port, i, NULL);
        ck_assert_int_eq(x.cached, 0);
        wait_blocks(a.port, start + (long long)(i - lo + 1) * BLOCKS);
    }
    json_decref(settled(a.port));
    srv_stop(&a);
}

static void seed_dir(ref_t *r, const char *dir, uint32_t lo, uint32_t hi)
{
    seed_dir_dt(r, dir, lo, hi, PKV_DTYPE_F16);
}

/* ---- 1, 2: back from disk, and warm after a restart --------------------------------------- */

START_TEST(evicted_prefix_loads_back_from_disk)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    pkv_server_config_t c = config(dir);
    srv_t v;
    srv_start(&v, &c);
    answer_t a = ask_same(&r, v.port, 1, NULL);
    ck_assert_int_eq(a.cached, 0);
    ck_assert_int_eq(a.disk, 0);
    wait_blocks(v.port, BLOCKS);
    ck_assert_int_eq(disk_now(v.port, "written_blocks"), BLOCKS);
    ck_assert_int_eq(disk_now(v.port, "written_bytes"), BLOCKS * REC);
    bytes_match(v.port, dir);
    struct stat sb;
    ck_assert_int_eq(stat(dir, &sb), 0);
    ck_assert_int_eq(sb.st_mode & 0777, 0700);

    reset(v.port, "{}", 200); /* memory only */
    json_t *st = stats(v.port);
    ck_assert_int_eq(ts_ji(st, "blocks.cached"), 0);
    ck_assert_int_eq(disk(st, "blocks"), BLOCKS);
    json_decref(st);
    a = ask_same(&r, v.port, 1, NULL);
    ck_assert_int_eq(a.cached, BLOCKS * BT);
    ck_assert_int_eq(a.disk, BLOCKS * BT);
    st = settled(v.port);
    ck_assert_int_eq(disk(st, "hit_blocks"), BLOCKS); /* once */
    ck_assert_int_eq(disk(st, "memory_hit_blocks"), 0);
    ck_assert_int_eq(disk(st, "loaded_blocks"), BLOCKS);
    ck_assert_int_eq(disk(st, "loaded_bytes"), BLOCKS * REC);
    ck_assert_int_eq(disk(st, "written_blocks"), BLOCKS); /* loaded blocks are not rewritten */
    ck_assert_int_eq(ts_ji(st, "disk.load_decisions.load"), 1);
    ck_assert_int_eq(ts_ji(st, "disk.load_decisions.recompute"), 0);
    ck_assert_int_eq(disk(st, "corrupt"), 0);
    json_decref(st);
    ck_assert_int_eq(metric(v.port, "pagekv_kv_tier_hit_blocks_total{tier=\"disk\"}"), BLOCKS);
    ck_assert_int_eq(metric(v.port, "pagekv_kv_tier_loaded_bytes_total{tier=\"disk\"}"),
                     BLOCKS * REC);
    ck_assert_int_eq(metric(v.port, "pagekv_kv_tier_load_seconds_count"), 1);

    /* Asked again: a memory hit now, counted there, not again on disk. */
    a = ask_same(&r, v.port, 1, NULL);
    ck_assert_int_eq(a.cached, BLOCKS * BT);
    ck_assert_int_eq(a.disk, 0);
    st = settled(v.port);
    ck_assert_int_eq(disk(st, "hit_blocks"), BLOCKS);
    ck_assert_int_eq(disk(st, "memory_hit_blocks"), BLOCKS);
    json_decref(st);
    ck_assert_int_eq(metric(v.port, "pagekv_kv_tier_hit_blocks_total{tier=\"memory\"}"), BLOCKS);
    bytes_match(v.port, dir);
    srv_stop(&v);
    ck_assert_uint_eq(dir_bytes(dir), BLOCKS * (REC + PKV_TIER_ENTRY_BYTES) +
                                          PKV_TIER_FOOTER_BYTES); /* sealed at the stop */
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

START_TEST(warm_after_a_restart)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    seed_dir(&r, dir, 0, 2);
    pkv_server_config_t c = config(dir);
    srv_t v;
    srv_start(&v, &c);
    json_t *st = stats(v.port);
    ck_assert_int_eq(disk(st, "blocks"), 2 * BLOCKS);
    ck_assert_int_eq(disk(st, "segments"), 1);
    ck_assert_int_eq(disk(st, "corrupt"), 0);
    json_decref(st);
    for (uint32_t i = 0; i < 2; i++) {
        answer_t a = ask_same(&r, v.port, i, NULL);
        ck_assert_int_eq(a.disk, BLOCKS * BT);
    }
    st = settled(v.port);
    ck_assert_int_eq(disk(st, "hit_blocks"), 2 * BLOCKS);
    ck_assert_int_eq(disk(st, "written_blocks"), 0);
    json_decref(st);
    bytes_match(v.port, dir);
    srv_stop(&v);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

/* ---- 3: kill -9 while writing ----------------------------------------------------------- */

static const char *const child_args[] = {"--preset",
                                         "tiny",
                                         "--threads",
                                         "1",
                                         "--block-tokens",
                                         "256",
                                         "--max-context",
                                         "2048",
                                         "--kv-cache-budget",
                                         "32M",
                                         "--prefix-cache-max-bytes",
                                         "none",
                                         "--no-memory-watch",
                                         "--kv-disk-bytes",
                                         "64M",
                                         "--kv-disk-min-free",
                                         "0",
                                         "--kv-disk-dir",
                                         NULL,
                                         NULL};

static void child_start(ts_node_t *n, const char *dir)
{
    const char *args[sizeof(child_args) / sizeof(child_args[0])];
    memcpy(args, child_args, sizeof(args));
    args[sizeof(args) / sizeof(args[0]) - 2] = dir;
    ts_node_start(n, NULL, HOST, false, false, args);
}

START_TEST(kill_9_while_writing_then_restart)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    ts_node_t n;
    child_start(&n, dir);
    /* Two prompts answered and on disk; a third answered, its blocks being written. */
    for (uint32_t i = 0; i < 2; i++) {
        ck_assert_str_eq(ask(n.port, i, NULL).text, ask(r.ref.port, i, NULL).text);
        wait_blocks(n.port, (long long)(i + 1) * BLOCKS);
    }
    ck_assert_str_eq(ask(n.port, 2, NULL).text, ask(r.ref.port, 2, NULL).text);
    ts_node_kill(&n);
    /* The open segment is unsealed; a write the kill cut short leaves a torn record (made
     * here for certain: half of one, after whatever the writer got done). */
    char seg[256];
    seg_path(dir, 0, seg, sizeof(seg));
    ck_assert_int_eq(seg_count(dir), 1);
    uint64_t size = file_size(seg);
    uint64_t whole = size / REC;
    ck_assert_uint_ge(whole, 2 * BLOCKS);
    ck_assert_uint_le(whole, 3 * BLOCKS);
    ck_assert_int_eq(truncate(seg, (off_t)(whole * REC + REC / 2)), 0);

    pkv_server_config_t c = config(dir);
    srv_t v;
    srv_start(&v, &c);
    json_t *st = stats(v.port);
    ck_assert_int_eq(disk(st, "blocks"), (long long)whole);
    ck_assert_int_eq(disk(st, "corrupt"), 1); /* the torn tail */
    ck_assert_int_eq(disk(st, "segments"), 1);
    json_decref(st);
    bytes_match(v.port, dir); /* repaired: truncated after the last whole record, sealed */
    ck_assert_uint_eq(file_size(seg), whole * (REC + PKV_TIER_ENTRY_BYTES) + PKV_TIER_FOOTER_BYTES);
    for (uint32_t i = 0; i < 3; i++) {
        answer_t a = ask_same(&r, v.port, i, NULL);
        uint64_t on_disk = PKV_MIN(BLOCKS, whole - PKV_MIN(whole, (uint64_t)i * BLOCKS));
        ck_assert_int_eq(a.disk, (long long)(on_disk * BT));
    }
    json_decref(settled(v.port));
    ck_assert_int_eq((long long)metric(v.port, "pagekv_kv_tier_corrupt_total{tier=\"disk\"}"), 1);
    srv_stop(&v);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

/* ---- 4, 5: damage --------------------------------------------------------------------------- */

/* Records 1 (payload) and 3 (header) of prompt 0 damaged: each is found on its first load,
 * counted, quarantined and recomputed; its new copy is written; after a restart the index
 * maps the key to the newest copy, so the damaged one is never read again. */
START_TEST(flipped_bytes_are_quarantined_and_recomputed)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    seed_dir(&r, dir, 0, 1);
    char seg[256];
    seg_path(dir, 0, seg, sizeof(seg));
    flip(seg, 1 * REC + PKV_TIER_HEADER_BYTES + 1000); /* a payload byte */
    flip(seg, 3 * REC + 60);                           /* a header byte (the key) */
    pkv_server_config_t c = config(dir);
    srv_t v;
    srv_start(&v, &c);
    ck_assert_int_eq(disk_now(v.port, "blocks"), BLOCKS); /* startup reads the index only */
    answer_t a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.cached, 1 * BT); /* record 1 failed: it and the rest computed */
    ck_assert_int_eq(a.disk, 1 * BT);
    wait_blocks(v.port, BLOCKS); /* record 1 quarantined, its new copy written */
    json_t *st = settled(v.port);
    ck_assert_int_eq(disk(st, "corrupt"), 1);
    ck_assert_int_eq(disk(st, "load_failures"), 1);
    ck_assert_int_eq(disk(st, "written_blocks"), 1);
    json_decref(st);

    reset(v.port, "{}", 200);
    a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.disk, 3 * BT); /* 0, 1 (the new copy), 2; then 3's header fails */
    wait_blocks(v.port, BLOCKS);
    st = settled(v.port);
    ck_assert_int_eq(disk(st, "corrupt"), 2);
    ck_assert_int_eq(disk(st, "written_blocks"), 2);
    json_decref(st);
    ck_assert_int_eq((long long)metric(v.port, "pagekv_kv_tier_corrupt_total{tier=\"disk\"}"), 2);

    reset(v.port, "{}", 200);
    a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.disk, BLOCKS * BT);
    st = settled(v.port);
    ck_assert_int_eq(disk(st, "corrupt"), 2); /* never read again */
    json_decref(st);
    srv_stop(&v);

    /* Restarted: both copies of records 1 and 3 are on disk; the newest wins. */
    srv_start(&v, &c);
    ck_assert_int_eq(disk_now(v.port, "blocks"), BLOCKS);
    a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.disk, BLOCKS * BT);
    st = settled(v.port);
    ck_assert_int_eq(disk(st, "corrupt"), 0);
    json_decref(st);
    bytes_match(v.port, dir);
    srv_stop(&v);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

START_TEST(segment_truncated_mid_record)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    seed_dir(&r, dir, 0, 1);
    char seg[256];
    seg_path(dir, 0, seg, sizeof(seg));
    ck_assert_int_eq(truncate(seg, 2 * REC + 5000), 0); /* inside record 2; no index */
    pkv_server_config_t c = config(dir);
    srv_t v;
    srv_start(&v, &c);
    json_t *st = stats(v.port);
    ck_assert_int_eq(disk(st, "blocks"), 2);
    ck_assert_int_eq(disk(st, "corrupt"), 1);
    json_decref(st);
    bytes_match(v.port, dir);
    answer_t a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.cached, 2 * BT);
    ck_assert_int_eq(a.disk, 2 * BT);
    wait_blocks(v.port, BLOCKS); /* the two lost ones written again */
    json_decref(settled(v.port));
    bytes_match(v.port, dir);
    srv_stop(&v);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

/* ---- 6: a full disk ------------------------------------------------------------------------- */

START_TEST(full_disk_stops_writes_not_serving)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    pkv_server_config_t c = config(dir);
    srv_t v;
    srv_start(&v, &c);
    /* ENOSPC on every append (the fault site): every write dropped, as disk_full. */
    pkv_fault_arm(PKV_FAULT_TIER_WRITE_FULL, 0, 1000);
    answer_t a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.cached, 0);
    json_t *st = settled(v.port);
    ck_assert_int_eq(ts_ji(st, "disk.dropped_writes.disk_full"), BLOCKS);
    ck_assert_int_eq(disk(st, "blocks"), 0);
    ck_assert_int_eq(disk(st, "written_blocks"), 0);
    json_decref(st);
    ck_assert_int_eq(pkv_fault_fired(PKV_FAULT_TIER_WRITE_FULL), BLOCKS);
    ck_assert_int_eq(metric(v.port, "pagekv_kv_tier_dropped_writes_total{cause=\"disk_full\"}"),
                     BLOCKS);
    bytes_match(v.port, dir);
    /* Room again: writing resumes. */
    pkv_fault_disarm_all();
    ask_same(&r, v.port, 1, NULL);
    wait_blocks(v.port, BLOCKS);
    reset(v.port, "{}", 200);
    a = ask_same(&r, v.port, 1, NULL);
    ck_assert_int_eq(a.disk, BLOCKS * BT);
    json_decref(settled(v.port));
    bytes_match(v.port, dir);
    srv_stop(&v);

    /* The free-space watermark: a filesystem with less free than asked stops writes. */
    c.kv_disk_min_free = UINT64_MAX - 1;
    srv_start(&v, &c);
    ask_same(&r, v.port, 2, NULL);
    st = settled(v.port);
    ck_assert_int_eq(ts_ji(st, "disk.dropped_writes.disk_full"), BLOCKS);
    ck_assert_int_eq(disk(st, "written_blocks"), 0);
    json_decref(st);
    srv_stop(&v);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

/* A cap below one record: nothing is ever written (no_room); the directory stays empty. */
START_TEST(cap_below_a_record_writes_nothing)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    pkv_server_config_t c = config(dir);
    c.kv_disk_bytes = REC / 2;
    srv_t v;
    srv_start(&v, &c);
    ask_same(&r, v.port, 0, NULL);
    json_t *st = settled(v.port);
    ck_assert_int_eq(ts_ji(st, "disk.dropped_writes.no_room"), BLOCKS);
    ck_assert_int_eq(disk(st, "bytes"), 0);
    ck_assert_int_eq(disk(st, "capacity_bytes"), REC / 2);
    json_decref(st);
    ck_assert_uint_eq(dir_bytes(dir), 0);
    reset(v.port, "{}", 200);
    answer_t a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.cached, 0);
    json_decref(settled(v.port));
    srv_stop(&v);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

/* A 1 MiB cap (15 records): segments are an eighth of it, so a full directory gives up the
 * oldest eighth, not all of it; the bytes never pass the cap. */
START_TEST(small_cap_evicts_oldest_segments)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    pkv_server_config_t c = config(dir);
    c.kv_disk_bytes = 1u << 20;
    srv_t v;
    srv_start(&v, &c);
    long long max_blocks = 0;
    for (uint32_t i = 0; i < 6; i++) {
        ask_same(&r, v.port, i, NULL);
        json_t *st = settled(v.port);
        uint64_t deadline = pkv_deadline_after_ns(10000000000ull);
        while (disk(st, "written_blocks") < (long long)(i + 1) * BLOCKS &&
               pkv_now_ns() < deadline) {
            json_decref(st);
            usleep(20000);
            st = stats(v.port);
        }
        ck_assert_int_eq(disk(st, "written_blocks"), (long long)(i + 1) * BLOCKS);
        ck_assert_int_le(disk(st, "bytes") + disk(st, "reserved_bytes"), 1 << 20);
        if (i >= 4) /* past the cap: at least 7/8 of it still holds records */
            ck_assert_int_ge(disk(st, "blocks"), 12);
        max_blocks = PKV_MAX(max_blocks, disk(st, "blocks"));
        json_decref(st);
        bytes_match(v.port, dir);
    }
    ck_assert_int_gt(disk_now(v.port, "evicted_segments"), 0);
    ck_assert_int_le(max_blocks, 15);
    reset(v.port, "{}", 200);
    ck_assert_int_eq(ask_same(&r, v.port, 5, NULL).disk, BLOCKS * BT); /* the newest stays */
    ck_assert_int_eq(ask_same(&r, v.port, 0, NULL).disk, 0);           /* the oldest went */
    json_decref(settled(v.port));
    srv_stop(&v);
    ck_assert_uint_le(dir_bytes(dir), 1u << 20);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

/* ---- 7: a read-only directory ---------------------------------------------------------------
 */

/* This (forked, still single-threaded: unshare needs that) test process gets a mount
 * namespace of its own, where a read-only bind mount can be made: the tests run as root,
 * whom file modes do not stop. */
static bool own_mount_namespace(char *why, size_t n)
{
    if (unshare(CLONE_NEWNS) || mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL)) {
        snprintf(why, n, "no mount namespace of its own (%s)", strerror(errno));
        return false;
    }
    return true;
}

START_TEST(read_only_directory)
{
    char dir[128], why[160];
    if (!own_mount_namespace(why, sizeof(why))) {
        PKV_TEST_SKIP("%s", why);
        return;
    }
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    seed_dir(&r, dir, 0, 1);
    ck_assert_int_eq(mount(dir, dir, NULL, MS_BIND, NULL), 0);
    ck_assert_int_eq(mount(NULL, dir, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL), 0);
    uint64_t before = dir_bytes(dir);

    pkv_server_config_t c = config(dir);
    srv_t v;
    srv_start(&v, &c);
    json_t *st = stats(v.port);
    ck_assert(json_is_false(ts_jp(st, "disk.writable")));
    ck_assert_int_eq(disk(st, "blocks"), BLOCKS);
    json_decref(st);
    answer_t a = ask_same(&r, v.port, 0, NULL); /* loads still work */
    ck_assert_int_eq(a.disk, BLOCKS * BT);
    ask_same(&r, v.port, 1, NULL); /* writes do not */
    st = settled(v.port);
    ck_assert_int_eq(ts_ji(st, "disk.dropped_writes.read_only"), BLOCKS);
    long long cached = ts_ji(st, "blocks.cached"), resets = ts_ji(st, "cache_resets");
    ck_assert_int_eq(cached, 2 * BLOCKS);
    json_decref(st);
    /* Dropping the disk tier is refused, and a refused reset changes nothing. */
    reset(v.port, "{\"disk\": true}", 409);
    st = stats(v.port);
    ck_assert_int_eq(ts_ji(st, "blocks.cached"), cached);
    ck_assert_int_eq(ts_ji(st, "cache_resets"), resets);
    ck_assert_int_eq(disk(st, "blocks"), BLOCKS);
    json_decref(st);
    long status;
    json_decref(post(v.port, "/v1/cache/purge", json_pack("{s:s}", "cache_salt", "t"), &status));
    ck_assert_int_eq(status, 409);
    reset(v.port, "{}", 200);
    ck_assert_int_eq(ask_same(&r, v.port, 0, NULL).disk, BLOCKS * BT);
    json_decref(settled(v.port));
    bytes_match(v.port, dir);
    srv_stop(&v);
    ck_assert_uint_eq(dir_bytes(dir), before);
    srv_stop(&r.ref);
    ck_assert_int_eq(umount(dir), 0);
    rm_tree(dir);
}
END_TEST

/* ---- 8: another layout's directory ------------------------------------------------------- */

typedef struct {
    pthread_mutex_t mu;
    uint32_t foreign_lines;
} logs_t;

static void log_sink(void *arg, pkv_log_level_t level, const char *module, const char *line)
{
    logs_t *l = arg;
    pthread_mutex_lock(&l->mu);
    if (strstr(line, "another model's or layout's KV")) l->foreign_lines++;
    pthread_mutex_unlock(&l->mu);
    fprintf(stderr, "[%s] %s\n", module, line);
}

static char *file_read(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc(*len + 1);
    ck_assert_uint_eq(fread(b, 1, *len, f), *len);
    fclose(f);
    return b;
}

/* Segments of another block size, KV dtype or model, sealed and unsealed (as a crash
 * leaves one): each logged once, none loaded, none touched (an unsealed one is not
 * repaired: that is its owner's business); their owner still loads them after. */
START_TEST(another_layouts_directory_is_left_alone)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    seed_dir(&r, dir, 0, 1); /* segment 1 */
    seed_dir(&r, dir, 1, 2); /* segment 2 */
    ck_assert_int_eq(seg_count(dir), 2);
    char s2[256];
    seg_path(dir, 1, s2, sizeof(s2));
    ck_assert_int_eq(truncate(s2, (off_t)(BLOCKS * REC)), 0); /* unsealed: its index gone */
    size_t len[2];
    char s1[256], *before[2];
    seg_path(dir, 0, s1, sizeof(s1));
    before[0] = file_read(s1, &len[0]);
    before[1] = file_read(s2, &len[1]);

    logs_t logs = {.mu = PTHREAD_MUTEX_INITIALIZER};
    pkv_log_set_sink(log_sink, &logs);
    for (int k = 0; k < 3; k++) {
        pkv_server_config_t c = config(dir);
        if (k == 0)
            c.block_tokens = 128; /* another block size */
        else if (k == 1)
            c.kv_dtype = PKV_DTYPE_F32; /* another KV dtype */
        else
            c.weight_seed = 2; /* another model: the same preset's other weights */
        logs.foreign_lines = 0;
        srv_t v;
        srv_start(&v, &c);
        json_t *st = stats(v.port);
        ck_assert_int_eq(disk(st, "foreign_segments"), 2);
        ck_assert_int_eq(disk(st, "blocks"), 0);
        ck_assert_int_eq(disk(st, "corrupt"), 0);
        json_decref(st);
        ck_assert_uint_eq(logs.foreign_lines, 2);
        /* The same answer as this layout's server without the tier. */
        pkv_server_config_t rc = c;
        rc.kv_disk_dir = NULL;
        srv_t other;
        srv_start(&other, &rc);
        answer_t a = ask(v.port, 0, NULL);
        ck_assert_str_eq(a.text, ask(other.port, 0, NULL).text);
        srv_stop(&other);
        ck_assert_int_eq(a.cached, 0);
        json_t *st2 = settled(v.port);
        ck_assert_int_eq(disk(st2, "hit_blocks"), 0);
        json_decref(st2);
        reset(v.port, "{\"disk\": true}", 200); /* its own records only */
        srv_stop(&v);
        for (int i = 0; i < 2; i++) {
            size_t l;
            char *now = file_read(i ? s2 : s1, &l);
            ck_assert_msg(l == len[i] && !memcmp(now, before[i], l), "segment %d was changed", i);
            free(now);
        }
    }
    pkv_log_set_sink(NULL, NULL);
    ck_assert_int_eq(seg_count(dir), 2);
    /* The owner: both segments load (the unsealed one repaired now). */
    pkv_server_config_t c = config(dir);
    srv_t v;
    srv_start(&v, &c);
    ck_assert_int_eq(disk_now(v.port, "blocks"), 2 * BLOCKS);
    for (uint32_t i = 0; i < 2; i++)
        ck_assert_int_eq(ask_same(&r, v.port, i, NULL).disk, BLOCKS * BT);
    json_decref(settled(v.port));
    bytes_match(v.port, dir);
    srv_stop(&v);
    free(before[0]);
    free(before[1]);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

/* A scaled format beside another format's records: an int8 server on a directory a bf16
 * server wrote never loads a bf16 record (the segment is another layout's: counted, logged
 * once, left byte for byte) and answers as an int8 server without the tier, its KV too;
 * restarted on the directory it loads its own records (disk hits) and answers the same;
 * the bf16 owner still loads its records, passing over int8's. */
START_TEST(int8_server_leaves_bf16_records_alone)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r16, r8;
    ref_start_dt(&r16, PKV_DTYPE_BF16);
    ref_start_dt(&r8, PKV_DTYPE_INT8);
    seed_dir_dt(&r16, dir, 0, 1, PKV_DTYPE_BF16);
    ck_assert_int_eq(seg_count(dir), 1);
    char s1[256];
    seg_path(dir, 0, s1, sizeof(s1));
    size_t len;
    char *before = file_read(s1, &len);

    logs_t logs = {.mu = PTHREAD_MUTEX_INITIALIZER};
    pkv_log_set_sink(log_sink, &logs);
    pkv_server_config_t c8 = config_dt(dir, PKV_DTYPE_INT8);
    srv_t v;
    srv_start(&v, &c8);
    json_t *st = stats(v.port);
    ck_assert_int_eq(disk(st, "foreign_segments"), 1);
    ck_assert_int_eq(disk(st, "blocks"), 0);
    json_decref(st);
    ck_assert_uint_eq(logs.foreign_lines, 1);
    answer_t first = ask_same(&r8, v.port, 0, NULL);
    ck_assert_int_eq(first.cached, 0);
    ck_assert_int_eq(first.disk, 0);
    wait_blocks(v.port, BLOCKS); /* its own records */
    st = settled(v.port);
    ck_assert_int_eq(disk(st, "hit_blocks"), 0);
    ck_assert_int_eq(disk(st, "loaded_blocks"), 0);
    json_decref(st);
    srv_stop(&v);
    pkv_log_set_sink(NULL, NULL);
    size_t l;
    char *now = file_read(s1, &l);
    ck_assert_msg(l == len && !memcmp(now, before, l), "the bf16 segment was changed");
    free(now);
    free(before);
    ck_assert_int_eq(seg_count(dir), 2);

    /* Restarted: its own records load. */
    srv_start(&v, &c8);
    st = stats(v.port);
    ck_assert_int_eq(disk(st, "blocks"), BLOCKS);
    ck_assert_int_eq(disk(st, "foreign_segments"), 1);
    json_decref(st);
    answer_t again = ask_same(&r8, v.port, 0, NULL);
    ck_assert_int_eq(again.disk, BLOCKS * BT);
    ck_assert_str_eq(again.text, first.text);
    st = settled(v.port);
    ck_assert_int_gt(disk(st, "hit_blocks"), 0);
    ck_assert_int_eq(disk(st, "hit_blocks"), BLOCKS);
    ck_assert_int_eq(disk(st, "corrupt"), 0);
    json_decref(st);
    srv_stop(&v);

    /* The bf16 owner: its records, not int8's. */
    pkv_server_config_t c16 = config_dt(dir, PKV_DTYPE_BF16);
    srv_start(&v, &c16);
    ck_assert_int_eq(disk_now(v.port, "blocks"), BLOCKS);
    ck_assert_int_eq(disk_now(v.port, "foreign_segments"), 1);
    ck_assert_int_eq(ask_same(&r16, v.port, 0, NULL).disk, BLOCKS * BT);
    json_decref(settled(v.port));
    srv_stop(&v);
    srv_stop(&r8.ref);
    srv_stop(&r16.ref);
    rm_tree(dir);
}
END_TEST

/* ---- 9, 10, 13: slow reads, failed reads, the decision ---------------------------------------
 */

START_TEST(slow_reads_become_a_recompute_within_the_deadline)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    seed_dir(&r, dir, 0, 1);
    pkv_server_config_t c = config(dir);
    c.kv_disk_load_ms = 100;
    srv_t v;
    srv_start(&v, &c);
    /* The first read holds 500 ms (two hits of the site), past the 100 ms deadline. */
    pkv_fault_arm(PKV_FAULT_TIER_READ_SLOW, 0, 2);
    answer_t a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.cached, 0);
    ck_assert_int_eq(a.disk, 0);
    json_t *st = settled(v.port); /* the loader freed the abandoned job's blocks */
    ck_assert_int_eq(disk(st, "load_timeouts"), 1);
    ck_assert_int_eq(disk(st, "hit_blocks"), 0);
    ck_assert_int_eq(ts_ji(st, "disk.load_decisions.load"), 1);
    long long loaded = disk(st, "loaded_blocks"); /* the slow read itself, at most */
    ck_assert_int_le(loaded, 1);
    json_decref(st);
    ck_assert_int_eq(pkv_fault_fired(PKV_FAULT_TIER_READ_SLOW), 2);
    /* The wait ended at the deadline (a margin for sanitizers), not at the read's end. */
    double waited = metric(v.port, "pagekv_kv_tier_load_seconds_sum");
    ck_assert_msg(waited >= 0.099 && waited < 0.35, "waited %.3f s", waited);
    ck_assert_int_eq(metric(v.port, "pagekv_kv_tier_load_timeouts_total"), 1);

    /* The estimate learnt that the disk is slow (0.5 s a block against well under 0.1 s to
     * compute one): the next prefix on disk is recomputed, by decision. */
    pkv_fault_disarm_all();
    reset(v.port, "{}", 200);
    a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.cached, 0);
    st = settled(v.port);
    ck_assert_int_eq(ts_ji(st, "disk.load_decisions.recompute"), 1);
    ck_assert_int_eq(ts_ji(st, "disk.load_decisions.load"), 1);
    ck_assert_int_eq(disk(st, "loaded_blocks"), loaded); /* nothing read */
    json_decref(st);
    ck_assert_int_eq(metric(v.port, "pagekv_kv_tier_load_decisions_total{decision=\"recompute\"}"),
                     1);
    srv_stop(&v);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

START_TEST(read_error_is_recomputed)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    seed_dir(&r, dir, 0, 1);
    pkv_server_config_t c = config(dir);
    srv_t v;
    srv_start(&v, &c);
    pkv_fault_arm(PKV_FAULT_TIER_READ_IO, 1, 1); /* the second record's read fails */
    answer_t a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.cached, BT);
    ck_assert_int_eq(a.disk, BT);
    ck_assert_int_eq(pkv_fault_fired(PKV_FAULT_TIER_READ_IO), 1);
    wait_blocks(v.port, BLOCKS);
    json_t *st = settled(v.port);
    ck_assert_int_eq(disk(st, "load_failures"), 1);
    ck_assert_int_eq(disk(st, "corrupt"), 0);
    ck_assert_int_eq(disk(st, "hit_blocks"), 1);
    ck_assert_int_eq(disk(st, "written_blocks"), 1); /* quarantined, so written again */
    json_decref(st);
    reset(v.port, "{}", 200);
    a = ask_same(&r, v.port, 0, NULL);
    ck_assert_int_eq(a.disk, BLOCKS * BT);
    json_decref(settled(v.port));
    bytes_match(v.port, dir);
    srv_stop(&v);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

/* ---- 11: two servers, one directory --------------------------------------------------------
 */

START_TEST(second_server_refused_until_the_first_dies)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ts_node_t a;
    child_start(&a, dir);
    char args[512], out[8192];
    snprintf(args, sizeof(args), "serve --port 0 --preset tiny --kv-disk-dir %s", dir);
    int code = ts_pagekv_run(args, out, sizeof(out));
    ck_assert_msg(code != 0, "the second server started: %s", out);
    ck_assert_msg(strstr(out, "is in use by another live server"), "%s", out);
    /* In-process too: the same refusal, nothing left behind. */
    pkv_server_config_t c = config(dir);
    pkv_server_t *s = NULL;
    ck_assert_int_ne(pkv_server_create(&c, &s), PKV_OK);
    ck_assert_ptr_null(s);
    ts_node_kill(&a);
    ts_node_t b;
    child_start(&b, dir);
    ask(b.port, 0, NULL);
    wait_blocks(b.port, BLOCKS);
    ts_node_stop(&b);
    rm_tree(dir);
}
END_TEST

/* ---- 12: tenants, purge, reset --------------------------------------------------------------
 */

START_TEST(tenants_purge_and_reset)
{
    char dir[128];
    tmpdir(dir, sizeof(dir));
    ref_t r;
    ref_start(&r);
    pkv_server_config_t c = config(dir);
    srv_t v;
    srv_start(&v, &c);
    ask_same(&r, v.port, 0, "alice");
    wait_blocks(v.port, BLOCKS);
    reset(v.port, "{}", 200); /* memory only: the disk keeps alice's blocks */
    ck_assert_int_eq(disk_now(v.port, "blocks"), BLOCKS);
    answer_t a = ask_same(&r, v.port, 0, "bob"); /* the same prompt, another tenant */
    ck_assert_int_eq(a.cached, 0);
    ck_assert_int_eq(a.disk, 0);
    wait_blocks(v.port, 2 * BLOCKS);
    a = ask_same(&r, v.port, 0, NULL); /* no salt: a tenant of its own too */
    ck_assert_int_eq(a.cached, 0);
    wait_blocks(v.port, 3 * BLOCKS);
    ck_assert_int_eq(disk_now(v.port, "hit_blocks"), 0);
    reset(v.port, "{}", 200);
    a = ask_same(&r, v.port, 0, "alice");
    ck_assert_int_eq(a.disk, BLOCKS * BT);

    /* Alice purged from both tiers: nothing of hers answers, now or after a restart. */
    long st;
    json_t *doc = post(v.port, "/v1/cache/purge", json_pack("{s:s}", "cache_salt", "alice"), &st);
    ck_assert_int_eq(st, 200);
    ck_assert_int_eq(ts_ji(doc, "memory_blocks"), BLOCKS);
    json_decref(doc);
    json_t *lk = json_pack("{s:s, s:o, s:s}", "model", "tiny", "prompt", prompt_ids(0),
                           "cache_salt", "alice");
    doc = post(v.port, "/v1/cache/lookup", lk, &st);
    ck_assert_int_eq(ts_ji(doc, "matched_tokens") + ts_ji(doc, "disk_matched_tokens"), 0);
    json_decref(doc);
    json_decref(settled(v.port));
    bytes_match(v.port, dir);
    srv_stop(&v);
    srv_start(&v, &c);
    a = ask_same(&r, v.port, 0, "alice");
    ck_assert_int_eq(a.cached, 0);
    wait_blocks(v.port, disk_now(v.port, "blocks")); /* her new copy written */
    ck_assert_int_gt(disk_now(v.port, "blocks"), 0);

    /* {"disk": true}: both tiers empty, the directory too. */
    reset(v.port, "{\"disk\": true}", 200);
    json_t *s2 = settled(v.port);
    ck_assert_int_eq(disk(s2, "blocks"), 0);
    ck_assert_int_eq(disk(s2, "bytes"), 0);
    ck_assert_int_eq(ts_ji(s2, "blocks.cached"), 0);
    json_decref(s2);
    ck_assert_uint_eq(dir_bytes(dir), 0);
    ck_assert_int_eq(ask_same(&r, v.port, 0, "alice").cached, 0);
    ck_assert_int_eq(ask_same(&r, v.port, 0, "bob").cached, 0);
    json_decref(settled(v.port));
    srv_stop(&v);
    srv_stop(&r.ref);
    rm_tree(dir);
}
END_TEST

/* Each test its own case (CK_RUN_CASE=name runs one). */
#define ADD(s, fn)                                                                                 \
    do {                                                                                           \
        TCase *tc_ = tcase_create(#fn);                                                            \
        tcase_set_timeout(tc_, 120);                                                               \
        tcase_add_test(tc_, fn);                                                                   \
        suite_add_tcase(s, tc_);                                                                   \
    } while (0)

static Suite *tier_server_suite(void)
{
    Suite *s = suite_create("tier_server");
    ADD(s, evicted_prefix_loads_back_from_disk);
    ADD(s, warm_after_a_restart);
    ADD(s, kill_9_while_writing_then_restart);
    ADD(s, flipped_bytes_are_quarantined_and_recomputed);
    ADD(s, segment_truncated_mid_record);
    ADD(s, full_disk_stops_writes_not_serving);
    ADD(s, cap_below_a_record_writes_nothing);
    ADD(s, small_cap_evicts_oldest_segments);
    ADD(s, read_only_directory);
    ADD(s, another_layouts_directory_is_left_alone);
    ADD(s, int8_server_leaves_bf16_records_alone);
    ADD(s, slow_reads_become_a_recompute_within_the_deadline);
    ADD(s, read_error_is_recomputed);
    ADD(s, second_server_refused_until_the_first_dies);
    ADD(s, tenants_purge_and_reset);
    return s;
}

PKV_TEST_MAIN(tier_server_suite)
