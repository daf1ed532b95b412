// fp8_check.cu — fp8 below the trainer, for test/test_fp8.py: the quantize kernel and delayed
// scaling of llmc/kernels/fp8.cuh, and what cuBLASLt (or, emulated, its stand-in) does with fp8.
// It prints; the Python test judges against its own model of the OCP FP8 formats.
//
//   fp8_check quantize e4m3|e5m2 auto|SCALE IN.f32 OUT.u8 [ROWS COLS]
//       quantizes IN's values (bf16-exact floats; ROWS x COLS: written transposed) with their own
//       scale (auto: step 1's calibration) or SCALE; prints "amax A scale S", writes the codes
//   fp8_check history H A1 A2 ...
//       one tensor whose amax is A1, then A2, ... one step each, with an H-step history: prints the
//       scale each step used ("step t scale S"), starting from 1 with no calibration
//   fp8_check decode
//       every code of e4m3 and of e5m2 through an fp8 matmul (x e4m3 1.0, dequantizing scales 0.5
//       and 1): prints "e4m3|e5m2 CODE VALUE"
//   fp8_check refuse
//       the layouts and types Hopper refuses: prints "CASE accepted|refused"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/kernels/fp8.cuh"

static std::vector<float> read_floats(const char* path) {
    FILE* f = fopen(path, "rb");
    if (!f) fail("cannot open %s", path);
    std::vector<float> v;
    float x;
    while (fread(&x, 4, 1, f) == 1) v.push_back(x);
    fclose(f);
    return v;
}

// One layer's state (12 tensors): slot 0 is an e4m3 input, slot 2 an e5m2 gradient.
static void make_state(Fp8Matmuls* f, int history, size_t operand_bytes) {
    float* state;
    uint8_t* ops;
    CUDA_CHECK(cudaMalloc(&state, fp8_state_floats(FP8_LINEARS * FP8_ROLES, history) * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&ops, 2 * operand_bytes));
    fp8_init(f, 1, history, state, ops, ops + operand_bytes, 0);
}

static float read_device_float(const void* p) {
    float x;
    CUDA_CHECK(cudaMemcpy(&x, p, 4, cudaMemcpyDeviceToHost));
    return x;
}

static floatX* upload_bf16(const std::vector<float>& v) {
    std::vector<floatX> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = __float2bfloat16(v[i]);  // exact: the test passes bf16 values
    floatX* d;
    CUDA_CHECK(cudaMalloc(&d, v.size() * sizeof(floatX)));
    CUDA_CHECK(cudaMemcpy(d, h.data(), v.size() * sizeof(floatX), cudaMemcpyHostToDevice));
    return d;
}

static int quantize(int argc, char** argv) {
    if (argc != 6 && argc != 8) fail("usage: fp8_check quantize e4m3|e5m2 auto|SCALE IN.f32 OUT.u8 [ROWS COLS]");
    int slot = strcmp(argv[2], "e5m2") == 0 ? FP8_GRAD : FP8_INPUT;
    std::vector<float> x = read_floats(argv[4]);
    int rows = argc == 8 ? atoi(argv[6]) : 1, cols = argc == 8 ? atoi(argv[7]) : (int)x.size();
    Fp8Matmuls f;
    make_state(&f, 4, x.size());
    if (strcmp(argv[3], "auto") != 0) {  // a given scale, no calibration: saturation shows
        float s = (float)atof(argv[3]), inv = 1.0f / s;
        CUDA_CHECK(cudaMemcpy(f.scale + slot, &s, 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(f.scale_inv + slot, &inv, 4, cudaMemcpyHostToDevice));
        f.calibrating = false;
    }
    floatX* d = upload_bf16(x);
    fp8_quantize(&f, f.a8, d, rows, cols, argc == 8, slot, 0);
    std::vector<uint8_t> q(x.size());
    CUDA_CHECK(cudaMemcpy(q.data(), f.a8, q.size(), cudaMemcpyDeviceToHost));
    FILE* out = fopen(argv[5], "wb");
    fwrite(q.data(), 1, q.size(), out);
    fclose(out);
    unsigned int amax_bits;
    CUDA_CHECK(cudaMemcpy(&amax_bits, f.amax_now + slot, 4, cudaMemcpyDeviceToHost));
    float amax;
    memcpy(&amax, &amax_bits, 4);
    printf("amax %.9g scale %.9g\n", amax, read_device_float(f.scale + slot));
    return 0;
}

static int history(int argc, char** argv) {
    int h = atoi(argv[2]);
    Fp8Matmuls f;
    make_state(&f, h, 16);
    f.calibrating = false;  // delayed scaling alone: step 1 quantizes at scale 1
    for (int t = 3; t < argc; t++) {
        std::vector<float> x(16, 0.0f);
        x[5] = (float)atof(argv[t]);
        floatX* d = upload_bf16(x);
        printf("step %d scale %.9g\n", t - 2, read_device_float(f.scale + FP8_INPUT));
        fp8_quantize(&f, f.a8, d, 1, 16, false, FP8_INPUT, 0);
        fp8_end_step(&f, 0);
        CUDA_CHECK(cudaFree(d));
    }
    return 0;
}

// cublasLtMatmul with fp8.cuh's descriptor but not its TN-only wrapper, so that the refused layouts
// can be asked for: D (m x n, bf16) = sa sb op(A) op(B).
static cublasStatus_t raw_matmul(cublasLtHandle_t lt, bool ta, bool tb, cudaDataType_t at, cudaDataType_t bt, int m, int n,
                                 int k, const void* a, const void* b, floatX* d, const float* sa, const float* sb) {
    cublasLtMatmulDesc_t desc = fp8_matmul_desc(ta, tb, sa, sb);
    cublasLtMatrixLayout_t la, lb, ld;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, at, ta ? k : m, ta ? m : k, ta ? k : m));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, bt, tb ? n : k, tb ? k : n, tb ? n : k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &result, &found);
    if (s == CUBLAS_STATUS_SUCCESS && found == 0) s = CUBLAS_STATUS_NOT_SUPPORTED;
    float alpha = 1.0f, beta = 0.0f;
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmul(lt, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &result.algo, nullptr, 0, 0);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    return s;
}

