# The client shim: our libcuda.so.1 (client/shim/, docs/architecture.md).
#   $(BUILD)/client/libcuda.so.1   every client/shim/*.c and client/shim/generated/*.c, the client
#                                  units of client/common/, common/ (LZ4, SHA-256) and the
#                                  generated protocol code; soname libcuda.so.1
#   $(BUILD)/client/libcuda.so     symlink, for programs that link with -lcuda
# Programs pick it up with LD_LIBRARY_PATH=$(BUILD)/client. With `make SAN=1` it goes to
# build-asan/client/ and is built with AddressSanitizer + UBSan: a program that is not itself
# built with the sanitizers then needs the runtime preloaded, e.g.
#   LD_PRELOAD=$$(gcc -print-file-name=libasan.so) LD_LIBRARY_PATH=build-asan/client ./prog
# (ASAN_OPTIONS=detect_leaks=0 when the program, like cudart, keeps memory until exit).
-include client/shim/shim_tables.mk

# The gpupool version (gpupool_shim_version(), hooks.c) comes from the Python package, so that the
# wheel's libraries and its command always agree.
GPUPOOL_VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' client/gpupool/__init__.py)
ifeq ($(GPUPOOL_VERSION),)
$(error cannot read __version__ from client/gpupool/__init__.py)
endif
EXTRA_CFLAGS_client_shim_ += -DGPUPOOL_VERSION='"$(GPUPOOL_VERSION)"' $(CLIENT_COMMON_INC)
EXTRA_CFLAGS_client_shim_generated_ += -I$(CURDIR)/client/shim
$(BUILD)/obj/client/shim/hooks.o: client/gpupool/__init__.py

SHIM_SRCS := $(sort $(wildcard client/shim/*.c client/shim/generated/*.c))
SHIM_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,$(SHIM_SRCS)) $(CLIENT_COMMON_OBJS) $(COMMON_OBJS)
SHIM_LIB  := $(BUILD)/client/libcuda.so.1

# -z nodelete: the library is never unmapped, even when a program dlclose()s it, because its
# receiver and flusher threads keep running its code until the process exits.
# -z defs: every symbol must resolve inside the library (catches a hook nobody defines); not
# with the sanitizers, whose runtimes are resolved at load time.
ifeq ($(SAN),1)
SHIM_LDFLAGS := -Wl,-z,nodelete
else
SHIM_LDFLAGS := -Wl,-z,nodelete -Wl,-z,defs
endif
# call_counts.c counts what the program sends (GPUPOOL_CALL_COUNTS=1, bench/link_model.py) by
# wrapping the transport's four entry points: every API file's call to gp_post etc. goes to
# __wrap_gp_post in call_counts.c, which calls conn.c's (__real_gp_post). Calls inside conn.c
# itself are not redirected.
SHIM_LDFLAGS += -Wl,--wrap=gp_post,--wrap=gp_post_lz4,--wrap=gp_request,--wrap=gp_request_detached
# entry_profile.c counts calls per CUDA entry point (GPUPOOL_PROFILE) through the compiler's
# function hooks: the API files are compiled with -finstrument-functions. Only the cu* entry
# points get the hooks: the files' static helpers (their names, read from the sources) and every
# gp_* function (shim-internal ones, the header's inline encoders) are excluded, so a launch pays
# one hook pair (a call and a relaxed load each when the profile is off), not one per helper.
# The exclusion matches substrings: the helpers' snake_case names never occur in a camelCase cu*
# name.
SHIM_API_HELPER_RE := s/^static [^(=;]*[ *]\([a-z_][a-z0-9_]*\)(.*/\1/p
SHIM_API_HELPERS := $(shell sed -n '$(SHIM_API_HELPER_RE)' client/shim/api_*.c | sort -u | paste -sd, -)
SHIM_API_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard client/shim/api_*.c))
$(SHIM_API_OBJS): CFLAGS_COMMON += -finstrument-functions \
	-finstrument-functions-exclude-function-list=gp_,$(SHIM_API_HELPERS)
$(SHIM_API_OBJS): client/shim/shim.mk

ALL_TARGETS += $(SHIM_LIB) $(BUILD)/client/libcuda.so

$(SHIM_LIB): $(SHIM_OBJS) $(PROTO_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -shared -Wl,-soname,libcuda.so.1 $(SHIM_LDFLAGS) -o $@ $^ \
		-lpthread -ldl

$(BUILD)/client/libcuda.so: $(SHIM_LIB)
	ln -sf libcuda.so.1 $@
