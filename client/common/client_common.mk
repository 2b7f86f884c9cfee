# The client units both client libraries link (client/common/): the configuration file and the
# environment (client_config*.c, toml_lexer.c, requirements.c), server addresses (hostport.c),
# TCP and TLS (net.c, tls.c), the info request (info_client.c) and the one-line log (log.c).
# None refers to either library's own state:
# libcuda.so.1 (client/shim/) and libnvidia-ml.so.1 (client/nvml/) reach the headers by the
# include path (-I client/common).
CLIENT_COMMON_SRCS := $(sort $(wildcard client/common/*.c))
CLIENT_COMMON_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,$(CLIENT_COMMON_SRCS))
CLIENT_COMMON_INC := -I$(CURDIR)/client/common
# The configuration reader's units (client_config_internal.h says which does what), for the
# binaries that link the reader without the rest: libgpupool-config.so, its C test, the fuzzers.
CLIENT_CONFIG_UNITS := client_config.o client_config_file.o client_config_keys.o \
    client_config_env.o client_config_values.o client_config_hooks.o toml_lexer.o hostport.o
