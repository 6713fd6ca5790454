/*
 * The fuzz targets' properties, compiled once (tests/fuzz/props_*.c into
 * build/libpkvfuzz.a) and linked into both the libFuzzer binaries (tests/fuzz/fuzz_*.c,
 * `make fuzz`) and the test binaries that replay each corpus (test_server,
 * test_xfer_wire, test_tokenizer, test_model, test_router, test_tier). Each pkv_fuzz_<target>()
 * takes one input; a broken property aborts or traps (a crash for libFuzzer, a failed test in
 * the suite).
 */
#ifndef PKV_TESTS_FUZZ_PROPS_H
#define PKV_TESTS_FUZZ_PROPS_H

#include "pagekv/pagekv.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Server request parser: the first byte picks the endpoint (odd: chat), the rest is the
 * body. pkv_fuzz_request_one() is the body's check: 0 refused by the parser, 1 refused by
 * the prompt step, 2 accepted by both. */
void pkv_fuzz_request(const uint8_t *data, size_t size);
int pkv_fuzz_request_one(bool chat, const char *body, size_t len);

/* xfer wire decoder and handle parser: whatever decodes survives a round trip. */
void pkv_fuzz_wire(const uint8_t *data, size_t size);

/* Tokenizer: the first byte picks the mode (builtin BPE round trip, llama2.c parser, chat
 * template), the rest is the payload. */
void pkv_fuzz_tokenizer(const uint8_t *data, size_t size);

/* Disk tier segment parser: any bytes as a segment file. */
void pkv_fuzz_tier(const uint8_t *data, size_t size);

/* llama2.c checkpoint loader: the input is the file (loaded from a memfd); the result
 * agrees with a reference reading of the format and a loaded model holds the file's
 * weights. Returns the loader's status. */
int pkv_fuzz_checkpoint(const uint8_t *data, size_t size);

/* llama2.c tokenizer loader (pkv_tok_load_llama2c_mem): the first byte picks how the
 * vocabulary size is given (see props_tokbin.c); the result agrees with a reference
 * reading of the format and a loaded vocabulary holds the file's pieces. Returns the
 * loader's status (0 for an input too short to say a vocabulary size). */
int pkv_fuzz_tokbin(const uint8_t *data, size_t size);

/* Router SSE framing: the first byte picks how the stream is cut into pieces, the rest
 * is the stream; what is relayed is exactly its complete events, however it is cut.
 * Returns the number of bytes relayed. */
size_t pkv_fuzz_sse(const uint8_t *data, size_t size);

/* A fuzz_*.c target's libFuzzer entry point: each input through `prop` (whose result,
 * if any, is for the suite's replays). */
#define PKV_FUZZ_TARGET(prop)                                                                      \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);                                  \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)                                   \
    {                                                                                              \
        (void)prop(data, size);                                                                    \
        return 0;                                                                                  \
    }

/* Silence the library's log lines (refusals log warnings) while on. */
static inline void pkv_fuzz_log_drop(void *arg, pkv_log_level_t level, const char *module,
                                     const char *line)
{
    (void)arg, (void)level, (void)module, (void)line;
}
static inline void pkv_fuzz_quiet_logs(bool on)
{
    pkv_log_set_sink(on ? pkv_fuzz_log_drop : NULL, NULL);
}

#endif
