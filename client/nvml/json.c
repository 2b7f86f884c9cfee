/*
 * json.c: the strict JSON parser of json.h. Recursive descent over a bounded input; every
 * allocation is checked and a failed parse frees what it built. Numbers follow the RFC grammar
 * exactly (no leading zeros, no "+", no ".5", no NaN) and are converted with strtod on a copy,
 * so the input need not be NUL-terminated.
 */
#include "json.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct parser {
    const char *p, *start, *end;
    int depth;
    char *err;
    size_t errcap;
    int failed;
} parser;

static void fail(parser *ps, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(parser *ps, const char *fmt, ...)
{
    if (ps->failed)
        return;
    ps->failed = 1;
    if (!ps->err || ps->errcap == 0)
        return;
    int n = snprintf(ps->err, ps->errcap, "offset %zu: ", (size_t)(ps->p - ps->start));
    if (n < 0 || (size_t)n >= ps->errcap)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ps->err + n, ps->errcap - (size_t)n, fmt, ap);
    va_end(ap);
}

static void skip_ws(parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static void free_members(gp_json_value *v)
{
    if (v->type == GPJ_STRING) {
        free(v->str);
    } else if (v->type == GPJ_ARRAY || v->type == GPJ_OBJECT) {
        for (size_t i = 0; i < v->len; i++) {
            free_members(&v->items[i]);
            if (v->keys)
                free(v->keys[i]);
        }
        free(v->items);
        free(v->keys);
    }
    memset(v, 0, sizeof *v);
}

void gp_json_free(gp_json_value *v)
{
    if (!v)
        return;
    free_members(v);
    free(v);
}

static int parse_value(parser *ps, gp_json_value *out);

/* ------------------------------------------------------------------------------ strings == */

static int hex4(parser *ps, unsigned *out)
{
    if (ps->end - ps->p < 4) {
        fail(ps, "truncated \\u escape");
        return -1;
    }
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = ps->p[i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else {
            fail(ps, "bad hex digit in \\u escape");
            return -1;
        }
    }
    ps->p += 4;
    *out = v;
    return 0;
}

static size_t put_utf8(char *dst, unsigned cp)
{
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        dst[0] = (char)(0xC0 | (cp >> 6));
        dst[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char)(0xE0 | (cp >> 12));
        dst[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    dst[0] = (char)(0xF0 | (cp >> 18));
    dst[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    dst[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    dst[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Length of the valid UTF-8 sequence at s (at most n bytes), or 0 when it is not valid
 * (overlong forms, surrogates and code points above U+10FFFF are invalid). */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    if (c < 0x80)
        return 1;
    size_t len;
    unsigned cp;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

/* At the opening quote. The decoded string is never longer than its source. */
static char *parse_string(parser *ps, size_t *len_out)
{
    ps->p++; /* '"' */
    const char *q = ps->p;
    while (q < ps->end && *q != '"')
        q += (*q == '\\' && q + 1 < ps->end) ? 2 : 1;
    if (q >= ps->end) {
        fail(ps, "unterminated string");
        return NULL;
    }
    char *out = malloc((size_t)(q - ps->p) + 1);
    if (!out) {
        fail(ps, "out of memory");
        return NULL;
    }
    size_t n = 0;
    while (ps->p < ps->end && *ps->p != '"') {
        unsigned char c = (unsigned char)*ps->p;
        if (c < 0x20) {
            fail(ps, "control character in string (escape it)");
            goto bad;
        }
        if (c != '\\') {
            size_t k = utf8_len((const unsigned char *)ps->p, (size_t)(ps->end - ps->p));
            if (k == 0) {
                fail(ps, "invalid UTF-8 in string");
                goto bad;
            }
            memcpy(out + n, ps->p, k);
            n += k;
            ps->p += k;
            continue;
        }
        ps->p++;
        if (ps->p >= ps->end) {
            fail(ps, "unterminated string");
            goto bad;
        }
        char e = *ps->p++;
        switch (e) {
        case '"':
            out[n++] = '"';
            break;
        case '\\':
            out[n++] = '\\';
            break;
        case '/':
            out[n++] = '/';
            break;
        case 'b':
            out[n++] = '\b';
            break;
        case 'f':
            out[n++] = '\f';
            break;
        case 'n':
            out[n++] = '\n';
            break;
        case 'r':
            out[n++] = '\r';
            break;
        case 't':
            out[n++] = '\t';
            break;
        case 'u': {
            unsigned cp;
            if (hex4(ps, &cp) != 0)
                goto bad;
            if (cp >= 0xDC00 && cp <= 0xDFFF) {
                fail(ps, "lone low surrogate in \\u escape");
                goto bad;
            }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo;
                if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u') {
                    fail(ps, "high surrogate not followed by a \\u low surrogate");
                    goto bad;
                }
                ps->p += 2;
                if (hex4(ps, &lo) != 0)
                    goto bad;
                if (lo < 0xDC00 || lo > 0xDFFF) {
                    fail(ps, "high surrogate not followed by a low surrogate");
                    goto bad;
                }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            /* 6 source bytes give at most 3, 12 at most 4: the buffer is large enough. */
            n += put_utf8(out + n, cp);
            break;
        }
        default:
            ps->p--;
            fail(ps, "unknown escape \\%c", e);
            goto bad;
        }
    }
    ps->p++; /* closing '"' */
    out[n] = '\0';
    *len_out = n;
    return out;
bad:
    free(out);
    return NULL;
}

/* ------------------------------------------------------------------------------ numbers == */

static int is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static int parse_number(parser *ps, gp_json_value *out)
{
    const char *s = ps->p, *q = ps->p;
    int integral = 1;
    if (q < ps->end && *q == '-')
        q++;
    if (q >= ps->end || !is_digit(*q)) {
        fail(ps, "expected a digit");
        return -1;
    }
    if (*q == '0') {
        q++;
        if (q < ps->end && is_digit(*q)) {
            ps->p = q;
            fail(ps, "leading zero in number");
            return -1;
        }
    } else {
        while (q < ps->end && is_digit(*q))
            q++;
    }
    if (q < ps->end && *q == '.') {
        integral = 0;
        q++;
        if (q >= ps->end || !is_digit(*q)) {
            ps->p = q;
            fail(ps, "expected a digit after '.'");
            return -1;
        }
        while (q < ps->end && is_digit(*q))
            q++;
    }
    if (q < ps->end && (*q == 'e' || *q == 'E')) {
        integral = 0;
        q++;
        if (q < ps->end && (*q == '+' || *q == '-'))
            q++;
        if (q >= ps->end || !is_digit(*q)) {
            ps->p = q;
            fail(ps, "expected a digit in the exponent");
            return -1;
        }
        while (q < ps->end && is_digit(*q))
            q++;
    }
    size_t n = (size_t)(q - s);
    char buf[64];
    char *copy = n < sizeof buf ? buf : malloc(n + 1);
    if (!copy) {
        fail(ps, "out of memory");
        return -1;
    }
    memcpy(copy, s, n);
    copy[n] = '\0';
    out->type = GPJ_NUMBER;
    out->num = strtod(copy, NULL); /* grammar checked above; overflow gives +-HUGE_VAL */
    if (integral) {
        errno = 0;
        long long v = strtoll(copy, NULL, 10);
        if (errno == 0) {
            out->is_int = 1;
            out->i = (int64_t)v;
        }
    }
    if (copy != buf)
        free(copy);
    ps->p = q;
    return 0;
}

/* ------------------------------------------------------------------- arrays and objects == */

static int grow(parser *ps, gp_json_value *v, size_t *cap, int with_keys)
{
    if (v->len < *cap)
        return 0;
    size_t nc = *cap ? *cap * 2 : 4;
    gp_json_value *items = realloc(v->items, nc * sizeof *items);
    if (!items) {
        fail(ps, "out of memory");
        return -1;
    }
    v->items = items;
    if (with_keys) {
        char **keys = realloc(v->keys, nc * sizeof *keys);
        if (!keys) {
            fail(ps, "out of memory");
            return -1;
        }
        v->keys = keys;
    }
    *cap = nc;
    return 0;
}

static int parse_array(parser *ps, gp_json_value *out)
{
    size_t cap = 0;
    out->type = GPJ_ARRAY;
    ps->p++; /* '[' */
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == ']') {
        ps->p++;
        return 0;
    }
    for (;;) {
        if (grow(ps, out, &cap, 0) != 0)
            return -1;
        gp_json_value *item = &out->items[out->len];
        memset(item, 0, sizeof *item);
        if (parse_value(ps, item) != 0) {
            free_members(item);
            return -1;
        }
        out->len++;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == ']') {
            ps->p++;
            return 0;
        }
        fail(ps, "expected ',' or ']'");
        return -1;
    }
}

static int parse_object(parser *ps, gp_json_value *out)
{
    size_t cap = 0;
    out->type = GPJ_OBJECT;
    ps->p++; /* '{' */
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '}') {
        ps->p++;
        return 0;
    }
    for (;;) {
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != '"') {
            fail(ps, "expected a string key");
            return -1;
        }
        if (grow(ps, out, &cap, 1) != 0)
            return -1;
        size_t klen;
        char *key = parse_string(ps, &klen);
        if (!key)
            return -1;
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != ':') {
            free(key);
            fail(ps, "expected ':'");
            return -1;
        }
        ps->p++;
        gp_json_value *item = &out->items[out->len];
        memset(item, 0, sizeof *item);
        if (parse_value(ps, item) != 0) {
            free_members(item);
            free(key);
            return -1;
        }
        out->keys[out->len] = key;
        out->len++;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == '}') {
            ps->p++;
            return 0;
        }
        fail(ps, "expected ',' or '}'");
        return -1;
    }
}

