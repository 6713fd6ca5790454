/*
 * The CLI's shared argument helpers (see cli.h); linked into the pagekv binary.
 */
#include "support/cli.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int pkv_cli_parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    if (!s || !*s || *s == '-') return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int pkv_cli_parse_u32_list(const char *s, uint64_t lo, uint64_t hi, uint32_t *out, uint32_t cap,
                           uint32_t *n)
{
    char buf[256];
    if (!s || strlen(s) >= sizeof(buf)) return -1;
    snprintf(buf, sizeof(buf), "%s", s);
    *n = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        uint64_t v;
        if (*n == cap || pkv_cli_parse_u64(t, lo, hi, &v)) return -1;
        out[(*n)++] = (uint32_t)v;
    }
    return *n ? 0 : -1;
}

int pkv_cli_parse_bytes(const char *s, uint64_t *out)
{
    if (!s || !*s || *s == '-') return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !isfinite(v) || v < 0) return -1;
    double mult = 1;
    if (*end) {
        switch (*end) {
        case 'k':
        case 'K':
            mult = 1024.0;
            break;
        case 'm':
        case 'M':
            mult = 1024.0 * 1024;
            break;
        case 'g':
        case 'G':
            mult = 1024.0 * 1024 * 1024;
            break;
        case 't':
        case 'T':
            mult = 1024.0 * 1024 * 1024 * 1024;
            break;
        default:
            return -1;
        }
        end++;
        if (*end == 'i') end++;
        if (*end == 'B') end++;
        if (*end) return -1;
    }
    v *= mult;
    if (v >= 18446744073709551615.0) return -1;
    *out = (uint64_t)v;
    return 0;
}

int pkv_cli_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "pagekv %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 2;
}

bool pkv_cli_progress_enabled(void)
{
    return isatty(STDERR_FILENO);
}

int pkv_cli_flag_u32(const char *cmd, const char *flag, const char *v, uint64_t lo, uint64_t hi,
                     uint32_t *out)
{
    uint64_t x;
    if (pkv_cli_parse_u64(v, lo, hi, &x))
        return pkv_cli_usage_error(cmd, "%s wants an integer in [%llu, %llu], got '%s'", flag,
                                   (unsigned long long)lo, (unsigned long long)hi, v);
    *out = (uint32_t)x;
    return 0;
}
