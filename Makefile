# gpupool native build and the verbs people reach for.
# Each component owns a fragment (*.mk) that adds its targets to ALL_TARGETS / TEST_BINS.
#   make            build everything native into build/
#   make SAN=1      the same with AddressSanitizer + UBSan into build-asan/
#   make HARDEN=0   without the hardening flags (stack protector, FORTIFY, RELRO, BIND_NOW)
#   make gen        regenerate generated code from its sources
#   make test       build, then run the whole test suite (what CI runs)
#   make demo       daemon on a simulated GPU + a demo client
#   make lint       ruff, the C style (clang-format) and the generated-code drift check
#   make bench      the remoting benchmark (docs/benchmarks.md); BENCH_ARGS=--tls adds TLS
#   make debs       the Debian packages gpupoold and gpupool-client into dist/deb/ (docs/packaging.md)
#   make fuzz       every fuzz target for FUZZ_SECONDS (tests/fuzz/README.md; make fuzz-build)

CC      ?= cc
PYTHON  ?= python3
NVCC    ?= $(shell command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)

ifeq ($(SAN),1)
BUILD   ?= build-asan
SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
else
BUILD   ?= build
SANFLAGS :=
endif

CSTD     := -std=c11 -D_GNU_SOURCE
WARN     := -Wall -Wextra -Werror -Wno-unused-parameter
OPT      ?= -O2 -g
# Hardening, as Debian's dpkg-buildflags (hardening=+all) gives a package: stack protector, stack
# clash protection, CET, _FORTIFY_SOURCE=2 (checked string and memory functions: needs an
# optimisation level, so not with OPT=-O0), full RELRO and BIND_NOW. On by default (no measurable
# cost: docs/benchmarks.md), off with HARDEN=0 and for SAN=1 (FORTIFY's wrappers hide accesses
# from AddressSanitizer).
ifeq ($(SAN),1)
HARDEN  ?= 0
else
HARDEN  ?= 1
endif
ifeq ($(HARDEN),1)
HARDEN_CFLAGS  := -fstack-protector-strong -fstack-clash-protection -fcf-protection \
                  -Wformat -Werror=format-security
ifeq ($(filter -O0,$(OPT)),)
HARDEN_CFLAGS  += -U_FORTIFY_SOURCE -D_FORTIFY_SOURCE=2
endif
HARDEN_LDFLAGS := -Wl,-z,relro -Wl,-z,now
else
HARDEN_CFLAGS  :=
HARDEN_LDFLAGS :=
endif
CFLAGS_COMMON := $(CSTD) $(WARN) $(OPT) -fPIC -fvisibility=hidden $(HARDEN_CFLAGS) $(SANFLAGS) \
                 -I$(CURDIR)/cudaapi -I$(CURDIR)/protocol/generated -I$(CURDIR)/protocol/include \
                 -I$(CURDIR)/common
LDFLAGS_COMMON := $(HARDEN_LDFLAGS) $(SANFLAGS)

ALL_TARGETS :=
TEST_BINS   :=

.PHONY: all clean gen test lint demo bench
all: real_all

include protocol/protocol.mk
include common/common.mk
-include client/common/client_common.mk
-include client/shim/shim.mk
-include client/nvml/nvml.mk
-include client/config/config.mk
-include worker/sim/sim.mk
-include worker/worker.mk
-include worker/scrub/scrub.mk
-include worker/checkpoint/checkpoint.mk
-include tests/c/tests.mk
-include tests/sim/sim_tests.mk
-include client/shim/shim_tests.mk
-include client/shim/shim_d2_tests.mk
-include client/nvml/nvml_tests.mk
-include tests/fuzz/fuzz.mk

real_all: $(ALL_TARGETS) $(TEST_BINS)

# What runs (worker, simulated device, shims, scrub, the config reader) without the test programs:
# `make demo` builds only this.
.PHONY: native
native: $(ALL_TARGETS)

# The objects depend on the flags they were compiled with: a build directory made before a flag
# changed (HARDEN, OPT, SAN) is rebuilt, not linked from objects without them.
FLAGS_STAMP := $(BUILD)/flags.stamp
FLAGS_TEXT  := $(CC) $(CFLAGS_COMMON) $(LDFLAGS_COMMON)
ifneq ($(file < $(FLAGS_STAMP)),$(FLAGS_TEXT))
$(shell mkdir -p $(BUILD))
$(file > $(FLAGS_STAMP),$(FLAGS_TEXT))
endif

$(BUILD)/obj/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_COMMON) $(EXTRA_CFLAGS_$(subst /,_,$(dir $<))) -MMD -MP -c $< -o $@

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)

gen:
	$(PYTHON) protocol/gen_protocol.py
	$(PYTHON) cudaapi/gen_cuda_tables.py
	$(if $(wildcard .venv/bin/python),.venv/bin/python,$(PYTHON)) client/nvml/gen_stubs.py  # reads the installed pynvml

test:
	./scripts/test.sh

lint:
	./scripts/lint.sh

demo:
	./scripts/demo.sh

bench:
	./scripts/bench.sh $(BENCH_ARGS)

.PHONY: debs
debs:
	./scripts/build-debs.sh

clean:
	rm -rf build build-asan build-fuzz
