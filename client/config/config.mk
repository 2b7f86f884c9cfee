# libgpupool-config.so: the client configuration reader (client/common/client_config.c) for the
# `gpupool` command, which calls it through ctypes (client/gpupool/config.py, client/config/binding.c).
#   $(BUILD)/client/libgpupool-config.so   binding.c + the configuration units of client/common/
# Next to libcuda.so.1, shipped with it in the gpupool package's lib/. Its own soname, so loading
# it in a process never stands in for a real libcuda.so.1 or libnvidia-ml.so.1 loaded later.
CONFIG_LIB := $(BUILD)/client/libgpupool-config.so
CONFIG_LIB_OBJS := $(BUILD)/obj/client/config/binding.o \
    $(addprefix $(BUILD)/obj/client/common/,$(CLIENT_CONFIG_UNITS) requirements.o net.o tls.o log.o) \
    $(GP_UTF8_OBJS)

EXTRA_CFLAGS_client_config_ := $(CLIENT_COMMON_INC)

ifeq ($(SAN),1)
CONFIG_LIB_LDFLAGS :=
else
CONFIG_LIB_LDFLAGS := -Wl,-z,defs
endif

ALL_TARGETS += $(CONFIG_LIB)

$(CONFIG_LIB): $(CONFIG_LIB_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -shared -Wl,-soname,libgpupool-config.so $(CONFIG_LIB_LDFLAGS) -o $@ \
		$^ -lpthread -ldl -lm
