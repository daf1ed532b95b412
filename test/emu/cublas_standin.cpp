// cublas_standin.cpp — cuBLASLt and cuBLAS for the CPU emulator of CUDA: the functions that the real
// <cublasLt.h> and <cublas_v2.h> declare, exactly the subset this repository calls, defined on the host.
// Link it instead of -lcublasLt -lcublas. Device memory is host memory under the emulator, every
// stream operation runs at the call (or, captured into a CUDA graph, when the graph is launched: see
// stream_capture.h), so a GEMM here is a plain loop that has finished on return.
//
// What it implements, from NVIDIA's documented semantics:
//   D = epilogue(alpha * op(A) op(B) + beta * C), every matrix column-major; op(A) is m x k, op(B) is
//   k x n, C and D are m x n; op(X) = X or X^T (CUBLAS_OP_N / CUBLAS_OP_T); element (i, j) of a
//   matrix with leading dimension ld lives at p[i + j * ld]; batch b starts at p + b * batch_stride.
//   The k-sum is accumulated in fp32 (CUBLAS_COMPUTE_32F and _PEDANTIC; a bf16 x bf16 product is
//   exact in fp32, as on tensor cores), alpha, beta and the epilogue are applied in fp32, and the
//   result is rounded to nearest even when D is bf16. beta == 0 means C is not read (BLAS rule), so
//   an uninitialised C (NaN-filled by the emulator) cannot leak into D.
//   Epilogues: DEFAULT; BIAS (bias[i] added to row i of the m x n output, i.e. per output feature);
//   GELU, GELU_BIAS (bias, then GELU, tanh approximation); GELU_AUX, GELU_AUX_BIAS (also store the
//   GELU input, in D's type, into the aux matrix); DGELU (D = result * GELU'(aux)); DGELU_BGRAD
//   (and bias[i] = sum over the row of D, before rounding); BGRADA / BGRADB (bias gradient = sums
//   of op(A)'s rows, length m / of op(B)'s columns, length n, over k). The bias-gradient outputs are
//   overwritten, not accumulated. Data types bf16, fp16 and fp32 for A, B, C, D, bias and aux.
//   Rules the real library enforces and this one checks, so a mistake fails here and not first on a
//   GPU: layout shapes agree with m, n, k and the transposes; ld >= rows; equal batch counts; the
//   aux leading dimension (and batch stride) a multiple of 8; pointers aligned as the heuristic's
//   preference promised (default 256 bytes, MIN_ALIGNMENT_*_BYTES); the bias and aux pointers at
//   least as aligned as the ones the descriptor held when the heuristic was asked (the heuristic
//   "depends on [their] value to determine expected pointer alignment", cublasLt.h: an algorithm
//   chosen for a 256-byte-aligned bias may rely on it); an algorithm that came from the heuristic.
//   Anything else (another epilogue, data type, compute type, order, pointer mode, an attribute
//   not listed) is refused with one line on stderr naming it and CUBLAS_STATUS_NOT_SUPPORTED.
//
// The k-sum runs in a fixed order (eight interleaved partial sums over k, combined pairwise, then the
// tail), so results are bit-reproducible run to run and schedule to schedule, like the real library
// for a fixed algorithm. Compile with -ffp-contract=off so the bits do not depend on whether the
// compiler fuses multiply-adds. Single-threaded on purpose: emulated runs may put several MPI ranks
// on two cores.
//
// fp8 (--precision fp8, llmc/kernels/fp8.cuh): A and B may be CUDA_R_8F_E4M3 / CUDA_R_8F_E5M2, decoded
// exactly by the OCP FP8 spec (fp8_to_float below), with C and D bf16 and the per-tensor dequantizing
// scales CUBLASLT_MATMUL_DESC_A_SCALE_POINTER / B_SCALE_POINTER (device floats, read when the matmul
// runs: D = alpha sa sb op(A) op(B) + beta C). Hopper's rules are refused as the real library
// refuses them: anything but TN (A transposed, B not), m, n, k or a leading dimension not a multiple
// of 16, e5m2 x e5m2, an fp8 operand beside a non-fp8 one.
//
// What it does not prove: speed; the exact bits of real cuBLASLt, whose accumulation order, split-K
// and tensor-core internals (e.g. the order of additions within an MMA instruction) are not
// documented; that a real GPU picks an algorithm for a shape; TF32 or any other mode.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include "stream_capture.h"

// The handles are pointers to structs the headers leave incomplete: the stand-in completes them.
struct cublasLtContext {
    uint64_t magic;
};
struct cublasContext {
    uint64_t magic;
    cudaStream_t stream;
    void* workspace;
    size_t workspace_bytes;
};

