/* KVQuant decode attention on CPU, straight from the packed codes (methods/kernels/kvquant_cpu.py).

   One decode query row per head (g query heads per KV head h) over T = T0 + T_q tokens of one
   sequence (layout: methods/kernels/kvquant_attention.py):
     [0, T0)  exact post-RoPE keys / values, fp32 `(H, T0, D)`;
     [T0, T)  codes as a little-endian bit stream per token, keys `(H, T_q, D * k_bits / 8)`,
              values `(H, T_q, D * v_bits / 8)`:
                k_pre[c] = key_codebook[code] * key_scale[h, c] + key_zero[h, c]
                v[c]     = value_codebook[code] * v_scale[t] + v_zero[t]      (fp16 per token)
              then the sparse outliers (sorted by token: position int32, lane = h * D + c int16,
              value fp16) replace their elements, and the key of position p is rotated by the
              rotate-half RoPE with the table row p (cos, sin `(P, D/2)` fp32).
   out[g] = softmax(q[g] K^T * scaling) V, the softmax exact over all T scores.

   Keys are handled in blocks of BLOCK tokens: the block's codes are looked up (a 256-entry table
   of codebook values per byte at 2 and 4 bits; 8 codes per 3 bytes at 3 bits) and dequantized
   into a small buffer that stays in L1, the block's outliers (a pointer walking the sorted list)
   written in, each key rotated once with its table row and dotted with the g queries; nothing
   the size of the cache is ever written. Values likewise, accumulated into p.V. One OpenMP
   region per call: key scores by span of tokens (all heads of a token share its table row),
   softmax by row, p.V by span into partials summed in a fixed order, so the result does not
   depend on the thread count. Strides are in elements; last axes are unit.

   With AVX-512 (and D a multiple of 32) a vector path replaces the blocks: 16 codes at a time
   become codebook values with one in-register table lookup (vpermps), the key is dequantized,
   rotated and dotted in registers, the value codes accumulate into p.V with the per-token scale
   folded into the probability; the outliers are then added as corrections, (value - its dense
   dequantization) times the RoPE-weighted query (keys, as the official SpMV) or the probability
   (values). `vector` = 0 forces the portable path (tests run both). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLOCK 16        /* tokens dequantized at a time (per head) */
#define SPAN_TOKENS 256 /* tokens per work item */

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

typedef struct {
    const int32_t *token; const int16_t *lane; const uint16_t *value; long n;
} Sparse;

typedef struct {
    const uint8_t *codes; long s_h, s_t; /* (H, T_q, D * bits / 8) */
    int bits;
    const float *codebook;               /* (2^bits,) */
    float lut[256 * 4];                  /* 2 and 4 bits: the codebook values of each byte */
    float table[16];                     /* the codebook, zero-padded (vector path) */
    Sparse out;
} Codes;

typedef struct {
    const float *q;                       /* (H, g, D) */
    const float *ek, *ev; long s_ekh, s_ekt, s_evh, s_evt; /* (H, T0, D) */
    Codes k, v;
    const float *ks, *kz;                 /* (H, D) */
    const uint16_t *vs, *vz; long s_vst;  /* (T_q,) */
    const float *cos_, *sin_;             /* (P, D/2) */
    float *out;                           /* (H, g, D) */
    long h, g, d, t0, tq, tokens;
    float scaling;
    int vector;                           /* 1: the AVX-512 path where it applies */
} Args;

static void build_lut(Codes *c) {
    memset(c->table, 0, sizeof c->table);
    memcpy(c->table, c->codebook, sizeof(float) * (size_t)(1 << c->bits));
    if (c->bits != 2 && c->bits != 4) return;
    const int per = 8 / c->bits, mask = (1 << c->bits) - 1;
    for (int byte = 0; byte < 256; byte++)
        for (int i = 0; i < per; i++) c->lut[byte * per + i] = c->codebook[(byte >> (i * c->bits)) & mask];
}

