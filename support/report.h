/*
 * Writing a command's results: a jansson object to the file named by --json. Shared by the
 * CLI's commands and the benchmarks.
 */
#ifndef PKV_SUPPORT_REPORT_H
#define PKV_SUPPORT_REPORT_H

#include <jansson.h>

/* Write obj to path (pretty, sorted keys); 0, or -1 with "pagekv CMD: cannot write PATH"
 * on stderr. obj stays the caller's. */
int pkv_report_write_json(const char *cmd, const char *path, json_t *obj);

#endif
