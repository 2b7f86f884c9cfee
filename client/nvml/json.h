/*
 * json.h: a small strict JSON parser (RFC 8259) for the NVML shim's `info` documents.
 *
 * Accepts exactly one value (objects, arrays, strings with escapes and \u surrogate pairs,
 * numbers, true/false/null) with optional whitespace around it; anything else is an error
 * with the byte offset and what was expected. Strings must be valid UTF-8; nesting is limited
 * to GPJ_MAX_DEPTH levels. The parsed tree is immutable; free it with gpj_free.
 * No global state: thread-safe.
 */
#ifndef GP_NVML_JSON_H
#define GP_NVML_JSON_H

#include <stddef.h>
#include <stdint.h>

#define GPJ_MAX_DEPTH 64

typedef enum gpj_type {
    GPJ_NULL = 0,
    GPJ_FALSE,
    GPJ_TRUE,
    GPJ_NUMBER,
    GPJ_STRING,
    GPJ_ARRAY,
    GPJ_OBJECT,
} gpj_type;

typedef struct gpj_value gpj_value;
struct gpj_value {
    gpj_type type;
    double num;          /* GPJ_NUMBER */
    int is_int;          /* GPJ_NUMBER written as an integer that fits in int64 (value in i) */
    int64_t i;
    char *str;           /* GPJ_STRING: NUL-terminated UTF-8 (may hold an escaped \u0000) */
    size_t len;          /* GPJ_STRING: bytes; GPJ_ARRAY/GPJ_OBJECT: members */
    gpj_value *items;    /* GPJ_ARRAY elements, GPJ_OBJECT values */
    char **keys;         /* GPJ_OBJECT keys (NUL-terminated), parallel to items */
};

/* Parse text[0..len). Returns the tree (free with gpj_free), or NULL with a one-line error in
 * err ("offset 12: expected ',' or '}'"). */
gpj_value *gpj_parse(const char *text, size_t len, char *err, size_t errcap);
void gpj_free(gpj_value *v);

/* Lookups; each accepts NULL and answers NULL / the default, so chains need no checks. */
const gpj_value *gpj_get(const gpj_value *obj, const char *key); /* first member named key */
const gpj_value *gpj_at(const gpj_value *arr, size_t i);
size_t gpj_count(const gpj_value *v);                          /* array/object members, else 0 */
const char *gpj_string(const gpj_value *v, const char *dflt);  /* the string, else dflt */
int gpj_is_null(const gpj_value *v);                           /* missing or null */
/* 1 and *out when v is a number (any), else 0. */
int gpj_number(const gpj_value *v, double *out);
/* 1 and *out when v is an integer >= 0 written without fraction/exponent, else 0. */
int gpj_u64(const gpj_value *v, uint64_t *out);
/* 1 and *out when v is an integer written without fraction/exponent, else 0. */
int gpj_i64(const gpj_value *v, int64_t *out);
/* 1 for true, 0 for false, dflt otherwise. */
int gpj_bool(const gpj_value *v, int dflt);

#endif
