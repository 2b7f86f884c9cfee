# C unit tests of the shim's tables and helpers (cuda-tables work). Included by the top-level
# Makefile; each test binary goes to $(BUILD)/tests/ and into TEST_BINS.
# The shim sources come from client/shim/shim_tables.mk (included here if shim.mk has not).
ifndef SHIM_TABLE_SRCS
include client/shim/shim_tables.mk
endif

# The tests reach the headers of what they test by the include path.
EXTRA_CFLAGS_tests_c_ += -I$(CURDIR)/client/shim -I$(CURDIR)/client/common -I$(CURDIR)/client/nvml
SHIM_OBJ := $(BUILD)/obj/client/shim
CLIENT_COMMON_OBJ := $(BUILD)/obj/client/common

TEST_BINS += $(BUILD)/tests/test_md2 $(BUILD)/tests/test_sha256 \
             $(BUILD)/tests/test_procaddr $(BUILD)/tests/test_export_tables

$(BUILD)/tests/test_md2: $(BUILD)/obj/tests/c/test_md2.o $(SHIM_OBJ)/md2.o $(SHIM_OBJ)/hmac_md2.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^

$(BUILD)/tests/test_sha256: $(BUILD)/obj/tests/c/test_sha256.o $(GP_SHA256_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^

# The generated weak stubs stand in for the functions the shim core implements.
$(BUILD)/tests/test_procaddr: $(BUILD)/obj/tests/c/test_procaddr.o $(SHIM_OBJ)/procaddr.o \
		$(SHIM_OBJ)/generated/gp_procaddr_table.o $(SHIM_OBJ)/generated/gp_stubs.o \
		$(SHIM_OBJ)/generated/gp_errors.o $(SHIM_OBJ)/unimplemented.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -lpthread

# The test defines the shim core's hooks (gp_ctx_*_for_tables, gp_integrity_*).
$(BUILD)/tests/test_export_tables: $(BUILD)/obj/tests/c/test_export_tables.o \
		$(SHIM_OBJ)/export_tables.o $(SHIM_OBJ)/integrity.o $(SHIM_OBJ)/hmac_md2.o \
		$(SHIM_OBJ)/md2.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -lpthread

# The client configuration (client_config.c): files, the TOML subset, the environment on top.
TEST_BINS += $(BUILD)/tests/test_client_config
$(BUILD)/tests/test_client_config: $(BUILD)/obj/tests/c/test_client_config.o \
		$(addprefix $(CLIENT_COMMON_OBJ)/,$(CLIENT_CONFIG_UNITS) requirements.o net.o tls.o log.o) \
		$(GP_UTF8_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -lpthread -ldl

# The LZ4 block codec of compressed copies (common/compress.c).
TEST_BINS += $(BUILD)/tests/test_compress
$(BUILD)/tests/test_compress: $(BUILD)/obj/tests/c/test_compress.o $(GP_COMPRESS_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -ldl -lpthread

# A driver-API client of the shim copying zeros/random both ways (tests/test_e2e_compression.py).
TEST_BINS += $(BUILD)/tests/copy_check
$(BUILD)/tests/copy_check: $(BUILD)/obj/tests/c/copy_check.o $(BUILD)/client/libcuda.so.1
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $< $(BUILD)/client/libcuda.so.1 -Wl,-rpath,'$$ORIGIN/../client'

# A driver-API client of the shim with a lease of several GPUs (issue 37): tests/c/multi_gpu.c,
# run by tests/test_multi_gpu_native.py and the pool's multi-GPU end-to-end test.
TEST_BINS += $(BUILD)/tests/multi_gpu
$(BUILD)/tests/multi_gpu: $(BUILD)/obj/tests/c/multi_gpu.o $(BUILD)/client/libcuda.so.1
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $< $(BUILD)/client/libcuda.so.1 -Wl,-rpath,'$$ORIGIN/../client'

# Two processes of one job sharing device memory through CUDA IPC (issue 37, item 4):
# tests/c/ipc_share.c, run by tests/test_e2e_ipc.py.
TEST_BINS += $(BUILD)/tests/ipc_share
$(BUILD)/tests/ipc_share: $(BUILD)/obj/tests/c/ipc_share.o $(BUILD)/client/libcuda.so.1
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $< $(BUILD)/client/libcuda.so.1 -Wl,-rpath,'$$ORIGIN/../client'

# tests/c/ipc_event.c, run by tests/test_e2e_ipc.py.
TEST_BINS += $(BUILD)/tests/ipc_event
$(BUILD)/tests/ipc_event: $(BUILD)/obj/tests/c/ipc_event.o $(BUILD)/client/libcuda.so.1
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $< $(BUILD)/client/libcuda.so.1 -Wl,-rpath,'$$ORIGIN/../client'

# The client's end of server-to-server copies (api_peer.c) against a fake core (issue 37,
# item 3): run by tests/test_worker_peer_links.py.
TEST_BINS += $(BUILD)/tests/test_api_peer
$(BUILD)/tests/test_api_peer: $(BUILD)/obj/tests/c/test_api_peer.o $(SHIM_OBJ)/api_peer.o \
		$(PROTO_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -pthread -o $@ $^
