/* The router's SSE framing, fuzz properties (see tests/fuzz/props.h, fuzz_sse.c).
 *
 * The relay appends each piece a decode node sends to the leg's buffer and passes on
 * what rt_sse_complete_end() says is complete, keeping the rest for the next piece. Here
 * the stream is cut into pieces the way the first input byte says, fed the same way, and
 * checked against a reference framing of the whole stream: every piece passed on ends
 * with a blank line, what is kept never holds one, and the bytes passed on are the
 * stream up to its last blank line however it was cut (up to one '\n' held back, see
 * below). */
#include "props.h"

#include "core/core.h"
#include "router/router_int.h"

#include <stdlib.h>
#include <string.h>

#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) abort();                                                                      \
    } while (0)

/* The reference: the end of the last "\n\n" in s, scanned from its start. */
static size_t last_event_end(const uint8_t *s, size_t n)
{
    size_t end = 0;
    for (size_t i = 1; i < n; i++)
        if (s[i - 1] == '\n' && s[i] == '\n') end = i + 1;
    return end;
}

static bool holds_blank_line(const char *s, size_t n)
{
    for (size_t i = 1; i < n; i++)
        if (s[i - 1] == '\n' && s[i] == '\n') return true;
    return false;
}

size_t pkv_fuzz_sse(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint64_t cut = data[0] * 0x9e3779b97f4a7c15ull + 1;
    const uint8_t *s = data + 1;
    size_t n = size - 1;
    char *buf = malloc(n + 1), *sent = malloc(n + 1);
    FUZZ_CHECK(buf && sent);
    size_t len = 0, nsent = 0;
    for (size_t off = 0; off < n;) {
        size_t k = 1 + (size_t)(pkv_splitmix64(&cut) % 64); /* 1..64 bytes a piece */
        if (k > n - off) k = n - off;
        size_t old = len;
        memcpy(buf + len, s + off, k);
        len += k;
        off += k;
        size_t end = rt_sse_complete_end(buf, len, old);
        FUZZ_CHECK(end <= len);
        if (end) {
            FUZZ_CHECK(end >= 2 && buf[end - 2] == '\n' && buf[end - 1] == '\n');
            memcpy(sent + nsent, buf, end);
            nsent += end;
            memmove(buf, buf + end, len - end);
            len -= end;
        }
        /* what is kept has no blank line, nor one across the boundary it was cut at */
        FUZZ_CHECK(!holds_blank_line(buf, len));
        FUZZ_CHECK(!(end && len && buf[0] == '\n'));
    }
    /* The whole stream's framing, but for one case: a '\n' that arrives in a later piece
     * than the event it follows is kept with what comes after it (an empty SSE line,
     * relayed with the next event), where the whole stream would count it complete. */
    size_t whole = last_event_end(s, n);
    FUZZ_CHECK(nsent == whole || (nsent + 1 == whole && s[nsent] == '\n'));
    FUZZ_CHECK(nsent + len == n);
    FUZZ_CHECK(memcmp(sent, s, nsent) == 0 && memcmp(buf, s + nsent, len) == 0);
    free(sent);
    free(buf);
    return nsent;
}
