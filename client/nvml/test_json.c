/*
 * test_json.c: unit tests of the strict JSON parser (json.c), run under ASan/UBSan by
 * tests/test_nvml_json.py. Prints "all checks passed" and exits 0, or names each failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

static int failures;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                                 \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

/* Parse text exactly as given (not NUL-terminated: a heap copy of just its bytes, so ASan
 * catches any read past the end). */
static gp_json_value *parse_n(const char *text, size_t n, char *err, size_t cap)
{
    char *copy = malloc(n ? n : 1);
    if (!copy) {
        printf("FAIL: out of memory\n");
        exit(1);
    }
    memcpy(copy, text, n);
    gp_json_value *v = gp_json_parse(copy, n, err, cap);
    free(copy);
    return v;
}

static gp_json_value *parse(const char *text)
{
    char err[200];
    gp_json_value *v = parse_n(text, strlen(text), err, sizeof err);
    if (!v)
        printf("  (parse of %s failed: %s)\n", text, err);
    return v;
}

static void expect_error(const char *text, const char *want)
{
    char err[200] = "";
    gp_json_value *v = parse_n(text, strlen(text), err, sizeof err);
    if (v) {
        printf("FAIL: %s parsed, expected error containing \"%s\"\n", text, want);
        failures++;
        gp_json_free(v);
        return;
    }
    if (!strstr(err, want)) {
        printf("FAIL: %s: error \"%s\" does not contain \"%s\"\n", text, err, want);
        failures++;
    }
}

static void test_scalars(void)
{
    gp_json_value *v = parse("  true ");
    CHECK(v && v->type == GPJ_TRUE && gp_json_bool(v, 0) == 1);
    gp_json_free(v);
    v = parse("false");
    CHECK(v && gp_json_bool(v, 1) == 0);
    gp_json_free(v);
    v = parse("null");
    CHECK(v && v->type == GPJ_NULL && gp_json_is_null(v));
    gp_json_free(v);
    CHECK(gp_json_is_null(NULL));

    uint64_t u = 0;
    int64_t i = 0;
    double d = 0;
    v = parse("85899345920");
    CHECK(v && gp_json_u64(v, &u) && u == 85899345920ull);
    gp_json_free(v);
    v = parse("18446744073709551615"); /* past int64: a number, but not an exact integer */
    CHECK(v && v->type == GPJ_NUMBER && !gp_json_u64(v, &u) && gp_json_number(v, &d) && d > 1.8e19);
    gp_json_free(v);
    v = parse("-42");
    CHECK(v && gp_json_i64(v, &i) && i == -42 && !gp_json_u64(v, &u));
    gp_json_free(v);
    v = parse("12.5");
    CHECK(v && gp_json_number(v, &d) && d == 12.5 && !gp_json_i64(v, &i));
    gp_json_free(v);
    v = parse("-0.25e+2");
    CHECK(v && gp_json_number(v, &d) && d == -25.0);
    gp_json_free(v);
    v = parse("1E3");
    CHECK(v && gp_json_number(v, &d) && d == 1000.0 && !v->is_int);
    gp_json_free(v);
    v = parse("0");
    CHECK(v && gp_json_u64(v, &u) && u == 0);
    gp_json_free(v);
    v = parse("1e400"); /* grammatical; overflows to infinity, never an exact integer */
    CHECK(v && gp_json_number(v, &d) && isinf(d) && !gp_json_u64(v, &u));
    gp_json_free(v);
}

static void test_strings(void)
{
    gp_json_value *v = parse("\"a\\\"b\\\\c\\/d\\b\\f\\n\\r\\t\"");
    CHECK(v && v->type == GPJ_STRING && strcmp(v->str, "a\"b\\c/d\b\f\n\r\t") == 0);
    CHECK(v && v->len == 12);
    gp_json_free(v);
    v = parse("\"\\u00e9\\u20AC\"");
    CHECK(v && strcmp(v->str, "\xc3\xa9\xe2\x82\xac") == 0);
    gp_json_free(v);
    v = parse("\"\\ud83d\\ude00\""); /* U+1F600 as a surrogate pair */
    CHECK(v && strcmp(v->str, "\xf0\x9f\x98\x80") == 0 && v->len == 4);
    gp_json_free(v);
    v = parse("\"caf\xc3\xa9 \xf0\x9f\x98\x80\""); /* raw UTF-8 passes through */
    CHECK(v && strcmp(v->str, "caf\xc3\xa9 \xf0\x9f\x98\x80") == 0);
    gp_json_free(v);
    v = parse("\"a\\u0000b\"");
    CHECK(v && v->len == 3 && v->str[1] == '\0' && v->str[2] == 'b');
    gp_json_free(v);
    v = parse("\"\"");
    CHECK(v && v->len == 0 && strcmp(gp_json_string(v, "x"), "") == 0);
    gp_json_free(v);
    CHECK(strcmp(gp_json_string(NULL, "dflt"), "dflt") == 0);
}

