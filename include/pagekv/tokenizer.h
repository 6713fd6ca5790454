/*
 * pagekv tokenizer: text <-> token ids for the built-in model and for llama2.c models.
 *
 * Two kinds behind one handle:
 *   - builtin (pkv_tok_create_builtin): a byte-level BPE whose merge table is compiled
 *     into the library (trained on general English text shipped by Debian packages, by
 *     `pagekv tokenizer train` via scripts/gen-bpe-merges.sh; see docs/design/tokenizer.md). Ids
 * 0..255 are the 256 single bytes, then the merges, then the special tokens (BOS, EOS and the chat
 * markers) at the end of the vocab. Every byte string encodes (byte fallback), and
 * decode(encode(s)) == s exactly.
 *   - llama2c (pkv_tok_load_llama2c): llama2.c's tokenizer.bin (scores + pieces), with
 *     its sentencepiece-like greedy merge-by-score encode, a dummy-prefix space, and
 *     <0xXX> byte-fallback pieces. BOS = 1, EOS = 2.
 *
 * Special tokens cannot be forged: encoding text never yields a special id, whatever
 * the text ("<|user|>" encodes as ordinary text). Specials enter a sequence only
 * through add_bos or pkv_tok_chat_template.
 *
 * Thread safety: a pkv_tok_t is immutable after creation; every function taking a
 * const pkv_tok_t * may run concurrently from any number of threads.
 *
 * Ownership: create/load allocate the tokenizer, pkv_tok_destroy frees it (NULL is a
 * no-op). Arrays and strings returned through `**out` parameters of the *_alloc,
 * decode and chat functions are malloc'd and freed by the caller with free().
 * Pointers returned by pkv_tok_decode_token / pkv_tok_piece point into the tokenizer
 * and stay valid until it is destroyed.
 */
#ifndef PAGEKV_TOKENIZER_H
#define PAGEKV_TOKENIZER_H

#include "pagekv/export.h"

#include "pagekv/pagekv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pkv_tok pkv_tok_t;

typedef enum {
    PKV_TOK_KIND_BUILTIN = 0, /* compiled-in byte-level BPE */
    PKV_TOK_KIND_LLAMA2C = 1, /* llama2.c tokenizer.bin */
} pkv_tok_kind_t;

/* The built-in tokenizer. Cheap (builds lookup tables from the compiled-in merges). */
PKV_API int pkv_tok_create_builtin(pkv_tok_t **out);

/* Load llama2.c's tokenizer.bin. `vocab_size` comes from the model checkpoint's
 * header (the file does not store it). Layout: int32 max_token_length, then for each
 * of vocab_size tokens: f32 score, int32 len, len bytes (no NUL). Truncated files,
 * trailing bytes, negative or over-long lengths, non-finite scores and vocab sizes
 * below 3 are PKV_ERR_CORRUPT / PKV_ERR_INVALID with a logged message naming the
 * token index and byte offset; a missing file is PKV_ERR_IO. */
PKV_API int pkv_tok_load_llama2c(const char *path, int32_t vocab_size, pkv_tok_t **out);
/* The same from memory (the bytes are copied; `data` may be freed afterwards). */
PKV_API int pkv_tok_load_llama2c_mem(const void *data, size_t len, int32_t vocab_size,
                                     pkv_tok_t **out);

PKV_API void pkv_tok_destroy(pkv_tok_t *tok);

PKV_API pkv_tok_kind_t pkv_tok_kind(const pkv_tok_t *tok);
/* Number of ids: every id in [0, vocab_size) is valid for decode. */
PKV_API int32_t pkv_tok_vocab_size(const pkv_tok_t *tok);
PKV_API int32_t pkv_tok_bos(const pkv_tok_t *tok);
PKV_API int32_t pkv_tok_eos(const pkv_tok_t *tok);
/* True for BOS, EOS, chat markers (builtin) and unk/BOS/EOS (llama2c). */
PKV_API bool pkv_tok_is_special(const pkv_tok_t *tok, int32_t id);
/* True for ids that end a generation: EOS, and for the builtin also <|end|> (the
 * marker that closes a turn in the chat template). */
PKV_API bool pkv_tok_is_stop(const pkv_tok_t *tok, int32_t id);

/* An upper bound on the ids pkv_tok_encode produces for `len` bytes of text
 * (with add_bos): size `out` with it to never see PKV_ERR_NOSPACE. */
PKV_API size_t pkv_tok_max_tokens(const pkv_tok_t *tok, size_t len);

/* Encode `len` bytes of `text` (any bytes, NULs included; need not be valid UTF-8)
 * into `out` (capacity `cap` ids), prepending BOS when add_bos. On success *n_out is
 * the number of ids written. PKV_ERR_NOSPACE when cap is too small (nothing useful in
 * out, *n_out untouched); PKV_ERR_NOMEM. Deterministic: the same text always gives
 * the same ids. */
