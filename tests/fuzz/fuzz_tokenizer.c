/*
 * Fuzz target for the tokenizer: the builtin BPE's round trip, the llama2.c
 * tokenizer.bin parser (and encode/decode with whatever vocabulary it accepts), and the
 * chat template. The first input byte picks the mode; the rest is the payload. Any broken
 * property aborts (a crash for libFuzzer); parse errors are expected. The properties are
 * in props_tokenizer.c, which the suite links too.
 *
 *   libFuzzer:  make fuzz; build/san-fuzzer-no-link-address-undefined/fuzz/fuzz_tokenizer \
 *                 -max_total_time=60 tests/fuzz/corpus/tokenizer
 *   replay:     cc -DPKV_FUZZ_REPLAY_MAIN -g -fsanitize=address,undefined -Iinclude -Isrc \
 *                 -D_GNU_SOURCE tests/fuzz/fuzz_tokenizer.c tests/fuzz/props_tokenizer.c \
 *                 src/tokenizer/[a-z]*.c src/core/core.c -o /tmp/fuzz_tokenizer_replay -lm -pthread
 *               /tmp/fuzz_tokenizer_replay tests/fuzz/corpus/tokenizer   (files or directories)
 * The suite replays the corpus too (tests/test_tokenizer.c).
 */
#include "props.h"

PKV_FUZZ_TARGET(pkv_fuzz_tokenizer)

#ifdef PKV_FUZZ_REPLAY_MAIN
#include "replay_main.h"
#endif
