/* InfiniGen's speculation on CPU (methods/kernels/speculation_cpu.py): from the partial query
   and the partial key cache of one layer, which stored tokens to fetch, in one call.

   For every (batch row, KV head) `bh`, its g query rows (already multiplied by the partial
   columns of the skewing matrix) score every stored token on the k partial columns of the
   channel-major partial keys pk (k, T):
     score[t] = max_i sum_c q[i, c] * pk[c, t]        (the group's max logit, `group_reduce=max`)
     count    = #{t : score[t] > max_t score - alpha}  (tokens the next layer is predicted to need)
     n        = count clamped to [1, cap] (or, shared, the floor of the mean count over heads)
     top      = the n best-scored slots in slot order, then cap - n other slots (unused)
   The n best are found by a quickselect of the n-th largest score and one pass (no sort: the
   fetched set is a set, and slot order reads the host store front to back). Work items are
   heads, in one OpenMP region (a thread per MIN_WORK multiply-adds at most); each head's result
   is its own, so nothing depends on the thread count. Strides are in elements; last axes are
   unit. */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The n-th largest of x[0:len] (1 <= n <= len); reorders x. Quickselect, median-of-three. */
static float nth_largest(float *x, long len, long n) {
    long lo = 0, hi = len - 1, want = n - 1; /* position `want` in descending order */
    while (lo < hi) {
        const long mid = lo + (hi - lo) / 2;
        float a = x[lo], b = x[mid], c = x[hi];
        const float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        long i = lo, j = hi;
        while (i <= j) { /* descending: larger values to the left */
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) {
                const float tmp = x[i];
                x[i++] = x[j];
                x[j--] = tmp;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return x[want];
    }
    return x[want];
}

/* top[0:n] = the n best-scored slots, in slot order (equal scores at the boundary: the lower
   slots); top[n:cap] = other slots, in slot order (distinct; marked unused by the count). */
static void select_slots(const float *s, long tokens, long n, long cap, float *scratch,
                         int64_t *top) {
    memcpy(scratch, s, sizeof(float) * (size_t)tokens);
    const float v = nth_largest(scratch, tokens, n);
    long above = 0;
    for (long t = 0; t < tokens; t++) above += s[t] > v;
    long ties = n - above, taken = 0, rest = n;
    for (long t = 0; t < tokens && (taken < n || rest < cap); t++) {
        if (s[t] > v || (s[t] == v && ties > 0)) {
            ties -= s[t] == v;
            top[taken++] = t;
        } else if (rest < cap) {
            top[rest++] = t;
        }
    }
}

/* Scores of one head: the group's max partial logit per token; returns how many tokens score
   above the max - alpha. Keys are channel-major `(k, T)`: for a block of tokens, each channel
   adds q[i, c] times a contiguous run of keys (vector multiply-adds along the tokens). */
#define BLOCK 64
#define MIN_WORK (1L << 20) /* multiply-adds per thread, at least */
static long head_scores(const float *q, long s_qg, const float *pk, long s_pc, long g, long k,
                        long tokens, float alpha, float *scores) {
    float top_score = -FLT_MAX, acc[g][BLOCK];
    for (long t0 = 0; t0 < tokens; t0 += BLOCK) {
        const long n = tokens - t0 < BLOCK ? tokens - t0 : BLOCK;
        memset(acc, 0, sizeof(acc));
        for (long c = 0; c < k; c++) {
            const float *key = pk + c * s_pc + t0;
            for (long i = 0; i < g; i++) {
                const float qc = q[i * s_qg + c];
                float *a = acc[i];
                if (n == BLOCK)
                    for (long j = 0; j < BLOCK; j++) a[j] += qc * key[j];
                else
                    for (long j = 0; j < n; j++) a[j] += qc * key[j];
            }
        }
        for (long j = 0; j < n; j++) {
            float best = acc[0][j];
            for (long i = 1; i < g; i++) best = acc[i][j] > best ? acc[i][j] : best;
            scores[t0 + j] = best;
            top_score = best > top_score ? best : top_score;
        }
    }
    const float threshold = top_score - alpha;
    long n = 0;
    for (long t = 0; t < tokens; t++) n += scores[t] > threshold;
    return n;
}

/* The entry point (ctypes): pointers, then strides and sizes as longs. `count` comes back as
   the number of slots each head uses, in [1, cap]: its own count (`shared` = 0) or the floor of
   the mean count over all heads (`shared` = 1, the official single buffer size). Returns 0, or
   1 for sizes it cannot serve, 2 when its scratch cannot be allocated (nothing written then). */
int speculate(const float *q, long s_qbh, long s_qg,  /* (BH, g, k) */
               const float *pk, long s_pbh, long s_pc, /* (BH, k, T) */
               long bh, long g, long k, long tokens, long cap, float alpha, int shared,
               int64_t *top, int64_t *count,           /* (BH, cap), (BH,) */
               int threads) {
    if (bh <= 0 || g <= 0 || k <= 0 || tokens <= 0 || cap <= 0 || cap > tokens) return 1;
    float *scores = malloc(sizeof(float) * (size_t)(2 * bh * tokens)); /* + select scratch */
    if (!scores) return 2;
    /* a thread per head, and per MIN_WORK multiply-adds at least: waking a sleeping worker
       costs more than a few hundred microseconds of work saves */
    const long by_work = bh * tokens * g * k / MIN_WORK;
    long team = bh < threads ? bh : threads;
    team = by_work < team ? (by_work > 1 ? by_work : 1) : team;
#pragma omp parallel num_threads((int)team)
    {
#pragma omp for schedule(static)
        for (long r = 0; r < bh; r++)
            count[r] = head_scores(q + r * s_qbh, s_qg, pk + r * s_pbh, s_pc, g, k, tokens,
                                   alpha, scores + r * tokens);
#pragma omp single
        if (shared) {
            long total = 0;
            for (long r = 0; r < bh; r++) total += count[r];
            for (long r = 0; r < bh; r++) count[r] = total / bh;
        }
#pragma omp for schedule(static)
        for (long r = 0; r < bh; r++) {
            count[r] = count[r] < 1 ? 1 : count[r] > cap ? cap : count[r];
            select_slots(scores + r * tokens, tokens, count[r], cap,
                         scores + (bh + r) * tokens, top + r * cap);
        }
    }
    free(scores);
    return 0;
}
