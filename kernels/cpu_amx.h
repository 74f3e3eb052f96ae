/* Exact blocks on AMX tiles (Intel Sapphire Rapids and later): a part of cpu_kernels.c, included
 * by it after the panels (it reads their layout and the kernels' helpers).
 *
 * A tile multiply-add (TDPBF16PS) takes 16 rows of 32 bf16 activations against 32 bf16 weights of
 * 16 outputs and adds the 16 x 16 sums into fp32, in about the time AVX-512 takes for 16 of the
 * 512 multiply-adds it does. bf16 holds 8 of fp32's 24 significant bits, so each activation goes
 * in as three bf16 parts that add up to it exactly (x = hi + mid + lo, each the top 8 bits of what
 * is left), and each weight as its small integer (Q4's u in 0..15, int8's q), exact in bf16: every
 * product is exact, and each group of 32 k is summed in fp32 by the tile, the three parts chained
 * into one accumulator. The group's scale then applies in fp32 (acc += d * sums, + m * sum(x) for
 * Q4), group after group, the order fixed. A row's results therefore do not depend on how many rows
 * share the product (the tile's rows are independent), but they are not the fp32 products' bits:
 * their rounding differs, within fp32's (a group's sums round once per part rather than once per
 * k; the tests bound both against float64). Rows below AMX_MIN_ROWS stay on the AVX-512 panels
 * (a decode row: converting a group's weights to bf16 costs what its AVX-512 multiply-adds do).
 *
 * A tile's sums are stored to memory for the scales (AMX has no other way out), and the core
 * stalls where an instruction waits on a tile: a store right after its multiply-adds held
 * retirement until they finished, and loads of what a tile store or a vector store just wrote
 * waited for it to reach L1. So each step (a group against a panel) is issued while the step
 * before it is stored and the one AMX_LAG back is scaled, its weights converted AMX_LAG ahead into
 * a ring (C accumulators rotate over three tiles, weights over two). */
#if defined(PANEL) && PANEL_LANES == 16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX_PRODUCTS 1
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023   /* Linux: ask for a state component (AMX's tile data, 18) */
#define XFEATURE_XTILEDATA 18
/* Rows from which products go on the tiles: against one cached 3,072 x 576 matrix on two threads
 * 3 rows took 60 us there against the panels' 57, 4 rows 58-65 against 81-87 (2-core Intel Xeon,
 * Sapphire Rapids, 2026-12-04). */
#define AMX_MIN_ROWS 4
#define AMX_TILE_ROWS 16
#define AMX_PANELS 8       /* panels whose sums a worker keeps at once (in L1) */
#define AMX_LAG 4          /* steps between a tile's sums stored and scaled, weights converted and loaded */
#define AMX_RING 8         /* slots of each ring: more than 2 * AMX_LAG steps are never in flight */
#define AMX_TILE_BYTES 1024

/* Whether this process may use the tiles: Linux grants the state once per process, on request. */
static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

static int amx_wanted = 1;
static int amx_out_of_memory;       /* a worker's scratch ran out (amx_product's -1) */

/* The tiles' palette: tiles 0, 1 and 7 hold sums (rows of x, 16 outputs of fp32), 2-4 x's parts
 * for a group (rows, 32 bf16), 5-6 a group's weights (16 pairs of k, 16 outputs, 2 bf16). */
struct amx_config { uint8_t palette, start_row, reserved[14]; uint16_t bytes_per_row[16]; uint8_t rows[16]; };

