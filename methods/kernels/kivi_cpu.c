/* KIVI decode attention on CPU, straight from the packed cache (methods/kernels/kivi_cpu.py).

   One decode query row per head attends over T tokens whose keys and values come in two
   segments each (KIVI's layout, methods/kernels/kivi_attention.py), for every (batch row, KV
   head) `bh` and the g query heads sharing it:
     keys    [0, T_qk): codes per channel `(D, T_qk * bits / 8)`, fp16 scale/zero `(D, T_qk / G)`:
             k[d, t] = code * scale[d, t / G] + zero[d, t / G];  [T_qk, T): fp32 `(T - T_qk, D)`
     values  [0, T_qv): codes per token `(T_qv, D * bits / 8)`, fp16 scale/zero `(T_qv, D / G)`:
             v[t, c] = code * scale[t, c / G] + zero[t, c / G];  [T_qv, T): fp32 `(T - T_qv, D)`
   out[g] = softmax(q[g] K^T * scaling) V, the softmax exact over all T scores.

   Codes are unpacked one byte at a time through a 256-entry table into a few floats held in
   L1 and used at once: the dequantized cache is never written anywhere. The scale is folded into
   the query (keys) or the probability (values) and the zero point into one term per group, so
   the inner loops are plain multiply-adds over contiguous floats. Everything runs in one OpenMP
   parallel region (one wake-up of the worker threads per call): key scores by (head, group),
   softmax by row, p.V by (head, span of tokens) into partials summed in a fixed order, so the
   result does not depend on the thread count. Strides are in elements; last axes are unit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#define MAX_PER_BYTE 8
#define SPAN_TOKENS 512 /* tokens per p.V work item */
#define RES_CHUNK 64    /* residual key tokens per score work item */

static float lut[4][256][MAX_PER_BYTE]; /* [log2(bits)][byte][i] = i-th code of byte */