static int literal(parser *ps, const char *word, gp_json_type type, gp_json_value *out)
{
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) {
        fail(ps, "unexpected character '%c'", *ps->p);
        return -1;
    }
    ps->p += n;
    out->type = type;
    return 0;
}

static int parse_value(parser *ps, gp_json_value *out)
{
    skip_ws(ps);
    if (ps->p >= ps->end) {
        fail(ps, "unexpected end of input");
        return -1;
    }
    switch (*ps->p) {
    case '{':
    case '[': {
        if (++ps->depth > GPJ_MAX_DEPTH) {
            fail(ps, "nested deeper than %d levels", GPJ_MAX_DEPTH);
            return -1;
        }
        int rc = *ps->p == '{' ? parse_object(ps, out) : parse_array(ps, out);
        ps->depth--;
        return rc;
    }
    case '"':
        out->type = GPJ_STRING;
        out->str = parse_string(ps, &out->len);
        if (!out->str) {
            out->type = GPJ_NULL;
            return -1;
        }
        return 0;
    case 't':
        return literal(ps, "true", GPJ_TRUE, out);
    case 'f':
        return literal(ps, "false", GPJ_FALSE, out);
    case 'n':
        return literal(ps, "null", GPJ_NULL, out);
    default:
        if (*ps->p == '-' || is_digit(*ps->p))
            return parse_number(ps, out);
        if ((unsigned char)*ps->p >= 0x20 && (unsigned char)*ps->p < 0x7F)
            fail(ps, "unexpected character '%c'", *ps->p);
        else
            fail(ps, "unexpected byte 0x%02x", (unsigned char)*ps->p);
        return -1;
    }
}

