/* avx2 variant of the KV kernels (temporary: forwards to scalar). */
#include "kernels/kv_quant_impl.h"

void kern_kvq_attn_avx2(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                        const struct kern_kv_rows *v, int n) {
    kern_kvq_attn_scalar(s, h0, nh, q, k, v, n);
}
void kern_kvq_unpack_avx2(const uint8_t *src, int n, int bits, uint8_t *out) { kern_kvq_unpack_scalar(src, n, bits, out); }