namespace {

constexpr uint64_t LT_HANDLE_MAGIC = 0x4c5448414e444c45ull, HANDLE_MAGIC = 0x434248414e444c45ull;
constexpr uint64_t LAYOUT_MAGIC = 0x4c41594f55542121ull, DESC_MAGIC = 0x444553432121212full;
constexpr uint64_t PREF_MAGIC = 0x5052454621212121ull, ALGO_MAGIC = 0x414c474f53544e44ull;

struct Layout {
    uint64_t magic = LAYOUT_MAGIC;
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld;
    int32_t batch = 1;
    int64_t batch_stride = 0;  // elements
};

struct Desc {
    uint64_t magic = DESC_MAGIC;
    cublasComputeType_t compute;
    cudaDataType_t scale;
    int32_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
    uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    void* bias = nullptr;
    int32_t bias_type = -1;  // -1: D's type
    int64_t bias_batch_stride = 0;
    void* aux = nullptr;
    int64_t aux_ld = 0, aux_batch_stride = 0;
    int32_t aux_type = -1;  // -1: D's type
    const float* a_scale = nullptr;  // fp8: device floats multiplying op(A) op(B) (null: 1)
    const float* b_scale = nullptr;
};

struct Pref {
    uint64_t magic = PREF_MAGIC;
    uint64_t max_workspace = 0;
    uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D: the documented default
};

// what the heuristic writes into cublasLtMatmulAlgo_t::data, and cublasLtMatmul checks
// data[1..4]: alignment promised for A, B, C, D; data[5], data[6]: the bias's and the aux's alignment
// as the heuristic saw their pointers
enum { ALGO_DATA_MAGIC = 0, ALGO_DATA_ALIGN = 1, ALGO_DATA_ALIGN_BIAS = 5, ALGO_DATA_ALIGN_AUX = 6 };

// The alignment a pointer's value shows, up to the 256 bytes cudaMalloc gives (null: any).
uint64_t pointer_alignment(const void* p) {
    uintptr_t v = (uintptr_t)p;
    uint64_t a = 1;
    while (a < 256 && v % (a * 2) == 0) a *= 2;
    return v == 0 ? 256 : a;
}

void refuse(const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fputs("cuBLASLt stand-in: ", stderr);
    vfprintf(stderr, fmt, args);
    fputc('\n', stderr);
    va_end(args);
}

const char* type_name(int t) {
    switch (t) {
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    case CUDA_R_16F: return "CUDA_R_16F";
    case CUDA_R_64F: return "CUDA_R_64F";
    case CUDA_R_8I: return "CUDA_R_8I";
    case CUDA_R_32I: return "CUDA_R_32I";
    case CUDA_R_8F_E4M3: return "CUDA_R_8F_E4M3";
    case CUDA_R_8F_E5M2: return "CUDA_R_8F_E5M2";
    default: return "(this cudaDataType_t value)";
    }
}
bool type_supported(int t) { return t == CUDA_R_32F || t == CUDA_R_16BF || t == CUDA_R_16F; }
bool is_fp8(int t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }
size_t type_bytes(int t) { return t == CUDA_R_32F ? 4 : is_fp8(t) ? 1 : 2; }

const char* compute_name(int c) {
    switch (c) {
    case CUBLAS_COMPUTE_32F: return "CUBLAS_COMPUTE_32F";
    case CUBLAS_COMPUTE_32F_PEDANTIC: return "CUBLAS_COMPUTE_32F_PEDANTIC";
    case CUBLAS_COMPUTE_32F_FAST_TF32: return "CUBLAS_COMPUTE_32F_FAST_TF32";
    case CUBLAS_COMPUTE_32F_FAST_16BF: return "CUBLAS_COMPUTE_32F_FAST_16BF";
    case CUBLAS_COMPUTE_32F_FAST_16F: return "CUBLAS_COMPUTE_32F_FAST_16F";
    case CUBLAS_COMPUTE_16F: return "CUBLAS_COMPUTE_16F";
    case CUBLAS_COMPUTE_64F: return "CUBLAS_COMPUTE_64F";
    case CUBLAS_COMPUTE_32I: return "CUBLAS_COMPUTE_32I";
    default: return "(this cublasComputeType_t value)";
    }
}
bool compute_supported(int c) { return c == CUBLAS_COMPUTE_32F || c == CUBLAS_COMPUTE_32F_PEDANTIC; }

const char* epilogue_name(uint32_t e) {
    switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return "CUBLASLT_EPILOGUE_DEFAULT";
    case CUBLASLT_EPILOGUE_RELU: return "CUBLASLT_EPILOGUE_RELU";
    case CUBLASLT_EPILOGUE_RELU_AUX: return "CUBLASLT_EPILOGUE_RELU_AUX";
    case CUBLASLT_EPILOGUE_BIAS: return "CUBLASLT_EPILOGUE_BIAS";
    case CUBLASLT_EPILOGUE_RELU_BIAS: return "CUBLASLT_EPILOGUE_RELU_BIAS";
    case CUBLASLT_EPILOGUE_RELU_AUX_BIAS: return "CUBLASLT_EPILOGUE_RELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DRELU: return "CUBLASLT_EPILOGUE_DRELU";
    case CUBLASLT_EPILOGUE_DRELU_BGRAD: return "CUBLASLT_EPILOGUE_DRELU_BGRAD";
    case CUBLASLT_EPILOGUE_GELU: return "CUBLASLT_EPILOGUE_GELU";
    case CUBLASLT_EPILOGUE_GELU_AUX: return "CUBLASLT_EPILOGUE_GELU_AUX";
    case CUBLASLT_EPILOGUE_GELU_BIAS: return "CUBLASLT_EPILOGUE_GELU_BIAS";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "CUBLASLT_EPILOGUE_GELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DGELU: return "CUBLASLT_EPILOGUE_DGELU";
    case CUBLASLT_EPILOGUE_DGELU_BGRAD: return "CUBLASLT_EPILOGUE_DGELU_BGRAD";
    case CUBLASLT_EPILOGUE_BGRADA: return "CUBLASLT_EPILOGUE_BGRADA";
    case CUBLASLT_EPILOGUE_BGRADB: return "CUBLASLT_EPILOGUE_BGRADB";
    default: return "(this cublasLtEpilogue_t value)";
    }
}

// What an epilogue does, as flags: the enum's values are bit sets, but the stand-in names its own.
struct Epilogue {
    bool bias = false, gelu = false, aux_out = false, dgelu = false, bgrad_d = false, bgrad_a = false,
         bgrad_b = false;
};
bool decode_epilogue(uint32_t e, Epilogue* ep) {
    *ep = Epilogue();
    switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return true;
    case CUBLASLT_EPILOGUE_BIAS: ep->bias = true; return true;
    case CUBLASLT_EPILOGUE_GELU: ep->gelu = true; return true;
    case CUBLASLT_EPILOGUE_GELU_BIAS: ep->gelu = ep->bias = true; return true;
    case CUBLASLT_EPILOGUE_GELU_AUX: ep->gelu = ep->aux_out = true; return true;
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: ep->gelu = ep->aux_out = ep->bias = true; return true;
    case CUBLASLT_EPILOGUE_DGELU: ep->dgelu = true; return true;
    case CUBLASLT_EPILOGUE_DGELU_BGRAD: ep->dgelu = ep->bgrad_d = true; return true;
    case CUBLASLT_EPILOGUE_BGRADA: ep->bgrad_a = true; return true;
    case CUBLASLT_EPILOGUE_BGRADB: ep->bgrad_b = true; return true;
    default: return false;
    }
}

// ---- numbers

float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest, ties to even; NaN stays a (quiet) NaN
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

