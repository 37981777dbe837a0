/* GGUF reader. The file is mapped read-only; keys, strings and tensor data are
 * pointers into the mapping. Only the tables (key/values, string arrays, tensor
 * infos) are allocated, and each allocation is bounded by the bytes left in the
 * file, so a hostile count cannot ask for more memory than the file could hold. */
#include "gguf/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/dtype.h"
#include "core/error.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_NESTING 8

struct gguf_file {
    const uint8_t *base; /* whole file */
    size_t size;
    bool mapped;         /* munmap on close */
    uint32_t version;
    uint64_t alignment;
    uint64_t n_kv;
    struct gguf_kv *kv;
    uint64_t n_tensors;
    struct gguf_tensor *tensors;
    const uint8_t *data; /* start of the tensor data section */
    uint64_t data_size;
    /* Every table allocated while parsing, freed on close. */
    void **allocs;
    size_t n_allocs, cap_allocs;
};

/* A cursor over the header bytes; every read checks the remaining length. */
struct reader {
    struct gguf_file *f;
    uint64_t pos;
};

static uint64_t remaining(const struct reader *r) { return r->f->size - r->pos; }

static bool take(struct reader *r, void *dst, uint64_t n, const char *what) {
    if (n > remaining(r)) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: file truncated while reading %s (offset %llu)", what,
                       (unsigned long long)r->pos);
        return false;
    }
    memcpy(dst, r->f->base + r->pos, n);
    r->pos += n;
    return true;
}

static void *track_alloc(struct gguf_file *f, uint64_t n, uint64_t size) {
    if (n == 0) n = 1;
    void *p = calloc((size_t)n, (size_t)size);
    if (!p) {
        kvq_error_code(KVQ_ERR_OOM, "gguf: out of memory");
        return NULL;
    }
    if (f->n_allocs == f->cap_allocs) {
        size_t cap = f->cap_allocs ? f->cap_allocs * 2 : 16;
        void **a = realloc(f->allocs, cap * sizeof *a);
        if (!a) {
            free(p);
            kvq_error_code(KVQ_ERR_OOM, "gguf: out of memory");
            return NULL;
        }
        f->allocs = a;
        f->cap_allocs = cap;
    }
    f->allocs[f->n_allocs++] = p;
    return p;
}

static bool read_str(struct reader *r, struct gguf_str *s, const char *what) {
    uint64_t len;
    if (!take(r, &len, 8, what)) return false;
    if (len > remaining(r)) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: %s has length %llu, past the end of the file", what,
                       (unsigned long long)len);
        return false;
    }
    s->ptr = (const char *)r->f->base + r->pos;
    s->len = len;
    r->pos += len;
    return true;
}

/* Size in bytes of a fixed-size scalar type; 0 for STRING/ARRAY/unknown. */
static uint64_t scalar_size(uint32_t t) {
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

static bool type_is_valid(uint32_t t) { return t <= GGUF_TYPE_FLOAT64; }

/* Decodes a scalar stored at p into v (which already has v->type set). */
static void decode_scalar(struct gguf_value *v, const uint8_t *p) {
    switch (v->type) {
    case GGUF_TYPE_UINT8: v->u64 = p[0]; break;
    case GGUF_TYPE_INT8: v->i64 = (int8_t)p[0]; break;
    case GGUF_TYPE_BOOL: v->b = p[0] != 0; break;
    case GGUF_TYPE_UINT16: { uint16_t x; memcpy(&x, p, 2); v->u64 = x; break; }
    case GGUF_TYPE_INT16: { int16_t x; memcpy(&x, p, 2); v->i64 = x; break; }
    case GGUF_TYPE_UINT32: { uint32_t x; memcpy(&x, p, 4); v->u64 = x; break; }
    case GGUF_TYPE_INT32: { int32_t x; memcpy(&x, p, 4); v->i64 = x; break; }
    case GGUF_TYPE_FLOAT32: { float x; memcpy(&x, p, 4); v->f64 = x; break; }
    case GGUF_TYPE_UINT64: memcpy(&v->u64, p, 8); break;
    case GGUF_TYPE_INT64: memcpy(&v->i64, p, 8); break;
    case GGUF_TYPE_FLOAT64: memcpy(&v->f64, p, 8); break;
    default: break;
    }
}

static bool read_value(struct reader *r, struct gguf_value *v, uint32_t type, int depth);

static bool read_array(struct reader *r, struct gguf_value *v, int depth) {
    uint32_t et;
    uint64_t n;
    if (depth >= GGUF_MAX_NESTING) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: arrays nested deeper than %d levels", GGUF_MAX_NESTING);
        return false;
    }
    if (!take(r, &et, 4, "array type") || !take(r, &n, 8, "array length")) return false;
    if (!type_is_valid(et)) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: array has invalid element type %u", et);
        return false;
    }
    v->arr.elem_type = (enum gguf_type)et;
    v->arr.n = n;
    uint64_t esize = scalar_size(et);
    if (esize) {
        if (n > remaining(r) / esize) {
            kvq_error_code(KVQ_ERR_FORMAT, "gguf: array of %llu elements runs past the end of the file",
                           (unsigned long long)n);
            return false;
        }
        v->arr.data = r->f->base + r->pos;
        r->pos += n * esize;
        return true;
    }
    /* Strings take at least 8 bytes each, nested arrays at least 12. */
    uint64_t min_size = et == GGUF_TYPE_STRING ? 8 : 12;
    if (n > remaining(r) / min_size) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: array of %llu elements runs past the end of the file",
                       (unsigned long long)n);
        return false;
    }
    if (et == GGUF_TYPE_STRING) {
        struct gguf_str *strs = track_alloc(r->f, n, sizeof *strs);
        if (!strs) return false;
        for (uint64_t i = 0; i < n; i++)
            if (!read_str(r, &strs[i], "array string")) return false;
        v->arr.strs = strs;
    } else {
        struct gguf_value *vals = track_alloc(r->f, n, sizeof *vals);
        if (!vals) return false;
        for (uint64_t i = 0; i < n; i++)
            if (!read_value(r, &vals[i], GGUF_TYPE_ARRAY, depth + 1)) return false;
        v->arr.vals = vals;
    }
    return true;
}

