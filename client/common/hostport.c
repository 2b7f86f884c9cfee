/*
 * hostport.c: the address syntax of a gpupool server ("host:port", "[v6]:port", a bare host).
 * Apart from net.c, which connects: the configuration reader checks addresses without linking
 * any of the network and TLS code.
 */
#include <stdio.h>
#include <string.h>

#include "client_config.h" /* GP_DEFAULT_PORT */
#include "hostport.h"

int gp_split_hostport(const char *s, char *host, size_t hcap, char *port, size_t pcap)
{
    const char *colon;
    if (!strchr(s, ':') && s[0] != '[') {
        if (strlen(s) >= hcap || !*s)
            return -1;
        strcpy(host, s);
        snprintf(port, pcap, "%s", GP_DEFAULT_PORT);
        return 0;
    }
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (!close || close[1] != ':')
            return -1;
        if ((size_t)(close - s - 1) >= hcap)
            return -1;
        memcpy(host, s + 1, (size_t)(close - s - 1));
        host[close - s - 1] = 0;
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon || (size_t)(colon - s) >= hcap)
            return -1;
        memcpy(host, s, (size_t)(colon - s));
        host[colon - s] = 0;
    }
    if (!colon[1] || strlen(colon + 1) >= pcap)
        return -1;
    for (const char *p = colon + 1; *p; p++)
        if (*p < '0' || *p > '9')
            return -1;
    strcpy(port, colon + 1);
    return host[0] ? 0 : -1;
}
