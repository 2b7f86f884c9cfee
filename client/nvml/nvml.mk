# The NVML shim: our libnvidia-ml.so.1 (client/nvml/, docs/architecture.md "The NVML shim").
#   $(BUILD)/client/libnvidia-ml.so.1   client/nvml/*.c (not the test_*.c), the generated stubs
#                                       (client/nvml/generated/, from gen_stubs.py), the client
#                                       units it shares with libcuda.so.1 (configuration, the
#                                       info request, TCP/TLS, log) and the generated protocol
#                                       code; soname libnvidia-ml.so.1
#   $(BUILD)/client/libnvidia-ml.so     symlink, for programs that link with -lnvidia-ml
# It sits next to libcuda.so.1, so LD_LIBRARY_PATH=$(BUILD)/client (what `gpupool run` sets)
# finds both. The SAN=1 build needs libasan preloaded in uninstrumented programs, as libcuda's.

NVML_SRCS := $(sort $(filter-out client/nvml/test_%.c,$(wildcard client/nvml/*.c)) \
               $(wildcard client/nvml/generated/*.c))
# The client units shared with libcuda.so.1 (client/common/) and SHA-256 (common/).
NVML_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,$(NVML_SRCS)) $(CLIENT_COMMON_OBJS) $(GP_SHA256_OBJS) \
            $(GP_UTF8_OBJS)
NVML_LIB  := $(BUILD)/client/libnvidia-ml.so.1

# client/nvml's sources include the shared client headers of client/common.
EXTRA_CFLAGS_client_nvml_ := $(CLIENT_COMMON_INC) -DGPUPOOL_VERSION='"$(GPUPOOL_VERSION)"'
EXTRA_CFLAGS_client_nvml_generated_ := -I$(CURDIR)/client/nvml $(CLIENT_COMMON_INC)

# -z defs: every symbol resolves inside the library or its listed dependencies (not with the
# sanitizers, whose runtimes are resolved at load time).
ifeq ($(SAN),1)
NVML_LDFLAGS :=
else
NVML_LDFLAGS := -Wl,-z,defs
endif

ALL_TARGETS += $(NVML_LIB) $(BUILD)/client/libnvidia-ml.so

$(NVML_LIB): $(NVML_OBJS) $(PROTO_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -shared -Wl,-soname,libnvidia-ml.so.1 $(NVML_LDFLAGS) -o $@ $^ \
		-lpthread -ldl -lm

$(BUILD)/client/libnvidia-ml.so: $(NVML_LIB)
	ln -sf libnvidia-ml.so.1 $@