static bool read_value(struct reader *r, struct gguf_value *v, uint32_t type, int depth) {
    if (!type_is_valid(type)) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: invalid value type %u", type);
        return false;
    }
    v->type = (enum gguf_type)type;
    if (type == GGUF_TYPE_STRING) return read_str(r, &v->str, "string value");
    if (type == GGUF_TYPE_ARRAY) return read_array(r, v, depth);
    uint64_t size = scalar_size(type);
    if (size > remaining(r)) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: file truncated in a value");
        return false;
    }
    decode_scalar(v, r->f->base + r->pos);
    r->pos += size;
    return true;
}

static bool str_is_c(struct gguf_str s, const char *c) { return gguf_str_eq(s, c); }

static bool parse_tensor_info(struct reader *r, struct gguf_tensor *t) {
    if (!read_str(r, &t->name, "tensor name")) return false;
    if (!take(r, &t->n_dims, 4, "tensor dims")) return false;
    if (t->n_dims == 0 || t->n_dims > GGUF_MAX_DIMS) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: tensor '%.*s' has %u dimensions (1..%d allowed)",
                       (int)(t->name.len > 200 ? 200 : t->name.len), t->name.ptr, t->n_dims, GGUF_MAX_DIMS);
        return false;
    }
    for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++)
        if (!take(r, &t->ne[d], 8, "tensor shape")) return false;
    if (!take(r, &t->type, 4, "tensor type") || !take(r, &t->offset, 8, "tensor offset")) return false;
    return true;
}

/* Checks shape, type and placement of a tensor against the data section. */
static bool validate_tensor(const struct gguf_file *f, struct gguf_tensor *t) {
    int nl = (int)(t->name.len > 200 ? 200 : t->name.len);
    const struct kvq_dtype_info *info = kvq_dtype_info(t->type);
    if (!info) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: tensor '%.*s' has unknown type %u", nl, t->name.ptr, t->type);
        return false;
    }
    uint64_t n = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) {
        if (t->ne[d] == 0 || t->ne[d] > f->size || n > UINT64_MAX / t->ne[d]) {
            kvq_error_code(KVQ_ERR_FORMAT, "gguf: tensor '%.*s' has an invalid shape", nl, t->name.ptr);
            return false;
        }
        n *= t->ne[d];
    }
    if (t->ne[0] % info->block_size != 0) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: tensor '%.*s' row length %llu is not a multiple of the %s block size %u",
                       nl, t->name.ptr, (unsigned long long)t->ne[0], info->name, info->block_size);
        return false;
    }
    uint64_t blocks = n / info->block_size;
    if (blocks > UINT64_MAX / info->block_bytes) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: tensor '%.*s' is too large", nl, t->name.ptr);
        return false;
    }
    t->nbytes = blocks * info->block_bytes;
    if (t->offset % f->alignment != 0) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: tensor '%.*s' offset %llu is not aligned to %llu", nl, t->name.ptr,
                       (unsigned long long)t->offset, (unsigned long long)f->alignment);
        return false;
    }
    if (t->offset > f->data_size || t->nbytes > f->data_size - t->offset) {
        kvq_error_code(KVQ_ERR_FORMAT,
                       "gguf: tensor '%.*s' data (%llu bytes at offset %llu) lies past the end of the file", nl,
                       t->name.ptr, (unsigned long long)t->nbytes, (unsigned long long)t->offset);
        return false;
    }
    t->data = f->data + t->offset;
    return true;
}