// An fp8 code's value, from the OCP 8-bit floating point spec (v1.0), not from cuda_fp8.h:
//   e4m3: bias 7, subnormals (exponent 0) m/8 * 2^-6, no infinities, S.1111.111 is NaN (max 448)
//   e5m2: bias 15, subnormals m/4 * 2^-14, IEEE's inf (S.11111.00) and NaNs (max 57344)
float fp8_to_float(uint8_t code, bool e5m2) {
    int sign = code >> 7, mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    int e = (code & 0x7f) >> mbits, m = code & ((1 << mbits) - 1), top = e5m2 ? 31 : 15;
    float v;
    if (e5m2 && e == top) v = m == 0 ? INFINITY : NAN;
    else if (!e5m2 && e == top && m == 7) v = NAN;
    else if (e == 0) v = ldexpf((float)m, 1 - bias - mbits);
    else v = ldexpf((float)((1 << mbits) + m), e - bias - mbits);
    return sign ? -v : v;
}

// fp16 (train_gpt_fp16) through CUDA's own host conversions (cuda_fp16.h): round to nearest even,
// subnormals kept, above 65504 inf, as a GPU's fp16 output.
float load(const void* p, cudaDataType_t t, size_t i) {
    if (is_fp8(t)) return fp8_to_float(((const uint8_t*)p)[i], t == CUDA_R_8F_E5M2);
    if (t == CUDA_R_16F) return __half2float(((const __half*)p)[i]);
    return t == CUDA_R_32F ? ((const float*)p)[i] : bf16_to_float(((const uint16_t*)p)[i]);
}
void store(void* p, cudaDataType_t t, size_t i, float v) {
    if (t == CUDA_R_32F)
        ((float*)p)[i] = v;
    else if (t == CUDA_R_16F)
        ((__half*)p)[i] = __float2half_rn(v);
    else
        ((uint16_t*)p)[i] = float_to_bf16(v);
}

// GELU, tanh approximation: 0.5 x (1 + tanh z), z = sqrt(2/pi) (x + 0.044715 x^3), and its derivative.
// 1 + tanh z is computed as 2 sigmoid(2z), which does not cancel for large negative x, and in double,
// rounded once to fp32, so the result does not depend on which libm variant a machine picks.
const double GELU_SCALE = 0.7978845608028654;  // sqrt(2 / pi)
double half_one_plus_tanh(double x) {  // (1 + tanh z) / 2 = sigmoid(2z)
    return 1.0 / (1.0 + exp(-2.0 * GELU_SCALE * (x + 0.044715 * x * x * x)));
}
float gelu(float xf) {
    double x = xf;
    return (float)(x * half_one_plus_tanh(x));
}
float gelu_grad(float xf) {  // s + x s (1 - s) dz/dx * 2, since 1 - tanh^2 z = 4 s (1 - s)
    double x = xf, s = half_one_plus_tanh(x);
    return (float)(s + 2.0 * x * s * (1.0 - s) * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x));
}

// Matrix `b` of a strided batch; a null pointer (an unused operand) stays null.
const char* batch_offset(const void* p, int b, int64_t stride, cudaDataType_t t) {
    return p ? (const char*)p + (int64_t)b * stride * (int64_t)type_bytes(t) : nullptr;
}

// One matrix operand as the GEMM reads it: element (r, c) of op(X) is at base[r * row_step + c * col_step].
struct Operand {
    const void* base;
    cudaDataType_t type;
    int64_t row_step, col_step;
};
Operand operand(const void* p, cudaDataType_t t, int64_t ld, bool trans) {
    return trans ? Operand{p, t, ld, 1} : Operand{p, t, 1, ld};
}

// Fixed-order dot product: eight interleaved fp32 partial sums, combined pairwise, then the tail.
float dot(const float* a, const float* b, int k) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int p = 0;
    for (; p + 8 <= k; p += 8)
        for (int l = 0; l < 8; l++) s[l] += a[p + l] * b[p + l];
    float tail = 0.0f;
    for (; p < k; p++) tail += a[p] * b[p];
    return (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))) + tail;
}

// acc (m x n, column-major, ld m) = op(A) op(B), fp32. op(A)'s rows and op(B)'s columns are first
// copied into contiguous fp32 rows, so every dot product walks two unit-stride arrays.
void gemm_fp32(float* acc, int m, int n, int k, Operand a, Operand b, std::vector<float>* pa, std::vector<float>* pb) {
    pa->resize((size_t)m * k);
    pb->resize((size_t)n * k);
    for (int i = 0; i < m; i++)
        for (int p = 0; p < k; p++) (*pa)[(size_t)i * k + p] = load(a.base, a.type, i * a.row_step + p * a.col_step);
    for (int j = 0; j < n; j++)
        for (int p = 0; p < k; p++) (*pb)[(size_t)j * k + p] = load(b.base, b.type, p * b.row_step + j * b.col_step);
    const int JB = 32;  // a block of op(B)'s columns stays in cache while every row of op(A) passes it
    for (int j0 = 0; j0 < n; j0 += JB)
        for (int i = 0; i < m; i++)
            for (int j = j0; j < n && j < j0 + JB; j++)
                acc[(size_t)j * m + i] = dot(pa->data() + (size_t)i * k, pb->data() + (size_t)j * k, k);
}

// ---- validation shared by the heuristic and the matmul

template <class T> T* checked(void* p, uint64_t magic, const char* what) {
    T* x = (T*)p;
    if (!x || x->magic != magic) {
        refuse("%s is null, destroyed or not created by the stand-in", what);
        return nullptr;
    }
    return x;
}

struct Problem {
    int m, n, k, batch;
    Epilogue ep;
    cudaDataType_t bias_type, aux_type;
};

// fp8's rules on Hopper (cuBLASLt's documentation of cublasLtMatmul, "FP8 requirements"), checked
// before the general shape checks, to which it then hands over with the types' own rules passed.
cublasStatus_t check_problem_shapes(const Desc* d, const Layout* a, const Layout* b, const Layout* c,
                                    const Layout* dd, Problem* pr);
