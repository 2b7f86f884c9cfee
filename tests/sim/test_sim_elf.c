/*
 * test_sim_elf.c: the image parsers (sim_elf.c, sim_image.c) on real nvcc output and on garbage.
 *
 * - The parameter layout nvcc records for each gp_test_* kernel must be the one in the sim's
 *   kernel table (the table is what launches use to unpack arguments).
 * - Mutated and truncated cubins and fatbins, and random bytes, must be rejected or parsed, never
 *   crash or read out of bounds (this binary is also built with ASan + UBSan by `make SAN=1`).
 *
 * It links the sim's objects directly to call these internal functions.
 */
#include "sim_internal.h"
#include "sim_test.h"

static const char *const table_kernels[] = {"gp_test_noop",    "gp_test_axpy",
                                            "gp_test_scalars", "gp_test_big_struct",
                                            "gp_test_index",   "gp_test_spin"};

static const struct sim_elf_kernel *kernel(const struct sim_elf_info *info, const char *name)
{
    for (size_t i = 0; i < info->nkernels; i++)
        if (strcmp(info->kernels[i].name, name) == 0)
            return &info->kernels[i];
    fprintf(stderr, "kernel %s not found in the image\n", name);
    exit(1);
}

static const struct sim_elf_global *global(const struct sim_elf_info *info, const char *name)
{
    for (size_t i = 0; i < info->nglobals; i++)
        if (strcmp(info->globals[i].name, name) == 0)
            return &info->globals[i];
    fprintf(stderr, "global %s not found in the image\n", name);
    exit(1);
}

static void test_table_matches_cubin(void)
{
    size_t len = 0;
    unsigned char *cubin = sim_test_input("GP_SIM_TEST_CUBIN", &len);
    struct sim_elf_info info;
    OK(sim_elf_parse(cubin, len, &info));
    CHECK_EQ(info.sm, 90);
    CHECK_EQ(info.nkernels, 7); /* six gp_test_* kernels and gp_other_kernel */
    for (size_t i = 0; i < sizeof(table_kernels) / sizeof(table_kernels[0]); i++) {
        const struct sim_kernel_def *def = sim_kernel_find(table_kernels[i]);
        const struct sim_elf_kernel *k = kernel(&info, table_kernels[i]);
        CHECK(def != NULL);
        if (k->nparams != def->nparams) {
            fprintf(stderr, "%s: nvcc says %d parameters, the table %d\n", def->name, k->nparams,
                    def->nparams);
            exit(1);
        }
        for (int p = 0; p < def->nparams; p++) {
            if (k->params[p].offset != def->params[p].offset ||
                k->params[p].size != def->params[p].size) {
                fprintf(stderr, "%s parameter %d: nvcc (offset %u, size %u), table (%u, %u)\n",
                        def->name, p, k->params[p].offset, k->params[p].size, def->params[p].offset,
                        def->params[p].size);
                exit(1);
            }
        }
        CHECK(k->regs > 0);
    }
    /* Spelled out for the two kernels whose layout matters most. */
    const struct sim_elf_kernel *big = kernel(&info, "gp_test_big_struct");
    CHECK_EQ(big->params[0].size, 400);
    CHECK_EQ(big->params[1].offset, 400);
    const struct sim_elf_kernel *sc = kernel(&info, "gp_test_scalars");
    static const uint32_t sizes[7] = {8, 1, 2, 4, 8, 4, 8}, offs[7] = {0, 8, 10, 12, 16, 24, 32};
    for (int p = 0; p < 7; p++) {
        CHECK_EQ(sc->params[p].size, sizes[p]);
        CHECK_EQ(sc->params[p].offset, offs[p]);
    }
    const struct sim_elf_kernel *other = kernel(&info, "gp_other_kernel");
    CHECK_EQ(other->nparams, 4);
    CHECK_EQ(other->params[2].offset, 16);
    CHECK_EQ(other->params[2].size, 400);
    CHECK_EQ(other->params[3].offset, 416);
    /* Globals, with their initial data where the image has it. */
    CHECK_EQ(global(&info, "gp_table")->size, 64);
    float t1 = 0;
    CHECK(global(&info, "gp_table")->init != NULL);
    memcpy(&t1, global(&info, "gp_table")->init + 4, 4);
    CHECK(t1 == 2.0f);
    CHECK_EQ(global(&info, "gp_counter")->size, 4);
    CHECK_EQ(global(&info, "gp_consts")->size, 16);
    int c3 = 0;
    memcpy(&c3, global(&info, "gp_consts")->init + 12, 4);
    CHECK_EQ(c3, 8);
    sim_elf_free(&info);
    free(cubin);
}

