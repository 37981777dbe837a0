/* GGUF reader: values of every type read back as written (files built byte by byte
 * here, independently of the library's writer), and hostile files (truncated,
 * bit-flipped, absurd counts and offsets) rejected with an error, never a crash. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "gguf/gguf.h"
#include "model/model.h"

/* ---- a byte-level GGUF builder ---- */

struct buf {
    uint8_t *p;
    size_t n, cap;
};

static void put(struct buf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void put_u32(struct buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(struct buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(struct buf *b, const char *s) {
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}
static void put_key(struct buf *b, const char *key, uint32_t type) {
    put_str(b, key);
    put_u32(b, type);
}
static void pad_to(struct buf *b, size_t align) {
    static const uint8_t zero[64];
    while (b->n % align) put(b, zero, 1);
}

static void put_header(struct buf *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    put(b, "GGUF", 4);
    put_u32(b, version);
    put_u64(b, n_tensors);
    put_u64(b, n_kv);
}

/* A file holding one key of every type, a nested array and two tensors. */
static struct buf build_sample(void) {
    struct buf b = {0};
    put_header(&b, 3, 2, 15);
    uint8_t u8 = 200; int8_t i8 = -100; uint16_t u16 = 60000; int16_t i16 = -30000;
    int32_t i32 = -2000000000; float f32 = 3.5f; uint8_t bl = 1; int64_t i64 = -5000000000LL; double f64 = 2.25;
    put_key(&b, "t.u8", GGUF_TYPE_UINT8); put(&b, &u8, 1);
    put_key(&b, "t.i8", GGUF_TYPE_INT8); put(&b, &i8, 1);
    put_key(&b, "t.u16", GGUF_TYPE_UINT16); put(&b, &u16, 2);
    put_key(&b, "t.i16", GGUF_TYPE_INT16); put(&b, &i16, 2);
    put_key(&b, "t.u32", GGUF_TYPE_UINT32); put_u32(&b, 4000000000u);
    put_key(&b, "t.i32", GGUF_TYPE_INT32); put(&b, &i32, 4);
    put_key(&b, "t.f32", GGUF_TYPE_FLOAT32); put(&b, &f32, 4);
    put_key(&b, "t.bool", GGUF_TYPE_BOOL); put(&b, &bl, 1);
    put_key(&b, "t.str", GGUF_TYPE_STRING); put_str(&b, "héllo");
    put_key(&b, "t.u64", GGUF_TYPE_UINT64); put_u64(&b, 1ull << 40);
    put_key(&b, "t.i64", GGUF_TYPE_INT64); put(&b, &i64, 8);
    put_key(&b, "t.f64", GGUF_TYPE_FLOAT64); put(&b, &f64, 8);
    put_key(&b, "t.arr_i32", GGUF_TYPE_ARRAY); put_u32(&b, GGUF_TYPE_INT32); put_u64(&b, 3);
    for (int32_t v = -1; v <= 1; v++) put(&b, &v, 4);
    put_key(&b, "t.arr_str", GGUF_TYPE_ARRAY); put_u32(&b, GGUF_TYPE_STRING); put_u64(&b, 2);
    put_str(&b, "a"); put_str(&b, "");
    /* [[1, 2], [3]] as arrays of uint8 */
    put_key(&b, "t.nested", GGUF_TYPE_ARRAY); put_u32(&b, GGUF_TYPE_ARRAY); put_u64(&b, 2);
    put_u32(&b, GGUF_TYPE_UINT8); put_u64(&b, 2); put(&b, "\x01\x02", 2);
    put_u32(&b, GGUF_TYPE_UINT8); put_u64(&b, 1); put(&b, "\x03", 1);
    /* tensors: a [4, 2] f32 and a [32, 1] q8_0 */
    put_str(&b, "w.f32"); put_u32(&b, 2); put_u64(&b, 4); put_u64(&b, 2); put_u32(&b, KVQ_F32); put_u64(&b, 0);
    put_str(&b, "w.q8"); put_u32(&b, 1); put_u64(&b, 32); put_u32(&b, KVQ_Q8_0); put_u64(&b, 32);
    pad_to(&b, 32);
    float data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    put(&b, data, sizeof data);
    uint8_t q8[34] = {0x00, 0x3c}; /* scale 1.0 in f16 */
    for (int i = 0; i < 32; i++) q8[2 + i] = (uint8_t)(i - 16);
    put(&b, q8, sizeof q8);
    return b;
}

static void test_values(void) {
    struct buf b = build_sample();
    struct gguf_file *f = gguf_open_memory(b.p, b.n);
    CHECK(f != NULL, "sample file: %s", kvq_last_error());
    if (!f) return;
    uint32_t u32;
    uint64_t u64;
    int64_t i64;
    float f32;
    bool bl;
    char s[32];
    CHECK(gguf_version(f) == 3 && gguf_n_kv(f) == 15 && gguf_n_tensors(f) == 2, "counts");
    CHECK(gguf_get_u32(f, "t.u8", &u32) && u32 == 200, "u8");
    CHECK(gguf_get_i64(f, "t.i8", &i64) && i64 == -100, "i8");
    CHECK(gguf_get_u32(f, "t.u16", &u32) && u32 == 60000, "u16");
    CHECK(gguf_get_i64(f, "t.i16", &i64) && i64 == -30000, "i16");
    CHECK(gguf_get_u32(f, "t.u32", &u32) && u32 == 4000000000u, "u32");
    CHECK(gguf_get_i64(f, "t.i32", &i64) && i64 == -2000000000, "i32");
    CHECK(!gguf_get_u32(f, "t.i32", &u32), "negative int refused as u32");
    CHECK(gguf_get_f32(f, "t.f32", &f32) && f32 == 3.5f, "f32");
    CHECK(gguf_get_bool(f, "t.bool", &bl) && bl, "bool");
    CHECK(gguf_get_str(f, "t.str", s, sizeof s) && strcmp(s, "héllo") == 0, "string");
    CHECK(!gguf_get_str(f, "t.str", s, 3), "string longer than the buffer refused");
    CHECK(gguf_get_u64(f, "t.u64", &u64) && u64 == 1ull << 40, "u64");
    CHECK(!gguf_get_u32(f, "t.u64", &u32), "u64 too big for u32 refused");
    CHECK(gguf_get_i64(f, "t.i64", &i64) && i64 == -5000000000LL, "i64");
    CHECK(gguf_get_f32(f, "t.f64", &f32) && f32 == 2.25f, "f64");
    const struct gguf_value *a = gguf_get_arr(f, "t.arr_i32", GGUF_TYPE_INT32);
    CHECK(a && a->arr.n == 3 && gguf_arr_i64(a, 0) == -1 && gguf_arr_i64(a, 2) == 1, "int array");
    a = gguf_get_arr(f, "t.arr_str", GGUF_TYPE_STRING);
    CHECK(a && a->arr.n == 2 && gguf_str_eq(a->arr.strs[0], "a") && a->arr.strs[1].len == 0, "string array");
    a = gguf_get_arr(f, "t.nested", GGUF_TYPE_ARRAY);
    CHECK(a && a->arr.n == 2 && a->arr.vals[0].arr.n == 2 && gguf_arr_i64(&a->arr.vals[0], 1) == 2 &&
              gguf_arr_i64(&a->arr.vals[1], 0) == 3,
          "nested array");
    const struct gguf_tensor *t = gguf_find_tensor(f, "w.f32");
    CHECK(t && t->ne[0] == 4 && t->ne[1] == 2 && t->nbytes == 32 && ((const float *)t->data)[7] == 8.0f, "f32 tensor");
    t = gguf_find_tensor(f, "w.q8");
    CHECK(t && t->type == KVQ_Q8_0 && t->nbytes == 34 && ((const int8_t *)t->data)[2] == -16, "q8_0 tensor");
    CHECK(gguf_find(f, "missing") == NULL && gguf_find_tensor(f, "missing") == NULL, "missing names");
    gguf_close(f);

    /* Every truncation of the file must fail cleanly. */
    int accepted = 0;
    for (size_t n = 0; n < b.n; n++) {
        uint8_t *copy = malloc(n ? n : 1);
        memcpy(copy, b.p, n);
        struct gguf_file *g = gguf_open_memory(copy, n);
        if (g) accepted++;
        gguf_close(g);
        free(copy);
    }
    CHECK(accepted == 0, "%d truncated copies were accepted", accepted);
    free(b.p);
}

/* Builds a header-only file with one key whose value is described by `body`. */
static void expect_rejected(const char *what, struct buf *b, const char *message_part) {
    kvq_clear_error();
    struct gguf_file *f = gguf_open_memory(b->p, b->n);
    CHECK(f == NULL, "%s was accepted", what);
    CHECK(strstr(kvq_last_error(), message_part) != NULL, "%s: error '%s' should mention '%s'", what,
          kvq_last_error(), message_part);
    gguf_close(f);
    free(b->p);
    *b = (struct buf){0};
}

static void test_hostile(void) {
    struct buf b = {0};
    put(&b, "GGUX", 4); put_u32(&b, 3); put_u64(&b, 0); put_u64(&b, 0);
    expect_rejected("bad magic", &b, "magic");
    put_header(&b, 1, 0, 0);
    expect_rejected("version 1", &b, "version");
    put_header(&b, 3, 0, 1ull << 60);
    expect_rejected("huge key count", &b, "more than the file can hold");
    put_header(&b, 3, 1ull << 62, 0);
    expect_rejected("huge tensor count", &b, "more than the file can hold");
    put_header(&b, 3, 0, 1); put_key(&b, "k", GGUF_TYPE_ARRAY); put_u32(&b, GGUF_TYPE_UINT64); put_u64(&b, 1ull << 61);
    expect_rejected("huge numeric array", &b, "past the end");
    put_header(&b, 3, 0, 1); put_key(&b, "k", GGUF_TYPE_ARRAY); put_u32(&b, GGUF_TYPE_STRING); put_u64(&b, 1ull << 40);
    expect_rejected("huge string array", &b, "past the end");
    put_header(&b, 3, 0, 1); put_key(&b, "k", GGUF_TYPE_STRING); put_u64(&b, ~0ull);
    expect_rejected("huge string", &b, "past the end");
    put_header(&b, 3, 0, 1); put_key(&b, "k", 99); put_u32(&b, 0);
    expect_rejected("invalid value type", &b, "invalid value type");
    put_header(&b, 3, 0, 1); put_key(&b, "k", GGUF_TYPE_ARRAY);
    for (int i = 0; i < 20; i++) { put_u32(&b, GGUF_TYPE_ARRAY); put_u64(&b, 1); }
    expect_rejected("deep nesting", &b, "nested");
    put_header(&b, 3, 0, 2); put_key(&b, "k", GGUF_TYPE_UINT8); put(&b, "\x01", 1); put_key(&b, "k", GGUF_TYPE_UINT8);
    put(&b, "\x01", 1);
    expect_rejected("duplicate key", &b, "duplicate");
    put_header(&b, 3, 0, 1); put_key(&b, "general.alignment", GGUF_TYPE_UINT32); put_u32(&b, 24);
    expect_rejected("alignment not a power of two", &b, "power of two");
    /* tensors */
    put_header(&b, 3, 1, 0); put_str(&b, "t"); put_u32(&b, 1); put_u64(&b, 32); put_u32(&b, KVQ_F32); put_u64(&b, 0);
    pad_to(&b, 32); put(&b, "0123456789", 10);
    expect_rejected("tensor past the end", &b, "past the end");
    put_header(&b, 3, 1, 0); put_str(&b, "t"); put_u32(&b, 1); put_u64(&b, 32); put_u32(&b, 77); put_u64(&b, 0);
    expect_rejected("unknown tensor type", &b, "unknown type");
    put_header(&b, 3, 1, 0); put_str(&b, "t"); put_u32(&b, 5); put_u64(&b, 1);
    for (int i = 0; i < 8; i++) put_u64(&b, 0);
    expect_rejected("too many dims", &b, "dimensions");
    put_header(&b, 3, 1, 0); put_str(&b, "t"); put_u32(&b, 2); put_u64(&b, 1ull << 40); put_u64(&b, 1ull << 40);
    put_u32(&b, KVQ_F32); put_u64(&b, 0);
    expect_rejected("overflowing shape", &b, "shape");
    put_header(&b, 3, 1, 0); put_str(&b, "t"); put_u32(&b, 1); put_u64(&b, 33); put_u32(&b, KVQ_Q8_0); put_u64(&b, 0);
    pad_to(&b, 32); for (int i = 0; i < 8; i++) put_u64(&b, 0);
    expect_rejected("row not a multiple of the block", &b, "multiple");
    put_header(&b, 3, 1, 0); put_str(&b, "t"); put_u32(&b, 1); put_u64(&b, 4); put_u32(&b, KVQ_F32); put_u64(&b, 3);
    pad_to(&b, 32); for (int i = 0; i < 8; i++) put_u64(&b, 0);
    expect_rejected("misaligned tensor", &b, "aligned");
}

/* Random bit flips and truncations of a real model's header: the reader must
 * either accept the file or fail with a message, and never crash (ASan checks). */
static void test_mutations(void) {
    const char *path = shared_path("models/tinydoc-q8_0.gguf");
    if (!path) {
        printf("SKIP mutations: models/tinydoc-q8_0.gguf missing\n");
        return;
    }
    FILE *fp = fopen(path, "rb");
    fseek(fp, 0, SEEK_END);
    size_t n = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *copy = malloc(n);
    CHECK(fread(copy, 1, n, fp) == n, "read model");
    fclose(fp);
    uint64_t rng = 12345;
    int rejected = 0, rounds = 2000;
    for (int r = 0; r < rounds; r++) {
        enum { MAX_FLIPS = 4 };
        size_t at[MAX_FLIPS];
        uint8_t mask[MAX_FLIPS];
        int flips = 1 + r % MAX_FLIPS;
        for (int k = 0; k < flips; k++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            /* The structure (keys, vocabulary, tensor infos) is in the first ~250 KB. */
            at[k] = (size_t)(rng >> 33) % 250000;
            mask[k] = (uint8_t)(1u << ((rng >> 20) & 7));
            copy[at[k]] ^= mask[k];
        }
        size_t len = r % 3 == 0 ? (size_t)(rng >> 40) % n : n;
        kvq_clear_error();
        struct gguf_file *f = gguf_open_memory(copy, len);
        if (!f) {
            rejected++;
            CHECK(kvq_last_error()[0] != '\0', "rejection without a message");
        }
        gguf_close(f);
        for (int k = flips - 1; k >= 0; k--) copy[at[k]] ^= mask[k];
    }
    printf("mutations: %d of %d mutated headers rejected with an error, the rest parsed\n", rejected, rounds);
    CHECK(rejected > 0, "no mutated file was rejected");
    free(copy);
}

/* The model loader names unsupported weight types and tensors clearly. */
static void test_model_errors(void) {
    char path[] = "/tmp/kvq_test_gguf_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "temp file");
    FILE *fp = fdopen(fd, "wb");
    struct buf b = {0};
    put_header(&b, 3, 1, 5);
    put_key(&b, "general.architecture", GGUF_TYPE_STRING); put_str(&b, "llama");
    put_key(&b, "llama.embedding_length", GGUF_TYPE_UINT32); put_u32(&b, 256);
    put_key(&b, "llama.block_count", GGUF_TYPE_UINT32); put_u32(&b, 1);
    put_key(&b, "llama.feed_forward_length", GGUF_TYPE_UINT32); put_u32(&b, 256);
    put_key(&b, "llama.attention.head_count", GGUF_TYPE_UINT32); put_u32(&b, 2);
    put_str(&b, "token_embd.weight"); put_u32(&b, 2); put_u64(&b, 256); put_u64(&b, 4); put_u32(&b, KVQ_Q5_K);
    put_u64(&b, 0);
    pad_to(&b, 32);
    uint8_t zeros[176 * 4] = {0};
    put(&b, zeros, sizeof zeros);
    fwrite(b.p, 1, b.n, fp);
    fclose(fp);
    struct model *m = model_load(path);
    CHECK(m == NULL && strstr(kvq_last_error(), "unsupported tensor type q5_K in tensor token_embd.weight"),
          "q5_K weight: got '%s'", kvq_last_error());
    model_free(m);
    free(b.p);

    b = (struct buf){0};
    put_header(&b, 3, 0, 1);
    put_key(&b, "general.architecture", GGUF_TYPE_STRING); put_str(&b, "mamba");
    fp = fopen(path, "wb");
    fwrite(b.p, 1, b.n, fp);
    fclose(fp);
    m = model_load(path);
    CHECK(m == NULL && strstr(kvq_last_error(), "unsupported architecture 'mamba'"), "arch: got '%s'",
          kvq_last_error());
    model_free(m);
    free(b.p);
    remove(path);
    CHECK(gguf_open("/nonexistent/model.gguf") == NULL && strstr(kvq_last_error(), "cannot open"), "missing file");
}

int main(void) {
    test_values();
    test_hostile();
    test_model_errors();
    test_mutations();
    return check_finish();
}
