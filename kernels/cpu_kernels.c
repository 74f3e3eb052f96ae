/* pdchat CPU kernels: the small-batch decode path, where PyTorch's per-op overhead and its BLAS
 * matrix-vector products (about a third of this machine's memory bandwidth) dominate a step.
 *
 * Built on first use by kernels/cpu.py with the system C compiler for the machine it runs on
 * (-O3 -march=native -fopenmp-simd: OpenMP's `simd` pragmas only, no OpenMP runtime; the threads
 * are the pool in cpu_pool.h) and called through ctypes. Every function has a PyTorch twin in
 * kernels/reference.py with the same semantics; tests compare the two. All tensors are fp32 and
 * row-major unless noted; row strides are in elements. `threads` is passed explicitly: the engine
 * steps on its own thread and decides how many cores a step may use.
 *
 * The int8 product has one intrinsics path per instruction set (below: AVX-512 VNNI, AVX-VNNI,
 * AVX2, NEON with the dot-product extension) and a portable one; the build takes the best path the
 * compiler's target has, and -DPDCHAT_INT8_PATH=n forces a lower one (the tests run every path
 * this CPU supports). Everything else is portable C whose `omp simd` loops the compiler vectorizes.
 */
#include <math.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PD_INT8_PORTABLE 0
#define PD_INT8_AVX2 1
#define PD_INT8_AVXVNNI 2
#define PD_INT8_AVX512VNNI 3
#define PD_INT8_NEON_DOT 4
#ifndef PDCHAT_INT8_PATH
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PDCHAT_INT8_PATH PD_INT8_AVX512VNNI
#elif defined(__AVXVNNI__)
#define PDCHAT_INT8_PATH PD_INT8_AVXVNNI
#elif defined(__AVX2__) && defined(__FMA__)
#define PDCHAT_INT8_PATH PD_INT8_AVX2
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define PDCHAT_INT8_PATH PD_INT8_NEON_DOT
#else
#define PDCHAT_INT8_PATH PD_INT8_PORTABLE
#endif
#endif

#if PDCHAT_INT8_PATH == PD_INT8_AVX512VNNI && !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#error "the AVX-512 VNNI int8 path needs -mavx512f -mavx512bw -mavx512vnni"
#elif PDCHAT_INT8_PATH == PD_INT8_AVXVNNI && !(defined(__AVXVNNI__) && defined(__FMA__))
#error "the AVX-VNNI int8 path needs -mavxvnni -mfma"
#elif PDCHAT_INT8_PATH == PD_INT8_AVX2 && !(defined(__AVX2__) && defined(__FMA__))
#error "the AVX2 int8 path needs -mavx2 -mfma"
#elif PDCHAT_INT8_PATH == PD_INT8_NEON_DOT && !(defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD))
#error "the NEON int8 path needs an aarch64 target with +dotprod"
#endif

#if PDCHAT_INT8_PATH == PD_INT8_NEON_DOT
#include <arm_neon.h>
#elif PDCHAT_INT8_PATH != PD_INT8_PORTABLE || defined(__AVX__)
#include <immintrin.h>      /* the x86 int8 paths, and the fp32 products' transposition (transpose_rows) */
#endif

/* The u8-by-s8 dot products (VNNI's dpbusd, and the portable loop) see the weights as stored,
 * q + 128, and subtract 128 * sum(x) afterwards; AVX2 and NEON multiply the signed q directly. */
#define PD_INT8_OFFSET (PDCHAT_INT8_PATH == PD_INT8_AVX512VNNI || PDCHAT_INT8_PATH == PD_INT8_AVXVNNI || \
                        PDCHAT_INT8_PATH == PD_INT8_PORTABLE)

/* Where a prefetch puts its line (__builtin_prefetch's locality: prefetcht0 and prefetcht2 on
 * x86). Streams read from memory a good way ahead go to L2: fetched into L1 they pushed out what
 * was in use or held up the loads they ran ahead of (each site says what it measured); a row needed
 * within a few hundred cycles goes to L1. */
#define INTO_L1 3
#define INTO_L2 1
/* Inlined whatever the compiler's size heuristics say. A helper whose only effects are prefetches
 * must be: GCC counts such a function pure and deletes calls to it that it has not inlined early
 * (GCC 12 dropped every fetch-ahead of the slices' attention tiles that way). */
#define INLINE static inline __attribute__((always_inline))

/* Products, attention and (for prefill-sized runs) the elementwise kernels run on the spinning
 * pool of cpu_pool.h: OpenMP's workers sleep between parallel regions and took tens of
 * microseconds to wake (splitting every product with OpenMP made a decode step 1.4x slower). */
#define ATTENTION_PAR_MACS (48LL << 10) /* attention on the pool: below this, a decode runs serially faster */
#include "cpu_pool.h"    /* parallel_rows(): products and attention run on it */

#define QBLOCK 64  /* int8 activations: one scale per block of 64 values, so an outlier spoils one block */


/* Workers started and workers asleep: a test checks that an idle pool stops spinning. */
void pd_pool_counts(int *workers, int *sleeping) {
    *workers = pool.workers;
    *sleeping = LOAD(pool.sleepers);
}

/* Whether idle workers spin for the next job (on: C products follow each other within
 * microseconds) or sleep at once (off: BLAS's OpenMP threads come next, and a spinning worker
 * would take a core from them). */
void pd_pool_spin(int on) {
    STORE(pool.spins, on ? POOL_SPINS : 0);
}

/* Which int8 dot product this build runs (PD_INT8_*): kernels/cpu.py names it. */
int pd_int8_path(void) {
    return PDCHAT_INT8_PATH;
}

/* exp for float in a form the compiler vectorizes (libm's expf is a scalar call): exp(x) = 2^n e^r
 * with n = round(x / ln 2) and r = x - n ln 2 (in two parts, so r stays exact), e^r by its Taylor
 * series to r^6 (|r| <= 0.35: relative error ~1e-7, like expf). Arguments are clamped to the float
 * range; below it the result is ~1e-38 instead of a denormal or 0, which no caller can tell apart. */
#define EXP_LOG2E 1.44269504f
#define EXP_LN2_HI 0.693145751953125f          /* ln 2 in two parts: n * EXP_LN2_HI is exact */
#define EXP_LN2_LO 1.428606765330187e-06f
/* e^r by its series to r^6 with FMA(a, b, c) = a * b + c: one definition for exp_fast and exp_lanes */
#define EXP_SERIES(FMA, r) \
    FMA(FMA(FMA(FMA(FMA(FMA(1.f / 720.f, r, 1.f / 120.f), r, 1.f / 24.f), r, 1.f / 6.f), r, 0.5f), r, 1.f), r, 1.f)
static inline float exp_fast(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;   /* (fminf/fmaxf would block vectorizing) */
    float n = rintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_LN2_HI, x);
    r = fmaf(n, -EXP_LN2_LO, r);
    float p = EXP_SERIES(fmaf, r);
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};   /* 2^n */
    return p * scale.f;
}

static inline float dot_f32(const float *a, const float *b, int n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* ---- exact 8-bit blocks: an fp32 matrix every 32 weights of whose rows are one scale times
 * integers in -127..127 (what a GGUF Q8_0 matrix reads as in fp32: the default model's embedding
 * and tied LM head) is held as those integers and scales, a quarter of its bytes, and its products
 * rebuild each weight (scale * q, exact in fp32) on the way: the same sums as from the fp32
 * matrix, bit for bit, on every path below (held by panels too, below 5 rows the sums of the
 * fp32 strips rather than of its dot products: exact blocks by panels). */
#define EXACT_BLOCK 32

/* q[N, K] and s[N, K / 32] with s * q == w bit for bit, if w has that form (K a multiple of 32);
 * returns 0 at the first block that does not (q and s are then partly written). A block's scale
 * is its largest magnitude over 127: its largest weight is then 127 times the scale exactly. */
int pd_exact_int8_blocks(const float *w, int64_t N, int K, int8_t *q, float *s) {
    if (K % EXACT_BLOCK) return 0;
    for (int64_t b = 0; b < N * (K / EXACT_BLOCK); b++) {
        const float *wb = w + b * EXACT_BLOCK;
        float amax = 0.f;
        for (int i = 0; i < EXACT_BLOCK; i++) amax = fabsf(wb[i]) > amax ? fabsf(wb[i]) : amax;
        float d = amax / 127.f;
        for (int i = 0; i < EXACT_BLOCK; i++) {
            float r = d > 0.f ? rintf(wb[i] / d) : 0.f;
            float back = d * r;
            /* (-0 fails: its integer rebuilds as +0) */
            if (!(fabsf(r) <= 127.f) || memcmp(&back, wb + i, sizeof back) || (r == 0.f && signbit(wb[i]))) return 0;
            q[b * EXACT_BLOCK + i] = (int8_t)r;
        }
        s[b] = d;
    }
    return 1;
}

/* Exact Q4 blocks: an fp32 matrix whose every 32 weights of a row are d * u + m with u in 0..15,
 * d * u exact in fp32 (so fused or not, the sum rounds once) and m the group's least weight (a
 * GGUF Q4_1 matrix read as fp32: every layer matrix of the default model) is held as its nibbles,
 * the int4 layout (byte i: weight i low, weight 16 + i high), and (d, m) per group in fp32: 0.75
 * bytes a weight against fp32's 4, and the products rebuild each weight on the way, so their sums
 * are the fp32 matrix's bit for bit. */
#define Q4X_GROUP_BYTES (EXACT_BLOCK / 2)

/* Whether group g (32 weights) is d * u + m for this d, its nibbles then written to q. */
static int q4_group_as(const float *wg, float d, float m, uint8_t *q) {
    uint8_t u[EXACT_BLOCK];
    for (int i = 0; i < EXACT_BLOCK; i++) {
        float r = d > 0.f ? rintf((wg[i] - m) / d) : 0.f;
        float product = d * r, back = product + m;
        /* (d * u not exact would round twice where a fused rebuild rounds once; -0 rebuilds as +0) */
        if (!(r >= 0.f && r <= 15.f) || fmaf(d, r, -product) != 0.f || memcmp(&back, wg + i, sizeof back))
            return 0;
        u[i] = (uint8_t)r;
    }
    for (int i = 0; i < Q4X_GROUP_BYTES; i++) q[i] = (uint8_t)(u[i] | u[i + Q4X_GROUP_BYTES] << 4);
    return 1;
}

/* The fp16 value nearest to v (ties to even) as a float, for v in fp16's normal range or 0. */
static float nearest_fp16(float v) {
    int e;
    frexpf(v, &e);                            /* v = f * 2^e, f in [0.5, 1) */
    float step = ldexpf(1.f, (e < -13 ? -13 : e) - 11);   /* 11 significant bits; subnormals' step below 2^-14 */
    return rintf(v / step) * step;
}

struct q4x_find_job { const float *w; uint8_t *q; float *dm; int K; int *failed; };

/* Rows [lo, hi) of a q4x_find_job, until a group without the form (any thread's). A Q4_1 group's d
 * is fp16, its largest weight 15 d + m; (max - min) / 15 in fp32 lands within rounding of d, so d
 * is tried as that value rounded to fp16, then as it is. A group of one value has d = 0. */
static void q4x_find_rows(const void *p, int lo, int hi) {
    const struct q4x_find_job *j = p;
    int G = j->K / EXACT_BLOCK;
    for (int64_t g = (int64_t)lo * G; g < (int64_t)hi * G; g++) {
        if (g % G == 0 && __atomic_load_n(j->failed, __ATOMIC_RELAXED)) return;
        const float *wg = j->w + g * EXACT_BLOCK;
        float low = wg[0], high = wg[0];
        for (int i = 1; i < EXACT_BLOCK; i++) {
            low = wg[i] < low ? wg[i] : low;
            high = wg[i] > high ? wg[i] : high;
        }
        float d = (high - low) / 15.f, d16 = nearest_fp16(d);
        uint8_t *qg = j->q + g * Q4X_GROUP_BYTES;
        if (isfinite(d) && isfinite(low) && q4_group_as(wg, d16, low, qg)) d = d16;
        else if (!(isfinite(d) && isfinite(low) && q4_group_as(wg, d, low, qg))) {
            __atomic_store_n(j->failed, 1, __ATOMIC_RELAXED);
            return;
        }
        j->dm[2 * g] = d;
        j->dm[2 * g + 1] = low;
    }
}

/* q[N, K / 2] and dm[N, K / 32, 2] with each group's weights d * u + m bit for bit, if w has that
 * form (K a multiple of 32), on the pool; returns 0 soon after a group that does not (q and dm are
 * then partly written). The default model's 210 layer matrices (106 M weights) took 0.55 s on one
 * thread and 0.27 s on two (2-core AMD EPYC, Zen 3, AVX2, 2026-12-03). */
int pd_exact_q4_blocks(const float *w, int64_t N, int K, uint8_t *q, float *dm, int threads) {
    if (K % EXACT_BLOCK || N > INT_MAX) return 0;
    int failed = 0;
    struct q4x_find_job job = {w, q, dm, K, &failed};
    parallel_rows(q4x_find_rows, &job, (int)N, row_chunk((int)N, threads), threads);
    return !failed;
}

/* ---- products for a few activation rows, one weight row at a time ------------------------------
 * Each output is a dot product in a fixed order: four vectors of 8 partial sums (k's product added
 * into lane k % 8 of vector (k % 32) / 8, k in order), the four vectors added pairwise and their
 * lanes in a fixed tree, then the k past the last multiple of 32 one at a time. Four chains of
 * multiply-adds, where GCC made one vector of sums of a plain loop, each add waiting on the last:
 * hidden while fp32 weights came from memory, not once exact blocks cut their bytes. The default
 * model's LM head (49,152 rows of 576, two threads, 2-core AMD EPYC, Zen 3, AVX2, 2026-11-28): in
 * a C harness, rows rebuilt and summed by that loop 3.8 ms, by four chains 2.0, fp32 5.4-5.9; here,
 * exact blocks 2.3-2.7 ms against fp32 5.5-7.1, fp32 as fast as through the old loop. */
typedef float f32x8 __attribute__((vector_size(8 * sizeof(float))));
#define FEW_MAX_ROWS 4      /* below OUTER_MIN_ROWS on every build */

/* The forms of weights the fp32 products read: fp32 rows, or exact blocks rebuilt on the way. */
enum { FORM_F32, FORM_Q8, FORM_Q4 };

struct few_job {
    const float *x, *w, *bias;       /* w: fp32 rows; NULL where exact blocks hold them */
    const int8_t *q8;                /* exact int8 blocks: the integers (scales: one per 32) */
    const uint8_t *q4;               /* exact Q4 blocks: the nibbles (scales: (d, m) per 32) */
    const float *scales;
    float *y;
    int M, N, K;
};

/* 8 int8 values as floats: by instructions that widen them where the build has them (GCC's own
 * conversion of a vector of int8 went a lane at a time, and the LM head took twice as long). */
INLINE f32x8 int8_as_floats(const int8_t *q) {
    f32x8 v;
#if defined(__AVX2__)
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
    memcpy(&v, &f, sizeof v);
#elif PDCHAT_INT8_PATH == PD_INT8_NEON_DOT
    int16x8_t h = vmovl_s8(vld1_s8(q));
    float32x4_t f[2] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)))};
    memcpy(&v, f, sizeof v);
#else
    for (int i = 0; i < 8; i++) v[i] = (float)q[i];
#endif
    return v;
}

/* 8 nibbles as floats: the low (shift 0) or high (shift 4) halves of 8 bytes. */
INLINE f32x8 nibbles_as_floats(const uint8_t *b, const int shift) {
    f32x8 v;
#if defined(__AVX2__)
    __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    __m256 f = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(wide, shift), _mm256_set1_epi32(15)));
    memcpy(&v, &f, sizeof v);
#else
    for (int i = 0; i < 8; i++) v[i] = (float)((b[i] >> shift) & 15);
#endif
    return v;
}

/* Weights k..k+7 of row n as a vector (exact blocks: rebuilt from the block's integers and
 * scale, or its nibbles and (d, m): in group order, weights 0-7 and 8-15 are the low nibbles of
 * bytes 0-7 and 8-15, 16-31 the high ones). */
INLINE f32x8 weights_8(const struct few_job *j, int64_t n, int k, const int form) {
    f32x8 w;
    int64_t g = n * (j->K / EXACT_BLOCK) + k / EXACT_BLOCK;
    if (form == FORM_Q8) {
        w = int8_as_floats(j->q8 + n * j->K + k) * j->scales[g];
    } else if (form == FORM_Q4) {
        int i = k % EXACT_BLOCK;
        const uint8_t *b = j->q4 + g * Q4X_GROUP_BYTES + i % Q4X_GROUP_BYTES;
        f32x8 u = i < Q4X_GROUP_BYTES ? nibbles_as_floats(b, 0) : nibbles_as_floats(b, 4);
        w = u * j->scales[2 * g] + j->scales[2 * g + 1];    /* (d * u exact: one rounding either way) */
    } else {
        memcpy(&w, j->w + n * j->K + k, sizeof w);
    }
    return w;
}

/* Rows of exact blocks ahead that few_rows_of fetches into L1 as it goes. An int8 row is a quarter
 * of a fp32 one's lines for the same arithmetic, and left to the hardware's prefetcher the default
 * model's LM head (49,152 rows of 576, caches flushed, two threads) read memory at 6-8 GB/s: 4.1-5.3
 * ms a decode row; 8 rows ahead 2.4 ms, 16 ahead 2.3 (2-core Intel Xeon, AVX-512, 2026-12-01). fp32
 * rows, near the memory's speed without it, gained within the noise at one row. Q4 blocks, fewer
 * bytes still, fetch as far ahead. */
#define Q8_AHEAD 8

/* Fetch row n's exact blocks into L1 (form: FORM_Q8 or FORM_Q4). */
INLINE void fetch_blocks(const struct few_job *j, int64_t n, const int form) {
    int64_t K = j->K, G = K / EXACT_BLOCK;
    if (form == FORM_Q8) {
        for (int k = 0; k < K; k += 64) __builtin_prefetch(j->q8 + n * K + k, 0, INTO_L1);
        __builtin_prefetch(j->scales + n * G, 0, INTO_L1);
    } else {
        for (int k = 0; k < K / 2; k += 64) __builtin_prefetch(j->q4 + n * (K / 2) + k, 0, INTO_L1);
        for (int g = 0; g < 2 * G; g += 16) __builtin_prefetch(j->scales + n * 2 * G + g, 0, INTO_L1);
    }
}

/* Weight rows [lo, hi) against M activation rows (M and form constants once inlined): each weight
 * row is read from memory once and serves every activation row from registers. */
INLINE void few_rows_of(const struct few_job *j, int lo, int hi, const int M, const int form) {
    int K = j->K, whole = K & ~31;
    for (int n = lo; n < hi; n++) {
        if (form != FORM_F32 && n + Q8_AHEAD < j->N) fetch_blocks(j, n + Q8_AHEAD, form);
        f32x8 acc[FEW_MAX_ROWS][4];
        for (int m = 0; m < M; m++)
            for (int v = 0; v < 4; v++) acc[m][v] = (f32x8){0};
        for (int k = 0; k < whole; k += 32)
            for (int v = 0; v < 4; v++) {
                f32x8 w = weights_8(j, n, k + 8 * v, form);
                for (int m = 0; m < M; m++) {
                    f32x8 x;
                    memcpy(&x, j->x + (int64_t)m * K + k + 8 * v, sizeof x);
                    acc[m][v] += w * x;
                }
            }
        float b = j->bias ? j->bias[n] : 0.f;
        for (int m = 0; m < M; m++) {
            f32x8 t = (acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]);
            float sum = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
            for (int k = whole; k < K; k++) sum += j->w[(int64_t)n * K + k] * j->x[(int64_t)m * K + k];  /* (fp32 only) */
            j->y[(int64_t)m * j->N + n] = sum + b;
        }
    }
}

/* (a copy of the loops for each count of rows and each form of weights) */
INLINE void few_rows_by_count(const struct few_job *j, int lo, int hi, const int form) {
    switch (j->M) {
    case 1: few_rows_of(j, lo, hi, 1, form); break;
    case 2: few_rows_of(j, lo, hi, 2, form); break;
    case 3: few_rows_of(j, lo, hi, 3, form); break;
    default: few_rows_of(j, lo, hi, 4, form);
    }
}

static void few_rows(const void *p, int lo, int hi) {
    const struct few_job *j = p;
    if (j->q8) few_rows_by_count(j, lo, hi, FORM_Q8);
    else if (j->q4) few_rows_by_count(j, lo, hi, FORM_Q4);
    else few_rows_by_count(j, lo, hi, FORM_F32);
}

/* From OUTER_MIN_ROWS activation rows on, the product runs in outer-product form: x is copied
 * transposed (k-major, its rows padded to a multiple of 8), and each weight, broadcast, multiplies
 * a strip of 8, 16, 24, 32 or 48 rows at once. A block of OUTER_W weight rows x a strip of rows keeps its
 * sums in registers for the whole of K (no reduction across a vector at the end), the weight block
 * stays in L1 for every strip, and a strip is read from L2 once per weight block. Dot products in
 * 4x4 register tiles, which re-read every activation row from L2 for each four weight rows, ran
 * at half its speed at 16-40 rows (a 16-stream decode step, a prefill slice beside a stream). Strips of 8
 * (half a vector of AVX-512) let 17-24 rows cost less than 32 do: the default model's products
 * over its 30 layers, 2-core AMD EPYC, 24 rows 32.6 ms against 39.5 padded to 32, 40 rows 52.7
 * against 59.3, 8 rows 18.0 against 21.1 (2026-11-27; the same bits). A strip of 8 also beats
 * those tiles at 4-7 rows; against one dot product at a time (few_rows, its sums then one chain:
 * faster than the tiles at 2-3 rows) it wins from 5 rows on AVX-512 (the layers' 5 rows 18.9 ms against 21.8; at 4 rows
 * 18.8 against 18.7, and the vocabulary's 4.3 against 3.4) and from 4 with 256-bit vectors (an
 * -march=haswell build here: 4 rows 18.4 against 26.9, 3 rows 19.9 against 21.4, 2 rows 19.8
 * against 15.0): OUTER_MIN_ROWS, below. 17-24 rows go as one strip of 24 rather than 16 and 8:
 * each weight broadcast once per k instead of twice, the 30 layers' products 2-7% faster in
 * alternating runs (24 rows four times, 17 and 20 twice; 2026-11-27, the same bits); one strip of
 * 40 was 9-12% slower than 32 and 8 (two runs). */
/* Weight rows of a block and the widest strip, so that a block x strip's sums fit the registers:
 * 8 x 48 rows = 24 of AVX-512's 32; with 16 vector registers (AVX2, AVX-VNNI: 256 bits) or NEON's
 * 32 of 128 bits, 6 x 16 rows (12 or 24). 8 x 48 there spilled sums to the stack in the inner loop:
 * an -march=haswell build here ran the 1B shape's 40-row products at 41-50 GF/s, 6 x 16 at 67-88,
 * and 16-32 rows 1.10-1.16x faster (the same bits: each sum still adds its k in order). */
#ifdef __AVX512F__
#define OUTER_W 8
#define OUTER_STRIP_MAX 48
#define OUTER_MIN_ROWS 5
#else
#define OUTER_W 6
#define OUTER_STRIP_MAX 16
#define OUTER_MIN_ROWS 4
#endif
_Static_assert(FEW_MAX_ROWS >= OUTER_MIN_ROWS - 1, "few_rows_of takes every count below the strips'");

