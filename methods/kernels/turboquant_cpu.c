/* TurboQuant decode attention on CPU, straight from the codes (methods/kernels/turboquant_cpu.py).

   One decode query row per head (g query heads per KV head h) over T = T_q + T_e tokens of one
   sequence (layout: methods/kernels/turboquant_attention.py):
     [0, T_q)  quantized in blocks of bt tokens; per token and head a bit stream of codes
               (coordinate j of the block's stream order at bit offs[j], widths[j] bits, its
               codebook entry cb[base[j] + code]), QJL sign bits (keys, optional), fp16 norms and
               residual norms per part (part[j]); per block and head the outlier-channel bit mask
               (stream order: outlier channels ascending, then the rest; identity without one);
     [T_q, T)  the exact tail, fp32 (H, T_e, D).
   A key of a block: x[perm] = concat_p(norm_p Pi_p^T c_p + rnorm_p coef_p S_p^T s_p), so
     q . x = sum_j (rot q[perm])_j norm_{p(j)} c_j + (proj q[perm])_j rnorm_{p(j)} s_j
   with rot = diag(Pi_p), proj = diag(coef_p S_p) (D x D, block-diagonal): the query is permuted,
   scaled and rotated once per block and head (column by column, from the transposed matrices),
   then every token costs D lookups and D sign reads. Values: per block,
   a = sum_t p_t norm_{p(j)} c_j (rotated coordinates), then out[perm] += a rot.
   out[g] = softmax(q[g] K^T * scaling) V, the softmax exact over all T scores.

   Two paths per tensor, the same sums:
     portable  a token's codes become codebook values through 256-entry byte tables (1, 2, 4 and
               8 bits) or 8 codes per w bytes (3, 5-7 bits), then plain dot products;
     vector    (D and the outlier count multiples of the lanes, widths <= 5 bits, g <= 16; the
               instruction set chosen at compile time) a chunk of lanes coordinates at a time
               stays in registers: the chunk's w bytes per 8 lanes are loaded once, every lane's
               code is cut out of them (a byte shuffle, a shift per lane, a mask) and becomes its
               codebook value by an in-register table lookup; the QJL signs choose +-rnorm per
               lane. Nothing per token leaves the registers but its g scores (keys) or the g p.V
               accumulators (values).
       AVX-512 VBMI: 16 lanes; bytes by vpermb, lookup by vpermt2ps (32 entries), signs a
               16-bit mask;
       AVX2 + FMA: 8 lanes; 8 bytes loaded (moved back near a row's end, so no load reads past
               a row: at least 8 code bytes a token), bytes by vpshufb, lookup by vpermps on
               8 entries, blended by the code's bits 3 and 4 (up to 4 tables), signs by their
               bit moved to the sign bit (vblendvps). An L1 table and vgatherdps instead took
               1.9x the time of the whole call (measured here).
     `vector` = 0 forces the portable path (tests run both, and build the AVX2 one again without
     AVX-512 where the CPU has it).

   One OpenMP region per call: key scores by span of blocks, softmax by row, p.V by span into
   partials summed in a fixed order (the result does not depend on the thread count). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define TQ_VECTOR 16 /* lanes: AVX-512 */
#elif defined(__AVX2__) && defined(__FMA__)
#define TQ_VECTOR 8  /* lanes: AVX2 + FMA */
#endif
#if defined(__F16C__) || defined(TQ_VECTOR)
#include <immintrin.h>
#endif

#define SPAN_BLOCKS 8 /* blocks per work item */
#define MAX_D 512
#define MAX_G 64
#define MAX_VEC_D 256 /* vector path: D <= 256 */
#define MAX_VEC_G 16  /* vector path: query heads per KV head */
#define MAX_VEC_BITS 5 /* vector path: a code indexes a 32-entry in-register table */

#if TQ_VECTOR == 16
typedef __m512 vec;
#define v_load _mm512_loadu_ps
#define v_store _mm512_storeu_ps
#define v_set1 _mm512_set1_ps
#define v_zero _mm512_setzero_ps
#define v_add _mm512_add_ps
#define v_mul _mm512_mul_ps
#define v_fmadd _mm512_fmadd_ps
#elif TQ_VECTOR == 8
typedef __m256 vec;
#define v_load _mm256_loadu_ps
#define v_store _mm256_storeu_ps
#define v_set1 _mm256_set1_ps
#define v_zero _mm256_setzero_ps
#define v_add _mm256_add_ps
#define v_mul _mm256_mul_ps
#define v_fmadd _mm256_fmadd_ps
#endif
#ifdef TQ_VECTOR
#define VW TQ_VECTOR                   /* coordinates per vector */
#define MAX_CHUNKS (MAX_VEC_D / VW)
#endif

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000 | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

#if TQ_VECTOR == 16
/* 16 coordinates of one part (uniform width w): where their 2w bytes start in a token's stream,
   and how to cut lane i's code out of them. */
