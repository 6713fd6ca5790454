/*
 * libFuzzer target for the router's SSE framing (rt_sse_complete_end, src/router/relay.c):
 * the first byte picks how the upstream stream is cut into pieces, the rest is the
 * stream. Fed piece by piece as the relay feeds it, what is passed on must be exactly
 * the stream's complete events, however it was cut. A violation aborts. The properties
 * are in props_sse.c, which the suite links too.
 *
 * Build (clang with libFuzzer): make fuzz, then
 *   build/san-fuzzer-no-link-address-undefined/fuzz/fuzz_sse tests/fuzz/corpus/sse
 * The corpus (tests/fuzz/make_loader_corpus.py) is replayed by tests/test_router.c.
 */
#include "props.h"

PKV_FUZZ_TARGET(pkv_fuzz_sse)

#ifdef PKV_FUZZ_REPLAY_MAIN
#include "replay_main.h"
#endif