/* The most rows a forward runs as one pd_layers call (products and attention in C); past them it
 * goes op by op, its products by chunks of these rows here or on BLAS, whichever this machine
 * runs faster (timed once, cpu_products.py). AVX-512 builds: 48, three vectors of 16 rows
 * (41-48 rows cost what 40 did; measured 2026-11-26). 256-bit x86 builds: 144, a 128-token chunk
 * beside up to 16 streams. BLAS at a few dozen rows repacks each weight matrix per product, and op
 * by op a 49-token prompt cost 1.7x a 48-token one. On a 2-core AMD EPYC (Zen 3, AVX2 only; the
 * default model, 2026-11-28; one engine, the limit switched round by round, six rounds, medians) a
 * lone prompt's first token in one call against op by op: fp32 157 vs 246 ms at 56 tokens, 174 vs
 * 271 at 64, 259 vs 345 at 96, 364 vs 456 at 128, 1.12-1.18x at 136-144 (the same path at 32, 48,
 * 129 and 160 tokens read 0.92-1.09x, the noise); int8 1.62-1.91x and int4 1.25-1.55x at 64-128
 * tokens. Past ~150 tokens BLAS is as fast. Other targets (Arm, x86 without AVX2) keep 48: not
 * measured. */
#if defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__)
#define FAST_ROWS 144
#else
#define FAST_ROWS 48
#endif

/* The weights of an outer job: fp32 rows (w), or rows that each block unpacks into a buffer of its
 * thread's first: int8 (u8: q + 128, one scale a row; AVX2's int8 prompt rows, below) or exact
 * blocks (q8, one scale per 32 weights; q4, (d, m) per 32). */
struct outer_job {
    const float *xt, *w, *bias;
    const uint8_t *u8;
    const int8_t *q8;
    const uint8_t *q4;
    const float *scales;
    float *y;
    int M, MP, N, K;
    int *failed;              /* set when a thread could not get its buffer */
};

/* This thread's scratch `which` of `bytes` (kept for its next calls: a fresh one per call would
 * fault its pages in each time); NULL if out of memory. */
enum scratch { SCRATCH_SUMS, SCRATCH_TILES, SCRATCH_AMX, SCRATCHES };  /* a worker's sums; a caller's packed rows; AMX's rings */
static void *thread_scratch(enum scratch which, size_t bytes) {
    static __thread void *buf[SCRATCHES];
    static __thread size_t have[SCRATCHES];
    if (bytes > have[which]) {
        void *grown = realloc(buf[which], bytes);
        if (!grown) return NULL;
        buf[which] = grown;
        have[which] = bytes;
    }
    return buf[which];
}

/* One int8 weight row (stored q + 128) as floats: out = scale * q. */
static inline void unpack_u8_row(const uint8_t *wr, float scale, float *out, int K) {
#pragma omp simd
    for (int k = 0; k < K; k++) out[k] = scale * (float)((int)wr[k] - 128);
}

/* Rows of exact blocks as their fp32 weights, which the outer products' strips then broadcast from
 * L1: by explicit vectors where the build has them. Left to vectorize the loops itself, GCC 12's
 * tuning for a Sapphire Rapids took 128-bit vectors and a chain of widenings, 50 instructions a
 * group of 32 nibbles where 16 bytes widen to 16 lanes in one; the unpacking took 18% of the
 * stepping thread's samples in a 16-stream decode (py-spy, 2-core Intel Xeon, AVX-512,
 * 2026-12-04), half what the strips' arithmetic took. The same values either way: d * u is exact (u < 16, d an fp16 number), so a fused or a
 * separate multiply-add rounds once. */
static void unpack_q8_row(const int8_t *q, const float *s, float *out, int K) {
    for (int g = 0; g < K / EXACT_BLOCK; g++) {
        const int8_t *b = q + g * EXACT_BLOCK;
        float *o = out + g * EXACT_BLOCK;
#if defined(__AVX512F__)
        __m512 scale = _mm512_set1_ps(s[g]);
        for (int i = 0; i < EXACT_BLOCK; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(
                                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + i))))));
#elif defined(__AVX2__)
        __m256 scale = _mm256_set1_ps(s[g]);
        for (int i = 0; i < EXACT_BLOCK; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(
                                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + i))))));
#else
#pragma omp simd
        for (int i = 0; i < EXACT_BLOCK; i++) o[i] = s[g] * (float)b[i];
#endif
    }
}

/* One row of exact Q4 blocks as its fp32 weights (weights 0-15 of a group the low nibbles of its
 * 16 bytes, 16-31 the high ones). */
static void unpack_q4x_row(const uint8_t *q, const float *dm, float *out, int K) {
    for (int g = 0; g < K / EXACT_BLOCK; g++) {
        const uint8_t *b = q + g * Q4X_GROUP_BYTES;
        float d = dm[2 * g], m = dm[2 * g + 1], *o = out + g * EXACT_BLOCK;
#if defined(__AVX512F__)
        __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b)), low = _mm512_set1_epi32(15);
        __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(_mm512_and_si512(u, low)), vm));
        _mm512_storeu_ps(o + Q4X_GROUP_BYTES, _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(_mm512_srli_epi32(u, 4)), vm));
#elif defined(__AVX2__)
        __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        for (int i = 0; i < Q4X_GROUP_BYTES; i += 8) {
            __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + i)));
            __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(u, _mm256_set1_epi32(15)));
            __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(u, 4));
            _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_mul_ps(vd, lo), vm));     /* (AVX2 without FMA too) */
            _mm256_storeu_ps(o + i + Q4X_GROUP_BYTES, _mm256_add_ps(_mm256_mul_ps(vd, hi), vm));
        }
#else
#pragma omp simd
        for (int i = 0; i < Q4X_GROUP_BYTES; i++) {
            o[i] = d * (float)(b[i] & 15) + m;
            o[i + Q4X_GROUP_BYTES] = d * (float)(b[i] >> 4) + m;
        }
#endif
    }
}

/* The outer job's weight rows [n0, n0 + nw) as fp32: where they are, or unpacked into `into`. */
static const float *weight_block(const struct outer_job *j, int n0, int nw, float *into) {
    int64_t K = j->K, G = K / EXACT_BLOCK;
    if (j->w) return j->w + n0 * K;
    for (int r = 0; r < nw; r++) {
        int64_t n = n0 + r;
        if (j->u8) unpack_u8_row(j->u8 + n * K, 1.f, into + r * K, j->K);    /* span_store scales */
        else if (j->q8) unpack_q8_row(j->q8 + n * K, j->scales + n * G, into + r * K, j->K);
        else unpack_q4x_row(j->q4 + n * (K / 2), j->scales + n * 2 * G, into + r * K, j->K);
    }
    return into;
}

/* A block of nw weight rows (OUTER_W but at a matrix's end) against the strip of SW activation rows
 * from m0, its sums into `part` (weight row r's at part + r * MP, as span_store takes them). Not
 * inlined: inlined into the loop over blocks (-march=haswell), its 12 sums spilled to the stack
 * there, and 32-144 rows took 7-27% longer. Every sum adds its k in order with a fused
 * multiply-add whatever the strip, so a row's result does not depend on the strip it is in (GCC,
 * left to contract `acc += w * x` itself, left the partial block's sums unfused in 8-row strips).
 * The next block is fetched into L2, not L1: there it pushed out the block and the strip in use,
 * and the default model's 30 layers of products took 14-21% longer at 8 rows and 8-10% at 16
 * (2-core AMD EPYC, 2026-11-27, alternating runs; 24-48 rows within the noise, -5% to +1.5%; an
 * -march=haswell build here, 6-row blocks, 4-12% longer at 4-32 rows). */
#define OUTER_STRIP_OF(NAME, W, SW, WIDTH)                                                       \
    WIDTH __attribute__((noinline)) static void NAME(const struct outer_job *j, const float *w, int n0, \
                                                     int nw, int m0, float *part) {          \
        float acc[W][SW];                                                                        \
        for (int r = 0; r < W; r++)                                                              \
            for (int m = 0; m < SW; m++) acc[r][m] = 0.f;                                        \
        const float *xt = j->xt + m0;                                                            \
        int K = j->K, MP = j->MP;                                                                \
        if (nw == W) {                                                                           \
            const float *ahead = w + (int64_t)W * K; /* the next block: fetched meanwhile */     \
            for (int k = 0; k < K; k++) {                                                        \
                const float *xk = xt + (int64_t)k * MP;                                          \
                if (j->w && m0 == 0 && (k & 15) == 0 && n0 + 2 * W <= j->N)                      \
                    for (int r = 0; r < W; r++) __builtin_prefetch(ahead + (int64_t)r * K + k, 0, INTO_L2); \
                for (int r = 0; r < W; r++) {                                                    \
                    float wr = w[(int64_t)r * K + k];                                            \
                    _Pragma("omp simd") for (int m = 0; m < SW; m++)                             \
                        acc[r][m] = __builtin_fmaf(wr, xk[m], acc[r][m]);                        \
                }                                                                                \
            }                                                                                    \
        } else {                                                                                 \
            for (int k = 0; k < K; k++) {                                                        \
                const float *xk = xt + (int64_t)k * MP;                                          \
                for (int r = 0; r < nw; r++) {                                                   \
                    float wr = w[(int64_t)r * K + k];                                            \
                    _Pragma("omp simd") for (int m = 0; m < SW; m++)                             \
                        acc[r][m] = __builtin_fmaf(wr, xk[m], acc[r][m]);                        \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < nw; r++)                                                             \
            for (int m = 0; m < SW; m++) part[(int64_t)r * MP + m0 + m] = acc[r][m];             \
    }
/* A strip wider than 8 rows keeps its sums in registers only as vectors of the build's full width
 * (6 x 16 rows: 12 of 16 ymm registers; 8 x 48: 24 of 32 zmm), but GCC's tuning for some CPUs
 * prefers narrower vectors (-march=native on a Zen 1: 128 bits; on a Skylake-X: 256), and with
 * those the sums spilled to the stack inside the loop over k. On a 2-core AMD EPYC (Zen 1, AVX2,
 * 2026-12-01) the default model's 30 layers of 16-row products took 80 ms that way, 58 at full
 * width. A strip of 8 fits either way, so it keeps the tuning's choice: there 12 sums of 128 bits
 * beat 6 of 256 (32 ms against 43 at 8 rows), since a 256-bit broadcast costs that CPU a vector
 * operation beside each multiply-add. (Clang takes no such attribute: there the tuning's width
 * stands, not measured.) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#define FULL_WIDTH __attribute__((target("prefer-vector-width=512")))
#elif defined(__GNUC__) && !defined(__clang__) && defined(__AVX__)
#define FULL_WIDTH __attribute__((target("prefer-vector-width=256")))
#else
#define FULL_WIDTH
#endif
#define OUTER_STRIP(SW, WIDTH) OUTER_STRIP_OF(outer_strip_##SW, OUTER_W, SW, WIDTH)
OUTER_STRIP(8, )
OUTER_STRIP(16, FULL_WIDTH)
#if OUTER_STRIP_MAX == 48
OUTER_STRIP(24, FULL_WIDTH)
OUTER_STRIP(32, FULL_WIDTH)
OUTER_STRIP(48, FULL_WIDTH)
#endif

#if OUTER_STRIP_MAX == 16 && defined(__AVX__)
#define OUTER_PAIR_8 1
/* The 8 rows past a product's strips of 16 against two weight blocks at once: 12 sums in
 * registers, as in a strip of 16, where one block's 6 leave the multiply-add units waiting (each
 * sum's next multiply-add waits for its last). On a 2-core AMD EPYC (Zen 3, AVX2, 2026-11-28) the
 * default model's 30 layers of 24-row products took 7-10% less time (paired medians of 20
 * alternating rounds), 40 rows 3.5% less; the same sums in the same order. At 8 rows alone (a
 * decode batch), where reading the weights sets the pace, it was 5-9% slower: those keep a block
 * at a time, as NEON builds do (not measured there). Where the tuning makes a strip of 8 twelve
 * sums of 128 bits (a Zen 1: FULL_WIDTH above) the pairs were 4-8% slower at 24 and 40 rows
 * (2026-12-01), so each machine times both (pd_outer_choose). */
OUTER_STRIP_OF(outer_strip_8_pair, (2 * OUTER_W), 8, FULL_WIDTH)
static int outer_pair_8 = 1;
#endif

/* 48 rows as three strips of 16 rather than one of 48 (pd_outer_choose): the same sums in the same
 * order, at a cost that depends on the CPU. On a 2-core AMD EPYC (Zen 4) three strips took the
 * default model's 48-row products in 62-63 ms where one took 70-71 (2026-11-27), where the
 * 48-row strip had been chosen on an Intel VM; so each machine times both. */
#if OUTER_STRIP_MAX == 48
static int outer_narrow_48;
/* Past 16 rows, whole strips of 16 (24 rows as a strip of 32, 40 as one of 48, the rows past M
 * zero) rather than strips of 8 at the end (pd_outer_choose): the same sums, and on some CPUs less
 * time. On a 2-core AMD EPYC (Zen 5, 2026-12-02) the default model's 30 layers of products took
 * 22 ms at 24 rows and 18 at 32, 29 at 40 and 27 at 48. Where it is set the step cost model counts
 * rows by 16 (pd_row_granule). */
static int outer_pad_16;
#define PADDED_ROWS(m) (outer_pad_16 && (m) > 16 ? ((m) + 15) & ~15 : ((m) + 7) & ~7)
#else
#define PADDED_ROWS(m) (((m) + 7) & ~7)
#endif

/* Weight rows [s0, s1) (s0 a multiple of OUTER_W) against every strip of activation rows, their
 * sums into part (row s0's first). */
static void outer_blocks(const struct outer_job *j, int s0, int s1, float *part, float *unpacked) {
    int64_t MP = j->MP;
    for (int n0 = s0; n0 < s1; n0 += OUTER_W) {
        int nw = s1 - n0 < OUTER_W ? s1 - n0 : OUTER_W, m0 = 0;
        const float *w = weight_block(j, n0, nw, unpacked);
        float *sums = part + (n0 - s0) * MP;
#if OUTER_STRIP_MAX == 48
        for (; j->MP - m0 > 48; m0 += 32) outer_strip_32(j, w, n0, nw, m0, sums);
        int left = j->MP - m0;    /* 8 to 48 rows: the weight block read once for all */
        if (left == 48 && outer_narrow_48)
            for (; m0 < j->MP; m0 += 16) outer_strip_16(j, w, n0, nw, m0, sums);
        else if (left == 48) outer_strip_48(j, w, n0, nw, m0, sums);
        else if (left == 24) outer_strip_24(j, w, n0, nw, m0, sums);     /* one strip: see the note above */
        else {            /* 8 to 40 rows: strips of 32, 16 and 8 as they fit */
            if (left >= 32) {
                outer_strip_32(j, w, n0, nw, m0, sums);
                m0 += 32, left -= 32;
            }
            if (left >= 16) {
                outer_strip_16(j, w, n0, nw, m0, sums);
                m0 += 16, left -= 16;
            }
            if (left > 0) outer_strip_8(j, w, n0, nw, m0, sums);
        }
#else
        for (; j->MP - m0 >= 16; m0 += 16) outer_strip_16(j, w, n0, nw, m0, sums);
        if (m0 == j->MP) continue;
#ifdef OUTER_PAIR_8
        if (outer_pair_8 && m0 > 0 && j->w && nw == OUTER_W && n0 + 2 * OUTER_W <= s1) {   /* the next block too */
            const float *next = w + (int64_t)OUTER_W * j->K;
            for (int m1 = 0; m1 < m0; m1 += 16) outer_strip_16(j, next, n0 + OUTER_W, OUTER_W, m1, sums + OUTER_W * MP);
            outer_strip_8_pair(j, w, n0, 2 * OUTER_W, m0, sums);
            n0 += OUTER_W;
            continue;
        }
#endif
        outer_strip_8(j, w, n0, nw, m0, sums);
#endif
    }
}

/* xt [K, MP] = x [M, K] transposed, rows M..MP-1 zero: what the strips read, one vector of rows per
 * k. It runs on the calling thread before the product is shared out, so it is paid in full: by
 * blocks of 8 x 8 in registers where the build has 256-bit vectors, one element at a time
 * elsewhere. On a 2-core AMD EPYC (2026-11-27) blocks took 24 x 1,536 in 6.6 us against 21.4
 * (the strided reads of one element at a time collide in the cache every 4 KB) and 24 x 576 in
 * 2.5 against 3.3; a slice step beside a stream (the default model, a 1,728-token newcomer)
 * spends 1.04-1.06 ms of its 30 layers' products here, against 1.73-1.81 before. */
#ifdef __AVX__
static inline void transpose_8x8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);         /* pairs of rows interleaved */
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {                     /* fours of rows, within each 128-bit half */
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {                        /* the halves of rows 0-3 and 4-7 joined */
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
#endif

static void transpose_rows(const float *x, float *xt, int M, int MP, int K) {
    int blocked = 0;                /* k below this went by blocks */
#ifdef __AVX__
    blocked = K & ~7;
    for (int k0 = 0; k0 < blocked; k0 += 8)
        for (int m0 = 0; m0 < MP; m0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = m0 + i < M ? _mm256_loadu_ps(x + (int64_t)(m0 + i) * K + k0) : _mm256_setzero_ps();
            transpose_8x8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(xt + (int64_t)(k0 + i) * MP + m0, r[i]);
        }
#endif
    for (int k = blocked; k < K; k++) {
        for (int m = 0; m < M; m++) xt[(int64_t)k * MP + m] = x[(int64_t)m * K + k];
        for (int m = M; m < MP; m++) xt[(int64_t)k * MP + m] = 0.f;
    }
}

/* The sums of weight rows [s0, s1) (part: weight row-major, MP floats a row), times the row's scale
 * for int8 weights, plus bias into y by activation rows, each row's stretch of the span at once,
 * 8 x 8 at a time in registers where the build has 256-bit vectors. int8's scale waits for here
 * rather than multiplying each weight as it is unpacked: AVX2's int8 products (Zen 3, the default
 * model's 30 layers, 2026-12-03, three alternating runs) took 3-4% less time at 8, 16 and 32 rows.
 * Stored from the strips, a block's sums went to rows N floats apart, 8 of a row at a time, and
 * where N x 4 bytes is a multiple of 2 KB those rows share one or two sets of L1: on a 2-core
 * Intel Xeon (AVX-512, 2026-12-01) 32 rows by 576 into 512 outputs ran at 99 GF/s on one thread,
 * into 520 at 125. */
static void span_store(const struct outer_job *j, int s0, int s1, const float *part) {
    int MP = j->MP, n0 = s0;
#ifdef __AVX__
    for (int m0 = 0; m0 < j->M; m0 += 8)
        for (int n = n0; n + 8 <= s1; n += 8) {
            __m256 r[8], b = j->bias ? _mm256_loadu_ps(j->bias + n) : _mm256_setzero_ps();
            __m256 scale = j->u8 ? _mm256_loadu_ps(j->scales + n) : _mm256_set1_ps(1.f);
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(part + (int64_t)(n - n0 + i) * MP + m0);
            transpose_8x8(r);
            for (int i = 0; i < 8 && m0 + i < j->M; i++)
                _mm256_storeu_ps(j->y + (int64_t)(m0 + i) * j->N + n, _mm256_add_ps(_mm256_mul_ps(r[i], scale), b));
        }
    n0 += (s1 - n0) & ~7;
#endif
    for (int m = 0; m < j->M; m++)
        for (int n = n0; n < s1; n++)
            j->y[(int64_t)m * j->N + n] = part[(int64_t)(n - s0) * MP + m] * (j->u8 ? j->scales[n] : 1.f)
                                          + (j->bias ? j->bias[n] : 0.f);
}

/* Weight rows of a span: their sums wait in the thread's part for span_store (16 KB at 32 rows
 * with AVX-512's blocks of 8, 12 KB with 6). */
#define OUTER_SPAN_ROWS (16 * OUTER_W)

/* Weight rows [lo, hi) (lo a multiple of OUTER_W) by spans of OUTER_SPAN_ROWS. */
static void outer_rows(const void *p, int lo, int hi) {
    const struct outer_job *j = p;
    size_t sums = (size_t)OUTER_SPAN_ROWS * j->MP;
    float *part = thread_scratch(SCRATCH_SUMS, sizeof(float) * (sums + (j->w ? 0 : (size_t)OUTER_W * j->K)));
    if (!part) {
        __atomic_store_n(j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int s0 = lo; s0 < hi; s0 += OUTER_SPAN_ROWS) {
        int s1 = s0 + OUTER_SPAN_ROWS < hi ? s0 + OUTER_SPAN_ROWS : hi;
        outer_blocks(j, s0, s1, part, part + sums);
        span_store(j, s0, s1, part);
    }
}

/* y = x @ W^T + bias in outer-product form, W fp32 (w), int8 (u8 and its row scales) or exact blocks
 * (q8 and its block scales), FAST_ROWS activation rows at a time: past them the transposed rows
 * outgrow L2 and every weight block re-reads them from further out. On a 2-core AMD EPYC (Zen 5,
 * AVX-512, 2026-12-02) the default model's products of 1,728 rows ran at 240-360 GF/s by 48 rows,
 * 230-320 all at once; MKL there, 140-170. Each row's sums are the same whatever its chunk.
 * Weight rows go out in chunks of about an eighth of a thread's share rather than a quarter, so
 * that less of a product's end falls to one thread: on a 2-core Intel Xeon (AVX-512, 2026-12-04)
 * the default model's 30 layers of 48-row products took 38.4-38.5 ms with quarters against
 * 33.3-34.9 with eighths, 32 rows 28.3-29.4 against 25.4-29.0 (alternating builds; sixteenths no
 * faster; 256-bit builds not measured); with eighths the caller waited for the other thread 2.7%
 * of its products' time in a 16-stream decode. Returns -1 if out of memory. */
static int outer_product(const float *x, const float *w, const uint8_t *u8, const int8_t *q8, const uint8_t *q4,
                         const float *scales, const float *bias, float *y, int M, int N, int K, int threads) {
    int rows = M < FAST_ROWS ? M : FAST_ROWS, failed = 0;
    float *xt = malloc(sizeof(float) * (size_t)K * PADDED_ROWS(rows));
    if (!xt) return -1;
    int chunk = (N / (8 * threads) + OUTER_W - 1) / OUTER_W * OUTER_W;
    for (int m0 = 0; m0 < M && !failed; m0 += rows) {
        int m = M - m0 < rows ? M - m0 : rows, MP = PADDED_ROWS(m);
        transpose_rows(x + (int64_t)m0 * K, xt, m, MP, K);
        struct outer_job job = {xt, w, bias, u8, q8, q4, scales, y + (int64_t)m0 * N, m, MP, N, K, &failed};
        parallel_rows(outer_rows, &job, N, chunk < OUTER_W ? OUTER_W : chunk, threads);
    }
    free(xt);
    return failed ? -1 : 0;
}

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Set how 48 rows go (1: three strips of 16, 0: one of 48; -1: leave it); returns the setting, or
 * -1 where the build has no 48-row strip. */
int pd_outer_narrow_48(int narrow) {
#if OUTER_STRIP_MAX == 48
    if (narrow >= 0) outer_narrow_48 = narrow;
    return outer_narrow_48;
#else
    (void)narrow;
    return -1;
#endif
}

/* Set whether past 16 rows the strips are whole strips of 16 (1, 0; -1: leave it); returns the
 * setting, or -1 where the build has no such choice. */
int pd_outer_pad_16(int pad) {
#if OUTER_STRIP_MAX == 48
    if (pad >= 0) outer_pad_16 = pad;
    return outer_pad_16;
#else
    (void)pad;
    return -1;
#endif
}


/* Set whether the 8 rows past strips of 16 take two weight blocks at once (1, 0; -1: leave it);
 * returns the setting, or -1 where the build has no pairs. */
int pd_outer_pair_8(int pair) {
#ifdef OUTER_PAIR_8
    if (pair >= 0) outer_pair_8 = pair;
    return outer_pair_8;
#else
    (void)pair;
    return -1;
#endif
}

/* Times products of M (and M2, if not 0) rows with *setting 0 and 1 on one thread (the caller's:
 * the pool is not started; a shape of the default model, weights larger than L2) and keeps the
 * faster: the best of five alternating runs each, about 12 ms a row count. The sums are the same
 * either way, so a close call costs speed, never results. Returns the choice, or -1 if out of
 * memory (the setting then stays as it was). */
#if OUTER_STRIP_MAX == 48 || defined(OUTER_PAIR_8)
static int faster_setting(int *setting, int M, int M2) {
    enum { N = 1536, K = 576 };
    int most = M > M2 ? M : M2;
    float *x = malloc(sizeof(float) * ((size_t)most * K + (size_t)N * K + (size_t)most * N));
    if (!x) return -1;
    float *w = x + (size_t)most * K, *y = w + (size_t)N * K;
    for (size_t i = 0; i < (size_t)most * K + (size_t)N * K; i++) x[i] = (float)(i % 7) * 0.25f - 0.75f;
    double best[2] = {1e30, 1e30};
    int was = *setting, failed = 0;
    for (int run = -2; run < 10; run++) {       /* (the first two fault the pages in) */
        *setting = run & 1;
        double start = seconds_now();
        failed |= outer_product(x, w, NULL, NULL, NULL, NULL, NULL, y, M, N, K, 1);
        if (M2) failed |= outer_product(x, w, NULL, NULL, NULL, NULL, NULL, y, M2, N, K, 1);
        double took = seconds_now() - start;
        if (run >= 0 && took < best[run & 1]) best[run & 1] = took;
    }
    free(x);
    *setting = failed ? was : best[1] < best[0];
    return failed ? -1 : *setting;
}
#endif

/* The build's choices that depend on the CPU, timed (faster_setting): on AVX-512 builds how 48
 * rows go, then whether 24 and 40 rows go as whole strips of 16 (bit 0 and bit 1 of the result);
 * on 256-bit x86 ones whether 24 rows pair their last 8; 0 where there is none, -1 if out of
 * memory. */
int pd_outer_choose(void) {
#if OUTER_STRIP_MAX == 48
    int narrow = faster_setting(&outer_narrow_48, 48, 0), pad = faster_setting(&outer_pad_16, 24, 40);
    return narrow < 0 || pad < 0 ? -1 : narrow | pad << 1;
#elif defined(OUTER_PAIR_8)
    return faster_setting(&outer_pair_8, 24, 0);
#else
    return 0;
#endif
}

/* y[M, N] = x[M, K] @ w[N, K]^T + bias for small M (decode batches, speculative verification,
 * prefill chunks). Below OUTER_MIN_ROWS one dot product at a time (few_rows), from there on the
 * outer-product form above. Returns -1 if out of memory. */
int pd_linear_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
                  int threads) {
    if (M <= 0) return 0;               /* (a forward that samples no row asks for no logits) */
    if (M >= OUTER_MIN_ROWS) return outer_product(x, w, NULL, NULL, NULL, NULL, bias, y, M, N, K, threads);
    struct few_job job = {x, w, bias, NULL, NULL, NULL, y, M, N, K};
    parallel_rows(few_rows, &job, N, row_chunk(N, threads), threads);
    return 0;
}

/* ---- exact blocks by panels: products of a few rows that rebuild weights in registers ---- */

/* The outer-product strips rebuild a block of weight rows into L1 and broadcast each weight from
 * there: per weight a store, a reload and a broadcast beside the rows' multiply-adds, which held
 * 16 rows of exact blocks to 70-90 GF/s a thread where a strip on cached fp32 weights ran at
 * 154-158 (2-core Intel Xeon, AVX-512, 2026-12-04). Held a second time by panels of
 * PANEL outputs, k-major, the integers of one k for a panel's outputs are one load: they widen to
 * a vector of the panel's weights at that k (rebuilt as the strips rebuild them: d * u + m for Q4,
 * s * q for int8, exact either way), which multiplies each activation row's x[k], broadcast. The
 * sums are the strips': each output's sum adds its k in order with a fused multiply-add from zero,
 * then the bias, so a row's result is the same bits either way (tested against the fp32
 * products). On a 2-core Intel Xeon (AVX-512, 2026-12-04; the default model's 30 layers of exact
 * Q4 blocks, distinct weights, two threads) 5 rows took 9.6 ms against the strips' 15.0, 8 rows
 * 11.3 against 15.3, 16 rows 15.8 against 21.1, 24 rows 23.5 against 28.8, 32 rows 26.5 against
 * 30.1 and 48 rows 39.5 against 38.4 (one thread: 16 rows 24 against 32-37). A tile keeps 16 rows'
 * sums in registers (24 spilled: 85 ms against 38 at 24 rows, one thread). The layouts, per panel
 * and group of 32 k: Q4, 16 pairs of k, PANEL bytes each (output j's byte: its weight at the
 * pair's first k in the low nibble, the second's in the high one), then the group's d of the
 * panel's outputs and their m (fp32, 2 x PANEL); int8, 32 k of PANEL integers each, then the
 * outputs' scales. The same bytes as the rows' layout, which stays for BLAS past the fast rows and
 * an embedding's lookups.
 * Fewer rows than a tile's (a decode batch: 1 to OUTER_MIN_ROWS - 1) go by panels too, four vectors
 * of outputs at once (AVX2: two), so a row's sums are the strips' at every count of rows, where
 * fp32 rows go by dot products in four chains (few_rows). There the panels read each weight's
 * bytes once as well and rebuild 16 weights with a handful of instructions, where few_rows rebuilt
 * 8 with as many: the default model's 30 layers at one row took 3.5 ms against 6.4-6.5 by rows, the
 * head (49,152 outputs of exact int8 blocks, cached) 0.8-1.0 against 1.2-1.4; 4 rows 6.4-6.6
 * against 9.4 (2-core Intel Xeon, AVX-512, 2026-12-04, C harness, two rounds); an -march=haswell
 * build there 4.7 against 6.1-6.3 at one row, 8.3 against 16.9 at 4. One stream's decode in the
 * engine went from 114 to 200-203 tok/s. */
/* A panel's vector ops: AVX-512 takes a panel in one vector, AVX2 with FMA in two halves of 8. */
#if defined(__AVX512F__)
#define PANEL_LANES 16
#define PANEL_TILE_ROWS 16
#define PANEL_MAX_ROWS FAST_ROWS
#define FEW_VECTORS 4
typedef __m512 pvec;
#define PV_ZERO() _mm512_setzero_ps()
#define PV_LOAD(p) _mm512_loadu_ps(p)
#define PV_STORE(p, v) _mm512_storeu_ps(p, v)
#define PV_SET1(f) _mm512_set1_ps(f)
#define PV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define PV_MUL(a, b) _mm512_mul_ps(a, b)
#define PV_ADD(a, b) _mm512_add_ps(a, b)
#define PV_BYTES(p) _mm_loadu_si128((const __m128i *)(p))            /* a lane's byte each */
#define PV_S8(in) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(in))
#define PV_NIBBLES(in, lo, hi) do { __m512i u_ = _mm512_cvtepu8_epi32(in); \
        lo = _mm512_cvtepi32_ps(_mm512_and_si512(u_, _mm512_set1_epi32(15))); \
        hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(u_, 4)); } while (0)
#elif defined(__AVX2__) && defined(__FMA__)
/* 8 rows a tile: 8 sums and the rebuild's 6 vectors in 16 registers. Each tile rebuilds the
 * weights again, and past 24 rows the strips are faster: an -march=haswell build on a 2-core Intel
 * Xeon (2026-12-04; the default model's 30 layers of exact Q4 blocks, distinct weights, two
 * threads, two runs) took 5 rows in 8.7-9.0 ms by panels against 17.1-17.4 by strips, 8 rows
 * 11.6 against 17.1-17.2, 16 rows 22.4-22.5 against 23.0, 24 rows 32.9-33.0 against 35.8-35.9,
 * 32 rows 43.1-43.2 against 41.1-41.3 and 48 rows 63.9-64.2 against 58.5-59.3 (not measured on
 * an AVX2-only CPU). */
#define PANEL_LANES 8
#define PANEL_TILE_ROWS 8
#define PANEL_MAX_ROWS 24
#define FEW_VECTORS 2
typedef __m256 pvec;
#define PV_ZERO() _mm256_setzero_ps()
#define PV_LOAD(p) _mm256_loadu_ps(p)
#define PV_STORE(p, v) _mm256_storeu_ps(p, v)
#define PV_SET1(f) _mm256_set1_ps(f)
#define PV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define PV_MUL(a, b) _mm256_mul_ps(a, b)
#define PV_ADD(a, b) _mm256_add_ps(a, b)
#define PV_BYTES(p) _mm_loadl_epi64((const __m128i *)(p))
#define PV_S8(in) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(in))
#define PV_NIBBLES(in, lo, hi) do { __m256i u_ = _mm256_cvtepu8_epi32(in); \
        lo = _mm256_cvtepi32_ps(_mm256_and_si256(u_, _mm256_set1_epi32(15))); \
        hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(u_, 4)); } while (0)
