/* GGUF v3 writer. Keys and tensor descriptions are kept in memory (small); tensor
 * data is produced by the caller's fill callback one tensor at a time, straight
 * into a reused buffer and out to the file, so a multi-GB model never sits in
 * memory (only its largest tensor does).
 *
 * Layout: "GGUF", version 3, tensor count, key count, the keys (string key, u32 type,
 * value), the tensor infos (name, n_dims, ne[], type, offset), padding to the
 * alignment, then each tensor's bytes at its offset (every offset a multiple of the
 * alignment, zero padding between). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/outfile.h"
#include "gguf/gguf.h"

struct wkv {
    char *key;
    uint8_t *val; /* serialized: u32 type, then the value */
    size_t val_len;
};

struct wtensor {
    char *name;
    uint32_t n_dims, type;
    uint64_t ne[GGUF_MAX_DIMS];
    uint64_t nbytes, offset;
    const void *data;
};

struct gguf_writer {
    struct wkv *kv;
    size_t n_kv, cap_kv;
    struct wtensor *t;
    size_t n_t, cap_t;
    uint32_t alignment;
    bool oom; /* an allocation failed: gguf_writer_write reports it */
    char *bad; /* first invalid tensor, reported by gguf_writer_write */
};

/* A growable byte buffer for one serialized value. */
struct buf {
    uint8_t *p;
    size_t n, cap;
    bool oom;
};

static void put(struct buf *b, const void *src, size_t n) {
    if (b->oom || n == 0) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n) cap *= 2;
        uint8_t *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void put_u32(struct buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(struct buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(struct buf *b, const char *s, size_t n) {
    put_u64(b, n);
    put(b, s, n);
}

struct gguf_writer *gguf_writer_new(void) {
    struct gguf_writer *w = calloc(1, sizeof *w);
    if (!w) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    w->alignment = 32;
    return w;
}

void gguf_writer_free(struct gguf_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].val);
    }
    for (size_t i = 0; i < w->n_t; i++) free(w->t[i].name);
    free(w->kv);
    free(w->t);
    free(w->bad);
    free(w);
}

/* Stores a serialized value under key, replacing an earlier value of that key. */
static void add_kv(struct gguf_writer *w, const char *key, struct buf *b) {
    if (b->oom) {
        free(b->p);
        w->oom = true;
        return;
    }
    for (size_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->kv[i].key, key) == 0) {
            free(w->kv[i].val);
            w->kv[i].val = b->p;
            w->kv[i].val_len = b->n;
            return;
        }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? w->cap_kv * 2 : 32;
        struct wkv *q = realloc(w->kv, cap * sizeof *q);
        if (!q) {
            free(b->p);
            w->oom = true;
            return;
        }
        w->kv = q;
        w->cap_kv = cap;
    }
    char *k = strdup(key);
    if (!k) {
        free(b->p);
        w->oom = true;
        return;
    }
    w->kv[w->n_kv++] = (struct wkv){k, b->p, b->n};
}

void gguf_writer_set_alignment(struct gguf_writer *w, uint32_t alignment) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
        if (!w->bad) w->bad = strdup("alignment must be a power of two");
        return;
    }
    w->alignment = alignment;
    gguf_writer_add_u32(w, "general.alignment", alignment);
}

#define SCALAR_ADDER(fn, ctype, gtype)                                   \
    void fn(struct gguf_writer *w, const char *key, ctype v) {         \
        struct buf b = {0};                                              \
        put_u32(&b, gtype);                                              \
        put(&b, &v, sizeof v);                                           \
        add_kv(w, key, &b);                                              \
    }
SCALAR_ADDER(gguf_writer_add_u32, uint32_t, GGUF_TYPE_UINT32)
SCALAR_ADDER(gguf_writer_add_i32, int32_t, GGUF_TYPE_INT32)
SCALAR_ADDER(gguf_writer_add_u64, uint64_t, GGUF_TYPE_UINT64)
SCALAR_ADDER(gguf_writer_add_f32, float, GGUF_TYPE_FLOAT32)

