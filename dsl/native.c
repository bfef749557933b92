/* Loops of the cpu target that are hundreds of tiny tensor calls in torch or numpy, written once in C.
 *
 * Each function computes bit for bit what the torch code it replaces computes: float32 values, every sum added
 * left to right in the order torch adds them, every operation rounded on its own (dsl/native.py compiles this file
 * with -ffp-contract=off, so no multiply-add is fused, and without fast-math). tests/test_native.py checks the bits.
 */

#include <stdint.h>

/* The largest hc the Sinkhorn loop takes: torch on the CPU adds up to 4 values one after the other (5 or more it adds
 * in another order, found by tests/test_hyper_sinkhorn.py); dsl/native.py checks it first. */
#define DEEPINFER_MAX_HC 4

/* Sinkhorn's loop on `n` matrices [hc, hc] of positive float32 values, row-major, in place: divide by the column
 * sums plus eps, then `iters - 1` times by the row sums plus eps and by the column sums plus eps. A column's sum adds
 * its rows from the first to the last, a row's sum its columns from the first to the last: the order of torch's
 * `sum(dim=-2)` and `sum(dim=-1)` over so few values on the CPU. Returns 0, or -1 (touching nothing) where hc is
 * outside 1..DEEPINFER_MAX_HC. */
int deepinfer_sinkhorn_f32(float *a, int64_t n, int64_t hc, int64_t iters, float eps) {
    float sums[DEEPINFER_MAX_HC];
    if (hc < 1 || hc > DEEPINFER_MAX_HC) return -1;
    for (int64_t t = 0; t < n; t++) {
        float *m = a + t * hc * hc;
        for (int64_t it = 0; it < iters; it++) {
            if (it > 0) { /* rows, then columns; the first pass has only the columns */
                for (int64_t i = 0; i < hc; i++) {
                    float s = m[i * hc];
                    for (int64_t j = 1; j < hc; j++) s = s + m[i * hc + j];
                    s = s + eps;
                    for (int64_t j = 0; j < hc; j++) m[i * hc + j] = m[i * hc + j] / s;
                }
            }
            for (int64_t j = 0; j < hc; j++) sums[j] = m[j];
            for (int64_t i = 1; i < hc; i++)
                for (int64_t j = 0; j < hc; j++) sums[j] = sums[j] + m[i * hc + j];
            for (int64_t j = 0; j < hc; j++) sums[j] = sums[j] + eps;
            for (int64_t i = 0; i < hc; i++)
                for (int64_t j = 0; j < hc; j++) m[i * hc + j] = m[i * hc + j] / sums[j];
        }
    }
    return 0;
}