#endif
#ifdef PANEL_LANES
#define PANEL 16
/* Groups ahead that a panel's first tile fetches into L1 (into the next panel at its end, the next
 * in memory; a fetch past the matrix does not fault). Left to the hardware's prefetcher, a
 * 16-stream decode step's head (49,152 outputs of exact int8 blocks, from memory after the layers)
 * took 5.3-5.6 ms and the layers' products 16.6-17.3; 2 groups ahead 3.1-3.5 and 14.1-15.1, 8
 * ahead 3.7-3.9 and 14.8-15.8 (the step 26.0-26.6 ms against 20.9-22.5 and 22.6-24.0; 2-core
 * Intel Xeon, AVX-512, 2026-12-04, two runs each). */
#ifndef PANEL_AHEAD
#define PANEL_AHEAD 2
#endif
/* Rows from which the tiles take x packed, k-major (pack_tiles). Row by row, a 16-row tile's
 * broadcasts came from 32 pointers (each row's two k), more than the registers, reloaded from the
 * stack every pair of k; packed, from one. On a 2-core Intel Xeon (AVX-512, 2026-12-04, x rewritten
 * by the caller before each product as a layer's are, two threads) 16 rows against 3,072 x 576
 * took 177 us packed against 211, 576 x 1,536 109 against 121, 32 rows 348 against 416 and 195
 * against 222; below 16 rows no faster (5-12 rows within 4%, both ways). An -march=haswell build
 * there (tiles of 8 rows, packed from 16 rows too) ran 16-32 rows 3-9% faster against 3,072 x 576
 * and 2-7% slower against 576 x 1,536 (not measured on an AVX2-only CPU). A 16-stream decode in
 * the engine went from 700 to 770-790 tok/s. */
#define PANEL_PACK_ROWS 16
#endif

/* Whether a matrix of exact blocks with N rows is held by panels too (pd_exact_panels): where this
 * build multiplies by them (every count of rows up to PANEL_MAX_ROWS), and N fills whole panels. */
static int has_panels(int N) {
#ifdef PANEL
    return N % PANEL == 0;
#else
    (void)N;
    return 0;
#endif
}

int pd_exact_panels(int N) { return has_panels(N); }

/* Whether a product of M rows of exact blocks goes on AMX tiles (cpu_amx.h). */
static int on_tiles(int M);

#ifdef PANEL
/* The bytes of a panel's group of 32 k and its floats (scales, or (d, m)) in a form's layout. */
#define GROUP_BYTES(form) ((form) == FORM_Q4 ? EXACT_BLOCK / 2 * PANEL : EXACT_BLOCK * PANEL)
#define GROUP_FLOATS(form) ((form) == FORM_Q4 ? 2 * PANEL : PANEL)

struct panel_fill_job { const uint8_t *rows; const float *params; uint8_t *bytes; float *floats; int K, form; };

/* Panels [lo, hi) of exact_panels_of. */
static void panel_fill(const void *a, int lo, int hi) {
    const struct panel_fill_job *j = a;
    int K = j->K, G = K / EXACT_BLOCK, q4 = j->form == FORM_Q4;
    for (int p = lo; p < hi; p++)
        for (int g = 0; g < G; g++) {
            uint8_t *o = j->bytes + ((int64_t)p * G + g) * GROUP_BYTES(j->form);
            float *f = j->floats + ((int64_t)p * G + g) * GROUP_FLOATS(j->form);
            for (int i = 0; i < PANEL; i++) {
                int64_t n = (int64_t)p * PANEL + i;
                if (!q4) {
                    f[i] = j->params[n * G + g];
                    for (int k = 0; k < EXACT_BLOCK; k++) o[k * PANEL + i] = j->rows[n * K + g * EXACT_BLOCK + k];
                    continue;
                }
                const uint8_t *b = j->rows + n * (K / 2) + g * Q4X_GROUP_BYTES;    /* weights 0-15 low nibbles, 16-31 high */
                f[i] = j->params[(n * G + g) * 2];
                f[PANEL + i] = j->params[(n * G + g) * 2 + 1];
                for (int pair = 0; pair < EXACT_BLOCK / 2; pair++) {
                    int k0 = 2 * pair, k1 = k0 + 1;
                    int u0 = k0 < Q4X_GROUP_BYTES ? b[k0] & 15 : b[k0 - Q4X_GROUP_BYTES] >> 4;
                    int u1 = k1 < Q4X_GROUP_BYTES ? b[k1] & 15 : b[k1 - Q4X_GROUP_BYTES] >> 4;
                    o[pair * PANEL + i] = (uint8_t)(u0 | u1 << 4);
                }
            }
        }
}
#endif

/* A matrix's exact blocks by panels (bytes and floats as many as its rows' layout holds) from the
 * rows' layout (rows and params); -1 where it has none (has_panels). */
static int exact_panels_of(const void *rows, const float *params, int N, int K, void *bytes, float *floats,
                           int form, int threads) {
    if (!has_panels(N) || K % EXACT_BLOCK) return -1;
#ifdef PANEL
    struct panel_fill_job job = {rows, params, bytes, floats, K, form};
    parallel_rows(panel_fill, &job, N / PANEL, 16, threads);
#else
    (void)rows, (void)params, (void)bytes, (void)floats, (void)form, (void)threads;
#endif
    return 0;
}

int pd_exact_q4_panels(const uint8_t *q, const float *dm, int N, int K, uint8_t *qp, float *dmp, int threads) {
    return exact_panels_of(q, dm, N, K, qp, dmp, FORM_Q4, threads);
}

int pd_exact_int8_panels(const int8_t *q, const float *s, int N, int K, int8_t *qp, float *sp, int threads) {
    return exact_panels_of(q, s, N, K, qp, sp, FORM_Q8, threads);
}

#ifdef PANEL
struct panel_job { const float *x; const uint8_t *bytes; const float *floats, *bias; float *y; int M, N, K, packed; };

/* A vector of a panel's weights at the two k of `pair` in group bytes b, rebuilt as the strips
 * rebuild them (d * u + m, or s * q: exact). */
INLINE void panel_weights(const uint8_t *b, int pair, pvec d, pvec m, pvec *w0, pvec *w1, const int form) {
    if (form == FORM_Q4) {
        pvec lo, hi;
        PV_NIBBLES(PV_BYTES(b + pair * PANEL), lo, hi);
        *w0 = PV_FMA(d, lo, m);
        *w1 = PV_FMA(d, hi, m);
    } else {
        *w0 = PV_MUL(d, PV_S8(PV_BYTES(b + 2 * pair * PANEL)));
        *w1 = PV_MUL(d, PV_S8(PV_BYTES(b + (2 * pair + 1) * PANEL)));
    }
}

/* Into L1, the group `ahead` on from group bytes b and floats f (into the next panel at a panel's
 * end: the next in memory; a fetch past the matrix does not fault). */
INLINE void fetch_group_ahead(const uint8_t *b, const float *f, const int ahead, const int form) {
    for (int i = 0; i < GROUP_BYTES(form); i += 64) __builtin_prefetch(b + ahead * GROUP_BYTES(form) + i, 0, INTO_L1);
    for (int i = 0; i < GROUP_FLOATS(form); i += 16) __builtin_prefetch(f + ahead * GROUP_FLOATS(form) + i, 0, INTO_L1);
}

/* Panel p against activation rows [m0, m0 + R) (R, form and packed constants once inlined: the
 * sums in registers), a vector of its outputs at a time. Packed (pack_tiles), the tile's rows come
 * k-major, so that every broadcast is at a constant offset from one pointer; else row by row. */
INLINE void panel_tile(const struct panel_job *j, int p, int m0, const int R, const int form, const int packed) {
    int G = j->K / EXACT_BLOCK, K = j->K;
    int64_t row = packed ? 1 : K, step = packed ? PANEL_TILE_ROWS : 1;     /* x's strides: a row, a k */
    const uint8_t *bytes = j->bytes + (int64_t)p * G * GROUP_BYTES(form);
    const float *floats = j->floats + (int64_t)p * G * GROUP_FLOATS(form), *x = j->x + (int64_t)m0 * K;
    for (int h = 0; h < PANEL; h += PANEL_LANES) {
        pvec acc[PANEL_TILE_ROWS];
        for (int r = 0; r < R; r++) acc[r] = PV_ZERO();
        for (int g = 0; g < G; g++) {
            const uint8_t *b = bytes + g * GROUP_BYTES(form) + h;
            const float *f = floats + g * GROUP_FLOATS(form), *xg = x + g * EXACT_BLOCK * step;
            if (m0 == 0 && h == 0) fetch_group_ahead(b, f, PANEL_AHEAD, form);
            pvec d = PV_LOAD(f + h), m = form == FORM_Q4 ? PV_LOAD(f + PANEL + h) : d;
            for (int pair = 0; pair < EXACT_BLOCK / 2; pair++) {
                pvec w0, w1;
                panel_weights(b, pair, d, m, &w0, &w1, form);
                const float *xk = xg + 2 * pair * step;
                for (int r = 0; r < R; r++) acc[r] = PV_FMA(w0, PV_SET1(xk[r * row]), acc[r]);
                for (int r = 0; r < R; r++) acc[r] = PV_FMA(w1, PV_SET1(xk[r * row + step]), acc[r]);
            }
        }
        pvec bias = j->bias ? PV_LOAD(j->bias + p * PANEL + h) : PV_ZERO();
        for (int r = 0; r < R; r++)    /* (+ 0 without a bias, as span_store adds: -0 sums become +0 there too) */
            PV_STORE(j->y + (int64_t)(m0 + r) * j->N + p * PANEL + h, PV_ADD(acc[r], bias));
    }
}

/* Rows below the tiles' (1 to OUTER_MIN_ROWS - 1: a decode batch) against nv vectors of outputs
 * from vector v0 at once (R and nv constants once inlined): a row's sum for an output is one chain
 * of multiply-adds, and the vectors' chains interleave, where one vector's would wait on each
 * multiply-add's latency. */
INLINE void panel_few(const struct panel_job *j, int v0, const int nv, const int R, const int form) {
    int G = j->K / EXACT_BLOCK, K = j->K;
    pvec acc[FEW_MAX_ROWS][FEW_VECTORS];
    const uint8_t *bytes[FEW_VECTORS];
    const float *floats[FEW_VECTORS];
    for (int v = 0; v < nv; v++) {
        int o = (v0 + v) * PANEL_LANES, p = o / PANEL, h = o % PANEL;
        bytes[v] = j->bytes + (int64_t)p * G * GROUP_BYTES(form) + h;
        floats[v] = j->floats + (int64_t)p * G * GROUP_FLOATS(form) + h;
        for (int r = 0; r < R; r++) acc[r][v] = PV_ZERO();
    }
    for (int g = 0; g < G; g++) {
        pvec d[FEW_VECTORS], m[FEW_VECTORS];
        for (int v = 0; v < nv; v++) {
            const uint8_t *b = bytes[v] + g * GROUP_BYTES(form);
            const float *f = floats[v] + g * GROUP_FLOATS(form);
            if (((v0 + v) * PANEL_LANES) % PANEL == 0) fetch_group_ahead(b, f, PANEL_AHEAD, form);   /* a panel's first vector's */
            d[v] = PV_LOAD(f);
            m[v] = form == FORM_Q4 ? PV_LOAD(f + PANEL) : d[v];
        }
        const float *xg = j->x + g * EXACT_BLOCK;
        for (int pair = 0; pair < EXACT_BLOCK / 2; pair++)
            for (int v = 0; v < nv; v++) {
                pvec w0, w1;
                panel_weights(bytes[v] + g * GROUP_BYTES(form), pair, d[v], m[v], &w0, &w1, form);
                for (int r = 0; r < R; r++) acc[r][v] = PV_FMA(w0, PV_SET1(xg[(int64_t)r * K + 2 * pair]), acc[r][v]);
                for (int r = 0; r < R; r++) acc[r][v] = PV_FMA(w1, PV_SET1(xg[(int64_t)r * K + 2 * pair + 1]), acc[r][v]);
            }
    }
    for (int v = 0; v < nv; v++) {
        int o = (v0 + v) * PANEL_LANES;
        pvec bias = j->bias ? PV_LOAD(j->bias + o) : PV_ZERO();
        for (int r = 0; r < R; r++) PV_STORE(j->y + (int64_t)r * j->N + o, PV_ADD(acc[r][v], bias));
    }
}

/* Vectors of outputs [lo, hi) against the few rows (a copy per count of rows and of vectors). */
INLINE void panel_few_rows_of(const struct panel_job *j, int lo, int hi, const int form) {
    for (int v0 = lo; v0 < hi; v0 += FEW_VECTORS) {
        int nv = hi - v0 < FEW_VECTORS ? hi - v0 : FEW_VECTORS;
#define FEW_CASE(R, NV) case (R) * 8 + (NV): panel_few(j, v0, NV, R, form); break;
#if FEW_VECTORS == 4
#define FEW_ROWS(R) FEW_CASE(R, 1) FEW_CASE(R, 2) FEW_CASE(R, 3) FEW_CASE(R, 4)
#else
#define FEW_ROWS(R) FEW_CASE(R, 1) FEW_CASE(R, 2)
#endif
        switch (j->M * 8 + nv) {
            FEW_ROWS(1) FEW_ROWS(2) FEW_ROWS(3) FEW_ROWS(4)
        }
#undef FEW_ROWS
#undef FEW_CASE
    }
}

static void q4_panel_few(const void *a, int lo, int hi) { panel_few_rows_of(a, lo, hi, FORM_Q4); }
static void q8_panel_few(const void *a, int lo, int hi) { panel_few_rows_of(a, lo, hi, FORM_Q8); }

/* Panels [lo, hi) against every activation row, by tiles of up to PANEL_TILE_ROWS rows. */
INLINE void panel_rows_of(const struct panel_job *j, int lo, int hi, const int form) {
    for (int p = lo; p < hi; p++)
        for (int m0 = 0; m0 < j->M; m0 += PANEL_TILE_ROWS) {
            int R = j->M - m0 < PANEL_TILE_ROWS ? j->M - m0 : PANEL_TILE_ROWS;
            switch (R * 2 + j->packed) {  /* a copy per count of rows, packed or not */
#define PANEL_TILE(R) case 2 * (R): panel_tile(j, p, m0, R, form, 0); break; \
                      case 2 * (R) + 1: panel_tile(j, p, m0, R, form, 1); break;
            PANEL_TILE(1) PANEL_TILE(2) PANEL_TILE(3) PANEL_TILE(4) PANEL_TILE(5) PANEL_TILE(6) PANEL_TILE(7)
            PANEL_TILE(8)
#if PANEL_TILE_ROWS == 16
            PANEL_TILE(9) PANEL_TILE(10) PANEL_TILE(11) PANEL_TILE(12) PANEL_TILE(13) PANEL_TILE(14)
            PANEL_TILE(15) PANEL_TILE(16)
#endif
#undef PANEL_TILE
            }
        }
}

static void q4_panel_rows(const void *a, int lo, int hi) { panel_rows_of(a, lo, hi, FORM_Q4); }
static void q8_panel_rows(const void *a, int lo, int hi) { panel_rows_of(a, lo, hi, FORM_Q8); }

/* x's rows by tiles of PANEL_TILE_ROWS, each k-major (tile t's row r at k: xt[(t * K + k) * TILE + r]). */
static void pack_tiles(const float *x, float *xt, int M, int K) {
    for (int m0 = 0; m0 < M; m0 += PANEL_TILE_ROWS)
        transpose_rows(x + (int64_t)m0 * K, xt + (int64_t)m0 * K, M - m0 < PANEL_TILE_ROWS ? M - m0 : PANEL_TILE_ROWS,
                       PANEL_TILE_ROWS, K);
}

