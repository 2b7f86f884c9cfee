# The shim's tables and their helpers (owned by the cuda-tables work; included by shim.mk).
#   generated/  from cudaapi/gen_cuda_tables.py (make gen): exported-symbol stubs,
#               the cuGetProcAddress table, CUresult names
#   *.c         cuGetProcAddress, cuGetExportTable + dark-API tables, integrity check,
#               MD2 / HMAC-MD2 (SHA-256 is common/sha256.c), the "not implemented" answer
# The hand-written files need hooks that the shim core defines (see export_tables.h and
# integrity.h): gp_ctx_current_for_tables, gp_ctx_primary_for_tables,
# gp_integrity_driver_version, gp_integrity_devices.
SHIM_TABLE_GEN_SRCS := \
	client/shim/generated/gp_stubs.c \
	client/shim/generated/gp_procaddr_table.c \
	client/shim/generated/gp_errors.c

SHIM_TABLE_SRCS := \
	$(SHIM_TABLE_GEN_SRCS) \
	client/shim/unimplemented.c \
	client/shim/procaddr.c \
	client/shim/export_tables.c \
	client/shim/integrity.c \
	client/shim/md2.c \
	client/shim/hmac_md2.c

SHIM_TABLE_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,$(SHIM_TABLE_SRCS))