/* The codebook values of one row of d codes. */
static inline void lookup_row(const Codes *c, const uint8_t *src, long d, float *dst) {
    switch (c->bits) {
        case 2:
            for (long j = 0; j < d / 4; j++) memcpy(dst + 4 * j, c->lut + 4 * src[j], 4 * sizeof(float));
            break;
        case 4:
            for (long j = 0; j < d / 2; j++) memcpy(dst + 2 * j, c->lut + 2 * src[j], 2 * sizeof(float));
            break;
        default: /* 3 bits: 8 codes in every 3 bytes (d is a multiple of 8) */
            for (long j = 0; j < d / 8; j++) {
                const uint32_t w = src[3 * j] | (uint32_t)src[3 * j + 1] << 8 | (uint32_t)src[3 * j + 2] << 16;
                for (int i = 0; i < 8; i++) dst[8 * j + i] = c->codebook[(w >> (3 * i)) & 7];
            }
    }
}

/* Code c of a row of d codes (a little-endian bit stream). */
static inline int code_at(const uint8_t *row, long c, long d, int bits) {
    const long bit = c * bits, byte = bit >> 3;
    const uint32_t w = row[byte] | (byte + 1 < d * bits / 8 ? (uint32_t)row[byte + 1] << 8 : 0u);
    return (int)((w >> (bit & 7)) & ((1u << bits) - 1));
}

