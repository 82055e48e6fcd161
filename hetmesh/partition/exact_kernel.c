/* A few rows of an fp32 linear layer, each output summed in one fixed order
 * (issue 44, item 5; hetmesh/partition/exact_kernel.py builds and proves it).
 *
 * out[i][j] = sum over k of x[i][k] * w[j][k], the sum cut into blocks of `block`
 * from k = 0; inside a block one fused multiply-add chain in k order from 0, the
 * blocks' sums added in order (out = b0; out = out + b1; ...): the order AMD's
 * EPYC's MKL takes in a call of 12 rows or more or a multiple of 4, so a row gets
 * here the bits it gets there. The weight is row-major (out x in, rows `ldw`
 * apart): 16 outputs' rows are read 16 inputs at a time and turned in registers,
 * so one vector holds 16 outputs' weights for one input (AVX2: 8 outputs by 8
 * inputs; else a plain loop, one output at a time). Built with
 * -ffp-contract=off: every fused product is written out, none is made by the
 * compiler. Never -ffast-math.
 */
#include <stddef.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define ROWS 8 /* rows per pass over the weight */

/* 16 x 16 floats turned: r[k] (16 outputs' weights at input k) from r[j] (output
 * j's weights at 16 inputs). */
static inline void turn16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        for (int h = 0; h < 2; h++) {
            __m512d a = _mm512_castps_pd(t[i + h]);
            __m512d b = _mm512_castps_pd(t[i + h + 2]);
            r[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            r[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    }
    /* r[4q + s] now holds, in its 128-bit lane L, outputs 4q..4q+3 at input 4L + s;
     * two lane shuffles gather input c's 16 outputs into r[c] */
    for (int i = 0; i < 8; i++) {
        int a = (i / 4) * 8 + (i % 4);
        t[a] = _mm512_shuffle_f32x4(r[a], r[a + 4], 0x88);
        t[a + 4] = _mm512_shuffle_f32x4(r[a], r[a + 4], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* outputs j0 .. j0 + n (n <= 16) of `m` (<= ROWS) rows; inlined per m, so that the
 * accumulators stay in registers */
static inline __attribute__((always_inline)) void tile16(const float *x, long m, long ldx,
                                                         const float *w, long n, long k,
                                                         long ldw, float *out, long ldo,
                                                         long block) {
    __mmask16 outs = (__mmask16)((1u << n) - 1u);
    const float *row[16];
    for (int j = 0; j < 16; j++)
        row[j] = w + (j < n ? j : n - 1) * ldw; /* past the last output: its row again */
    for (long b0 = 0; b0 < k; b0 += block) {
        long end = b0 + block < k ? b0 + block : k;
        __m512 acc[ROWS];
        for (int i = 0; i < ROWS; i++)
            acc[i] = _mm512_setzero_ps();
        for (long c = b0; c < end; c += 16) {
            long count = end - c < 16 ? end - c : 16;
            __mmask16 ins = (__mmask16)((1u << count) - 1u);
            __m512 r[16];
            for (int j = 0; j < 16; j++)
                r[j] = _mm512_maskz_loadu_ps(ins, row[j] + c);
            turn16(r);
            for (long q = 0; q < count; q++) {
                for (long i = 0; i < m; i++) {
                    __m512 xi = _mm512_set1_ps(x[i * ldx + c + q]);
                    acc[i] = _mm512_fmadd_ps(xi, r[q], acc[i]);
                }
            }
        }
        for (long i = 0; i < m; i++) {
            float *o = out + i * ldo;
            __m512 sum = acc[i];
            if (b0 > 0)
                sum = _mm512_add_ps(_mm512_maskz_loadu_ps(outs, o), acc[i]);
            _mm512_mask_storeu_ps(o, outs, sum);
        }
    }
}

int hm_width(void) { return 16; }

int hm_pass(void) { return ROWS; }

void hm_rows(const float *x, long m, long ldx, const float *w, long n, long k, long ldw,
             float *out, long ldo, long block, long j0, long j1) {
    (void)n;
    for (long i0 = 0; i0 < m; i0 += ROWS) {
        long rows = m - i0 < ROWS ? m - i0 : ROWS;
        for (long j = j0; j < j1; j += 16) {
            long outs = j1 - j < 16 ? j1 - j : 16;
            const float *xi = x + i0 * ldx;
            const float *wj = w + j * ldw;
            float *o = out + i0 * ldo + j;
            switch (rows) {
#define TILE(M)                                                                            \
    case M:                                                                                \
        tile16(xi, M, ldx, wj, outs, k, ldw, o, ldo, block);                                \
        break;
                TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
            }
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define ROWS 4 /* rows per pass (16 ymm registers: 4 sums, 8 weights, a few temps) */

/* 8 x 8 floats turned: r[k] (8 outputs' weights at input k) from r[j] */
static inline void turn8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

static inline __m256i first(long count) { /* lanes below count set */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __attribute__((always_inline)) void tile8(const float *x, long m, long ldx,
                                                        const float *w, long n, long k,
                                                        long ldw, float *out, long ldo,
                                                        long block) {
    __m256i outs = first(n);
    const float *row[8];
    for (int j = 0; j < 8; j++)
        row[j] = w + (j < n ? j : n - 1) * ldw;
    for (long b0 = 0; b0 < k; b0 += block) {
        long end = b0 + block < k ? b0 + block : k;
        __m256 acc[ROWS];
        for (int i = 0; i < ROWS; i++)
            acc[i] = _mm256_setzero_ps();
        for (long c = b0; c < end; c += 8) {
            long count = end - c < 8 ? end - c : 8;
            __m256 r[8];
            if (count == 8) {
                for (int j = 0; j < 8; j++)
                    r[j] = _mm256_loadu_ps(row[j] + c);
            } else {
                __m256i ins = first(count);
                for (int j = 0; j < 8; j++)
                    r[j] = _mm256_maskload_ps(row[j] + c, ins);
            }
            turn8(r);
            for (long q = 0; q < count; q++) {
                for (long i = 0; i < m; i++) {
                    __m256 xi = _mm256_set1_ps(x[i * ldx + c + q]);
                    acc[i] = _mm256_fmadd_ps(xi, r[q], acc[i]);
                }
            }
        }
        for (long i = 0; i < m; i++) {
            float *o = out + i * ldo;
            __m256 sum = acc[i];
            if (b0 > 0)
                sum = _mm256_add_ps(_mm256_maskload_ps(o, outs), acc[i]);
            _mm256_maskstore_ps(o, outs, sum);
        }
    }
}

int hm_width(void) { return 8; }

int hm_pass(void) { return ROWS; }

void hm_rows(const float *x, long m, long ldx, const float *w, long n, long k, long ldw,
             float *out, long ldo, long block, long j0, long j1) {
    (void)n;
    for (long i0 = 0; i0 < m; i0 += ROWS) {
        long rows = m - i0 < ROWS ? m - i0 : ROWS;
        for (long j = j0; j < j1; j += 8) {
            long outs = j1 - j < 8 ? j1 - j : 8;
            const float *xi = x + i0 * ldx;
            const float *wj = w + j * ldw;
            float *o = out + i0 * ldo + j;
            switch (rows) {
#define TILE(M)                                                                            \
    case M:                                                                                \
        tile8(xi, M, ldx, wj, outs, k, ldw, o, ldo, block);                                 \
        break;
                TILE(1) TILE(2) TILE(3) TILE(4)
#undef TILE
            }
        }
    }
}

#else /* plain C: the same order, one output at a time */

int hm_width(void) { return 1; }

int hm_pass(void) { return 1; }

void hm_rows(const float *x, long m, long ldx, const float *w, long n, long k, long ldw,
             float *out, long ldo, long block, long j0, long j1) {
    (void)n;
    for (long i = 0; i < m; i++) {
        for (long j = j0; j < j1; j++) {
            const float *wj = w + j * ldw;
            const float *xi = x + i * ldx;
            float total = 0.0f;
            for (long b0 = 0; b0 < k; b0 += block) {
                long end = b0 + block < k ? b0 + block : k;
                float acc = 0.0f;
                for (long c = b0; c < end; c++)
                    acc = __builtin_fmaf(xi[c], wj[c], acc);
                total = b0 > 0 ? total + acc : acc;
            }
            out[i * ldo + j] = total;
        }
    }
}

#endif
