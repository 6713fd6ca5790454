/*
 * tokenizer: the parts common to both kinds: lifetime, accessors, encode dispatch,
 * decode, and the chat template. The kinds fill the same struct (tokenizer_int.h); after
 * creation nothing mutates it, so every call here is safe from many threads at once.
 */
#include "tokenizer/tokenizer_int.h"

#include "core/core.h"

#include <stdlib.h>
#include <string.h>

int tok_alloc_tables(struct pkv_tok *t, int32_t vocab_size, size_t arena_bytes)
{
    size_t v = (size_t)vocab_size;
    t->vocab_size = vocab_size;
    t->special = calloc(v, 1);
    t->arena = malloc(arena_bytes ? arena_bytes : 1);
    t->dec_off = calloc(v, sizeof(uint32_t));
    t->dec_len = calloc(v, sizeof(uint32_t));
    t->piece_off = calloc(v, sizeof(uint32_t));
    t->piece_len = calloc(v, sizeof(uint32_t));
    if (!t->special || !t->arena || !t->dec_off || !t->dec_len || !t->piece_off || !t->piece_len)
        return PKV_ERR_NOMEM;
    for (int i = 0; i < 256; i++) t->byte_id[i] = -1;
    return PKV_OK;
}

void pkv_tok_destroy(pkv_tok_t *tok)
{
    if (!tok) return;
    free(tok->special);
    free(tok->arena);
    free(tok->dec_off);
    free(tok->dec_len);
    free(tok->piece_off);
    free(tok->piece_len);
    free(tok->pair_keys);
    free(tok->pair_ids);
    free(tok->scores);
    free(tok->str_slots);
    free(tok);
}

pkv_tok_kind_t pkv_tok_kind(const pkv_tok_t *tok)
{
    return tok->kind;
}
int32_t pkv_tok_vocab_size(const pkv_tok_t *tok)
{
    return tok->vocab_size;
}
int32_t pkv_tok_bos(const pkv_tok_t *tok)
{
    return tok->bos;
}
int32_t pkv_tok_eos(const pkv_tok_t *tok)
{
    return tok->eos;
}
bool pkv_tok_is_special(const pkv_tok_t *tok, int32_t id)
{
    return id >= 0 && id < tok->vocab_size && tok->special[id];
}

bool pkv_tok_is_stop(const pkv_tok_t *tok, int32_t id)
{
    if (id == tok->eos) return true;
    return tok->kind == PKV_TOK_KIND_BUILTIN && id == tok->bos + TOK_BPE_SPECIAL_END;
}

size_t pkv_tok_utf8_complete(const char *bytes, size_t len)
{
    const uint8_t *s = (const uint8_t *)bytes;
    /* find the last lead byte within the final 3 bytes */
    for (size_t back = 1; back <= 3 && back <= len; back++) {
        uint8_t c = s[len - back];
        if ((c & 0xC0) == 0x80) continue; /* continuation: keep looking for its lead */
        size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
        /* an incomplete sequence is held back; complete or invalid ones go out */
        return need > back ? len - back : len;
    }
    return len;
}

size_t pkv_tok_max_tokens(const pkv_tok_t *tok, size_t len)
{
    (void)tok;
    /* one id per byte at worst, plus BOS, plus llama2c's dummy-prefix space */
    return len + 2;
}

static int encode_into(const pkv_tok_t *tok, const char *text, size_t len, bool add_bos,
                       int32_t *out, size_t cap, size_t *n)
{
    if (add_bos) {
        if (*n >= cap) return PKV_ERR_NOSPACE;
        out[(*n)++] = tok->bos;
    }
    if (tok->kind == PKV_TOK_KIND_BUILTIN)
        return tok_bpe_encode(tok, (const uint8_t *)text, len, out, cap, n);
    return tok_llama2c_encode(tok, (const uint8_t *)text, len, out, cap, n);
}

