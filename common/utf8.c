/*
 * utf8.c: texts that cross a boundary as UTF-8 (utf8.h). The client cleans what it sends and
 * shows (host names, server messages); the worker cleans what it reports to gpupoold (device
 * names, end details), whose reader takes only valid UTF-8 (the spec's string type).
 */
#include <string.h>

#include "utf8.h"

size_t gp_utf8_clean(char *dst, size_t cap, const char *src, size_t n)
{
    size_t o = 0;
    const unsigned char *s = (const unsigned char *)src;
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        int ok = k > 0 && i + k <= n && c != 0xC0 && c != 0xC1 && c <= 0xF4;
        for (size_t j = 1; ok && j < k; j++)
            ok = (s[i + j] & 0xC0) == 0x80;
        if (ok && k > 2) { /* no overlong forms, surrogates or code points past U+10FFFF */
            unsigned c1 = s[i + 1];
            if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 > 0x9F) || (c == 0xF0 && c1 < 0x90) ||
                (c == 0xF4 && c1 > 0x8F))
                ok = 0;
        }
        if (!ok)
            k = 1;
        if (o + (ok ? k : 1) >= cap)
            break;
        if (ok) {
            memcpy(dst + o, s + i, k);
            o += k;
        } else {
            dst[o++] = '?';
        }
        i += k;
    }
    dst[o] = 0;
    return o;
}
