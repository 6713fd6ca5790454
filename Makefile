# pagekv — one non-recursive Makefile, out-of-tree build.
#
#   make                      build/libpagekv.a, build/libpagekv.so, build/pagekv
#   make check                build and run every test binary (Check), print a summary
#   make check SAN=address,undefined   the same under ASan+UBSan (build dir build/san-address-undefined)
#   make check SAN=thread     the same under TSan
#   make GPU=1                the GPU part too (src/gpu against CUDA's cuda.h, the driver
#                             found at run time; build dir build/gpu; docs/design/gpu.md)
#   make install PREFIX=/usr/local
#   make format / make format-check
#
# Each src/<module>/*.c goes into the library; support/*.c (code the benchmarks and the
# tests share: CLI helpers, benchmark helpers, fixtures) into build/libpkvsupport.a, not
# installed; tools/*.c and bench/*.c make the CLI; each tests/test_*.c is its own test
# binary linked with tests/support/*.c, the support library and the fuzz targets'
# properties (tests/fuzz/props_*.c).

CC      ?= cc
PREFIX  ?= /usr/local
SAN     ?=
GPU     ?=
CUDA    ?= /usr/local/cuda
WERROR  ?= $(if $(CI),-Werror,)
PKGS    := ucx jansson libmicrohttpd openssl libcurl libxxhash

comma   := ,
ifeq ($(SAN),)
BUILD   ?= build$(if $(GPU),/gpu,)
SANFLAGS :=
else
BUILD   ?= build/$(if $(GPU),gpu-,)san-$(subst $(comma),-,$(SAN))
SANFLAGS := -fsanitize=$(SAN) -fno-omit-frame-pointer -fno-sanitize-recover=all
endif

OPT      ?= -O2
WARN     := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wformat=2 \
            -Wno-unused-parameter $(WERROR)
CPPFLAGS += -Iinclude -Isrc -I. -D_GNU_SOURCE $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
CFLAGS   += -std=c11 -g $(OPT) -fPIC -pthread $(WARN) $(SANFLAGS)
LDFLAGS  += -pthread -Wl,--as-needed $(SANFLAGS)
LDLIBS   += $(shell pkg-config --libs $(PKGS) 2>/dev/null) -lm $(if $(GPU),-ldl,)
TEST_LIBS := $(shell pkg-config --libs check 2>/dev/null) $(shell pkg-config --libs libcurl 2>/dev/null)