int pkv_tok_encode(const pkv_tok_t *tok, const char *text, size_t len, bool add_bos, int32_t *out,
                   size_t cap, size_t *n_out)
{
    if (!tok || (!text && len) || (!out && cap) || !n_out) return PKV_ERR_INVALID;
    size_t n = 0;
    int rc = encode_into(tok, text, len, add_bos, out, cap, &n);
    if (rc) return rc;
    *n_out = n;
    return PKV_OK;
}

int pkv_tok_encode_alloc(const pkv_tok_t *tok, const char *text, size_t len, bool add_bos,
                         int32_t **ids_out, size_t *n_out)
{
    if (!tok || (!text && len) || !ids_out || !n_out) return PKV_ERR_INVALID;
    size_t cap = pkv_tok_max_tokens(tok, len);
    int32_t *ids = malloc(sizeof(int32_t) * cap);
    if (!ids) return PKV_ERR_NOMEM;
    size_t n = 0;
    int rc = encode_into(tok, text, len, add_bos, ids, cap, &n);
    if (rc) {
        free(ids);
        return rc;
    }
    /* shrink to fit: a 16k-character prompt is ~4k ids, not 16k */
    int32_t *fit = realloc(ids, sizeof(int32_t) * (n ? n : 1));
    if (fit) ids = fit;
    *ids_out = ids;
    *n_out = n;
    return PKV_OK;
}

int pkv_tok_decode_token(const pkv_tok_t *tok, int32_t prev_id, int32_t id, const char **bytes,
                         size_t *len)
{
    if (!tok || !bytes || !len || id < 0 || id >= tok->vocab_size) return PKV_ERR_INVALID;
    const char *p = tok->arena + tok->dec_off[id];
    size_t l = tok->dec_len[id];
    /* llama2c: the encoder's dummy-prefix space is dropped at the start / after BOS,
     * from text pieces only (not from the byte piece <0x20>), as llama2.c does */
    if (tok->kind == PKV_TOK_KIND_LLAMA2C && (prev_id < 0 || prev_id == tok->bos) &&
        tok->dec_off[id] == tok->piece_off[id] && l > 0 && p[0] == ' ') {
        p++;
        l--;
    }
    *bytes = p;
    *len = l;
    return PKV_OK;
}

int pkv_tok_decode(const pkv_tok_t *tok, const int32_t *ids, size_t n, char **text_out,
                   size_t *len_out)
{
    if (!tok || (!ids && n) || !text_out || !len_out) return PKV_ERR_INVALID;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tok->vocab_size) {
            PKV_LOGE(TOK_LOG, "decode: id %d at index %zu is outside the vocab (%d)", (int)ids[i],
                     i, (int)tok->vocab_size);
            return PKV_ERR_INVALID;
        }
        total += tok->dec_len[ids[i]];
    }
    char *text = malloc(total + 1);
    if (!text) return PKV_ERR_NOMEM;
    size_t off = 0;
    int32_t prev = -1;
    for (size_t i = 0; i < n; i++) {
        const char *p;
        size_t l;
        int rc = pkv_tok_decode_token(tok, prev, ids[i], &p, &l);
        PKV_ASSERT(rc == PKV_OK && off + l <= total);
        memcpy(text + off, p, l);
        off += l;
        prev = ids[i];
    }
    text[off] = '\0';
    *text_out = text;
    *len_out = off;
    return PKV_OK;
}

int pkv_tok_piece(const pkv_tok_t *tok, int32_t id, const char **bytes, size_t *len)
{
    if (!tok || !bytes || !len || id < 0 || id >= tok->vocab_size) return PKV_ERR_INVALID;
    *bytes = tok->arena + tok->piece_off[id];
    *len = tok->piece_len[id];
    return PKV_OK;
}

/* ---- chat template ------------------------------------------------------------------ */
static const char *const role_names[] = {"system", "user", "assistant"};

int pkv_chat_role_parse(const char *s, pkv_chat_role_t *out)
{
    if (!s || !out) return PKV_ERR_INVALID;
    for (int i = 0; i < 3; i++) {
        if (!strcmp(s, role_names[i])) {
            *out = (pkv_chat_role_t)i;
            return PKV_OK;
        }
    }
    return PKV_ERR_INVALID;
}

