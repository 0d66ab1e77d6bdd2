/* Decode attention over per-head rows read where they are stored, on CPU
   (methods/kernels/ragged_attention_cpu.py): the contiguous buffer or the paged block tables,
   every (batch row, KV head) `bh` with its own length.

   Head `bh` holds `len[bh]` tokens; its key t lives in block `k_table[bh][t / block_tokens]` at
   offset `t % block_tokens`, its value in `v_table[bh][t / block_tokens]` (K and V have tables
   of their own; a contiguous buffer is one block per head, `block_tokens` = its capacity). Its g query heads (one decode row each) attend over those tokens only:
     p[g, t] = softmax_t(q[g] . k[t] * scaling),  out[g] = sum_t p[g, t] v[t]   (fp32)
   A head with no token attends to nothing: its output is zeros (the convention of vLLM and
   flash-attention's variable-length kernels for an empty key set).

   One OpenMP parallel region per call with no barrier inside: each (head, span of SPAN_TOKENS
   tokens) work item computes its scores, a softmax over its own span and its unnormalised p.V;
   after the region each head's spans are merged serially in token order. Spans are cut by token
   index, never by block, so the arithmetic is the same whatever the layout or the block size
   (paged and contiguous give the same bits) and whatever the thread count. Strides are in
   elements; the last axis is unit. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define SPAN_TOKENS 256 /* tokens per work item (a fixed split: results do not depend on threads) */
#define PARALLEL_MIN_MACS (1L << 17) /* below this many q.k multiply-adds: one thread */
#define LEN(a, r) ((a)->lengths ? (a)->lengths[r] : (a)->uniform)

typedef struct {
    const float *q; long s_qbh, s_qg;   /* (BH, g, D) */
    const float *k; long s_kblk, s_kt;  /* blocks (N, block_tokens, D) */
    const float *v; long s_vblk, s_vt;  /* blocks (N', block_tokens, D) */
    const int64_t *k_table; long s_ktbh; /* (BH, blocks): key block ids in token order */
    const int64_t *v_table; long s_vtbh; /* (BH, blocks): value block ids */
    long block_tokens;
    const int64_t *lengths;             /* (BH,) tokens per head, or NULL: every head `uniform` */
    long uniform;
    float *out;                         /* (BH, g, D) contiguous */
    long bh, g, d;
    float scaling;
} Args;

/* Rows t0 .. t1 of head r, block by block: calls BODY(row pointer, index from t0) per token. */
#define FOR_ROWS(base, s_blk, s_t, table, BODY)                                               \
    for (long t = t0; t < t1;) {                                                              \
        const long off = t % a->block_tokens;                                                 \
        const long n = a->block_tokens - off < t1 - t ? a->block_tokens - off : t1 - t;       \
        const float *row = (base) + table[t / a->block_tokens] * (s_blk) + off * (s_t);       \
        for (long i = 0; i < n; i++, row += (s_t)) { const long j = t - t0 + i; BODY; }       \
        t += n;                                                                               \
    }

/* One work item, (head r, tokens [t0, t1)): e = exp(score - m) with the span's own max m[h]
   and sum l[h], and the unnormalised partial[h] = sum_t e[h, t] v[t]. */
static void span(const Args *a, long r, long t0, long t1, float *partial, float *m, float *l) {
    const long g = a->g, d = a->d;
    const int64_t *k_table = a->k_table + r * a->s_ktbh, *v_table = a->v_table + r * a->s_vtbh;
    float q[g * d], e[g * SPAN_TOKENS];
    for (long h = 0; h < g; h++)
        for (long c = 0; c < d; c++)
            q[h * d + c] = a->q[r * a->s_qbh + h * a->s_qg + c] * a->scaling;
    FOR_ROWS(a->k, a->s_kblk, a->s_kt, k_table, {
        for (long h = 0; h < g; h++) {
            const float *qh = q + h * d;
            float dot = 0.f;
            for (long c = 0; c < d; c++) dot += qh[c] * row[c];
            e[h * SPAN_TOKENS + j] = dot;
        }
    })
    const long n = t1 - t0;
    for (long h = 0; h < g; h++) {
        float *x = e + h * SPAN_TOKENS, top = x[0], sum = 0.f;
        for (long j = 1; j < n; j++) top = x[j] > top ? x[j] : top;
        for (long j = 0; j < n; j++) sum += (x[j] = expf(x[j] - top));
        m[h] = top;
        l[h] = sum;
    }
    FOR_ROWS(a->v, a->s_vblk, a->s_vt, v_table, {
        for (long h = 0; h < g; h++) {
            const float w = e[h * SPAN_TOKENS + j];
            float *o = partial + h * d;
            for (long c = 0; c < d; c++) o[c] += w * row[c];
        }
    })
}