/* First index of the sorted positions with position >= p, searching [lo, n). */
static long lower_bound(const Sparse *s, long lo, long p) {
    long hi = s->n;
    while (lo < hi) {
        const long mid = lo + (hi - lo) / 2;
        if (s->token[mid] < p) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* buf (n, d) of head h, tokens [p0, p0 + n): write in the outliers o in [lo, hi). */
static void patch(const Sparse *s, long lo, long hi, long h, long d, long p0, float *buf) {
    for (long o = lo; o < hi; o++) {
        const long lane = s->lane[o];
        if (lane / d == h) buf[(s->token[o] - p0) * d + lane % d] = half_to_float(s->value[o]);
    }
}

/* Dequantize tokens [i0, i0 + n) of head h into buf (n, d), outliers [lo, hi) written in. */
static void dequant_keys(const Args *a, long h, long i0, long n, long lo, long hi, float *buf) {
    const long d = a->d;
    const float *s = a->ks + h * d, *z = a->kz + h * d;
    for (long ti = 0; ti < n; ti++) {
        float *row = buf + ti * d;
        lookup_row(&a->k, a->k.codes + h * a->k.s_h + (i0 + ti) * a->k.s_t, d, row);
        for (long c = 0; c < d; c++) row[c] = row[c] * s[c] + z[c];
    }
    patch(&a->k.out, lo, hi, h, d, a->t0 + i0, buf);
}

static void dequant_values(const Args *a, long h, long i0, long n, long lo, long hi, float *buf) {
    const long d = a->d;
    for (long ti = 0; ti < n; ti++) {
        float *row = buf + ti * d;
        const float s = half_to_float(a->vs[(i0 + ti) * a->s_vst]);
        const float z = half_to_float(a->vz[(i0 + ti) * a->s_vst]);
        lookup_row(&a->v, a->v.codes + h * a->v.s_h + (i0 + ti) * a->v.s_t, d, row);
        for (long c = 0; c < d; c++) row[c] = row[c] * s + z;
    }
    patch(&a->v.out, lo, hi, h, d, a->t0 + i0, buf);
}

/* g dot products of the queries of head h with key k (d), scaled, into scores[., p]. */
static inline void score(const Args *a, long h, const float *k, long p, float *scores) {
    for (long gi = 0; gi < a->g; gi++) {
        const float *q = a->q + (h * a->g + gi) * a->d;
        float dot = 0.f;
        for (long c = 0; c < a->d; c++) dot += q[c] * k[c];
        scores[(h * a->g + gi) * a->tokens + p] = dot * a->scaling;
    }
}

/* Scores of the quantized tokens [i0, i1). */
static void key_span(const Args *a, long i0, long i1, float *scores) {
    const long d = a->d, half = d / 2;
    float buf[BLOCK * d], rot[d];
    long lo = lower_bound(&a->k.out, 0, a->t0 + i0);
    for (long b0 = i0; b0 < i1; b0 += BLOCK) {
        const long n = b0 + BLOCK < i1 ? BLOCK : i1 - b0;
        const long hi = lower_bound(&a->k.out, lo, a->t0 + b0 + n);
        for (long h = 0; h < a->h; h++) {
            dequant_keys(a, h, b0, n, lo, hi, buf);
            for (long ti = 0; ti < n; ti++) {
                const long p = a->t0 + b0 + ti;
                const float *x = buf + ti * d, *cs = a->cos_ + p * half, *sn = a->sin_ + p * half;
                for (long j = 0; j < half; j++) { /* rotate-half RoPE at position p */
                    rot[j] = x[j] * cs[j] - x[j + half] * sn[j];
                    rot[j + half] = x[j + half] * cs[j] + x[j] * sn[j];
                }
                score(a, h, rot, p, scores);
            }
        }
        lo = hi;
    }
}

/* acc (H, g, D) += p[:, i0:i1] V[i0:i1] over the quantized tokens. */
static void value_span(const Args *a, long i0, long i1, const float *probs, float *acc) {
    const long d = a->d;
    float buf[BLOCK * d];
    long lo = lower_bound(&a->v.out, 0, a->t0 + i0);
    for (long b0 = i0; b0 < i1; b0 += BLOCK) {
        const long n = b0 + BLOCK < i1 ? BLOCK : i1 - b0;
        const long hi = lower_bound(&a->v.out, lo, a->t0 + b0 + n);
        for (long h = 0; h < a->h; h++) {
            dequant_values(a, h, b0, n, lo, hi, buf);
            for (long gi = 0; gi < a->g; gi++) {
                const float *p = probs + (h * a->g + gi) * a->tokens + a->t0 + b0;
                float *o = acc + (h * a->g + gi) * d;
                for (long ti = 0; ti < n; ti++)
                    for (long c = 0; c < d; c++) o[c] += p[ti] * buf[ti * d + c];
            }
        }
        lo = hi;
    }
}

/* The exact tokens [0, T0): scores, then (after the softmax) their share of p.V. */
static void exact_scores(const Args *a, float *scores) {
    for (long h = 0; h < a->h; h++)
        for (long t = 0; t < a->t0; t++) score(a, h, a->ek + h * a->s_ekh + t * a->s_ekt, t, scores);
}

static void exact_values(const Args *a, const float *probs, float *acc) {
    for (long h = 0; h < a->h; h++)
        for (long gi = 0; gi < a->g; gi++) {
            float *o = acc + (h * a->g + gi) * a->d;
            for (long t = 0; t < a->t0; t++) {
                const float p = probs[(h * a->g + gi) * a->tokens + t];
                const float *v = a->ev + h * a->s_evh + t * a->s_evt;
                for (long c = 0; c < a->d; c++) o[c] += p * v[c];
            }
        }
}


/* The outliers as corrections of the dense scores / p.V of the quantized tokens [i0, i1):
   (value - the element's dense dequantization) times its coefficient. Keys: the RoPE-weighted
   query q[c] cos + q[c +- D/2] (+-sin) of channel c at the outlier's position. */
static void key_corrections(const Args *a, long i0, long i1, float *scores) {
    const Sparse *o = &a->k.out;
    const long d = a->d, half = d / 2, g = a->g;
    const long lo = lower_bound(o, 0, a->t0 + i0), hi = lower_bound(o, lo, a->t0 + i1);
    for (long e = lo; e < hi; e++) {
        const long p = o->token[e], i = p - a->t0, h = o->lane[e] / d, c = o->lane[e] % d;
        const int code = code_at(a->k.codes + h * a->k.s_h + i * a->k.s_t, c, d, a->k.bits);
        const float deq = a->k.codebook[code] * a->ks[h * d + c] + a->kz[h * d + c];
        const float delta = (half_to_float(o->value[e]) - deq) * a->scaling;
        const float cs = a->cos_[p * half + c % half], sn = a->sin_[p * half + c % half];
        for (long gi = 0; gi < g; gi++) {
            const float *q = a->q + (h * g + gi) * d;
            const float coef = c < half ? q[c] * cs + q[c + half] * sn : q[c] * cs - q[c - half] * sn;
            scores[(h * g + gi) * a->tokens + p] += coef * delta;
        }
    }
}

static void value_corrections(const Args *a, long i0, long i1, const float *probs, float *acc) {
    const Sparse *o = &a->v.out;
    const long d = a->d, g = a->g;
    const long lo = lower_bound(o, 0, a->t0 + i0), hi = lower_bound(o, lo, a->t0 + i1);
    for (long e = lo; e < hi; e++) {
        const long p = o->token[e], i = p - a->t0, h = o->lane[e] / d, c = o->lane[e] % d;
        const int code = code_at(a->v.codes + h * a->v.s_h + i * a->v.s_t, c, d, a->v.bits);
        const float deq = a->v.codebook[code] * half_to_float(a->vs[i * a->s_vst])
                          + half_to_float(a->vz[i * a->s_vst]);
        const float delta = half_to_float(o->value[e]) - deq;
        for (long gi = 0; gi < g; gi++)
            acc[(h * g + gi) * d + c] += probs[(h * g + gi) * a->tokens + p] * delta;
    }
}

#ifdef __AVX512F__
#define MAX_CHUNKS 16 /* d <= 256 */
#define MAX_GROUP 16  /* query heads per KV head */

/* Codebook indices of codes [c0, c0 + 16) of a packed row (c0 a multiple of 16). */
static inline __attribute__((always_inline)) __m512i code_index16(const uint8_t *row, long c0,
                                                                  const int bits) {
    if (bits == 4) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(row + c0 / 2)), m = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    }
    if (bits == 2) {
        uint32_t w;
        memcpy(&w, row + c0 / 4, sizeof w);
        const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                                 28, 30);
        return _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)w), shifts),
                                _mm512_set1_epi32(3));
    }
    uint32_t lo;
    uint16_t hi; /* 3 bits: 16 codes in 6 bytes; codes 0-7 in bits 0-23, codes 8-15 in 24-47 */
    memcpy(&lo, row + c0 / 16 * 6, sizeof lo);
    memcpy(&hi, row + c0 / 16 * 6 + 4, sizeof hi);
    const __m512i words = _mm512_mask_set1_epi32(_mm512_set1_epi32((int)lo), 0xff00,
                                                 (int)((lo >> 24) | (uint32_t)hi << 8));
    const __m512i shifts = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21);
    return _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(7));
}

