/* Decode attention that also accumulates the attention each key receives, on CPU
   (methods/kernels/colsum_attention_cpu.py): H2O's step in one call.

   For every (batch row, KV head) `bh`, its g query heads (one decode row each) attend over the T
   fp32 keys and values of that head:
     p[g, t]  = softmax_t(q[g] . k[t] * scaling)          (the exact softmax, fp32)
     out[g]   = sum_t p[g, t] v[t]
     acc[t]  += (sum_g p[g, t]) / g                         (the group mean, H2O's score)
   Probabilities are never returned: they live in a scratch row per query head. Optionally (a
   positions row given) it also picks the token to evict next, per `bh`: the lowest updated acc[t]
   among tokens with lo <= position[t] < hi (the unprotected ones; the first such slot on ties, as
   torch's argmin; slot 0 when none is eligible, as torch's argmin over all +inf).

   One OpenMP parallel region per call with no barrier inside (on a machine whose idle worker
   threads sleep, every barrier costs a wake-up): each (head, span of tokens) work item computes
   its scores, a softmax over its own span (max, exponentials, sum) and its unnormalised p.V;
   after the region each head's spans are merged serially in slot order (the global softmax, the
   output, the column sums, the eviction pick), so the result does not depend on the thread
   count. Strides are in elements; last axes are unit. */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define SPAN_TOKENS 256 /* tokens per work item (a fixed split: results do not depend on threads) */

typedef struct {
    const float *q; long s_qbh, s_qg;  /* (BH, g, D) */
    const float *k; long s_kbh, s_kt;  /* (BH, T, D) */
    const float *v; long s_vbh, s_vt;  /* (BH, T, D) */
    float *out;                        /* (BH, g, D) contiguous */
    float *acc; long s_abh;            /* (BH, T) */
    const int64_t *pos; long s_pbh;    /* (BH, T) text positions, or NULL: no eviction pick */
    long lo, hi;                       /* eligible for eviction: lo <= position < hi */
    long bh, g, d, tokens;
    float scaling;
} Args;

/* One work item, (head row r, tokens [t0, t1)): the span's scores for the g query rows, turned
   in place into e = exp(score - m) with the span's own max m[h] and sum l[h] (a split softmax:
   the spans are merged after the parallel region, so it needs no barrier inside), and the
   unnormalised partial[h] = sum_t e[h, t] v[t]. */
static void span(const Args *a, long r, long t0, long t1, float *scores, float *partial,
                 float *m, float *l) {
    const long g = a->g, d = a->d;
    float q[g * d];
    for (long h = 0; h < g; h++)
        for (long c = 0; c < d; c++)
            q[h * d + c] = a->q[r * a->s_qbh + h * a->s_qg + c] * a->scaling;
    for (long t = t0; t < t1; t++) {
        const float *k = a->k + r * a->s_kbh + t * a->s_kt;
        for (long h = 0; h < g; h++) {
            const float *qh = q + h * d;
            float dot = 0.f;
            for (long c = 0; c < d; c++) dot += qh[c] * k[c];
            scores[(r * g + h) * a->tokens + t] = dot;
        }
    }
    for (long h = 0; h < g; h++) {
        float *x = scores + (r * g + h) * a->tokens, top = x[t0], sum = 0.f;
        for (long t = t0 + 1; t < t1; t++) top = x[t] > top ? x[t] : top;
        for (long t = t0; t < t1; t++) sum += (x[t] = expf(x[t] - top));
        m[h] = top;
        l[h] = sum;
    }
    for (long t = t0; t < t1; t++) {
        const float *v = a->v + r * a->s_vbh + t * a->s_vt;
        for (long h = 0; h < g; h++) {
            const float e = scores[(r * g + h) * a->tokens + t];
            float *o = partial + h * d;
            for (long c = 0; c < d; c++) o[c] += e * v[c];
        }
    }
}

/* Head row r after its spans: out = the spans' partials rescaled to the global softmax, acc +=
   the group mean of the normalised probabilities, and (when asked) the eviction pick. */
