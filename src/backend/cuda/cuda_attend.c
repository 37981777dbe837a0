/* Attention over the caches' device blocks and windows: the host plans each
 * sequence's rows and uploads the plan; the tile kernels split rows on the device. */
#include "backend/cuda/cuda_private.h"

_Static_assert(sizeof(struct cuk_attn_args) == 16 * 4 + 4 * sizeof(size_t) + 8 * sizeof(void *) + sizeof(struct cuk_xq),
               "a kernel's argument structs have no padding (a recorded step's bytes would differ)");

void cuda_attention(struct backend *b, const struct be_attention *a, int n) {
    struct cuda_backend *cb = cuda(b);
    cb->xq_of = cb->x16_of = NULL;
    if (n <= 0 || cb->failed) return;
    step_op(cb, n, false);
    const int D = a->head_dim;
    double t0 = prof_begin(cb);
    if (!cuk_attention_head_dim_supported(D)) {
        snprintf(cb->failure, sizeof cb->failure, "the CUDA attention kernels take head sizes 64, 128 and 256, not %d", D);
        cb->failed = true;
        return;
    }
    if (cb->cap_uc < n) {
        free(cb->uc);
        free(cb->uc_mirror);
        free(cb->uc_chunk);
        cb->uc = malloc(sizeof *cb->uc * (size_t)n);
        cb->uc_mirror = malloc(sizeof *cb->uc_mirror * (size_t)n);
        cb->uc_chunk = malloc(sizeof *cb->uc_chunk * (size_t)n);
        cb->cap_uc = cb->uc && cb->uc_mirror && cb->uc_chunk ? n : 0;
        if (!cb->cap_uc) {
            ck(cb, cudaErrorMemoryAllocation, "host memory");
            return;
        }
    }
    size_t need = cuk_attention_scratch_floats(cb->max_tokens > n ? cb->max_tokens : n, a->n_head, D, cb->n_sm);
    if (!grow_floats(cb, &cb->part, &cb->part_floats, need, "device memory for attention")) return;
    /* each sequence's cache once: its block table, its windows */
    int nu = 0;
    struct kv_view views[MAX_FORMATS];
    int n_fmt = 0;
    for (int t = 0; t < n; t++) {
        if (nu > 0 && cb->uc[nu - 1] == a->caches[t]) continue;
        struct kv_cache *c = a->caches[t];
        struct kv_view v;
        kv_cache_view(c, &v);
        int run = 1; /* its tokens, consecutive */
        while (t + run < n && a->caches[t + run] == c) run++;
        struct cuda_mirror *m = v.windows ? sync_windows(cb, c, &v, kv_cache_n_past(c), run) : mirror_of(cb, c);
        if (!m || !sync_table(cb, m, &v)) return;
        cb->uc[nu] = c;
        cb->uc_mirror[nu++] = m;
        int f = 0;
        while (f < n_fmt && !same_format(&views[f], &v)) f++;
        if (f == n_fmt) {
            if (n_fmt == MAX_FORMATS) {
                ck(cb, cudaErrorNotSupported, "more than 4 KV formats in one batch");
                return;
            }
            views[n_fmt++] = v;
        }
    }
    /* row by row only when every block of the batch has the one layout */
    if (sync_blocks(cb, kv_cache_pool(a->caches[0]), &views[0], a->n_kv, n_fmt == 1) != 0) {
        ck(cb, cudaErrorMemoryAllocation, kvq_last_error());
        return;
    }
    /* chunks: runs of consecutive positions of one sequence (a prefill), up to
     * chunk_max tokens, which the tensor-core kernel attends together (the union of
     * their rows, each token masked to its own: sliding and rotating windows too);
     * uc_chunk[t] is the length of the chunk starting at t, else 0 */
    const int chunk_max = cuk_attn_tile_chunk(a->n_head / a->n_kv, D);
    for (int t = 0; t < n;) {
        const struct kv_cache *c = a->caches[t];
        int len = 1;
        while (len < chunk_max && t + len < n && a->caches[t + len] == c && a->pos[t + len] == a->pos[t] + len)
            len++;
        cb->uc_chunk[t] = len;
        for (int i = 1; i < len; i++) cb->uc_chunk[t + i] = 0;
        t += len;
    }
    /* the tokens' plans by row format, and in each first the single tokens, then the
     * chunks: a launch each */
    size_t toks_off = stage_alloc(cb, sizeof(struct cuk_attn_tok) * (size_t)n);
    size_t idx_off = stage_alloc(cb, sizeof(int32_t) * (size_t)n);
    size_t grp_off = stage_alloc(cb, sizeof(struct cuk_attn_group) * (size_t)n);
    if (toks_off == (size_t)-1 || idx_off == (size_t)-1 || grp_off == (size_t)-1) return;
    struct {
        int fmt, tok0, n_tok, grp0, n_grp, max_group;
    } sets[2 * MAX_FORMATS];
    int n_sets = 0, k = 0, ng = 0, attn_rows = 0;
    for (int f = 0; f < n_fmt; f++)
        for (int chunks = 0; chunks < 2; chunks++) {
            sets[n_sets].fmt = f;
            sets[n_sets].tok0 = k;
            sets[n_sets].grp0 = ng;
            sets[n_sets].max_group = 1;
            int u = -1, run0 = 0; /* a sequence's tokens are consecutive: run0 its first */
            for (int t = 0; t < n; t++) {
                if (u < 0 || cb->uc[u] != a->caches[t]) u++, run0 = t;
                const int len = cb->uc_chunk[t];
                if (len == 0 || (len > 1) != (chunks == 1)) continue;
                struct kv_view v;
                kv_cache_view(a->caches[t], &v);
                if (!same_format(&views[f], &v)) continue;
                ((struct cuk_attn_group *)(cb->stage_h + grp_off))[ng++] =
                    (struct cuk_attn_group){k - sets[n_sets].tok0, len};
                if (len > sets[n_sets].max_group) sets[n_sets].max_group = len;
                for (int i = t; i < t + len; i++, k++) {
                    struct kv_cache *c = a->caches[i];
                    struct kv_query_plan pl;
                    kv_cache_query_plan(c, a->pos[i], &pl);
                    const int rows = plan_rows(&pl, a->pos[i]);
                    if (rows > attn_rows) attn_rows = rows;
                    const int32_t fe = kv_view_entry(&v, a->pos[run0]);
                    const struct kv_cache_config *cfg = kv_cache_get_config(c);
                    const struct kv_shape *sh = kv_cache_get_shape(c);
                    const struct cuda_mirror *m = cb->uc_mirror[u], *w = m->win ? m : NULL;
                    struct cuk_attn_tok *tk = (struct cuk_attn_tok *)(cb->stage_h + toks_off) + k;
                    *tk = (struct cuk_attn_tok){
                        .q_pos = a->pos[i], .a1 = pl.a1, .b1 = pl.b1, .a2 = pl.a2, .b2 = pl.b2, .sinks = pl.sinks,
                        .ws = pl.ws, .fresh = a->pos[run0], .max_size = cfg->max_size, .keep = cfg->keep,
                        .window = sh->window,
                        .nkb = v.nkb, .base = v.base, .table = (uint64_t)(uintptr_t)m->table_d,
                        .fresh_block = fe >= 0 && fe < v.n_blk && v.blk[fe] ? (uint64_t)(uintptr_t)block_dev(cb, v.blk[fe]) : 0,
                        .ring_cap = w ? w->ring_cap : 1, .sink_cap = w ? w->sink_cap : 1,
                        .ring = w ? (uint64_t)(uintptr_t)w->win : 0,
                        .sink = w ? (uint64_t)(uintptr_t)w->sink : 0,
                        .mu = w && w->has_mu ? (uint64_t)(uintptr_t)w->mu : 0,
                    };
                    ((int32_t *)(cb->stage_h + idx_off))[k] = i;
                }
            }
            sets[n_sets].n_tok = k - sets[n_sets].tok0;
            sets[n_sets].n_grp = ng - sets[n_sets].grp0;
            if (sets[n_sets].n_tok > 0) n_sets++;
        }
    flush_copies(cb);
    /* the queries as this layer's KV append prepared them (its buffer had room for n) */
    const bool prepped = cb->qprep_of == a->q && cb->qprep_n == n && cb->qprep_scale == a->scale;
    cb->qprep_of = NULL;
    if (ensure_signs(cb, D, views[0].signs) != 0 || !ensure_qprep(cb, n, a->n_head, D)) return;
    const float *signs = cb->signs;
    const struct cuk_xq *xq = product_input(cb, a->out, n, (int64_t)a->n_head * D);
    float *const out = product_f32(cb, a->out, n);
    prof_end(cb, P_ATTN_HOST, t0);
    t0 = prof_begin(cb);
    for (int i = 0; i < n_sets && !cb->failed; i++) {
        const struct kv_view *v = &views[sets[i].fmt];
        struct cuk_attn_args args = {
            .k_bits = v->k_bits, .k_group = v->k_group, .v_bits = v->v_bits, .v_group = v->v_group,
            .k_rot = v->k_rot, .v_rot = v->v_rot, .k_row = v->k_row, .v_row = v->v_row,
            .head_bytes = v->head_bytes, .win_row = v->win_row,
            .n_head = a->n_head, .n_kv = a->n_kv, .head_dim = D, .scale = a->scale,
            .signs = signs, .q = a->q, .out = out,
            .toks = (const struct cuk_attn_tok *)(cb->stage_d + toks_off) + sets[i].tok0,
            .tok_index = (const int32_t *)(cb->stage_d + idx_off) + sets[i].tok0,
            .n = sets[i].n_tok,
            .groups = (const struct cuk_attn_group *)(cb->stage_d + grp_off) + sets[i].grp0,
            .n_groups = sets[i].n_grp, .max_group = sets[i].max_group,
            .partial = cb->part, .n_sm = cb->n_sm,
            .xq = xq ? *xq : (struct cuk_xq){0},
            .qprep = cb->qprep, .q_prepped = prepped,
        };
        cuk_attention(&cb->q, &args);
    }
    cb->q.attn_rows = attn_rows;
    cb->q.after_attn = true;
    prof_end(cb, P_ATTN_GPU, t0);
}