#include "cpu_amx.h"    /* exact blocks on AMX tiles, where the CPU has them */

/* y = x @ W^T + bias by panels, M rows at once; panels go out in chunks of an eighth of a
 * thread's share (as outer_product's rows). From PANEL_PACK_ROWS rows on, x goes packed (the
 * caller's scratch, read by every thread): -1 if out of memory. On AMX from AMX_MIN_ROWS rows. */
static int panel_product(const float *x, const void *bytes, const float *floats, const float *bias, float *y,
                         int M, int N, int K, int form, int threads) {
#ifdef AMX_PRODUCTS
    if (amx_takes(M)) return amx_product(x, bytes, floats, bias, y, M, N, K, form, threads);
#endif
    struct panel_job job = {x, bytes, floats, bias, y, M, N, K, M >= PANEL_PACK_ROWS};
    if (M < OUTER_MIN_ROWS) {
        int vectors = N / PANEL_LANES, chunk = (vectors / (4 * threads) + FEW_VECTORS - 1) / FEW_VECTORS * FEW_VECTORS;
        parallel_rows(form == FORM_Q4 ? q4_panel_few : q8_panel_few, &job, vectors, chunk < FEW_VECTORS ? FEW_VECTORS : chunk,
                      threads);
        return 0;
    }
    if (job.packed) {
        int tiles = (M + PANEL_TILE_ROWS - 1) / PANEL_TILE_ROWS;
        float *xt = thread_scratch(SCRATCH_TILES, sizeof(float) * K * tiles * PANEL_TILE_ROWS);
        if (!xt) return -1;
        pack_tiles(x, xt, M, K);
        job.x = xt;
    }
    int panels = N / PANEL, chunk = panels / (8 * threads);
    parallel_rows(form == FORM_Q4 ? q4_panel_rows : q8_panel_rows, &job, panels, chunk < 1 ? 1 : chunk, threads);
    return 0;
}
#endif

static int on_tiles(int M) {
#ifdef AMX_PRODUCTS
    return amx_takes(M);
#else
    (void)M;
    return 0;
#endif
}

/* Whether exact blocks go on AMX tiles from AMX_MIN_ROWS rows: on (the default) where the build and
 * the OS allow it; on = 0 or 1 turns them off or back on, -1 only asks. */
int pd_exact_amx(int on) {
#ifdef AMX_PRODUCTS
    if (on >= 0) amx_wanted = on;
    return amx_wanted && amx_granted();
#else
    (void)on;
    return 0;
#endif
}

/* Rows by which a product's cost rises, for the step cost model: where exact blocks go by panels,
 * their tiles' (AVX-512: 16, AVX2: 8; the default model's every product), else the strips'
 * narrowest step (8, or 16 where pd_outer_choose timed whole strips of 16 faster: a choice that
 * took a newcomer's slices beside a stream from 15 tokens to 7 between two engines, 2.8 s against
 * 3.9 to its first token, once the panels made a decode 5 ms; 2-core Intel Xeon, 2026-12-04). */
int pd_row_granule(void) {
#ifdef PANEL
    return PANEL_TILE_ROWS;
#else
    return PADDED_ROWS(17) - 16;
#endif
}

/* pd_linear_f32 on a matrix held in exact blocks of either form (q8 or q4, the other NULL; scales
 * theirs): -2 if K is not whole blocks. */
static int linear_exact(const float *x, const int8_t *q8, const uint8_t *q4, const float *scales,
                        const float *bias, float *y, int M, int N, int K, int threads) {
    if (K % EXACT_BLOCK) return -2;
    if (M <= 0) return 0;
#ifdef PANEL
    if (has_panels(N) && (M <= PANEL_MAX_ROWS || on_tiles(M))) {   /* the panels follow the rows' layout */
        int64_t G = K / EXACT_BLOCK;
        if (q4) return panel_product(x, q4 + (int64_t)N * (K / 2), scales + N * G * 2, bias, y, M, N, K, FORM_Q4, threads);
        return panel_product(x, q8 + (int64_t)N * K, scales + N * G, bias, y, M, N, K, FORM_Q8, threads);
    }
#endif
    if (M >= OUTER_MIN_ROWS) return outer_product(x, NULL, NULL, q8, q4, scales, bias, y, M, N, K, threads);
    struct few_job job = {x, NULL, bias, q8, q4, scales, y, M, N, K};
    parallel_rows(few_rows, &job, N, row_chunk(N, threads), threads);
    return 0;
}

/* pd_linear_f32 on a matrix held in exact int8 blocks (q [N, K], s [N, K / 32]): the same results
 * as on its fp32 weights, bit for bit (held by panels too, at every count of rows those of its
 * strips: exact blocks by panels). Returns -1 if out of memory, -2 if K is not whole blocks. */
int pd_linear_exact_int8(const float *x, const int8_t *q, const float *s, const float *bias, float *y, int M,
                         int N, int K, int threads) {
    return linear_exact(x, q, NULL, s, bias, y, M, N, K, threads);
}

/* The same for exact Q4 blocks (q [N, K / 2] nibbles, dm [N, K / 32, 2]). Where pd_exact_panels(N),
 * either form's tensors are followed by the same blocks by panels (pd_exact_int8_panels,
 * pd_exact_q4_panels): q [2, N, K] and s [2, N, K / 32]; q [2, N, K / 2] and dm [2, N, K / 32, 2]. */
int pd_linear_exact_q4(const float *x, const uint8_t *q, const float *dm, const float *bias, float *y, int M,
                       int N, int K, int threads) {
    return linear_exact(x, NULL, q, dm, bias, y, M, N, K, threads);
}

struct q4x_unpack_job { const uint8_t *q; const float *dm; float *out; int K; };

static void q4x_unpack_rows(const void *p, int lo, int hi) {
    const struct q4x_unpack_job *j = p;
    int64_t K = j->K;
    for (int64_t n = lo; n < hi; n++) unpack_q4x_row(j->q + n * (K / 2), j->dm + n * (K / 16), j->out + n * K, j->K);
}

/* Rows of exact Q4 blocks as their fp32 weights (for BLAS past the C products' rows), on the pool. */
void pd_unpack_exact_q4(const uint8_t *q, const float *dm, float *out, int N, int K, int threads) {
    struct q4x_unpack_job job = {q, dm, out, K};
    parallel_rows(q4x_unpack_rows, &job, N, row_chunk(N, threads), threads);
}

/* Activations in int8, in blocks of 64 values with one scale each, as two parts: x ~= s * (hi + lo / 254)
 * where hi = round(x / s) and lo is the rounded remainder. With both parts the product is as exact
 * as fp32 activations to about 1e-5 of the block's largest value (hi alone: 4e-3, which flips
 * greedy near-ties often), at twice the integer work but the same weight traffic.
 * corr[m] = 128 * sum_b s_b * (sum(hi_b) + sum(lo_b) / 254) undoes the +128 offset of the weights
 * where the dot product sees it (PD_INT8_OFFSET), else 0. */
#define LO_SCALE 254.f
/* The larger of two floats that are not NaN: an instruction, where fmaxf is a call into libm
 * (GCC keeps its NaN rules), made per key in attention and per value in quantizing. */
static inline float max_f(float a, float b) { return a > b ? a : b; }

/* v rounded to the nearest integer, ties to even (lrintf's default mode) for |v| < 2^22, in a form
 * that vectorizes (lrintf stays a scalar call per value: with a max that did not vectorize either,
 * quantizing took a quarter as long as the product it fed, 32 rows of the default model). */
static inline float round_even(float v) { return (v + 12582912.f) - 12582912.f; }

/* The int8 scale of n values, s = max|x| / 127; returns 1 / s (0 for an all-zero block). */
static inline float block_scale(const float *p, int n, float *s) {
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int i = 0; i < n; i++) amax = max_f(amax, fabsf(p[i]));
    *s = amax / 127.f;
    return amax > 0.f ? 127.f / amax : 0.f;
}

/* One block of QBLOCK values in two parts (hi, lo) with its scale s; returns the block's share of
 * corr, s * (sum(hi) + sum(lo) / 254). */
static inline float quantize_block(const float *p, int8_t *hi, int8_t *lo, float *s) {
    float inv = block_scale(p, QBLOCK, s);
    int sum_hi = 0, sum_lo = 0;
#pragma omp simd reduction(+ : sum_hi, sum_lo)
    for (int i = 0; i < QBLOCK; i++) {
        float v = p[i] * inv, h = round_even(v), l = round_even((v - h) * LO_SCALE);
        int hq = (int)h, lq = (int)(l > 127.f ? 127.f : l < -127.f ? -127.f : l);
        hi[i] = (int8_t)hq;
        lo[i] = (int8_t)lq;
        sum_hi += hq;
        sum_lo += lq;
    }
    return *s * ((float)sum_hi + (float)sum_lo / LO_SCALE);
}

static void quantize_rows(const float *x, int M, int K, int8_t *hi, int8_t *lo, float *xs, float *corr) {
    int nb = K / QBLOCK;
    for (int m = 0; m < M; m++) {
        float c = 0.f;
        for (int b = 0; b < nb; b++) {
            int64_t at = (int64_t)m * K + b * QBLOCK;
            c += quantize_block(x + at, hi + at, lo + at, &xs[m * nb + b]);
        }
        corr[m] = PD_INT8_OFFSET ? 128.f * c : 0.f;
    }
}

/* One output: sum_b xs_b * <w_row(b), hi(b) + lo(b) / 254> with w stored as u8 = q + 128 (the
 * paths that multiply q itself flip the top bit: u8 ^ 0x80 is q as a signed byte). */
#if PDCHAT_INT8_PATH == PD_INT8_AVX512VNNI
static inline float dot_u8_blocks(const uint8_t *wr, const int8_t *hi, const int8_t *lo, const float *xs, int nb) {
    __m512 f = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i w = _mm512_loadu_si512(wr + b * QBLOCK);
        __m512i ah = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(hi + b * QBLOCK));
        __m512i al = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(lo + b * QBLOCK));
        __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(al), _mm512_set1_ps(1.f / LO_SCALE), _mm512_cvtepi32_ps(ah));
        f = _mm512_fmadd_ps(part, _mm512_set1_ps(xs[b]), f);
    }
    return _mm512_reduce_add_ps(f);
}
#elif PDCHAT_INT8_PATH == PD_INT8_AVXVNNI || PDCHAT_INT8_PATH == PD_INT8_AVX2
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#if PDCHAT_INT8_PATH == PD_INT8_AVX2
/* acc + <q, x> over 32 bytes in eight int32 lanes. maddubs multiplies unsigned by signed bytes, so
 * it gets |q| and x with q's sign; a pair of products is at most 2 * 127 * 127, inside its int16. */
static inline __m256i dot32(__m256i acc, __m256i q, __m256i x) {
    __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

static inline float dot_u8_blocks(const uint8_t *wr, const int8_t *hi, const int8_t *lo, const float *xs, int nb) {
    __m256 f = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i ah = _mm256_setzero_si256(), al = _mm256_setzero_si256();
        for (int half = 0; half < QBLOCK; half += 32) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(wr + b * QBLOCK + half));
            __m256i h = _mm256_loadu_si256((const __m256i *)(hi + b * QBLOCK + half));
            __m256i l = _mm256_loadu_si256((const __m256i *)(lo + b * QBLOCK + half));
#if PDCHAT_INT8_PATH == PD_INT8_AVXVNNI
            ah = _mm256_dpbusd_avx_epi32(ah, w, h);
            al = _mm256_dpbusd_avx_epi32(al, w, l);
#else
            __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
            ah = dot32(ah, q, h);
            al = dot32(al, q, l);
#endif
        }
        __m256 part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(al), _mm256_set1_ps(1.f / LO_SCALE), _mm256_cvtepi32_ps(ah));
        f = _mm256_fmadd_ps(part, _mm256_set1_ps(xs[b]), f);
    }
    return sum8(f);
}
#elif PDCHAT_INT8_PATH == PD_INT8_NEON_DOT
static inline float dot_u8_blocks(const uint8_t *wr, const int8_t *hi, const int8_t *lo, const float *xs, int nb) {
    float32x4_t f = vdupq_n_f32(0.f);
    for (int b = 0; b < nb; b++) {
        int32x4_t ah = vdupq_n_s32(0), al = vdupq_n_s32(0);
        for (int i = 0; i < QBLOCK; i += 16) {
            int8x16_t q = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(wr + b * QBLOCK + i), vdupq_n_u8(0x80)));
            ah = vdotq_s32(ah, q, vld1q_s8(hi + b * QBLOCK + i));
            al = vdotq_s32(al, q, vld1q_s8(lo + b * QBLOCK + i));
        }
        float32x4_t part = vfmaq_n_f32(vcvtq_f32_s32(ah), vcvtq_f32_s32(al), 1.f / LO_SCALE);
        f = vfmaq_n_f32(f, part, xs[b]);
    }
    return vaddvq_f32(f);
}
#else
static inline float dot_u8_blocks(const uint8_t *wr, const int8_t *hi, const int8_t *lo, const float *xs, int nb) {
    float f = 0.f;
    for (int b = 0; b < nb; b++) {
        int32_t ah = 0, al = 0;
#pragma omp simd reduction(+ : ah, al)
        for (int i = 0; i < QBLOCK; i++) {
            int32_t w = wr[b * QBLOCK + i];
            ah += w * (int32_t)hi[b * QBLOCK + i];
            al += w * (int32_t)lo[b * QBLOCK + i];
        }
        f += ((float)ah + (float)al / LO_SCALE) * xs[b];
    }
    return f;
}
#endif

/* y[M, N] = x[M, K] @ (scales[N] * q[N, K])^T + bias, weights int8 stored as u8 (q + 128) so that
 * the unsigned-by-signed VNNI dot product applies. K must be a multiple of 64. Returns -1 if out
 * of memory (the caller raises). */
struct u8_job {
    const uint8_t *w;
    const float *scales, *bias, *xs, *corr;
    const int8_t *hi, *lo;
    float *y;
    int M, N, K;
};

/* Each row prefetches the row U8_AHEAD further (the LM head of a decode: 0.66 -> 0.57 ms for the
 * default model's, 14.1 -> 12.0 for the 1B shape's 128K rows; a row's lines are few). */
#define U8_AHEAD 4
static void u8_rows(const void *p, int lo, int hi) {
    const struct u8_job *j = p;
    int nb = j->K / QBLOCK;
    for (int n = lo; n < hi; n++) {
        const uint8_t *wr = j->w + (int64_t)n * j->K;
        float b = j->bias ? j->bias[n] : 0.f;
        if (n + U8_AHEAD < j->N)
            for (int k = 0; k < j->K; k += 64) __builtin_prefetch(wr + (int64_t)U8_AHEAD * j->K + k, 0, INTO_L1);
        for (int m = 0; m < j->M; m++) {
            int64_t at = (int64_t)m * j->K;
            float acc = dot_u8_blocks(wr, j->hi + at, j->lo + at, j->xs + m * nb, nb);
            j->y[(int64_t)m * j->N + n] = (acc - j->corr[m]) * j->scales[n] + b;
        }
    }
}

/* From how many rows int8 (U8_OUTER_MIN_ROWS) and int4 (Q4_OUTER_MIN_ROWS) products run in the
 * integer outer-product form (int_outer, below). On the VNNI paths, 8: at 8 rows (AVX-512, both
 * models) int8 1.2-2.8x the dot kernel, int4 0.76-1.8x. AVX2 takes int4 only (Q4_GROUP_ADD there says
 * why), from 6: the default model's 30 layers of products (2-core AMD EPYC, Zen 3, weights from
 * memory, best of 5, 2026-12-03, two alternating runs) took 11.3-12.7 ms at 4-7 rows that way, by
 * the dot kernel 8.2-9.3 at 4, 11.9-12.2 at 5, 14.7-14.8 at 6, 14.2-16.4 at 7 (and before the
 * tiles' two-words loop 15.8 at 8, 23.4 at 12 and 28-32 at 16, where they took 14, 22 and 24). */
#if PDCHAT_INT8_PATH == PD_INT8_AVX512VNNI || PDCHAT_INT8_PATH == PD_INT8_AVXVNNI
#define U8_OUTER_MIN_ROWS 8
#define Q4_OUTER_MIN_ROWS 8
#elif PDCHAT_INT8_PATH == PD_INT8_AVX2
#define Q4_OUTER_MIN_ROWS 6
#endif
#ifdef Q4_OUTER_MIN_ROWS
enum { OUTER_U8, OUTER_Q4 };   /* the weights of an int_outer call */
static int int_outer(int format, const float *x, const uint8_t *w, const void *params, const float *bias,
                     float *y, int M, int N, int K, int threads);
#endif
/* AVX2 has no dpbusd: its int8 dot product (maddubs on |q| and signed activations, two parts)
 * costs more than fp32's FMAs, and prompt rows ran at 0.46-0.72x fp32 (-march=haswell build, 1B
 * shape, 16-40 rows). From this many rows its weights are unpacked a block at a time for the fp32
 * outer-product kernel: the activations stay fp32, as above 48 rows (BLAS), so a prompt's numbers
 * differ from a decode's by the activations' int8 rounding (~1e-5 of a block's largest value).
 * From 8 rather than 16 (a decode batch of 8-15): the default model's 30 layers of products
 * (Zen 3, as above, 2026-12-03) unpacked took 21.5-21.7 ms at 4-8 rows and 28.0 at 12, by the dot
 * kernel 14.1 at 4, 19.8-20.3 at 6, 22.8 at 7, 26.2 at 8 and 38.4 at 12. */
#define AVX2_U8_DEQUANT_ROWS 8

/* From how many rows pd_linear_u8 multiplies with fp32 activations (0: it never does). */
int pd_u8_dequant_rows(void) {
#if PDCHAT_INT8_PATH == PD_INT8_AVX2
    return AVX2_U8_DEQUANT_ROWS;
#else
    return 0;
#endif
}

int pd_linear_u8(const float *x, const uint8_t *w, const float *scales, const float *bias, float *y,
                 int M, int N, int K, int threads) {
#ifdef U8_OUTER_MIN_ROWS
    if (M >= U8_OUTER_MIN_ROWS) return int_outer(OUTER_U8, x, w, scales, bias, y, M, N, K, threads);
#elif PDCHAT_INT8_PATH == PD_INT8_AVX2
    if (M >= AVX2_U8_DEQUANT_ROWS) return outer_product(x, NULL, w, NULL, NULL, scales, bias, y, M, N, K, threads);
#endif
    int nb = K / QBLOCK;
    int8_t *hi = malloc((size_t)2 * M * K);
    float *xs = malloc(sizeof(float) * ((size_t)M * nb + M));
    if (!hi || !xs) {
        free(hi);
        free(xs);
        return -1;
    }
    int8_t *lo = hi + (size_t)M * K;
    float *corr = xs + (size_t)M * nb;
    quantize_rows(x, M, K, hi, lo, xs, corr);
    struct u8_job job = {w, scales, bias, xs, corr, hi, lo, y, M, N, K};
    parallel_rows(u8_rows, &job, N, row_chunk(N, threads), threads);
    free(hi);
    free(xs);
    return 0;
}

/* ---- 4-bit weights: y[M, N] = x[M, K] @ w^T + bias -------------------------------------------
 * Groups of 32 weights of a row, each w = d * u + m with u in 0..15 (asymmetric: a group's range
 * need not be centred on zero), d and m in bf16 (a shift makes them fp32). Storage: u two to a
 * byte, 16 bytes a group, byte i holding weight i in its low nibble and weight 16 + i in its high
 * one (one load, an AND and a shift give the group in order); params[n, g] = (d, m).
 * Activations are quantized to int8 in blocks of 32, one part only (the weights' 4-bit error
 * dwarfs the activations'): x ~= xs * xq. Then per group
 *   <w, x> = d * xs * <u, xq> + m * xs * sum(xq)
 * where <u, xq> is exact integer arithmetic on every path (u is a valid byte signed or unsigned;
 * maddubs pairs reach 2 * 15 * 127, inside its int16) and xs * sum(xq) is computed once per block. */
#define Q4_GROUP 32
#define Q4_GROUP_BYTES (Q4_GROUP / 2)

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Activations to int8 in blocks of 32 (one per weight group), with their scales xs and the
 * offset term's factor xz = xs * sum(q), so that over a group <w, x> = d * xs * <u, xq> + m * xz.
 * Both are stored once per lane a group's products fill (Q4_XS_LANES: 4 int32 lanes on x86), xz
 * shared out among the lanes (a power of two: exact), so the scales of a load's groups are one
 * vector load each, not a gather, and the offset term is one more multiply-add in the same loop.
 * The groups of a block of Q4_SPLIT are stored split, the first halves of the Q4_SPLIT groups
 * then their second halves, as one load of the weights' nibbles holds them (low nibbles: first
 * halves); the groups past the last whole block keep their order. */
#if PDCHAT_INT8_PATH == PD_INT8_AVX512VNNI
#define Q4_SPLIT 4
#elif PDCHAT_INT8_PATH == PD_INT8_AVXVNNI || PDCHAT_INT8_PATH == PD_INT8_AVX2
#define Q4_SPLIT 2
#else
#define Q4_SPLIT 1
#endif
#if Q4_SPLIT > 1
#define Q4_XS_LANES 4
#else
#define Q4_XS_LANES 1
#endif
#define Q4_XS(r, g) (((int64_t)(r) * ng + (g)) * Q4_XS_LANES)

static inline int64_t q4_x_index(int g, int i, int ng) {
    int block = g / Q4_SPLIT, gi = g % Q4_SPLIT;
    if ((block + 1) * Q4_SPLIT > ng)                     /* past the last whole block: in order */
        return (int64_t)g * Q4_GROUP + i;
    int64_t base = (int64_t)block * Q4_SPLIT * Q4_GROUP;
    int half = i / Q4_GROUP_BYTES;
    return base + half * Q4_SPLIT * Q4_GROUP_BYTES + gi * Q4_GROUP_BYTES + i % Q4_GROUP_BYTES;
}

/* One group of activations to int8 (q) with its scale s; returns sum(q). */
static inline int quantize_group(const float *p, int8_t *q, float *s) {
    float inv = block_scale(p, Q4_GROUP, s);
    int sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < Q4_GROUP; i++) {
        int v = (int)round_even(p[i] * inv);
        q[i] = (int8_t)v;
        sum += v;
    }
    return sum;
}

static void quantize_q4_blocks(const float *x, int M, int K, int8_t *q, float *xs, float *xz) {
    int ng = K / Q4_GROUP;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < ng; g++) {
            int8_t v[Q4_GROUP];
            float s;
            int sum = quantize_group(x + (int64_t)m * K + g * Q4_GROUP, v, &s);
            for (int i = 0; i < Q4_GROUP; i++) q[(int64_t)m * K + q4_x_index(g, i, ng)] = v[i];
            for (int l = 0; l < Q4_XS_LANES; l++) {
                xs[Q4_XS(m, g) + l] = s;
                xz[Q4_XS(m, g) + l] = s * (float)sum / (float)Q4_XS_LANES;
            }
        }
}

/* For one weight row (wr, its params pr: (d, m) per group in bf16) and R <= Q4_TILE activation
 * rows (x, xs, xz; rows K apart), ng groups: out[r] = sum_g d * xs * <u, xq> + m * xz. The
 * weights are unpacked and their params widened once for all R rows (a chunked prefill
 * multiplies 32 rows by every matrix), and inside the loop: a decode step's rows are 576 weights
 * wide in the default model, so anything done once per row (a pass over its params, a separate
 * dot product for the offset term) cost as much as the products. Called with R constant, the
 * row loops unroll into registers. */