typedef struct {
    __m512i gather;         /* vpermb indices: lane i's 4 bytes, from its code's first byte */
    __m512i shift, mask;    /* lane i: code = (word >> shift) & mask */
    __m512 lo, hi;          /* the part's codebook, entries 0-15 and 16-31 (zero padded) */
    long byte0;
    __mmask16 load;         /* the chunk's 2w bytes (a masked load never reads past a row) */
} Chunk;
#elif TQ_VECTOR == 8
/* 8 coordinates of one part (uniform width w): the chunk's w bytes lie in the 8 bytes loaded
   from `byte0` (moved back from the chunk's first byte near a row's end, so no load reads past
   a row); how to cut lane i's code out of them. */
typedef struct {
    __m256i gather;         /* vpshufb indices: lane i's 4 bytes of the word, from its code's */
    __m256i shift, mask;    /* lane i: code = (bytes >> shift) & mask */
    __m256 table[4];        /* the part's codebook, entries 8k..8k+7 (zero padded) */
    long byte0;
    long width;
} Chunk;
#endif

typedef struct {
    const uint8_t *codes; long s_ch, s_ct, code_bytes;   /* (H, T_q, code_bytes) */
    const uint8_t *signs; long s_sh, s_st;               /* (H, T_q, ceil(D/8)) or NULL */
    const uint16_t *norms; long s_nh, s_nt;              /* (H, T_q, parts) */
    const uint16_t *rnorms; long s_rh, s_rt;             /* (H, T_q, parts) or NULL */
    const uint8_t *masks; long s_mh, s_mb;               /* (H, NB, ceil(D/8)) or NULL */
    const float *rot, *proj, *cb;                        /* (D, D) each (keys: transposed), codebooks */
    const int32_t *offs, *widths, *base, *part;          /* (D,) each */
    long outliers;                                       /* channels of part 0 when split */
    int aligned;                                         /* every part starts on a byte */
    int vector;                                          /* this tensor takes the AVX-512 path */
    float lut[2][256 * 8];                               /* per part: a byte's codebook values */
#ifdef TQ_VECTOR
    Chunk chunks[MAX_CHUNKS];
#endif
} Tensor;

static float SIGNS[256 * 8];                             /* a byte's 8 sign bits as +-1 */

__attribute__((constructor)) static void build_signs(void) {
    for (int byte = 0; byte < 256; byte++)
        for (int i = 0; i < 8; i++) SIGNS[byte * 8 + i] = (byte >> i & 1) ? 1.f : -1.f;
}

/* Part p's widths are uniform: a byte holds 8 / w codes (w = 1, 2, 4, 8) or, at 3 and 5 bits,
   8 codes fill w bytes. The table maps a byte to its codes' codebook values. */
static void build_tables(Tensor *x, long d) {
    const long o = x->outliers, parts = o ? 2 : 1;
    x->aligned = 1;
    for (long p = 0; p < parts; p++) {
        const long j0 = p ? o : 0, w = x->widths[j0], n = p || !o ? d - j0 : o;
        const long group = (w == 1 || w == 2 || w == 4) ? 8 / w : (w == 8 ? 1 : 8);
        if ((x->offs[j0] & 7) || n % group) x->aligned = 0;
        if (w == 1 || w == 2 || w == 4 || w == 8) {
            const int per = 8 / (int)w, mask = (1 << w) - 1;
            for (int byte = 0; byte < 256; byte++)
                for (int i = 0; i < per; i++)
                    x->lut[p][byte * per + i] = x->cb[x->base[j0] + ((byte >> (i * w)) & mask)];
        }
    }
}

#if TQ_VECTOR == 16
/* The vector path's chunks, or 0 when this tensor's layout does not fit it. */
static int build_chunks(Tensor *x, long d, long g) {
    if (d % 16 || d > MAX_VEC_D || x->outliers % 16 || g > MAX_VEC_G) return 0;
    for (long k = 0; k < d / 16; k++) {
        const long j0 = 16 * k, w = x->widths[j0];
        if (w > MAX_VEC_BITS || (x->offs[j0] & 7)) return 0;
        uint8_t gather[64];
        int32_t shift[16];
        float table[32] = {0};
        for (long i = 0; i < 16; i++) {
            const long bit = x->offs[j0 + i] - x->offs[j0], byte = bit >> 3;
            for (long e = 0; e < 4; e++) gather[4 * i + e] = (uint8_t)(byte + e < 16 ? byte + e : 15);
            shift[i] = (int32_t)(bit & 7);
        }
        memcpy(table, x->cb + x->base[j0], sizeof(float) * (size_t)(1 << w));
        Chunk *c = &x->chunks[k];
        c->gather = _mm512_loadu_si512(gather);
        c->shift = _mm512_loadu_si512(shift);
        c->mask = _mm512_set1_epi32((1 << w) - 1);
        c->lo = _mm512_loadu_ps(table);
        c->hi = _mm512_loadu_ps(table + 16);
        c->byte0 = x->offs[j0] >> 3;
        c->load = (__mmask16)((1u << (2 * w)) - 1);
    }
    return 1;
}

/* The codebook values of one chunk of a token's stream `row`. */
static inline __attribute__((always_inline)) __m512 chunk_values(const uint8_t *row, const Chunk *c) {
    const __m128i bytes = _mm_maskz_loadu_epi8(c->load, row + c->byte0);
    const __m512i words = _mm512_permutexvar_epi8(c->gather, _mm512_zextsi128_si512(bytes));
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(words, c->shift), c->mask);
    return _mm512_permutex2var_ps(c->lo, codes, c->hi);
}

