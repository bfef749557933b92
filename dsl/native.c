/* Loops of the cpu target that are hundreds of tiny tensor calls in torch or numpy, written once in C.
 *
 * Each function computes bit for bit what the torch code it replaces computes: float32 values, every sum added
 * left to right in the order torch adds them, every operation rounded on its own (dsl/native.py compiles this file
 * with -ffp-contract=off, so no multiply-add is fused, and without fast-math). tests/test_hyper_sinkhorn.py,
 * tests/test_native_rounding.py and tests/test_native_rope.py check the bits.
 */

#include <stdint.h>
#include <string.h>

/* The largest hc the Sinkhorn loop takes: torch on the CPU adds up to 4 values one after the other (5 to 8 it adds in
 * another order: this loop gave other bits in every random case tried there); dsl/native.py checks it first. */
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

/* ---- fp8 and fp4 rounding and cache codes: dsl/ops/rounding.py and dsl/cache_format.py, value for value ----------
 * Each function runs over `nblocks` blocks of `block` contiguous float32 values; a block's scale comes from its amax,
 * which is NaN when any value is (as torch's amax). Every comparison below is false for NaN, so NaN passes through
 * clamps as it does in torch's clamp. */

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* 2^k as float32, exactly (0 below the subnormals, inf above 2^127): torch.exp2 of an integer k. */
static float exp2_int(int64_t k) {
    if (k > 127) return float_of(0x7F800000u);
    if (k >= -126) return float_of((uint32_t)(k + 127) << 23);
    if (k >= -149) return float_of(1u << (k + 149));
    return 0.0f;
}

/* rounding.pow2_ceil: k = exponent - 127, plus one where the mantissa is non-zero, from |x|'s bits. */
static inline int64_t pow2_ceil_exponent(float x) {
    int64_t b = (int64_t)(bits_of(x) & 0x7FFFFFFFu);
    return ((b + 0x7FFFFF) >> 23) - 127;
}

/* float32 -> e4m3 (fn: no infinities, 0x7F is NaN) rounding to nearest even, as torch's cast: |x| >= 480 and NaN
 * give NaN; below 2^-6 the subnormals, multiples of 2^-9 (adding 2^14 rounds to them); above, the mantissa's 20 low
 * bits dropped with ties to even. */
static uint8_t e4m3_code(float x) {
    uint32_t b = bits_of(x), sign = (b >> 24) & 0x80u, a = b & 0x7FFFFFFFu;
    if (a >= 0x43F00000u) return (uint8_t)(sign | 0x7Fu);  /* 480 and up, inf and NaN */
    if (a < 0x3C800000u) {  /* below 2^-6 */
        float rounded = float_of(a) + 16384.0f;  /* the add rounds |x| to a multiple of 2^-9 */
        return (uint8_t)(sign | (bits_of(rounded) - bits_of(16384.0f)));
    }
    a += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u);
    return (uint8_t)(sign | (a >> 20));
}

static float e4m3_value(uint8_t c) {
    uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
    float v;
    if (e == 15 && m == 7) v = float_of(0x7FF00000u);  /* the NaN torch's cast makes: the code's mantissa bits kept */
    else if (e == 0) v = (float)m * (1.0f / 512.0f);
    else v = float_of(((e - 7 + 127) << 23) | (m << 20));
    return (c & 0x80u) ? -v : v;
}

/* e2m1 codes (sign in bit 3) of values clamped to [-6, 6]: how many thresholds |q| reaches. A midpoint belongs to the
 * upper code when that code is even (the thresholds 0.75, 1.75, 3.5), else the threshold is the next float up. */
static uint8_t e2m1_code(float q) {
    static const float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    static const int tie_up[7] = {0, 1, 0, 1, 0, 1, 0};
    uint32_t b = bits_of(q);
    float a = float_of(b & 0x7FFFFFFFu);
    uint8_t code = 0;
    for (int i = 0; i < 7; i++) {
        float t = tie_up[i] ? mids[i] : float_of(bits_of(mids[i]) + 1u);
        code += (uint8_t)(a >= t);
    }
    return (uint8_t)(code | ((b >> 31) << 3));
}

static const float e2m1_values[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static float block_amax(const float *x, int64_t n) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float a = float_of(bits_of(x[i]) & 0x7FFFFFFFu);
        if (a != a) return a;
        if (a > amax) amax = a;
    }
    return amax;
}