const char *pkv_chat_role_name(pkv_chat_role_t role)
{
    return (unsigned)role < 3 ? role_names[role] : "unknown";
}

/* A growable id array or byte string: the template writes through one of them. */
struct chat_out {
    const pkv_tok_t *tok;
    bool text;     /* render display text instead of ids */
    int32_t *ids;  /* ids mode */
    char *buf;     /* text mode */
    size_t n, cap; /* elements */
};

static int out_reserve(struct chat_out *o, size_t more)
{
    if (o->n + more <= o->cap) return PKV_OK;
    size_t cap = o->cap ? o->cap : 64;
    while (cap < o->n + more + 1) cap *= 2;
    if (o->text) {
        char *b = realloc(o->buf, cap);
        if (!b) return PKV_ERR_NOMEM;
        o->buf = b;
    } else {
        int32_t *b = realloc(o->ids, sizeof(int32_t) * cap);
        if (!b) return PKV_ERR_NOMEM;
        o->ids = b;
    }
    o->cap = cap;
    return PKV_OK;
}

static int out_special(struct chat_out *o, int32_t id)
{
    if (o->text) {
        const char *p;
        size_t l;
        pkv_tok_piece(o->tok, id, &p, &l);
        int rc = out_reserve(o, l);
        if (rc) return rc;
        memcpy(o->buf + o->n, p, l);
        o->n += l;
        return PKV_OK;
    }
    int rc = out_reserve(o, 1);
    if (rc) return rc;
    o->ids[o->n++] = id;
    return PKV_OK;
}

/* Ordinary text: encoded (never yields a special id) or copied for display. */
static int out_text(struct chat_out *o, const char *s, size_t len)
{
    int rc = out_reserve(o, pkv_tok_max_tokens(o->tok, len));
    if (rc) return rc;
    if (o->text) {
        memcpy(o->buf + o->n, s, len);
        o->n += len;
        return PKV_OK;
    }
    return encode_into(o->tok, s, len, false, o->ids, o->cap, &o->n);
}

static int out_str(struct chat_out *o, const char *s)
{
    return out_text(o, s, strlen(s));
}

static int render_builtin(struct chat_out *o, const pkv_chat_msg_t *msgs, size_t n, bool gen)
{
    const pkv_tok_t *t = o->tok;
    int32_t base = t->bos; /* specials are laid out in enum order from BOS */
    int rc = out_special(o, t->bos);
    for (size_t i = 0; i < n && !rc; i++) {
        int32_t marker = base + TOK_BPE_SPECIAL_SYSTEM + (int32_t)msgs[i].role;
        rc = out_special(o, marker);
        if (!rc) rc = out_str(o, "\n");
        if (!rc) rc = out_text(o, msgs[i].content, msgs[i].content_len);
        if (!rc) rc = out_special(o, base + TOK_BPE_SPECIAL_END);
        if (!rc) rc = out_str(o, "\n");
    }
    if (!rc && gen) {
        rc = out_special(o, base + TOK_BPE_SPECIAL_ASSISTANT);
        if (!rc) rc = out_str(o, "\n");
    }
    return rc;
}

/* Llama 2 chat: each user turn (with the system prompt folded into the first) is its
 * own sentencepiece encode, as in Meta's reference code:
 *   BOS "[INST] <<SYS>>\n" sys "\n<</SYS>>\n\n" user " [/INST]" " " answer " " EOS ... */