# src/gpu: driver.c (cuda.h, GPU=1) or gpu_none.c (no CUDA anywhere), never both.
LIB_SRC   := $(filter-out $(if $(GPU),src/gpu/gpu_none.c,src/gpu/driver.c),$(sort $(wildcard src/*/*.c)))
SUP_SRC   := $(sort $(wildcard support/*.c))
CLI_SRC   := $(sort $(wildcard tools/*.c bench/*.c))
TSUP_SRC  := $(sort $(wildcard tests/support/*.c))
TEST_SRC  := $(sort $(wildcard tests/test_*.c))
FUZZ_SRC  := $(sort $(wildcard tests/fuzz/fuzz_*.c))
FPROP_SRC := $(sort $(wildcard tests/fuzz/props_*.c))

LIB_OBJ   := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
SUP_OBJ   := $(SUP_SRC:%.c=$(BUILD)/obj/%.o)
CLI_OBJ   := $(CLI_SRC:%.c=$(BUILD)/obj/%.o)
TSUP_OBJ  := $(TSUP_SRC:%.c=$(BUILD)/obj/%.o)
FPROP_OBJ := $(FPROP_SRC:%.c=$(BUILD)/obj/%.o)
TEST_BIN  := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)

ALIB := $(BUILD)/libpagekv.a
SLIB := $(BUILD)/libpagekv.so
SUPLIB := $(BUILD)/libpkvsupport.a
FUZZLIB := $(BUILD)/libpkvfuzz.a
CLI  := $(BUILD)/pagekv

.SECONDARY:
.PHONY: all check install format format-check clean deps test demo fuzz fuzz-bins
# The README's two commands: each installs missing Debian packages, then builds.
.DEFAULT_GOAL := all

test:
	scripts/deps.sh
	$(MAKE) --no-print-directory check
demo:
	scripts/deps.sh
	$(MAKE) --no-print-directory all
	$(BUILD)/pagekv demo
all: $(ALIB) $(SLIB) $(CLI)
# GPU=1 also builds `pagekv bench gpu` and the GPU tests alone (libc, libdl and the driver
# at run time): what scripts/gpu-check.sh builds on a GPU machine, built here the same way.
GPU_CORE_SRC := src/gpu/driver.c src/gpu/arena.c src/gpu/attn.c src/gpu/kv_storage.c \
    src/kv/kv.c src/kv/pool.c src/kv/dense.c $(wildcard src/prim/*.c) src/core/core.c \
    src/core/fault.c
# The pool's prefix keys use OpenSSL's SHA-256: linked in statically, since a GPU machine
# promises no Debian library (the binaries need glibc 2.34, libdl and the driver).
GPU_LIBS := -Wl,-Bstatic -lcrypto -Wl,-Bdynamic -ldl -lm -lpthread
GPU_HDRS := $(wildcard src/gpu/*.h src/core/*.h src/kv/*.h src/prim/*.h include/pagekv/*.h)
GPU_BENCH_SRC := tools/standalone/pagekv_gpu.c bench/bench_gpu.c bench/bench_gpu_replay.c \
    $(GPU_CORE_SRC)
GPU_TEST_SRC := tests/gpu/main.c tests/support/gpu_cases.c $(GPU_CORE_SRC)
ifneq ($(GPU),)
NVCC ?= $(CUDA)/bin/nvcc
all: $(BUILD)/pagekv-gpu $(BUILD)/pagekv-gpu-test $(BUILD)/pagekv-kernels.fatbin
# The kernels, for H100 / H200 (sm_90), loaded at run time by pkv_gpu_attn_load.
$(BUILD)/pagekv-kernels.fatbin: src/gpu/kernels.cu Makefile
	@mkdir -p $(dir $@)
	$(NVCC) -fatbin -O3 -gencode arch=compute_90,code=sm_90 -o $@ $<
$(BUILD)/pagekv-gpu: $(GPU_BENCH_SRC) $(GPU_HDRS) bench/bench_gpu.h Makefile
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -DPKV_GPU=1 -I$(CUDA)/include $(CFLAGS) -o $@ $(GPU_BENCH_SRC) $(GPU_LIBS)
$(BUILD)/pagekv-gpu-test: $(GPU_TEST_SRC) $(GPU_HDRS) tests/support/gpu_cases.h Makefile
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -DPKV_GPU=1 -I$(CUDA)/include $(CFLAGS) -o $@ $(GPU_TEST_SRC) $(GPU_LIBS)
endif

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -MMD -MP -c $< -o $@

# The library exports only what include/pagekv/ declares (marked PKV_API, see
# include/pagekv/export.h and docs/design/api.md); tests/test_api checks it.
# (objects built before that flag must be rebuilt: they depend on the Makefile).
$(LIB_OBJ): CFLAGS += -fvisibility=hidden
$(BUILD)/obj/src/gpu/driver.o: CPPFLAGS += -DPKV_GPU=1 -I$(CUDA)/include
$(LIB_OBJ): Makefile

$(ALIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(SLIB): $(LIB_OBJ)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(SUPLIB): $(SUP_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(CLI): $(CLI_OBJ) $(SUPLIB) $(ALIB)
	$(CC) $(LDFLAGS) -o $@ $(CLI_OBJ) $(SUPLIB) $(ALIB) $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/obj/tests/%.o $(TSUP_OBJ) $(SUPLIB) $(FUZZLIB) $(ALIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(TSUP_OBJ) $(SUPLIB) $(FUZZLIB) $(ALIB) $(TEST_LIBS) $(LDLIBS)

# tests/test_api checks the installed headers and this build's .so with this build's
# compilers (docs/design/api.md).
$(BUILD)/obj/tests/test_api.o: CPPFLAGS += -DPKV_TEST_SRCDIR='"$(CURDIR)"' \
    -DPKV_TEST_CC='"$(CC)"' -DPKV_TEST_CXX='"$(CXX)"' -DPKV_TEST_SANFLAGS='"$(SANFLAGS)"'
$(BUILD)/obj/tests/test_api.o: Makefile
$(BUILD)/tests/test_api: $(SLIB)
# tests/test_router runs tests/sdk/openai_check.cjs from the source tree.
$(BUILD)/obj/tests/test_router.o: CPPFLAGS += -DPKV_TEST_SRCDIR='"$(CURDIR)"'
$(BUILD)/obj/tests/test_router.o: Makefile

# Each test binary forks every test (Check's default) with its own timeout.
# scripts/run-tests.sh prints one line per binary and a closing "N passed, N failed, N skipped".
check: all $(TEST_BIN)
	@BUILD=$(BUILD) SAN=$(SAN) scripts/run-tests.sh $(TEST_BIN)

# libFuzzer targets (tests/fuzz/fuzz_*.c), the library instrumented too:
#   make fuzz  ->  build/san-fuzzer-no-link-address-undefined/fuzz/fuzz_*  (run: BIN CORPUS_DIR)
# Their properties (tests/fuzz/props_*.c, build/libpkvfuzz.a) are linked into the test
# binaries too, which replay each corpus without libFuzzer.
FUZZ_BIN := $(FUZZ_SRC:tests/fuzz/%.c=$(BUILD)/fuzz/%)
fuzz:
	$(MAKE) --no-print-directory CC=clang SAN=fuzzer-no-link,address,undefined fuzz-bins
fuzz-bins: $(FUZZ_BIN)
$(FUZZLIB): $(FPROP_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^
$(BUILD)/fuzz/%: tests/fuzz/%.c $(FUZZLIB) $(ALIB)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -fsanitize=fuzzer $< $(FUZZLIB) $(ALIB) $(LDLIBS) -o $@

install: all
	install -d $(DESTDIR)$(PREFIX)/include/pagekv $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin
	install -m 644 include/pagekv/*.h $(DESTDIR)$(PREFIX)/include/pagekv/
	install -m 644 $(ALIB) $(SLIB) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(CLI) $(DESTDIR)$(PREFIX)/bin/
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBS@|$(shell pkg-config --libs $(PKGS) 2>/dev/null) -lm -pthread|' \
	    pagekv.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/pagekv.pc

FMT_FILES = $(shell git ls-files '*.c' '*.h' 2>/dev/null)
format:
	clang-format -i $(FMT_FILES)
format-check:
	clang-format --dry-run -Werror $(FMT_FILES)

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
