/*
 * server generation output (see gen.h).
 */
#include "server/gen.h"

#include <string.h>

void srv_gen_init(srv_gen_t *g)
{
    memset(g, 0, sizeof(*g));
}

void srv_gen_feed(srv_gen_t *g, const pkv_request_output_t *o, const char **text, size_t *len)
{
    *text = o->text;
    *len = o->text_len;
    if (!o->finished) return;
    g->finished = true;
    g->finish = o->finish;
    g->status = o->status;
    g->prompt_tokens = o->prompt_tokens;
    g->cached_tokens = o->cached_tokens;
    g->completion_tokens = o->completion_tokens;
    g->preemptions = o->preemptions;
}

const char *srv_gen_finish_reason(const srv_gen_t *g)
{
    if (!g->finished) return NULL;
    if (g->finish == PKV_FINISH_STOP) return "stop";
    if (g->finish == PKV_FINISH_LENGTH) return "length";
    return NULL;
}

size_t srv_utf8_sanitize(const char *in, size_t len, char *out)
{
    const unsigned char *s = (const unsigned char *)in;
    size_t i = 0, o = 0;
    while (i < len) {
        unsigned c = s[i];
        if (c < 0x80) {
            out[o++] = (char)c;
            i++;
            continue;
        }
        unsigned need, lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF)
            need = 1;
        else if (c == 0xE0)
            need = 2, lo = 0xA0;
        else if (c == 0xED)
            need = 2, hi = 0x9F;
        else if (c >= 0xE1 && c <= 0xEF)
            need = 2;
        else if (c == 0xF0)
            need = 3, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3)
            need = 3;
        else if (c == 0xF4)
            need = 3, hi = 0x8F;
        else
            need = 0; /* never a lead byte */
        size_t j = i + 1;
        unsigned got = 0;
        if (need && j < len && s[j] >= lo && s[j] <= hi) {
            j++, got++;
            while (got < need && j < len && s[j] >= 0x80 && s[j] <= 0xBF) j++, got++;
        }
        if (need && got == need) {
            memcpy(out + o, s + i, j - i);
            o += j - i;
        } else {
            out[o++] = (char)0xEF, out[o++] = (char)0xBF, out[o++] = (char)0xBD;
        }
        i = j;
    }
    return o;
}
