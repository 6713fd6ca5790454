/*
 * The public API (docs/design/api.md): libpagekv.so exports exactly the functions that
 * include/pagekv/ declares, each declaration carries PKV_API, and every installed header
 * compiles alone as C11 and as C++17 and links from C++.
 *
 * The Makefile compiles in where the sources are and which compilers this build uses
 * (PKV_TEST_SRCDIR, PKV_TEST_CC, PKV_TEST_CXX, PKV_TEST_SANFLAGS). The library checked
 * is the one of this binary's build: <BUILD>/tests/test_api -> <BUILD>/libpagekv.so, so
 * build/, build/san-address-undefined/ and build/san-thread/ each check their own.
 * Nothing here skips: a missing tool or library is a failure.
 */
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"

#include <glob.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef PKV_TEST_SRCDIR
#error "the Makefile defines PKV_TEST_SRCDIR, PKV_TEST_CC, PKV_TEST_CXX, PKV_TEST_SANFLAGS"
#endif

#define INCDIR PKV_TEST_SRCDIR "/include"
#define MARK   "PKV_API_MARK_" /* what PKV_API expands to while the headers are scanned */
#define CFLAGS "-std=c11 -Wall -Wextra -Wstrict-prototypes -Werror -pedantic -fsyntax-only"
/* no -pedantic for C++: stage.h and xfer.h end structs with C99 flexible array members,
 * which g++ and clang++ accept as an extension */
#define CXFLAGS "-std=c++17 -Wall -Wextra -Werror"

/* ---- small helpers ------------------------------------------------------------------ */
typedef struct {
    char **v;
    size_t n, cap;
} names_t;

static void names_add(names_t *l, const char *s)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->v = realloc(l->v, l->cap * sizeof(*l->v));
        ck_assert_ptr_nonnull(l->v);
    }
    l->v[l->n] = strdup(s);
    ck_assert_ptr_nonnull(l->v[l->n]);
    l->n++;
}
static bool names_has(const names_t *l, const char *s)
{
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->v[i], s) == 0) return true;
    return false;
}
static void names_free(names_t *l)
{
    for (size_t i = 0; i < l->n; i++) free(l->v[i]);
    free(l->v);
    *l = (names_t){0};
}
static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}
/* One line "label (n): a b c" on stderr (the suite runner shows a failing binary's tail). */
static void names_print(const char *label, names_t *l)
{
    qsort(l->v, l->n, sizeof(*l->v), cmp_str);
    fprintf(stderr, "%s (%zu):", label, l->n);
    for (size_t i = 0; i < l->n; i++) fprintf(stderr, " %s", l->v[i]);
    fprintf(stderr, "\n");
}

/* Run `cmd` under sh (srvtest's ts_proc_run: the one launcher) with stderr joined to
 * stdout; *out gets the output (caller frees). Returns the exit code (128 + N for signal N). */
static int run_capture(const char *cmd, char **out)
{
    char *argv[] = {"/bin/sh", "-c", (char *)cmd, NULL};
    return ts_proc_run(argv, 600, out);
}

/* The build directory of this binary (<BUILD>/tests/test_api -> <BUILD>). */
static void build_dir(char *dir, size_t cap)
{
    char exe[PATH_MAX];
    ck_assert_ptr_nonnull(realpath("/proc/self/exe", exe));
    for (int up = 0; up < 2; up++) {
        char *slash = strrchr(exe, '/');
        ck_assert_ptr_nonnull(slash);
        *slash = '\0';
    }
    ck_assert_uint_lt(strlen(exe), cap);
    snprintf(dir, cap, "%s", exe);
}

/* The installed headers, sorted (glob sorts). */
static void public_headers(glob_t *g)
{
    int rc = glob(INCDIR "/pagekv/*.h", 0, NULL, g);
    ck_assert_msg(rc == 0 && g->gl_pathc > 0, "no headers under %s", INCDIR "/pagekv");
}
static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* ---- scanning the headers ----------------------------------------------------------- */
typedef struct {
    names_t funcs;    /* functions declared with PKV_API */
    names_t unmarked; /* "header: name" of function declarations without PKV_API */
    names_t odd;      /* "header: what" of top-level declarations the API rules forbid */
} decls_t;

static void decls_free(decls_t *d)
{
    names_free(&d->funcs);
    names_free(&d->unmarked);
    names_free(&d->odd);
}
static void note(names_t *l, const char *header, const char *what)
{
    char line[256];
    snprintf(line, sizeof(line), "%s: %s", base_name(header), what);
    names_add(l, line);
}

/* Split preprocessed text into tokens: identifiers and numbers whole, string and char
 * literals as one "\"" token, everything else one character per token. */
