# gpupool-scrub: wipes a GPU's memory between tenants (worker/scrub/README.md). Its own small
# driver loader; nothing shared with the worker but the CUDA header.
SCRUB_SRCS := $(sort $(wildcard worker/scrub/*.c))
SCRUB_OBJS := $(SCRUB_SRCS:%.c=$(BUILD)/obj/%.o)

ALL_TARGETS += $(BUILD)/gpupool-scrub

$(BUILD)/gpupool-scrub: $(SCRUB_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -ldl