static int cmp_offset(const void *a, const void *b) {
    const struct gguf_tensor *x = *(const struct gguf_tensor *const *)a, *y = *(const struct gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* As llama.cpp: the tensors tile the data section, each at the aligned end of the
 * one before. A changed type byte or shape changes a tensor's size, so it would
 * overlap its neighbour or leave a gap: the file is refused instead of reading
 * one tensor's bytes as another's. */
static bool check_layout(struct gguf_file *f) {
    if (f->n_tensors == 0) return true;
    const struct gguf_tensor **by_off = track_alloc(f, f->n_tensors, sizeof *by_off);
    if (!by_off) return false;
    for (uint64_t i = 0; i < f->n_tensors; i++) by_off[i] = &f->tensors[i];
    qsort(by_off, (size_t)f->n_tensors, sizeof *by_off, cmp_offset);
    uint64_t expect = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const struct gguf_tensor *t = by_off[i];
        if (t->offset != expect) {
            kvq_error_code(
                KVQ_ERR_FORMAT,
                "gguf: tensor '%.*s' starts at offset %llu, expected %llu (%s the tensor before it: its type or "
                "shape does not match the data)",
                (int)(t->name.len > 200 ? 200 : t->name.len), t->name.ptr, (unsigned long long)t->offset,
                (unsigned long long)expect, t->offset < expect ? "overlaps" : "leaves a gap after");
            return false;
        }
        expect = (t->offset + t->nbytes + f->alignment - 1) / f->alignment * f->alignment;
    }
    return true;
}

static bool parse(struct gguf_file *f) {
    struct reader r = {f, 0};
    char magic[4];
    if (!take(&r, magic, 4, "magic") || memcmp(magic, GGUF_MAGIC, 4) != 0) {
        kvq_error_code(KVQ_ERR_FORMAT, "not a GGUF file (bad magic)");
        return false;
    }
    if (!take(&r, &f->version, 4, "version")) return false;
    if (f->version != 2 && f->version != 3) {
        kvq_error_code(KVQ_ERR_UNSUPPORTED, "gguf: unsupported version %u (2 and 3 are supported)", f->version);
        return false;
    }
    if (!take(&r, &f->n_tensors, 8, "tensor count") || !take(&r, &f->n_kv, 8, "key count")) return false;
    /* A key/value takes at least 13 bytes, a tensor info at least 32. */
    if (f->n_kv > remaining(&r) / 13 || f->n_tensors > remaining(&r) / 32) {
        kvq_error_code(KVQ_ERR_FORMAT, "gguf: header claims %llu keys and %llu tensors, more than the file can hold",
                       (unsigned long long)f->n_kv, (unsigned long long)f->n_tensors);
        return false;
    }
    f->kv = track_alloc(f, f->n_kv, sizeof *f->kv);
    if (!f->kv) return false;
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < f->n_kv; i++) {
        struct gguf_kv *kv = &f->kv[i];
        uint32_t type;
        if (!read_str(&r, &kv->key, "key") || !take(&r, &type, 4, "value type")) return false;
        if (!read_value(&r, &kv->value, type, 0)) return false;
        for (uint64_t j = 0; j < i; j++) {
            if (f->kv[j].key.len == kv->key.len && memcmp(f->kv[j].key.ptr, kv->key.ptr, kv->key.len) == 0) {
                kvq_error_code(KVQ_ERR_FORMAT, "gguf: duplicate key '%.*s'",
                               (int)(kv->key.len > 200 ? 200 : kv->key.len), kv->key.ptr);
                return false;
            }
        }
        if (str_is_c(kv->key, "general.alignment")) {
            if (kv->value.type != GGUF_TYPE_UINT32 || kv->value.u64 == 0 ||
                (kv->value.u64 & (kv->value.u64 - 1)) != 0) {
                kvq_error_code(KVQ_ERR_FORMAT, "gguf: general.alignment must be a power of two (uint32)");
                return false;
            }
            f->alignment = kv->value.u64;
        }
    }
    f->tensors = track_alloc(f, f->n_tensors, sizeof *f->tensors);
    if (!f->tensors) return false;
    for (uint64_t i = 0; i < f->n_tensors; i++)
        if (!parse_tensor_info(&r, &f->tensors[i])) return false;
    uint64_t data_start = (r.pos + f->alignment - 1) / f->alignment * f->alignment;
    if (data_start > f->size) data_start = f->size; /* ok only if there is no tensor data */
    f->data = f->base + data_start;
    f->data_size = f->size - data_start;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        if (!validate_tensor(f, &f->tensors[i])) return false;
        for (uint64_t j = 0; j < i; j++) {
            if (f->tensors[j].name.len == f->tensors[i].name.len &&
                memcmp(f->tensors[j].name.ptr, f->tensors[i].name.ptr, f->tensors[i].name.len) == 0) {
                kvq_error_code(KVQ_ERR_FORMAT, "gguf: duplicate tensor '%.*s'",
                               (int)(f->tensors[i].name.len > 200 ? 200 : f->tensors[i].name.len),
                               f->tensors[i].name.ptr);
                return false;
            }
        }
    }
    return check_layout(f);
}

