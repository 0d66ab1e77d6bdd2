/* KIVI decode attention on CPU, straight from the packed cache (methods/kernels/kivi_cpu.py).

   The two halves of one decode step's attention over the quantized tokens, for every
   (batch row, KV head) `bh` and the g query heads that share it:
     kivi_key_scores:  scores[g, t] = sum_d q[g, d] * (code[d, t] * scale[d, t/G] + zero[d, t/G])
                       (keys quantized per channel, groups of G tokens; codes (D, T * bits / 8))
     kivi_value_out:   out[g, c]    = sum_t p[g, t] * (code[t, c] * scale[t, c/G] + zero[t, c/G])
                       (values quantized per token, groups of G channels; codes (T, D * bits / 8))
   Codes are unpacked one byte at a time through a 256-entry table into a few floats held in
   registers/L1 and used at once: the dequantized cache is never written anywhere. The scale is
   folded into the query (keys) or the probability (values) and the zero point into one bias per
   group, so the inner loop is a plain multiply-add over G contiguous floats.
   All float arrays are fp32; strides are in elements. Work is split over OpenMP threads. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PER_BYTE 8

static float lut[4][256][MAX_PER_BYTE]; /* [log2(bits)][byte][i] = i-th code of byte */

__attribute__((constructor)) static void build_tables(void) {
    for (int lb = 0; lb < 4; lb++) {
        int bits = 1 << lb, per = 8 / bits, mask = (1 << bits) - 1;
        for (int byte = 0; byte < 256; byte++)
            for (int i = 0; i < per; i++) lut[lb][byte][i] = (float)((byte >> (i * bits)) & mask);
    }
}

/* n_bytes packed bytes -> n_bytes * 8 / bits floats (element order). One fixed-size copy per
   byte (the width a compile-time constant in each case), so it compiles to plain vector moves. */
#define UNPACK_WITH(PER, LB)                                                                  \
    for (long j = 0; j < n_bytes; j++) memcpy(dst + j * PER, lut[LB][src[j]], PER * sizeof(float))
static inline void unpack(const uint8_t *src, long n_bytes, int bits, float *dst) {
    switch (bits) {
        case 1: UNPACK_WITH(8, 0); break;
        case 2: UNPACK_WITH(4, 1); break;
        case 4: UNPACK_WITH(2, 2); break;
        default: for (long j = 0; j < n_bytes; j++) dst[j] = (float)src[j];
    }
}

/* q (BH, g, D) [s_qbh, s_qg, 1]; codes (BH, D, bytes) [s_cbh, s_cd, 1];
   scale/zero (BH, D, n_groups) [s_sbh, s_sd, 1]; out (BH, g, n_groups * G) contiguous. */
void kivi_key_scores(const float *q, long s_qbh, long s_qg,
                     const uint8_t *codes, long s_cbh, long s_cd,
                     const float *scale, const float *zero, long s_sbh, long s_sd,
                     float *out, long bh, long g, long d, long n_groups, long group, int bits,
                     int threads) {
    const long group_bytes = group * bits / 8, tokens = n_groups * group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long item = 0; item < bh * n_groups; item++) {
        const long r = item / n_groups, n = item % n_groups;
        float codes_f[group], acc[g * group], bias[g];
        memset(acc, 0, sizeof(acc));
        memset(bias, 0, sizeof(bias));
        for (long c = 0; c < d; c++) {
            unpack(codes + r * s_cbh + c * s_cd + n * group_bytes, group_bytes, bits, codes_f);
            const float s = scale[r * s_sbh + c * s_sd + n], z = zero[r * s_sbh + c * s_sd + n];
            for (long h = 0; h < g; h++) {
                const float qv = q[r * s_qbh + h * s_qg + c], qs = qv * s;
                float *a = acc + h * group;
                bias[h] += qv * z;
                for (long t = 0; t < group; t++) a[t] += qs * codes_f[t];
            }
        }
        for (long h = 0; h < g; h++) {
            float *o = out + (r * g + h) * tokens + n * group;
            for (long t = 0; t < group; t++) o[t] = acc[h * group + t] + bias[h];
        }
    }
}

/* p (BH, g, T) [s_pbh, s_pg, 1]; codes (BH, T, D * bits / 8) [s_cbh, s_ct, 1];
   scale/zero (BH, T, D / G) [s_sbh, s_st, 1]; out (BH, g, D) contiguous (overwritten). */
void kivi_value_out(const float *p, long s_pbh, long s_pg,
                    const uint8_t *codes, long s_cbh, long s_ct,
                    const float *scale, const float *zero, long s_sbh, long s_st,
                    float *out, long bh, long g, long d, long tokens, long group, int bits,
                    int threads) {
    const long group_bytes = group * bits / 8, m_groups = d / group;
    /* Each work item sums one span of tokens of one head into its own partial; a fixed split
       (independent of the thread count) keeps the summation order, and the result, the same. */
    const long span = 512, spans = (tokens + span - 1) / span, items = bh * spans;
    float *partial = calloc((size_t)(items > 0 ? items : 1) * g * d, sizeof(float));
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long item = 0; item < items; item++) {
        const long r = item / spans, t0 = (item % spans) * span;
        const long t1 = t0 + span < tokens ? t0 + span : tokens;
        float *acc = partial + item * g * d, codes_f[group];
        for (long t = t0; t < t1; t++) {
            for (long m = 0; m < m_groups; m++) {
                unpack(codes + r * s_cbh + t * s_ct + m * group_bytes, group_bytes, bits,
                       codes_f);
                const float s = scale[r * s_sbh + t * s_st + m], z = zero[r * s_sbh + t * s_st + m];
                for (long h = 0; h < g; h++) {
                    const float pv = p[r * s_pbh + h * s_pg + t], ps = pv * s, pz = pv * z;
                    float *a = acc + h * d + m * group;
                    for (long c = 0; c < group; c++) a[c] += ps * codes_f[c] + pz;
                }
            }
        }
    }
    for (long r = 0; r < bh; r++) {
        float *o = out + r * g * d;
        memset(o, 0, sizeof(float) * g * d);
        for (long k = 0; k < spans; k++) {
            const float *a = partial + (r * spans + k) * g * d;
            for (long e = 0; e < g * d; e++) o[e] += a[e];
        }
    }
    free(partial);
}