#define Q4_TILE 4
/* The paths with a decode kernel (dot_q4_decode) take this many weight rows at a time. */
#if PDCHAT_INT8_PATH == PD_INT8_AVX512VNNI || PDCHAT_INT8_PATH == PD_INT8_AVXVNNI || PDCHAT_INT8_PATH == PD_INT8_AVX2
#define Q4_DECODE_ROWS 4
#endif
/* The dot products below are INLINE, into each call with a constant R: a call per weight row (the
 * compiler's choice at R = 1) cost a seventh of a decode step in spills and the return through
 * memory. */
#if PDCHAT_INT8_PATH == PD_INT8_AVX512VNNI || PDCHAT_INT8_PATH == PD_INT8_AVXVNNI || PDCHAT_INT8_PATH == PD_INT8_AVX2
/* Groups' (d, m) pairs, bf16 to floats in order: the bf16 bits are a float's top half. */
static inline __m256 q4_params8(const uint16_t *pr) {            /* four groups */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)pr)), 16));
}
static inline __m128 q4_params4(const uint16_t *pr) {            /* two groups */
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)pr)), 16));
}
#endif
#if PDCHAT_INT8_PATH == PD_INT8_AVX512VNNI
/* a product's lanes 4g..4g+3 hold group g of a block of four: its d and m are params 2g and 2g+1 */
#define Q4_BY_D _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0)
#define Q4_BY_M _mm512_set_epi32(7, 7, 7, 7, 5, 5, 5, 5, 3, 3, 3, 3, 1, 1, 1, 1)

/* The two groups left after the blocks of four (ng is even) as 64 bytes in order, one per lane */
INLINE __m512i q4_tail_weights(const uint8_t *wg) {
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m256i p = _mm256_loadu_si256((const __m256i *)wg);
    __m256i lo = _mm256_and_si256(p, nib), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), nib);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                              _mm256_permute2x128_si256(lo, hi, 0x31), 1);
}

/* Those two groups (u, their params pg) against one activation row's (xg, its scales s0 and s1,
 * offset factors z0 and z1): the products into f, the offset term returned. */
INLINE float q4_tail_row(__m512i u, const uint16_t *pg, const int8_t *xg, float s0, float s1,
                         float z0, float z1, __m512 *f) {
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(xg));
    /* insertf64x4, not insertf32x8: the latter is AVX-512 DQ, which this path does not require */
    __m512 s = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(bf16_to_f32(pg[0]) * s0)),
                                                   _mm256_castps_pd(_mm256_set1_ps(bf16_to_f32(pg[2]) * s1)), 1));
    *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, *f);
    return (bf16_to_f32(pg[1]) * z0 + bf16_to_f32(pg[3]) * z1) * (float)Q4_XS_LANES;
}

INLINE void dot_q4_rows(const uint8_t *wr, const uint16_t *pr, const int8_t *x, const float *xs,
                        const float *xz, int ng, int K, int R, float *out) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512 f[Q4_TILE];
    float tail[Q4_TILE];
    for (int r = 0; r < R; r++) {
        f[r] = _mm512_setzero_ps();
        tail[r] = 0.f;
    }
    int g = 0;
    for (; g + Q4_SPLIT <= ng; g += Q4_SPLIT) {   /* four groups (128 weights) per pair of products */
        __m512i p = _mm512_loadu_si512(wr + g * Q4_GROUP_BYTES);
        __m512i lo = _mm512_and_si512(p, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), nibble);
        __m512 dm = _mm512_castps256_ps512(q4_params8(pr + 2 * g));
        __m512 d = _mm512_permutexvar_ps(Q4_BY_D, dm), m = _mm512_permutexvar_ps(Q4_BY_M, dm);
        for (int r = 0; r < R; r++) {
            const int8_t *xb = x + (int64_t)r * K + g * Q4_GROUP;
            __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xb)),
                                              hi, _mm512_loadu_si512(xb + 4 * Q4_GROUP_BYTES));
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_loadu_ps(xs + Q4_XS(r, g))), f[r]);
            f[r] = _mm512_fmadd_ps(m, _mm512_loadu_ps(xz + Q4_XS(r, g)), f[r]);
        }
    }
    if (g < ng) {
        __m512i u = q4_tail_weights(wr + g * Q4_GROUP_BYTES);
        for (int r = 0; r < R; r++)
            tail[r] = q4_tail_row(u, pr + 2 * g, x + (int64_t)r * K + g * Q4_GROUP, xs[Q4_XS(r, g)],
                                  xs[Q4_XS(r, g + 1)], xz[Q4_XS(r, g)], xz[Q4_XS(r, g + 1)], &f[r]);
    }
    for (int r = 0; r < R; r++)
        out[r] = _mm512_reduce_add_ps(f[r]) + tail[r];
}

/* A decode's one activation row against W <= Q4_DECODE_ROWS weight rows at once (wr and pr: the
 * first row's; the others wstride bytes and pstride params further): the activations and their
 * scales are loaded once for all W, and the rows' chains of multiply-adds overlap. Each load
 * prefetches the same bytes of the rows at `ahead` (the next four, wstride apart): reading four
 * rows side by side, the hardware's prefetcher did not keep up (a 16384 x 2048 matrix streamed at
 * 15.5 GB/s against 18.9 one row at a time; with the prefetch, 48.7). Into L2, not L1: the default
 * model's int4 decode step 6-7% faster (2-core AMD EPYC, 2026-11-27, 12 alternating rounds twice;
 * the int8 rows' prefetch into L2 made int8's 3-4% slower, and the 256-bit form's, built here for
 * the AVX2 path, +3.5% and -0.4%: both stay in L1). */
INLINE void dot_q4_decode(const uint8_t *wr, const uint16_t *pr, int64_t wstride, int64_t pstride,
                          const uint8_t *ahead, const int8_t *x, const float *xs, const float *xz,
                          int ng, int W, float *out) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512 f[Q4_DECODE_ROWS];
    float tail[Q4_DECODE_ROWS];
    for (int w = 0; w < W; w++) {
        f[w] = _mm512_setzero_ps();
        tail[w] = 0.f;
    }
    int g = 0;
    for (; g + Q4_SPLIT <= ng; g += Q4_SPLIT) {
        __m512i xl = _mm512_loadu_si512(x + g * Q4_GROUP), xh = _mm512_loadu_si512(x + g * Q4_GROUP + 4 * Q4_GROUP_BYTES);
        __m512 s = _mm512_loadu_ps(xs + Q4_XS(0, g)), z = _mm512_loadu_ps(xz + Q4_XS(0, g));
        for (int w = 0; w < W; w++) {
            __builtin_prefetch(ahead + w * wstride + g * Q4_GROUP_BYTES, 0, INTO_L2);
            __m512i p = _mm512_loadu_si512(wr + w * wstride + g * Q4_GROUP_BYTES);
            __m512i lo = _mm512_and_si512(p, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), nibble);
            __m512 dm = _mm512_castps256_ps512(q4_params8(pr + w * pstride + 2 * g));
            __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh);
            f[w] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_permutexvar_ps(Q4_BY_D, dm), s), f[w]);
            f[w] = _mm512_fmadd_ps(_mm512_permutexvar_ps(Q4_BY_M, dm), z, f[w]);
        }
    }
    if (g < ng)
        for (int w = 0; w < W; w++)
            tail[w] = q4_tail_row(q4_tail_weights(wr + w * wstride + g * Q4_GROUP_BYTES), pr + w * pstride + 2 * g,
                                  x + g * Q4_GROUP, xs[Q4_XS(0, g)], xs[Q4_XS(0, g + 1)], xz[Q4_XS(0, g)],
                                  xz[Q4_XS(0, g + 1)], &f[w]);
    for (int w = 0; w < W; w++)
        out[w] = _mm512_reduce_add_ps(f[w]) + tail[w];
}
#elif PDCHAT_INT8_PATH == PD_INT8_AVXVNNI || PDCHAT_INT8_PATH == PD_INT8_AVX2
/* lanes 4g..4g+3 hold group g of a block of two: its d and m are params 2g and 2g+1 */
#define Q4_BY_D _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0)
#define Q4_BY_M _mm256_set_epi32(3, 3, 3, 3, 1, 1, 1, 1)

/* <u, x> of two groups: low nibbles (first halves) with xlo, high ones with xhi, in eight lanes */
INLINE __m256i q4_dot2(__m256i lo, __m256i hi, __m256i xlo, __m256i xhi) {
#if PDCHAT_INT8_PATH == PD_INT8_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xlo), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xhi), ones));
#endif
}

INLINE void dot_q4_rows(const uint8_t *wr, const uint16_t *pr, const int8_t *x, const float *xs,
                        const float *xz, int ng, int K, int R, float *out) {
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m256 f[Q4_TILE];
    for (int r = 0; r < R; r++)
        f[r] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g += Q4_SPLIT) {     /* two groups (64 weights) per pair of products */
        __m256i p = _mm256_loadu_si256((const __m256i *)(wr + g * Q4_GROUP_BYTES));
        __m256i lo = _mm256_and_si256(p, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), nibble);
        __m256 dm = _mm256_castps128_ps256(q4_params4(pr + 2 * g));
        __m256 d = _mm256_permutevar8x32_ps(dm, Q4_BY_D), m = _mm256_permutevar8x32_ps(dm, Q4_BY_M);
        for (int r = 0; r < R; r++) {
            const int8_t *xb = x + (int64_t)r * K + g * Q4_GROUP;
            __m256i dot = q4_dot2(lo, hi, _mm256_loadu_si256((const __m256i *)xb),
                                  _mm256_loadu_si256((const __m256i *)(xb + 32)));
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_loadu_ps(xs + Q4_XS(r, g))), f[r]);
            f[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xz + Q4_XS(r, g)), f[r]);
        }
    }
    for (int r = 0; r < R; r++)
        out[r] = sum8(f[r]);
}

/* As the AVX-512 path's: one activation row against W weight rows, sharing its loads. */
INLINE void dot_q4_decode(const uint8_t *wr, const uint16_t *pr, int64_t wstride, int64_t pstride,
                          const uint8_t *ahead, const int8_t *x, const float *xs, const float *xz,
                          int ng, int W, float *out) {
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m256 f[Q4_DECODE_ROWS];
    for (int w = 0; w < W; w++)
        f[w] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g += Q4_SPLIT) {
        __m256i xlo = _mm256_loadu_si256((const __m256i *)(x + g * Q4_GROUP));
        __m256i xhi = _mm256_loadu_si256((const __m256i *)(x + g * Q4_GROUP + 32));
        __m256 s = _mm256_loadu_ps(xs + Q4_XS(0, g)), z = _mm256_loadu_ps(xz + Q4_XS(0, g));
        for (int w = 0; w < W; w++) {
            __builtin_prefetch(ahead + w * wstride + g * Q4_GROUP_BYTES, 0, INTO_L1);
            __m256i p = _mm256_loadu_si256((const __m256i *)(wr + w * wstride + g * Q4_GROUP_BYTES));
            __m256i lo = _mm256_and_si256(p, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), nibble);
            __m256 dm = _mm256_castps128_ps256(q4_params4(pr + w * pstride + 2 * g));
            __m256i dot = q4_dot2(lo, hi, xlo, xhi);
            f[w] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_permutevar8x32_ps(dm, Q4_BY_D), s), f[w]);
            f[w] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(dm, Q4_BY_M), z, f[w]);
        }
    }
    for (int w = 0; w < W; w++)
        out[w] = sum8(f[w]);
}
#elif PDCHAT_INT8_PATH == PD_INT8_NEON_DOT
INLINE void dot_q4_rows(const uint8_t *wr, const uint16_t *pr, const int8_t *x, const float *xs,
                        const float *xz, int ng, int K, int R, float *out) {
    const uint8x16_t nibble = vdupq_n_u8(0x0f);
    float32x4_t f[Q4_TILE];
    float offset[Q4_TILE];
    for (int r = 0; r < R; r++) {
        f[r] = vdupq_n_f32(0.f);
        offset[r] = 0.f;
    }
    for (int g = 0; g < ng; g++) {
        uint8x16_t p = vld1q_u8(wr + g * Q4_GROUP_BYTES);
        int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(p, nibble)), hi = vreinterpretq_s8_u8(vshrq_n_u8(p, 4));
        float d = bf16_to_f32(pr[2 * g]), m = bf16_to_f32(pr[2 * g + 1]);
        for (int r = 0; r < R; r++) {
            const int8_t *xg = x + (int64_t)r * K + g * Q4_GROUP;
            int32x4_t dot = vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, vld1q_s8(xg)), hi, vld1q_s8(xg + 16));
            f[r] = vfmaq_n_f32(f[r], vcvtq_f32_s32(dot), d * xs[Q4_XS(r, g)]);
            offset[r] += m * xz[Q4_XS(r, g)];
        }
    }
    for (int r = 0; r < R; r++)
        out[r] = vaddvq_f32(f[r]) + offset[r];
}
#else
INLINE void dot_q4_rows(const uint8_t *wr, const uint16_t *pr, const int8_t *x, const float *xs,
                        const float *xz, int ng, int K, int R, float *out) {
    for (int r = 0; r < R; r++) {
        const int8_t *xr = x + (int64_t)r * K;
        float f = 0.f;
        for (int g = 0; g < ng; g++) {
            const uint8_t *wg = wr + g * Q4_GROUP_BYTES;
            const int8_t *xg = xr + g * Q4_GROUP;
            int32_t d = 0;
#pragma omp simd reduction(+ : d)
            for (int i = 0; i < Q4_GROUP_BYTES; i++)
                d += (int32_t)(wg[i] & 15) * xg[i] + (int32_t)(wg[i] >> 4) * xg[i + Q4_GROUP_BYTES];
            f += bf16_to_f32(pr[2 * g]) * xs[Q4_XS(r, g)] * (float)d + bf16_to_f32(pr[2 * g + 1]) * xz[Q4_XS(r, g)];
        }
        out[r] = f;
    }
}
#endif

struct q4_job {
    const uint8_t *w;
    const uint16_t *params;
    const float *bias, *xs, *xz;
    const int8_t *x;
    float *y;
    int M, N, K;
};

#ifdef Q4_DECODE_ROWS
/* A decode (one activation row): Q4_DECODE_ROWS weight rows at a time. */
static void q4_decode_rows(const struct q4_job *j, int lo, int hi) {
    int ng = j->K / Q4_GROUP;
    int64_t wstride = j->K / 2, pstride = 2 * ng;
    for (int n = lo; n < hi; n += Q4_DECODE_ROWS) {
        int W = hi - n < Q4_DECODE_ROWS ? hi - n : Q4_DECODE_ROWS;
        float out[Q4_DECODE_ROWS];
        const uint8_t *wr = j->w + n * wstride;
        const uint16_t *pr = j->params + n * pstride;
        /* the next four rows where the matrix has them (else these again: a pointer past the end
         * of the matrix would be undefined, even unread) */
        const uint8_t *ahead = n + 2 * Q4_DECODE_ROWS <= j->N ? wr + Q4_DECODE_ROWS * wstride : wr;
        if (W == Q4_DECODE_ROWS)
            dot_q4_decode(wr, pr, wstride, pstride, ahead, j->x, j->xs, j->xz, ng, Q4_DECODE_ROWS, out);
        else
            dot_q4_decode(wr, pr, wstride, pstride, ahead, j->x, j->xs, j->xz, ng, W, out);
        for (int w = 0; w < W; w++)
            j->y[n + w] = out[w] + (j->bias ? j->bias[n + w] : 0.f);
    }
}
#endif

static void q4_rows(const void *p, int lo, int hi) {
    const struct q4_job *j = p;
#ifdef Q4_DECODE_ROWS
    if (j->M == 1) {
        q4_decode_rows(j, lo, hi);
        return;
    }
#endif
    int ng = j->K / Q4_GROUP;
    for (int n = lo; n < hi; n++) {
        const uint8_t *wr = j->w + (int64_t)n * (j->K / 2);
        const uint16_t *pr = j->params + (int64_t)n * 2 * ng;
        float b = j->bias ? j->bias[n] : 0.f, out[Q4_TILE];
        for (int m = 0; m < j->M; m += Q4_TILE) {
            int R = j->M - m < Q4_TILE ? j->M - m : Q4_TILE;
            const int8_t *x = j->x + (int64_t)m * j->K;
            const float *xs = j->xs + Q4_XS(m, 0), *xz = j->xz + Q4_XS(m, 0);
            /* constants let the compiler keep the tile in registers (1: a decode where there is
             * no dot_q4_decode, and ragged ends) */
            if (R == Q4_TILE)
                dot_q4_rows(wr, pr, x, xs, xz, ng, j->K, Q4_TILE, out);
            else if (R == 1)
                dot_q4_rows(wr, pr, x, xs, xz, ng, j->K, 1, out);
            else
                dot_q4_rows(wr, pr, x, xs, xz, ng, j->K, R, out);
            for (int r = 0; r < R; r++)
                j->y[(int64_t)(m + r) * j->N + n] = out[r] + b;
        }
    }
}

/* int8 weights (stored q + 128) to fp32, out[N, K] = q * scales[n], for long prefills (BLAS);
 * rows split over the pool (torch's three element-wise passes made int8 prefill 0.84x fp32). */
struct u8_unpack_job {
    const uint8_t *w;
    const float *scales;
    float *out;
    int K;
};

static void u8_unpack_rows(const void *p, int lo, int hi) {
    const struct u8_unpack_job *j = p;
    for (int n = lo; n < hi; n++)
        unpack_u8_row(j->w + (int64_t)n * j->K, j->scales[n], j->out + (int64_t)n * j->K, j->K);
}

void pd_unpack_u8(const uint8_t *w, const float *scales, float *out, int N, int K, int threads) {
    struct u8_unpack_job job = {w, scales, out, K};
    parallel_rows(u8_unpack_rows, &job, N, row_chunk(N, threads), threads);
}

/* 4-bit weights to fp32 (out[N, K]) for long prefills, which BLAS computes faster than the
 * integer products; rows split over the pool. */
struct q4_unpack_job {
    const uint8_t *w;
    const uint16_t *params;
    float *out;
    int K;
};

static void q4_unpack_rows(const void *p, int lo, int hi) {
    const struct q4_unpack_job *j = p;
    int ng = j->K / Q4_GROUP;
    for (int n = lo; n < hi; n++)
        for (int g = 0; g < ng; g++) {
            const uint8_t *wg = j->w + (int64_t)n * (j->K / 2) + g * Q4_GROUP_BYTES;
            const uint16_t *pg = j->params + ((int64_t)n * ng + g) * 2;
            float d = bf16_to_f32(pg[0]), m = bf16_to_f32(pg[1]), *o = j->out + (int64_t)n * j->K + g * Q4_GROUP;
#pragma omp simd
            for (int i = 0; i < Q4_GROUP_BYTES; i++) {
                o[i] = d * (float)(wg[i] & 15) + m;
                o[i + Q4_GROUP_BYTES] = d * (float)(wg[i] >> 4) + m;
            }
        }
}

void pd_unpack_q4(const uint8_t *w, const uint16_t *params, float *out, int N, int K, int threads) {
    struct q4_unpack_job job = {w, params, out, K};
    parallel_rows(q4_unpack_rows, &job, N, row_chunk(N, threads), threads);
}

/* ---- Integer products in outer-product form: prefills and batches from 6-8 rows on -----------
 * The dot-product kernels above convert and scale each (weight row, activation row, block) sum on
 * its own: about 9 multiply-adds an instruction against fp32's 16, and a 32-token prompt ran at
 * 0.73x fp32's speed in int8 (default model, 0.51x on the 1B shape). Here the activations are
 * stored k-major, four consecutive int8 of a row in each int32 lane, OUTER_LANES rows to a
 * vector: a weight row's 4 bytes, broadcast, meet a vector of activation rows in one dpbusd; R
 * weight rows x V vectors of rows keep their sums in registers for a whole block, and a block's
 * conversion and scaling serves a vector of rows at once. The arithmetic is the dot-product
 * kernels' (the same quantized activations, exact integer sums per block): only the order of the
 * float additions differs. AVX-512 VNNI, AVX-VNNI (256 bits, 16 registers: one vector of
 * rows a tile) and, for int4, AVX2 share the code through these names. */
#if PDCHAT_INT8_PATH == PD_INT8_AVX512VNNI
#define OUTER_LANES 16
#define OUTER_V 2           /* vectors of rows a tile takes (32 registers) */
typedef __m512i ivec;
typedef __m512 fvec;
#define I_ZERO() _mm512_setzero_si512()
#define I_LOAD(p) _mm512_loadu_si512(p)
#define I_SET1(w) _mm512_set1_epi32(w)
#define DPBUSD(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define F_ZERO() _mm512_setzero_ps()
#define F_LOAD(p) _mm512_loadu_ps(p)
#define F_STORE(p, v) _mm512_storeu_ps(p, v)
#define F_SET1(f) _mm512_set1_ps(f)
#define F_OF(v) _mm512_cvtepi32_ps(v)
#define F_MUL(a, b) _mm512_mul_ps(a, b)
#define F_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif PDCHAT_INT8_PATH == PD_INT8_AVXVNNI || PDCHAT_INT8_PATH == PD_INT8_AVX2
#define OUTER_LANES 8
#define OUTER_V 1
typedef __m256i ivec;
typedef __m256 fvec;
#define I_ZERO() _mm256_setzero_si256()
#define I_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define I_SET1(w) _mm256_set1_epi32(w)
#if PDCHAT_INT8_PATH == PD_INT8_AVXVNNI
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
/* AVX2 has no dpbusd; maddubs adds two u8 x s8 products into an int16, which holds them exactly
 * only while they stay within it. int4's weights (0..15) against activations of at most 127 make
 * at most 3,810 a pair, and a group of 32's 8 words add up in int16 (16 products a lane, at most
 * 30,480), widened once a group: dpbusd's sums. The 30 layers' int4 products (Zen 3, 2026-12-03,
 * three alternating runs) took 1-9% less time at 16, 32 and 128 rows than with a widening per
 * word. int8's stored weights (q + 128, up to 255) would saturate it, so AVX2's int8 rows take the
 * fp32 kernel instead (AVX2_U8_DEQUANT_ROWS) and the int8 tiles are not built. */
#define Q4_GROUP_ADD(acc, u, s) _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s))
#define Q4_GROUP_SUM(acc) _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
_Static_assert(Q4_GROUP / 2 * 15 * 127 <= 32767, "a group's int4 products fit an int16");
#endif
#define F_ZERO() _mm256_setzero_ps()
#define F_LOAD(p) _mm256_loadu_ps(p)
#define F_STORE(p, v) _mm256_storeu_ps(p, v)
#define F_SET1(f) _mm256_set1_ps(f)
#define F_OF(v) _mm256_cvtepi32_ps(v)
#define F_MUL(a, b) _mm256_mul_ps(a, b)
#define F_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#endif

#if defined(OUTER_LANES) && !defined(Q4_GROUP_ADD)
#define Q4_GROUP_ADD(acc, u, s) DPBUSD(acc, u, s)
#define Q4_GROUP_SUM(acc) (acc)
#endif

#ifdef OUTER_LANES
#define OUTER_R 4        /* weight rows of a tile */
#define WORDS(k) ((k) / 4)

struct int_outer_job {
    const float *x, *bias;
    const uint8_t *w;
    const void *params;       /* int8: row scales (float); int4: (d, m) per group (bf16) */
    int32_t *q;               /* activation words at word_at() (int8: hi, then lo at + K/4 * MP) */
    float *xs, *xz;           /* [blocks][MP] block scales; int4: xs * sum(q) too; int8: corr[M] in xz */
    float *y;
    int format, M, MP, N, K;
    int *failed;              /* set when a thread could not get its scratch */
};

/* Where activation row m's word i (its int8 4i..4i+3) is: rows by vectors, each vector's
 * words k-major (lane = row), so a strip of rows reads one stream and a panel is one run of
 * memory (k-major across all rows, a panel of a 256-row prefill was read at a stride of 1 KB,
 * which L2 could hold only a part of: 47 against 138 G multiply-adds a second). */
