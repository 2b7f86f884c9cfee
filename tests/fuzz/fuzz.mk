# Coverage-guided fuzzing (libFuzzer, from Debian's clang) of the C that reads outside input
# (tests/fuzz/README.md): the protocol decoders, the worker's frame loop on the simulated device,
# the shim's handling of what a server sends, the client configuration file, the server's info
# document. Everything here builds with clang into build-fuzz/, instrumented for coverage and
# with AddressSanitizer + UBSan, whatever BUILD and CC say:
#   make fuzz-build      the targets (scripts/fuzz.sh and tests/test_fuzz.py run them)
#   make fuzz            each target for FUZZ_SECONDS (default 60) on its corpus
FUZZ_CC     ?= clang
FUZZ_BUILD  := build-fuzz
FUZZ_SAN    := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_CFLAGS := -std=c11 -D_GNU_SOURCE $(WARN) -O1 -g -fPIC $(FUZZ_SAN) -fsanitize=fuzzer-no-link \
               -I$(CURDIR)/cudaapi -I$(CURDIR)/protocol/generated -I$(CURDIR)/protocol/include \
               -I$(CURDIR)/common -DSIM_MAX_SPIN_NS=1000000ull -DGPUPOOL_VERSION='"fuzz"'
FUZZ_LINK   := $(FUZZ_SAN) -fsanitize=fuzzer
FUZZ_OBJ    := $(FUZZ_BUILD)/obj

FUZZ_TARGETS := $(addprefix $(FUZZ_BUILD)/,fuzz_protocol fuzz_worker fuzz_shim_replies \
                  fuzz_client_config fuzz_info)

.PHONY: fuzz-build fuzz
fuzz-build: $(FUZZ_TARGETS) $(FUZZ_BUILD)/libgpupool-sim.so

fuzz: fuzz-build
	./scripts/fuzz.sh $(FUZZ_SECONDS)

# worker/main.c's main() would clash with libFuzzer's: renamed in this build only. The worker's
# log lines are formatted but not printed (millions of sessions).
$(FUZZ_OBJ)/worker/%.o: FUZZ_EXTRA := -DWK_LOG_QUIET
$(FUZZ_OBJ)/worker/main.o: FUZZ_EXTRA := -DWK_LOG_QUIET -Dmain=gpupool_worker_main
$(FUZZ_OBJ)/client/nvml/%.o: FUZZ_EXTRA := -I$(CURDIR)/client/common
$(FUZZ_OBJ)/client/shim/%.o: FUZZ_EXTRA := -I$(CURDIR)/client/common
# The targets include the headers (and, fuzz_shim_replies, the source) of what they feed.
$(FUZZ_OBJ)/tests/fuzz/%.o: FUZZ_EXTRA := -I$(CURDIR)/client/shim -I$(CURDIR)/client/common \
                                         -I$(CURDIR)/client/nvml -I$(CURDIR)/worker

$(FUZZ_OBJ)/%.o: %.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(FUZZ_EXTRA) -MMD -MP -c $< -o $@

-include $(shell find $(FUZZ_OBJ) -name '*.d' 2>/dev/null)

FUZZ_PROTO := $(FUZZ_OBJ)/protocol/generated/gp_protocol.o

$(FUZZ_BUILD)/fuzz_protocol: $(FUZZ_OBJ)/tests/fuzz/fuzz_protocol.o $(FUZZ_PROTO)
	$(FUZZ_CC) $(FUZZ_LINK) -o $@ $^

FUZZ_WORKER_OBJS := $(patsubst %.c,$(FUZZ_OBJ)/%.o,$(wildcard worker/*.c)) \
                    $(patsubst %.c,$(FUZZ_OBJ)/%.o,$(COMMON_SRCS))
$(FUZZ_BUILD)/fuzz_worker: $(FUZZ_OBJ)/tests/fuzz/fuzz_worker.o $(FUZZ_WORKER_OBJS) $(FUZZ_PROTO) \
		| $(FUZZ_BUILD)/libgpupool-sim.so
	$(FUZZ_CC) $(FUZZ_LINK) -o $@ $(filter %.o,$^) -ldl -lpthread -lssl -lcrypto

# The simulated device the worker target loads, instrumented too (its code runs every call).
$(FUZZ_BUILD)/libgpupool-sim.so: $(patsubst %.c,$(FUZZ_OBJ)/%.o,$(wildcard worker/sim/*.c))
	$(FUZZ_CC) -shared $(FUZZ_SAN) -Wl,-soname,libgpupool-sim.so -o $@ $^ -ldl -lpthread

# conn.c and the connection's files it calls (conn_route.c, conn_life.c, conn_read.c,
# conn_write.c, keepalive.c, pending.c, request_ids.c) are compiled into the target itself (it includes them to reach their private
# state); tls.c
# names servers as the configuration does (client_config.c: gp_server_desc).
$(FUZZ_BUILD)/fuzz_shim_replies: $(FUZZ_OBJ)/tests/fuzz/fuzz_shim_replies.o \
		$(FUZZ_OBJ)/common/compress.o $(FUZZ_OBJ)/common/utf8.o \
		$(addprefix $(FUZZ_OBJ)/client/common/,log.o tls.o $(CLIENT_CONFIG_UNITS) requirements.o net.o) \
		$(FUZZ_PROTO)
	$(FUZZ_CC) $(FUZZ_LINK) -o $@ $^ -lpthread -ldl

$(FUZZ_BUILD)/fuzz_client_config: $(FUZZ_OBJ)/tests/fuzz/fuzz_client_config.o \
		$(addprefix $(FUZZ_OBJ)/client/common/,$(CLIENT_CONFIG_UNITS) requirements.o net.o tls.o log.o) \
		$(FUZZ_OBJ)/common/utf8.o
	$(FUZZ_CC) $(FUZZ_LINK) -o $@ $^ -lpthread -ldl

$(FUZZ_BUILD)/fuzz_info: $(FUZZ_OBJ)/tests/fuzz/fuzz_info.o \
		$(FUZZ_OBJ)/client/nvml/nvml_view.o $(FUZZ_PROTO) $(FUZZ_OBJ)/common/utf8.o
	$(FUZZ_CC) $(FUZZ_LINK) -o $@ $^ -lm