/* `bits` a constant after inlining (one copy per width: no branch in the inner loops). */
static inline __attribute__((always_inline)) void key_span_bits(const Args *a, long i0, long i1,
                                                                float *scores, const int bits) {
    const long d = a->d, half = d / 2, nc = d / 16, nh = nc / 2, g = a->g;
    const __m512 table = _mm512_loadu_ps(a->k.table);
    __m512 x[MAX_CHUNKS], cs[MAX_CHUNKS / 2], sn[MAX_CHUNKS / 2], acc[MAX_GROUP];
    for (long i = i0; i < i1; i++) {
        const long p = a->t0 + i;
        for (long k = 0; k < nh; k++) {
            cs[k] = _mm512_loadu_ps(a->cos_ + p * half + 16 * k);
            sn[k] = _mm512_loadu_ps(a->sin_ + p * half + 16 * k);
        }
        for (long h = 0; h < a->h; h++) {
            const uint8_t *row = a->k.codes + h * a->k.s_h + i * a->k.s_t;
            const float *s = a->ks + h * d, *z = a->kz + h * d, *q = a->q + h * g * d;
            for (long k = 0; k < nc; k++)
                x[k] = _mm512_fmadd_ps(_mm512_permutexvar_ps(code_index16(row, 16 * k, bits), table),
                                       _mm512_loadu_ps(s + 16 * k), _mm512_loadu_ps(z + 16 * k));
            for (long gi = 0; gi < g; gi++) acc[gi] = _mm512_setzero_ps();
            for (long k = 0; k < nh; k++) { /* rotate-half RoPE at p, then the g dot products */
                const __m512 lo = x[k], hi = x[k + nh];
                const __m512 r_lo = _mm512_fmsub_ps(lo, cs[k], _mm512_mul_ps(hi, sn[k]));
                const __m512 r_hi = _mm512_fmadd_ps(hi, cs[k], _mm512_mul_ps(lo, sn[k]));
                for (long gi = 0; gi < g; gi++) {
                    acc[gi] = _mm512_fmadd_ps(_mm512_loadu_ps(q + gi * d + 16 * k), r_lo, acc[gi]);
                    acc[gi] = _mm512_fmadd_ps(_mm512_loadu_ps(q + gi * d + half + 16 * k), r_hi, acc[gi]);
                }
            }
            for (long gi = 0; gi < g; gi++)
                scores[(h * g + gi) * a->tokens + p] = _mm512_reduce_add_ps(acc[gi]) * a->scaling;
        }
    }
}

