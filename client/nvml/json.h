/*
 * json.h: a small strict JSON parser (RFC 8259) for the NVML shim's `info` documents.
 *
 * Accepts exactly one value (objects, arrays, strings with escapes and \u surrogate pairs,
 * numbers, true/false/null) with optional whitespace around it; anything else is an error
 * with the byte offset and what was expected. Strings must be valid UTF-8; nesting is limited
 * to GPJ_MAX_DEPTH levels. The parsed tree is immutable; free it with gp_json_free.
 * No global state: thread-safe.
 */
#ifndef GP_NVML_JSON_H
#define GP_NVML_JSON_H

#include <stddef.h>
#include <stdint.h>

#define GPJ_MAX_DEPTH 64

typedef enum gp_json_type {
    GPJ_NULL = 0,
    GPJ_FALSE,
    GPJ_TRUE,
    GPJ_NUMBER,
    GPJ_STRING,
    GPJ_ARRAY,
    GPJ_OBJECT,
} gp_json_type;

typedef struct gp_json_value gp_json_value;
struct gp_json_value {
    gp_json_type type;
    double num; /* GPJ_NUMBER */
    int is_int; /* GPJ_NUMBER written as an integer that fits in int64 (value in i) */
    int64_t i;
    char *str;            /* GPJ_STRING: NUL-terminated UTF-8 (may hold an escaped \u0000) */
    size_t len;           /* GPJ_STRING: bytes; GPJ_ARRAY/GPJ_OBJECT: members */
    gp_json_value *items; /* GPJ_ARRAY elements, GPJ_OBJECT values */
    char **keys;          /* GPJ_OBJECT keys (NUL-terminated), parallel to items */
};

/* Parse text[0..len). Returns the tree (free with gp_json_free), or NULL with a one-line error in
 * err ("offset 12: expected ',' or '}'"). */
gp_json_value *gp_json_parse(const char *text, size_t len, char *err, size_t errcap);
void gp_json_free(gp_json_value *v);

/* Lookups; each accepts NULL and answers NULL / the default, so chains need no checks. */
const gp_json_value *gp_json_get(const gp_json_value *obj,
                                 const char *key); /* first member named key */
const gp_json_value *gp_json_at(const gp_json_value *arr, size_t i);
size_t gp_json_count(const gp_json_value *v); /* array/object members, else 0 */
const char *gp_json_string(const gp_json_value *v, const char *dflt); /* the string, else dflt */
int gp_json_is_null(const gp_json_value *v);                          /* missing or null */
/* 1 and *out when v is a number (any), else 0. */
int gp_json_number(const gp_json_value *v, double *out);
/* 1 and *out when v is an integer >= 0 written without fraction/exponent, else 0. */
int gp_json_u64(const gp_json_value *v, uint64_t *out);
/* 1 and *out when v is an integer written without fraction/exponent, else 0. */
int gp_json_i64(const gp_json_value *v, int64_t *out);
/* 1 for true, 0 for false, dflt otherwise. */
int gp_json_bool(const gp_json_value *v, int dflt);

#endif
