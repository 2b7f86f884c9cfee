# C unit tests of the shim core's data structures (VA map, handles). Included by the top-level
# Makefile; binaries go to $(BUILD)/tests/ and into TEST_BINS.
TEST_BINS += $(BUILD)/tests/test_vamap $(BUILD)/tests/test_handles \
             $(BUILD)/tests/test_requirements

$(BUILD)/tests/test_vamap: $(BUILD)/obj/tests/c/test_vamap.o $(BUILD)/obj/client/shim/vamap.o \
		$(BUILD)/obj/client/shim/handles.o $(BUILD)/obj/client/common/log.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -lpthread

$(BUILD)/tests/test_handles: $(BUILD)/obj/tests/c/test_handles.o \
		$(BUILD)/obj/client/shim/handles.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -lpthread

$(BUILD)/tests/test_requirements: $(BUILD)/obj/tests/c/test_requirements.o \
		$(BUILD)/obj/client/common/requirements.o $(BUILD)/obj/client/common/log.o \
		$(GP_UTF8_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^

# A driver-API client of the shim for the end-to-end tests (tests/test_shim_core.py); it needs a
# server, so it is built here but run by pytest. Linked against the shim itself (rpath).
TEST_BINS += $(BUILD)/tests/shim_scenarios
$(BUILD)/tests/shim_scenarios: $(BUILD)/obj/tests/c/shim_scenarios.o $(BUILD)/client/libcuda.so.1
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $< $(BUILD)/client/libcuda.so.1 -Wl,-rpath,'$$ORIGIN/../client' \
		-lpthread

# The connect step of a spread lease alone (gp_connect_parts; tests/test_shim_spread_connect.py,
# issue 37, item 3). Its functions are hidden in libcuda.so.1, so it links the shim's objects
# themselves, with the library's --wrap flags.
# test_connect_parts: its checks over TLS, a part's pin against the client's own, the slices.
TEST_BINS += $(BUILD)/tests/spread_connect $(BUILD)/tests/test_connect_parts
$(BUILD)/tests/spread_connect $(BUILD)/tests/test_connect_parts: $(BUILD)/tests/%: \
		$(BUILD)/obj/tests/c/%.o $(SHIM_OBJS) $(PROTO_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ \
		-Wl,--wrap=gp_post,--wrap=gp_post_lz4,--wrap=gp_request,--wrap=gp_request_detached \
		-lpthread -ldl