/* Chunk c's 16 QJL signs (bits 16c..16c+15 of the token's sign row) as +-r per lane. */
static inline __attribute__((always_inline)) vec sign_values(const uint8_t *s, long c, vec plus,
                                                             vec minus) {
    uint16_t bits;
    memcpy(&bits, s + 2 * c, sizeof bits);
    return _mm512_mask_blend_ps(bits, minus, plus);
}
#elif TQ_VECTOR == 8
/* The vector path's chunks, or 0 when this tensor's layout does not fit it. */
static int build_chunks(Tensor *x, long d, long g) {
    if (d % 8 || d > MAX_VEC_D || x->outliers % 8 || g > MAX_VEC_G || x->code_bytes < 8) return 0;
    for (long k = 0; k < d / 8; k++) {
        const long j0 = 8 * k, w = x->widths[j0], first = x->offs[j0] >> 3;
        if (w > MAX_VEC_BITS || (x->offs[j0] & 7)) return 0;
        const long byte0 = first + 8 <= x->code_bytes ? first : x->code_bytes - 8;
        uint8_t gather[32];
        int32_t shift[8];
        float table[32] = {0};
        for (long i = 0; i < 8; i++) {
            const long bit = x->offs[j0 + i] - 8 * byte0, byte = bit >> 3;
            for (long e = 0; e < 4; e++) /* the word sits in bytes 0-7 of both 128-bit halves */
                gather[4 * i + e] = (uint8_t)(byte + e < 8 ? byte + e : 7);
            shift[i] = (int32_t)(bit & 7);
        }
        memcpy(table, x->cb + x->base[j0], sizeof(float) * (size_t)(1 << w));
        Chunk *c = &x->chunks[k];
        c->gather = _mm256_loadu_si256((const __m256i *)gather);
        c->shift = _mm256_loadu_si256((const __m256i *)shift);
        c->mask = _mm256_set1_epi32((1 << w) - 1);
        for (int e = 0; e < 4; e++) c->table[e] = _mm256_loadu_ps(table + 8 * e);
        c->byte0 = byte0;
        c->width = w;
    }
    return 1;
}

/* The codebook values of one chunk of a token's stream `row`: a code's low 3 bits pick from
   8 entries in a register (vpermps); bits 3 and 4 (w > 3) choose between 2 or 4 such picks
   (their bit moved to the sign bit, which vblendvps reads). */
static inline __attribute__((always_inline)) __m256 chunk_values(const uint8_t *row, const Chunk *c) {
    int64_t word;
    memcpy(&word, row + c->byte0, sizeof word);
    const __m256i words = _mm256_shuffle_epi8(_mm256_set1_epi64x(word), c->gather);
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(words, c->shift), c->mask);
    __m256 y = _mm256_permutevar8x32_ps(c->table[0], codes);
    if (c->width > 3) {
        __m256 hi = _mm256_permutevar8x32_ps(c->table[1], codes);
        if (c->width > 4) {
            const __m256 bit4 = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 27));
            y = _mm256_blendv_ps(y, _mm256_permutevar8x32_ps(c->table[2], codes), bit4);
            hi = _mm256_blendv_ps(hi, _mm256_permutevar8x32_ps(c->table[3], codes), bit4);
        }
        y = _mm256_blendv_ps(y, hi, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
    }
    return y;
}

/* Chunk c's 8 QJL signs (byte c of the token's sign row) as +-r per lane: bit i moved to lane
   i's sign bit, which vblendvps reads. */
static inline __attribute__((always_inline)) vec sign_values(const uint8_t *s, long c, vec plus,
                                                             vec minus) {
    const __m256i bits = _mm256_sllv_epi32(_mm256_set1_epi32(s[c]),
                                           _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24));
    return _mm256_blendv_ps(minus, plus, _mm256_castsi256_ps(bits));
}
#endif

/* The codebook values of part p's n codes of width w starting at byte `src` (y, n floats). */
static inline void decode_part(const Tensor *x, int p, const uint8_t *src, long n, long w,
                               const float *cb, float *y) {
    switch (w) {
        case 1: for (long j = 0; j < n / 8; j++) memcpy(y + 8 * j, x->lut[p] + 8 * src[j], 8 * sizeof(float)); break;
        case 2: for (long j = 0; j < n / 4; j++) memcpy(y + 4 * j, x->lut[p] + 4 * src[j], 4 * sizeof(float)); break;
        case 4: for (long j = 0; j < n / 2; j++) memcpy(y + 2 * j, x->lut[p] + 2 * src[j], 2 * sizeof(float)); break;
        case 8: for (long j = 0; j < n; j++) y[j] = cb[src[j]]; break;
        default: /* 3..7 bits: 8 codes in every w bytes */
            for (long j = 0; j < n / 8; j++) {
                uint64_t word = 0;
                for (long b = 0; b < w; b++) word |= (uint64_t)src[w * j + b] << (8 * b);
                for (int i = 0; i < 8; i++) y[8 * j + i] = cb[(word >> (w * i)) & ((1u << w) - 1)];
            }
    }
}