static void tokenize(const char *s, names_t *toks)
{
    while (*s) {
        size_t n = 1;
        if (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r') {
            s++;
            continue;
        }
        if (*s == '_' || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') ||
            (*s >= '0' && *s <= '9')) {
            n = strspn(s, "_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789");
        } else if (*s == '"' || *s == '\'') {
            while (s[n] && s[n] != *s) n += (s[n] == '\\' && s[n + 1]) ? 2 : 1;
            if (s[n]) n++;
            names_add(toks, "\"");
            s += n;
            continue;
        }
        char t[128];
        snprintf(t, sizeof(t), "%.*s", (int)(n < sizeof(t) ? n : sizeof(t) - 1), s);
        names_add(toks, t);
        s += n;
    }
}

static bool is_ident(const char *t)
{
    return t[0] == '_' || (t[0] >= 'a' && t[0] <= 'z') || (t[0] >= 'A' && t[0] <= 'Z');
}

/* One top-level declaration t[0..n) (without its ';'), or a definition when `body`. */
static void scan_statement(char **t, size_t n, bool body, const char *header, decls_t *d)
{
    if (n == 0 || strcmp(t[0], "typedef") == 0) return;
    bool marked = false, is_static = false;
    const char *name = NULL;
    for (size_t i = 0; i < n && !name; i++) {
        if (strcmp(t[i], MARK) == 0) marked = true;
        if (strcmp(t[i], "static") == 0) is_static = true;
        if (strcmp(t[i], "{") == 0) break; /* a struct/enum/union body: no declarator */
        if (strcmp(t[i], "__attribute__") == 0 && i + 1 < n && strcmp(t[i + 1], "(") == 0) {
            int depth = 0; /* skip the attribute's parentheses */
            for (i++; i < n; i++) {
                depth += strcmp(t[i], "(") == 0 ? 1 : strcmp(t[i], ")") == 0 ? -1 : 0;
                if (depth == 0) break;
            }
            continue;
        }
        if (strcmp(t[i], "(") != 0) continue;
        if (i == 0 || !is_ident(t[i - 1]) || (i + 1 < n && strcmp(t[i + 1], "*") == 0)) {
            note(&d->odd, header, "a declaration that is not a plain function prototype");
            return;
        }
        name = t[i - 1];
    }
    if (!name) {
        bool tag_only =
            strcmp(t[0], "struct") == 0 || strcmp(t[0], "enum") == 0 || strcmp(t[0], "union") == 0;
        if (!tag_only) note(&d->odd, header, "a variable declaration");
        return;
    }
    if (body || is_static) {
        if (!(body && is_static)) note(&d->odd, header, name);
        return; /* a static inline helper: compiled into the caller, never exported */
    }
    if (marked)
        names_add(&d->funcs, name);
    else
        note(&d->unmarked, header, name);
}

/* Walk the tokens of one header, cutting top-level declarations at ';' and function
 * definitions at their closing '}'. */
static void scan_tokens(const names_t *toks, const char *header, decls_t *d)
{
    int paren = 0, brace = 0;
    bool fn_body = false;
    size_t start = 0;
    for (size_t i = 0; i < toks->n; i++) {
        const char *t = toks->v[i];
        if (strcmp(t, "(") == 0) paren++;
        if (strcmp(t, ")") == 0) paren--;
        if (strcmp(t, "{") == 0 && brace++ == 0 && paren == 0)
            fn_body = i > start && strcmp(toks->v[i - 1], ")") == 0;
        if (strcmp(t, "}") == 0 && --brace == 0 && paren == 0 && fn_body) {
            scan_statement(toks->v + start, i + 1 - start, true, header, d);
            start = i + 1;
            fn_body = false;
        }
        if (strcmp(t, ";") == 0 && paren == 0 && brace == 0) {
            scan_statement(toks->v + start, i - start, false, header, d);
            start = i + 1;
        }
    }
    if (start < toks->n) note(&d->odd, header, "text after the last declaration");
}

/* Preprocess `header` with PKV_API redefined to MARK and scan the lines that come from
 * the header itself (linemarkers name the file), not from what it includes. */
static void scan_header(const char *header, decls_t *d)
{
    char *cmd = NULL, *out = NULL;
    ck_assert_int_ge(asprintf(&cmd, "%s -E -std=c11 -DPKV_API=%s -I'%s' '%s'", PKV_TEST_CC, MARK,
                              INCDIR, header),
                     0);
    int rc = run_capture(cmd, &out);
    ck_assert_msg(rc == 0, "%s failed (%d):\n%s", cmd, rc, out);
    size_t cap = strlen(out) + 2, len = 0;
    char *own = malloc(cap);
    ck_assert_ptr_nonnull(own);
    bool keep = false;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#') {
            char *q = strchr(line, '"'), *e = q ? strchr(q + 1, '"') : NULL;
            if (e)
                keep = (size_t)(e - q - 1) == strlen(header) && !strncmp(q + 1, header, e - q - 1);
            continue;
        }
        if (!keep) continue;
        len += (size_t)sprintf(own + len, "%s\n", line);
    }
    own[len] = '\0';
    names_t toks = {0};
    tokenize(own, &toks);
    scan_tokens(&toks, header, d);
    names_free(&toks);
    free(own);
    free(out);
    free(cmd);
}

