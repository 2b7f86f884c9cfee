# gpupool-worker: the server-side process that executes one client's calls (worker/README.md).
# Sources are worker/*.c (not worker/sim/, the simulated device, which sim.mk builds), plus
# SHA-256 and the LZ4 codec shared with the client shim (common/), compiled by the generic
# $(BUILD)/obj rule. OpenSSL (the
# data path's TLS, worker/tls.c) is linked normally: the server installs libssl3 with gpupool.
WORKER_SRCS := $(wildcard worker/*.c)
WORKER_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,$(WORKER_SRCS)) $(COMMON_OBJS)

ALL_TARGETS += $(BUILD)/gpupool-worker

$(BUILD)/gpupool-worker: $(WORKER_OBJS) $(PROTO_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -ldl -lpthread -lssl -lcrypto

# The test build of a worker a tenant has taken over (tests/c/worker/worker_compromise.c; issue
# 29): the same objects plus the one that defines wk_test_compromise. A test program only: never
# installed, never named by gpupoold's defaults (tests/test_worker_sandbox.py passes --worker).
TEST_BINS += $(BUILD)/tests/gpupool-worker-compromise
EXTRA_CFLAGS_tests_c_worker_ += -I$(CURDIR)/worker

$(BUILD)/tests/gpupool-worker-compromise: $(WORKER_OBJS) $(PROTO_OBJS) \
		$(BUILD)/obj/tests/c/worker/worker_compromise.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -ldl -lpthread -lssl -lcrypto
