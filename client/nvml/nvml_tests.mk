# C unit test of the NVML shim's part that needs no server: the mapping from an info reply (the
# spec's info_gpu and info_lease records) to NVML's answers. Run by tests/test_nvml_view.py (also
# under ASan).
TEST_BINS += $(BUILD)/tests/test_nvml_view

$(BUILD)/tests/test_nvml_view: $(BUILD)/obj/client/nvml/test_nvml_view.o \
		$(BUILD)/obj/client/nvml/nvml_view.o $(BUILD)/obj/client/common/info_decode.o \
		$(PROTO_OBJS) $(GP_UTF8_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -lm