typedef struct {
    const float *q;                                      /* (H, g, D) */
    const float *ek, *ev; long s_ekh, s_ekt, s_evh, s_evt, te;
    Tensor k, v;
    float *out;
    long h, g, d, tq, bt, tokens;
    float scaling;
} Args;

/* The stream order of block b of head h: outlier channels ascending, then the rest (the set
   bits of the block's mask, then the clear ones, 64 channels at a time). */
static void block_perm(const Tensor *x, long h, long b, long d, int *perm) {
    if (!x->masks) {
        for (long j = 0; j < d; j++) perm[j] = (int)j;
        return;
    }
    const uint8_t *m = x->masks + h * x->s_mh + b * x->s_mb;
    long n = 0;
    for (int pass = 0; pass < 2; pass++)
        for (long c0 = 0; c0 < d; c0 += 64) {
            const long bytes = (d - c0 + 7) / 8 < 8 ? (d - c0 + 7) / 8 : 8;
            const long live = d - c0 < 64 ? d - c0 : 64;
            uint64_t bits = 0;
            memcpy(&bits, m + c0 / 8, (size_t)bytes); /* little-endian: bit c of the word = channel c0 + c */
            if (pass) bits = ~bits;
            if (live < 64) bits &= (UINT64_C(1) << live) - 1;
            for (; bits; bits &= bits - 1) perm[n++] = (int)(c0 + __builtin_ctzll(bits));
        }
}

/* y (D) = x (D) M for the block-diagonal M (D x D, row-major; parts [0, o) and [o, d)): row by
   row, each row's part contiguous. */
static void times_blockdiag(const float *x, const float *m, long d, long o, float *y) {
    memset(y, 0, sizeof(float) * (size_t)d);
    for (long i = 0; i < d; i++) {
        const long lo = i < o ? 0 : o, hi = i < o ? o : d;
        const float xi = x[i], *row = m + i * d;
        for (long j = lo; j < hi; j++) y[j] += xi * row[j];
    }
}

#ifdef TQ_VECTOR
/* Y (n, VW nc) = X (n, D) M[:, :VW nc] for n rows at once, over all of M (its zero blocks add
   exactly nothing; skipping them would cost a branch per chunk and row); `n` and `nc` constants
   after inlining, so the n * nc sums stay in registers. M and Y have row stride D (pass them
   offset to start at another column). Each chunk of M is loaded once for the n rows (M does not
   fit in L1 beside the other matrices), and the n chains of FMAs run side by side. */
static inline __attribute__((always_inline)) void times_dense_nc(const float *x, const float *m,
                                                                long d, float *y, const long n,
                                                                const long nc) {
    enum { MAX_ROWS = 4 };
    vec acc[MAX_ROWS][MAX_CHUNKS], xi[MAX_ROWS];
    for (long r = 0; r < n; r++)
        for (long c = 0; c < nc; c++) acc[r][c] = v_zero();
    for (long i = 0; i < d; i++) {
        for (long r = 0; r < n; r++) xi[r] = v_set1(x[r * d + i]);
        for (long c = 0; c < nc; c++) {
            const vec mc = v_load(m + i * d + VW * c);
            for (long r = 0; r < n; r++) acc[r][c] = v_fmadd(xi[r], mc, acc[r][c]);
        }
    }
    for (long r = 0; r < n; r++)
        for (long c = 0; c < nc; c++) v_store(y + r * d + VW * c, acc[r][c]);
}
#endif

#if TQ_VECTOR == 16
/* Rows [0, n) four at a time (D = 64), two at a time (D = 128), else one at a time. */
static void times_dense(const float *x, const float *m, long d, float *y, long n) {
    for (long r0 = 0; r0 < n;) {
        const long left = n - r0;
        const float *xr = x + r0 * d;
        float *yr = y + r0 * d;
        if (d == 64) {
            switch (left < 4 ? left : 4) {
                case 4: times_dense_nc(xr, m, d, yr, 4, 4); break;
                case 3: times_dense_nc(xr, m, d, yr, 3, 4); break;
                case 2: times_dense_nc(xr, m, d, yr, 2, 4); break;
                default: times_dense_nc(xr, m, d, yr, 1, 4);
            }
            r0 += left < 4 ? left : 4;
        } else if (d == 128) {
            if (left >= 2) times_dense_nc(xr, m, d, yr, 2, 8);
            else times_dense_nc(xr, m, d, yr, 1, 8);
            r0 += left < 2 ? left : 2;
        } else {
            times_dense_nc(xr, m, d, yr, 1, d / 16);
            r0++;
        }
    }
}
#elif TQ_VECTOR == 8
/* 32 columns at a time (16 registers hold 2 rows of 4 chunks beside their operands), rows two
   at a time; the last columns (D not a multiple of 32) one row at a time. */
static void times_dense(const float *x, const float *m, long d, float *y, long n) {
    for (long col = 0; col < d; col += 32) {
        const long nc = d - col < 32 ? (d - col) / 8 : 4;
        for (long r0 = 0; r0 < n;) {
            const float *xr = x + r0 * d;
            float *yr = y + r0 * d + col;
            if (nc == 4 && n - r0 >= 2) {
                times_dense_nc(xr, m + col, d, yr, 2, 4);
                r0 += 2;
            } else {
                if (nc == 4) times_dense_nc(xr, m + col, d, yr, 1, 4);
                else times_dense_nc(xr, m + col, d, yr, 1, nc);
                r0++;
            }
        }
    }
}
#endif

