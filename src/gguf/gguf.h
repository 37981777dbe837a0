/* GGUF v2/v3 reader (mmap) and writer. Knows the file format only: keys,
 * values and tensor descriptions; nothing about models.
 *
 * Every count, length and offset read from a file is checked against the file
 * size before use, so a truncated or hostile file fails with one clear error
 * (see core/error.h) and never crashes or triggers a huge allocation. */
#ifndef KVQ_GGUF_H
#define KVQ_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum gguf_type {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
};

/* A string inside the mapped file: NOT NUL-terminated. */
struct gguf_str {
    const char *ptr;
    uint64_t len;
};

struct gguf_value {
    enum gguf_type type;
    union {
        uint64_t u64; /* UINT8..UINT64 (zero-extended) */
        int64_t i64;  /* INT8..INT64 (sign-extended) */
        double f64;   /* FLOAT32, FLOAT64 */
        bool b;       /* BOOL */
        struct gguf_str str;
        struct {
            enum gguf_type elem_type;
            uint64_t n;
            /* numeric/bool elements: packed little-endian in the file, element size by type */
            const void *data;
            /* STRING elements */
            const struct gguf_str *strs;
            /* ARRAY elements (nested arrays) */
            const struct gguf_value *vals;
        } arr;
    };
};

struct gguf_kv {
    struct gguf_str key;
    struct gguf_value value;
};

#define GGUF_MAX_DIMS 4

struct gguf_tensor {
    struct gguf_str name;
    uint32_t n_dims;
    uint64_t ne[GGUF_MAX_DIMS]; /* ne[0] is the row length (contiguous); unused dims are 1 */
    uint32_t type;              /* enum kvq_dtype */
    uint64_t offset;            /* relative to the data section */
    uint64_t nbytes;
    const void *data;           /* inside the mapping */
};

struct gguf_file; /* opaque */

/* Opens and validates a file. NULL on error (kvq_last_error() says why). */
struct gguf_file *gguf_open(const char *path);
/* Same, over a caller-owned buffer (used by the fuzzer); the buffer must outlive the result. */
struct gguf_file *gguf_open_memory(const void *data, size_t size);
void gguf_close(struct gguf_file *f);
/* The caller will not read these bytes of the file for a while: a mapped file's
 * whole pages among them leave the process's memory (read again from the file if
 * touched). Nothing for a caller-owned buffer. */
void gguf_release_pages(const struct gguf_file *f, const void *p, size_t n);

uint32_t gguf_version(const struct gguf_file *f);
uint64_t gguf_alignment(const struct gguf_file *f);
uint64_t gguf_n_kv(const struct gguf_file *f);
const struct gguf_kv *gguf_kv_at(const struct gguf_file *f, uint64_t i);
const struct gguf_value *gguf_find(const struct gguf_file *f, const char *key);

/* Typed getters. Return false when the key is missing or has an incompatible type.
 * Integer getters accept any integer type whose value fits; float getters accept
 * FLOAT32/FLOAT64 and integers. */
bool gguf_get_u32(const struct gguf_file *f, const char *key, uint32_t *out);
bool gguf_get_u64(const struct gguf_file *f, const char *key, uint64_t *out);
bool gguf_get_i64(const struct gguf_file *f, const char *key, int64_t *out);
bool gguf_get_f32(const struct gguf_file *f, const char *key, float *out);
bool gguf_get_bool(const struct gguf_file *f, const char *key, bool *out);
/* String as a NUL-terminated copy in a caller buffer; false if missing/not a string/too long. */
bool gguf_get_str(const struct gguf_file *f, const char *key, char *buf, size_t buf_size);
/* Array of the given element type (false if missing or different type). */
const struct gguf_value *gguf_get_arr(const struct gguf_file *f, const char *key, enum gguf_type elem_type);
/* Element i of a numeric array as double / int64 (no bounds check beyond assert). */
double gguf_arr_f64(const struct gguf_value *arr, uint64_t i);
int64_t gguf_arr_i64(const struct gguf_value *arr, uint64_t i);

uint64_t gguf_n_tensors(const struct gguf_file *f);
const struct gguf_tensor *gguf_tensor_at(const struct gguf_file *f, uint64_t i);
const struct gguf_tensor *gguf_find_tensor(const struct gguf_file *f, const char *name);

const char *gguf_type_name(enum gguf_type t);
/* True when the string equals the NUL-terminated s. */
bool gguf_str_eq(struct gguf_str a, const char *s);

/* --- Writer: builds a GGUF v3 file (used by gen-model and tests). ---------- */
struct gguf_writer;
struct gguf_writer *gguf_writer_new(void);
void gguf_writer_free(struct gguf_writer *w);
void gguf_writer_set_alignment(struct gguf_writer *w, uint32_t alignment);
void gguf_writer_add_u32(struct gguf_writer *w, const char *key, uint32_t v);
void gguf_writer_add_i32(struct gguf_writer *w, const char *key, int32_t v);
void gguf_writer_add_u64(struct gguf_writer *w, const char *key, uint64_t v);
void gguf_writer_add_f32(struct gguf_writer *w, const char *key, float v);
void gguf_writer_add_bool(struct gguf_writer *w, const char *key, bool v);
void gguf_writer_add_str(struct gguf_writer *w, const char *key, const char *v);
/* Numeric array: elements packed as elem_type in host (little-endian) order. */
void gguf_writer_add_arr(struct gguf_writer *w, const char *key, enum gguf_type elem_type,
                         const void *data, uint64_t n);
void gguf_writer_add_str_arr(struct gguf_writer *w, const char *key, const char *const *strs, uint64_t n);
/* Declares a tensor; its bytes are produced later by the fill callback, in
 * declaration order, so multi-GB files never sit in memory. A tensor declared with
 * data (non-NULL) has its bytes copied from there at write time instead. */
typedef int (*gguf_fill_fn)(void *user, uint64_t tensor_index, void *dst, uint64_t nbytes);
void gguf_writer_add_tensor(struct gguf_writer *w, const char *name, uint32_t n_dims,
                            const uint64_t *ne, uint32_t type, const void *data);
/* Writes the file; returns 0 or -1 with kvq_last_error(). */
int gguf_writer_write(struct gguf_writer *w, const char *path, gguf_fill_fn fill, void *user);

#endif
