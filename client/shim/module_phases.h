/*
 * module_phases.h: where a module load's time goes on the client, phase by phase, for the
 * profile (GPUPOOL_PROFILE, profile.c): hashing the image, asking the server whether it has it
 * (a module_load without the image) and sending it when it does not. The server's side, the
 * driver's load and PTX JIT included, is module_load's worker ms in the profile's op table.
 */
#ifndef GP_MODULE_PHASES_H
#define GP_MODULE_PHASES_H

#include <stdint.h>

enum {
    GP_MODPHASE_HASH,   /* SHA-256 of the image (api_module.c names images by it) */
    GP_MODPHASE_PROBE,  /* module_load without the image: answered by the server's cache */
    GP_MODPHASE_UPLOAD, /* module_load with the image: the server did not have it */
    GP_MODPHASES
};

typedef struct gp_module_phase {
    uint64_t count, bytes, ns;
} gp_module_phase;

extern const char *const gp_module_phase_names[GP_MODPHASES];

/* Monotonic nanoseconds, for timing a phase. */
uint64_t gp_module_phase_now_ns(void);
/* One phase of a load: the image bytes it handled and the nanoseconds it took. */
void gp_module_phase_add(int phase, uint64_t bytes, uint64_t ns);
/* The totals so far. */
void gp_module_phases_snapshot(gp_module_phase out[GP_MODPHASES]);

#endif /* GP_MODULE_PHASES_H */
