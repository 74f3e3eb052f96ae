/* Runs pdchat's CPU kernels on jobs read from a file and writes their outputs to another, so that
 * tests/kernels/test_arm_kernels.py can check an aarch64 build under qemu-user against the PyTorch
 * reference on the host. Built with -I kernels: this one translation unit includes the kernels.
 *
 * Input (little-endian): int32 job count, then per job an int32 op code (OP_* below), DIMS int32
 * dimensions (unused ones 0) and the op's arrays, each contiguous, in the order `run` reads them:
 * float32, uint8 for int8, int4 and exact Q4 weights, int8 for exact int8 blocks, bf16 for int4's params, int32 for attention's batch layout. Output: int32
 * pd_int8_path(), then each job's results as float32 arrays in the order `run` writes them.
 * Every kernel gets THREADS threads, so the worker pool runs wherever a kernel splits its work. */
#include <stdio.h>
#include "cpu_kernels.c"

enum { OP_LINEAR_U8 = 1, OP_LINEAR_F32, OP_RMS_NORM, OP_ADD_RMS_NORM, OP_SILU_MUL, OP_ROPE, OP_ATTENTION,
       OP_LINEAR_Q4, OP_LINEAR_EXACT, OP_LINEAR_EXACT_Q4 };
#define DIMS 7
#define THREADS 2
#define EPS 1e-5f

static FILE *in, *out;

static void *take(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, in) != bytes) {
        fprintf(stderr, "arm_driver: short input\n");
        exit(2);
    }
    return p;
}

static float *floats(size_t n) { return take(n * sizeof(float)); }

static int32_t *ints(size_t n) { return take(n * sizeof(int32_t)); }

static void put(const float *p, size_t n) { fwrite(p, sizeof(float), n, out); }

/* A ragged batch of S sequences (query_start_loc, context lengths, block tables) over a paged cache
 * of `blocks` blocks of `bs` positions; q is contiguous [T, H, D]. */
static void attention(int S, int H, int KVH, int D, int bs, int blocks, int max_blocks) {
    int32_t *cu_q = ints(S + 1), *ctx = ints(S), *tables = ints((size_t)S * max_blocks);
    size_t T = cu_q[S], cache = (size_t)blocks * bs * KVH * D;
    float *q = floats(T * H * D), *k = floats(cache), *v = floats(cache), *o = malloc(sizeof(float) * T * H * D);
    pd_paged_attention(q, (int64_t)H * D, k, v, tables, max_blocks, cu_q, ctx, S, H, KVH, D, bs,
                       1.f / sqrtf((float)D), o, THREADS);
    put(o, T * H * D);
    free(cu_q), free(ctx), free(tables), free(q), free(k), free(v), free(o);
}