static void amx_configure(int R) {
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t == 5 || t == 6 ? 16 : R;
        c.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* x's rows [0, M) in tiles of 16: tile t, group g, part p is 16 rows of 32 bf16 at
 * parts + ((t * G + g) * 3 + p) * 512 (rows past M unwritten: never loaded), and each row's sum of
 * the group's 32 activations (fp32, one fixed tree: k and k + 16, then halves) at
 * sums[(t * G + g) * 16 + r]. */
static void amx_split_rows(const float *x, int M, int K, uint16_t *parts, float *sums) {
    int G = K / EXACT_BLOCK;
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000);
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            const float *xg = x + (int64_t)m * K + g * EXACT_BLOCK;
            int64_t at = (int64_t)(m / AMX_TILE_ROWS) * G + g, r = m % AMX_TILE_ROWS;
            __m512 part[3][2], half[2];
            for (int v = 0; v < 2; v++) {
                __m512 rest = half[v] = _mm512_loadu_ps(xg + 16 * v);
                for (int p = 0; p < 3; p++) {            /* each part the top 8 bits of the rest: exact */
                    part[p][v] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), top));
                    rest = _mm512_sub_ps(rest, part[p][v]);
                }
            }
            for (int p = 0; p < 3; p++)
                _mm512_storeu_si512(parts + ((at * 3 + p) * AMX_TILE_ROWS + r) * 32,
                                    (__m512i)_mm512_cvtne2ps_pbh(part[p][1], part[p][0]));
            sums[at * AMX_TILE_ROWS + r] = _mm512_reduce_add_ps(_mm512_add_ps(half[0], half[1]));   /* (a fixed tree) */
        }
}

/* A panel's group of weights (its bytes in the panels' layout) as a tile of bf16 integers: row i
 * holds, for each of the 16 outputs, its weights at k = 2i and 2i + 1. */
INLINE void amx_weights(const uint8_t *b, uint16_t *tile, const int form) {
    if (form == FORM_Q4) {          /* a byte holds an output's pair: u(2i) low, u(2i + 1) high */
        const __m512i bf16_of = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
            0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0);            /* 15.0 ... 1.0, 0 */
        const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
        for (int i = 0; i < EXACT_BLOCK / 2; i++) {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + i * PANEL)));
            /* (v | v << 12) & 0x000F000F: u(2i) in the low word, u(2i + 1) in the high one */
            __m512i u = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), nibbles, 0xA8);
            _mm512_storeu_si512(tile + i * 32, _mm512_permutexvar_epi16(u, bf16_of));
        }
    } else {                        /* int8, k-major: 16 outputs' q at k, then at k + 1 */
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000);
        for (int i = 0; i < EXACT_BLOCK / 2; i++) {
            __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 * i * PANEL))));
            __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + (2 * i + 1) * PANEL))));
            /* a float of |q| <= 127 is its bf16 in the top half: q0's as the low word, q1's high */
            __m512i low = _mm512_srli_epi32(_mm512_castps_si512(q0), 16);
            _mm512_storeu_si512(tile + i * 32, _mm512_ternarylogic_epi32(low, _mm512_castps_si512(q1), high, 0xF8));
        }
    }
}

struct amx_job {
    const uint16_t *parts; const float *sums; const uint8_t *bytes; const float *floats, *bias; float *y;
    int M, N, K;
};

/* Panel p's group g converted into tile, its next group fetched into L1 (the panels' way). Against
 * the default model's 30 layers (distinct weights, from memory; two threads, C harness) 16 rows
 * took 11.4 ms unfetched, 9.7 two groups ahead and 9.1-9.3 one ahead; 4 rows 7.7-8.0, 5.9-6.0 and
 * 5.3-5.5 (the AVX-512 panels 13.6-13.8 and 7.3-7.4; 2-core Intel Xeon, Sapphire Rapids,
 * 2026-12-04). */
#define AMX_AHEAD 1
INLINE void amx_convert(const struct amx_job *j, int p, int g, uint16_t *tile, const int form) {
    int64_t at = (int64_t)p * (j->K / EXACT_BLOCK) + g;
    const uint8_t *b = j->bytes + at * GROUP_BYTES(form);
    fetch_group_ahead(b, j->floats + at * GROUP_FLOATS(form), AMX_AHEAD, form);
    amx_weights(b, tile, form);
}

/* Step i's group multiply-adds: weights from `weights` into tile 5 or 6, sums into tile 0, 1 or 7
 * (the rotation of i % 6), x's parts in tiles 2-4. */
INLINE void amx_issue(int i, const uint16_t *weights) {
#define AMX_ISSUE(C, W) _tile_loadd(W, weights, 64); _tile_zero(C); \
        _tile_dpbf16ps(C, 2, W); _tile_dpbf16ps(C, 3, W); _tile_dpbf16ps(C, 4, W); break;
    switch (i % 6) {
    case 0: AMX_ISSUE(0, 5)
    case 1: AMX_ISSUE(1, 6)
    case 2: AMX_ISSUE(7, 5)
    case 3: AMX_ISSUE(0, 6)
    case 4: AMX_ISSUE(1, 5)
    default: AMX_ISSUE(7, 6)
    }
#undef AMX_ISSUE
}

