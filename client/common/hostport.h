/*
 * hostport.h: the address syntax of a gpupool server (hostport.c).
 */
#ifndef GP_HOSTPORT_H
#define GP_HOSTPORT_H

#include <stddef.h>

/* Split "host:port" / "[v6]:port"; a bare host name (no colon at all) means gpupoold's default
 * port (GP_DEFAULT_PORT). 0, or -1 when it is not an address. */
int gp_split_hostport(const char *s, char *host, size_t hcap, char *port, size_t pcap);

#endif /* GP_HOSTPORT_H */
