# gpupool-worker: the server-side process that executes one client's calls (worker/README.md).
# Sources are worker/*.c (not worker/sim/, the simulated device, which sim.mk builds), plus the
# SHA-256 shared with the client shim, compiled by the generic $(BUILD)/obj rule. OpenSSL (the
# data path's TLS, worker/tls.c) is linked normally: the server installs libssl3 with gpupool.
WORKER_SRCS := $(wildcard worker/*.c)
WORKER_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,$(WORKER_SRCS)) $(BUILD)/obj/client/shim/sha256.o \
               $(BUILD)/obj/client/shim/compress.o

ALL_TARGETS += $(BUILD)/gpupool-worker

$(BUILD)/gpupool-worker: $(WORKER_OBJS) $(PROTO_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -ldl -lpthread -lssl -lcrypto
