/* Row-wise float32 ops of a decoder layer, each one pass over memory instead of torch's several
 * (each with its own temporary): RMSNorm with the residual add folded in, SiLU(gate) * up and GELU(gate) * up.
 * Rows [begin, end) of a row-major matrix, so the caller can split rows between threads.
 * Built by picovllm/kernels/cpu/build.py (-O3 -march=native -ffast-math: the loops vectorize). */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* out = w * h / sqrt(mean(h^2) + eps), h = x (+ residual, then written to residual_out when given). */
void rms_norm(const float *x, const float *residual, float *residual_out, const float *w, float *out,
              int64_t n, float eps, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        if (residual) {
            const float *rr = residual + r * n;
            float *ro = residual_out + r * n;
            for (int64_t i = 0; i < n; i++) ro[i] = xr[i] + rr[i];
            xr = ro;
        }
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        /* -ffast-math's approximate reciprocal square root gives NaN at infinity (a row whose squares overflow
           float32): there the scale is 0, as torch's float32 norm makes it (a NaN stays NaN). Read from the bits:
           finite-math lets the compiler drop isinf/isnan. */
        uint32_t bits;
        memcpy(&bits, &ss, sizeof bits);
        const float inv = (bits & 0x7f800000u) == 0x7f800000u ? ((bits & 0x7fffffu) ? ss : 0.0f)
                                                              : 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* x rows are [gate (n) | up (n)]; out rows are silu(gate) * up (n). */
void silu_mul(const float *x, float *out, int64_t n, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
        const float *g = x + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float e = expf(fminf(-g[i], 80.0f));     /* finite math: keep expf's argument in range */
            o[i] = g[i] / (1.0f + e) * u[i];
        }
    }
}

/* x rows are [gate (n) | up (n)]; out rows are gelu(gate) * up (n), gelu's tanh approximation (Gemma's GeGLU). */
void gelu_tanh_mul(const float *x, float *out, int64_t n, int64_t begin, int64_t end) {
    const float c = 0.7978845608028654f;   /* sqrt(2 / pi) */
    for (int64_t r = begin; r < end; r++) {
        const float *g = x + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++)
            o[i] = 0.5f * g[i] * (1.0f + tanhf(c * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * u[i];
    }
}

/* Rotary embedding, "rotate half" layout: token t's heads x[t] (row stride x_stride, heads of d
 * contiguous floats) at position pos[t] -> out[t] (contiguous [heads, d]); cos_sin rows are
 * [cos (d/2) | sin (d/2)] per position. */
void rope(const float *x, int64_t x_stride, int64_t heads, int64_t d, const int64_t *pos,
          const float *cos_sin, float *out, int64_t begin, int64_t end) {
    const int64_t half = d / 2;
    for (int64_t t = begin; t < end; t++) {
        const float *c = cos_sin + pos[t] * d, *s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = x + t * x_stride + h * d, *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * d, *o2 = o1 + half;
            for (int64_t i = 0; i < half; i++) {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    }
}