static inline float clamp(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* e8m0 byte of a power-of-two scale 2^k (k from pow2_ceil_exponent: -127 for a zero amax, 128 and up for inf and
 * NaN), as torch's cast to float8_e8m0fnu; and its value, as cache_format's table (255 is NaN). */
static inline uint8_t e8m0_byte(int64_t k) { return k > 127 ? 0xFF : (uint8_t)(k + 127); }
static inline float e8m0_value(uint8_t byte) { return byte == 0xFF ? float_of(0x7FC00000u) : exp2_int((int64_t)byte - 127); }

/* rounding.fp8_round: amax floored at `floor`, the scale pow2_ceil(amax * inv_max), x / scale clamped to +-448, cast
 * to e4m3 and back, times the scale. */
void deepinfer_fp8_round_f32(const float *x, float *out, int64_t nblocks, int64_t block, float floor, float inv_max) {
    for (int64_t t = 0; t < nblocks; t++) {
        const float *xb = x + t * block;
        float *ob = out + t * block;
        float amax = block_amax(xb, block);
        amax = amax < floor ? floor : amax;
        float scale = exp2_int(pow2_ceil_exponent(amax * inv_max));
        for (int64_t i = 0; i < block; i++) ob[i] = e4m3_value(e4m3_code(clamp(xb[i] / scale, -448.0f, 448.0f))) * scale;
    }
}

/* rounding.fp4_round. e4m3_scale: the scale is amax (floored at `floor`) / 6 clamped to 448 and cast to e4m3;
 * otherwise pow2_ceil(amax (floored at `floor`) * inv_max). Then x / scale clamped to +-6, to its e2m1 value, times
 * the scale. */
void deepinfer_fp4_round_f32(const float *x, float *out, int64_t nblocks, int64_t block, int e4m3_scale, float floor,
                             float inv_max) {
    for (int64_t t = 0; t < nblocks; t++) {
        const float *xb = x + t * block;
        float *ob = out + t * block;
        float amax = block_amax(xb, block), scale;
        amax = amax < floor ? floor : amax;
        if (e4m3_scale) {
            float ratio = amax / 6.0f;
            scale = e4m3_value(e4m3_code(ratio > 448.0f ? 448.0f : ratio));
        } else {
            scale = exp2_int(pow2_ceil_exponent(amax * inv_max));
        }
        for (int64_t i = 0; i < block; i++) ob[i] = e2m1_values[e2m1_code(clamp(xb[i] / scale, -6.0f, 6.0f))] * scale;
    }
}

/* cache_format.EntryFormat("fp8").encode: e4m3 codes of x / scale and the e8m0 byte of scale = pow2_ceil(amax / 448)
 * per block. */
void deepinfer_fp8_encode_f32(const float *x, uint8_t *codes, uint8_t *scales, int64_t nblocks, int64_t block) {
    for (int64_t t = 0; t < nblocks; t++) {
        int64_t k = pow2_ceil_exponent(block_amax(x + t * block, block) / 448.0f);
        float scale = exp2_int(k);
        for (int64_t i = 0; i < block; i++) codes[t * block + i] = e4m3_code(x[t * block + i] / scale);
        scales[t] = e8m0_byte(k);
    }
}

/* cache_format.EntryFormat("fp4").encode: e2m1 codes of x / scale, two a byte (the even column low), and the scale
 * byte per block. Power-of-two scales are pow2_ceil(amax / 6) in e8m0. An e4m3 scale is amax over the first of the
 * block's possible largest |codes| (6, 4, 3, 2, 1.5, 1, 0.5) whose quotient is an e4m3 value that gives the block back
 * exactly; 1.0 for a zero block. Returns -1 - t where block t has none (its values are not on the grid), else 0. */
int deepinfer_fp4_encode_f32(const float *x, uint8_t *codes, uint8_t *scales, int64_t nblocks, int64_t block,
                             int e4m3_scale) {
    static const float maxima[7] = {6.0f, 4.0f, 3.0f, 2.0f, 1.5f, 1.0f, 0.5f};
    for (int64_t t = 0; t < nblocks; t++) {
        const float *xb = x + t * block;
        float amax = block_amax(xb, block), scale = 0.0f;
        if (!e4m3_scale) {
            int64_t k = pow2_ceil_exponent(amax / 6.0f);
            scale = exp2_int(k);
            scales[t] = e8m0_byte(k);
        } else if (amax == 0.0f) {
            scale = 1.0f;
            scales[t] = e4m3_code(1.0f);
        } else {
            int found = 0;
            for (int c = 0; c < 7 && !found; c++) {
                float want = amax / maxima[c];
                uint8_t code = e4m3_code(want);
                float s = e4m3_value(code);
                if (!(s == want)) continue;
                found = 1;
                for (int64_t i = 0; i < block && found; i++)
                    found = e2m1_values[e2m1_code(clamp(xb[i] / s, -6.0f, 6.0f))] * s == xb[i];
                if (found) { scale = s; scales[t] = code; }
            }
            if (!found) return (int)(-1 - t);
        }
        for (int64_t i = 0; i < block; i += 2) {
            uint8_t lo = e2m1_code(xb[i] / scale), hi = e2m1_code(xb[i + 1] / scale);
            codes[(t * block + i) / 2] = (uint8_t)(lo | (hi << 4));
        }
    }
    return 0;
}

/* cache_format.EntryFormat.decode: values = code's value times its block's scale. fp4 codes are two a byte (the even
 * column low); scales are e4m3 bytes when e4m3_scale, else e8m0. */
void deepinfer_decode_f32(const uint8_t *codes, const uint8_t *scales, float *out, int64_t nblocks, int64_t block,
                          int fp4, int e4m3_scale) {
    for (int64_t t = 0; t < nblocks; t++) {
        float scale = e4m3_scale ? e4m3_value(scales[t]) : e8m0_value(scales[t]);
        float *ob = out + t * block;
        if (scale != scale) {  /* a NaN scale: torch's product is the scale's NaN, even where the code is NaN too */
            for (int64_t i = 0; i < block; i++) ob[i] = scale;
            continue;
        }
        if (fp4) {
            const uint8_t *cb = codes + t * block / 2;
            for (int64_t i = 0; i < block / 2; i++) {
                ob[2 * i] = e2m1_values[cb[i] & 0xFu] * scale;
                ob[2 * i + 1] = e2m1_values[cb[i] >> 4] * scale;
            }
        } else {
            const uint8_t *cb = codes + t * block;
            for (int64_t i = 0; i < block; i++) ob[i] = e4m3_value(cb[i]) * scale;
        }
    }
}

/* ---- rope: dsl/ops/rope.py's _rotated ----------------------------------------------------------------------------
 * x [T, inner, D] with its last 2 * half dims rotated pair by pair: rot [T, half, 2, 2] indexed [.., in, out], an
 * output the sum of its two rounded products, even * rot[0][out] + odd * rot[1][out] (no fused multiply-add, as
 * torch's separate multiply and add). The first D - 2 * half dims are copied. */
void deepinfer_rope_f32(const float *x, const float *rot, float *out, int64_t tokens, int64_t inner, int64_t dim,
                        int64_t half) {
    int64_t nope = dim - 2 * half;
    for (int64_t t = 0; t < tokens; t++) {
        const float *r = rot + t * half * 4;
        for (int64_t h = 0; h < inner; h++) {
            const float *xr = x + (t * inner + h) * dim;
            float *orow = out + (t * inner + h) * dim;
            memcpy(orow, xr, (size_t)nope * sizeof(float));
            for (int64_t p = 0; p < half; p++) {
                float even = xr[nope + 2 * p], odd = xr[nope + 2 * p + 1];
                const float *rp = r + p * 4;
                float a = even * rp[0], b = odd * rp[2], c = even * rp[1], d = odd * rp[3];
                orow[nope + 2 * p] = a + b;
                orow[nope + 2 * p + 1] = c + d;
            }
        }
    }
}

/* ---- cache rows: dsl/cache.py's load_rows and store_rows ----------------------------------------------------------
 * A pool holds `count` blocks (or ring slots) of `per` rows. Pair m names block tables[major[m]][minor[m] / per] (with
 * `tables` [tmajor, twidth]; without it, block major[m]) and row minor[m] % per. Returns the flat row, or -1 where an
 * index lies outside its tensor (or is negative, which torch's indexing would wrap): the caller then runs torch. */
static int64_t pool_row(const int64_t *major, const int64_t *minor, int64_t m, const int64_t *tables, int64_t tmajor,
                        int64_t twidth, int64_t count, int64_t per) {
    int64_t a = major[m], b = minor[m], block;
    if (a < 0 || b < 0) return -1;
    if (tables) {
        if (a >= tmajor || b / per >= twidth) return -1;
        block = tables[a * twidth + b / per];
    } else {
        block = a;
    }
    if (block < 0 || block >= count) return -1;
    return block * per + b % per;
}

/* 0 where every pair lies inside the pool, else -1. */
static int pairs_inside(const int64_t *major, const int64_t *minor, int64_t n, const int64_t *tables, int64_t tmajor,
                        int64_t twidth, int64_t count, int64_t per) {
    for (int64_t m = 0; m < n; m++)
        if (pool_row(major, minor, m, tables, tmajor, twidth, count, per) < 0) return -1;
    return 0;
}

/* load_rows: the `n` entries at the pairs, decoded as deepinfer_decode_f32 decodes them, into out [n, dim]. `codes`
 * holds dim (fp8) or dim / 2 (fp4) bytes a row and `scales` dim / block. Returns 0, or -1 (out untouched) where a pair
 * lies outside the pool. */
int deepinfer_load_rows_f32(const uint8_t *codes, const uint8_t *scales, int64_t count, int64_t per,
                            const int64_t *major, const int64_t *minor, int64_t n, const int64_t *tables,
                            int64_t tmajor, int64_t twidth, float *out, int64_t dim, int64_t block, int fp4,
                            int e4m3_scale) {
    int64_t code_bytes = fp4 ? dim / 2 : dim, nscales = dim / block;
    if (pairs_inside(major, minor, n, tables, tmajor, twidth, count, per)) return -1;
    for (int64_t m = 0; m < n; m++) {
        int64_t row = pool_row(major, minor, m, tables, tmajor, twidth, count, per);
        deepinfer_decode_f32(codes + row * code_bytes, scales + row * nscales, out + m * dim, nscales, block, fp4,
                             e4m3_scale);
    }
    return 0;
}

/* store_rows: row m of each source (`bytes0` and `bytes1` a row: codes, then scales) copied to the pool rows of pair
 * m, pair after pair (a pair given twice keeps its last row; the caller's pairs given twice carry equal values).
 * Returns 0, or -1 (nothing stored) where a pair lies outside the pool. */
int deepinfer_store_rows(const uint8_t *src0, uint8_t *dst0, int64_t bytes0, const uint8_t *src1, uint8_t *dst1,
                         int64_t bytes1, int64_t count, int64_t per, const int64_t *major, const int64_t *minor,
                         int64_t n, const int64_t *tables, int64_t tmajor, int64_t twidth) {
    if (pairs_inside(major, minor, n, tables, tmajor, twidth, count, per)) return -1;
    for (int64_t m = 0; m < n; m++) {
        int64_t row = pool_row(major, minor, m, tables, tmajor, twidth, count, per);
        memcpy(dst0 + row * bytes0, src0 + m * bytes0, (size_t)bytes0);
        memcpy(dst1 + row * bytes1, src1 + m * bytes1, (size_t)bytes1);
    }
    return 0;
}

/* ---- sums written out as elementwise ops ------------------------------------------------------------------------
 * y [n, d] = x[which[0]] + x[which[1]] + ... added one after the other from +0 (torch's `y = zeros; y += x[j]` for
 * each j in turn), x a strided [k, n, d] (strides in elements). */
void deepinfer_add_slices_f32(const float *x, int64_t stride_k, int64_t stride_n, int64_t stride_d, int64_t n,
                              int64_t d, const int64_t *which, int64_t count, float *y) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < d; c++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < count; i++) acc = acc + x[which[i] * stride_k + t * stride_n + c * stride_d];
            y[t * d + c] = acc;
        }
}

/* out [r, width] = s[r, 0] * w[r, 0] + s[r, 1] * w[r, 1] + ... over `heads`, each product rounded, added from the
 * first head on (torch's `out = s[:, 0] * w[:, :1]` then `out = out + s[:, h] * w[:, h:h+1]`); s [r, heads, width]
 * and w [r, heads] contiguous. */
void deepinfer_weighted_heads_f32(const float *s, const float *w, float *out, int64_t rows, int64_t heads,
                                  int64_t width) {
    for (int64_t r = 0; r < rows; r++) {
        const float *sr = s + r * heads * width, *wr = w + r * heads;
        float *o = out + r * width;
        for (int64_t c = 0; c < width; c++) o[c] = sr[c] * wr[0];
        for (int64_t h = 1; h < heads; h++) {
            float wh = wr[h];
            const float *sh = sr + h * width;
            for (int64_t c = 0; c < width; c++) o[c] = o[c] + sh[c] * wh;
        }
    }
}
