/*
 * Argument helpers for the pagekv CLI's commands and benchmarks: sizes, bounded integers,
 * usage errors, whether to print progress.
 */
#ifndef PKV_SUPPORT_CLI_H
#define PKV_SUPPORT_CLI_H

#include <stdbool.h>
#include <stdint.h>

/* Parse "123", "64K", "2M", "1.5G" (powers of 1024) into bytes. -1 on bad input. */
int pkv_cli_parse_bytes(const char *s, uint64_t *out);
/* Parse an unsigned integer within [lo, hi]. -1 on bad input. */
int pkv_cli_parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out);
/* A comma-separated list of 1..cap integers, each within [lo, hi], into out[0..*n). -1 on
 * bad input (out and *n then undefined). */
int pkv_cli_parse_u32_list(const char *s, uint64_t lo, uint64_t hi, uint32_t *out, uint32_t cap,
                           uint32_t *n);
/* A flag's integer within [lo, hi] into *out: 0, or the usage error "FLAG wants an integer in
 * [LO, HI], got 'V'" (returns 2). */
int pkv_cli_flag_u32(const char *cmd, const char *flag, const char *v, uint64_t lo, uint64_t hi,
                     uint32_t *out);
/* Print "pagekv NAME: message" to stderr and return 2 (usage error exit code). */
int pkv_cli_usage_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* True when stderr is a terminal (progress lines go there). */
bool pkv_cli_progress_enabled(void);

#endif
