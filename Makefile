# ferry build. `make` builds the library, tools and tests into $(BUILD);
# `make test` runs the suite; `make SAN=1 BUILD=build-san test` runs it under
# AddressSanitizer and UndefinedBehaviorSanitizer.

BUILD ?= build
CC ?= cc
MPICC ?= mpicc
NVCC ?= nvcc
SAN ?= 0

FABRIC_CFLAGS := $(shell pkg-config --cflags libfabric 2>/dev/null)
FABRIC_LIBS := $(shell pkg-config --libs libfabric 2>/dev/null || echo -lfabric)
MPI_CFLAGS = $(if $(filter 1,$(MPI)),$(shell $(MPICC) -showme:compile 2>/dev/null))
MPI_LIBS = $(if $(filter 1,$(MPI)),$(shell $(MPICC) -showme:link 2>/dev/null))

WARN := -Wall -Wextra -Wno-unused-parameter -Wshadow -Wstrict-prototypes
CFLAGS ?= -O3 -g
# only the calls marked FERRY_API (include/ferry.h) are visible outside
# the library; scripts/libferry.map keeps the exports to ferry_* as well
CFLAGS += -std=c11 -D_GNU_SOURCE -fPIC -pthread -fvisibility=hidden $(WARN) -Iinclude -Isrc \
          $(FABRIC_CFLAGS)
LDLIBS := $(FABRIC_LIBS) -lrt -lm -pthread
ifeq ($(SAN),1)
CFLAGS += -fsanitize=address,undefined -fno-omit-frame-pointer \
          -fno-sanitize-recover=undefined
LDFLAGS += -fsanitize=address,undefined
endif

# CUDA: on when nvcc is found (CUDA=0 turns it off; sanitizer builds do).
CUDA_HOME ?= /usr/local/cuda
NVCC_FOUND := $(shell command -v $(NVCC) 2>/dev/null || test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc)
ifeq ($(SAN),1)
CUDA ?= 0
endif
ifneq ($(NVCC_FOUND),)
CUDA ?= 1
else
CUDA ?= 0
endif
ifeq ($(CUDA),1)
NVCC := $(if $(shell command -v $(NVCC) 2>/dev/null),$(NVCC),$(CUDA_HOME)/bin/nvcc)
CFLAGS += -DFERRY_HAVE_CUDA -I$(CUDA_HOME)/include
LDLIBS += -L$(CUDA_HOME)/lib64 -lcudart_static -ldl
endif
# MPI for the benchmark's baseline (MPI=0 builds it without).
MPI ?= 1

