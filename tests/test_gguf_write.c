/* GGUF writer -> reader round trip: every value type, numeric/bool/string arrays,
 * key replacement, tensors from data and from the fill callback, alignment, and
 * the writer's errors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "gguf/gguf.h"

static int fill_pattern(void *user, uint64_t idx, void *dst, uint64_t nbytes) {
    int *calls = user;
    (*calls)++;
    uint8_t *p = dst;
    for (uint64_t i = 0; i < nbytes; i++) p[i] = (uint8_t)(i * 7 + idx * 13);
    return 0;
}

static int fill_fail(void *user, uint64_t idx, void *dst, uint64_t nbytes) {
    (void)user, (void)idx, (void)dst, (void)nbytes;
    return kvq_error("deliberate failure");
}

static void round_trip(const char *path, uint32_t alignment) {
    struct gguf_writer *w = gguf_writer_new();
    if (alignment != 32) gguf_writer_set_alignment(w, alignment);
    gguf_writer_add_u32(w, "t.u32", 4000000000u);
    gguf_writer_add_i32(w, "t.i32", -123456);
    gguf_writer_add_u64(w, "t.u64", 0x123456789abcdefull);
    gguf_writer_add_f32(w, "t.f32", 3.25f);
    gguf_writer_add_bool(w, "t.bool", true);
    gguf_writer_add_str(w, "t.str", "héllo wörld");
    gguf_writer_add_str(w, "t.empty", "");
    gguf_writer_add_u32(w, "t.replaced", 1);
    gguf_writer_add_u32(w, "t.replaced", 2);
    uint8_t u8[] = {1, 2, 255};
    int8_t i8[] = {-1, 0, 127};
    uint16_t u16[] = {65535, 7};
    int16_t i16[] = {-32768, 5};
    uint32_t u32[] = {1, 2, 3, 4};
    int32_t i32[] = {-7, 8};
    float f32[] = {0.5f, -1.5f, 1e30f};
    bool bl[] = {true, false, true};
    uint64_t u64[] = {1ull << 60, 3};
    int64_t i64[] = {-(1ll << 60), 9};
    double f64[] = {1.0 / 3.0, -2.5};
    gguf_writer_add_arr(w, "a.u8", GGUF_TYPE_UINT8, u8, 3);
    gguf_writer_add_arr(w, "a.i8", GGUF_TYPE_INT8, i8, 3);
    gguf_writer_add_arr(w, "a.u16", GGUF_TYPE_UINT16, u16, 2);
    gguf_writer_add_arr(w, "a.i16", GGUF_TYPE_INT16, i16, 2);
    gguf_writer_add_arr(w, "a.u32", GGUF_TYPE_UINT32, u32, 4);
    gguf_writer_add_arr(w, "a.i32", GGUF_TYPE_INT32, i32, 2);
    gguf_writer_add_arr(w, "a.f32", GGUF_TYPE_FLOAT32, f32, 3);
    gguf_writer_add_arr(w, "a.bool", GGUF_TYPE_BOOL, bl, 3);
    gguf_writer_add_arr(w, "a.u64", GGUF_TYPE_UINT64, u64, 2);
    gguf_writer_add_arr(w, "a.i64", GGUF_TYPE_INT64, i64, 2);
    gguf_writer_add_arr(w, "a.f64", GGUF_TYPE_FLOAT64, f64, 2);
    gguf_writer_add_arr(w, "a.empty", GGUF_TYPE_UINT32, NULL, 0);
    const char *strs[] = {"a", "", "<0x0A>", "\xe2\x96\x81the"};
    gguf_writer_add_str_arr(w, "a.str", strs, 4);

    float data[3 * 64];
    for (int i = 0; i < 3 * 64; i++) data[i] = (float)i * 0.25f;
    uint64_t ne_a[] = {64, 3}, ne_b[] = {32, 5}, ne_c[] = {7}, ne_d[] = {256, 2, 2};
    gguf_writer_add_tensor(w, "a.weight", 2, ne_a, KVQ_F32, data);
    gguf_writer_add_tensor(w, "b.weight", 2, ne_b, KVQ_Q8_0, NULL);
    gguf_writer_add_tensor(w, "c.bias", 1, ne_c, KVQ_F16, NULL);
    gguf_writer_add_tensor(w, "d.weight", 3, ne_d, KVQ_Q4_K, NULL);
    int calls = 0;
    CHECK(gguf_writer_write(w, path, fill_pattern, &calls) == 0, "write: %s", kvq_last_error());
    CHECK(calls == 3, "fill called %d times (expected 3: tensors without data)", calls);
    gguf_writer_free(w);

    struct gguf_file *f = gguf_open(path);
    CHECK(f != NULL, "open: %s", kvq_last_error());
    if (!f) return;
    CHECK(gguf_version(f) == 3, "version %u", gguf_version(f));
    CHECK(gguf_alignment(f) == alignment, "alignment %llu", (unsigned long long)gguf_alignment(f));
    uint32_t u;
    uint64_t v64;
    int64_t i;
    float fl;
    bool b;
    char s[64];
    CHECK(gguf_get_u32(f, "t.u32", &u) && u == 4000000000u, "u32");
    CHECK(gguf_get_i64(f, "t.i32", &i) && i == -123456, "i32");
    CHECK(gguf_get_u64(f, "t.u64", &v64) && v64 == 0x123456789abcdefull, "u64");
    CHECK(gguf_get_f32(f, "t.f32", &fl) && fl == 3.25f, "f32");
    CHECK(gguf_get_bool(f, "t.bool", &b) && b, "bool");
    CHECK(gguf_get_str(f, "t.str", s, sizeof s) && strcmp(s, "héllo wörld") == 0, "str");
    CHECK(gguf_get_str(f, "t.empty", s, sizeof s) && s[0] == 0, "empty str");
    CHECK(gguf_get_u32(f, "t.replaced", &u) && u == 2, "replaced key holds %u", u);
    CHECK(gguf_find(f, "t.u32")->type == GGUF_TYPE_UINT32, "u32 type");
    CHECK(gguf_find(f, "t.i32")->type == GGUF_TYPE_INT32, "i32 type");
    CHECK(gguf_n_kv(f) == 21 + (alignment != 32), "n_kv %llu", (unsigned long long)gguf_n_kv(f));
    const struct gguf_value *a;
    CHECK((a = gguf_get_arr(f, "a.u8", GGUF_TYPE_UINT8)) && a->arr.n == 3 && gguf_arr_i64(a, 2) == 255, "a.u8");
    CHECK((a = gguf_get_arr(f, "a.i8", GGUF_TYPE_INT8)) && gguf_arr_i64(a, 0) == -1 && gguf_arr_i64(a, 2) == 127, "a.i8");
    CHECK((a = gguf_get_arr(f, "a.u16", GGUF_TYPE_UINT16)) && gguf_arr_i64(a, 0) == 65535, "a.u16");
    CHECK((a = gguf_get_arr(f, "a.i16", GGUF_TYPE_INT16)) && gguf_arr_i64(a, 0) == -32768, "a.i16");
    CHECK((a = gguf_get_arr(f, "a.u32", GGUF_TYPE_UINT32)) && a->arr.n == 4 && gguf_arr_i64(a, 3) == 4, "a.u32");
    CHECK((a = gguf_get_arr(f, "a.i32", GGUF_TYPE_INT32)) && gguf_arr_i64(a, 0) == -7, "a.i32");
    CHECK((a = gguf_get_arr(f, "a.f32", GGUF_TYPE_FLOAT32)) && gguf_arr_f64(a, 1) == -1.5 && gguf_arr_f64(a, 2) == 1e30f,
          "a.f32");
    CHECK((a = gguf_get_arr(f, "a.bool", GGUF_TYPE_BOOL)) && a->arr.n == 3 && ((const uint8_t *)a->arr.data)[0] == 1 &&
              ((const uint8_t *)a->arr.data)[1] == 0,
          "a.bool");
    CHECK((a = gguf_get_arr(f, "a.u64", GGUF_TYPE_UINT64)) && gguf_arr_i64(a, 0) == (1ll << 60), "a.u64");
    CHECK((a = gguf_get_arr(f, "a.i64", GGUF_TYPE_INT64)) && gguf_arr_i64(a, 0) == -(1ll << 60), "a.i64");
    CHECK((a = gguf_get_arr(f, "a.f64", GGUF_TYPE_FLOAT64)) && gguf_arr_f64(a, 0) == 1.0 / 3.0, "a.f64");
    CHECK((a = gguf_get_arr(f, "a.empty", GGUF_TYPE_UINT32)) && a->arr.n == 0, "a.empty");
    CHECK((a = gguf_get_arr(f, "a.str", GGUF_TYPE_STRING)) && a->arr.n == 4, "a.str");
    if (a && a->arr.n == 4)
        for (int k = 0; k < 4; k++) CHECK(gguf_str_eq(a->arr.strs[k], strs[k]), "a.str[%d]", k);

    CHECK(gguf_n_tensors(f) == 4, "n_tensors");
    const struct gguf_tensor *t = gguf_find_tensor(f, "a.weight");
    CHECK(t && t->type == KVQ_F32 && t->n_dims == 2 && t->ne[0] == 64 && t->ne[1] == 3 && t->nbytes == sizeof data &&
              memcmp(t->data, data, sizeof data) == 0,
          "a.weight");
    t = gguf_find_tensor(f, "b.weight");
    CHECK(t && t->type == KVQ_Q8_0 && t->nbytes == 5 * 34, "b.weight");
    if (t) {
        bool ok = true;
        for (uint64_t k = 0; k < t->nbytes; k++) ok &= ((const uint8_t *)t->data)[k] == (uint8_t)(k * 7 + 1 * 13);
        CHECK(ok, "b.weight bytes come from the fill callback");
    }
    t = gguf_find_tensor(f, "c.bias");
    CHECK(t && t->type == KVQ_F16 && t->n_dims == 1 && t->ne[0] == 7 && t->nbytes == 14, "c.bias");
    t = gguf_find_tensor(f, "d.weight");
    CHECK(t && t->type == KVQ_Q4_K && t->n_dims == 3 && t->ne[2] == 2 && t->nbytes == 4 * 144, "d.weight");
    for (uint64_t k = 0; k < gguf_n_tensors(f); k++)
        CHECK(gguf_tensor_at(f, k)->offset % alignment == 0, "tensor %llu offset aligned", (unsigned long long)k);
    gguf_close(f);
}

int main(void) {
    char dir[] = "/tmp/kvq_gguf_test_XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    char path[256];
    snprintf(path, sizeof path, "%s/rt.gguf", dir);
    round_trip(path, 32);
    round_trip(path, 64);

    /* Errors: bad rows, a failing fill callback (no file left behind), duplicates. */
    struct gguf_writer *w = gguf_writer_new();
    uint64_t ne[] = {33, 2};
    gguf_writer_add_tensor(w, "bad", 2, ne, KVQ_Q8_0, NULL);
    CHECK(gguf_writer_write(w, path, fill_pattern, &(int){0}) != 0 && strstr(kvq_last_error(), "multiple"),
          "q8_0 row of 33 refused: %s", kvq_last_error());
    gguf_writer_free(w);
    remove(path);
    w = gguf_writer_new();
    ne[0] = 32;
    gguf_writer_add_tensor(w, "x", 2, ne, KVQ_Q8_0, NULL);
    CHECK(gguf_writer_write(w, path, fill_fail, NULL) != 0 && strstr(kvq_last_error(), "deliberate"),
          "fill failure reported: %s", kvq_last_error());
    CHECK(access(path, F_OK) != 0, "no partial file after a failure");
    gguf_writer_add_tensor(w, "x", 2, ne, KVQ_Q8_0, NULL);
    CHECK(gguf_writer_write(w, path, fill_pattern, &(int){0}) != 0 && strstr(kvq_last_error(), "duplicate"),
          "duplicate tensor refused: %s", kvq_last_error());
    gguf_writer_free(w);
    remove(path);
    rmdir(dir);
    return check_finish();
}