void gguf_writer_add_bool(struct gguf_writer *w, const char *key, bool v) {
    struct buf b = {0};
    uint8_t x = v ? 1 : 0;
    put_u32(&b, GGUF_TYPE_BOOL);
    put(&b, &x, 1);
    add_kv(w, key, &b);
}

void gguf_writer_add_str(struct gguf_writer *w, const char *key, const char *v) {
    struct buf b = {0};
    put_u32(&b, GGUF_TYPE_STRING);
    put_str(&b, v, strlen(v));
    add_kv(w, key, &b);
}

static size_t scalar_size(enum gguf_type t) {
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

void gguf_writer_add_arr(struct gguf_writer *w, const char *key, enum gguf_type elem_type, const void *data,
                         uint64_t n) {
    size_t es = scalar_size(elem_type);
    if (es == 0) {
        if (!w->bad) w->bad = strdup("gguf_writer_add_arr takes numeric or bool elements only");
        return;
    }
    struct buf b = {0};
    put_u32(&b, GGUF_TYPE_ARRAY);
    put_u32(&b, elem_type);
    put_u64(&b, n);
    put(&b, data, (size_t)(n * es));
    add_kv(w, key, &b);
}

void gguf_writer_add_str_arr(struct gguf_writer *w, const char *key, const char *const *strs, uint64_t n) {
    struct buf b = {0};
    put_u32(&b, GGUF_TYPE_ARRAY);
    put_u32(&b, GGUF_TYPE_STRING);
    put_u64(&b, n);
    for (uint64_t i = 0; i < n; i++) put_str(&b, strs[i], strlen(strs[i]));
    add_kv(w, key, &b);
}

void gguf_writer_add_tensor(struct gguf_writer *w, const char *name, uint32_t n_dims, const uint64_t *ne,
                            uint32_t type, const void *data) {
    char why[256] = "";
    uint64_t n = 1;
    if (n_dims == 0 || n_dims > GGUF_MAX_DIMS) snprintf(why, sizeof why, "tensor %s: %u dimensions", name, n_dims);
    else if (!kvq_dtype_info(type)) snprintf(why, sizeof why, "tensor %s: unknown type %u", name, type);
    for (uint32_t i = 0; i < n_dims && !why[0]; i++) {
        if (ne[i] == 0) snprintf(why, sizeof why, "tensor %s: dimension %u is 0", name, i);
        else n *= ne[i];
    }
    size_t row = why[0] ? 0 : kvq_dtype_row_bytes(type, ne[0]);
    if (!why[0] && row == 0)
        snprintf(why, sizeof why, "tensor %s: row of %llu values is not a multiple of %s's block of %u", name,
                 (unsigned long long)ne[0], kvq_dtype_name(type), kvq_dtype_info(type)->block_size);
    if (why[0]) {
        if (!w->bad) w->bad = strdup(why);
        return;
    }
    if (w->n_t == w->cap_t) {
        size_t cap = w->cap_t ? w->cap_t * 2 : 64;
        struct wtensor *q = realloc(w->t, cap * sizeof *q);
        if (!q) {
            w->oom = true;
            return;
        }
        w->t = q;
        w->cap_t = cap;
    }
    struct wtensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (!t->name) {
        w->oom = true;
        return;
    }
    t->n_dims = n_dims;
    t->type = type;
    for (uint32_t i = 0; i < GGUF_MAX_DIMS; i++) t->ne[i] = i < n_dims ? ne[i] : 1;
    t->nbytes = row * (n / ne[0]);
    t->data = data;
    w->n_t++;
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static int write_all(FILE *f, const void *p, size_t n, const char *path) {
    if (n && fwrite(p, 1, n, f) != n) return kvq_error("gguf: cannot write '%s': %s", path, strerror(errno));
    return 0;
}

int gguf_writer_write(struct gguf_writer *w, const char *path, gguf_fill_fn fill, void *user) {
    if (w->oom) return kvq_error_code(KVQ_ERR_OOM, "gguf: out of memory while building the file");
    if (w->bad) return kvq_error("gguf: %s", w->bad);
    for (size_t i = 0; i < w->n_t; i++) {
        if (!fill && !w->t[i].data) return kvq_error("gguf: tensor %s has no data and no fill callback", w->t[i].name);
        for (size_t j = 0; j < i; j++)
            if (strcmp(w->t[i].name, w->t[j].name) == 0) return kvq_error("gguf: duplicate tensor %s", w->t[i].name);
    }
    /* The header, in memory (keys and tensor infos are small). */
    struct buf h = {0};
    put(&h, "GGUF", 4);
    put_u32(&h, 3);
    put_u64(&h, w->n_t);
    put_u64(&h, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        put_str(&h, w->kv[i].key, strlen(w->kv[i].key));
        put(&h, w->kv[i].val, w->kv[i].val_len);
    }
    uint64_t off = 0, max_bytes = 0;
    for (size_t i = 0; i < w->n_t; i++) {
        struct wtensor *t = &w->t[i];
        t->offset = off;
        off = align_up(off + t->nbytes, w->alignment);
        if (!t->data && t->nbytes > max_bytes) max_bytes = t->nbytes;
        put_str(&h, t->name, strlen(t->name));
        put_u32(&h, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) put_u64(&h, t->ne[d]);
        put_u32(&h, t->type);
        put_u64(&h, t->offset);
    }
    static const uint8_t zeros[256];
    size_t pad = (size_t)(align_up(h.n, w->alignment) - h.n);
    while (pad > 0) {
        size_t k = pad < sizeof zeros ? pad : sizeof zeros;
        put(&h, zeros, k);
        pad -= k;
    }
    if (h.oom) {
        free(h.p);
        return kvq_error_code(KVQ_ERR_OOM, "gguf: out of memory while building the header");
    }
    struct kvq_outfile out;
    FILE *f = kvq_outfile_open(&out, path);
    if (!f) {
        free(h.p);
        return kvq_error_wrap("gguf: %s", kvq_last_error());
    }
    int rc = write_all(f, h.p, h.n, path);
    free(h.p);
    uint8_t *tmp = NULL;
    if (rc == 0 && fill && max_bytes > 0) {
        tmp = malloc((size_t)max_bytes);
        if (!tmp)
            rc = kvq_error_code(KVQ_ERR_OOM, "gguf: out of memory for a tensor of %llu bytes",
                                (unsigned long long)max_bytes);
    }
    uint64_t pos = 0;
    for (size_t i = 0; i < w->n_t && rc == 0; i++) {
        struct wtensor *t = &w->t[i];
        while (pos < t->offset && rc == 0) { /* alignment padding */
            size_t k = t->offset - pos < sizeof zeros ? (size_t)(t->offset - pos) : sizeof zeros;
            rc = write_all(f, zeros, k, path);
            pos += k;
        }
        if (rc) break;
        const void *src = t->data;
        if (!src) {
            kvq_clear_error();
            if (fill(user, i, tmp, t->nbytes) != 0) {
                rc = kvq_last_error()[0] ? -1 : kvq_error("gguf: producing tensor %s failed", t->name);
                break;
            }
            src = tmp;
        }
        rc = write_all(f, src, (size_t)t->nbytes, path);
        pos += t->nbytes;
    }
    /* Pad the file to the alignment after the last tensor, as ggml does. */
    while (rc == 0 && pos % w->alignment) {
        size_t k = (size_t)(align_up(pos, w->alignment) - pos);
        rc = write_all(f, zeros, k, path);
        pos += k;
    }
    free(tmp);
    /* a failed write leaves the path as it was (no partial file, no removed device) */
    if (rc != 0) kvq_outfile_abort(&out);
    else if (kvq_outfile_commit(&out) != 0) rc = kvq_error_wrap("gguf: %s", kvq_last_error());
    return rc;
}