INLINE void amx_store(int i, float *into) {
    switch (i % 3) {
    case 0: _tile_stored(0, into, 64); break;
    case 1: _tile_stored(1, into, 64); break;
    default: _tile_stored(7, into, 64);
    }
}

/* Panels [p0, p0 + np) against row tile t (R rows): steps run group by group, each group's panels
 * in turn; `converted` holds every step's weights (more than one row tile) or is NULL (the weights
 * converted into `ring` as they come). Sums go to acc (np panels x 16 rows x 16 outputs). */
INLINE void amx_panels(const struct amx_job *j, int p0, int np, int t, int R, const uint16_t *converted,
                       uint16_t *ring, float *stored, float *acc, const int form) {
    int G = j->K / EXACT_BLOCK, steps = G * np;
    const uint16_t *parts = j->parts + (int64_t)t * G * 3 * 512;
    const float *sums = j->sums + (int64_t)t * G * AMX_TILE_ROWS;
    memset(acc, 0, sizeof(float) * np * AMX_TILE_ROWS * PANEL);
    int ig = 0, ip = 0, sg = 0, sp = 0, cg = 0, cp = 0;   /* the issued, scaled and converted steps' group and panel */
    if (!converted)
        for (int i = 0; i < AMX_LAG && i < steps; i++) {
            amx_convert(j, p0 + cp, cg, ring + (i % AMX_RING) * 512, form);
            if (++cp == np) cp = 0, cg++;
        }
    for (int i = 0; i < steps + AMX_LAG; i++) {
        if (i < steps) {
            if (ip == 0) {                /* a new group: its x parts */
                const uint16_t *xg = parts + (int64_t)ig * 3 * 512;
                _tile_loadd(2, xg, 64);
                _tile_loadd(3, xg + 512, 64);
                _tile_loadd(4, xg + 1024, 64);
            }
            amx_issue(i, converted ? converted + (int64_t)i * 512 : ring + (i % AMX_RING) * 512);
            if (++ip == np) ip = 0, ig++;
        }
        if (i >= 1 && i <= steps) amx_store(i - 1, stored + ((i - 1) % AMX_RING) * 256);
        if (i >= AMX_LAG) {               /* step i - AMX_LAG's sums, scaled into acc */
            const float *c = stored + ((i - AMX_LAG) % AMX_RING) * 256;
            const float *f = j->floats + ((int64_t)(p0 + sp) * G + sg) * GROUP_FLOATS(form);
            const float *s = sums + sg * AMX_TILE_ROWS;
            float *a = acc + sp * AMX_TILE_ROWS * PANEL;
            __m512 d = _mm512_loadu_ps(f);
            if (form == FORM_Q4) {
                __m512 m = _mm512_loadu_ps(f + PANEL);
                for (int r = 0; r < R; r++)
                    _mm512_store_ps(a + r * PANEL, _mm512_fmadd_ps(m, _mm512_set1_ps(s[r]),
                                    _mm512_fmadd_ps(d, _mm512_load_ps(c + r * PANEL), _mm512_load_ps(a + r * PANEL))));
            } else {
                for (int r = 0; r < R; r++)
                    _mm512_store_ps(a + r * PANEL, _mm512_fmadd_ps(d, _mm512_load_ps(c + r * PANEL), _mm512_load_ps(a + r * PANEL)));
            }
            if (++sp == np) sp = 0, sg++;
        }
        if (!converted && i + AMX_LAG < steps) {
            amx_convert(j, p0 + cp, cg, ring + ((i + AMX_LAG) % AMX_RING) * 512, form);
            if (++cp == np) cp = 0, cg++;
        }
    }
}

/* Panels [lo, hi) against every row: AMX_PANELS at a time, their weights converted once for all row
 * tiles where there are several. */
