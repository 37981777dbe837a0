/* kvq gen-model: writes a GGUF model of a real architecture's shape with random
 * weights, for speed and memory measurements of models we cannot ship.
 *
 * Weights are normal with std 1/sqrt(fan_in) (fan_in = row length), so every
 * projection roughly keeps its input's scale and activations stay finite; norm
 * weights are 1 (Gemma's too: its GGUF holds them with the +1 of Gemma's norm folded
 * in), biases 0.02 * normal. The vocabulary is a placeholder of the right
 * size in llama.cpp's SPM form ("llama"): <unk> <s> </s>, the 256 byte tokens
 * <0x00>..<0xFF>, the printable ASCII characters and "▁", then "<pN>" placeholders.
 * Both kvq and llama.cpp load it. Data is produced tensor by tensor through the GGUF
 * writer's fill callback (rows split over threads, each row seeded from (seed,
 * tensor, row) so the output does not depend on the thread count). */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/threadpool.h"
#include "gguf/gguf.h"
#include "kernels/f16.h"

struct shape {
    const char *name, *arch, *hf_name;
    int n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx;
    float rope_theta, rms_eps;
    bool tied, qkv_bias;
    /* 0 for none: head_dim (key_length) when not n_embd / n_head; sliding_window;
     * rope_linear, the factor of linear rope scaling (Gemma 3: global layers only) */
    int head_dim, n_swa;
    float rope_linear;
};

/* Mistral: the v0.2/v0.3 base shape with v0.2's vocabulary (32000) and rope theta 1e6.
 * Gemma 3 (arch gemma3: q/k norms, post-attention and post-FFN norms, GELU-tanh FFN,
 * embeddings scaled by sqrt(n_embd)): llama.cpp's GGUF shape, its vocabulary the
 * tokenizer's 262144 tokens (the HF embedding's 262208 rows less the unused ones the
 * converter drops). Five sliding layers then one global, the local rope theta (10000)
 * and the query scale 1/sqrt(head_dim) (query_pre_attn_scalar 256) are not in the
 * file: kvq and llama.cpp hard-code them. */