cublasStatus_t check_fp8_problem(const Desc* d, const Layout* a, const Layout* b, const Layout* c, const Layout* dd,
                                 Problem* pr) {
    if (!is_fp8(a->type) || !is_fp8(b->type)) {
        refuse("A is %s and B %s: an fp8 operand needs an fp8 partner", type_name(a->type), type_name(b->type));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (a->type == CUDA_R_8F_E5M2 && b->type == CUDA_R_8F_E5M2) {
        refuse("A and B both CUDA_R_8F_E5M2: cuBLASLt has no e5m2 x e5m2 matmul (one of them must be e4m3)");
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (c->type != CUDA_R_16BF || dd->type != CUDA_R_16BF) {
        refuse("fp8 inputs with C %s and D %s are not implemented (bf16 C and D are)", type_name(c->type), type_name(dd->type));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d->compute != CUBLAS_COMPUTE_32F) {
        refuse("fp8 inputs need CUBLAS_COMPUTE_32F, got %s", compute_name(d->compute));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d->trans_a != CUBLAS_OP_T || d->trans_b != CUBLAS_OP_N) {
        refuse("fp8 with transa=%s transb=%s: Hopper's fp8 kernels take only TN (A transposed, B not); quantize the "
               "operand transposed instead", d->trans_a == CUBLAS_OP_T ? "T" : "N", d->trans_b == CUBLAS_OP_T ? "T" : "N");
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d->epilogue != CUBLASLT_EPILOGUE_DEFAULT && d->epilogue != CUBLASLT_EPILOGUE_BIAS) {
        refuse("fp8 with epilogue %s is not implemented (DEFAULT and BIAS are)", epilogue_name(d->epilogue));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    const Layout* all[4] = {a, b, c, dd};
    for (int x = 0; x < 4; x++) {
        if (all[x]->rows % 16 != 0 || all[x]->cols % 16 != 0 || all[x]->ld % 16 != 0) {
            refuse("fp8: %c is %llu x %llu with ld %lld; m, n, k and the leading dimensions must be multiples of 16",
                   "ABCD"[x], (unsigned long long)all[x]->rows, (unsigned long long)all[x]->cols, (long long)all[x]->ld);
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
        if (all[x]->batch != 1) {
            refuse("fp8 batched matmuls are not implemented");
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
    }
    return check_problem_shapes(d, a, b, c, dd, pr);
}

cublasStatus_t check_problem(const Desc* d, const Layout* a, const Layout* b, const Layout* c, const Layout* dd,
                             Problem* pr) {
    if (!compute_supported(d->compute)) {
        refuse("compute type %s is not implemented", compute_name(d->compute));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d->scale != CUDA_R_32F) {
        refuse("scale type %s is not implemented (only CUDA_R_32F)", type_name(d->scale));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    const Layout* all[4] = {a, b, c, dd};
    const char* names[4] = {"A", "B", "C", "D"};
    if (is_fp8(a->type) || is_fp8(b->type)) return check_fp8_problem(d, a, b, c, dd, pr);
    for (int x = 0; x < 4; x++) {
        if (!type_supported(all[x]->type)) {
            refuse("data type %s for %s is not implemented (CUDA_R_16BF, CUDA_R_16F and CUDA_R_32F are)", type_name(all[x]->type),
                   names[x]);
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
    }
    if (a->type != b->type || c->type != dd->type) {
        refuse("A is %s, B %s, C %s, D %s: A and B must share a type, C and D must share one", type_name(a->type),
               type_name(b->type), type_name(c->type), type_name(dd->type));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (a->type == CUDA_R_32F && dd->type != CUDA_R_32F) {
        refuse("fp32 A and B with a %s output is not implemented", type_name(dd->type));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d->compute == CUBLAS_COMPUTE_32F_PEDANTIC && a->type != CUDA_R_32F) {
        refuse("CUBLAS_COMPUTE_32F_PEDANTIC with %s inputs is not implemented (the repo pairs it with fp32)",
               type_name(a->type));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d->a_scale || d->b_scale) {
        refuse("CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER with %s inputs: the stand-in implements them for fp8 only",
               type_name(a->type));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return check_problem_shapes(d, a, b, c, dd, pr);
}

cublasStatus_t check_problem_shapes(const Desc* d, const Layout* a, const Layout* b, const Layout* c,
                                    const Layout* dd, Problem* pr) {
    const Layout* all[4] = {a, b, c, dd};
    const char* names[4] = {"A", "B", "C", "D"};
    bool ta = d->trans_a == CUBLAS_OP_T, tb = d->trans_b == CUBLAS_OP_T;
    uint64_t m = dd->rows, n = dd->cols, k = ta ? a->rows : a->cols;
    uint64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
    if (a->rows != a_rows || a->cols != a_cols || b->rows != b_rows || b->cols != b_cols || c->rows != m ||
        c->cols != n) {
        refuse("layouts disagree: D is %llu x %llu, so with transa=%s transb=%s A must be %llu x %llu (is %llu x %llu), "
               "B %llu x %llu (is %llu x %llu), C %llu x %llu (is %llu x %llu)",
               (unsigned long long)m, (unsigned long long)n, ta ? "T" : "N", tb ? "T" : "N",
               (unsigned long long)a_rows, (unsigned long long)a_cols, (unsigned long long)a->rows,
               (unsigned long long)a->cols, (unsigned long long)b_rows, (unsigned long long)b_cols,
               (unsigned long long)b->rows, (unsigned long long)b->cols, (unsigned long long)m, (unsigned long long)n,
               (unsigned long long)c->rows, (unsigned long long)c->cols);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    for (int x = 0; x < 4; x++) {
        if (all[x]->ld < (int64_t)(all[x]->rows > 1 ? all[x]->rows : 1)) {
            refuse("the leading dimension of %s (%lld) is smaller than its row count (%llu)", names[x],
                   (long long)all[x]->ld, (unsigned long long)all[x]->rows);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
        if (all[x]->batch != dd->batch) {
            refuse("batch counts differ: %s has %d, D has %d", names[x], all[x]->batch, dd->batch);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
    }
    if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
        refuse("a dimension over 2^31 is not implemented");
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    Epilogue ep;
    decode_epilogue(d->epilogue, &ep);  // values were checked when set
    cudaDataType_t bias_type = d->bias_type < 0 ? dd->type : (cudaDataType_t)d->bias_type;
    cudaDataType_t aux_type = d->aux_type < 0 ? dd->type : (cudaDataType_t)d->aux_type;
    bool uses_bias = ep.bias || ep.bgrad_d || ep.bgrad_a || ep.bgrad_b, uses_aux = ep.aux_out || ep.dgelu;
    if (uses_bias && bias_type != dd->type) {
        refuse("bias data type %s with a %s output is not implemented (the documented rule: the bias has D's type)",
               type_name(bias_type), type_name(dd->type));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (uses_aux) {
        if (aux_type != dd->type) {
            refuse("epilogue aux data type %s with a %s output is not implemented", type_name(aux_type),
                   type_name(dd->type));
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
        if (d->aux_ld < (int64_t)m || d->aux_ld % 8 != 0) {
            refuse("%s needs CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD >= the rows of D (%llu) and a multiple of 8, got %lld",
                   epilogue_name(d->epilogue), (unsigned long long)m, (long long)d->aux_ld);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
        if (d->aux_batch_stride % 8 != 0) {
            refuse("%s needs CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE a multiple of 8, got %lld",
                   epilogue_name(d->epilogue), (long long)d->aux_batch_stride);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
    }
    pr->m = (int)m, pr->n = (int)n, pr->k = (int)k, pr->batch = dd->batch;
    pr->ep = ep, pr->bias_type = bias_type, pr->aux_type = aux_type;
    return CUBLAS_STATUS_SUCCESS;
}

bool check_size(size_t got, size_t want, const char* attr) {
    if (got == want) return true;
    refuse("%s takes %zu bytes, got %zu", attr, want, got);
    return false;
}

int32_t read_i32(const void* buf) {
    int32_t v;
    memcpy(&v, buf, 4);
    return v;
}
int64_t read_i64(const void* buf) {
    int64_t v;
    memcpy(&v, buf, 8);
    return v;
}

// The shared body of cublasGemmEx and cublasGemmStridedBatchedEx.
cublasStatus_t gemm_ex(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                       const void* alpha, const void* A, cudaDataType at, int lda, long long sa, const void* B,
                       cudaDataType bt, int ldb, long long sb, const void* beta, void* C, cudaDataType ct, int ldc,
                       long long sc, int batch, cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    if (!handle || handle->magic != HANDLE_MAGIC) {
        refuse("cuBLAS handle is null, destroyed or not created by the stand-in");
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    if ((transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) || (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T)) {
        refuse("cuBLAS operation %d is not implemented (CUBLAS_OP_N and CUBLAS_OP_T are)",
               transa != CUBLAS_OP_N && transa != CUBLAS_OP_T ? (int)transa : (int)transb);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (algo != CUBLAS_GEMM_DEFAULT && algo != CUBLAS_GEMM_DEFAULT_TENSOR_OP) {
        refuse("cublasGemmAlgo_t %d is not implemented (CUBLAS_GEMM_DEFAULT is)", (int)algo);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    // the same checks as the cuBLASLt path, through its layout and descriptor
    Desc d;
    d.compute = compute, d.scale = CUDA_R_32F, d.trans_a = transa, d.trans_b = transb;
    bool ta = transa == CUBLAS_OP_T, tb = transb == CUBLAS_OP_T;
    Layout la, lb, lc;
    la.type = at, la.rows = ta ? k : m, la.cols = ta ? m : k, la.ld = lda, la.batch = batch, la.batch_stride = sa;
    lb.type = bt, lb.rows = tb ? n : k, lb.cols = tb ? k : n, lb.ld = ldb, lb.batch = batch, lb.batch_stride = sb;
    lc.type = ct, lc.rows = m, lc.cols = n, lc.ld = ldc, lc.batch = batch, lc.batch_stride = sc;
    if (m < 0 || n < 0 || k < 0 || batch < 0) {
        refuse("negative size: m=%d n=%d k=%d batch=%d", m, n, k, batch);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    Problem pr;
    cublasStatus_t s = check_problem(&d, &la, &lb, &lc, &lc, &pr);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    if (!alpha || !beta || (!A && k > 0) || (!B && k > 0) || !C) {
        refuse("cuBLAS GEMM: a null pointer among alpha, beta, A, B, C");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    float al = *(const float*)alpha, be = *(const float*)beta;
    // now, or when a graph replays it (stream capture), with alpha and beta read at this call
    emu::stream_work(handle->stream, "cublasGemmEx", cudaGraphNodeTypeKernel, [=]() {
        std::vector<float> acc((size_t)m * n), pa, pb;
        for (int bi = 0; bi < batch; bi++) {
            const char* ab = batch_offset(A, bi, sa, at);
            const char* bb = batch_offset(B, bi, sb, bt);
            char* cb = (char*)batch_offset(C, bi, sc, ct);
            gemm_fp32(acc.data(), m, n, k, operand(ab, at, lda, ta), operand(bb, bt, ldb, tb), &pa, &pb);
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    size_t ci = (size_t)i + (size_t)j * ldc;
                    float v = al * acc[(size_t)j * m + i];
                    if (be != 0.0f) v += be * load(cb, ct, ci);
                    store(cb, ct, ci, v);
                }
        }
    });
    return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

// Linked without the emulated CUDA runtime (test/test_emu_cublas.py drives the stand-in alone), no
// stream is ever captured: the work runs at once. The runtime's definition replaces this one.
__attribute__((weak)) void emu::stream_work(cudaStream_t, const char*, int, std::function<void()> work) { work(); }

extern "C" {

// ================================================================ cuBLASLt

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    *handle = new cublasLtContext{LT_HANDLE_MAGIC};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
    if (!checked<cublasLtContext>(handle, LT_HANDLE_MAGIC, "cublasLtDestroy: the handle"))
        return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->magic = 0;
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
    if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
    Layout* l = new Layout();
    l->type = type, l->rows = rows, l->cols = cols, l->ld = ld;
    *layout = (cublasLtMatrixLayout_t)l;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
    Layout* l = checked<Layout>(layout, LAYOUT_MAGIC, "cublasLtMatrixLayoutDestroy: the layout");
    if (!l) return CUBLAS_STATUS_INVALID_VALUE;
    l->magic = 0;
    delete l;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t size) {
    Layout* l = checked<Layout>(layout, LAYOUT_MAGIC, "cublasLtMatrixLayoutSetAttribute: the layout");
    if (!l || !buf) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_ORDER: {
        if (!check_size(size, 4, "CUBLASLT_MATRIX_LAYOUT_ORDER")) return CUBLAS_STATUS_INVALID_VALUE;
        int32_t order = read_i32(buf);
        if (order != CUBLASLT_ORDER_COL) {
            refuse("matrix order %d is not implemented (CUBLASLT_ORDER_COL is)", order);
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT:
        if (!check_size(size, 4, "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT")) return CUBLAS_STATUS_INVALID_VALUE;
        l->batch = read_i32(buf);
        if (l->batch < 1) {
            refuse("batch count %d is not positive", l->batch);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
        if (!check_size(size, 8, "CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET")) return CUBLAS_STATUS_INVALID_VALUE;
        l->batch_stride = read_i64(buf);
        return CUBLAS_STATUS_SUCCESS;
    default:
        refuse("matrix layout attribute %d is not implemented (ORDER, BATCH_COUNT, STRIDED_BATCH_OFFSET are)", (int)attr);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
    if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
    if (!compute_supported(compute)) {
        refuse("compute type %s is not implemented (CUBLAS_COMPUTE_32F and CUBLAS_COMPUTE_32F_PEDANTIC are)",
               compute_name(compute));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (scale != CUDA_R_32F) {
        refuse("scale type %s is not implemented (CUDA_R_32F is)", type_name(scale));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    Desc* d = new Desc();
    d->compute = compute, d->scale = scale;
    *desc = (cublasLtMatmulDesc_t)d;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
    Desc* d = checked<Desc>(desc, DESC_MAGIC, "cublasLtMatmulDescDestroy: the descriptor");
    if (!d) return CUBLAS_STATUS_INVALID_VALUE;
    d->magic = 0;
    delete d;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
    Desc* d = checked<Desc>(desc, DESC_MAGIC, "cublasLtMatmulDescSetAttribute: the descriptor");
    if (!d || !buf) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
        const char* name = attr == CUBLASLT_MATMUL_DESC_TRANSA ? "CUBLASLT_MATMUL_DESC_TRANSA" : "CUBLASLT_MATMUL_DESC_TRANSB";
        if (!check_size(size, 4, name)) return CUBLAS_STATUS_INVALID_VALUE;
        int32_t op = read_i32(buf);
        if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) {
            refuse("%s = %d is not implemented (CUBLAS_OP_N and CUBLAS_OP_T are)", name, op);
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
        (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d->trans_a : d->trans_b) = op;
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_EPILOGUE: {
        if (!check_size(size, 4, "CUBLASLT_MATMUL_DESC_EPILOGUE")) return CUBLAS_STATUS_INVALID_VALUE;
        uint32_t e = (uint32_t)read_i32(buf);
        Epilogue ep;
        if (!decode_epilogue(e, &ep)) {
            refuse("epilogue %s (%u) is not implemented", epilogue_name(e), e);
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
        d->epilogue = e;
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
        if (!check_size(size, sizeof(void*), "CUBLASLT_MATMUL_DESC_BIAS_POINTER")) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&d->bias, buf, sizeof(void*));
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
        if (!check_size(size, sizeof(void*), "CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER")) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(attr == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER ? (void*)&d->a_scale : (void*)&d->b_scale, buf, sizeof(void*));
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
        if (!check_size(size, sizeof(void*), "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER"))
            return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&d->aux, buf, sizeof(void*));
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: {
        bool bias = attr == CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE;
        const char* name = bias ? "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE" : "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE";
        if (!check_size(size, 4, name)) return CUBLAS_STATUS_INVALID_VALUE;
        int32_t t = read_i32(buf);
        if (!type_supported(t)) {
            refuse("%s = %s is not implemented (CUDA_R_16BF, CUDA_R_16F and CUDA_R_32F are)", name, type_name(t));
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
        (bias ? d->bias_type : d->aux_type) = t;
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE:
    case CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE: {
        if (!check_size(size, 8, "an int64_t descriptor attribute")) return CUBLAS_STATUS_INVALID_VALUE;
        int64_t v = read_i64(buf);
        (attr == CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD          ? d->aux_ld
         : attr == CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE ? d->aux_batch_stride
                                                                  : d->bias_batch_stride) = v;
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: {
        if (!check_size(size, 4, "CUBLASLT_MATMUL_DESC_POINTER_MODE")) return CUBLAS_STATUS_INVALID_VALUE;
        int32_t mode = read_i32(buf);
        if (mode != CUBLASLT_POINTER_MODE_HOST) {
            refuse("pointer mode %d is not implemented (CUBLASLT_POINTER_MODE_HOST is)", mode);
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
        return CUBLAS_STATUS_SUCCESS;
    }
    default:
        refuse("matmul descriptor attribute %d is not implemented (TRANSA, TRANSB, EPILOGUE, BIAS_POINTER, "
               "BIAS_DATA_TYPE, BIAS_BATCH_STRIDE, EPILOGUE_AUX_POINTER, _LD, _BATCH_STRIDE, _DATA_TYPE, POINTER_MODE, "
               "A_SCALE_POINTER, B_SCALE_POINTER are)", (int)attr);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
    if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
    *pref = (cublasLtMatmulPreference_t) new Pref();
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    Pref* p = checked<Pref>(pref, PREF_MAGIC, "cublasLtMatmulPreferenceDestroy: the preference");
    if (!p) return CUBLAS_STATUS_INVALID_VALUE;
    p->magic = 0;
    delete p;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t size) {
    Pref* p = checked<Pref>(pref, PREF_MAGIC, "cublasLtMatmulPreferenceSetAttribute: the preference");
    if (!p || !buf) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
        if (!check_size(size, 8, "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES")) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&p->max_workspace, buf, 8);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK: {
        // the stand-in never splits k (scheme NONE), which every mask admits
        if (!check_size(size, 4, "CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK")) return CUBLAS_STATUS_INVALID_VALUE;
        uint32_t mask = (uint32_t)read_i32(buf);
        if (mask & ~(uint32_t)CUBLASLT_REDUCTION_SCHEME_MASK) {
            refuse("reduction scheme mask 0x%x has bits outside CUBLASLT_REDUCTION_SCHEME_MASK", mask);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: {
        if (!check_size(size, 4, "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES")) return CUBLAS_STATUS_INVALID_VALUE;
        uint32_t a = (uint32_t)read_i32(buf);
        if (a == 0 || (a & (a - 1)) != 0) {
            refuse("minimum alignment %u is not a power of two", a);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
        p->align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES] = a;
        return CUBLAS_STATUS_SUCCESS;
    }
    default:
        refuse("matmul preference attribute %d is not implemented (MAX_WORKSPACE_BYTES, REDUCTION_SCHEME_MASK, "
               "MIN_ALIGNMENT_{A,B,C,D}_BYTES are)", (int)attr);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}

// One algorithm for every problem the stand-in implements: no workspace, no split-K.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
    if (!checked<cublasLtContext>(handle, LT_HANDLE_MAGIC, "cublasLtMatmulAlgoGetHeuristic: the handle"))
        return CUBLAS_STATUS_NOT_INITIALIZED;
    Desc* dd = checked<Desc>(desc, DESC_MAGIC, "cublasLtMatmulAlgoGetHeuristic: the matmul descriptor");
    Layout* la = checked<Layout>(a, LAYOUT_MAGIC, "cublasLtMatmulAlgoGetHeuristic: layout A");
    Layout* lb = checked<Layout>(b, LAYOUT_MAGIC, "cublasLtMatmulAlgoGetHeuristic: layout B");
    Layout* lc = checked<Layout>(c, LAYOUT_MAGIC, "cublasLtMatmulAlgoGetHeuristic: layout C");
    Layout* ld = checked<Layout>(d, LAYOUT_MAGIC, "cublasLtMatmulAlgoGetHeuristic: layout D");
    Pref* p = checked<Pref>(pref, PREF_MAGIC, "cublasLtMatmulAlgoGetHeuristic: the preference");
    if (!dd || !la || !lb || !lc || !ld || !p || !results || !returned) return CUBLAS_STATUS_INVALID_VALUE;
    if (requested <= 0) {
        refuse("cublasLtMatmulAlgoGetHeuristic: requestedAlgoCount %d must be positive", requested);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    Problem pr;
    cublasStatus_t s = check_problem(dd, la, lb, lc, ld, &pr);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    memset(&results[0], 0, sizeof(results[0]));
    results[0].algo.data[ALGO_DATA_MAGIC] = ALGO_MAGIC;
    for (int x = 0; x < 4; x++) results[0].algo.data[ALGO_DATA_ALIGN + x] = p->align[x];
    results[0].algo.data[ALGO_DATA_ALIGN_BIAS] = pointer_alignment(dd->bias);
    results[0].algo.data[ALGO_DATA_ALIGN_AUX] = pointer_alignment(dd->aux);
    results[0].workspaceSize = 0;
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t adesc, const void* B, cublasLtMatrixLayout_t bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t cdesc, void* D,
                              cublasLtMatrixLayout_t ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
    if (!checked<cublasLtContext>(handle, LT_HANDLE_MAGIC, "cublasLtMatmul: the handle"))
        return CUBLAS_STATUS_NOT_INITIALIZED;
    Desc* d = checked<Desc>(desc, DESC_MAGIC, "cublasLtMatmul: the matmul descriptor");
    Layout* la = checked<Layout>(adesc, LAYOUT_MAGIC, "cublasLtMatmul: layout A");
    Layout* lb = checked<Layout>(bdesc, LAYOUT_MAGIC, "cublasLtMatmul: layout B");
    Layout* lc = checked<Layout>(cdesc, LAYOUT_MAGIC, "cublasLtMatmul: layout C");
    Layout* ld = checked<Layout>(ddesc, LAYOUT_MAGIC, "cublasLtMatmul: layout D");
    if (!d || !la || !lb || !lc || !ld || !alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
    Problem pr;
    cublasStatus_t s = check_problem(d, la, lb, lc, ld, &pr);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    const Epilogue& ep = pr.ep;
    float al = *(const float*)alpha, be = *(const float*)beta;
    if ((ep.bias || ep.bgrad_d || ep.bgrad_a || ep.bgrad_b) && !d->bias) {
        refuse("%s needs CUBLASLT_MATMUL_DESC_BIAS_POINTER", epilogue_name(d->epilogue));
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if ((ep.aux_out || ep.dgelu) && !d->aux) {
        refuse("%s needs CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER", epilogue_name(d->epilogue));
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if ((!A && pr.k > 0) || (!B && pr.k > 0) || (!C && be != 0.0f) || !D) {
        refuse("cublasLtMatmul: a null matrix pointer");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    // An algorithm from the heuristic may rely on the alignment its preference promised (256 bytes
    // unless told otherwise), for every matrix of the batch.
    if (algo) {
        if (algo->data[ALGO_DATA_MAGIC] != ALGO_MAGIC) {
            refuse("cublasLtMatmul: the algorithm did not come from cublasLtMatmulAlgoGetHeuristic");
            return CUBLAS_STATUS_INVALID_VALUE;
        }
        const void* ptrs[4] = {A, B, beta != nullptr && be != 0.0f ? C : nullptr, D};
        const Layout* ls[4] = {la, lb, lc, ld};
        for (int x = 0; x < 4; x++) {
            uint64_t want = algo->data[ALGO_DATA_ALIGN + x];
            for (int bi = 0; ptrs[x] && bi < pr.batch; bi++) {
                uintptr_t addr = (uintptr_t)batch_offset(ptrs[x], bi, ls[x]->batch_stride, ls[x]->type);
                if (addr % want != 0) {
                    refuse("cublasLtMatmul: matrix %c%s is at %p, not %llu-byte aligned as the preference given to the "
                           "heuristic promised (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%c_BYTES)", "ABCD"[x],
                           pr.batch > 1 ? " of some batch" : "", (void*)addr, (unsigned long long)want, "ABCD"[x]);
                    return CUBLAS_STATUS_INVALID_VALUE;
                }
            }
        }
        const void* eptr[2] = {(ep.bias || ep.bgrad_d || ep.bgrad_a || ep.bgrad_b) ? d->bias : nullptr,
                               (ep.aux_out || ep.dgelu) ? d->aux : nullptr};
        const char* ename[2] = {"CUBLASLT_MATMUL_DESC_BIAS_POINTER", "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER"};
        for (int x = 0; x < 2; x++) {
            uint64_t want = algo->data[x == 0 ? ALGO_DATA_ALIGN_BIAS : ALGO_DATA_ALIGN_AUX];
            if (eptr[x] && pointer_alignment(eptr[x]) < want) {
                refuse("cublasLtMatmul: %s is %p, %llu-byte aligned, less than the %llu bytes of the pointer the "
                       "descriptor held when the heuristic chose the algorithm (the heuristic reads the pointer's "
                       "value for its alignment): ask it with a pointer no more aligned than every one you will pass",
                       ename[x], eptr[x], (unsigned long long)pointer_alignment(eptr[x]), (unsigned long long)want);
                return CUBLAS_STATUS_INVALID_VALUE;
            }
        }
    }
    (void)workspace, (void)workspace_bytes;  // no workspace needed

    // Runs now, or when a graph replays it (stream capture): with the descriptors, layouts and alpha,
    // beta as they are at this call, as the library keeps them (the caller may destroy the descriptors
    // right after), and the matrices as they are when it runs.
    Desc dv = *d;
    Layout lav = *la, lbv = *lb, lcv = *lc, ldv = *ld;
    emu::stream_work(stream, "cublasLtMatmul", cudaGraphNodeTypeKernel, [=]() {
        const Desc* d = &dv;
        const Layout *la = &lav, *lb = &lbv, *lc = &lcv, *ld = &ldv;
        const Epilogue& ep = pr.ep;
        int m = pr.m, n = pr.n, k = pr.k;
        bool ta = d->trans_a == CUBLAS_OP_T, tb = d->trans_b == CUBLAS_OP_T;
        std::vector<float> acc((size_t)m * n), pa, pb, rowsum(m);
        // fp8's dequantizing scales, read as the matmul runs (a graph replay reads the current ones)
        float sab = (d->a_scale ? *d->a_scale : 1.0f) * (d->b_scale ? *d->b_scale : 1.0f);
        for (int bi = 0; bi < pr.batch; bi++) {
            const char* ab = batch_offset(A, bi, la->batch_stride, la->type);
            const char* bb = batch_offset(B, bi, lb->batch_stride, lb->type);
            const char* cb = batch_offset(C, bi, lc->batch_stride, lc->type);
            char* db = (char*)batch_offset(D, bi, ld->batch_stride, ld->type);
            char* bias = (char*)batch_offset(d->bias, bi, d->bias_batch_stride, pr.bias_type);
            char* aux = (char*)batch_offset(d->aux, bi, d->aux_batch_stride, pr.aux_type);
            gemm_fp32(acc.data(), m, n, k, operand(ab, la->type, la->ld, ta), operand(bb, lb->type, lb->ld, tb), &pa, &pb);
            // pa holds op(A)'s rows, pb op(B)'s columns: the BGRADA / BGRADB sums run over them in k order
            if (ep.bgrad_a || ep.bgrad_b) {
                int len = ep.bgrad_a ? m : n;
                const std::vector<float>& src = ep.bgrad_a ? pa : pb;
                for (int r = 0; r < len; r++) {
                    float sum = 0.0f;
                    for (int p = 0; p < k; p++) sum += src[(size_t)r * k + p];
                    store(bias, pr.bias_type, r, sum);
                }
            }
            std::fill(rowsum.begin(), rowsum.end(), 0.0f);
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    float v = al * sab * acc[(size_t)j * m + i];
                    if (be != 0.0f) v += be * load(cb, lc->type, (size_t)i + (size_t)j * lc->ld);
                    if (ep.bias) v += load(bias, pr.bias_type, i);
                    size_t ai = (size_t)i + (size_t)j * d->aux_ld;
                    if (ep.aux_out) store(aux, pr.aux_type, ai, v);
                    if (ep.gelu) v = gelu(v);
                    if (ep.dgelu) v *= gelu_grad(load(aux, pr.aux_type, ai));
                    if (ep.bgrad_d) rowsum[i] += v;
                    store(db, ld->type, (size_t)i + (size_t)j * ld->ld, v);
                }
            if (ep.bgrad_d)
                for (int i = 0; i < m; i++) store(bias, pr.bias_type, i, rowsum[i]);
        }
    });
    return CUBLAS_STATUS_SUCCESS;
}

// ================================================================ cuBLAS

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    *handle = new cublasContext{HANDLE_MAGIC, nullptr, nullptr, 0};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
    if (!checked<cublasContext>(handle, HANDLE_MAGIC, "cublasDestroy: the handle")) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->magic = 0;
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

// The stream is recorded and otherwise ignored: under the emulator every stream runs at the call.
// As in the real library, setting the stream drops a workspace set before it.
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
    if (!checked<cublasContext>(handle, HANDLE_MAGIC, "cublasSetStream: the handle")) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->stream = stream;
    handle->workspace = nullptr;
    handle->workspace_bytes = 0;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
    if (!checked<cublasContext>(handle, HANDLE_MAGIC, "cublasSetWorkspace: the handle"))
        return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->workspace = workspace;
    handle->workspace_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType at, int lda, const void* B,
                            cudaDataType bt, int ldb, const void* beta, void* C, cudaDataType ct, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    return gemm_ex(handle, transa, transb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta, C, ct, ldc, 0, 1,
                   compute, algo);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType at,
                                          int lda, long long sa, const void* B, cudaDataType bt, int ldb,
                                          long long sb, const void* beta, void* C, cudaDataType ct, int ldc,
                                          long long sc, int batch, cublasComputeType_t compute,
                                          cublasGemmAlgo_t algo) {
    return gemm_ex(handle, transa, transb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc, batch,
                   compute, algo);
}

const char* cublasGetStatusString(cublasStatus_t status) {
    switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cuBLAS status";
    }
}

}  // extern "C"