/* Y (n, D) = X (n, D) M for a tensor's block-diagonal M: the vector form where the tensor takes
   the vector path. */
static void tensor_blockdiag(const Tensor *t, const float *x, const float *m, long d, float *y,
                             long n) {
#ifdef TQ_VECTOR
    if (t->vector) {
        times_dense(x, m, d, y, n);
        return;
    }
#endif
    for (long r = 0; r < n; r++) times_blockdiag(x + r * d, m, d, t->outliers, y + r * d);
}

/* The g queries of KV head h for block b: permuted to the block's stream order, times
   `scaling`, rotated (rq) and projected (sq, QJL keys only), each (g, D); rot and proj come
   transposed (x rot^T = rot x). `x` (g, D) scratch. */
static void query_prep(const Args *a, long h, long b, float *x, float *rq, float *sq) {
    const Tensor *k = &a->k;
    const long d = a->d;
    int perm[MAX_D];
    block_perm(k, h, b, d, perm);
    for (long gi = 0; gi < a->g; gi++) {
        const float *q = a->q + (h * a->g + gi) * d;
        for (long i = 0; i < d; i++) x[gi * d + i] = q[perm[i]] * a->scaling;
    }
    tensor_blockdiag(k, x, k->rot, d, rq, a->g);
    if (k->signs) tensor_blockdiag(k, x, k->proj, d, sq, a->g);
}

/* The codebook values of one token's stream (y, D floats; norms not applied). */
static inline void decode_row(const Tensor *x, long h, long t, long d, float *y) {
    const uint8_t *row = x->codes + h * x->s_ch + t * x->s_ct;
    if (x->aligned) {
        const long o = x->outliers;
        if (o) decode_part(x, 0, row, o, x->widths[0], x->cb + x->base[0], y);
        decode_part(x, o ? 1 : 0, row + x->offs[o] / 8, d - o, x->widths[o], x->cb + x->base[o], y + o);
        return;
    }
    for (long j = 0; j < d; j++) {
        const long off = x->offs[j], byte = off >> 3;
        uint32_t w = row[byte];
        if ((off & 7) + x->widths[j] > 8) w |= (uint32_t)row[byte + 1] << 8;
        const int code = (int)((w >> (off & 7)) & ((1u << x->widths[j]) - 1));
        y[j] = x->cb[x->base[j] + code];
    }
}

/* Scores of the quantized tokens of block b, head h (portable). */
static void key_block(const Args *a, long b, long h, const float *rq, const float *sq,
                      float *scores) {
    const Tensor *k = &a->k;
    const long d = a->d, g = a->g, o = k->outliers;
    float y[MAX_D], sg[MAX_D];
    for (long t = b * a->bt; t < (b + 1) * a->bt; t++) {
        decode_row(k, h, t, d, y);
        /* y *= the part norms; sg = the signs times the part residual norms */
        const uint16_t *nr = k->norms + h * k->s_nh + t * k->s_nt;
        const float n0 = half_to_float(nr[0]), n1 = o ? half_to_float(nr[1]) : n0;
        for (long j = 0; j < o; j++) y[j] *= n0;
        for (long j = o; j < d; j++) y[j] *= n1;
        if (k->signs) {
            const uint8_t *s = k->signs + h * k->s_sh + t * k->s_st;
            const uint16_t *rr = k->rnorms + h * k->s_rh + t * k->s_rt;
            const float r0 = half_to_float(rr[0]), r1 = o ? half_to_float(rr[1]) : r0;
            for (long j = 0; j < d / 8; j++) memcpy(sg + 8 * j, SIGNS + 8 * s[j], 8 * sizeof(float));
            for (long j = d / 8 * 8; j < d; j++) sg[j] = (s[j >> 3] >> (j & 7) & 1) ? 1.f : -1.f;
            for (long j = 0; j < o; j++) sg[j] *= r0;
            for (long j = o; j < d; j++) sg[j] *= r1;
        }
        for (long gi = 0; gi < g; gi++) {
            const float *r = rq + gi * d, *p = sq + gi * d;
            float s = 0.f;
            for (long j = 0; j < d; j++) s += r[j] * y[j];
            if (k->signs)
                for (long j = 0; j < d; j++) s += p[j] * sg[j];
            scores[(h * g + gi) * a->tokens + t] = s;
        }
    }
}

#if TQ_VECTOR == 16
/* The four sums of a, b, c, d in one vector [sum a, sum b, sum c, sum d]: a third of the
   shuffles of four separate reductions. */
static inline __attribute__((always_inline)) __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], likewise c, d; then [a, b, c, d] */
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}
#elif TQ_VECTOR == 8
/* The four sums of a, b, c, d in one vector [sum a, sum b, sum c, sum d]. */
static inline __attribute__((always_inline)) __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
    /* per 128-bit lane: [a01, a23, b01, b23] and [c01, c23, d01, d23], then [a, b, c, d] */
    const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}
#endif