gp_json_value *gp_json_parse(const char *text, size_t len, char *err, size_t errcap)
{
    if (err && errcap)
        err[0] = '\0';
    parser ps = {.p = text, .start = text, .end = text + len, .err = err, .errcap = errcap};
    if (!text) {
        fail(&ps, "no input");
        return NULL;
    }
    gp_json_value *v = calloc(1, sizeof *v);
    if (!v) {
        fail(&ps, "out of memory");
        return NULL;
    }
    if (parse_value(&ps, v) != 0) {
        gp_json_free(v);
        return NULL;
    }
    skip_ws(&ps);
    if (ps.p != ps.end) {
        fail(&ps, "unexpected data after the value");
        gp_json_free(v);
        return NULL;
    }
    return v;
}

/* ------------------------------------------------------------------------------ lookups == */

const gp_json_value *gp_json_get(const gp_json_value *obj, const char *key)
{
    if (!obj || obj->type != GPJ_OBJECT || !key)
        return NULL;
    for (size_t i = 0; i < obj->len; i++)
        if (strcmp(obj->keys[i], key) == 0)
            return &obj->items[i];
    return NULL;
}

const gp_json_value *gp_json_at(const gp_json_value *arr, size_t i)
{
    if (!arr || arr->type != GPJ_ARRAY || i >= arr->len)
        return NULL;
    return &arr->items[i];
}

size_t gp_json_count(const gp_json_value *v)
{
    return v && (v->type == GPJ_ARRAY || v->type == GPJ_OBJECT) ? v->len : 0;
}

const char *gp_json_string(const gp_json_value *v, const char *dflt)
{
    return v && v->type == GPJ_STRING ? v->str : dflt;
}

int gp_json_is_null(const gp_json_value *v)
{
    return !v || v->type == GPJ_NULL;
}

int gp_json_number(const gp_json_value *v, double *out)
{
    if (!v || v->type != GPJ_NUMBER)
        return 0;
    *out = v->num;
    return 1;
}

int gp_json_i64(const gp_json_value *v, int64_t *out)
{
    if (!v || v->type != GPJ_NUMBER || !v->is_int)
        return 0;
    *out = v->i;
    return 1;
}

int gp_json_u64(const gp_json_value *v, uint64_t *out)
{
    if (!v || v->type != GPJ_NUMBER || !v->is_int || v->i < 0)
        return 0;
    *out = (uint64_t)v->i;
    return 1;
}

int gp_json_bool(const gp_json_value *v, int dflt)
{
    if (v && v->type == GPJ_TRUE)
        return 1;
    if (v && v->type == GPJ_FALSE)
        return 0;
    return dflt;
}
