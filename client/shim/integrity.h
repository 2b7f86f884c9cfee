/*
 * integrity.h: the answer to cudart's integrity check (export table INTEGRITY_CHECK, slot 1).
 *
 * cudart calls it three times at start-up and refuses to run (error 103, "integrity checks
 * failed") unless the answer is right. The answer hashes client-side addresses, the process and
 * thread ids and the devices the shim reports, so it is computed here, never on the server.
 */
#ifndef GP_INTEGRITY_H
#define GP_INTEGRITY_H

#include "gp_cuda.h"

/* The most devices the answer can cover (the hash includes every device the shim reports). */
#define GP_INTEGRITY_MAX_DEVICES 64

/* ---- hooks the shim core DEFINES (integrity.c calls them) ----------------------------------- */

/* The driver version the shim reports through cuDriverGetVersion (e.g. 13000). The hash must
 * use exactly that value, or cudart rejects the answer. Negative if not known yet. */
int gp_integrity_driver_version(void);

/* Fills up to `max` devices, in ordinal order, with the UUID and PCI domain/bus/device numbers
 * the shim reports for them (cuDeviceGetUuid, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID / _BUS_ID /
 * _DEVICE_ID), and returns how many it wrote; -1 if the device list is not known yet. */
int gp_integrity_devices(CUuuid *uuids, int *pci_domain, int *pci_bus, int *pci_dev, int max);

/* ---- defined by integrity.c ------------------------------------------------------------------ */

/* The addresses the answer hashes, which belong to the export tables (export_tables.c passes
 * them, so that this file needs nothing from it): the CUDART_INTERFACE and INTEGRITY_CHECK
 * tables and the function in the INTEGRITY_CHECK table's slot 1, the one cudart called. */
typedef struct gp_integrity_addresses {
    const void *cudart_interface;
    const void *integrity_table;
    const void *check_fn;
} gp_integrity_addresses;

/* The answer of INTEGRITY_CHECK slot 1, integrity_check(version, unix_seconds, out[2]).
 * version % 10 == 0 or 1: fixed answers. Otherwise HMAC-MD2 (16-byte key) over the packed
 * little-endian message {u32 driver_version, u32 version, u32 getpid(), u32 pthread_self(),
 * ptr CUDART_INTERFACE table, ptr INTEGRITY_CHECK table, ptr the slot's function, u64
 * unix_seconds} followed per device by {16-byte uuid, i32 pci_domain, i32 pci_bus, i32
 * pci_device}; the 16-byte digest is returned as two little-endian u64. */
CUresult gp_integrity_answer(unsigned int version, unsigned long long unix_seconds,
                             const gp_integrity_addresses *addr, unsigned long long out[2]);

#endif /* GP_INTEGRITY_H */