#ifdef TQ_VECTOR
/* key_block on the vector path; `nc` (D / VW) a constant after inlining, so the token's chunks
   live in registers. Tokens go four at a time: each query's four dot products are reduced
   together and stored as four consecutive scores. */
static inline __attribute__((always_inline)) void key_block_nc(
        const Args *a, long b, long h, const float *rq, const float *sq, float *scores,
        const long nc) {
    const Tensor *k = &a->k;
    const long d = a->d, g = a->g, c0 = k->outliers / VW; /* chunks [0, c0) are part 0 */
    const long end = (b + 1) * a->bt;
    vec y[MAX_CHUNKS], sg[MAX_CHUNKS], acc[4][MAX_VEC_G];
    for (long t0 = b * a->bt; t0 < end; t0 += 4) {
        const long n = end - t0 < 4 ? end - t0 : 4;
        for (long u = 0; u < 4; u++) {
            if (u >= n) { /* past the block's end: nothing to score */
                for (long gi = 0; gi < g; gi++) acc[u][gi] = v_zero();
                continue;
            }
            const long t = t0 + u;
            const uint8_t *row = k->codes + h * k->s_ch + t * k->s_ct;
            const uint16_t *nr = k->norms + h * k->s_nh + t * k->s_nt;
            const vec n0 = v_set1(half_to_float(nr[0]));
            const vec n1 = c0 ? v_set1(half_to_float(nr[1])) : n0;
            for (long c = 0; c < nc; c++) y[c] = v_mul(chunk_values(row, &k->chunks[c]), c < c0 ? n0 : n1);
            if (k->signs) { /* sign bit 1 -> +rnorm, 0 -> -rnorm */
                const uint8_t *s = k->signs + h * k->s_sh + t * k->s_st;
                const uint16_t *rr = k->rnorms + h * k->s_rh + t * k->s_rt;
                const float r0 = half_to_float(rr[0]), r1 = c0 ? half_to_float(rr[1]) : r0;
                const vec p0 = v_set1(r0), m0 = v_set1(-r0), p1 = v_set1(r1), m1 = v_set1(-r1);
                for (long c = 0; c < nc; c++)
                    sg[c] = c < c0 ? sign_values(s, c, p0, m0) : sign_values(s, c, p1, m1);
            }
            for (long gi = 0; gi < g; gi++) { /* two chains of FMAs: half the latency */
                const float *r = rq + gi * d, *p = sq + gi * d;
                vec codes = v_mul(v_load(r), y[0]), signs = v_zero();
                for (long c = 1; c < nc; c++) codes = v_fmadd(v_load(r + VW * c), y[c], codes);
                if (k->signs)
                    for (long c = 0; c < nc; c++) signs = v_fmadd(v_load(p + VW * c), sg[c], signs);
                acc[u][gi] = v_add(codes, signs);
            }
        }
        for (long gi = 0; gi < g; gi++) {
            float four[4];
            _mm_storeu_ps(four, reduce4(acc[0][gi], acc[1][gi], acc[2][gi], acc[3][gi]));
            memcpy(scores + (h * g + gi) * a->tokens + t0, four, sizeof(float) * (size_t)n);
        }
    }
}

static void key_block_vec(const Args *a, long b, long h, const float *rq, const float *sq,
                          float *scores) {
    switch (a->d / VW) {
        case 4: key_block_nc(a, b, h, rq, sq, scores, 4); break;   /* D = 64 (AVX-512) */
        case 8: key_block_nc(a, b, h, rq, sq, scores, 8); break;   /* D = 128, or 64 (AVX2) */
        default: key_block_nc(a, b, h, rq, sq, scores, a->d / VW);
    }
}
#endif

/* Scores of the quantized blocks [b0, b1). */
static void key_span(const Args *a, long b0, long b1, float *scores) {
    const long n = a->g * a->d;
    float *rq = malloc(sizeof(float) * (size_t)(3 * n)), *sq = rq + n, *x = sq + n;
    if (!rq) return;
    for (long b = b0; b < b1; b++)
        for (long h = 0; h < a->h; h++) {
            query_prep(a, h, b, x, rq, sq);
#ifdef TQ_VECTOR
            if (a->k.vector) {
                key_block_vec(a, b, h, rq, sq, scores);
                continue;
            }
#endif
            key_block(a, b, h, rq, sq, scores);
        }
    free(rq);
}

/* rot_acc (g, D) += p V over the tokens of block b, head h, in rotated coordinates (portable). */
static void value_block(const Args *a, long b, long h, const float *probs, float *rot_acc) {
    const Tensor *v = &a->v;
    const long d = a->d, g = a->g, o = v->outliers;
    float y[MAX_D];
    for (long t = b * a->bt; t < (b + 1) * a->bt; t++) {
        decode_row(v, h, t, d, y);
        const uint16_t *nr = v->norms + h * v->s_nh + t * v->s_nt;
        const float n0 = half_to_float(nr[0]), n1 = o ? half_to_float(nr[1]) : n0;
        for (long gi = 0; gi < g; gi++) { /* the part norms folded into the probability */
            const float p = probs[(h * g + gi) * a->tokens + t], p0 = p * n0, p1 = p * n1;
            float *r = rot_acc + gi * d;
            for (long j = 0; j < o; j++) r[j] += p0 * y[j];
            for (long j = o; j < d; j++) r[j] += p1 * y[j];
        }
    }
}

