/*
 * image.h: recognising the device-code images that cuModuleLoadData / cuLibraryLoadData accept,
 * and reading a kernel's parameter layout out of a cubin when the server cannot tell it.
 *
 * The driver API passes images as bare pointers without a length, so the length has to be
 * derived from the image's own headers:
 *   fatbin wrapper  {i32 magic 0x466243b1, i32 version, ptr data, ptr filename_or_fatbins}; data
 *                   points at a fatbin (this is what cudart hands to cuLibraryLoadData)
 *   fatbin          {u32 magic 0xBA55ED50, u16 version, u16 header_size, u64 fat_size}, then
 *                   entries {u16 kind, u16, u32 header_size, u64 payload_size, ..., u64 flags at
 *                   +0x28, ...} each followed by its payload; total = header_size + fat_size
 *   ELF64 (cubin)   the furthest of the section header table, the program header table and every
 *                   section's contents (SHT_NOBITS excepted)
 *   PTX / text      NUL-terminated text; the terminator counts
 * Everything here is pure computation on memory: no locks, no logging, thread-safe.
 */
#ifndef GP_IMAGE_H
#define GP_IMAGE_H

#include <stddef.h>
#include <stdint.h>

enum gp_image_kind {
    GP_IMAGE_WRAPPER = 1, /* fatbin wrapper: the bytes that matter are the fatbin it points to */
    GP_IMAGE_FATBIN = 2,
    GP_IMAGE_ELF = 3,
    GP_IMAGE_TEXT = 4, /* PTX (or any other NUL-terminated text the server's driver may accept) */
};

#define GP_FATBIN_WRAPPER_MAGIC 0x466243b1u
#define GP_FATBIN_MAGIC 0xBA55ED50u
/* Images larger than this are refused as corrupt. */
#define GP_IMAGE_MAX_SIZE ((size_t)2 << 30)

/* Kind and size of the image at `image`. For a wrapper, *size is the size of the fatbin it
 * points to (the bytes that gp_image_data returns and that travel to the server). Returns 0, or
 * -1 when the bytes are not a recognisable image (bad magic, absurd sizes, binary garbage). */
int gp_image_size(const void *image, size_t *size, int *kind);

/* The same, but never reads at or beyond image + avail (for buffers of known length: files,
 * tests). A wrapper's target is not bounded by avail (it lives elsewhere). */
int gp_image_size_n(const void *image, size_t avail, size_t *size, int *kind);

/* The bytes to hash and send: the fatbin for a wrapper, else the image itself. Call only on an
 * image that gp_image_size accepted. */
const void *gp_image_data(const void *image, int kind);

/* Fallback parameter layout of `kernel` from the image (`size` bytes at `image`, as
 * gp_image_size reported; a wrapper is followed): the EIATTR_KPARAM_INFO records of the
 * `.nv.info.<kernel>` section of the first uncompressed ELF that has one (a fatbin's compressed
 * entries are skipped). Fills offsets[i] / sizes[i] for parameter i. Returns the parameter
 * count (0 for a kernel without parameters), or -1 when the kernel's records are not found,
 * are malformed, or there are more than `max` parameters. */
int gp_image_param_info(const void *image, size_t size, const char *kernel, uint32_t *offsets,
                        uint32_t *sizes, int max);

#endif /* GP_IMAGE_H */