__attribute__((constructor)) static void build_tables(void) {
    for (int lb = 0; lb < 4; lb++) {
        int bits = 1 << lb, per = 8 / bits, mask = (1 << bits) - 1;
        for (int byte = 0; byte < 256; byte++)
            for (int i = 0; i < per; i++) lut[lb][byte][i] = (float)((byte >> (i * bits)) & mask);
    }
}

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) { /* zero or subnormal */
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000 | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
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

typedef struct {
    const float *q; long s_qbh, s_qg;                        /* (BH, g, D) */
    const uint8_t *kc; long s_kcbh, s_kcd;                   /* (BH, D, T_qk * k_bits / 8) */
    const uint16_t *ks, *kz; long s_ksbh, s_ksd;             /* (BH, D, T_qk / k_group) */
    const float *kr; long s_krbh, s_krt;                     /* (BH, T - T_qk, D) */
    const uint8_t *vc; long s_vcbh, s_vct;                   /* (BH, T_qv, D * v_bits / 8) */
    const uint16_t *vs, *vz; long s_vsbh, s_vst;             /* (BH, T_qv, D / v_group) */
    const float *vr; long s_vrbh, s_vrt;                     /* (BH, T - T_qv, D) */
    float *out;                                              /* (BH, g, D) */
    long bh, g, d, tokens, t_qk, t_qv, k_group, v_group;
    int k_bits, v_bits;
    float scaling;
} Args;

/* scores[r, h, n*G : (n+1)*G] for quantized key group n. */
static void key_group_scores(const Args *a, long r, long n, float *scores) {
    const long g = a->g, group = a->k_group, group_bytes = group * a->k_bits / 8;
    float codes_f[group], acc[g * group], bias[g];
    memset(acc, 0, sizeof(acc));
    memset(bias, 0, sizeof(bias));
    for (long c = 0; c < a->d; c++) {
        unpack(a->kc + r * a->s_kcbh + c * a->s_kcd + n * group_bytes, group_bytes, a->k_bits,
               codes_f);
        const long sz = r * a->s_ksbh + c * a->s_ksd + n;
        const float s = half_to_float(a->ks[sz]), z = half_to_float(a->kz[sz]);
        for (long h = 0; h < g; h++) {
            const float qv = a->q[r * a->s_qbh + h * a->s_qg + c] * a->scaling, qs = qv * s;
            float *acc_h = acc + h * group;
            bias[h] += qv * z;
            for (long t = 0; t < group; t++) acc_h[t] += qs * codes_f[t];
        }
    }
    for (long h = 0; h < g; h++) {
        float *o = scores + (r * g + h) * a->tokens + n * group;
        for (long t = 0; t < group; t++) o[t] = acc[h * group + t] + bias[h];
    }
}

/* scores of residual key tokens [t0, t1) (indices into the residual). */
static void residual_scores(const Args *a, long r, long t0, long t1, float *scores) {
    for (long h = 0; h < a->g; h++) {
        const float *q = a->q + r * a->s_qbh + h * a->s_qg;
        float *o = scores + (r * a->g + h) * a->tokens + a->t_qk;
        for (long t = t0; t < t1; t++) {
            const float *k = a->kr + r * a->s_krbh + t * a->s_krt;
            float dot = 0.f;
            for (long c = 0; c < a->d; c++) dot += q[c] * k[c];
            o[t] = dot * a->scaling;
        }
    }
}

static void softmax_row(float *x, long n) {
    float top = x[0], sum = 0.f; /* n >= 1; no infinities (built with -ffast-math) */
    for (long i = 1; i < n; i++) top = x[i] > top ? x[i] : top;
    for (long i = 0; i < n; i++) sum += (x[i] = expf(x[i] - top));
    const float inv = 1.f / sum;
    for (long i = 0; i < n; i++) x[i] *= inv;
}

/* acc (g, D) += p[:, t0:t1] V[t0:t1] over both value segments. */
static void value_span(const Args *a, long r, long t0, long t1, const float *probs, float *acc) {
    const long g = a->g, d = a->d, group = a->v_group, group_bytes = group * a->v_bits / 8;
    const long m_groups = d / group, q_end = t1 < a->t_qv ? t1 : a->t_qv;
    float codes_f[group];
    for (long t = t0; t < q_end; t++) {
        for (long m = 0; m < m_groups; m++) {
            unpack(a->vc + r * a->s_vcbh + t * a->s_vct + m * group_bytes, group_bytes,
                   a->v_bits, codes_f);
            const long sz = r * a->s_vsbh + t * a->s_vst + m;
            const float s = half_to_float(a->vs[sz]), z = half_to_float(a->vz[sz]);
            for (long h = 0; h < g; h++) {
                const float p = probs[(r * g + h) * a->tokens + t], ps = p * s, pz = p * z;
                float *acc_h = acc + h * d + m * group;
                for (long c = 0; c < group; c++) acc_h[c] += ps * codes_f[c] + pz;
            }
        }
    }
    for (long t = t0 > a->t_qv ? t0 : a->t_qv; t < t1; t++) {
        const float *v = a->vr + r * a->s_vrbh + (t - a->t_qv) * a->s_vrt;
        for (long h = 0; h < g; h++) {
            const float p = probs[(r * g + h) * a->tokens + t];
            float *acc_h = acc + h * d;
            for (long c = 0; c < d; c++) acc_h[c] += p * v[c];
        }
    }
}

static void decode(const Args *a, int threads) {
    const long n_groups = a->t_qk / a->k_group, res = a->tokens - a->t_qk;
    const long res_chunks = (res + RES_CHUNK - 1) / RES_CHUNK;
    const long spans = (a->tokens + SPAN_TOKENS - 1) / SPAN_TOKENS, rows = a->bh * a->g;
    float *scores = malloc(sizeof(float) * (size_t)(rows * a->tokens > 0 ? rows * a->tokens : 1));
    float *partial = calloc((size_t)(a->bh * spans * a->g * a->d + 1), sizeof(float));
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (long item = 0; item < a->bh * n_groups; item++)
            key_group_scores(a, item / n_groups, item % n_groups, scores);
#pragma omp for schedule(static)
        for (long item = 0; item < a->bh * res_chunks; item++) {
            const long t0 = (item % res_chunks) * RES_CHUNK;
            residual_scores(a, item / res_chunks, t0, t0 + RES_CHUNK < res ? t0 + RES_CHUNK : res,
                            scores);
        }
#pragma omp for schedule(static)
        for (long row = 0; row < rows; row++) softmax_row(scores + row * a->tokens, a->tokens);
#pragma omp for schedule(static)
        for (long item = 0; item < a->bh * spans; item++) {
            const long t0 = (item % spans) * SPAN_TOKENS;
            value_span(a, item / spans, t0, t0 + SPAN_TOKENS < a->tokens ? t0 + SPAN_TOKENS
                                                                          : a->tokens,
                       scores, partial + item * a->g * a->d);
        }
    }
    for (long r = 0; r < a->bh; r++) {
        float *o = a->out + r * a->g * a->d;
        memset(o, 0, sizeof(float) * a->g * a->d);
        for (long k = 0; k < spans; k++) {
            const float *p = partial + (r * spans + k) * a->g * a->d;
            for (long e = 0; e < a->g * a->d; e++) o[e] += p[e];
        }
    }
    free(scores);
    free(partial);
}

/* The entry point (ctypes): pointers, then strides and sizes as longs (see Args). */
void kivi_decode_attention(const float *q, long s_qbh, long s_qg,
                           const uint8_t *kc, long s_kcbh, long s_kcd,
                           const uint16_t *ks, const uint16_t *kz, long s_ksbh, long s_ksd,
                           const float *kr, long s_krbh, long s_krt,
                           const uint8_t *vc, long s_vcbh, long s_vct,
                           const uint16_t *vs, const uint16_t *vz, long s_vsbh, long s_vst,
                           const float *vr, long s_vrbh, long s_vrt,
                           float *out, long bh, long g, long d, long tokens, long t_qk, long t_qv,
                           long k_group, long v_group, int k_bits, int v_bits, float scaling,
                           int threads) {
    const Args a = {q, s_qbh, s_qg, kc, s_kcbh, s_kcd, ks, kz, s_ksbh, s_ksd, kr, s_krbh, s_krt,
                    vc, s_vcbh, s_vct, vs, vz, s_vsbh, s_vst, vr, s_vrbh, s_vrt, out,
                    bh, g, d, tokens, t_qk, t_qv, k_group, v_group, k_bits, v_bits, scaling};
    decode(&a, threads);
}
