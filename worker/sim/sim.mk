# The simulated device: libgpupool-sim.so, a driver with libcuda.so.1's C API that the worker
# dlopen()s instead of the real one (worker/sim/README.md).
SIM_SRCS := $(sort $(wildcard worker/sim/*.c))
SIM_OBJS := $(SIM_SRCS:%.c=$(BUILD)/obj/%.o)
SIM_LIB  := $(BUILD)/libgpupool-sim.so

ALL_TARGETS += $(SIM_LIB)

# -z defs: an undefined symbol is a link error here, not a dlopen() failure in the worker.
$(SIM_LIB): $(SIM_OBJS)
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS_COMMON) -Wl,-z,defs -Wl,-soname,libgpupool-sim.so -o $@ $^ -ldl -lpthread