#ifdef TQ_VECTOR
/* value_block on the vector path for the chunks [cf, cf + nc) (columns VW cf ..): rot_acc's
   columns there are written, not added to; `nc` a constant after inlining, so the g * nc sums
   stay in registers. */
static inline __attribute__((always_inline)) void value_block_nc(
        const Args *a, long b, long h, const float *probs, float *rot_acc, const long cf,
        const long nc) {
    const Tensor *v = &a->v;
    const long g = a->g, d = a->d, c0 = v->outliers / VW;
    vec y[MAX_CHUNKS], acc[MAX_VEC_G * MAX_CHUNKS];
    for (long e = 0; e < g * nc; e++) acc[e] = v_zero();
    for (long t = b * a->bt; t < (b + 1) * a->bt; t++) {
        const uint8_t *row = v->codes + h * v->s_ch + t * v->s_ct;
        const uint16_t *nr = v->norms + h * v->s_nh + t * v->s_nt;
        const float n0 = half_to_float(nr[0]), n1 = c0 ? half_to_float(nr[1]) : n0;
        for (long c = 0; c < nc; c++) y[c] = chunk_values(row, &v->chunks[cf + c]);
        for (long gi = 0; gi < g; gi++) {
            const float p = probs[(h * g + gi) * a->tokens + t];
            const vec p0 = v_set1(p * n0), p1 = v_set1(p * n1);
            for (long c = 0; c < nc; c++)
                acc[gi * nc + c] = v_fmadd(cf + c < c0 ? p0 : p1, y[c], acc[gi * nc + c]);
        }
    }
    for (long gi = 0; gi < g; gi++)
        for (long c = 0; c < nc; c++) v_store(rot_acc + gi * d + VW * (cf + c), acc[gi * nc + c]);
}

#if TQ_VECTOR == 16
static void value_block_vec(const Args *a, long b, long h, const float *probs, float *rot_acc) {
    switch (a->d / 16) {
        case 4: value_block_nc(a, b, h, probs, rot_acc, 0, 4); break;
        case 8: value_block_nc(a, b, h, probs, rot_acc, 0, 8); break;
        default: value_block_nc(a, b, h, probs, rot_acc, 0, a->d / 16);
    }
}
#else
/* 32 columns at a time: 16 registers hold g = 3 queries' sums of 4 chunks beside the chunks
   (each token's codes are still cut once: every chunk belongs to one pass). */
static void value_block_vec(const Args *a, long b, long h, const float *probs, float *rot_acc) {
    for (long cf = 0; cf < a->d / 8; cf += 4) {
        if (a->d / 8 - cf >= 4) value_block_nc(a, b, h, probs, rot_acc, cf, 4);
        else value_block_nc(a, b, h, probs, rot_acc, cf, a->d / 8 - cf);
    }
}
#endif
#endif

/* acc (H, g, D) += p[:, blocks [b0, b1)] V. */
static void value_span(const Args *a, long b0, long b1, const float *probs, float *acc) {
    const Tensor *v = &a->v;
    const long d = a->d, g = a->g;
    int perm[MAX_D];
    float *rot_acc = malloc(sizeof(float) * (size_t)(2 * g * d)), *back = rot_acc + g * d;
    if (!rot_acc) return;
    for (long b = b0; b < b1; b++)
        for (long h = 0; h < a->h; h++) {
#ifdef TQ_VECTOR
            if (v->vector)
                value_block_vec(a, b, h, probs, rot_acc);
            else
#endif
            {
                memset(rot_acc, 0, sizeof(float) * (size_t)(g * d));
                value_block(a, b, h, probs, rot_acc);
            }
            block_perm(v, h, b, d, perm);
            tensor_blockdiag(v, rot_acc, v->rot, d, back, g); /* back to the channels: (r rot)[perm] */
            for (long gi = 0; gi < g; gi++) {
                float *dst = acc + (h * g + gi) * d;
                for (long i = 0; i < d; i++) dst[perm[i]] += back[gi * d + i];
            }
        }
    free(rot_acc);
}

static void tail_scores(const Args *a, float *scores) {
    for (long h = 0; h < a->h; h++)
        for (long gi = 0; gi < a->g; gi++) {
            const float *q = a->q + (h * a->g + gi) * a->d;
            for (long t = 0; t < a->te; t++) {
                const float *k = a->ek + h * a->s_ekh + t * a->s_ekt;
                float dot = 0.f;
                for (long c = 0; c < a->d; c++) dot += q[c] * k[c];
                scores[(h * a->g + gi) * a->tokens + a->tq + t] = dot * a->scaling;
            }
        }
}

static void tail_values(const Args *a, const float *probs, float *acc) {
    for (long h = 0; h < a->h; h++)
        for (long gi = 0; gi < a->g; gi++) {
            float *o = acc + (h * a->g + gi) * a->d;
            for (long t = 0; t < a->te; t++) {
                const float p = probs[(h * a->g + gi) * a->tokens + a->tq + t];
                const float *v = a->ev + h * a->s_evh + t * a->s_evt;
                for (long c = 0; c < a->d; c++) o[c] += p * v[c];
            }
        }
}