static void test_containers(void)
{
    const char *doc = "{\"schema\": 1, \"gpus\": [{\"index\": 0, \"name\": \"H100\", "
                      "\"live\": {\"temperature_c\": null, \"gpu_util\": 12.5}}, {}], "
                      "\"empty\": {}, \"none\": [], \"nested\": [[[]]], \"dup\": 1, \"dup\": 2}";
    gp_json_value *v = parse(doc);
    CHECK(v && v->type == GPJ_OBJECT && gp_json_count(v) == 7);
    int64_t i = 0;
    double d = 0;
    CHECK(gp_json_i64(gp_json_get(v, "schema"), &i) && i == 1);
    const gp_json_value *gpus = gp_json_get(v, "gpus");
    CHECK(gpus && gpus->type == GPJ_ARRAY && gp_json_count(gpus) == 2);
    const gp_json_value *g0 = gp_json_at(gpus, 0);
    CHECK(strcmp(gp_json_string(gp_json_get(g0, "name"), ""), "H100") == 0);
    CHECK(gp_json_is_null(gp_json_get(gp_json_get(g0, "live"), "temperature_c")));
    CHECK(gp_json_get(gp_json_get(g0, "live"), "temperature_c") != NULL);
    CHECK(gp_json_number(gp_json_get(gp_json_get(g0, "live"), "gpu_util"), &d) && d == 12.5);
    CHECK(gp_json_at(gpus, 2) == NULL);
    CHECK(gp_json_get(gpus, "x") == NULL); /* not an object */
    CHECK(gp_json_at(v, 0) == NULL);       /* not an array */
    CHECK(gp_json_get(v, "missing") == NULL);
    CHECK(gp_json_count(gp_json_get(v, "empty")) == 0 &&
          gp_json_get(v, "empty")->type == GPJ_OBJECT);
    CHECK(gp_json_count(gp_json_get(v, "none")) == 0 && gp_json_get(v, "none")->type == GPJ_ARRAY);
    CHECK(gp_json_count(gp_json_at(gp_json_at(gp_json_get(v, "nested"), 0), 0)) == 0);
    CHECK(gp_json_i64(gp_json_get(v, "dup"), &i) && i == 1); /* the first of duplicate keys */
    CHECK(gp_json_get(NULL, "x") == NULL && gp_json_at(NULL, 0) == NULL &&
          gp_json_count(NULL) == 0);
    gp_json_free(v);
    gp_json_free(NULL);

    /* many members: the arrays grow */
    char big[20000];
    size_t n = 0;
    big[n++] = '[';
    for (int k = 0; k < 2000; k++)
        n += (size_t)snprintf(big + n, sizeof big - n, "%s%d", k ? "," : "", k);
    big[n++] = ']';
    big[n] = '\0';
    v = parse(big);
    CHECK(v && gp_json_count(v) == 2000 && gp_json_i64(gp_json_at(v, 1999), &i) && i == 1999);
    gp_json_free(v);

    /* nesting up to the limit works, one more is an error */
    char deep[2 * GPJ_MAX_DEPTH + 3];
    memset(deep, '[', GPJ_MAX_DEPTH);
    memset(deep + GPJ_MAX_DEPTH, ']', GPJ_MAX_DEPTH);
    deep[2 * GPJ_MAX_DEPTH] = '\0';
    v = parse(deep);
    CHECK(v != NULL);
    gp_json_free(v);
    memset(deep, '[', GPJ_MAX_DEPTH + 1);
    memset(deep + GPJ_MAX_DEPTH + 1, ']', GPJ_MAX_DEPTH + 1);
    deep[2 * GPJ_MAX_DEPTH + 2] = '\0';
    expect_error(deep, "nested deeper");
}

