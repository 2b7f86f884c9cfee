/*
 * entry_profile.h: calls and time per CUDA entry point, for the profile (GPUPOOL_PROFILE,
 * profile.c). entry_profile.c's header comment says how the entry points are found.
 */
#ifndef GP_ENTRY_PROFILE_H
#define GP_ENTRY_PROFILE_H

#include <stddef.h>
#include <stdint.h>

enum {
    GP_ENTRY_CALLS,    /* times the program called it */
    GP_ENTRY_NS,       /* nanoseconds the program spent in it */
    GP_ENTRY_FRAMES,   /* frames it sent to the server */
    GP_ENTRY_WAITED,   /* of which it waited for the reply: round trips */
    GP_ENTRY_SENT,     /* bytes sent */
    GP_ENTRY_RECEIVED, /* bytes received */
    GP_ENTRY_WAIT_NS,  /* of GP_ENTRY_NS: nanoseconds in the transport (call_counts.h) */
    GP_ENTRY_FIELDS
};

/* One entry point's counters, as gp_entry_snapshot hands them out. */
typedef struct gp_entry_counts {
    uintptr_t fn; /* its address in the shim */
    uint64_t v[GP_ENTRY_FIELDS];
} gp_entry_counts;

/* The frame the calling thread just sent, added to the entry point it is in (none: nothing).
 * call_counts.c calls it for every frame it counts. */
void gp_entry_note_frame(int waited, uint64_t sent, uint64_t received, uint64_t ns);

/* Copies up to cap entry points that were called into out; returns how many there are. */
size_t gp_entry_snapshot(gp_entry_counts *out, size_t cap);

/* Calls of entry points that did not fit the table (more distinct ones than it holds). */
uint64_t gp_entry_overflow(void);

#endif /* GP_ENTRY_PROFILE_H */