/* ---- the library's dynamic symbols -------------------------------------------------- */
static void exported_symbols(const char *so, names_t *funcs, names_t *data)
{
    char *cmd = NULL, *out = NULL;
    ck_assert_int_ge(asprintf(&cmd, "nm -D --defined-only '%s'", so), 0);
    int rc = run_capture(cmd, &out);
    ck_assert_msg(rc == 0, "%s failed (%d):\n%s", cmd, rc, out);
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        char type, name[256];
        if (sscanf(line, "%*s %c %255s", &type, name) != 2) continue;
        name[strcspn(name, "@")] = '\0'; /* a versioned name: name@@VERSION */
        if (strchr("TWi", type))
            names_add(funcs, name);
        else if (strchr("BDGRSV", type))
            names_add(data, name);
    }
    free(out);
    free(cmd);
}

START_TEST(so_exports_exactly_the_declared_functions)
{
    decls_t d = {0};
    glob_t g;
    public_headers(&g);
    for (size_t i = 0; i < g.gl_pathc; i++) scan_header(g.gl_pathv[i], &d);
    globfree(&g);

    char dir[PATH_MAX], so[PATH_MAX + 32];
    build_dir(dir, sizeof(dir));
    snprintf(so, sizeof(so), "%s/libpagekv.so", dir);
    ck_assert_msg(access(so, R_OK) == 0, "%s: not built", so);
    names_t funcs = {0}, data = {0}, extra = {0}, missing = {0};
    exported_symbols(so, &funcs, &data);
    for (size_t i = 0; i < funcs.n; i++)
        if (!names_has(&d.funcs, funcs.v[i])) names_add(&extra, funcs.v[i]);
    for (size_t i = 0; i < d.funcs.n; i++)
        if (!names_has(&funcs, d.funcs.v[i])) names_add(&missing, d.funcs.v[i]);

    fprintf(stderr, "%s: %zu functions exported, %zu declared in %s/pagekv\n", so, funcs.n,
            d.funcs.n, INCDIR);
    bool ok = extra.n == 0 && missing.n == 0 && data.n == 0 && d.unmarked.n == 0 && d.odd.n == 0;
    if (!ok) {
        names_print("exported by the .so, declared by no public header", &extra);
        names_print("declared PKV_API, not exported (no definition, or hidden)", &missing);
        names_print("data exported by the .so (the API has functions only)", &data);
        names_print("function declarations without PKV_API", &d.unmarked);
        names_print("declarations the API check does not allow", &d.odd);
    }
    ck_assert_uint_gt(d.funcs.n, 0);
    ck_assert_uint_gt(funcs.n, 0);
    ck_assert_msg(
        ok, "exported %zu / declared %zu: %zu extra, %zu missing, %zu data, %zu unmarked, %zu odd",
        funcs.n, d.funcs.n, extra.n, missing.n, data.n, d.unmarked.n, d.odd.n);
    names_free(&funcs);
    names_free(&data);
    names_free(&extra);
    names_free(&missing);
    decls_free(&d);
}
END_TEST

