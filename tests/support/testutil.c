#include "tests/support/testutil.h"

#include "prim/prim.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

uint64_t pkv_test_seed(uint64_t fallback)
{
    const char *e = getenv("PKV_TEST_SEED");
    return e ? strtoull(e, NULL, 0) : fallback;
}

void pkv_test_skip(const char *test, const char *fmt, ...)
{
    size_t tl = strlen(test);
    if (tl > 3 && strcmp(test + tl - 3, "_fn") == 0) tl -= 3;
    char line[1024];
    int n = snprintf(line, sizeof(line), "SKIP %.*s: ", (int)tl, test);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    for (char *p = line; *p; p++)
        if (*p == '\n') *p = ' '; /* one line per skip, whatever the reason holds */
    strcat(line, "\n");
    fputs(line, stderr);
    const char *file = getenv("PKV_TEST_SKIP_FILE");
    int fd = file && *file ? open(file, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644) : -1;
    if (fd < 0) return;
    ssize_t w = write(fd, line, strlen(line));
    (void)w;
    close(fd);
}

uint64_t pkv_test_rss(void)
{
    pkv_prim_mem_t m;
    if (pkv_prim_mem_read(0, &m) != 0) return 0;
    return m.rss_bytes;
}

uint32_t pkv_test_tcp_conns(pid_t pid, uint16_t port, uint64_t *unread)
{
    uint32_t conns = 0;
    uint64_t rx_sum = 0;
    for (int v6 = 0; v6 < 2; v6++) {
        char path[64], line[512];
        snprintf(path, sizeof(path), "/proc/%d/net/tcp%s", (int)pid, v6 ? "6" : "");
        FILE *f = fopen(path, "r");
        while (f && fgets(line, sizeof(line), f)) {
            unsigned lport, st;
            unsigned long rx;
            if (sscanf(line, " %*d: %*[0-9A-Fa-f]:%x %*[0-9A-Fa-f]:%*x %x %*x:%lx", &lport, &st,
                       &rx) != 3 ||
                lport != port || (st != 0x01 && st != 0x08 && st != 0x09))
                /* established, close-wait, last-ack */
                continue;
            conns++;
            rx_sum += rx;
        }
        if (f) fclose(f);
    }
    if (unread) *unread = rx_sum;
    return conns;
}

uint32_t pkv_test_fault_sweep(pkv_fault_site_t site, int (*step)(void *arg), void *arg, int want_rc,
                              void (*after_fail)(void *arg))
{
    for (uint32_t skip = 0;; skip++) {
        pkv_fault_arm(site, skip, 1);
        int rc = step(arg);
        bool fired = pkv_fault_fired(site) > 0;
        pkv_fault_disarm_all();
        if (!fired) {
            ck_assert_int_eq(rc, PKV_OK);
            return skip;
        }
        ck_assert_int_eq(rc, want_rc);
        if (after_fail) after_fail(arg);
    }
}

uint32_t pkv_test_corpus_each(const char *env, const char *dir, pkv_test_corpus_fn fn, void *arg)
{
    const char *over = env ? getenv(env) : NULL;
    if (over) dir = over;
    DIR *d = opendir(dir);
    ck_assert_msg(d != NULL, "corpus directory %s missing (run from the repository root)", dir);
    uint8_t *buf = malloc(PKV_TEST_CORPUS_MAX);
    ck_assert_ptr_nonnull(buf);
    uint32_t files = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        ck_assert_msg(f != NULL, "%s: cannot open", path);
        size_t n = fread(buf, 1, PKV_TEST_CORPUS_MAX, f);
        fclose(f);
        ck_assert_msg(n < PKV_TEST_CORPUS_MAX, "%s: %zu bytes or more", path, n);
        fn(e->d_name, buf, n, arg);
        files++;
    }
    closedir(d);
    free(buf);
    return files;
}

typedef struct {
    int (*target)(const uint8_t *data, size_t len);
    uint32_t accepted;
} corpus_status_t;

static void corpus_status_one(const char *name, const uint8_t *data, size_t len, void *arg)
{
    corpus_status_t *c = arg;
    int rc = c->target(data, len);
    if (!strncmp(name, "ok-", 3)) ck_assert_msg(rc == PKV_OK, "%s: %s", name, pkv_status_str(rc));
    if (!strncmp(name, "bad-", 4)) ck_assert_msg(rc != PKV_OK, "%s: accepted", name);
    c->accepted += rc == PKV_OK;
}

uint32_t pkv_test_corpus_status(const char *env, const char *dir,
                                int (*target)(const uint8_t *data, size_t len), uint32_t min_files)
{
    corpus_status_t c = {target, 0};
    uint32_t files = pkv_test_corpus_each(env, dir, corpus_status_one, &c);
    ck_assert_msg(files >= min_files, "%s: %u files, expected at least %u", dir, files, min_files);
    return c.accepted;
}

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

void pkv_test_rm_tree(const char *path)
{
    nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

void pkv_test_tmpfile(char *tmpl)
{
    int fd = mkstemp(tmpl);
    ck_assert_msg(fd >= 0, "mkstemp %s", tmpl);
    close(fd);
}