static void softmax_row(float *x, long n) {
    float top = x[0], sum = 0.f;
    for (long i = 1; i < n; i++) top = x[i] > top ? x[i] : top;
    for (long i = 0; i < n; i++) sum += (x[i] = expf(x[i] - top));
    const float inv = 1.f / sum;
    for (long i = 0; i < n; i++) x[i] *= inv;
}

static int decode(const Args *a, int threads) {
    const long nb = a->tq / a->bt, rows = a->h * a->g, width = rows * a->d;
    const long spans = (nb + SPAN_BLOCKS - 1) / SPAN_BLOCKS, items = spans > 0 ? spans : 1;
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
            const long b0 = item * SPAN_BLOCKS, b1 = b0 + SPAN_BLOCKS < nb ? b0 + SPAN_BLOCKS : nb;
            if (item == 0) tail_scores(a, scores);
            if (b0 < b1) key_span(a, b0, b1, scores);
        }
#pragma omp for schedule(static)
        for (long row = 0; row < rows; row++) softmax_row(scores + row * a->tokens, a->tokens);
#pragma omp for schedule(static)
        for (long item = 0; item < items; item++) {
            const long b0 = item * SPAN_BLOCKS, b1 = b0 + SPAN_BLOCKS < nb ? b0 + SPAN_BLOCKS : nb;
            float *acc = partial + item * width;
            if (item == 0) tail_values(a, scores, acc);
            if (b0 < b1) value_span(a, b0, b1, scores, acc);
        }
    }
    memset(a->out, 0, sizeof(float) * (size_t)width);
    for (long item = 0; item < items; item++)
        for (long e = 0; e < width; e++) a->out[e] += partial[item * width + e];
    free(scores);
    free(partial);
    return 0;
}

/* The vector path this build has: its lanes (16: AVX-512 VBMI, 8: AVX2 + FMA), 0 for none.
   It serves D and the outlier count multiples of the lanes, D <= 256, widths <= 5 bits,
   g <= 16 (AVX2: also at least 8 code bytes a token). */
int tq_vector_path(void) {
#ifdef TQ_VECTOR
    return TQ_VECTOR;
#else
    return 0;
#endif
}

/* A tensor's path: the vector one where it is built, asked for and fits, else the tables. */
static void choose_path(Tensor *x, long d, long g, int vector) {
    x->vector = 0;
#ifdef TQ_VECTOR
    x->vector = vector && build_chunks(x, d, g);
#else
    (void)g;
    (void)vector;
#endif
    if (!x->vector) build_tables(x, d);
}

/* The entry point (ctypes). Returns 0, 1 (sizes it cannot serve) or 2 (out of memory). Keys'
   rotation and projection come transposed (krot_t, kproj_t); the values' rotation as is. */
int tq_decode_attention(const float *q,
                        const float *ek, long s_ekh, long s_ekt,
                        const float *ev, long s_evh, long s_evt, long te,
                        const uint8_t *kc, long s_kch, long s_kct, long k_code_bytes,
                        const uint8_t *ks, long s_ksh, long s_kst,
                        const uint16_t *kn, long s_knh, long s_knt,
                        const uint16_t *kr, long s_krh, long s_krt,
                        const uint8_t *km, long s_kmh, long s_kmb,
                        const float *krot_t, const float *kproj_t, const float *kcb,
                        const int32_t *klay, long k_outliers,
                        const uint8_t *vc, long s_vch, long s_vct, long v_code_bytes,
                        const uint16_t *vn, long s_vnh, long s_vnt,
                        const uint8_t *vm, long s_vmh, long s_vmb,
                        const float *vrot, const float *vcb, const int32_t *vlay, long v_outliers,
                        float *out, long h, long g, long d, long tq, long bt,
                        float scaling, int vector, int threads) {
    if (h < 1 || g < 1 || g > MAX_G || d < 2 || d > MAX_D || tq < 0 || te < 0 || tq + te < 1
        || bt < 1 || tq % bt || (te && (!ek || !ev)) || (ks && (!kr || !kproj_t)))
        return 1;
    Args a = {.q = q, .ek = ek, .ev = ev, .s_ekh = s_ekh, .s_ekt = s_ekt, .s_evh = s_evh,
              .s_evt = s_evt, .te = te, .out = out, .h = h, .g = g, .d = d, .tq = tq, .bt = bt,
              .tokens = tq + te, .scaling = scaling};
    a.k = (Tensor){kc, s_kch, s_kct, k_code_bytes, ks, s_ksh, s_kst, kn, s_knh, s_knt, kr, s_krh,
                   s_krt, km, s_kmh, s_kmb, krot_t, kproj_t, kcb, klay, klay + d, klay + 2 * d,
                   klay + 3 * d, k_outliers};
    a.v = (Tensor){vc, s_vch, s_vct, v_code_bytes, NULL, 0, 0, vn, s_vnh, s_vnt, NULL, 0, 0, vm,
                   s_vmh, s_vmb, vrot, NULL, vcb, vlay, vlay + d, vlay + 2 * d, vlay + 3 * d,
                   v_outliers};
    choose_path(&a.k, d, g, vector);
    choose_path(&a.v, d, g, vector);
    return decode(&a, threads);
}