/* The scanner itself: marked, unmarked and odd declarations in a made-up header. */
START_TEST(scanner_flags_unmarked_and_odd_declarations)
{
    char dir[] = "/tmp/pkv-api-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char path[64];
    snprintf(path, sizeof(path), "%s/fake.h", dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("#include \"pagekv/export.h\"\n#include <stddef.h>\n"
          "typedef struct { int a; } pkv_fake_t;\ntypedef void (*pkv_fake_fn)(int);\n"
          "struct pkv_tag { int b; };\n"
          "PKV_API const char *pkv_fake_ok(void);\n"
          "PKV_API void pkv_fake_fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));\n"
          "__attribute__((warn_unused_result)) PKV_API int pkv_fake_attr(void);\n"
          "size_t pkv_fake_unmarked(pkv_fake_t *t,\n    int n);\n"
          "static inline int pkv_fake_inline(void) { return 1; }\n"
          "extern int pkv_fake_var;\nvoid (*pkv_fake_ptr)(void);\n",
          f);
    ck_assert_int_eq(fclose(f), 0);
    decls_t d = {0};
    scan_header(path, &d);
    ck_assert_int_eq(unlink(path), 0);
    ck_assert_int_eq(rmdir(dir), 0);
    ck_assert_uint_eq(d.funcs.n, 3);
    ck_assert(names_has(&d.funcs, "pkv_fake_ok"));
    ck_assert(names_has(&d.funcs, "pkv_fake_fmt"));
    ck_assert(names_has(&d.funcs, "pkv_fake_attr"));
    ck_assert_uint_eq(d.unmarked.n, 1);
    ck_assert_str_eq(d.unmarked.v[0], "fake.h: pkv_fake_unmarked");
    ck_assert_uint_eq(d.odd.n, 2); /* the variable and the function pointer */
    decls_free(&d);
}
END_TEST

/* ---- headers alone, from C and C++ -------------------------------------------------- */
START_TEST(each_header_compiles_alone_as_c_and_cxx)
{
    glob_t g;
    public_headers(&g);
    for (size_t i = 0; i < g.gl_pathc; i++) {
        const char *h = base_name(g.gl_pathv[i]);
        for (int cxx = 0; cxx < 2; cxx++) {
            char *cmd = NULL, *out = NULL;
            /* twice: the include guard; the typedef keeps a macro-only TU non-empty */
            ck_assert_int_ge(asprintf(&cmd,
                                      "printf '#include \"pagekv/%s\"\\n#include "
                                      "\"pagekv/%s\"\\ntypedef int pkv_api_tu_;\\n' | "
                                      "%s %s -fsyntax-only -I'%s' -x %s -",
                                      h, h, cxx ? PKV_TEST_CXX : PKV_TEST_CC,
                                      cxx ? CXFLAGS : CFLAGS, INCDIR, cxx ? "c++" : "c"),
                             0);
            int rc = run_capture(cmd, &out);
            ck_assert_msg(rc == 0, "%s alone as %s: %s\n%s", h, cxx ? "C++" : "C", cmd, out);
            free(out);
            free(cmd);
        }
    }
    globfree(&g);
}
END_TEST

/* A C++ program including every header links against the .so and calls into it. */
START_TEST(cxx_program_links_against_the_so)
{
    char bdir[PATH_MAX], dir[] = "/tmp/pkv-api-XXXXXX", src[64], bin[64];
    build_dir(bdir, sizeof(bdir));
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(src, sizeof(src), "%s/consumer.cpp", dir);
    snprintf(bin, sizeof(bin), "%s/consumer", dir);
    FILE *f = fopen(src, "w");
    ck_assert_ptr_nonnull(f);
    glob_t g;
    public_headers(&g);
    for (size_t i = 0; i < g.gl_pathc; i++)
        fprintf(f, "#include \"pagekv/%s\"\n", base_name(g.gl_pathv[i]));
    globfree(&g);
    fputs("#include <cstdio>\n#include <cstring>\nint main()\n{\n"
          "    if (std::strcmp(pkv_version(), PKV_VERSION_STRING) != 0) return 1;\n"
          "    if (std::strcmp(pkv_status_str(PKV_ERR_NOFIT), \"nofit\") != 0) return 2;\n"
          "    std::printf(\"pagekv %s from C++\\n\", pkv_version());\n    return 0;\n}\n",
          f);
    ck_assert_int_eq(fclose(f), 0);
    char *cmd = NULL, *out = NULL;
    ck_assert_int_ge(asprintf(&cmd,
                              "%s %s %s -I'%s' '%s' -o '%s' -L'%s' -lpagekv -Wl,-rpath,'%s' && "
                              "'%s'",
                              PKV_TEST_CXX, CXFLAGS, PKV_TEST_SANFLAGS, INCDIR, src, bin, bdir,
                              bdir, bin),
                     0);
    int rc = run_capture(cmd, &out);
    unlink(bin);
    unlink(src);
    rmdir(dir);
    ck_assert_msg(rc == 0, "%s: exit %d\n%s", cmd, rc, out);
    ck_assert_msg(strstr(out, "pagekv " PKV_VERSION_STRING " from C++") != NULL, "%s", out);
    free(out);
    free(cmd);
}
END_TEST

static Suite *api_suite(void)
{
    Suite *s = suite_create("api");
    TCase *tc = tcase_create("api");
    tcase_add_test(tc, so_exports_exactly_the_declared_functions);
    tcase_add_test(tc, scanner_flags_unmarked_and_odd_declarations);
    tcase_add_test(tc, each_header_compiles_alone_as_c_and_cxx);
    tcase_add_test(tc, cxx_program_links_against_the_so);
    suite_add_tcase(s, tc);
    return s;
}
PKV_TEST_MAIN(api_suite)
