/*
 * A command's results to a file (see report.h).
 */
#include "support/report.h"

#include <stdio.h>

int pkv_report_write_json(const char *cmd, const char *path, json_t *obj)
{
    if (json_dump_file(obj, path, JSON_INDENT(2) | JSON_SORT_KEYS) != 0) {
        fprintf(stderr, "pagekv %s: cannot write %s\n", cmd, path);
        return -1;
    }
    return 0;
}