static void test_errors(void)
{
    expect_error("", "unexpected end");
    expect_error("   ", "unexpected end");
    expect_error("tru", "unexpected character 't'");
    expect_error("nul", "unexpected character");
    expect_error("True", "unexpected character 'T'");
    expect_error("01", "leading zero");
    expect_error("-", "expected a digit");
    expect_error("+1", "unexpected character '+'");
    expect_error(".5", "unexpected character '.'");
    expect_error("1.", "after '.'");
    expect_error("1e", "exponent");
    expect_error("NaN", "unexpected character 'N'");
    expect_error("[1,]", "unexpected character ']'");
    expect_error("[1 2]", "expected ',' or ']'");
    expect_error("{\"a\":1,}", "expected a string key");
    expect_error("{\"a\" 1}", "expected ':'");
    expect_error("{a:1}", "expected a string key");
    expect_error("{\"a\":1", "expected ',' or '}'");
    expect_error("[", "unexpected end");
    expect_error("\"abc", "unterminated string");
    expect_error("\"abc\\", "unterminated string");
    expect_error("\"a\tb\"", "control character");
    expect_error("\"\\x\"", "unknown escape \\x");
    expect_error("\"\\u12xy\"", "bad hex digit");
    expect_error("\"\\u12\"", "truncated \\u escape");
    expect_error("\"\\u12", "unterminated string");
    expect_error("\"\\ud83d\"", "high surrogate");
    expect_error("\"\\ud83dx\"", "high surrogate");
    expect_error("\"\\ud83d\\u0041\"", "low surrogate");
    expect_error("\"\\ude00\"", "lone low surrogate");
    expect_error("\"\xc3\"", "invalid UTF-8");             /* truncated sequence */
    expect_error("\"\xc0\xaf\"", "invalid UTF-8");         /* overlong */
    expect_error("\"\xed\xa0\x80\"", "invalid UTF-8");     /* encoded surrogate */
    expect_error("\"\xf4\x90\x80\x80\"", "invalid UTF-8"); /* past U+10FFFF */
    expect_error("\"\xff\"", "invalid UTF-8");
    expect_error("{} {}", "after the value");
    expect_error("1 x", "after the value");
    expect_error("\x01", "unexpected byte 0x01");

    /* the offset is reported */
    char err[200];
    gp_json_value *v = gp_json_parse("[1, x]", 6, err, sizeof err);
    CHECK(!v && strncmp(err, "offset 4:", 9) == 0);
    /* a tiny error buffer is never overrun, and NULL is fine */
    char small[8];
    v = gp_json_parse("[1, x]", 6, small, sizeof small);
    CHECK(!v && strlen(small) < sizeof small);
    v = gp_json_parse("[1, x]", 6, NULL, 0);
    CHECK(!v);
    v = gp_json_parse(NULL, 0, err, sizeof err);
    CHECK(!v && strstr(err, "no input"));
    /* a length shorter than the text: only that much is read */
    v = gp_json_parse("[1][2]", 3, err, sizeof err);
    CHECK(v && gp_json_count(v) == 1);
    gp_json_free(v);
}

/* Every prefix of a valid document fails cleanly (no crash, no leak, no over-read). */
static void test_truncations(void)
{
    const char *doc = "{\"a\": [1, -2.5e3, \"x\\u00e9\\ud83d\\ude00\", true, false, null, "
                      "{\"b\": {}}], \"c\": \"\xc3\xa9\"}";
    size_t n = strlen(doc);
    for (size_t k = 0; k < n; k++) {
        char err[200];
        gp_json_value *v = parse_n(doc, k, err, sizeof err);
        if (v) {
            printf("FAIL: prefix of %zu bytes parsed\n", k);
            failures++;
            gp_json_free(v);
        }
    }
    gp_json_value *v = parse(doc);
    CHECK(v != NULL);
    gp_json_free(v);
}

int main(void)
{
    test_scalars();
    test_strings();
    test_containers();
    test_errors();
    test_truncations();
    if (failures) {
        printf("%d check(s) failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
