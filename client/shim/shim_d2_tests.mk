# C unit tests of the module/launch part of the shim (helper D2). Included by the top Makefile.
TEST_BINS += $(BUILD)/tests/test_image
$(BUILD)/tests/test_image: $(BUILD)/obj/tests/c/test_image.o $(BUILD)/obj/client/shim/image.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^

# The module/launch/attribute/occupancy entry points against a fake shim core (no network).
D2_API_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,client/shim/api_module.c client/shim/api_link.c \
	client/shim/api_func.c \
	client/shim/api_launch.c client/shim/api_occupancy.c client/shim/image.c \
	client/shim/entry_profile.c client/shim/module_phases.c) $(GP_SHA256_OBJS)
TEST_BINS += $(BUILD)/tests/test_module_api
$(BUILD)/tests/test_module_api: $(BUILD)/obj/tests/c/test_module_api.o \
		$(BUILD)/obj/tests/c/fake_parts.o $(D2_API_OBJS) $(PROTO_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -pthread -o $@ $^
