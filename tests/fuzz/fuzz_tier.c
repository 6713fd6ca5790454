/*
 * Fuzz target for the disk tier's segment parser (pkv_tier_seg_parse, the core of
 * pkv_tier_seg_open): any bytes as a segment file. The properties are in props_tier.c,
 * which the suite links too; tests/test_tier.c replays the corpus (tests/fuzz/corpus/tier,
 * made by tests/fuzz/make_tier_corpus.c: sealed and unsealed segments, torn, flipped).
 *
 *   libFuzzer:  make fuzz; build/san-fuzzer-no-link-address-undefined/fuzz/fuzz_tier \
 *                 -max_total_time=60 tests/fuzz/corpus/tier
 */
#include "props.h"

PKV_FUZZ_TARGET(pkv_fuzz_tier)

#ifdef PKV_FUZZ_REPLAY_MAIN
#include "replay_main.h"
#endif