static void key_span_vec(const Args *a, long i0, long i1, float *scores) {
    switch (a->k.bits) {
        case 2: key_span_bits(a, i0, i1, scores, 2); break;
        case 3: key_span_bits(a, i0, i1, scores, 3); break;
        default: key_span_bits(a, i0, i1, scores, 4);
    }
    key_corrections(a, i0, i1, scores);
}

static inline __attribute__((always_inline)) void value_span_bits(const Args *a, long i0, long i1,
                                                                  const float *probs, float *out,
                                                                  const int bits) {
    const long d = a->d, nc = d / 16, g = a->g;
    const __m512 table = _mm512_loadu_ps(a->v.table);
    __m512 vals[MAX_CHUNKS], acc[MAX_GROUP * MAX_CHUNKS];
    float bias[MAX_GROUP];
    for (long h = 0; h < a->h; h++) {
        for (long e = 0; e < g * nc; e++) acc[e] = _mm512_setzero_ps();
        for (long gi = 0; gi < g; gi++) bias[gi] = 0.f;
        for (long i = i0; i < i1; i++) {
            const uint8_t *row = a->v.codes + h * a->v.s_h + i * a->v.s_t;
            const float sc = half_to_float(a->vs[i * a->s_vst]), zc = half_to_float(a->vz[i * a->s_vst]);
            for (long k = 0; k < nc; k++)
                vals[k] = _mm512_permutexvar_ps(code_index16(row, 16 * k, bits), table);
            for (long gi = 0; gi < g; gi++) { /* p v = (p scale) code + p zero */
                const float pr = probs[(h * g + gi) * a->tokens + a->t0 + i];
                const __m512 ps = _mm512_set1_ps(pr * sc);
                bias[gi] += pr * zc;
                for (long k = 0; k < nc; k++) acc[gi * nc + k] = _mm512_fmadd_ps(ps, vals[k], acc[gi * nc + k]);
            }
        }
        for (long gi = 0; gi < g; gi++) {
            float *o = out + (h * g + gi) * d;
            const __m512 b = _mm512_set1_ps(bias[gi]);
            for (long k = 0; k < nc; k++)
                _mm512_storeu_ps(o + 16 * k, _mm512_add_ps(_mm512_loadu_ps(o + 16 * k), _mm512_add_ps(acc[gi * nc + k], b)));
        }
    }
}

static void value_span_vec(const Args *a, long i0, long i1, const float *probs, float *out) {
    switch (a->v.bits) {
        case 2: value_span_bits(a, i0, i1, probs, out, 2); break;
        case 3: value_span_bits(a, i0, i1, probs, out, 3); break;
        default: value_span_bits(a, i0, i1, probs, out, 4);
    }
    value_corrections(a, i0, i1, probs, out);
}
#endif

static int use_vector(const Args *a) {
#ifdef __AVX512F__
    return a->vector && a->d % 32 == 0 && a->d <= 16 * MAX_CHUNKS && a->g <= MAX_GROUP;
#else
    (void)a;
    return 0;
#endif
}

static void key_span_any(const Args *a, long i0, long i1, float *scores) {
#ifdef __AVX512F__
    if (use_vector(a)) {
        key_span_vec(a, i0, i1, scores);
        return;
    }
#endif
    key_span(a, i0, i1, scores);
}

static void value_span_any(const Args *a, long i0, long i1, const float *probs, float *acc) {
#ifdef __AVX512F__
    if (use_vector(a)) {
        value_span_vec(a, i0, i1, probs, acc);
        return;
    }
#endif
    value_span(a, i0, i1, probs, acc);
}

static void softmax_row(float *x, long n) {
    float top = x[0], sum = 0.f; /* n >= 1; no infinities (built with -ffast-math) */
    for (long i = 1; i < n; i++) top = x[i] > top ? x[i] : top;
    for (long i = 0; i < n; i++) sum += (x[i] = expf(x[i] - top));
    const float inv = 1.f / sum;
    for (long i = 0; i < n; i++) x[i] *= inv;
}

