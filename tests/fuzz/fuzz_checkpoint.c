/*
 * libFuzzer target for the llama2.c checkpoint loader (pkv_model_load_llama2c): the input
 * is a checkpoint file. The loader's answer must agree with a reference reading of the
 * format (PKV_OK exactly for valid files, else PKV_ERR_CORRUPT), and a loaded model must
 * hold the file's weights. A violation aborts. The properties are in props_checkpoint.c,
 * which the suite links too.
 *
 * Build (clang with libFuzzer): make fuzz, then
 *   build/san-fuzzer-no-link-address-undefined/fuzz/fuzz_checkpoint tests/fuzz/corpus/checkpoint
 * The corpus (tests/fuzz/make_loader_corpus.py) is replayed by tests/test_model.c.
 */
#include "props.h"

PKV_FUZZ_TARGET(pkv_fuzz_checkpoint)

#ifdef PKV_FUZZ_REPLAY_MAIN
#include "replay_main.h"
#endif