static inline int64_t word_at(const struct int_outer_job *j, int m, int i) {
    return ((int64_t)(m / OUTER_LANES) * WORDS(j->K) + i) * OUTER_LANES + m % OUTER_LANES;
}

/* Word i of a block's OUTER_LANES rows (row r's at words[r][i]) into the tiles' layout, from
 * activation row m0 (a vector's first) on: a vector's lanes at once, where row by row was a store
 * of 4 bytes per word (quantizing the default model's activations: 0.92 -> 0.73 ns a value). */
static inline void store_words(const struct int_outer_job *j, int32_t *q, int m0, int w0, int n,
                               const int32_t words[OUTER_LANES][QBLOCK / 4]) {
    for (int i = 0; i < n; i++) {
        int32_t *at = q + word_at(j, m0, w0 + i);
#pragma omp simd
        for (int r = 0; r < OUTER_LANES; r++) at[r] = words[r][i];
    }
}

#ifdef U8_OUTER_MIN_ROWS
/* Vectors of activation rows [lo, hi) quantized as for pd_linear_u8 (two parts a block of 64),
 * into the tiles' layout; rows past M are zeros with zero scales. */
static void u8_outer_acts(const void *p, int lo, int hi) {
    const struct int_outer_job *j = p;
    int K = j->K, MP = j->MP;
    int32_t *qh = j->q, *ql = j->q + (int64_t)WORDS(K) * MP;
    for (int m0 = lo * OUTER_LANES; m0 < hi * OUTER_LANES; m0 += OUTER_LANES) {
        int rows = j->M - m0 < OUTER_LANES ? j->M - m0 : OUTER_LANES;
        float c[OUTER_LANES] = {0};
        for (int b = 0; b < K / QBLOCK; b++) {
            int32_t h[OUTER_LANES][QBLOCK / 4] = {{0}}, l[OUTER_LANES][QBLOCK / 4] = {{0}};
            for (int r = 0; r < rows; r++)
                c[r] += quantize_block(j->x + (int64_t)(m0 + r) * K + b * QBLOCK, (int8_t *)h[r], (int8_t *)l[r],
                                       &j->xs[(int64_t)b * MP + m0 + r]);
            for (int r = rows; r < OUTER_LANES; r++) j->xs[(int64_t)b * MP + m0 + r] = 0.f;
            store_words(j, qh, m0, WORDS(b * QBLOCK), QBLOCK / 4, h);
            store_words(j, ql, m0, WORDS(b * QBLOCK), QBLOCK / 4, l);
        }
        for (int r = 0; r < rows; r++) j->xz[m0 + r] = 128.f * c[r];
    }
}
#endif

/* The same for int4's activations (one part, a block of 32: quantize_group). */
static void q4_outer_acts(const void *p, int lo, int hi) {
    const struct int_outer_job *j = p;
    int K = j->K, MP = j->MP;
    for (int m0 = lo * OUTER_LANES; m0 < hi * OUTER_LANES; m0 += OUTER_LANES) {
        int rows = j->M - m0 < OUTER_LANES ? j->M - m0 : OUTER_LANES;
        for (int g = 0; g < K / Q4_GROUP; g++) {
            int32_t v[OUTER_LANES][QBLOCK / 4] = {{0}};
            for (int r = 0; r < rows; r++) {
                float s;
                int sum = quantize_group(j->x + (int64_t)(m0 + r) * K + g * Q4_GROUP, (int8_t *)v[r], &s);
                j->xs[(int64_t)g * MP + m0 + r] = s;
                j->xz[(int64_t)g * MP + m0 + r] = s * (float)sum;
            }
            for (int r = rows; r < OUTER_LANES; r++) j->xs[(int64_t)g * MP + m0 + r] = j->xz[(int64_t)g * MP + m0 + r] = 0.f;
            store_words(j, j->q, m0, WORDS(g * Q4_GROUP), Q4_GROUP / 4, v);
        }
    }
}

static inline ivec word_of(const uint8_t *at) {
    int32_t word;
    memcpy(&word, at, 4);
    return I_SET1(word);
}

/* A tile's sums (f[r * V + v]) into y, a run of R floats per activation row: int8's undo the
 * weights' +128 offset (corr, in xz) and take the row's scale; int4's are final. */
static inline void outer_store(const struct int_outer_job *j, const fvec *f, int R, int V, int n0, int m0) {
    const float *scales = j->format == OUTER_U8 ? j->params : NULL;
    for (int v = 0; v < V; v++) {
        float t[OUTER_R][OUTER_LANES];
        for (int r = 0; r < R; r++) F_STORE(t[r], f[r * V + v]);
        for (int i = 0; i < OUTER_LANES && m0 + OUTER_LANES * v + i < j->M; i++) {
            int m = m0 + OUTER_LANES * v + i;
            float *y = j->y + (int64_t)m * j->N + n0, corr = scales ? j->xz[m] : 0.f;
            for (int r = 0; r < R; r++)
                y[r] = (scales ? (t[r][i] - corr) * scales[n0 + r] : t[r][i]) + (j->bias ? j->bias[n0 + r] : 0.f);
        }
    }
}

/* Tiles go by chunks of K: OUTER_KC bytes of it (int8: 8 blocks) for OUTER_NC weight rows at a
 * time, so a pair of activation vectors' words for the chunk (both parts: 32 KB) stay in L1 while
 * the block's tiles pass, the block's weights (32 KB) beside them or in L2; tiles over the whole of
 * K re-read their activation words from L2 for every 4 weight rows. The sums in between wait in
 * `part`. 512 bytes rather than 256: 1.0-1.5x as fast in A/Bs from 48 to 1,024
 * rows, 1,024 bytes slower at 256 rows (2026-11-26). */
#define OUTER_KC 512
#define OUTER_NC 64

/* A tile's sums: into y (outer_store) once K's last block is in (`last`), else kept in part
 * (weight row r, vector v at part + r * pstride + v * OUTER_LANES) for the next chunk. */
static inline void tile_done(const struct int_outer_job *j, const fvec *f, int R, int V, int n0, int m0,
                             int last, float *part, int64_t pstride) {
    if (last) {
        outer_store(j, f, R, V, n0, m0);
        return;
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) F_STORE(part + r * pstride + v * OUTER_LANES, f[r * V + v]);
}

#ifdef U8_OUTER_MIN_ROWS
/* The sums of weight rows n0.. (R of them) x activation rows m0.. (V vectors) over K's blocks
 * [b0, b1), int8's: per block f += (hi_sum + lo_sum / 254) * xs, continuing the sums in part.
 * A tile of one vector fetches the next tile's weights into L2 as it goes: its four short runs of
 * a row each left the hardware's prefetcher behind, and the default model's 30 layers of products
 * at 8 and 16 rows took 21-24% less time (2-core AMD EPYC, 2026-11-27, alternating runs; with two
 * vectors, where a tile has twice the arithmetic per weight, it gained nothing; AVX-VNNI's
 * one-vector tiles not measured). */
