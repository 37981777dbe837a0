/* The tensor-core attention kernel's launches (attention_tile.cuh) for head sizes 64
 * and 128, and which launches it takes. */
#include "backend/cuda/attention_tile.cuh"

bool attn_tile_prepped(const cuk_attn_args *a) { return a->k_rot || a->k_bits < 16; }

bool attn_tile_takes(const cuk_attn_args *a) {
    const int D = a->head_dim, kb = a->k_bits, vb = a->v_bits;
    /* normal-float rows: K5V4, K4V4, K4V3 and K3V2, on any byte boundary (a block comes
     * to shared memory as it lies) */
    const bool nf = a->k_group == KERN_KVQ_NF && a->v_group == KERN_KVQ_NF &&
                    ((kb == 5 && vb == 4) || (kb == 4 && vb == 4) || (kb == 4 && vb == 3) || (kb == 3 && vb == 2));
    /* groups a k-step stays inside, at most 4 (scale, bias) words a thread; rows on the
     * boundaries the loads need */
    const bool groups_ok = nf || (kb == 16 && vb == 16) ||
                           ((a->k_group == 32 || a->k_group == 64) && a->v_group == a->k_group &&
                            TILE * (D / a->k_group) <= 4 * TILE_THREADS);
    const size_t k_row = kern_kvq_row_bytes(kb, a->k_group, D), v_row = kern_kvq_row_bytes(vb, a->v_group, D);
    const bool rows = a->k_row == k_row && a->v_row == v_row && a->head_bytes == TILE * (k_row + v_row); /* row_bytes<> */
    const bool aligned = (nf || (k_row % 8 == 0 && v_row % 8 == 0)) && a->head_bytes % 16 == 0 && a->win_row % 16 == 0;
    const bool formats = nf || (kb == 16 && vb == 16) || (kb == 8 && (vb == 8 || vb == 4)) || (kb == 4 && vb == 4);
    return formats && groups_ok && rows && aligned && (D == 64 || D == 128 || D == 256) && a->n_head % a->n_kv == 0 &&
           cuk_attn_tile_rows(a->n_head / a->n_kv) > 0 && a->n_groups > 0 && a->max_group <= 32;
}

int attn_tile_launch(cuk_queue *qu, const cuk_attn_args *a) {
    switch (a->head_dim) {
    case 64: return launch_formats<64>(qu, a);
    case 128: return launch_formats<128>(qu, a);
    default: return attn_tile_launch_256(qu, a);
    }
}