# Every .c and .cu under src/ is part of the library (a new engine or
# transport folder needs no line here).
LIB_SRCS := $(sort $(shell find src -name '*.c'))
CUDA_SRCS := $(sort $(shell find src -name '*.cu'))
LIB_OBJS := $(LIB_SRCS:%.c=$(BUILD)/obj/%.o)
ifeq ($(CUDA),1)
LIB_OBJS += $(patsubst %.cu,$(BUILD)/obj/%.o,$(CUDA_SRCS))
endif
TOOL_COMMON := $(wildcard tools/common/*.c)
TOOL_COMMON_OBJS := $(TOOL_COMMON:%.c=$(BUILD)/obj/%.o)
CUDA_OBJS := $(CUDA_SRCS:%.cu=$(BUILD)/obj/%.o)

TEST_SRCS := $(wildcard tests/unit/*.c tests/mp/*.c)
TEST_BINS := $(TEST_SRCS:tests/%.c=$(BUILD)/tests/%)

LIBA := $(BUILD)/libferry.a
# libferry.so is a link to libferry.so.$(SOVERSION), whose SONAME that is;
# only ferry_* symbols are exported (scripts/libferry.map).
SOVERSION := 0
LIBSO := $(BUILD)/libferry.so
LIBSO_REAL := $(LIBSO).$(SOVERSION)
BINS := $(BUILD)/bin/ferry-bench $(BUILD)/bin/ferry-info $(BUILD)/bin/ferry-signal-bench

.PHONY: all lib tools tests test check cuda clean install pyext
all: lib tools tests

lib: $(LIBA) $(LIBSO)
tools: $(BINS)
tests: $(TEST_BINS)

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itools/common -MMD -MP -c $< -o $@

$(LIBA): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(LIBSO_REAL): $(LIB_OBJS) scripts/libferry.map
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libferry.so.$(SOVERSION) \
	    -Wl,--version-script=scripts/libferry.map -o $@ $(LIB_OBJS) $(LDLIBS) \
	    $(if $(filter 1,$(CUDA)),-lstdc++)

$(LIBSO): $(LIBSO_REAL)
	ln -sf $(notdir $<) $@

# Tools link MPI for the baseline (built without it when mpicc is missing).
ifneq ($(MPI_LIBS),)
BENCH_MPI := -DFERRY_HAVE_MPI $(MPI_CFLAGS)
endif
# ferry-bench is tools/ferry_bench.c and tools/bench/, built in one step.
BENCH_SRCS := tools/ferry_bench.c $(wildcard tools/bench/*.c)
# the commit the benchmark was built at, for its --json (none outside git)
GIT_COMMIT := $(shell git rev-parse --short=12 HEAD 2>/dev/null)
$(BUILD)/bin/ferry-bench: $(BENCH_SRCS) tools/bench/bench.h $(TOOL_COMMON_OBJS) $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DFERRY_GIT_COMMIT='"$(GIT_COMMIT)"' -Itools/common $(BENCH_MPI) $(LDFLAGS) -o $@ $(filter-out %.h,$^) $(LDLIBS) $(MPI_LIBS) $(if $(filter 1,$(CUDA)),-lstdc++)

SIGBENCH_CUDA := $(if $(filter 1,$(CUDA)),$(BUILD)/obj/tools/signal_kernels.o)
$(BUILD)/bin/ferry-signal-bench: tools/ferry_signal_bench.c $(TOOL_COMMON_OBJS) $(SIGBENCH_CUDA) $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itools -Itools/common $(LDFLAGS) -o $@ $^ $(LDLIBS) $(if $(filter 1,$(CUDA)),-lstdc++)

# test_signal's kernel_args mode launches the bench's bad-call kernel
$(BUILD)/tests/mp/test_signal: $(SIGBENCH_CUDA)

$(BUILD)/bin/ferry-info: tools/ferry_info.c $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $^ $(LDLIBS) $(if $(filter 1,$(CUDA)),-lstdc++)

$(BUILD)/tests/%: tests/%.c $(TOOL_COMMON_OBJS) $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itools/common -Itests $(LDFLAGS) -o $@ $^ $(LDLIBS) $(if $(filter 1,$(CUDA)),-lstdc++)

# CUDA kernels: compiled whenever nvcc exists (CI has no GPU but has nvcc).
# Hopper (sm_90) and Blackwell (sm_100) code, plus PTX for later chips.
NVCC_ARCH ?= -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_100,code=sm_100 \
             -gencode=arch=compute_100,code=compute_100
cuda: $(CUDA_OBJS)
# nvcc writes each object's header dependencies beside it (-MD -MF), as
# the C compiler does (-MMD), so a header change rebuilds exactly the
# kernels that include it
$(BUILD)/obj/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 $(NVCC_ARCH) -Xcompiler -fPIC,-fvisibility=hidden -DFERRY_HAVE_CUDA -Iinclude -Isrc \
		-MD -MP -MF $(@:.o=.d) -c $< -o $@

# Coverage-guided fuzzing (libFuzzer): argument checks and record decoding.
FUZZ_BUILD ?= build-fuzz
FUZZ_CC ?= clang
FUZZ_SAN := -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS := -g -O1 -std=c11 -D_GNU_SOURCE -fPIC -pthread -Iinclude -Isrc \
               $(FABRIC_CFLAGS) -fno-omit-frame-pointer $(FUZZ_SAN)
FUZZ_LIB_SRCS := $(LIB_SRCS)
FUZZ_OBJS := $(FUZZ_LIB_SRCS:%.c=$(FUZZ_BUILD)/obj/%.o)
FUZZ_BINS := $(FUZZ_BUILD)/fuzz_config $(FUZZ_BUILD)/fuzz_records $(FUZZ_BUILD)/fuzz_ht_records
.PHONY: fuzz
fuzz: $(FUZZ_BINS)
$(FUZZ_BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@
$(FUZZ_BUILD)/fuzz_%: tests/fuzz/fuzz_%.c $(FUZZ_OBJS)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $^ $(FABRIC_LIBS) -lrt -lm -pthread

# make install PREFIX=... (DESTDIR too): headers, libferry.so.$(SOVERSION)
# with its link, libferry.a, the tools, a pkg-config file and a CMake
# package (find_package(ferry): ferry::ferry).
PREFIX ?= /usr/local
VERSION := $(shell sed -n 's/^\#define FERRY_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' include/ferry.h | paste -sd.)
LIBS_PRIVATE := $(filter-out $(FABRIC_LIBS),$(LDLIBS)) $(if $(filter 1,$(CUDA)),-lstdc++)
SUBST = sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' \
            -e 's|@SOVERSION@|$(SOVERSION)|g' -e 's|@MAJOR@|$(firstword $(subst ., ,$(VERSION)))|g' \
            -e 's|@LIBS_PRIVATE@|$(LIBS_PRIVATE)|g'
install: lib tools
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/bin \
	    $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/lib/cmake/ferry
	install -m 644 include/ferry.h include/ferry_signal.h include/ferry_signal_device.cuh \
	    $(DESTDIR)$(PREFIX)/include/
	install -m 755 $(LIBSO_REAL) $(DESTDIR)$(PREFIX)/lib/
	ln -sf libferry.so.$(SOVERSION) $(DESTDIR)$(PREFIX)/lib/libferry.so
	install -m 644 $(LIBA) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(BINS) $(DESTDIR)$(PREFIX)/bin/
	$(SUBST) scripts/ferry.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/ferry.pc
	$(SUBST) scripts/ferryConfig.cmake.in > $(DESTDIR)$(PREFIX)/lib/cmake/ferry/ferryConfig.cmake
	$(SUBST) scripts/ferryConfigVersion.cmake.in \
	    > $(DESTDIR)$(PREFIX)/lib/cmake/ferry/ferryConfigVersion.cmake

# ferry._torchext (python/ferry/_torchext.cpp): the high-throughput calls'
# host path in C++ for torch tensors, against the torch python3 imports
pyext:
	scripts/build_torchext.sh

test: all
	tests/run.sh $(BUILD)

# The whole suite: release build, then sanitizers (what CI runs).
check:
	tests/check.sh

clean:
	rm -rf build build-san build-fuzz build-dev

-include $(LIB_OBJS:.o=.d) $(TOOL_COMMON_OBJS:.o=.d) $(CUDA_OBJS:.o=.d) $(BUILD)/obj/tools/signal_kernels.d
