# C shared by the client libraries and the worker (common/): the LZ4 block codec of compressed
# copies (compress.c), SHA-256 (sha256.c: module hashes, the module cache, TLS pins) and UTF-8
# cleaning (utf8.c: texts on the wire). All are dependency-free; every component reaches their headers by the include path (-I common, in
# CFLAGS_COMMON) and links the objects it needs.
COMMON_SRCS := common/compress.c common/sha256.c common/utf8.c
COMMON_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,$(COMMON_SRCS))
GP_SHA256_OBJS := $(BUILD)/obj/common/sha256.o
GP_COMPRESS_OBJS := $(BUILD)/obj/common/compress.o
GP_UTF8_OBJS := $(BUILD)/obj/common/utf8.o