PKV_API int pkv_tok_encode(const pkv_tok_t *tok, const char *text, size_t len, bool add_bos,
                           int32_t *out, size_t cap, size_t *n_out);
/* The same into a malloc'd array (*ids_out, caller frees; never NULL on success, even
 * for zero ids). */
PKV_API int pkv_tok_encode_alloc(const pkv_tok_t *tok, const char *text, size_t len, bool add_bos,
                                 int32_t **ids_out, size_t *n_out);

/* Streaming decode: the bytes that token `id` contributes when it follows `prev_id`
 * (-1 at the start of a sequence). Special tokens contribute no bytes (len 0). For
 * llama2c, a leading space is dropped right after BOS (the dummy prefix), as
 * llama2.c does. The bytes may be a partial UTF-8 sequence; concatenating the pieces
 * of a sequence equals pkv_tok_decode of it. PKV_ERR_INVALID for an id out of range. */
PKV_API int pkv_tok_decode_token(const pkv_tok_t *tok, int32_t prev_id, int32_t id,
                                 const char **bytes, size_t *len);
/* Streaming helper: how many of `len` bytes can be emitted now without splitting a
 * UTF-8 sequence, i.e. `len` minus the bytes of an incomplete but still possible
 * sequence at the end (at most 3). Invalid bytes are not held back (they can never
 * complete), so a caller that holds back the rest, prepends it to the next piece, and
 * flushes it when the stream ends emits every byte exactly once. */
PKV_API size_t pkv_tok_utf8_complete(const char *bytes, size_t len);

/* Decode a whole sequence into a malloc'd buffer (*text_out, caller frees; always
 * NUL-terminated for convenience, *len_out excludes the NUL; the text may contain NULs).
 * decode(encode(s, add_bos)) == s for every byte string s with the builtin tokenizer,
 * and with llama2c when every byte of s is representable (byte pieces present).
 * ids[0] is taken as the start of a sequence (llama2c drops the dummy-prefix space
 * there); to decode a continuation, use pkv_tok_decode_token with the real prev_id. */
PKV_API int pkv_tok_decode(const pkv_tok_t *tok, const int32_t *ids, size_t n, char **text_out,
                           size_t *len_out);

/* The raw vocabulary piece of `id` for display and debugging: bytes for ordinary
 * tokens, the marker name for specials ("<|user|>", "<s>"), "<0x0A>" style for
 * llama2c byte pieces. */
PKV_API int pkv_tok_piece(const pkv_tok_t *tok, int32_t id, const char **bytes, size_t *len);

/* ---- chat template ------------------------------------------------------------- */
typedef enum {
    PKV_CHAT_SYSTEM = 0,
    PKV_CHAT_USER = 1,
    PKV_CHAT_ASSISTANT = 2,
} pkv_chat_role_t;

/* "system" / "user" / "assistant" -> role; PKV_ERR_INVALID otherwise. */
PKV_API int pkv_chat_role_parse(const char *s, pkv_chat_role_t *out);
PKV_API const char *pkv_chat_role_name(pkv_chat_role_t role);

typedef struct {
    pkv_chat_role_t role;
    const char *content; /* any bytes */
    size_t content_len;
} pkv_chat_msg_t;

/* Messages -> prompt ids (malloc'd, caller frees).
 * builtin:  BOS, then per message  <|role|> "\n" content <|end|> "\n",
 *           then, when add_generation_prompt,  <|assistant|> "\n".
 *           Markers are special ids; content is encoded as plain text, so content can
 *           never close a turn or open another.
 * llama2c:  the Llama 2 chat format: BOS "[INST] <<SYS>>\n" system "\n<</SYS>>\n\n"
 *           user " [/INST]" then " " assistant " " EOS, BOS "[INST] " ... per turn.
 *           Its markers are text (as in Llama 2 itself) apart from BOS/EOS; turns must
 *           alternate user/assistant; add_generation_prompt has no effect (a user turn
 *           always ends with " [/INST]").
 * A system message is allowed only first. PKV_ERR_INVALID for a bad role/order. */
PKV_API int pkv_tok_chat_template(const pkv_tok_t *tok, const pkv_chat_msg_t *msgs, size_t n,
                                  bool add_generation_prompt, int32_t **ids_out, size_t *n_out);
/* The same prompt rendered as display text (malloc'd, NUL-terminated, caller frees):
 * for logs and debugging only; encoding this text does NOT reproduce the special ids. */
PKV_API int pkv_tok_chat_render(const pkv_tok_t *tok, const pkv_chat_msg_t *msgs, size_t n,
                                bool add_generation_prompt, char **text_out, size_t *len_out);

#ifdef __cplusplus
}
#endif
#endif
