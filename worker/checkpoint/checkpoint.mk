# gpupool-checkpoint: detaches a worker's CUDA state from its GPU and attaches it again
# (worker/checkpoint/README.md). Loads the driver itself; nothing shared with the worker but the
# CUDA header.
CHECKPOINT_SRCS := $(sort $(wildcard worker/checkpoint/*.c))
CHECKPOINT_OBJS := $(CHECKPOINT_SRCS:%.c=$(BUILD)/obj/%.o)

ALL_TARGETS += $(BUILD)/gpupool-checkpoint

$(BUILD)/gpupool-checkpoint: $(CHECKPOINT_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -ldl
