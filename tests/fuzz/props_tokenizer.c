/* The tokenizer's fuzz properties (see tests/fuzz/props.h, fuzz_tokenizer.c). */
#include "props.h"

#include "pagekv/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void check_round_trip(const pkv_tok_t *tok, const uint8_t *s, size_t len, bool exact)
{
    int32_t *ids = NULL;
    size_t n = 0;
    if (pkv_tok_encode_alloc(tok, (const char *)s, len, true, &ids, &n) != PKV_OK) abort();
    if (n > pkv_tok_max_tokens(tok, len)) abort();
    char *back = NULL;
    size_t blen = 0;
    if (pkv_tok_decode(tok, ids, n, &back, &blen) != PKV_OK) abort();
    if (exact && (blen != len || memcmp(back, s, len) != 0)) abort();
    for (size_t i = 1; i < n; i++)
        if (pkv_tok_is_special(tok, ids[i]) && ids[i] != 0) abort(); /* forged special */
    free(back);
    free(ids);
}

/* The builtin tokenizer is immutable: one instance serves every input (creating it
 * costs ~2 ms, mostly first-touch page faults). */
static const pkv_tok_t *builtin(void)
{
    static pkv_tok_t *tok;
    if (!tok && pkv_tok_create_builtin(&tok) != PKV_OK) abort();
    return tok;
}

void pkv_fuzz_tokenizer(const uint8_t *data, size_t size)
{
    if (size < 1) return;
    pkv_fuzz_quiet_logs(true);
    uint8_t mode = data[0] % 3;
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    pkv_tok_t *tok = NULL;
    if (mode == 0) {
        check_round_trip(builtin(), p, n, true);
    } else if (mode == 1) {
        /* two bytes of vocab size, then the file */
        if (n < 2) {
            pkv_fuzz_quiet_logs(false);
            return;
        }
        int32_t vocab = (int32_t)(p[0] | p[1] << 8);
        if (pkv_tok_load_llama2c_mem(p + 2, n - 2, vocab, &tok) == PKV_OK) {
            static const uint8_t text[] = "hello world \xc3\xa9\xff\x00 <s> 12345\n";
            /* exact only when every byte has a byte piece, which a fuzzed file need not */
            check_round_trip(tok, text, sizeof(text) - 1, false);
            for (int32_t id = 0; id < pkv_tok_vocab_size(tok); id++) {
                const char *b;
                size_t l;
                if (pkv_tok_decode_token(tok, id ? id - 1 : -1, id, &b, &l) != PKV_OK) abort();
            }
        }
    } else {
        /* messages separated by 0xFF; a message's first byte is its role */
        pkv_chat_msg_t msgs[16];
        size_t m = 0, start = 0;
        for (size_t i = 0; i <= n && m < 16; i++) {
            if (i < n && p[i] != 0xFF) continue;
            if (i > start) {
                msgs[m].role = (pkv_chat_role_t)(p[start] % 4);
                msgs[m].content = (const char *)p + start + 1;
                msgs[m].content_len = i - start - 1;
                m++;
            }
            start = i + 1;
        }
        int32_t *ids = NULL;
        size_t nid = 0;
        if (pkv_tok_chat_template(builtin(), msgs, m, true, &ids, &nid) == PKV_OK) {
            char *text = NULL;
            size_t tl = 0;
            if (pkv_tok_chat_render(builtin(), msgs, m, true, &text, &tl) != PKV_OK) abort();
            free(text);
            free(ids);
        }
    }
    pkv_tok_destroy(tok);
    pkv_fuzz_quiet_logs(false);
}