static void run(int op, const int *d) {
    if (op == OP_LINEAR_U8 || op == OP_LINEAR_F32) {
        int M = d[0], N = d[1], K = d[2];
        float *x = floats((size_t)M * K), *y = malloc(sizeof(float) * M * N);
        void *w = take((size_t)N * K * (op == OP_LINEAR_U8 ? 1 : sizeof(float)));
        float *scales = op == OP_LINEAR_U8 ? floats(N) : NULL, *bias = floats(N);
        if (op == OP_LINEAR_U8 && pd_linear_u8(x, w, scales, bias, y, M, N, K, THREADS) != 0) exit(3);
        if (op == OP_LINEAR_F32) pd_linear_f32(x, w, bias, y, M, N, K, THREADS);
        put(y, (size_t)M * N);
        free(x), free(y), free(w), free(scales), free(bias);
    } else if (op == OP_LINEAR_EXACT) {
        int M = d[0], N = d[1], K = d[2];
        float *x = floats((size_t)M * K), *y = malloc(sizeof(float) * M * N);
        int8_t *q = take((size_t)N * K);
        float *scales = floats((size_t)N * (K / EXACT_BLOCK)), *bias = floats(N);
        if (pd_linear_exact_int8(x, q, scales, bias, y, M, N, K, THREADS) != 0) exit(3);
        put(y, (size_t)M * N);
        free(x), free(y), free(q), free(scales), free(bias);
    } else if (op == OP_LINEAR_EXACT_Q4) {
        int M = d[0], N = d[1], K = d[2];
        float *x = floats((size_t)M * K), *y = malloc(sizeof(float) * M * N);
        uint8_t *q = take((size_t)N * K / 2);
        float *dm = floats((size_t)N * (K / EXACT_BLOCK) * 2), *bias = floats(N);
        if (pd_linear_exact_q4(x, q, dm, bias, y, M, N, K, THREADS) != 0) exit(3);
        put(y, (size_t)M * N);
        free(x), free(y), free(q), free(dm), free(bias);
    } else if (op == OP_LINEAR_Q4) {
        int M = d[0], N = d[1], K = d[2];
        float *x = floats((size_t)M * K), *y = malloc(sizeof(float) * M * N);
        uint8_t *w = take((size_t)N * K / 2);
        uint16_t *params = take((size_t)N * (K / Q4_GROUP) * 2 * sizeof(uint16_t));
        float *bias = floats(N);
        if (pd_linear_q4(x, w, params, bias, y, M, N, K, THREADS) != 0) exit(3);
        put(y, (size_t)M * N);
        free(x), free(y), free(w), free(params), free(bias);
    } else if (op == OP_RMS_NORM || op == OP_ADD_RMS_NORM) {
        int T = d[0], D = d[1];
        float *x = floats((size_t)T * D), *delta = op == OP_ADD_RMS_NORM ? floats((size_t)T * D) : NULL;
        float *w = floats(D), *o = malloc(sizeof(float) * T * D);
        if (delta) pd_add_rms_norm(x, delta, w, o, T, D, EPS, THREADS);
        else pd_rms_norm(x, w, o, T, D, EPS, THREADS);
        if (delta) put(x, (size_t)T * D);         /* the residual sum, in place */
        put(o, (size_t)T * D);
        free(x), free(delta), free(w), free(o);
    } else if (op == OP_SILU_MUL) {
        int T = d[0], I = d[1];
        float *gu = floats((size_t)T * 2 * I), *o = malloc(sizeof(float) * T * I);
        pd_silu_mul(gu, o, T, I, THREADS);
        put(o, (size_t)T * I);
        free(gu), free(o);
    } else if (op == OP_ROPE) {
        int T = d[0], H = d[1], KVH = d[2], D = d[3];
        float *q = floats((size_t)T * H * D), *k = floats((size_t)T * KVH * D);
        float *c = floats((size_t)T * D), *s = floats((size_t)T * D);
        pd_rope(q, (int64_t)H * D, H, k, (int64_t)KVH * D, KVH, c, s, T, D, THREADS);
        put(q, (size_t)T * H * D);
        put(k, (size_t)T * KVH * D);
        free(q), free(k), free(c), free(s);
    } else if (op == OP_ATTENTION) {
        attention(d[0], d[1], d[2], d[3], d[4], d[5], d[6]);
    } else {
        fprintf(stderr, "arm_driver: unknown op %d\n", op);
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc != 3 || !(in = fopen(argv[1], "rb")) || !(out = fopen(argv[2], "wb"))) {
        fprintf(stderr, "usage: arm_driver INPUT OUTPUT\n");
        return 2;
    }
    int32_t jobs, path = pd_int8_path();
    fwrite(&path, sizeof path, 1, out);
    if (fread(&jobs, sizeof jobs, 1, in) != 1) return 2;
    for (int j = 0; j < jobs; j++) {
        int32_t head[1 + DIMS];
        if (fread(head, sizeof(int32_t), 1 + DIMS, in) != 1 + DIMS) return 2;
        run(head[0], head + 1);
    }
    return fclose(out) == 0 ? 0 : 1;
}
