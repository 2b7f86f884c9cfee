/*
 * spread_connect.c: the shim's connect step alone (gp_connect_parts, client/shim/connect_parts.h),
 * for tests/test_shim_spread_connect.py: a lease spread over several servers (issue 37, item 3)
 * is connected part by part before conn.c holds one connection per part, so no CUDA program can
 * reach this yet. Connects with the process's configuration (GPUPOOL_*) as the shim does, prints
 * one line per part, the window and what the snapshot announces, then closes every part.
 * Exit 0: connected; 1: not (the shim's one line is on stderr).
 */
#include <stdio.h>
#include <unistd.h>

#include "connect_parts.h"
#include "shim.h"
#include "shim_core.h"

#define CAP 64

int main(void)
{
    static gp_part_link parts[CAP];
    int n = 0;
    if (gp_connect_parts(parts, CAP, &n) != CUDA_SUCCESS) {
        printf("FAIL spread_connect: not connected\n");
        return 1;
    }
    printf("window 0x%llx 0x%llx\n", (unsigned long long)gp_vamap_window_base(),
           (unsigned long long)gp_vamap_window_size());
    for (int i = 0; i < n; i++)
        printf("part %d server %s first_device %d ndevices %d va_base 0x%llx va_size 0x%llx "
               "session %llu connected %d\n",
               i, parts[i].desc, parts[i].first_device, parts[i].ndevices,
               (unsigned long long)parts[i].va_base, (unsigned long long)parts[i].va_size,
               (unsigned long long)parts[i].session_id, parts[i].fd >= 0);
    printf("announced %d session %llu\n", gp_device_announced(),
           (unsigned long long)gp_session_id());
    for (int i = 0; i < n; i++) {
        gp_tls_free(parts[i].tls);
        if (close(parts[i].fd) != 0)
            perror("close");
    }
    printf("PASS spread_connect: %d part%s\n", n, n == 1 ? "" : "s");
    return 0;
}