struct gguf_file *gguf_open_memory(const void *data, size_t size) {
    struct gguf_file *f = calloc(1, sizeof *f);
    if (!f) {
        kvq_error_code(KVQ_ERR_OOM, "gguf: out of memory");
        return NULL;
    }
    f->base = data;
    f->size = size;
    if (!parse(f)) {
        gguf_close(f);
        return NULL;
    }
    return f;
}

struct gguf_file *gguf_open(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        kvq_error_code(KVQ_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        kvq_error_code(KVQ_ERR_IO, "'%s' is not a regular file", path);
        return NULL;
    }
    if (st.st_size < 24) {
        close(fd);
        kvq_error_code(KVQ_ERR_FORMAT, "'%s' is not a GGUF file (only %lld bytes)", path, (long long)st.st_size);
        return NULL;
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        kvq_error_code(KVQ_ERR_IO, "cannot map '%s': %s", path, strerror(errno));
        return NULL;
    }
    struct gguf_file *f = gguf_open_memory(map, (size_t)st.st_size);
    if (!f) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kvq_last_error());
        munmap(map, (size_t)st.st_size);
        kvq_error_wrap("%s: %s", path, msg);
        return NULL;
    }
    f->mapped = true;
    return f;
}

void gguf_release_pages(const struct gguf_file *f, const void *p, size_t n) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p, b = a + n;
    const uintptr_t lo = (a + page - 1) / page * page, hi = b / page * page;
    if (!f->mapped || a < (uintptr_t)f->base || b > (uintptr_t)f->base + f->size || hi <= lo) return;
    madvise((void *)lo, hi - lo, MADV_DONTNEED); /* advice: failing changes nothing */
}

void gguf_close(struct gguf_file *f) {
    if (!f) return;
    for (size_t i = 0; i < f->n_allocs; i++) free(f->allocs[i]);
    free(f->allocs);
    if (f->mapped) munmap((void *)f->base, f->size);
    free(f);
}

uint32_t gguf_version(const struct gguf_file *f) { return f->version; }
uint64_t gguf_alignment(const struct gguf_file *f) { return f->alignment; }
uint64_t gguf_n_kv(const struct gguf_file *f) { return f->n_kv; }
const struct gguf_kv *gguf_kv_at(const struct gguf_file *f, uint64_t i) { return i < f->n_kv ? &f->kv[i] : NULL; }
uint64_t gguf_n_tensors(const struct gguf_file *f) { return f->n_tensors; }
const struct gguf_tensor *gguf_tensor_at(const struct gguf_file *f, uint64_t i) {
    return i < f->n_tensors ? &f->tensors[i] : NULL;
}

bool gguf_str_eq(struct gguf_str a, const char *s) {
    size_t n = strlen(s);
    return a.len == n && memcmp(a.ptr, s, n) == 0;
}

const struct gguf_value *gguf_find(const struct gguf_file *f, const char *key) {
    for (uint64_t i = 0; i < f->n_kv; i++)
        if (gguf_str_eq(f->kv[i].key, key)) return &f->kv[i].value;
    return NULL;
}

const struct gguf_tensor *gguf_find_tensor(const struct gguf_file *f, const char *name) {
    for (uint64_t i = 0; i < f->n_tensors; i++)
        if (gguf_str_eq(f->tensors[i].name, name)) return &f->tensors[i];
    return NULL;
}

