/*
 * fuzz_protocol: every generated decoder of protocol/gpupool.toml (both directions: requests and
 * replies), as the shim and the worker run them on bytes from the network.
 *
 * Input: byte 0 picks the message (an index into gp_samples, the generated table of every
 * message and reply), the rest is its body. Checked: no decoder reads outside the body (ASan);
 * a body that decodes re-encodes to exactly the same bytes (one encoding per message, so a
 * decoder never accepts what the encoder would not write). Bodies with trailing bytes
 * (GP_PROTO_ETRAILING) are decoded up to their known fields only.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gp_protocol.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const gp_sample_entry *e = &gp_samples[data[0] % GP_SAMPLE_COUNT];
    const uint8_t *body = data + 1;
    size_t len = size - 1;
    int rc = e->dec(body, len);
    if (rc != 0 && rc != GP_PROTO_EMALFORMED && rc != GP_PROTO_ETRAILING)
        abort(); /* a decoder returned something the header does not define */
    if (rc != 0)
        return 0; /* malformed, or trailing bytes (read up to the known fields only) */
    /* Decoded: encode it again; what decoded from `len` bytes re-encodes to `len` bytes. */
    uint8_t *again = malloc(len ? len : 1);
    if (!again)
        return 0;
    size_t n = 0;
    if (e->rt(body, len, again, &n) != 0)
        abort(); /* decode+encode failed on a body that decodes */
    if (n != len || memcmp(again, body, len) != 0)
        abort(); /* not the same bytes: two encodings of one message */
    free(again);
    return 0;
}
