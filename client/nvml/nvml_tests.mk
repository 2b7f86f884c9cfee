# C unit tests of the NVML shim's parts that need no server: the JSON parser and the mapping
# from an info document to NVML's answers. Run by tests/test_nvml_json.py (also under ASan).
TEST_BINS += $(BUILD)/tests/test_nvml_json $(BUILD)/tests/test_nvml_view

$(BUILD)/tests/test_nvml_json: $(BUILD)/obj/client/nvml/test_json.o $(BUILD)/obj/client/nvml/json.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^

$(BUILD)/tests/test_nvml_view: $(BUILD)/obj/client/nvml/test_nvml_view.o \
		$(BUILD)/obj/client/nvml/nvml_view.o $(BUILD)/obj/client/nvml/json.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -lm