static int decode_and_refuse(bool decode) {
    cublasLtHandle_t lt;
    CUBLAS_CHECK(cublasLtCreate(&lt));
    const int m = 256, n = 16, k = 16;
    std::vector<uint8_t> a((size_t)m * k, 0), b((size_t)k * n, 0);
    for (int i = 0; i < m; i++) a[(size_t)i * k] = (uint8_t)i;  // A^T stored (m x k) row-major: code i in row i
    b[0] = 0x38;                                                  // e4m3 1.0 at (0, 0)
    uint8_t *da, *db;
    floatX* dd;
    float scales[2] = {0.5f, 1.0f}, *ds;
    CUDA_CHECK(cudaMalloc(&da, a.size()));
    CUDA_CHECK(cudaMalloc(&db, b.size()));
    CUDA_CHECK(cudaMalloc(&dd, (size_t)m * n * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc(&ds, sizeof(scales)));
    CUDA_CHECK(cudaMemcpy(da, a.data(), a.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db, b.data(), b.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(ds, scales, sizeof(scales), cudaMemcpyHostToDevice));
    if (decode) {
        for (cudaDataType_t t : {CUDA_R_8F_E4M3, CUDA_R_8F_E5M2}) {
            CUBLAS_CHECK(raw_matmul(lt, true, false, t, CUDA_R_8F_E4M3, m, n, k, da, db, dd, ds, ds + 1));
            std::vector<floatX> h((size_t)m * n);
            CUDA_CHECK(cudaMemcpy(h.data(), dd, h.size() * sizeof(floatX), cudaMemcpyDeviceToHost));
            for (int i = 0; i < m; i++)  // D(i, 0) = 0.5 * 1 * code i
                printf("%s %d %.17g\n", t == CUDA_R_8F_E4M3 ? "e4m3" : "e5m2", i, __bfloat162float(h[i]));
        }
        return 0;
    }
    struct Case { const char* name; bool ta, tb; cudaDataType_t at, bt; int m, n, k; };
    const Case cases[] = {
        {"TN e4m3 x e4m3 256x16x16", true, false, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, 256, 16, 16},
        {"TN e4m3 x e5m2 256x16x16", true, false, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, 256, 16, 16},
        {"TN e5m2 x e4m3 256x16x16", true, false, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, 256, 16, 16},
        {"NN e4m3 x e4m3 256x16x16", false, false, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, 256, 16, 16},
        {"TT e4m3 x e4m3 16x16x16", true, true, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, 16, 16, 16},
        {"TN e5m2 x e5m2 256x16x16", true, false, CUDA_R_8F_E5M2, CUDA_R_8F_E5M2, 256, 16, 16},
        {"TN e4m3 x e4m3 256x16x8", true, false, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, 256, 16, 8},
        {"TN e4m3 x e4m3 256x8x16", true, false, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, 256, 8, 16},
    };
    for (const Case& c : cases) {
        cublasStatus_t s = raw_matmul(lt, c.ta, c.tb, c.at, c.bt, c.m, c.n, c.k, da, db, dd, ds, ds + 1);
        printf("%s %s\n", c.name, s == CUBLAS_STATUS_SUCCESS ? "accepted" : "refused");
    }
    return 0;
}

int main(int argc, char** argv) {
    std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "quantize") return quantize(argc, argv);
    if (mode == "history" && argc > 3) return history(argc, argv);
    if (mode == "decode" || mode == "refuse") return decode_and_refuse(mode == "decode");
    fail("usage: fp8_check quantize|history|decode|refuse ... (see test/fp8_check.cu)");
}
