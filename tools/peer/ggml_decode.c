/* Decode attention timed on ggml's CPU backend: the peer tools/peer_ggml.py compares
 * clattn with. Built by that script against a ggml build from ggml's public source.
 *
 * One graph per run: B sequences of n_kv contiguous keys and values (f16), one query
 * token each, every query head of a KV head's group attending the same rows.
 *   flash: ggml_flash_attn_ext (the path llama.cpp takes with -fa on)
 *   plain: mul_mat(K, q) -> optional soft-cap -> soft_max_ext -> mul_mat(V^T, p), the
 *          path llama.cpp takes with -fa off (V stored transposed, as llama.cpp does then)
 * Inputs come from DATA (raw, in this order: q f32 [B, H, D], K f16 [B, HKV, NKV, D], V f16
 * [B, HKV, NKV, D]); the output of the last computation goes to OUT (f32 [B, H, D]), for the
 * caller to check. Prints one line: "<median ms> <min ms>" over `iters` timed computations
 * after `warmup` untimed ones.
 *
 * usage: ggml_decode PATH H HKV D NKV B SOFTCAP THREADS ITERS WARMUP DATA OUT
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-cpu.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int read_all(FILE *f, void *dst, size_t n) {
    return fread(dst, 1, n, f) == n;
}

int main(int argc, char **argv) {
    if (argc != 13) {
        fprintf(stderr, "usage: %s flash|plain H HKV D NKV B SOFTCAP THREADS ITERS WARMUP DATA OUT\n",
                argv[0]);
        return 2;
    }
    const int flash = strcmp(argv[1], "flash") == 0;
    const int H = atoi(argv[2]), HKV = atoi(argv[3]), D = atoi(argv[4]);
    const int NKV = atoi(argv[5]), B = atoi(argv[6]);
    const float softcap = (float)atof(argv[7]);
    const int threads = atoi(argv[8]), iters = atoi(argv[9]), warmup = atoi(argv[10]);
    if (H <= 0 || HKV <= 0 || H % HKV || D <= 0 || NKV <= 0 || B <= 0 || threads <= 0 ||
        iters <= 0 || warmup < 0) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    const size_t kv = (size_t)D * NKV * HKV * B * sizeof(ggml_fp16_t);
    const size_t scores = (size_t)NKV * H * B * sizeof(float) * 3;
    struct ggml_init_params ip = {
        .mem_size = 3 * kv + scores + (size_t)D * H * B * 16 + (64u << 20),
        .mem_buffer = NULL,
        .no_alloc = false,
    };
    struct ggml_context *ctx = ggml_init(ip);
    if (!ctx) { fprintf(stderr, "ggml_init failed\n"); return 1; }
    const float scale = 1.0f / sqrtf((float)D);
    struct ggml_tensor *q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, 1, H, B);
    struct ggml_tensor *k = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, NKV, HKV, B);
    struct ggml_tensor *out;
    struct ggml_tensor *v = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, NKV, HKV, B);
    FILE *in = fopen(argv[11], "rb");
    if (!in || !read_all(in, q->data, ggml_nbytes(q)) || !read_all(in, k->data, ggml_nbytes(k)) ||
        !read_all(in, v->data, ggml_nbytes(v))) {
        fprintf(stderr, "cannot read %s\n", argv[11]);
        return 1;
    }
    fclose(in);
    if (flash) {
        out = ggml_flash_attn_ext(ctx, q, k, v, NULL, scale, 0.0f, softcap);
    } else {
        /* the same values stored transposed: vt[h][d][r] = v[h][r][d] */
        struct ggml_tensor *vt = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, NKV, D, HKV, B);
        const ggml_fp16_t *src = (const ggml_fp16_t *)v->data;
        ggml_fp16_t *dst = (ggml_fp16_t *)vt->data;
        for (int64_t h = 0; h < (int64_t)HKV * B; ++h)
            for (int64_t r = 0; r < NKV; ++r)
                for (int64_t d = 0; d < D; ++d)
                    dst[(h * D + d) * NKV + r] = src[(h * NKV + r) * D + d];
        struct ggml_tensor *kq = ggml_mul_mat(ctx, k, q);          /* [NKV, 1, H, B] */
        if (softcap > 0.0f) {
            kq = ggml_scale(ctx, kq, scale / softcap);
            kq = ggml_tanh(ctx, kq);
            kq = ggml_scale(ctx, kq, softcap);
            kq = ggml_soft_max_ext(ctx, kq, NULL, 1.0f, 0.0f);
        } else {
            kq = ggml_soft_max_ext(ctx, kq, NULL, scale, 0.0f);
        }
        out = ggml_mul_mat(ctx, vt, kq);                           /* [D, 1, H, B] */
    }
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    double *t = malloc(sizeof(double) * iters);
    for (int i = 0; i < warmup + iters; ++i) {
        const double t0 = now_ms();
        if (ggml_graph_compute_with_ctx(ctx, gf, threads) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "compute failed\n");
            return 1;
        }
        if (i >= warmup) t[i - warmup] = now_ms() - t0;
    }
    qsort(t, iters, sizeof(double), cmp_double);
    FILE *of = fopen(argv[12], "wb");
    if (!of || fwrite(out->data, 1, ggml_nbytes(out), of) != ggml_nbytes(out)) {
        fprintf(stderr, "cannot write %s\n", argv[12]);
        return 1;
    }
    fclose(of);
    printf("%.6f %.6f\n", t[iters / 2], t[0]);
    free(t);
    ggml_free(ctx);
    return 0;
}