static int render_llama2(struct chat_out *o, const pkv_chat_msg_t *msgs, size_t n)
{
    size_t i = 0;
    const pkv_chat_msg_t *sys = NULL;
    if (n > 0 && msgs[0].role == PKV_CHAT_SYSTEM) sys = &msgs[i++];
    int rc = PKV_OK;
    while (i < n && !rc) {
        const pkv_chat_msg_t *user = &msgs[i++];
        const pkv_chat_msg_t *answer = i < n ? &msgs[i++] : NULL;
        /* one encode call per turn: build the turn's text, then encode it whole */
        size_t len = 16 + user->content_len + (sys ? sys->content_len + 32 : 0) +
                     (answer ? answer->content_len + 2 : 0);
        char *turn = malloc(len);
        if (!turn) return PKV_ERR_NOMEM;
        size_t l = 0;
#define APPEND(p, k) (memcpy(turn + l, (p), (k)), l += (k))
        APPEND("[INST] ", 7);
        if (sys) {
            APPEND("<<SYS>>\n", 8);
            APPEND(sys->content, sys->content_len);
            APPEND("\n<</SYS>>\n\n", 11);
            sys = NULL;
        }
        APPEND(user->content, user->content_len);
        APPEND(" [/INST]", 8);
        if (answer) {
            APPEND(" ", 1);
            APPEND(answer->content, answer->content_len);
            APPEND(" ", 1);
        }
#undef APPEND
        PKV_ASSERT(l <= len);
        rc = out_special(o, o->tok->bos);
        if (!rc) rc = out_text(o, turn, l);
        if (!rc && answer) rc = out_special(o, o->tok->eos);
        free(turn);
    }
    return rc;
}

static int chat_validate(const pkv_tok_t *tok, const pkv_chat_msg_t *msgs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if ((unsigned)msgs[i].role > PKV_CHAT_ASSISTANT ||
            (!msgs[i].content && msgs[i].content_len)) {
            PKV_LOGE(TOK_LOG, "chat: message %zu has a bad role or content", i);
            return PKV_ERR_INVALID;
        }
        if (msgs[i].role == PKV_CHAT_SYSTEM && i != 0) {
            PKV_LOGE(TOK_LOG, "chat: a system message is allowed only first (message %zu)", i);
            return PKV_ERR_INVALID;
        }
        if (tok->kind == PKV_TOK_KIND_LLAMA2C) {
            size_t first = (n > 0 && msgs[0].role == PKV_CHAT_SYSTEM) ? 1 : 0;
            if (i >= first) {
                pkv_chat_role_t want = ((i - first) % 2 == 0) ? PKV_CHAT_USER : PKV_CHAT_ASSISTANT;
                if (msgs[i].role != want) {
                    PKV_LOGE(TOK_LOG,
                             "chat: llama 2 chat needs user/assistant turns in turn; message "
                             "%zu is %s",
                             i, pkv_chat_role_name(msgs[i].role));
                    return PKV_ERR_INVALID;
                }
            }
        }
    }
    return PKV_OK;
}

static int chat_render(const pkv_tok_t *tok, const pkv_chat_msg_t *msgs, size_t n, bool gen,
                       struct chat_out *o)
{
    if (!tok || (!msgs && n)) return PKV_ERR_INVALID;
    int rc = chat_validate(tok, msgs, n);
    if (rc) return rc;
    o->tok = tok;
    if (tok->kind == PKV_TOK_KIND_BUILTIN)
        rc = render_builtin(o, msgs, n, gen);
    else
        rc = render_llama2(o, msgs, n);
    return rc;
}

int pkv_tok_chat_template(const pkv_tok_t *tok, const pkv_chat_msg_t *msgs, size_t n,
                          bool add_generation_prompt, int32_t **ids_out, size_t *n_out)
{
    if (!ids_out || !n_out) return PKV_ERR_INVALID;
    struct chat_out o = {0};
    int rc = chat_render(tok, msgs, n, add_generation_prompt, &o);
    if (rc) {
        free(o.ids);
        return rc;
    }
    *ids_out = o.ids;
    *n_out = o.n;
    return PKV_OK;
}

int pkv_tok_chat_render(const pkv_tok_t *tok, const pkv_chat_msg_t *msgs, size_t n,
                        bool add_generation_prompt, char **text_out, size_t *len_out)
{
    if (!text_out || !len_out) return PKV_ERR_INVALID;
    struct chat_out o = {.text = true};
    int rc = chat_render(tok, msgs, n, add_generation_prompt, &o);
    if (!rc) rc = out_reserve(&o, 1);
    if (rc) {
        free(o.buf);
        return rc;
    }
    o.buf[o.n] = '\0';
    *text_out = o.buf;
    *len_out = o.n;
    return PKV_OK;
}
