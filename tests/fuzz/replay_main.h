/*
 * A plain main() for fuzz targets: replays files and directories of inputs through
 * LLVMFuzzerTestOneInput, so a corpus runs without libFuzzer (and under any sanitizer).
 * Include it at the end of a fuzz target, under #ifdef PKV_FUZZ_REPLAY_MAIN.
 */
#ifndef PKV_FUZZ_REPLAY_MAIN_H
#define PKV_FUZZ_REPLAY_MAIN_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    for (size_t r; buf && (r = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += r;
        if (n < cap) continue;
        uint8_t *grown = realloc(buf, cap *= 2);
        if (!grown) free(buf);
        buf = grown;
    }
    fclose(f);
    if (!buf) return -1;
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    int files = 0;
    for (int i = 1; i < argc; i++) {
        DIR *d = opendir(argv[i]);
        if (!d) {
            if (replay_file(argv[i])) {
                fprintf(stderr, "cannot read %s\n", argv[i]);
                return 1;
            }
            files++;
            continue;
        }
        for (struct dirent *e; (e = readdir(d));) {
            if (e->d_name[0] == '.') continue;
            char path[4096];
            snprintf(path, sizeof(path), "%s/%s", argv[i], e->d_name);
            if (replay_file(path) == 0) files++;
        }
        closedir(d);
    }
    printf("%s: replayed %d inputs, no failure\n", argv[0], files);
    return 0;
}

#endif