static const struct shape shapes[] = {
    {"llama3-8b", "llama", "Meta-Llama-3-8B", 4096, 32, 32, 8, 14336, 128256, 8192, 500000.0f, 1e-5f, false, false, 0, 0, 0},
    {"llama3-70b", "llama", "Meta-Llama-3-70B", 8192, 80, 64, 8, 28672, 128256, 8192, 500000.0f, 1e-5f, false, false, 0, 0, 0},
    {"mistral-7b", "llama", "Mistral-7B-v0.2", 4096, 32, 32, 8, 14336, 32000, 32768, 1000000.0f, 1e-5f, false, false, 0, 0, 0},
    {"qwen2.5-0.5b", "qwen2", "Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, 32768, 1000000.0f, 1e-6f, true, true, 0, 0, 0},
    {"qwen2.5-7b", "qwen2", "Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, 32768, 1000000.0f, 1e-6f, false, true, 0, 0, 0},
    /* 77 GB in Q8_0: more than one 80 GB GPU holds, with its KV (tensor parallelism) */
    {"qwen2.5-72b", "qwen2", "Qwen2.5-72B", 8192, 80, 64, 8, 29568, 152064, 32768, 1000000.0f, 1e-6f, false, true, 0, 0, 0},
    {"gemma3-4b", "gemma3", "gemma-3-4b-pt", 2560, 34, 8, 4, 10240, 262144, 131072, 1000000.0f, 1e-6f, true, false, 256, 1024, 8.0f},
    {"gemma3-12b", "gemma3", "gemma-3-12b-pt", 3840, 48, 16, 8, 15360, 262144, 131072, 1000000.0f, 1e-6f, true, false, 256, 1024, 8.0f},
};
#define N_SHAPES (sizeof shapes / sizeof shapes[0])

static const char *const gen_model_help =
    "usage: kvq gen-model --shape NAME --type TYPE -o FILE [--seed S] [-t N] [--layers N]\n"
    "\n"
    "Writes a GGUF model with the shape of a real one and random weights (normal, std\n"
    "1/sqrt(fan_in); norms 1), with a placeholder SPM vocabulary of the real size.\n"
    "kvq and llama.cpp load it; its output is noise, its speed and memory are real.\n"
    "\n"
    "  --shape NAME    llama3-8b | llama3-70b | mistral-7b (v0.2: vocab 32000, theta 1e6)\n"
    "                  | qwen2.5-0.5b | qwen2.5-7b | qwen2.5-72b (77 GB in q8_0: two 80 GB\n"
    "                  GPUs, --tp 2) | gemma3-4b | gemma3-12b (head size 256, window 1024)\n"
    "  --type TYPE     f16 | q8_0 | q4_0 | q4_k | q6_k | q4_k_m: weights of the 2-D tensors\n"
    "                  (norms and biases are f32). q4_k_m is q4_k with q6_k for the output\n"
    "                  and for attn_v and ffn_down in llama-quantize's Q4_K_M layers. The\n"
    "                  k types need rows of a multiple of 256 values; other tensors fall\n"
    "                  back to q8_0 (llama-quantize falls back likewise)\n"
    "  -o FILE         output file\n"
    "  --seed S        random seed (default 1)\n"
    "  -t, --threads N threads (default: all cores)\n"
    "  --layers N      fewer layers than the real model (for quick tests)\n"
    "  -h, --help      this text\n";

/* ---- random numbers ---- */

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Approximately standard normal: Irwin-Hall sum of four 16-bit uniforms, scaled to unit variance. */
static void fill_normal(uint64_t *s, float *dst, int n, float std) {
    const float k = std * 1.7320508f / 65536.0f;
    for (int i = 0; i < n; i++) {
        uint64_t r = splitmix(s);
        uint32_t sum = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) + (uint32_t)((r >> 32) & 0xffff) +
                       (uint32_t)(r >> 48);
        dst[i] = ((float)sum - 131070.0f) * k;
    }
}

/* ---- quantizers (ggml block layouts) ---- */

/* q8_0: blocks of 32: f16 scale d, 32 x int8; x = d * q. */
static void quant_q8_0(const float *x, uint8_t *out, int n) {
    for (int b = 0; b < n / 32; b++, x += 32, out += 34) {
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
        float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0;
        uint16_t h = kvq_f32_to_f16(d);
        memcpy(out, &h, 2);
        for (int i = 0; i < 32; i++) out[2 + i] = (uint8_t)(int8_t)lrintf(x[i] * id);
    }
}

/* q4_0: blocks of 32: f16 scale d, 16 bytes; byte j holds value j (low nibble) and
 * value j+16 (high nibble); x = d * (q - 8). d = (value of largest magnitude) / -8. */
static void quant_q4_0(const float *x, uint8_t *out, int n) {
    for (int b = 0; b < n / 32; b++, x += 32, out += 18) {
        float amax = 0, mx = 0;
        for (int i = 0; i < 32; i++)
            if (fabsf(x[i]) > amax) {
                amax = fabsf(x[i]);
                mx = x[i];
            }
        float d = mx / -8.0f, id = d != 0 ? 1.0f / d : 0;
        uint16_t h = kvq_f32_to_f16(d);
        memcpy(out, &h, 2);
        for (int j = 0; j < 16; j++) {
            int q0 = (int)(x[j] * id + 8.5f), q1 = (int)(x[j + 16] * id + 8.5f);
            q0 = q0 < 0 ? 0 : q0 > 15 ? 15 : q0;
            q1 = q1 < 0 ? 0 : q1 > 15 ? 15 : q1;
            out[2 + j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* q4_K: super-blocks of 256 = 8 sub-blocks of 32: f16 d, f16 dmin, 12 bytes of 6-bit
 * sub-block scales/mins, 128 bytes of nibbles. x = d*sc[j]*q - dmin*m[j]. Scales:
 * j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
 * m = (s[j+4] >> 4) | (s[j] >> 6) << 4. Nibbles: 32-byte group g holds sub-block 2g
 * (low) and 2g+1 (high). Sub-block range: min(0, min x) .. max x, 15 steps. */
static void quant_q4_k(const float *x, uint8_t *out, int n) {
    for (int b = 0; b < n / 256; b++, x += 256, out += 144) {
        float scale[8], minv[8], max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; j++) {
            float lo = 0, hi = -INFINITY;
            for (int i = 0; i < 32; i++) {
                lo = fminf(lo, x[32 * j + i]);
                hi = fmaxf(hi, x[32 * j + i]);
            }
            scale[j] = (hi - lo) / 15.0f;
            minv[j] = -lo;
            max_scale = fmaxf(max_scale, scale[j]);
            max_min = fmaxf(max_min, minv[j]);
        }
        float d = max_scale / 63.0f, dmin = max_min / 63.0f;
        uint16_t hd = kvq_f32_to_f16(d), hm = kvq_f32_to_f16(dmin);
        d = kvq_f16_to_f32(hd);
        dmin = kvq_f16_to_f32(hm);
        memcpy(out, &hd, 2);
        memcpy(out + 2, &hm, 2);
        uint8_t *s = out + 4, *qs = out + 16;
        memset(s, 0, 12);
        int ls[8], lm[8];
        for (int j = 0; j < 8; j++) {
            ls[j] = d > 0 ? (int)lrintf(scale[j] / d) : 0;
            lm[j] = dmin > 0 ? (int)lrintf(minv[j] / dmin) : 0;
            ls[j] = ls[j] > 63 ? 63 : ls[j];
            lm[j] = lm[j] > 63 ? 63 : lm[j];
            if (j < 4) {
                s[j] = (uint8_t)ls[j];
                s[j + 4] = (uint8_t)lm[j];
            } else {
                s[j + 4] = (uint8_t)((ls[j] & 15) | ((lm[j] & 15) << 4));
                s[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
                s[j] |= (uint8_t)((lm[j] >> 4) << 6);
            }
        }
        for (int j = 0; j < 8; j++) {
            float sd = d * ls[j], sm = dmin * lm[j], inv = sd > 0 ? 1.0f / sd : 0;
            for (int i = 0; i < 32; i++) {
                int q = (int)lrintf((x[32 * j + i] + sm) * inv);
                q = q < 0 ? 0 : q > 15 ? 15 : q;
                uint8_t *p = &qs[32 * (j / 2) + i];
                if (j % 2 == 0) *p = (uint8_t)q;
                else *p |= (uint8_t)(q << 4);
            }
        }
    }
}

/* q6_K: super-blocks of 256 = 16 sub-blocks of 16: ql[128] (low 4 bits), qh[64] (high
 * 2 bits), int8 scales[16], f16 d. x = d*sc[v/16]*(q - 32). Value v = 128h + 32quad + l:
 * low bits in ql[64h + 32(quad & 1) + l] (the high nibble for quad >= 2), high bits
 * 2quad.. of qh[32h + l]. Sub-block range: max |x| over 32 steps. */
static void quant_q6_k(const float *x, uint8_t *out, int n) {
    for (int b = 0; b < n / 256; b++, x += 256, out += 210) {
        float scale[16], max_scale = 0;
        for (int k = 0; k < 16; k++) {
            float amax = 0;
            for (int i = 0; i < 16; i++) amax = fmaxf(amax, fabsf(x[16 * k + i]));
            scale[k] = amax / 31.0f;
            max_scale = fmaxf(max_scale, scale[k]);
        }
        uint16_t hd = kvq_f32_to_f16(max_scale / 127.0f);
        const float d = kvq_f16_to_f32(hd);
        memcpy(out + 208, &hd, 2);
        uint8_t *ql = out, *qh = out + 128, q[256];
        int8_t *sc = (int8_t *)(out + 192);
        for (int k = 0; k < 16; k++) {
            int l = d > 0 ? (int)lrintf(scale[k] / d) : 0;
            sc[k] = (int8_t)(l > 127 ? 127 : l);
            const float sd = d * sc[k], inv = sd > 0 ? 1.0f / sd : 0;
            for (int i = 0; i < 16; i++) {
                int v = (int)lrintf(x[16 * k + i] * inv) + 32;
                q[16 * k + i] = (uint8_t)(v < 0 ? 0 : v > 63 ? 63 : v);
            }
        }
        memset(ql, 0, 128);
        memset(qh, 0, 64);
        for (int v = 0; v < 256; v++) {
            const int h = v / 128, quad = v % 128 / 32, l = v % 32;
            ql[64 * h + 32 * (quad & 1) + l] |= (uint8_t)((q[v] & 15) << (quad >= 2 ? 4 : 0));
            qh[32 * h + l] |= (uint8_t)((q[v] >> 4) << (2 * quad));
        }
    }
}

static void quant_row(uint32_t type, const float *x, void *out, int n) {
    switch (type) {
    case KVQ_F32: memcpy(out, x, sizeof(float) * (size_t)n); break;
    case KVQ_F16: {
        uint16_t *o = out;
        for (int i = 0; i < n; i++) o[i] = kvq_f32_to_f16(x[i]);
        break;
    }
    case KVQ_Q8_0: quant_q8_0(x, out, n); break;
    case KVQ_Q4_0: quant_q4_0(x, out, n); break;
    case KVQ_Q4_K: quant_q4_k(x, out, n); break;
    case KVQ_Q6_K: quant_q6_k(x, out, n); break;
    default: break;
    }
}

/* ---- tensors ---- */

enum init { INIT_NORMAL, INIT_ONES, INIT_BIAS };

struct gtensor {
    char name[64];
    uint32_t n_dims, type;
    uint64_t ne[2];
    enum init init;
};

struct gen {
    struct gtensor *t;
    int n_t;
    uint64_t seed;
    int n_threads;
    uint64_t total_bytes, done_bytes;
    double t0;
    bool tty;
};

struct job {
    const struct gtensor *t;
    uint8_t *dst;
    uint64_t seed, tensor;
    int64_t r0, r1;
    size_t row_bytes;
};

static void *gen_rows(void *arg) {
    struct job *j = arg;
    int n = (int)j->t->ne[0];
    float *row = malloc(sizeof(float) * (size_t)n);
    if (!row) return (void *)1;
    float std = 1.0f / sqrtf((float)n);
    for (int64_t r = j->r0; r < j->r1; r++) {
        uint64_t s = j->seed ^ (j->tensor * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)r * 0xd1b54a32d192ed03ull);
        splitmix(&s);
        if (j->t->init == INIT_ONES)
            for (int i = 0; i < n; i++) row[i] = 1.0f;
        else
            fill_normal(&s, row, n, j->t->init == INIT_BIAS ? 0.02f : std);
        quant_row(j->t->type, row, j->dst + (size_t)r * j->row_bytes, n);
    }
    free(row);
    return NULL;
}

static int fill_tensor(void *user, uint64_t idx, void *dst, uint64_t nbytes) {
    struct gen *g = user;
    const struct gtensor *t = &g->t[idx];
    int64_t rows = (int64_t)t->ne[1];
    size_t row_bytes = kvq_dtype_row_bytes(t->type, t->ne[0]);
    if (row_bytes * (uint64_t)rows != nbytes) return kvq_error("gen-model: size mismatch for %s", t->name);
    int nt = g->n_threads < rows ? g->n_threads : (int)rows;
    pthread_t th[256];
    struct job jobs[256];
    int started = 0, rc = 0;
    for (int i = 0; i < nt; i++) {
        jobs[i] = (struct job){t, dst, g->seed, idx, rows * i / nt, rows * (i + 1) / nt, row_bytes};
        if (i > 0 && pthread_create(&th[i], NULL, gen_rows, &jobs[i]) != 0) {
            rc = kvq_error("gen-model: cannot start a thread");
            break;
        }
        started = i + 1;
    }
    if (rc == 0 && gen_rows(&jobs[0]) != NULL) rc = kvq_error("gen-model: out of memory");
    for (int i = 1; i < started; i++) {
        void *ret;
        pthread_join(th[i], &ret);
        if (ret && rc == 0) rc = kvq_error("gen-model: out of memory");
    }
    g->done_bytes += nbytes;
    if (g->tty) {
        double el = cli_now() - g->t0;
        fprintf(stderr, "\rkvq: %6.0f / %.0f MiB  %5.0f MiB/s  ", g->done_bytes / 1048576.0, g->total_bytes / 1048576.0,
                g->done_bytes / 1048576.0 / (el > 0 ? el : 1e-9));
    }
    return rc;
}

static uint32_t weight_type_for(uint32_t type, uint64_t row) {
    if ((type == KVQ_Q4_K || type == KVQ_Q6_K) && row % 256 != 0) return KVQ_Q8_0;
    return type;
}

/* llama-quantize's Q4_K_M: q6_K for attn_v and ffn_down of the first and last eighth
 * of the layers and every third one between. */
static bool q4_k_m_more_bits(int il, int n_layer) {
    return il < n_layer / 8 || il >= 7 * n_layer / 8 || (il - n_layer / 8) % 3 == 2;
}

static void add_t(struct gen *g, const char *name, uint32_t n_dims, uint64_t ne0, uint64_t ne1, uint32_t type,
                  enum init init) {
    struct gtensor *t = &g->t[g->n_t++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = n_dims;
    t->ne[0] = ne0;
    t->ne[1] = ne1;
    t->type = n_dims == 1 ? KVQ_F32 : weight_type_for(type, ne0);
    t->init = init;
}

static const char *const gen_model_value_flags[] = {"--shape", "--type", "-o", "--output", "--seed", "-t", "--threads", "--layers", NULL};

int cmd_gen_model(int argc, char **argv) {
    const char *shape_name = NULL, *type_name = NULL, *out = NULL;
    uint64_t seed = 1;
    int n_threads = 0, n_layers = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(gen_model_help, stdout);
            return 0;
        }
        if (!(v = cli_option_value(argc, argv, &i, gen_model_value_flags, "gen-model"))) return 1;
        bool ok = true;
        if (!strcmp(a, "--shape")) shape_name = v;
        else if (!strcmp(a, "--type")) type_name = v;
        else if (!strcmp(a, "-o") || !strcmp(a, "--output")) out = v;
        else if (!strcmp(a, "--seed")) ok = cli_parse_u64(a, v, &seed);
        else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) ok = cli_parse_int(a, v, 1, 256, &n_threads);
        else if (!strcmp(a, "--layers")) ok = cli_parse_int(a, v, 1, 1000, &n_layers);
        else return cli_fail("unknown option '%s' for gen-model (see 'kvq gen-model --help')", a);
        if (!ok) return 1;
    }
    if (!shape_name)
        return cli_fail("gen-model needs --shape (llama3-8b, llama3-70b, mistral-7b, qwen2.5-0.5b, qwen2.5-7b, "
                        "qwen2.5-72b, gemma3-4b, gemma3-12b)");
    if (!type_name) return cli_fail("gen-model needs --type (f16, q8_0, q4_0, q4_k, q6_k, q4_k_m)");
    if (!out) return cli_fail("gen-model needs an output file: -o FILE");
    const struct shape *sh = NULL;
    for (size_t i = 0; i < N_SHAPES; i++)
        if (!strcmp(shapes[i].name, shape_name)) sh = &shapes[i];
    if (!sh)
        return cli_fail("unknown shape '%s' (expected llama3-8b, llama3-70b, mistral-7b, qwen2.5-0.5b, qwen2.5-7b, "
                        "qwen2.5-72b, gemma3-4b or gemma3-12b)", shape_name);
    uint32_t type;
    int ftype; /* llama.cpp's general.file_type */
    bool mix_m = false; /* q4_k_m */
    if (!strcmp(type_name, "f16")) type = KVQ_F16, ftype = 1;
    else if (!strcmp(type_name, "q8_0")) type = KVQ_Q8_0, ftype = 7;
    else if (!strcmp(type_name, "q4_0")) type = KVQ_Q4_0, ftype = 2;
    else if (!strcmp(type_name, "q4_k")) type = KVQ_Q4_K, ftype = 14; /* Q4_K_S: all q4_K */
    else if (!strcmp(type_name, "q6_k")) type = KVQ_Q6_K, ftype = 18;
    else if (!strcmp(type_name, "q4_k_m")) type = KVQ_Q4_K, ftype = 15, mix_m = true;
    else return cli_fail("unknown type '%s' (expected f16, q8_0, q4_0, q4_k, q6_k or q4_k_m)", type_name);
    if (n_threads <= 0) n_threads = kvq_online_cpus();
    if (n_threads > 256) n_threads = 256;
    int n_layer = n_layers > 0 ? n_layers : sh->n_layer;
    int hd = sh->head_dim ? sh->head_dim : sh->n_embd / sh->n_head, nq = sh->n_head * hd, nkv = sh->n_head_kv * hd;
    const bool gemma = !strcmp(sh->arch, "gemma3");

    struct gen g = {0};
    g.seed = seed;
    g.n_threads = n_threads;
    g.t = calloc((size_t)n_layer * 13 + 4, sizeof *g.t);
    struct gguf_writer *w = gguf_writer_new();
    char **tok = calloc((size_t)sh->n_vocab, sizeof *tok);
    float *scores = malloc(sizeof(float) * (size_t)sh->n_vocab);
    int32_t *types = malloc(sizeof(int32_t) * (size_t)sh->n_vocab);
    char *blob = malloc((size_t)sh->n_vocab * 16);
    int rc = 1;
    if (!g.t || !w || !tok || !scores || !types || !blob) {
        cli_fail("out of memory");
        goto done;
    }

    /* Metadata. */
    const char *a = sh->arch;
    char key[128], name[96];
#define K(s) (snprintf(key, sizeof key, "%s.%s", a, s), key)
    gguf_writer_add_str(w, "general.architecture", a);
    snprintf(name, sizeof name, "random %s (kvq gen-model, seed %llu)", sh->hf_name, (unsigned long long)seed);
    gguf_writer_add_str(w, "general.name", name);
    gguf_writer_add_u32(w, "general.file_type", (uint32_t)ftype);
    gguf_writer_add_u32(w, "general.quantization_version", 2);
    gguf_writer_add_u32(w, K("context_length"), (uint32_t)sh->n_ctx);
    gguf_writer_add_u32(w, K("embedding_length"), (uint32_t)sh->n_embd);
    gguf_writer_add_u32(w, K("block_count"), (uint32_t)n_layer);
    gguf_writer_add_u32(w, K("feed_forward_length"), (uint32_t)sh->n_ff);
    gguf_writer_add_u32(w, K("attention.head_count"), (uint32_t)sh->n_head);
    gguf_writer_add_u32(w, K("attention.head_count_kv"), (uint32_t)sh->n_head_kv);
    if (sh->head_dim) {
        gguf_writer_add_u32(w, K("attention.key_length"), (uint32_t)hd);
        gguf_writer_add_u32(w, K("attention.value_length"), (uint32_t)hd);
    }
    if (sh->n_swa) gguf_writer_add_u32(w, K("attention.sliding_window"), (uint32_t)sh->n_swa);
    gguf_writer_add_f32(w, K("attention.layer_norm_rms_epsilon"), sh->rms_eps);
    gguf_writer_add_f32(w, K("rope.freq_base"), sh->rope_theta);
    gguf_writer_add_u32(w, K("rope.dimension_count"), (uint32_t)hd);
    if (sh->rope_linear) {
        gguf_writer_add_str(w, K("rope.scaling.type"), "linear");
        gguf_writer_add_f32(w, K("rope.scaling.factor"), sh->rope_linear);
    }
    if (!strcmp(a, "llama")) gguf_writer_add_u32(w, K("vocab_size"), (uint32_t)sh->n_vocab);

    /* Placeholder SPM vocabulary. */
    char *bp = blob;
    int nv = 0;
#define ADD_TOK(str, score, type_)                \
    do {                                          \
        size_t l_ = strlen(str);                  \
        memcpy(bp, str, l_ + 1);                  \
        tok[nv] = bp;                             \
        bp += l_ + 1;                             \
        scores[nv] = (score);                     \
        types[nv] = (type_);                      \
        nv++;                                     \
    } while (0)
    ADD_TOK("<unk>", 0.0f, 2);
    ADD_TOK("<s>", 0.0f, 3);
    ADD_TOK("</s>", 0.0f, 3);
    for (int b = 0; b < 256; b++) {
        char s[8];
        snprintf(s, sizeof s, "<0x%02X>", b);
        ADD_TOK(s, 0.0f, 6);
    }
    ADD_TOK("\xe2\x96\x81", -1.0f, 1);
    for (int c = 0x21; c < 0x7f; c++) {
        char s[2] = {(char)c, 0};
        ADD_TOK(s, -2.0f - (float)c, 1);
    }
    while (nv < sh->n_vocab) {
        char s[16];
        snprintf(s, sizeof s, "<p%d>", nv);
        ADD_TOK(s, -1000.0f - (float)nv, 1);
    }
    gguf_writer_add_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_add_str(w, "tokenizer.ggml.pre", "default");
    gguf_writer_add_str_arr(w, "tokenizer.ggml.tokens", (const char *const *)tok, (uint64_t)nv);
    gguf_writer_add_arr(w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores, (uint64_t)nv);
    gguf_writer_add_arr(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, (uint64_t)nv);
    gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", 1);
    gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", 2);
    gguf_writer_add_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    gguf_writer_add_bool(w, "tokenizer.ggml.add_bos_token", true);
    gguf_writer_add_bool(w, "tokenizer.ggml.add_eos_token", false);

    /* Tensors, in llama.cpp's names and order. */
    add_t(&g, "token_embd.weight", 2, (uint64_t)sh->n_embd, (uint64_t)sh->n_vocab, type, INIT_NORMAL);
    for (int il = 0; il < n_layer; il++) {
        char n[64];
        const uint32_t more = mix_m && q4_k_m_more_bits(il, n_layer) ? KVQ_Q6_K : type;
#define T(s, dims, e0, e1, init) T_AS(s, dims, e0, e1, type, init)
#define T_AS(s, dims, e0, e1, ty, init)                               \
    do {                                                              \
        snprintf(n, sizeof n, "blk.%d.%s", il, s);                    \
        add_t(&g, n, dims, (uint64_t)(e0), (uint64_t)(e1), ty, init); \
    } while (0)
        T("attn_norm.weight", 1, sh->n_embd, 1, INIT_ONES);
        T("attn_q.weight", 2, sh->n_embd, nq, INIT_NORMAL);
        T("attn_k.weight", 2, sh->n_embd, nkv, INIT_NORMAL);
        T_AS("attn_v.weight", 2, sh->n_embd, nkv, more, INIT_NORMAL);
        if (gemma) {
            T("attn_q_norm.weight", 1, hd, 1, INIT_ONES);
            T("attn_k_norm.weight", 1, hd, 1, INIT_ONES);
        }
        if (sh->qkv_bias) {
            T("attn_q.bias", 1, nq, 1, INIT_BIAS);
            T("attn_k.bias", 1, nkv, 1, INIT_BIAS);
            T("attn_v.bias", 1, nkv, 1, INIT_BIAS);
        }
        T("attn_output.weight", 2, nq, sh->n_embd, INIT_NORMAL);
        if (gemma) T("post_attention_norm.weight", 1, sh->n_embd, 1, INIT_ONES);
        T("ffn_norm.weight", 1, sh->n_embd, 1, INIT_ONES);
        T("ffn_gate.weight", 2, sh->n_embd, sh->n_ff, INIT_NORMAL);
        T("ffn_up.weight", 2, sh->n_embd, sh->n_ff, INIT_NORMAL);
        T_AS("ffn_down.weight", 2, sh->n_ff, sh->n_embd, more, INIT_NORMAL);
        if (gemma) T("post_ffw_norm.weight", 1, sh->n_embd, 1, INIT_ONES);
#undef T_AS
#undef T
    }
    add_t(&g, "output_norm.weight", 1, (uint64_t)sh->n_embd, 1, type, INIT_ONES);
    if (!sh->tied)
        add_t(&g, "output.weight", 2, (uint64_t)sh->n_embd, (uint64_t)sh->n_vocab, mix_m ? KVQ_Q6_K : type, INIT_NORMAL);

    uint64_t n_params = 0;
    int n_fallback = 0;
    for (int i = 0; i < g.n_t; i++) {
        struct gtensor *t = &g.t[i];
        gguf_writer_add_tensor(w, t->name, t->n_dims, t->ne, t->type, NULL);
        n_params += t->ne[0] * t->ne[1];
        g.total_bytes += kvq_dtype_row_bytes(t->type, t->ne[0]) * t->ne[1];
        n_fallback += t->n_dims == 2 && t->type == KVQ_Q8_0 && type != KVQ_Q8_0;
    }
    if (n_fallback)
        fprintf(stderr, "kvq: %d tensors have rows that are not a multiple of 256: written as q8_0\n", n_fallback);
    fprintf(stderr, "kvq: %s (%s), %d layers, %.3f B parameters, %s: %.2f GiB, %d threads\n", sh->name, sh->hf_name,
            n_layer, n_params / 1e9, type_name, g.total_bytes / 1073741824.0, n_threads);
    g.tty = isatty(STDERR_FILENO);
    g.t0 = cli_now();
    if (gguf_writer_write(w, out, fill_tensor, &g) != 0) {
        if (g.tty) fputc('\n', stderr);
        cli_fail("%s", kvq_last_error());
        goto done;
    }
    double el = cli_now() - g.t0;
    if (g.tty) fputc('\n', stderr);
    fprintf(stderr, "kvq: wrote %s: %llu parameters, %.2f GiB in %.1f s (%.0f MiB/s)\n", out,
            (unsigned long long)n_params, g.total_bytes / 1073741824.0, el, g.total_bytes / 1048576.0 / el);
    rc = 0;
done:
    gguf_writer_free(w);
    free(g.t);
    free(tok);
    free(scores);
    free(types);
    free(blob);
    return rc;
}
