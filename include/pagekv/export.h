/*
 * pagekv export macro. The library is built with -fvisibility=hidden: only
 * declarations marked PKV_API (every function declared in include/pagekv/) are
 * exported from libpagekv.so. Every public header includes this one.
 *
 * A consumer may define PKV_API itself before including any pagekv header (for
 * example empty); tests/test_api.c does so to list the marked declarations.
 */
#ifndef PAGEKV_EXPORT_H
#define PAGEKV_EXPORT_H

#ifndef PKV_API
#if defined(__GNUC__) || defined(__clang__)
#define PKV_API __attribute__((visibility("default")))
#else
#define PKV_API
#endif
#endif

#endif