#define U8_OUTER_TILE(R, V)                                                                        \
    static void u8_outer_##R##x##V(const struct int_outer_job *j, int n0, int m0, int b0, int b1,  \
                                   float *part, int64_t pstride) {                                 \
        int K = j->K, MP = j->MP;                                                                  \
        const uint8_t *w = j->w + (int64_t)n0 * K;                                                 \
        const int32_t *qh = j->q + word_at(j, m0, 0), *ql = qh + (int64_t)WORDS(K) * MP;           \
        fvec f[R][V];                                                                              \
        for (int r = 0; r < R; r++)                                                                \
            for (int v = 0; v < V; v++)                                                            \
                f[r][v] = b0 ? F_LOAD(part + r * pstride + v * OUTER_LANES) : F_ZERO();            \
        for (int b = b0; b < b1; b++) {                                                            \
            ivec ih[R][V], il[R][V];                                                               \
            for (int r = 0; r < R; r++)                                                            \
                for (int v = 0; v < V; v++) ih[r][v] = il[r][v] = I_ZERO();                        \
            for (int i = WORDS(b * QBLOCK); i < WORDS((b + 1) * QBLOCK); i++) {                    \
                if (V == 1 && (i & 15) == 0 && n0 + 2 * R <= j->N)                               \
                    for (int r = 0; r < R; r++) __builtin_prefetch(w + (int64_t)(R + r) * K + 4 * i, 0, INTO_L2); \
                ivec xh[V], xl[V];                                                                 \
                for (int v = 0; v < V; v++) {                                                      \
                    xh[v] = I_LOAD(qh + ((int64_t)v * WORDS(K) + i) * OUTER_LANES);                \
                    xl[v] = I_LOAD(ql + ((int64_t)v * WORDS(K) + i) * OUTER_LANES);                \
                }                                                                                  \
                for (int r = 0; r < R; r++) {                                                      \
                    ivec wb = word_of(w + (int64_t)r * K + 4 * i);                                 \
                    for (int v = 0; v < V; v++) {                                                  \
                        ih[r][v] = DPBUSD(ih[r][v], wb, xh[v]);                                    \
                        il[r][v] = DPBUSD(il[r][v], wb, xl[v]);                                    \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            for (int v = 0; v < V; v++) {                                                          \
                fvec xs = F_LOAD(j->xs + (int64_t)b * MP + m0 + OUTER_LANES * v);                  \
                for (int r = 0; r < R; r++) {                                                      \
                    fvec sum = F_FMA(F_OF(il[r][v]), F_SET1(1.f / LO_SCALE), F_OF(ih[r][v]));      \
                    f[r][v] = F_FMA(sum, xs, f[r][v]);                                             \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        tile_done(j, &f[0][0], R, V, n0, m0, b1 == K / QBLOCK, part, pstride);                     \
    }

U8_OUTER_TILE(4, 1)
U8_OUTER_TILE(1, 1)
#if OUTER_V == 2
U8_OUTER_TILE(4, 2)
U8_OUTER_TILE(1, 2)
#endif
#endif

/* int4: per group f += d * xs * <u, q> + m * xz over groups [g0, g1), from the tile's rows of the
 * chunk unpacked to one byte a weight in k order (u, OUTER_KC bytes a row) and their params as
 * floats (dm: d, m per group, OUTER_KC / Q4_GROUP groups a row). */
#define Q4_OUTER_TILE(R, V)                                                                        \
    static void q4_outer_##R##x##V(const struct int_outer_job *j, const uint8_t *u, const float *dm, int n0, \
                                   int m0, int g0, int g1, float *part, int64_t pstride) {          \
        int K = j->K, MP = j->MP;                                                                  \
        const int32_t *q = j->q + word_at(j, m0, 0);                                               \
        fvec f[R][V];                                                                              \
        for (int r = 0; r < R; r++)                                                                \
            for (int v = 0; v < V; v++)                                                            \
                f[r][v] = g0 ? F_LOAD(part + r * pstride + v * OUTER_LANES) : F_ZERO();            \
        for (int g = g0; g < g1; g++) {                                                            \
            ivec acc[R][V];                                                                        \
            for (int r = 0; r < R; r++)                                                            \
                for (int v = 0; v < V; v++) acc[r][v] = I_ZERO();                                  \
            const int32_t *qg = q + (int64_t)WORDS(g * Q4_GROUP) * OUTER_LANES;                    \
            const uint8_t *ug = u + (g - g0) * Q4_GROUP;                                           \
            /* two words a pass: unrolled whole, GCC summed the group's products in another     \
             * order and spilled them; by the group's bounds, a loop's counters each pass. Two   \
             * (AVX2, Zen 3, 2026-12-03, one thread, two shapes at 16-128 rows): 57-70 G         \
             * multiply-adds a second, against 45-56 before and 36-52 unrolled whole (the VNNI  \
             * builds' dpbusd tiles take the same loop, not measured there). */                  \
            _Pragma("GCC unroll 2") for (int i = 0; i < WORDS(Q4_GROUP); i++) {                \
                ivec xw[V];                                                                        \
                for (int v = 0; v < V; v++) xw[v] = I_LOAD(qg + ((int64_t)v * WORDS(K) + i) * OUTER_LANES); \
                for (int r = 0; r < R; r++) {                                                      \
                    ivec wb = word_of(ug + (int64_t)r * OUTER_KC + 4 * i);                         \
                    for (int v = 0; v < V; v++) acc[r][v] = Q4_GROUP_ADD(acc[r][v], wb, xw[v]);    \
                }                                                                                  \
            }                                                                                      \
            for (int v = 0; v < V; v++) {                                                          \
                fvec xs = F_LOAD(j->xs + (int64_t)g * MP + m0 + OUTER_LANES * v);                  \
                fvec xz = F_LOAD(j->xz + (int64_t)g * MP + m0 + OUTER_LANES * v);                  \
                for (int r = 0; r < R; r++) {                                                      \
                    const float *p = dm + 2 * ((int64_t)r * (OUTER_KC / Q4_GROUP) + g - g0);       \
                    fvec dot = F_MUL(F_OF(Q4_GROUP_SUM(acc[r][v])), xs);                           \
                    f[r][v] = F_FMA(dot, F_SET1(p[0]), f[r][v]);                                   \
                    f[r][v] = F_FMA(xz, F_SET1(p[1]), f[r][v]);                                    \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        tile_done(j, &f[0][0], R, V, n0, m0, g1 == K / Q4_GROUP, part, pstride);                   \
    }
Q4_OUTER_TILE(4, 1)
Q4_OUTER_TILE(1, 1)
#if OUTER_V == 2
Q4_OUTER_TILE(4, 2)
Q4_OUTER_TILE(1, 2)
#endif

/* The activation rows [m0, m1) a block of weight rows meets before the next block: as many as
 * keep their words within OUTER_PANEL_BYTES (in L2 while the blocks pass), a multiple of 32.
 * Without the panels a 512-row prefill's words were re-read from L3 by every tile (int8: 0.47x
 * BLAS's fp32). */
#define OUTER_PANEL_BYTES (512 << 10)
static int outer_panel(const struct int_outer_job *j, int parts) {
    int rows = (int)(OUTER_PANEL_BYTES / ((int64_t)parts * j->K)) & ~31;
    return rows < 32 ? 32 : rows;
}

/* A tile of V vectors of rows where the build has one, else V single vectors. */
#if OUTER_V == 2
#define PAIR_OR_ONE(fn2, fn1, V, ...) ((V) == 2 ? fn2(__VA_ARGS__) : fn1(__VA_ARGS__))
#else
#define PAIR_OR_ONE(fn2, fn1, V, ...) fn1(__VA_ARGS__)
#endif

/* What a thread's chunks share: its panel of activation rows [m0, m1), block of weight rows
 * [n0, n1), chunk of K (int8 blocks or int4 groups [k0, k1)) and the sums in between. */
struct outer_chunk {
    int m0, m1, n0, n1, k0, k1;
    float *part;              /* OUTER_NC x (m1 - m0): weight row-major */
};

#ifdef U8_OUTER_MIN_ROWS
/* Each pair of activation vectors against the block's tiles of OUTER_R weight rows (single rows
 * at the block's end). */
static void u8_outer_chunk(const struct int_outer_job *j, const struct outer_chunk *c) {
    int64_t ps = c->m1 - c->m0;
    for (int V, m = c->m0; m < c->m1; m += OUTER_LANES * V) {
        V = c->m1 - m >= OUTER_V * OUTER_LANES ? OUTER_V : 1;
        for (int n = c->n0; n < c->n1; n += OUTER_R) {
            float *part = c->part + (n - c->n0) * ps + (m - c->m0);
            if (c->n1 - n >= OUTER_R)
                PAIR_OR_ONE(u8_outer_4x2, u8_outer_4x1, V, j, n, m, c->k0, c->k1, part, ps);
            else
                for (int r = 0; r < c->n1 - n; r++)
                    PAIR_OR_ONE(u8_outer_1x2, u8_outer_1x1, V, j, n + r, m, c->k0, c->k1, part + r * ps, ps);
        }
    }
}
#endif

static void q4_outer_chunk(const struct int_outer_job *j, const struct outer_chunk *c, const uint8_t *u,
                           const float *dm) {
    int64_t ps = c->m1 - c->m0;
    for (int V, m = c->m0; m < c->m1; m += OUTER_LANES * V) {
        V = c->m1 - m >= OUTER_V * OUTER_LANES ? OUTER_V : 1;
        for (int n = c->n0; n < c->n1; n += OUTER_R) {
            const uint8_t *ur = u + (int64_t)(n - c->n0) * OUTER_KC;
            const float *dr = dm + 2 * (n - c->n0) * (OUTER_KC / Q4_GROUP);
            float *part = c->part + (n - c->n0) * ps + (m - c->m0);
            if (c->n1 - n >= OUTER_R)
                PAIR_OR_ONE(q4_outer_4x2, q4_outer_4x1, V, j, ur, dr, n, m, c->k0, c->k1, part, ps);
            else
                for (int r = 0; r < c->n1 - n; r++)
                    PAIR_OR_ONE(q4_outer_1x2, q4_outer_1x1, V, j, ur + r * OUTER_KC, dr + 2 * r * (OUTER_KC / Q4_GROUP),
                                n + r, m, c->k0, c->k1, part + r * ps, ps);
        }
    }
}

/* The block's weight rows [n0, n1) over the chunk's groups [k0, k1) to one byte a weight in k
 * order (u, OUTER_KC bytes a row) and their params as floats (dm). Each row fetches the same
 * chunk 16 rows further into L2: the default model's 30 layers of int4 products 4-11% faster at
 * 8-48 rows (2-core AMD EPYC, 2026-11-27, alternating runs; 4 rows further: 3-10%). */
static void q4_outer_unpack(const struct int_outer_job *j, const struct outer_chunk *c, uint8_t *u, float *dm) {
    int ng = j->K / Q4_GROUP;
    for (int n = c->n0; n < c->n1; n++) {
        const uint8_t *wr = j->w + (int64_t)n * (j->K / 2);
        const uint16_t *pr = (const uint16_t *)j->params + (int64_t)n * 2 * ng;
        uint8_t *ur = u + (int64_t)(n - c->n0) * OUTER_KC;
        float *dr = dm + 2 * (n - c->n0) * (OUTER_KC / Q4_GROUP);
        if (n + 16 < c->n1) {
            for (int g = c->k0; g < c->k1; g += 64 / Q4_GROUP_BYTES)
                __builtin_prefetch(wr + (int64_t)16 * (j->K / 2) + g * Q4_GROUP_BYTES, 0, INTO_L2);
            __builtin_prefetch(pr + (int64_t)16 * 2 * ng + 2 * c->k0, 0, INTO_L2);
        }
        for (int g = c->k0; g < c->k1; g++) {
            uint8_t *o = ur + (g - c->k0) * Q4_GROUP;
#pragma omp simd
            for (int i = 0; i < Q4_GROUP_BYTES; i++) {
                o[i] = wr[g * Q4_GROUP_BYTES + i] & 15;
                o[i + Q4_GROUP_BYTES] = wr[g * Q4_GROUP_BYTES + i] >> 4;
            }
            dr[2 * (g - c->k0)] = bf16_to_f32(pr[2 * g]);
            dr[2 * (g - c->k0) + 1] = bf16_to_f32(pr[2 * g + 1]);
        }
    }
}

/* Weight rows [lo, hi): per panel of activation rows, per block of OUTER_NC weight rows, per chunk
 * of K (int4's unpacked once for the panel's rows). */
static void int_outer_rows(const void *p, int lo, int hi) {
    const struct int_outer_job *j = p;
    int int8 = j->format == OUTER_U8, panel = outer_panel(j, int8 ? 2 : 1);
    int per_chunk = OUTER_KC / (int8 ? QBLOCK : Q4_GROUP), chunks = j->K / (int8 ? QBLOCK : Q4_GROUP);
    /* the sums, then int4's unpacked chunk (dm, u: 40 KB, unused by int8) */
    size_t floats = (size_t)OUTER_NC * panel + 2 * OUTER_NC * (OUTER_KC / Q4_GROUP);
    float *part = thread_scratch(SCRATCH_SUMS, sizeof(float) * floats + (size_t)OUTER_NC * OUTER_KC);
    if (!part) {
        __atomic_store_n(j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    float *dm = part + OUTER_NC * panel;
    uint8_t *u = (uint8_t *)(dm + 2 * OUTER_NC * (OUTER_KC / Q4_GROUP));
    struct outer_chunk c = {.part = part};
    for (c.m0 = 0; c.m0 < j->MP; c.m0 += panel) {
        c.m1 = c.m0 + panel < j->MP ? c.m0 + panel : j->MP;
        for (c.n0 = lo; c.n0 < hi; c.n0 += OUTER_NC) {
            c.n1 = c.n0 + OUTER_NC < hi ? c.n0 + OUTER_NC : hi;
            for (c.k0 = 0; c.k0 < chunks; c.k0 += per_chunk) {
                c.k1 = c.k0 + per_chunk < chunks ? c.k0 + per_chunk : chunks;
#ifdef U8_OUTER_MIN_ROWS
                if (int8) {
                    u8_outer_chunk(j, &c);
                    continue;
                }
#endif
                q4_outer_unpack(j, &c, u, dm);
                q4_outer_chunk(j, &c, u, dm);
            }
        }
    }
}

/* y[M, N] = x @ W^T + bias for W int8 (format OUTER_U8: w, row scales) or int4 (OUTER_Q4: w,
 * params). Returns -1 if out of memory. */
static int int_outer(int format, const float *x, const uint8_t *w, const void *params, const float *bias,
                     float *y, int M, int N, int K, int threads) {
    int MP = (M + OUTER_LANES - 1) / OUTER_LANES * OUTER_LANES, failed = 0, int8 = format == OUTER_U8;
    int blocks = K / (int8 ? QBLOCK : Q4_GROUP);
    /* not kept between calls (a long prompt's are tens of MB); every word and scale is written */
    size_t words = (size_t)(int8 ? 2 : 1) * WORDS(K) * MP;
    int32_t *q = malloc(sizeof(int32_t) * words + sizeof(float) * 2 * blocks * MP);
    if (!q) return -1;
    float *xs = (float *)(q + words);
    struct int_outer_job job = {x, bias, w, params, q, xs, xs + (size_t)blocks * MP, y, format, M, MP, N, K, &failed};
    int vectors = MP / OUTER_LANES;
#ifdef U8_OUTER_MIN_ROWS
    rows_fn acts = int8 ? u8_outer_acts : q4_outer_acts;
#else
    rows_fn acts = q4_outer_acts;             /* (AVX2: int4 only) */
#endif
    parallel_rows(acts, &job, vectors, (vectors + threads - 1) / threads, threads);
    parallel_rows(int_outer_rows, &job, N, row_chunk(N, threads), threads);
    free(q);
    return failed ? -1 : 0;
}
#endif

/* K must be a multiple of 64. Returns -1 if out of memory (the caller raises). */
int pd_linear_q4(const float *x, const uint8_t *w, const uint16_t *params, const float *bias, float *y,
                 int M, int N, int K, int threads) {
#ifdef Q4_OUTER_MIN_ROWS
    if (M >= Q4_OUTER_MIN_ROWS) return int_outer(OUTER_Q4, x, w, params, bias, y, M, N, K, threads);
#endif
    int ng = K / Q4_GROUP;
    int8_t *xq = malloc((size_t)M * K);
    float *xs = malloc(sizeof(float) * 2 * Q4_XS_LANES * (size_t)M * ng);
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    float *xz = xs + (size_t)Q4_XS_LANES * M * ng;
    quantize_q4_blocks(x, M, K, xq, xs, xz);
    struct q4_job job = {w, params, bias, xs, xz, xq, y, M, N, K};
    parallel_rows(q4_rows, &job, N, row_chunk(N, threads), threads);
    free(xq);
    free(xs);
    return 0;
}

static inline float inv_rms(const float *x, int D, float eps) {
    float ss = dot_f32(x, x, D);
    return 1.f / sqrtf(ss / (float)D + eps);
}

/* Elementwise work is split over tokens only for prefill-sized runs: below this, waking the pool
 * costs more than it saves. */
#define PAR_MIN_ELEMS (1LL << 18)

static void over_tokens(rows_fn fn, const void *job, int T, int64_t elems, int threads) {
    int t = elems >= PAR_MIN_ELEMS ? threads : 1;
    int chunk = T / (4 * t);
    parallel_rows(fn, job, T, chunk > 0 ? chunk : 1, t);
}

struct norm_job {
    float *x;
    const float *delta, *w;
    float *out;
    int D;
    float eps;
};

/* Tokens [lo, hi): x[t] += delta[t] where there is a delta; out[t] = w * x[t] / rms(x[t]). */
static void norm_rows(const void *p, int lo, int hi) {
    const struct norm_job *j = p;
    int D = j->D;
    for (int t = lo; t < hi; t++) {
        float *xr = j->x + (int64_t)t * D, *o = j->out + (int64_t)t * D;
        if (j->delta) {
            const float *dr = j->delta + (int64_t)t * D;
#pragma omp simd
            for (int i = 0; i < D; i++) xr[i] += dr[i];
        }
        float r = inv_rms(xr, D, j->eps);
#pragma omp simd
        for (int i = 0; i < D; i++) o[i] = j->w[i] * (xr[i] * r);
    }
}

/* out[t] = w * x[t] / rms(x[t]) (out may be x) */
void pd_rms_norm(const float *x, const float *w, float *out, int T, int D, float eps, int threads) {
    struct norm_job job = {(float *)x, NULL, w, out, D, eps};      /* x is only read: no delta */
    over_tokens(norm_rows, &job, T, (int64_t)T * D, threads);
}

/* x[t] += delta[t] (in place: x is the residual stream); out[t] = w * x[t] / rms(x[t]) */
void pd_add_rms_norm(float *x, const float *delta, const float *w, float *out, int T, int D, float eps,
                     int threads) {
    struct norm_job job = {x, delta, w, out, D, eps};
    over_tokens(norm_rows, &job, T, (int64_t)T * D, threads);
}

struct rope_job {
    float *q, *k;
    int64_t q_stride, k_stride;
    int H, KVH, D;
    const float *cos, *sin;
};

static void rope_rows(const void *p, int lo, int hi) {
    const struct rope_job *j = p;
    int H = j->H, D = j->D, half = D / 2;
    for (int t = lo; t < hi; t++) {
        const float *c = j->cos + (int64_t)t * D, *s = j->sin + (int64_t)t * D;
        for (int h = 0; h < H + j->KVH; h++) {
            float *x = h < H ? j->q + t * j->q_stride + (int64_t)h * D : j->k + t * j->k_stride + (int64_t)(h - H) * D;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* Rotary embedding, half-split layout, in place on q [T, H, D] and k [T, KVH, D] whose token rows
 * are `q_stride` / `k_stride` apart (views into the fused qkv output); cos/sin: [T, D]. */
void pd_rope(float *q, int64_t q_stride, int H, float *k, int64_t k_stride, int KVH, const float *cos,
             const float *sin, int T, int D, int threads) {
    struct rope_job job = {q, k, q_stride, k_stride, H, KVH, D, cos, sin};
    over_tokens(rope_rows, &job, T, (int64_t)T * (H + KVH) * D, threads);
}

struct silu_job {
    const float *gu;
    float *out;
    int I;
};

static void silu_rows(const void *p, int lo, int hi) {
    const struct silu_job *j = p;
    int I = j->I;
    for (int t = lo; t < hi; t++) {
        const float *g = j->gu + (int64_t)t * 2 * I, *u = g + I;
        float *o = j->out + (int64_t)t * I;
#pragma omp simd
        for (int i = 0; i < I; i++) {
            float v = g[i];
            o[i] = v / (1.f + exp_fast(-v)) * u[i];
        }
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i] */
void pd_silu_mul(const float *gu, float *out, int T, int I, int threads) {
    struct silu_job job = {gu, out, I};
    over_tokens(silu_rows, &job, T, (int64_t)T * I, threads);
}

/* Write k[t], v[t] ([KVH, D] rows, strided) to cache slot slots[t]; slot -1 is skipped.
 * Cache layout per layer: [num_blocks * block_size, KVH, D]. */
void pd_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                 float *v_cache, const int64_t *slots, int T, int KVH, int D) {
    size_t row = (size_t)KVH * D;
    for (int t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, k + t * k_stride, row * sizeof(float));
        memcpy(v_cache + slots[t] * row, v + t * v_stride, row * sizeof(float));
    }
}

#define KEY_TILE 32
#define MAX_HEAD_DIM 512

/* Paged attention for a flat ragged batch (semantics in kernels/reference.py): query j of
 * sequence s sits at position ctx[s] - n_s + j and attends keys 0..position. Online softmax over
 * tiles of keys. q rows are q_stride apart; out is [T, H, D]. */
struct attention_job {
    const float *q, *k_cache, *v_cache;
    int64_t q_stride;
    const int32_t *tables, *cu_q, *ctx;
    int max_blocks, H, KVH, D, bs;
    float scale;
    float *out;
    /* Work split by keys (a lone decode's groups, a slice's few tiles): `parts` ranges of each
     * token's keys, each part's unnormalized sums, max and total per (token, head) in `partial`
     * (D + 2 floats) until merged (merge_parts). */
    int parts;
    float *partial;
};

/* Part `part` of the keys 0..keys-1: [*lo, *last]. */
static inline void part_range(const struct attention_job *job, int keys, int part, int *lo, int *last) {
    *lo = (int)((int64_t)keys * part / job->parts);
    *last = (int)((int64_t)keys * (part + 1) / job->parts) - 1;
}

/* Where (token, head) `at`'s result goes: its output row, or its part's row of sums (D floats, then
 * the max and the total) when the keys go in parts. */
static inline float *result_row(const struct attention_job *job, int64_t at, int part) {
    return job->parts == 1 ? job->out + at * job->D : job->partial + (at * job->parts + part) * (job->D + 2);
}

/* Where key j's row of one KV head (at `head`) starts in either cache. */
static inline size_t key_at(const struct attention_job *job, const int32_t *table, size_t head, int j) {
    return ((size_t)table[j / job->bs] * job->bs + j % job->bs) * job->KVH * job->D + head;
}

/* Keys [from, to)'s rows of one KV head (at `head`) in one cache (K or V), fetched into L2. Into L1
 * these fetches held up the loads they ran ahead of: one decode query over 1,500 keys, 30 layers'
 * caches read from memory, took 4.9 ms, 3.1-3.6 into L2 (4,000 keys: 19.8 against 12.5); in the
 * engine a decode step after a 1,728-token prompt 7% faster with fp32 weights and 15% with int8
 * (2-core AMD EPYC, 2026-11-27, alternating runs). A tile fetches the next keys' K rows before
 * scoring and their V rows after, where all 16 keys' K and V lines at once (128) would run past
 * what the core keeps in flight. Until 2026-11-27 GCC had deleted the tiles' fetches (INLINE,
 * above), and the first pass over a KV head's keys waited on memory: one thread took 37 ms for 30
 * layers of a 15-query slice over 1,500 keys from memory, 28 in cache. Fetched, that slice takes
 * 17-19% less time in an -march=haswell build and 22-32% less in the AVX-512 one (one and two
 * threads), 15 queries over 600 or 3,000 keys 31-38% less in both, 31 over 1,000 8% and 24%
 * (alternating runs; the same bits); two tiles of keys ahead, or in four parts, did no better. */
INLINE void prefetch_rows(const struct attention_job *job, const float *cache, const int32_t *table, size_t head,
                          int from, int to) {
    for (int j = from; j < to; j++) {
        size_t at = key_at(job, table, head, j);
        for (int d = 0; d < job->D; d += 16) __builtin_prefetch(cache + at + d, 0, INTO_L2);   /* (a 64-byte line) */
    }
}

/* Key j's rows in both caches (a decode's fetch ahead, key by key). */
INLINE void prefetch_key(const struct attention_job *job, const int32_t *table, size_t head, int j) {
    prefetch_rows(job, job->k_cache, table, head, j, j + 1);
    prefetch_rows(job, job->v_cache, table, head, j, j + 1);
}

/* Sequences of TILE_MIN_QUERIES or more queries (prefill slices, long verifies) go by tiles
 * (attention_tiles); the others one (token, KV head) pair at a time (attention_groups). */
#define TILE_MIN_QUERIES 4
/* Floats in one vector of the attention code (`lanes`): 16 (a zmm; four NEON q registers), 8 where
 * x86 has 16 vector registers of 256 bits (AVX2, AVX-VNNI). There, vectors of 16 (two ymm each)
 * spilled the decodes' queries and sums and the tiles' scores to the stack: an -march=haswell
 * build here took a decode token over 1,500 keys (30 layers) in 14.0 ms, 4.0 with 8, a 15-query
 * slice in 64.5 ms, 31.8 with 8; in the engine after a 1,728-token prompt TPOT 33.0 -> 22.6 ms
 * with fp32 weights, 21.5 -> 11.4 with int8 (2-core AMD EPYC, 2026-11-27, alternating runs). */
#if defined(__AVX__) && !defined(__AVX512F__)
#define TR 8
#else
#define TR 16
#endif
#define TK 16   /* keys scored at once */
/* A vector of TR floats (GCC/Clang vector extensions: the compiler maps it to the target's
 * registers: a zmm, a ymm, or four NEON q registers). */
typedef float lanes __attribute__((vector_size(TR * sizeof(float))));
/* A vector the compiler must hold in a register from here on (an empty asm that "changes" it). With
 * 16 ymm GCC otherwise read a tile's query vectors from memory again in every multiply-add that
 * used them (a memory operand each), and on a 2-core AMD EPYC (Zen 3, AVX2) the loads, not the
 * multiply-adds, set the pace: scores for 4 keys x 16 rows in L1 at 2.1 vector multiply-adds a ns,
 * 3.8 held (a core's peak 5.7; 2026-11-28). Elsewhere a no-op (not measured there; on Arm a vector
 * is four registers). */
#if TR == 8                   /* (256-bit x86) */
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

/* A tile is TILE_ROWS (query, head) rows of one KV head, one vector lane each, in TILE_VECS vectors:
 * 16 everywhere, so two vectors of 8 on 256-bit x86, where each broadcast key or value element then
 * serves two multiply-adds and each key is read once per 16 rows. Against tiles of one vector of 8,
 * an -march=haswell build here took 12-18% less time over 30 layers' caches from memory (15
 * queries over 1,500 keys three times, 31 over 1,000, 15 over 3,000; 2026-11-28, alternating runs);
 * its results moved by up to 3e-7 (with half the tiles, a slice's keys split between the threads
 * where they had not). */
#define TILE_VECS (TR == 8 ? 2 : 1)
#define TILE_ROWS (TR * TILE_VECS)
static int tiles_of(int queries, int group) { return (queries * group + TILE_ROWS - 1) / TILE_ROWS; }

/* One tile: up to TILE_ROWS rows of one KV head against keys 0..last, vectorized across the rows.
 * The queries are copied transposed once (qt[d][row]), so a key's scores for all rows are one
 * multiply-add per dimension and vector with the key's element broadcast: the scores stay in
 * registers, the online softmax runs on vectors of rows, and the weighted values are added into
 * ot[d][row] the same way. Lanes past the tile's rows carry zeros and are never written out. */
/* A tile of V vectors (TILE_VECS, or 1 for a pass's last rows where they fit one vector: below)
 * scores this many keys at once: 8 vectors of sums, so that they, the query's vectors and a
 * broadcast key element fit 16 registers (AVX2's ymm; 16 keys' sums spilled there). */
#define SCORED_KEYS(V) (8 / (V))
/* Dimensions whose value sums add_values carries at once (8 vectors): each sum is a chain of TK
 * dependent multiply-adds, and one chain at a time waited on their latency. With both, 30 layers'
 * attention of a 15-query slice over 1,500 keys took 14-16% less time (AVX-512 build) and 23% less
 * (-march=haswell build, tiles of 8 rows then) with one layer's caches in cache, 9% and 15% from
 * memory; 32 queries over 1,000 keys from memory 9% and 20% (2-core AMD EPYC, 2026-11-27,
 * alternating runs; the same bits). */
#define VALUE_DIMS(V) (8 / (V))

/* Scores of a tile's nk keys (rows `row` floats apart) for its V vectors of rows: acc[j] = K[j] . qt. */
INLINE void score_keys(const float *kr, size_t row, int nk, int D, lanes (*qt)[TILE_VECS],
                       lanes acc[TK][TILE_VECS], const int V) {
    for (int j = 0; j < TK; j++)
        for (int v = 0; v < V; v++) acc[j][v] = (lanes){0};
    if (nk == TK) {     /* (the usual full tile: constant bounds keep the scores in registers) */
        for (int j0 = 0; j0 < TK; j0 += SCORED_KEYS(V))
            for (int d = 0; d < D; d++) {
                lanes q[TILE_VECS];
                memcpy(q, qt[d], sizeof(lanes) * V);
                for (int v = 0; v < V; v++) IN_REGISTER(q[v]);
#pragma GCC unroll 16
                for (int j = j0; j < j0 + SCORED_KEYS(V); j++) {
                    float k = kr[j * row + d];
#pragma GCC unroll 2
                    for (int v = 0; v < V; v++) acc[j][v] += k * q[v];
                }
            }
    } else {
        for (int d = 0; d < D; d++)
            for (int j = 0; j < nk; j++)
                for (int v = 0; v < V; v++) acc[j][v] += kr[j * row + d] * qt[d][v];
    }
}

typedef int32_t ilanes __attribute__((vector_size(TR * sizeof(int32_t))));   /* a comparison's lanes */

static inline lanes splat(float c) { return (lanes){0} + c; }

/* Lane by lane: `yes` where the mask's lane is set (all ones), else `no`. */
static inline lanes pick(ilanes mask, lanes yes, lanes no) {
    ilanes a, b;
    memcpy(&a, &yes, sizeof a);
    memcpy(&b, &no, sizeof b);
    a = (a & mask) | (b & ~mask);
    lanes r;
    memcpy(&r, &a, sizeof r);
    return r;
}

/* exp_fast on a whole vector, step for step (the clamp, 2^n e^r with r in two parts, the series to
 * r^6); n by adding and taking away 1.5 * 2^23: the nearest integer for every |x / ln 2| below 2^22,
 * as rintf gives, but where the compiler fuses the multiply into that add it rounds the exact
 * product, so where x / ln 2 lies within a rounding of a half integer the two may take neighbouring
 * n (r then about ln 2 / 2 either way: the same accuracy, results an ulp or so apart). No output of
 * the attention tests or of a 30-layer A/B of the two builds moved. */
#define LANES_FMA(a, b, c) ((a) * (b) + (c))    /* (contracted to one multiply-add, as fmaf) */
static inline lanes exp_lanes(lanes x) {
    x = pick(x < -87.f, splat(-87.f), pick(x > 88.f, splat(88.f), x));
    lanes n = (x * EXP_LOG2E + 12582912.f) - 12582912.f;
    lanes r = n * -EXP_LN2_HI + x;
    r = n * -EXP_LN2_LO + r;
    lanes p = EXP_SERIES(LANES_FMA, r);
    ilanes e = (__builtin_convertvector(n, ilanes) + 127) << 23;      /* 2^n */
    lanes scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* Online softmax over one tile, per row (a lane of one of its V vectors): keys past a row's
 * position (lim) count for nothing where `masked`; the scores s become the weights, m and l the
 * running max and sum, alpha what the sums so far scale by. On whole vectors where the scores are:
 * as loops over floats (omp simd) it needed the scores copied out and back, and GCC's tuning for a
 * Zen 1 ran those loops 128 bits at a time. (Inlined with `masked` and V constants.) */
INLINE void softmax_pass(lanes s[TK][TILE_VECS], int nk, int j0, const float *lim_f, float *m_f, float *l_f,
                         lanes *alpha, const int masked, const int V) {
    for (int v = 0; v < V; v++) {
        lanes lim, m, l;
        memcpy(&lim, lim_f + v * TR, sizeof lim);
        memcpy(&m, m_f + v * TR, sizeof m);
        memcpy(&l, l_f + v * TR, sizeof l);
        lanes mt = m;
        for (int j = 0; j < nk; j++) {
            lanes most = pick(mt > s[j][v], mt, s[j][v]);           /* max_f(mt, s): its NaN too */
            mt = masked ? pick(splat((float)(j0 + j)) <= lim, most, mt) : most;
        }
        alpha[v] = pick(mt == -INFINITY, splat(1.f), exp_lanes(m - mt));
        l *= alpha[v];
        for (int j = 0; j < nk; j++) {
            lanes w = exp_lanes(s[j][v] - mt);
            s[j][v] = masked ? pick(splat((float)(j0 + j)) <= lim, w, splat(0.f)) : w;
            l += s[j][v];
        }
        memcpy(m_f + v * TR, &mt, sizeof mt);
        memcpy(l_f + v * TR, &l, sizeof l);
    }
}

/* Rows go in position order, so where the first row sees all nk keys every row does, and the tile
 * takes them unmasked (padding rows too: their sums are never written out): all but a slice's last
 * tile or two of keys, 2-8% off its attention (15 queries over 1,500 keys, 30 layers, 2-core AMD
 * EPYC, 2026-11-27: 5-8% with one layer's caches in cache, 2-7% read from memory, in alternating
 * runs; the same bits). */
INLINE void softmax_keys(lanes s[TK][TILE_VECS], int nk, int j0, const float *lim, float *m, float *l,
                         lanes *alpha, const int V) {
    if (j0 + nk - 1 <= lim[0]) softmax_pass(s, nk, j0, lim, m, l, alpha, 0, V);
    else softmax_pass(s, nk, j0, lim, m, l, alpha, 1, V);
}

/* ot[d] = ot[d] * scale + sum over the tile's keys of V[j][d] * p[j], for its V vectors of rows at
 * once (a row's p, scale and ot in lane r % TR of vector r / TR). */
INLINE void add_values(const float *vr, size_t row, int nk, int D, lanes p[TK][TILE_VECS],
                       const lanes *scale, lanes (*ot)[TILE_VECS], const int V) {
    if (nk == TK && D % VALUE_DIMS(V) == 0) {
        for (int d = 0; d < D; d += VALUE_DIMS(V)) {
            lanes o[VALUE_DIMS(V)][TILE_VECS];
#pragma GCC unroll 8
            for (int i = 0; i < VALUE_DIMS(V); i++)
                for (int v = 0; v < V; v++) o[i][v] = ot[d + i][v] * scale[v];
#pragma GCC unroll 16
            for (int j = 0; j < TK; j++)
#pragma GCC unroll 8
                for (int i = 0; i < VALUE_DIMS(V); i++) {
                    float x = vr[j * row + d + i];
#pragma GCC unroll 2
                    for (int v = 0; v < V; v++) o[i][v] += x * p[j][v];
                }
#pragma GCC unroll 8
            for (int i = 0; i < VALUE_DIMS(V); i++)
                for (int v = 0; v < V; v++) ot[d + i][v] = o[i][v];
        }
    } else {
        for (int d = 0; d < D; d++)
            for (int v = 0; v < V; v++) {
                lanes o = ot[d][v] * scale[v];
                for (int j = 0; j < nk; j++) o += vr[j * row + d] * p[j][v];
                ot[d][v] = o;
            }
    }
}

/* Tiles of one KV head that go over its keys together (a pass): each block of keys comes from
 * memory once for all of them (the other tiles read it from L1), where each tile had read all the
 * keys again. A tile's state (below) is 8 KB at the default model's head size, so three and a
 * block of keys fit L1 (its arrays take 64 KB of stack at the largest head size, 192 KB a pass).
 * With the query vectors held in registers (IN_REGISTER), 30 layers of a slice beside a decode,
 * caches from memory, took 6% less time for 15 queries over 1,500 keys, 12% for 31 over 1,000, 10%
 * for 23 over 700, 3-4% for 15 over 600 or 3,000 (2-core AMD EPYC, Zen 3, AVX2 only, 2026-11-28,
 * 30 alternating rounds each, paired medians); results move by up to 3e-7 (the passes' key ranges
 * split between threads where the tiles' had not). Not measured on AVX-512 or Arm builds (their
 * results checked against a reference: the suite, and an Arm build under qemu). */
#define TILES_PER_PASS 3
static int passes_of(int queries, int group) {
    return (tiles_of(queries, group) + TILES_PER_PASS - 1) / TILES_PER_PASS;
}

/* One tile over a pass: its queries (transposed, scaled), its value sums, each row's softmax max
 * and total, and each row's position (the last key it sees). */
struct tile_state {
    lanes qt[MAX_HEAD_DIM][TILE_VECS], ot[MAX_HEAD_DIM][TILE_VECS];
    float m[TILE_ROWS], l[TILE_ROWS], lim[TILE_ROWS];
};

static void start_tile(const struct attention_job *job, const float *const *qrow, const int *pos, int R,
                       struct tile_state *t) {
    for (int d = 0; d < job->D; d++) {
        float x[TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; r++) x[r] = r < R ? qrow[r][d] * job->scale : 0.f;
        memcpy(t->qt[d], x, sizeof x);
        for (int v = 0; v < TILE_VECS; v++) t->ot[d][v] = (lanes){0};
    }
    for (int r = 0; r < TILE_ROWS; r++) {
        t->m[r] = -INFINITY, t->l[r] = 0.f;
        t->lim[r] = r < R ? (float)pos[r] : -1.f;     /* padding lanes see no key */
    }
}

/* A tile's first V vectors of rows against nk keys from j0 (their rows from `first` on in each cache). */
INLINE void tile_keys_of(const struct attention_job *job, struct tile_state *t, size_t first, int j0, int nk,
                         const int V) {
    size_t row = (size_t)job->KVH * job->D;
    lanes acc[TK][TILE_VECS], scale[TILE_VECS];
    score_keys(job->k_cache + first, row, nk, job->D, t->qt, acc, V);
    softmax_keys(acc, nk, j0, t->lim, t->m, t->l, scale, V);
    add_values(job->v_cache + first, row, nk, job->D, acc, scale, t->ot, V);
}

/* A tile of `rows` rows against nk keys: where they fit one vector of a two-vector tile (a pass's
 * last rows: 21 of a 7-token slice's, GQA of 3, are 16 + 5), one vector's work. Each row's sums
 * are its own whatever the tile's width, so the results are the same. */
static inline void tile_keys(const struct attention_job *job, struct tile_state *t, int rows, size_t first,
                             int j0, int nk) {
    if (TILE_VECS > 1 && rows <= TR) tile_keys_of(job, t, first, j0, nk, 1);
    else tile_keys_of(job, t, first, j0, nk, TILE_VECS);
}

/* One pass: R rows of one KV head (up to TILES_PER_PASS tiles, rows in position order) against
 * part `part` of the keys up to the last row's position; a tile's rows past their own positions
 * count those keys for nothing (exactly: weights of 0 and a rescale by 1). */
static void attend_pass(const struct attention_job *job, const float *const *qrow, const int *pos, int R,
                        const int32_t *table, size_t head, int part, float *const *out_rows) {
    int tiles = (R + TILE_ROWS - 1) / TILE_ROWS, bs = job->bs, D = job->D;
    struct tile_state tile[TILES_PER_PASS];
    for (int i = 0; i < tiles; i++) {
        int r0 = i * TILE_ROWS;
        start_tile(job, qrow + r0, pos + r0, R - r0 < TILE_ROWS ? R - r0 : TILE_ROWS, &tile[i]);
    }
    int j0, last;
    part_range(job, pos[R - 1] + 1, part, &j0, &last);
    while (j0 <= last) {
        int in_block = bs - j0 % bs, left = last + 1 - j0;
        int nk = left < in_block ? left : in_block;
        nk = nk < TK ? nk : TK;
        size_t first = key_at(job, table, head, j0);
        int next = j0 + nk, ahead = next + TK <= last + 1 ? next + TK : last + 1;   /* fetched meanwhile */
        prefetch_rows(job, job->k_cache, table, head, next, ahead);
        for (int i = 0; i < tiles; i++) {
            tile_keys(job, &tile[i], R - i * TILE_ROWS, first, j0, nk);
            if (i == 0) prefetch_rows(job, job->v_cache, table, head, next, ahead);
        }
        j0 += nk;
    }
    for (int r = 0; r < R; r++) {       /* the output, or a part's sums and their max and total */
        const struct tile_state *t = &tile[r / TILE_ROWS];
        int i = r % TILE_ROWS;
        float inv = job->parts == 1 ? 1.f / t->l[i] : 1.f;
        for (int d = 0; d < D; d++) out_rows[r][d] = t->ot[d][i / TR][i % TR] * inv;
        if (job->parts > 1) out_rows[r][D] = t->m[i], out_rows[r][D + 1] = t->l[i];
    }
}

/* Work items [lo, hi): item = pass * parts + part, a pass being one of one KV head of one tiled
 * sequence, sequences in order. A KV head's rows are (query, head) pairs taken query by query over
 * its group of heads, its tiles shared out between its passes as evenly as they go. */
static void attention_tiles(const void *arg, int lo, int hi) {
    const struct attention_job *job = arg;
    int H = job->H, D = job->D, group = H / job->KVH, P = job->parts;
    for (int item = lo; item < hi; item++) {
        int s = 0, rest = item / P, n;
        for (;; s++) {
            n = job->cu_q[s + 1] - job->cu_q[s];
            if (n < TILE_MIN_QUERIES) continue;
            int items = job->KVH * passes_of(n, group);
            if (rest < items) break;
            rest -= items;
        }
        int tiles = tiles_of(n, group), passes = passes_of(n, group), kvh = rest / passes, p = rest % passes;
        int r0 = tiles * p / passes * TILE_ROWS, r1 = tiles * (p + 1) / passes * TILE_ROWS;
        int R = (r1 < n * group ? r1 : n * group) - r0;
        int t0 = job->cu_q[s], first_pos = job->ctx[s] - n, pos[TILES_PER_PASS * TILE_ROWS];
        const float *qrow[TILES_PER_PASS * TILE_ROWS];
        float *orow[TILES_PER_PASS * TILE_ROWS];
        for (int r = 0; r < R; r++) {
            int qi = (r0 + r) / group, h = kvh * group + (r0 + r) % group;
            qrow[r] = job->q + (int64_t)(t0 + qi) * job->q_stride + (int64_t)h * D;
            orow[r] = result_row(job, (int64_t)(t0 + qi) * H + h, item % P);
            pos[r] = first_pos + qi;
        }
        attend_pass(job, qrow, pos, R, job->tables + (int64_t)s * job->max_blocks, (size_t)kvh * D, item % P, orow);
    }
}

/* Heads of a KV group that attend_heads takes at once (a larger group goes in parts). */
#define GROUP_PART 8
/* Keys ahead of the one being scored whose rows are fetched meanwhile (a decode over 1.7K keys,
 * 30 layers: 7.3 -> 6.4 ms, at 16 as at 8; whole blocks fetched at once did nothing). */
#define AHEAD_KEYS 16

/* n <= TR floats as a vector, lanes past n zero; n == TR compiles to one load. */
static inline lanes lanes_at(const float *p, int n) {
    lanes v = {0};
    if (n == TR) memcpy(&v, p, sizeof v);
    else memcpy(&v, p, (size_t)n * sizeof(float));
    return v;
}

/* The sum of a vector's lanes by halves (GCC summed `for r: s += v[r]` as a chain of scalar adds
 * through the stack: with it, a decode's per-key dot products cost 4x their loads). */
typedef float lanes8 __attribute__((vector_size(8 * sizeof(float))));
typedef float lanes4 __attribute__((vector_size(4 * sizeof(float))));
static inline float sum_lanes(lanes v) {
#if TR == 16                  /* (else TR is 8: a ymm) */
    lanes8 a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    a += b;
#else
    lanes8 a;
    memcpy(&a, &v, sizeof a);
#endif
    lanes4 c, d;
    memcpy(&c, &a, sizeof c);
    memcpy(&d, (const char *)&a + sizeof c, sizeof d);
    c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* One query token's G heads of one KV head, as attend_heads carries them over the keys: the
 * queries (scaled) and the online softmax's sums, maxima and totals, the current tile's scores. */
struct head_group {
    lanes q[GROUP_PART][MAX_HEAD_DIM / TR], o[GROUP_PART][MAX_HEAD_DIM / TR];
    float m[GROUP_PART], l[GROUP_PART], sc[GROUP_PART][KEY_TILE];
    int G;
};
#define CHUNK(D, c) ((D) - (c) * TR < TR ? (D) - (c) * TR : TR)   /* floats in chunk c of a head */

/* The scores of nk keys from key j0 (rows from kr on, `row` floats apart) for every head, the
 * rows of key j + AHEAD_KEYS (up to `last`) fetched meanwhile. */
INLINE void group_scores(const struct attention_job *job, struct head_group *g, const float *kr, const int32_t *table,
                         size_t head, int j0, int nk, int last, const int C) {
    size_t row = (size_t)job->KVH * job->D;
    for (int j = 0; j < nk; j++) {
        if (j0 + j + AHEAD_KEYS <= last) prefetch_key(job, table, head, j0 + j + AHEAD_KEYS);
        for (int h = 0; h < g->G; h++) {
            lanes acc = {0};
            for (int c = 0; c < C; c++) acc += g->q[h][c] * lanes_at(kr + j * row + c * TR, CHUNK(job->D, c));
            g->sc[h][j] = sum_lanes(acc);
        }
    }
}

/* The tile's scores into each head's online softmax, and its nk values (from vr on) into the sums. */
INLINE void group_values(const struct attention_job *job, struct head_group *g, const float *vr, int nk, const int C) {
    size_t row = (size_t)job->KVH * job->D;
    for (int h = 0; h < g->G; h++) {
        float tile_max = -INFINITY, sum = 0.f, *sc = g->sc[h];
        for (int j = 0; j < nk; j++) tile_max = max_f(tile_max, sc[j]);
        float m_new = max_f(g->m[h], tile_max), rescale = exp_fast(g->m[h] - m_new);
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < nk; j++) {        /* (a loop of its own: the exps vectorize) */
            sc[j] = exp_fast(sc[j] - m_new);
            sum += sc[j];
        }
        g->l[h] = g->l[h] * rescale + sum, g->m[h] = m_new;
        lanes acc[MAX_HEAD_DIM / TR];
        for (int c = 0; c < C; c++) acc[c] = g->o[h][c] * rescale;
        for (int j = 0; j < nk; j++)
            for (int c = 0; c < C; c++) acc[c] += sc[j] * lanes_at(vr + j * row + c * TR, CHUNK(job->D, c));
        for (int c = 0; c < C; c++) g->o[h][c] = acc[c];
    }
}

/* One query token (t, at position pos) for G heads of KV head kvh, from head h0 on, over part
 * `part` of its keys (job->parts of them): each key's row comes from memory once for all G heads
 * (the others read it from L1), dot products by vectors along the head dimension, C chunks of TR
 * (the last padded with zeros where TR does not divide D), online softmax per head over tiles of
 * keys. One part writes the output, several their partial sums (merge_parts). Inlined for the
 * common head sizes: a constant C keeps a head's sums in registers (with C known only at run
 * time they went through the stack at every multiply-add). */
INLINE void attend_heads_c(const struct attention_job *job, int t, int pos, const int32_t *table, int kvh, int h0,
                           int G, int part, const int C) {
    int D = job->D, bs = job->bs, lo, last;
    part_range(job, pos + 1, part, &lo, &last);
    size_t head = (size_t)kvh * D;
    struct head_group g;
    g.G = G;
    for (int h = 0; h < G; h++) {
        const float *qh = job->q + (int64_t)t * job->q_stride + (int64_t)(h0 + h) * D;
        for (int c = 0; c < C; c++) {
            g.q[h][c] = lanes_at(qh + c * TR, CHUNK(D, c)) * job->scale;
            g.o[h][c] = (lanes){0};
        }
        g.m[h] = -INFINITY, g.l[h] = 0.f;
    }
    for (int j0 = lo; j0 <= last;) {         /* tiles of keys within one cache block */
        int in_block = bs - j0 % bs, left = last + 1 - j0;
        int nk = left < in_block ? left : in_block;
        nk = nk < KEY_TILE ? nk : KEY_TILE;
        size_t first = key_at(job, table, head, j0);
        group_scores(job, &g, job->k_cache + first, table, head, j0, nk, last, C);
        group_values(job, &g, job->v_cache + first, nk, C);
        j0 += nk;
    }
    for (int h = 0; h < G; h++) {
        float *out = result_row(job, (int64_t)t * job->H + h0 + h, part);
        for (int c = 0; c < C; c++) {
            lanes r = job->parts == 1 ? g.o[h][c] * (1.f / g.l[h]) : g.o[h][c];
            memcpy(out + c * TR, &r, (size_t)CHUNK(D, c) * sizeof(float));
        }
        if (job->parts > 1) out[D] = g.m[h], out[D + 1] = g.l[h];
    }
}
#undef CHUNK
#undef INLINE

static void attend_heads(const struct attention_job *job, int t, int pos, const int32_t *table, int kvh, int h0,
                         int G, int part) {
    switch (job->D) {
    case 64: attend_heads_c(job, t, pos, table, kvh, h0, G, part, 64 / TR); break;
    case 128: attend_heads_c(job, t, pos, table, kvh, h0, G, part, 128 / TR); break;
    default: attend_heads_c(job, t, pos, table, kvh, h0, G, part, (job->D + TR - 1) / TR);
    }
}

/* The sequence of token t, and whether its queries are few enough for attention_groups. */
static int sequence_of(const struct attention_job *job, int t, int *grouped) {
    int s = 0;
    while (job->cu_q[s + 1] <= t) s++;
    *grouped = job->cu_q[s + 1] - job->cu_q[s] < TILE_MIN_QUERIES;
    return s;
}

/* Work items [lo, hi): item = (token * KVH + KV head) * parts + part, for the tokens of sequences
 * of fewer than TILE_MIN_QUERIES queries (decodes, short verifies); the group's heads
 * GROUP_PART at a time. */
static void attention_groups(const void *arg, int lo, int hi) {
    const struct attention_job *job = arg;
    int KVH = job->KVH, group = job->H / KVH, grouped;
    for (int item = lo; item < hi; item++) {
        int part = item % job->parts, t = item / job->parts / KVH, kvh = item / job->parts % KVH;
        int s = sequence_of(job, t, &grouped);
        if (!grouped) continue;                    /* attention_tiles' */
        int pos = job->ctx[s] - (job->cu_q[s + 1] - job->cu_q[s]) + (t - job->cu_q[s]);
        const int32_t *table = job->tables + (int64_t)s * job->max_blocks;
        for (int h0 = 0; h0 < group; h0 += GROUP_PART)
            attend_heads(job, t, pos, table, kvh, kvh * group + h0, group - h0 < GROUP_PART ? group - h0 : GROUP_PART,
                         part);
    }
}

/* Each (token, head) of the tokens just attended in parts (those of attention_groups, or else of
 * attention_tiles) from its parts' sums: each part's rescaled to the largest max, then divided by
 * the total (a part where a row saw no key has sums of 0, whatever its weight). */
static void merge_parts(const struct attention_job *job, int T, int groups) {
    int D = job->D, P = job->parts, grouped;
    for (int t = 0; t < T; t++) {
        sequence_of(job, t, &grouped);
        if (grouped != groups) continue;
        for (int h = 0; h < job->H; h++) {
            const float *p = job->partial + ((int64_t)t * job->H + h) * P * (D + 2);
            float mx = -INFINITY, total = 0.f, w[P];
            for (int k = 0; k < P; k++) mx = max_f(mx, p[k * (D + 2) + D]);
            for (int k = 0; k < P; k++) total += (w[k] = exp_fast(p[k * (D + 2) + D] - mx)) * p[k * (D + 2) + D + 1];
            float *out = job->out + ((int64_t)t * job->H + h) * D;
            for (int d = 0; d < D; d++) {
                float sum = 0.f;
                for (int k = 0; k < P; k++) sum += w[k] * p[k * (D + 2) + d];
                out[d] = sum / total;
            }
        }
    }
}

/* Key ranges per decode, or per pass of tiles, so that the items fill every thread alike: with the
 * default model's 3 KV heads, one decode or a 15-token slice's 3 passes split 2 : 1 over two cores.
 * Only when each range keeps SPLIT_MIN_KEYS keys or more. */
#define SPLIT_MIN_KEYS 256
static int key_parts(int items, int threads, int longest) {
    int a = items, b = threads;
    while (b) {
        int r = a % b;
        a = b, b = r;
    }
    int parts = threads / a;    /* threads / gcd: items * parts divides evenly */
    return parts > 1 && items < 8 * threads && longest >= parts * SPLIT_MIN_KEYS ? parts : 1;
}

static inline int max_i(int a, int b) { return a > b ? a : b; }

/* The passes of the tiled sequences (groups = 0: `items` passes) or the (token, KV head) pairs of
 * the others (groups = 1: `items` = T * KVH, attention_groups passes over the tiled), each in
 * `parts` ranges of keys, merged where more than one. T: the batch's tokens. */
static void attend_in_parts(struct attention_job *job, int T, int items, int parts, int threads, int groups) {
    size_t size = (size_t)T * job->H * parts * (job->D + 2);
    job->parts = parts;
    job->partial = parts > 1 ? malloc(sizeof(float) * size) : NULL;
    if (!job->partial) job->parts = 1;            /* (one part, or out of memory: unsplit) */
    items *= job->parts;
    if (groups) {
        int chunk = items / (2 * threads) > 1 ? items / (2 * threads) : 1;
        parallel_rows(attention_groups, job, items, chunk, threads);
    } else {
        parallel_rows(attention_tiles, job, items, 1, threads);
    }
    if (job->parts > 1) merge_parts(job, T, groups);
    free(job->partial);
    job->partial = NULL;
}

/* pd_paged_attention; where `tile_seconds` is given, the time the tiled sequences took is added to
 * it (the step cost model fits a prompt's attention from it, apart from the products). */
static void paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                            const int32_t *tables, int max_blocks, const int32_t *cu_q, const int32_t *ctx,
                            int S, int H, int KVH, int D, int bs, float scale, float *out, int threads,
                            double *tile_seconds) {
    int64_t macs = 0;
    for (int s = 0; s < S; s++) macs += (int64_t)(cu_q[s + 1] - cu_q[s]) * ctx[s] * H * D * 2;
    struct attention_job job = {q, k_cache, v_cache, q_stride, tables, cu_q, ctx, max_blocks, H, KVH, D, bs,
                                scale, out, 1, NULL};
    int passes = 0, short_queries = 0, longest = 0, longest_tiled = 0;
    for (int s = 0; s < S; s++) {
        int n = cu_q[s + 1] - cu_q[s];
        if (n >= TILE_MIN_QUERIES) passes += KVH * passes_of(n, H / KVH), longest_tiled = max_i(longest_tiled, ctx[s]);
        else short_queries += n, longest = max_i(longest, ctx[s]);
    }
    int par = macs >= ATTENTION_PAR_MACS ? threads : 1;
    if (passes) {
        double start = tile_seconds ? seconds_now() : 0.0;
        attend_in_parts(&job, cu_q[S], passes, key_parts(passes, par, longest_tiled), par, 0);
        if (tile_seconds) *tile_seconds += seconds_now() - start;
    }
    if (short_queries)
        attend_in_parts(&job, cu_q[S], cu_q[S] * KVH, key_parts(short_queries * KVH, par, longest), par, 1);
}

void pd_paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                        const int32_t *tables, int max_blocks, const int32_t *cu_q, const int32_t *ctx,
                        int S, int H, int KVH, int D, int bs, float scale, float *out, int threads) {
    paged_attention(q, q_stride, k_cache, v_cache, tables, max_blocks, cu_q, ctx, S, H, KVH, D, bs, scale, out,
                    threads, NULL);
}

/* ---- whole layers: one call per forward, so a decode step pays Python's overhead once ---- */

/* How each of pd_layers' matrices is stored (dims[6...]). */
enum { PD_WEIGHTS_F32 = 0, PD_WEIGHTS_INT8 = 1, PD_WEIGHTS_INT4 = 2, PD_WEIGHTS_EXACT_INT8 = 3,
       PD_WEIGHTS_EXACT_Q4 = 4 };

/* FAST_ROWS (above), for the scheduler and the products past it. */
int pd_fast_rows(void) { return FAST_ROWS; }

/* The most activation rows for which pd_linear_u8 (format PD_WEIGHTS_INT8) or pd_linear_q4
 * (PD_WEIGHTS_INT4) beats BLAS on weights unpacked to fp32; 0: the caller's own limit. The
 * outer-product kernels, by chunks of K (2026-11-26, 1B shape's products): AVX-512 VNNI int8
 * 1.0-1.3x MKL's fp32 from 128 to 1,024 rows (over the whole of K a tile at a time: 0.80-1.1x
 * from 512, where unpacking for BLAS did 0.89-0.95x), int4 1.5-2.3x; the AVX-VNNI build, against
 * MKL held to AVX2 on this machine, int8 1.07-1.20x (default model 0.93-0.96x, as unpacking),
 * int4 1.4-1.7x. AVX2's int4 (2-core AMD EPYC, Zen 3, the default model's 30 layers, 2026-12-03):
 * 256 and 512 rows 1.37x and 1.35x fp32's best (MKL), unpacked for BLAS 0.90x and 1.00x. */
int pd_quant_max_rows(int format) {
#if PDCHAT_INT8_PATH == PD_INT8_AVX512VNNI || PDCHAT_INT8_PATH == PD_INT8_AVXVNNI
    (void)format;
    return INT_MAX;
#elif PDCHAT_INT8_PATH == PD_INT8_AVX2
    return format == PD_WEIGHTS_INT4 ? INT_MAX : 0;
#else
    (void)format;
    return 0;
#endif
}

/* ptrs[0..2] = weight, scales, bias. */
static int linear_any(const float *x, const void *const *lin, int format, float *y, int M, int N, int K,
                      int threads) {
    switch (format) {
    case PD_WEIGHTS_INT8: return pd_linear_u8(x, lin[0], lin[1], lin[2], y, M, N, K, threads);
    case PD_WEIGHTS_INT4: return pd_linear_q4(x, lin[0], lin[1], lin[2], y, M, N, K, threads);
    case PD_WEIGHTS_EXACT_INT8: return pd_linear_exact_int8(x, lin[0], lin[1], lin[2], y, M, N, K, threads);
    case PD_WEIGHTS_EXACT_Q4: return pd_linear_exact_q4(x, lin[0], lin[1], lin[2], y, M, N, K, threads);
    default: return pd_linear_f32(x, lin[0], lin[2], y, M, N, K, threads);
    }
}

enum { LINEARS_PER_LAYER = 4 };     /* qkv, o, gate_up, down: a format each in dims */

enum { W_QKV = 0, W_Q_NORM = 3, W_K_NORM, W_O, W_NORM_MLP = 8, W_GATE_UP, W_DOWN = 12, W_NEXT_NORM = 15,
       PTRS_PER_LAYER };

/* Every block of a Llama-family model, in place on x [T, D] (the residual stream) and h [T, D] (its
 * normalised form), exactly as the model's op-by-op forward (engine/model.py) does with these
 * kernels. dims = {layers, D, H, KVH, head_dim, intermediate, then each layer's four matrices'
 * formats (PD_WEIGHTS_*: a model may hold some exactly and not others)}; ptrs: PTRS_PER_LAYER per layer in
 * the order above (q/k norm NULL when the model has none). The caches hold all layers,
 * `layer_stride` floats apart. The seconds the tiled sequences' attention took are added to
 * *tile_seconds where it is given. Returns -1 if out of memory. */
int pd_layers(const int *dims, float eps, const void *const *ptrs, float *x, float *h, const float *cos,
              const float *sin, const int64_t *slots, float *k_cache, float *v_cache, int64_t layer_stride,
              const int32_t *tables, int max_blocks, const int32_t *cu_q, const int32_t *ctx, int S, int bs,
              float scale, int T, int threads, double *tile_seconds) {
    int L = dims[0], D = dims[1], H = dims[2], KVH = dims[3], Dh = dims[4], I = dims[5];
    int Nq = H * Dh, Nkv = KVH * Dh, Nqkv = Nq + 2 * Nkv;
    float *qkv = malloc(sizeof(float) * (size_t)T * (Nqkv + Nq + D + 3 * (size_t)I));
    if (!qkv) return -1;
    float *att = qkv + (size_t)T * Nqkv, *delta = att + (size_t)T * Nq, *gu = delta + (size_t)T * D;
    float *act = gu + (size_t)T * 2 * I, *q = qkv, *k = qkv + Nq, *v = k + Nkv;
    int status = 0;
    for (int l = 0; l < L && status == 0; l++) {
        const void *const *p = ptrs + (size_t)l * PTRS_PER_LAYER;
        const int *F = dims + 6 + l * LINEARS_PER_LAYER;
        float *kc = k_cache + l * layer_stride, *vc = v_cache + l * layer_stride;
        status |= linear_any(h, p + W_QKV, F[0], qkv, T, Nqkv, D, threads);
        if (p[W_Q_NORM])
            for (int t = 0; t < T; t++) {   /* (in place: each row's scale is taken before it is written) */
                pd_rms_norm(q + (size_t)t * Nqkv, p[W_Q_NORM], q + (size_t)t * Nqkv, H, Dh, eps, 1);
                pd_rms_norm(k + (size_t)t * Nqkv, p[W_K_NORM], k + (size_t)t * Nqkv, KVH, Dh, eps, 1);
            }
        pd_rope(q, Nqkv, H, k, Nqkv, KVH, cos, sin, T, Dh, threads);
        pd_store_kv(k, Nqkv, v, Nqkv, kc, vc, slots, T, KVH, Dh);
        paged_attention(q, Nqkv, kc, vc, tables, max_blocks, cu_q, ctx, S, H, KVH, Dh, bs, scale, att, threads,
                        tile_seconds);
        status |= linear_any(att, p + W_O, F[1], delta, T, D, Nq, threads);
        pd_add_rms_norm(x, delta, p[W_NORM_MLP], h, T, D, eps, threads);
        status |= linear_any(h, p + W_GATE_UP, F[2], gu, T, 2 * I, D, threads);
        pd_silu_mul(gu, act, T, I, threads);
        status |= linear_any(act, p + W_DOWN, F[3], delta, T, D, I, threads);
        pd_add_rms_norm(x, delta, p[W_NEXT_NORM], h, T, D, eps, threads);
    }
    free(qkv);
    return status;
}

/* ---- sampling ---- */

/* Rows [lo, hi) of a greedy pick (pd_greedy). */
struct greedy_job { const float *logits; int64_t *out; int V; };

static void greedy_rows(const void *p, int lo, int hi) {
    const struct greedy_job *j = p;
    for (int m = lo; m < hi; m++) {
        const float *row = j->logits + (int64_t)m * j->V;
        float best = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
        for (int i = 0; i < j->V; i++) {
            best = max_f(best, row[i]);
            nan |= row[i] != row[i];
        }
        int64_t at = -1;
        for (int i = 0; !nan && i < j->V; i++)
            if (row[i] == best) {
                at = i;
                break;
            }
        j->out[m] = at;
    }
}

/* Each of M rows of V logits: the index of its largest value (the first of equal ones), -1 for a
 * row holding a NaN (reference.greedy). torch's argmax over a 16-stream step's 16 x 49,152 logits
 * took 0.96 ms right after the C products, their pool's worker still spinning beside torch's own
 * threads (0.53 with it asleep; 2-core Intel Xeon, AVX-512, 2026-12-04): here a pass for the
 * largest value by vectors and one to its first place, on the pool. */
void pd_greedy(const float *logits, int64_t *out, int M, int V, int threads) {
    struct greedy_job job = {logits, out, V};
    parallel_rows(greedy_rows, &job, M, 1, (int64_t)M * V >= 1 << 17 ? threads : 1);
}