static bool type_is_unsigned(enum gguf_type t) {
    return t == GGUF_TYPE_UINT8 || t == GGUF_TYPE_UINT16 || t == GGUF_TYPE_UINT32 || t == GGUF_TYPE_UINT64;
}
static bool type_is_signed(enum gguf_type t) {
    return t == GGUF_TYPE_INT8 || t == GGUF_TYPE_INT16 || t == GGUF_TYPE_INT32 || t == GGUF_TYPE_INT64;
}

bool gguf_get_u64(const struct gguf_file *f, const char *key, uint64_t *out) {
    const struct gguf_value *v = gguf_find(f, key);
    if (!v) return false;
    if (type_is_unsigned(v->type)) { *out = v->u64; return true; }
    if (type_is_signed(v->type) && v->i64 >= 0) { *out = (uint64_t)v->i64; return true; }
    return false;
}

bool gguf_get_u32(const struct gguf_file *f, const char *key, uint32_t *out) {
    uint64_t x;
    if (!gguf_get_u64(f, key, &x) || x > UINT32_MAX) return false;
    *out = (uint32_t)x;
    return true;
}

bool gguf_get_i64(const struct gguf_file *f, const char *key, int64_t *out) {
    const struct gguf_value *v = gguf_find(f, key);
    if (!v) return false;
    if (type_is_signed(v->type)) { *out = v->i64; return true; }
    if (type_is_unsigned(v->type) && v->u64 <= INT64_MAX) { *out = (int64_t)v->u64; return true; }
    return false;
}

bool gguf_get_f32(const struct gguf_file *f, const char *key, float *out) {
    const struct gguf_value *v = gguf_find(f, key);
    if (!v) return false;
    if (v->type == GGUF_TYPE_FLOAT32 || v->type == GGUF_TYPE_FLOAT64) { *out = (float)v->f64; return true; }
    if (type_is_unsigned(v->type)) { *out = (float)v->u64; return true; }
    if (type_is_signed(v->type)) { *out = (float)v->i64; return true; }
    return false;
}

bool gguf_get_bool(const struct gguf_file *f, const char *key, bool *out) {
    const struct gguf_value *v = gguf_find(f, key);
    if (!v || v->type != GGUF_TYPE_BOOL) return false;
    *out = v->b;
    return true;
}

bool gguf_get_str(const struct gguf_file *f, const char *key, char *buf, size_t buf_size) {
    const struct gguf_value *v = gguf_find(f, key);
    if (!v || v->type != GGUF_TYPE_STRING || v->str.len >= buf_size) return false;
    memcpy(buf, v->str.ptr, v->str.len);
    buf[v->str.len] = '\0';
    return true;
}

const struct gguf_value *gguf_get_arr(const struct gguf_file *f, const char *key, enum gguf_type elem_type) {
    const struct gguf_value *v = gguf_find(f, key);
    if (!v || v->type != GGUF_TYPE_ARRAY || v->arr.elem_type != elem_type) return NULL;
    return v;
}

static struct gguf_value arr_elem(const struct gguf_value *arr, uint64_t i) {
    struct gguf_value v = {.type = arr->arr.elem_type};
    decode_scalar(&v, (const uint8_t *)arr->arr.data + i * scalar_size(arr->arr.elem_type));
    return v;
}

double gguf_arr_f64(const struct gguf_value *arr, uint64_t i) {
    struct gguf_value v = arr_elem(arr, i);
    if (v.type == GGUF_TYPE_FLOAT32 || v.type == GGUF_TYPE_FLOAT64) return v.f64;
    if (type_is_unsigned(v.type)) return (double)v.u64;
    if (type_is_signed(v.type)) return (double)v.i64;
    return v.b ? 1.0 : 0.0;
}

int64_t gguf_arr_i64(const struct gguf_value *arr, uint64_t i) {
    struct gguf_value v = arr_elem(arr, i);
    if (v.type == GGUF_TYPE_FLOAT32 || v.type == GGUF_TYPE_FLOAT64) return (int64_t)v.f64;
    if (type_is_unsigned(v.type)) return (int64_t)v.u64;
    if (type_is_signed(v.type)) return v.i64;
    return v.b;
}

const char *gguf_type_name(enum gguf_type t) {
    static const char *names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                  "bool", "string", "array", "uint64", "int64", "float64"};
    return (unsigned)t <= GGUF_TYPE_FLOAT64 ? names[t] : "invalid";
}