static int decode(const Args *a, int threads) {
    const long spans = (a->tq + SPAN_TOKENS - 1) / SPAN_TOKENS, rows = a->h * a->g;
    const long items = spans > 0 ? spans : 1, width = rows * a->d;
    float *scores = malloc(sizeof(float) * (size_t)(rows * a->tokens));
    float *partial = calloc((size_t)(items * width), sizeof(float));
    if (!scores || !partial) {
        free(scores);
        free(partial);
        return 2;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long item = 0; item < items; item++) {
            const long i0 = item * SPAN_TOKENS, i1 = i0 + SPAN_TOKENS < a->tq ? i0 + SPAN_TOKENS : a->tq;
            if (item == 0) exact_scores(a, scores);
            if (i0 < i1) key_span_any(a, i0, i1, scores);
        }
#pragma omp for schedule(static)
        for (long row = 0; row < rows; row++) softmax_row(scores + row * a->tokens, a->tokens);
#pragma omp for schedule(static)
        for (long item = 0; item < items; item++) {
            const long i0 = item * SPAN_TOKENS, i1 = i0 + SPAN_TOKENS < a->tq ? i0 + SPAN_TOKENS : a->tq;
            float *acc = partial + item * width;
            if (item == 0) exact_values(a, scores, acc);
            if (i0 < i1) value_span_any(a, i0, i1, scores, acc);
        }
    }
    memset(a->out, 0, sizeof(float) * (size_t)width);
    for (long item = 0; item < items; item++)
        for (long e = 0; e < width; e++) a->out[e] += partial[item * width + e];
    free(scores);
    free(partial);
    return 0;
}

/* Whether this build has the AVX-512 path (it serves D a multiple of 32, g <= 16). */
int kvquant_vector_path(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

static int bits_ok(int bits, long d) { return (bits == 2 || bits == 3 || bits == 4) && (d * bits) % 8 == 0; }

/* The entry point (ctypes): pointers, then strides and sizes as longs (see Args). Returns 0, 1
   (sizes it cannot serve) or 2 (out of memory). */
int kvquant_decode_attention(const float *q,
                             const float *ek, long s_ekh, long s_ekt,
                             const float *ev, long s_evh, long s_evt,
                             const uint8_t *kc, long s_kch, long s_kct,
                             const uint8_t *vc, long s_vch, long s_vct,
                             const float *ks, const float *kz,
                             const uint16_t *vs, const uint16_t *vz, long s_vst,
                             const float *kcb, const float *vcb,
                             const float *cos_, const float *sin_,
                             const int32_t *kt, const int16_t *kl, const uint16_t *kv, long nk,
                             const int32_t *vt, const int16_t *vl, const uint16_t *vv, long nv,
                             float *out, long h, long g, long d, long t0, long tq,
                             int k_bits, int v_bits, float scaling, int vector, int threads) {
    if (h < 1 || g < 1 || d < 2 || d % 2 || t0 < 0 || tq < 0 || t0 + tq < 1 || !bits_ok(k_bits, d)
        || !bits_ok(v_bits, d))
        return 1;
    Args a = {.q = q, .ek = ek, .ev = ev, .s_ekh = s_ekh, .s_ekt = s_ekt, .s_evh = s_evh,
              .s_evt = s_evt, .ks = ks, .kz = kz, .vs = vs, .vz = vz, .s_vst = s_vst,
              .cos_ = cos_, .sin_ = sin_, .out = out, .h = h, .g = g, .d = d, .t0 = t0, .tq = tq,
              .tokens = t0 + tq, .scaling = scaling, .vector = vector};
    a.k = (Codes){.codes = kc, .s_h = s_kch, .s_t = s_kct, .bits = k_bits, .codebook = kcb,
                  .out = {kt, kl, kv, nk}};
    a.v = (Codes){.codes = vc, .s_h = s_vch, .s_t = s_vct, .bits = v_bits, .codebook = vcb,
                  .out = {vt, vl, vv, nv}};
    build_lut(&a.k);
    build_lut(&a.v);
    return decode(&a, threads);
}