INLINE void amx_rows_of(const struct amx_job *j, int lo, int hi, const int form) {
    int G = j->K / EXACT_BLOCK, tiles = (j->M + AMX_TILE_ROWS - 1) / AMX_TILE_ROWS;
    size_t ring_bytes = AMX_RING * AMX_TILE_BYTES, acc_bytes = sizeof(float) * AMX_PANELS * AMX_TILE_ROWS * PANEL;
    size_t converted_bytes = tiles > 1 ? (size_t)AMX_PANELS * G * AMX_TILE_BYTES : 0;
    char *scratch = thread_scratch(SCRATCH_AMX, 2 * ring_bytes + acc_bytes + converted_bytes + 64);
    if (!scratch) {
        __atomic_store_n(&amx_out_of_memory, 1, __ATOMIC_RELAXED);
        return;
    }
    char *base = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint16_t *ring = (uint16_t *)base, *converted = tiles > 1 ? (uint16_t *)(base + 2 * ring_bytes + acc_bytes) : NULL;
    float *stored = (float *)(base + ring_bytes), *acc = (float *)(base + 2 * ring_bytes);
    int configured = 0;
    for (int p0 = lo; p0 < hi; p0 += AMX_PANELS) {
        int np = hi - p0 < AMX_PANELS ? hi - p0 : AMX_PANELS;
        if (converted)       /* step order: group by group, the panels of each */
            for (int g = 0; g < G; g++)
                for (int pc = 0; pc < np; pc++)
                    amx_convert(j, p0 + pc, g, converted + ((int64_t)g * np + pc) * 512, form);
        for (int t = 0; t < tiles; t++) {
            int R = j->M - t * AMX_TILE_ROWS < AMX_TILE_ROWS ? j->M - t * AMX_TILE_ROWS : AMX_TILE_ROWS;
            if (R != configured) amx_configure(configured = R);
            amx_panels(j, p0, np, t, R, converted, ring, stored, acc, form);
            for (int pc = 0; pc < np; pc++) {
                int o = (p0 + pc) * PANEL;
                __m512 bias = j->bias ? _mm512_loadu_ps(j->bias + o) : _mm512_setzero_ps();
                for (int r = 0; r < R; r++)      /* (+ 0 without a bias, as the panels add) */
                    _mm512_storeu_ps(j->y + (int64_t)(t * AMX_TILE_ROWS + r) * j->N + o,
                                     _mm512_add_ps(_mm512_load_ps(acc + (pc * AMX_TILE_ROWS + r) * PANEL), bias));
            }
        }
    }
    _tile_release();
}

static void q4_amx_rows(const void *a, int lo, int hi) { amx_rows_of(a, lo, hi, FORM_Q4); }
static void q8_amx_rows(const void *a, int lo, int hi) { amx_rows_of(a, lo, hi, FORM_Q8); }

/* Whether a product of M rows of exact blocks goes on the tiles. */
static int amx_takes(int M) { return M >= AMX_MIN_ROWS && amx_wanted && amx_granted(); }

/* y = x @ W^T + bias on the tiles (panel_product's arguments): x split once by the caller (its
 * scratch, read by every thread), the panels shared out in claims of half a thread's share (an
 * eighth, as panel_product's, paid each claim's tile set-up and pipeline fill: 16 rows against
 * 960 x 576 took 50 us on two threads against 43, 576 x 1,536 77 against 72). -1 if out of memory. */
static int amx_product(const float *x, const void *bytes, const float *floats, const float *bias, float *y,
                       int M, int N, int K, int form, int threads) {
    int G = K / EXACT_BLOCK, tiles = (M + AMX_TILE_ROWS - 1) / AMX_TILE_ROWS;
    size_t parts_bytes = (size_t)tiles * G * 3 * AMX_TILE_BYTES;
    char *split = thread_scratch(SCRATCH_TILES, parts_bytes + sizeof(float) * tiles * G * AMX_TILE_ROWS);
    if (!split) return -1;
    amx_split_rows(x, M, K, (uint16_t *)split, (float *)(split + parts_bytes));
    struct amx_job job = {(const uint16_t *)split, (const float *)(split + parts_bytes), bytes, floats, bias, y, M, N, K};
    amx_out_of_memory = 0;
    int panels = N / PANEL, chunk = (panels + 2 * threads - 1) / (2 * threads);
    parallel_rows(form == FORM_Q4 ? q4_amx_rows : q8_amx_rows, &job, panels, chunk < 1 ? 1 : chunk, threads);
    return amx_out_of_memory ? -1 : 0;
}
#endif
