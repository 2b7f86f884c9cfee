/*
 * compress.c: LZ4-compressed copies on the worker side (docs/architecture.md, "Compression of
 * copies"). The block codec is common/compress.c, shared with the shim; this file moves
 * blocks between the socket and copy buffers (staging buffers, or the simulated device's memory)
 * and keeps the byte counts that show what compression saved.
 */
#include <stdlib.h>
#include <string.h>

#include "compress.h"
#include "worker.h"

uint32_t wk_cz_negotiate(struct worker *w, uint32_t hello_flags)
{
    w->cz.on = 0;
    if (!(hello_flags & GP_HELLO_LZ4))
        return 0;
    if (!gp_lz4_available()) {
        wk_log("the client asked for lz4-compressed copies; copies stay uncompressed (%s)",
               gp_lz4_why());
        return 0;
    }
    w->cz.on = 1;
    wk_log("copies of %d bytes or more are lz4-compressed in this session", GP_LZ4_MIN_COPY);
    return GP_HELLO_LZ4;
}

int wk_cz_copy(const struct worker *w, uint64_t n)
{
    return w->cz.on && gp_cz_applies(n);
}

static int scratch(struct worker *w)
{
    if (!w->cz.scratch)
        w->cz.scratch = malloc(GP_CZ_HDR + GP_LZ4_BLOCK);
    return w->cz.scratch ? 0 : -1;
}

int wk_cz_read(struct worker *w, void *dst, size_t n)
{
    uint8_t *d = dst;
    size_t done = 0;
    if (scratch(w) != 0) {
        wk_protocol_error(w, GP_OP_MEMCPY_HTOD, "out of memory for a compressed copy");
        return -1;
    }
    while (done < n) {
        uint8_t hdr[GP_CZ_HDR];
        uint32_t raw, stored;
        const char *why = NULL;
        if (wk_io_read_bulk(w, hdr, sizeof hdr) != 0)
            return -1;
        if (gp_cz_header(hdr, n - done, &raw, &stored, &why) != 0) {
            wk_protocol_error(w, GP_OP_MEMCPY_HTOD, "%s", why);
            return -1;
        }
        if (stored == raw) {
            if (wk_io_read_bulk(w, d ? d + done : NULL, raw) != 0)
                return -1;
        } else if (!d) { /* a failed copy: its data is dropped undecoded */
            if (wk_io_read_bulk(w, NULL, stored) != 0)
                return -1;
        } else {
            if (wk_io_read_bulk(w, w->cz.scratch, stored) != 0)
                return -1;
            if (gp_cz_inflate(w->cz.scratch, stored, d + done, raw, &why) != 0) {
                wk_protocol_error(w, GP_OP_MEMCPY_HTOD, "%s", why);
                return -1;
            }
        }
        w->cz.h2d_wire += GP_CZ_HDR + (uint64_t)stored;
        done += raw;
    }
    w->cz.h2d_raw += n;
    return 0;
}

int wk_cz_write(struct worker *w, const void *src, size_t n, int *raw_run)
{
    const uint8_t *s = src;
    if (scratch(w) != 0) {
        wk_end_session(w, WK_END_WORKER_ERROR, "out of memory for a compressed copy");
        return -1;
    }
    for (size_t off = 0; off < n;) {
        size_t raw = n - off < GP_LZ4_BLOCK ? n - off : GP_LZ4_BLOCK;
        gp_cz_enc st = {.raw_run = *raw_run};
        size_t len = gp_cz_encode(&st, s + off, raw, w->cz.scratch);
        *raw_run = st.raw_run;
        if (wk_io_write_direct(w, w->cz.scratch, len) != 0)
            return -1;
        w->cz.d2h_wire += len;
        off += raw;
    }
    w->cz.d2h_raw += n;
    return 0;
}

void wk_cz_end(struct worker *w)
{
    if (w->cz.h2d_raw || w->cz.d2h_raw)
        wk_log("copy bytes (lz4 %s): host-to-device %llu raw, %llu on the wire; device-to-host "
               "%llu raw, %llu on the wire",
               w->cz.on ? "on" : "off", (unsigned long long)w->cz.h2d_raw,
               (unsigned long long)w->cz.h2d_wire, (unsigned long long)w->cz.d2h_raw,
               (unsigned long long)w->cz.d2h_wire);
    free(w->cz.scratch);
    w->cz.scratch = NULL;
}