static void merge(const Args *a, long r, long spans, const float *scores, const float *partial,
                  const float *m, const float *l, int64_t *slot) {
    const long g = a->g, d = a->d;
    float top[g], total[g], coef[spans * g];
    for (long h = 0; h < g; h++) {
        top[h] = m[h];
        for (long s = 1; s < spans; s++) top[h] = m[s * g + h] > top[h] ? m[s * g + h] : top[h];
        total[h] = 0.f;
        for (long s = 0; s < spans; s++) total[h] += l[s * g + h] * expf(m[s * g + h] - top[h]);
        for (long s = 0; s < spans; s++) coef[s * g + h] = expf(m[s * g + h] - top[h]) / total[h];
    }
    float *o = a->out + r * g * d;
    memset(o, 0, sizeof(float) * g * d);
    for (long s = 0; s < spans; s++)
        for (long h = 0; h < g; h++)
            for (long c = 0; c < d; c++)
                o[h * d + c] += coef[s * g + h] * partial[(s * g + h) * d + c];
    float *acc = a->acc + r * a->s_abh;
    const float inv_g = 1.f / (float)g;
    for (long s = 0; s < spans; s++) {
        const long t1 = (s + 1) * SPAN_TOKENS < a->tokens ? (s + 1) * SPAN_TOKENS : a->tokens;
        for (long h = 0; h < g; h++) {
            const float *e = scores + (r * g + h) * a->tokens, cf = coef[s * g + h] * inv_g;
            for (long t = s * SPAN_TOKENS; t < t1; t++) acc[t] += e[t] * cf;
        }
    }
    if (!slot) return;
    /* two branch-free passes (the first vectorises): the lowest eligible score, then its first
       slot; FLT_MAX stands for "protected" (scores are probabilities summed, never that large) */
    const int64_t *pos = a->pos + r * a->s_pbh;
    float low = FLT_MAX;
    for (long t = 0; t < a->tokens; t++) {
        const float x = pos[t] >= a->lo && pos[t] < a->hi ? acc[t] : FLT_MAX;
        low = x < low ? x : low;
    }
    *slot = 0;
    if (low == FLT_MAX) return;
    for (long t = 0; t < a->tokens; t++)
        if (acc[t] == low && pos[t] >= a->lo && pos[t] < a->hi) {
            *slot = t;
            return;
        }
}

static int decode(const Args *a, int64_t *slots, int threads) {
    const long spans = (a->tokens + SPAN_TOKENS - 1) / SPAN_TOKENS, items = a->bh * spans;
    const long g = a->g, width = g * a->d;
    float *scores = malloc(sizeof(float) * (size_t)(a->bh * g * a->tokens));
    float *partial = calloc((size_t)(items * width), sizeof(float));
    float *stats = malloc(sizeof(float) * (size_t)(2 * items * g)); /* m, then l, per item */
    if (!scores || !partial || !stats) {
        free(scores);
        free(partial);
        free(stats);
        return 2;
    }
    /* one parallel region, one barrier: its end (fewer wake-ups of sleeping worker threads) */
#pragma omp parallel for schedule(static) num_threads(items < threads ? (int)items : threads)
    for (long item = 0; item < items; item++) {
        const long t0 = (item % spans) * SPAN_TOKENS;
        const long t1 = t0 + SPAN_TOKENS < a->tokens ? t0 + SPAN_TOKENS : a->tokens;
        span(a, item / spans, t0, t1, scores, partial + item * width, stats + item * g,
             stats + (items + item) * g);
    }
    for (long r = 0; r < a->bh; r++)
        merge(a, r, spans, scores, partial + r * spans * width, stats + r * spans * g,
              stats + (items + r * spans) * g, slots ? slots + r : NULL);
    free(scores);
    free(partial);
    free(stats);
    return 0;
}

/* The entry point (ctypes): pointers, then strides and sizes as longs (see Args). Returns 0, or
   1 for sizes it cannot serve, 2 when its scratch cannot be allocated (nothing written then). */
int colsum_decode_attention(const float *q, long s_qbh, long s_qg,
                             const float *k, long s_kbh, long s_kt,
                             const float *v, long s_vbh, long s_vt,
                             float *out, float *acc, long s_abh,
                             const int64_t *pos, long s_pbh, long lo, long hi, int64_t *slots,
                             long bh, long g, long d, long tokens, float scaling, int threads) {
    if (bh <= 0 || g <= 0 || d <= 0 || tokens <= 0) return 1;
    const Args a = {q, s_qbh, s_qg, k, s_kbh, s_kt, v, s_vbh, s_vt, out, acc, s_abh,
                    pos, s_pbh, lo, hi, bh, g, d, tokens, scaling};
    return decode(&a, pos ? slots : NULL, threads);
}