static void test_fatbin_selection(void)
{
    size_t len = 0;
    unsigned char *fb = sim_test_input("GP_SIM_TEST_FATBIN", &len);
    struct sim_image img;
    OK(sim_fatbin_parse(fb, len, 90, &img)); /* the sm_90 cubin inside */
    CHECK(!img.any_name);
    CHECK_EQ(img.elf.nkernels, 7);
    sim_image_free(&img);
    OK(sim_fatbin_parse(fb, len, 100, &img)); /* only the PTX fits a 10.0 device */
    CHECK(img.any_name);
    sim_image_free(&img);
    CHECK_RC(sim_fatbin_parse(fb, len, 86, &img), CUDA_ERROR_NO_BINARY_FOR_GPU);
    CHECK_RC(sim_fatbin_parse(fb, len - 1, 90, &img), CUDA_ERROR_INVALID_IMAGE); /* truncated */
    free(fb);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Flips random bytes, biased towards the headers (where the offsets and counts are) and runs
 * the parser on an exactly-sized copy, so that ASan sees any read past the end. */
static void fuzz(const unsigned char *orig, size_t len, int rounds,
                 CUresult (*parse)(const unsigned char *, size_t))
{
    int accepted = 0;
    for (int r = 0; r < rounds; r++) {
        size_t n = len;
        if (r % 5 == 0)
            n = (size_t)(rng() % len); /* truncated */
        unsigned char *b = malloc(n ? n : 1);
        CHECK(b != NULL);
        memcpy(b, orig, n);
        int flips = 1 + (int)(rng() % 8);
        for (int i = 0; i < flips && n > 0; i++) {
            size_t pos = rng() % 3 == 0 ? (size_t)(rng() % (n < 256 ? n : 256)) : rng() % n;
            b[pos] = (unsigned char)rng();
        }
        CUresult rc = parse(b, n);
        CHECK(rc == CUDA_SUCCESS || rc == CUDA_ERROR_INVALID_IMAGE ||
              rc == CUDA_ERROR_NO_BINARY_FOR_GPU || rc == CUDA_ERROR_OUT_OF_MEMORY);
        accepted += rc == CUDA_SUCCESS;
        free(b);
    }
    printf("fuzz: %d of %d mutated images still parsed\n", accepted, rounds);
}

static CUresult parse_elf(const unsigned char *b, size_t n)
{
    struct sim_elf_info info;
    CUresult rc = sim_elf_parse(b, n, &info);
    if (rc == CUDA_SUCCESS)
        sim_elf_free(&info);
    return rc;
}

static CUresult parse_fatbin(const unsigned char *b, size_t n)
{
    struct sim_image img;
    CUresult rc = sim_fatbin_parse(b, n, 90, &img);
    if (rc == CUDA_SUCCESS)
        sim_image_free(&img);
    return rc;
}

static void test_fuzz_cubin(void)
{
    size_t len = 0;
    unsigned char *cubin = sim_test_input("GP_SIM_TEST_CUBIN", &len);
    fuzz(cubin, len, 4000, parse_elf);
    free(cubin);
}

static void test_fuzz_fatbin(void)
{
    size_t len = 0;
    unsigned char *fb = sim_test_input("GP_SIM_TEST_FATBIN", &len);
    fuzz(fb, len, 3000, parse_fatbin);
    free(fb);
}

static void test_random_bytes(void)
{
    for (int r = 0; r < 2000; r++) {
        size_t n = (size_t)(rng() % 4096);
        unsigned char *b = malloc(n ? n : 1);
        CHECK(b != NULL);
        for (size_t i = 0; i < n; i++)
            b[i] = (unsigned char)rng();
        if (r % 2 == 0 && n >= 64) /* a plausible ELF identification, garbage after it */
            memcpy(b, "\177ELF\2\1\1\101\10\0\0\0\0\0\0\0\2\0\276\0", 20);
        CHECK_RC(parse_elf(b, n), CUDA_ERROR_INVALID_IMAGE);
        if (n >= 4) {
            uint32_t magic = 0xBA55ED50u;
            memcpy(b, &magic, 4);
        }
        CUresult rc = parse_fatbin(b, n);
        CHECK(rc == CUDA_ERROR_INVALID_IMAGE || rc == CUDA_ERROR_NO_BINARY_FOR_GPU);
        free(b);
    }
}

SIM_TEST_MAIN(SIM_T(table_matches_cubin), SIM_T(fatbin_selection), SIM_T(fuzz_cubin),
              SIM_T(fuzz_fatbin), SIM_T(random_bytes))