/* Head r after its spans (partials, maxima and sums in token order): the global softmax. */
static void merge(const Args *a, long r, long spans, const float *partial, const float *m,
                  const float *l) {
    const long g = a->g, d = a->d;
    float *o = a->out + r * g * d;
    memset(o, 0, sizeof(float) * g * d);
    for (long h = 0; h < g && spans; h++) {
        float top = m[h], total = 0.f;
        for (long s = 1; s < spans; s++) top = m[s * g + h] > top ? m[s * g + h] : top;
        for (long s = 0; s < spans; s++) total += l[s * g + h] * expf(m[s * g + h] - top);
        for (long s = 0; s < spans; s++) {
            const float coef = expf(m[s * g + h] - top) / total;
            const float *p = partial + (s * g + h) * d;
            for (long c = 0; c < d; c++) o[h * d + c] += coef * p[c];
        }
    }
}

static int decode(const Args *a, int threads) {
    long *first = malloc(sizeof(long) * (size_t)(a->bh + 1)); /* head r's items: first[r].. */
    if (!first) return 2;
    first[0] = 0;
    for (long r = 0; r < a->bh; r++) {
        if (LEN(a, r) < 0) {
            free(first);
            return 1;
        }
        first[r + 1] = first[r] + (LEN(a, r) + SPAN_TOKENS - 1) / SPAN_TOKENS;
    }
    const long items = first[a->bh], g = a->g, width = g * a->d;
    long *owner = malloc(sizeof(long) * (size_t)(items ? items : 1));
    float *partial = calloc((size_t)(items * width + 1), sizeof(float));
    float *stats = malloc(sizeof(float) * (size_t)(2 * items * g + 1)); /* m, then l */
    if (!owner || !partial || !stats) {
        free(first);
        free(owner);
        free(partial);
        free(stats);
        return 2;
    }
    for (long r = 0; r < a->bh; r++)
        for (long i = first[r]; i < first[r + 1]; i++) owner[i] = r;
    long tokens = 0; /* a short cache is not worth waking the worker threads */
    for (long r = 0; r < a->bh; r++) tokens += LEN(a, r);
    const int parallel = tokens * g * a->d >= PARALLEL_MIN_MACS;
    if (items) {
#pragma omp parallel for schedule(static) num_threads(items < threads ? (int)items : threads) \
    if (parallel)
        for (long item = 0; item < items; item++) {
            const long r = owner[item], t0 = (item - first[r]) * SPAN_TOKENS;
            const long t1 = t0 + SPAN_TOKENS < LEN(a, r) ? t0 + SPAN_TOKENS : LEN(a, r);
            span(a, r, t0, t1, partial + item * width, stats + item * g,
                 stats + (items + item) * g);
        }
    }
    for (long r = 0; r < a->bh; r++)
        merge(a, r, first[r + 1] - first[r], partial + first[r] * width, stats + first[r] * g,
              stats + (items + first[r]) * g);
    free(first);
    free(owner);
    free(partial);
    free(stats);
    return 0;
}

/* The entry point (ctypes): pointers, then strides and sizes as longs (see Args). Returns 0, or
   1 for sizes it cannot serve, 2 when its scratch cannot be allocated (nothing written then). */
int ragged_decode_attention(const float *q, long s_qbh, long s_qg,
                            const float *k, long s_kblk, long s_kt,
                            const float *v, long s_vblk, long s_vt,
                            const int64_t *k_table, long s_ktbh,
                            const int64_t *v_table, long s_vtbh, long block_tokens,
                            const int64_t *lengths, long uniform, float *out,
                            long bh, long g, long d, float scaling, int threads) {
    if (bh <= 0 || g <= 0 || d <= 0 || block_tokens <= 0) return 1;
    const Args a = {q, s_qbh, s_qg, k, s_kblk, s_kt, v, s_vblk, s_vt, k_table, s_ktbh,
                    v_table, s_vtbh, block_tokens, lengths, uniform, out, bh, g, d, scaling};
    return decode(&a, threads);
}
