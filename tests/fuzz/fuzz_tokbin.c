/*
 * libFuzzer target for the llama2.c tokenizer loader (pkv_tok_load_llama2c_mem): the
 * first byte says how the vocabulary size is given, the rest is tokenizer.bin. The
 * loader's answer must agree with a reference reading of the format, and a loaded
 * vocabulary must hold the file's pieces and round-trip text. A violation aborts. The
 * properties are in props_tokbin.c, which the suite links too.
 *
 * Build (clang with libFuzzer): make fuzz, then
 *   build/san-fuzzer-no-link-address-undefined/fuzz/fuzz_tokbin tests/fuzz/corpus/tokbin
 * The corpus (tests/fuzz/make_loader_corpus.py) is replayed by tests/test_tokenizer.c.
 */
#include "props.h"

PKV_FUZZ_TARGET(pkv_fuzz_tokbin)

#ifdef PKV_FUZZ_REPLAY_MAIN
#include "replay_main.h"
#endif
