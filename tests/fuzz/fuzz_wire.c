/*
 * libFuzzer target for the xfer wire decoder and the handle parser.
 *
 * Each input goes through xf_wire_decode, xf_wire_peek_foreign and
 * pkv_xfer_handle_decode. Whatever decodes must survive a round trip: re-encoding gives a
 * message that decodes to the same fields (READ runs compared after expansion, since the
 * encoder re-coalesces them), and a decoded handle re-encodes to exactly the input bytes.
 * A violation traps. The properties are in props_wire.c, which the suite links too.
 *
 * Build (clang with libFuzzer): make fuzz, then
 *   build/san-fuzzer-no-link-address-undefined/fuzz/fuzz_wire tests/fuzz/corpus/wire
 * The corpus is replayed by tests/test_xfer_wire.c in the normal suite.
 */
#include "props.h"

PKV_FUZZ_TARGET(pkv_fuzz_wire)

#ifdef PKV_FUZZ_REPLAY_MAIN
#include "replay_main.h"
#endif
