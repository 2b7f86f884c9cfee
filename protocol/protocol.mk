# Generated protocol code, compiled into both the client shim and the worker.
PROTO_OBJS := $(BUILD)/obj/protocol/generated/gp_protocol.o

TEST_BINS += $(BUILD)/tests/test_protocol
$(BUILD)/tests/test_protocol: $(BUILD)/obj/tests/c/test_protocol.o $(PROTO_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^
