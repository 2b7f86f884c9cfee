# C tests of the simulated device (worker/sim). tests/test_sim_device.py builds them with
# `make sim_tests`, compiles the CUDA test kernels with nvcc and runs them.
SIM_TEST_API_NAMES := test_sim_config test_sim_memory test_sim_stream test_sim_launch \
	test_sim_checkpoint \
	test_sim_memfile test_sim_graph test_sim_export test_sim_tensormap test_sim_shared test_sim_ipc
SIM_TEST_BINS := $(SIM_TEST_API_NAMES:%=$(BUILD)/tests/%) $(BUILD)/tests/test_sim_elf \
	$(BUILD)/tests/test_pacing
SIM_TEST_UTIL := $(BUILD)/obj/tests/sim/sim_test.o

# Helpers of tests/test_sim_device.py and tests/test_scrub.py: a tenant process for the memory
# file tests, and a stand-in driver that makes gpupool-scrub's failure paths reachable.
SIM_TEST_TOOLS := $(BUILD)/tests/sim_memtool $(BUILD)/tests/libscrub_fake_driver.so

TEST_BINS += $(SIM_TEST_BINS) $(SIM_TEST_TOOLS)
EXTRA_CFLAGS_tests_sim_ := -I$(CURDIR)/worker/sim -idirafter $(CURDIR)/worker

# These call the library through its exported API, as the worker does.
$(SIM_TEST_API_NAMES:%=$(BUILD)/tests/%): $(BUILD)/tests/%: $(BUILD)/obj/tests/sim/%.o \
		$(SIM_TEST_UTIL) $(SIM_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $< $(SIM_TEST_UTIL) -L$(BUILD) -lgpupool-sim \
		-Wl,-rpath,'$$ORIGIN/..' -ldl -lpthread

# The image parser test calls internal functions, so it links the sim's objects directly.
$(BUILD)/tests/test_sim_elf: $(BUILD)/obj/tests/sim/test_sim_elf.o $(SIM_TEST_UTIL) $(SIM_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $^ -ldl -lpthread

$(BUILD)/tests/sim_memtool: $(BUILD)/obj/tests/sim/sim_memtool.o $(SIM_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $< -L$(BUILD) -lgpupool-sim -Wl,-rpath,'$$ORIGIN/..' -lpthread

$(BUILD)/tests/libscrub_fake_driver.so: $(BUILD)/obj/tests/sim/scrub_fake_driver.o
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS_COMMON) -Wl,-z,defs -o $@ $^ -lpthread

.PHONY: sim_tests
sim_tests: $(SIM_LIB) $(SIM_TEST_BINS) $(SIM_TEST_TOOLS)

# The worker's pacing (worker/pacing.c, issue 32 item 4) linked alone with the simulated device.
$(BUILD)/tests/test_pacing: $(BUILD)/obj/tests/sim/test_pacing.o $(SIM_TEST_UTIL) \
		$(BUILD)/obj/worker/pacing.o $(BUILD)/obj/worker/log.o $(SIM_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_COMMON) -o $@ $(filter %.o,$^) -L$(BUILD) -lgpupool-sim \
		-Wl,-rpath,'$$ORIGIN/..' -ldl -lpthread
