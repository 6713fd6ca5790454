/*
 * Fuzz target for the server's request parser: an HTTP body -> pkv_openai_request_t
 * (pkv_openai_request_parse), then the prompt step with the builtin tokenizer
 * (pkv_openai_request_prompt). The first input byte picks the endpoint (even:
 * /v1/completions, odd: /v1/chat/completions; the corpus uses 'p' and 'm'); the rest is
 * the body. Any broken property aborts (a crash for libFuzzer); refusals are expected.
 * The properties are in props_request.c, which the suite links too.
 *
 *   libFuzzer:  make fuzz; build/san-fuzzer-no-link-address-undefined/fuzz/fuzz_request \
 *                 -max_total_time=60 tests/fuzz/corpus/request
 *   replay:     cc -DPKV_FUZZ_REPLAY_MAIN -g -fsanitize=address,undefined -Iinclude -Isrc \
 *                 -D_GNU_SOURCE tests/fuzz/fuzz_request.c tests/fuzz/props_request.c \
 *                 src/openai/request.c src/tokenizer/[a-z]*.c src/core/core.c \
 *                 -o /tmp/fuzz_request_replay -ljansson -lcrypto -lm -pthread
 *               /tmp/fuzz_request_replay tests/fuzz/corpus/request   (files or directories)
 * The suite replays the corpus too (tests/test_openai.c): files named ok-* must be
 * accepted by both steps, bad-* refused by one of them.
 */
#include "props.h"

PKV_FUZZ_TARGET(pkv_fuzz_request)

#ifdef PKV_FUZZ_REPLAY_MAIN
#include "replay_main.h"
#endif
