// attention_cudnn.cuh — causal attention's fast path: cuDNN 9's fused flash attention (SDPA),
// forward and backward, built through cuDNN's backend ("graph") C API.
//
// What it computes, per batch b and head h (hs = C/NH channels, scale = 1/sqrt(hs)):
//   S = scale * Q K^T,  S[t,u] = -inf for u > t (causal),  P = softmax(S),  O = P V
//   stats[t] = logsumexp of row t of S  (kept for the backward: (B, NH, T) floats)
// backward, with dO given and D[t] = dO[t] . O[t]:
//   P = exp(S - stats),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D) * scale,  dQ = dS K,  dK = dS^T Q
//
// Why fused: the attention matrix is (B, NH, T, T): 600 MB per layer for B=16, NH=12, T=1024 in
// bf16. The fused kernel (flash attention) never writes it: it streams K and V through shared memory
// tile by tile, keeps a running max and sum per row, and writes only O and the stats. The backward
// rebuilds P tile by tile from Q, K and stats. Traffic: Q, K, V, O (and dO, dQ, dK, dV) once each;
// compute bound, on the tensor cores.
//
// How cuDNN is told: we describe the computation as a graph of small operations (two matmuls,
// pointwise ops, reductions, the causal mask as index generation + compare + select), each a
// backend descriptor with tensor descriptors for its inputs and outputs; the intermediate tensors
// are "virtual" (never in memory). cuDNN's heuristics match the pattern to its fused engine and
// return engine configurations; we finalise the first one that is deterministic and fits, as an
// "execution plan", once per shape, and run it with a "variant pack" of device pointers per call.
// The graph mirrors, operation for operation, the one cuDNN's own frontend library builds for SDPA
// (the pattern the fused engine recognises). Q, K, V are read in place from the (B, T, 3C) qkv
// buffer through strides, O written into (B, T, C): no permute kernels.
// Why not one node: cuDNN 9.13+ also has single-operation SDPA descriptors
// (CUDNN_BACKEND_OPERATION_SDPA_FWD/BWD_DESCRIPTOR), but before cuDNN 9.21 they cannot express a
// causal mask (that takes their subgraph attribute), and the frontend itself builds this composite
// graph for causal attention on every cuDNN 9 up to there. So we build it too, node by node.
//
// Determinism: engines that declare CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC are skipped, and the
// backward is built in the form that writes dQ directly (no fp32 dQ accumulated with atomics).
// If no engine accepts the graph, the error says so and suggests --attention simple.
#pragma once

#include <cudnn.h>
#include <string>
#include <vector>
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/utils.h"

// A cuDNN call that fails is cuDNN refusing the graph (no engine for this GPU, shape or version) or
// failing to run it. It is thrown, not fatal at once: at start-up the trainer catches it and falls
// back to the simple attention (see cudnn_attention_setup); later, the catch turns it into a failure.
struct CudnnRefusal {
    std::string why;
};
inline void cudnn_check(cudnnStatus_t status, const char* call, const char* file, int line) {
    if (status == CUDNN_STATUS_SUCCESS) return;
    char detail[1024];
    cudnnGetLastErrorString(detail, sizeof(detail));
    throw CudnnRefusal{strprintf("%s at %s:%d: %s%s%s", call, file, line, cudnnGetErrorString(status),
                                 detail[0] ? ": " : "", detail)};
}
#define CUDNN_CHECK(call) cudnn_check((call), #call, __FILE__, __LINE__)

constexpr cudnnDataType_t CUDNN_FLOATX = FLOATX_IS_FP32 ? CUDNN_DATA_FLOAT : FLOATX_IS_FP16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;

// The unique ids of the tensors that live in memory (the variant pack maps them to pointers).
enum CudnnAttentionUid : int64_t {
    UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE, UID_NEG_INF, UID_DO, UID_DQ, UID_DK, UID_DV,
    UID_SOFTMAX_SUM, UID_ONE, UID_FIRST_VIRTUAL = 100
};

// Builds one graph: owns every descriptor it creates and destroys them all at the end.
struct CudnnGraph {
    std::vector<cudnnBackendDescriptor_t> owned;
    std::vector<cudnnBackendDescriptor_t> ops;
    int64_t next_virtual_uid = UID_FIRST_VIRTUAL;

    cudnnBackendDescriptor_t create(cudnnBackendDescriptorType_t type) {
        cudnnBackendDescriptor_t d;
        CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &d));
        owned.push_back(d);
        return d;
    }
    ~CudnnGraph() {
        for (auto it = owned.rbegin(); it != owned.rend(); ++it) cudnnBackendDestroyDescriptor(*it);
    }
};

static void set_attr(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                     int64_t count, const void* value) {
    CUDNN_CHECK(cudnnBackendSetAttribute(d, name, type, count, value));
}

struct Dims4 { int64_t d[4]; };

// A tensor descriptor. uid < 0: a new virtual tensor. by_value: a host scalar passed at execution.
static cudnnBackendDescriptor_t cudnn_tensor(CudnnGraph* g, int64_t uid, Dims4 dims, Dims4 strides,
                                             cudnnDataType_t type, bool by_value = false) {
    bool is_virtual = uid < 0;
    if (is_virtual) uid = g->next_virtual_uid++;
    cudnnBackendDescriptor_t t = g->create(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    int64_t alignment = 16;
    set_attr(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    set_attr(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    set_attr(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    set_attr(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.d);
    set_attr(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.d);
    set_attr(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) set_attr(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    CUDNN_CHECK(cudnnBackendFinalize(t));
    return t;
}

static cudnnBackendDescriptor_t cudnn_scalar(CudnnGraph* g, int64_t uid) {
    return cudnn_tensor(g, uid, {{1, 1, 1, 1}}, {{1, 1, 1, 1}}, CUDNN_DATA_FLOAT, true);
}

// y = mode(x [, b [, t]]); axis >= 0 only for GEN_INDEX.
static void cudnn_pointwise(CudnnGraph* g, cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x,
                            cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                            cudnnDataType_t math = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = g->create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set_attr(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    set_attr(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
    if (axis >= 0) set_attr(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    CUDNN_CHECK(cudnnBackendFinalize(pw));
    cudnnBackendDescriptor_t op = g->create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set_attr(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
    set_attr(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    if (b) set_attr(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t) set_attr(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    set_attr(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    CUDNN_CHECK(cudnnBackendFinalize(op));
    g->ops.push_back(op);
}

// c = a b (batched over the first two dimensions), fp32 accumulation
static void cudnn_matmul(CudnnGraph* g, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    cudnnBackendDescriptor_t mm = g->create(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    set_attr(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    CUDNN_CHECK(cudnnBackendFinalize(mm));
    cudnnBackendDescriptor_t op = g->create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    set_attr(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    set_attr(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    set_attr(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    set_attr(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm);
    CUDNN_CHECK(cudnnBackendFinalize(op));
    g->ops.push_back(op);
}

// y = reduce(x) over the dimensions where y has size 1
static void cudnn_reduction(CudnnGraph* g, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t rd = g->create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    set_attr(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    set_attr(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    CUDNN_CHECK(cudnnBackendFinalize(rd));
    cudnnBackendDescriptor_t op = g->create(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    set_attr(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    set_attr(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    set_attr(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd);
    CUDNN_CHECK(cudnnBackendFinalize(op));
    g->ops.push_back(op);
}

// y = x seen with other dimensions/strides (a transpose, for the matmuls)
static void cudnn_reshape(CudnnGraph* g, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t op = g->create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    set_attr(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    set_attr(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    CUDNN_CHECK(cudnnBackendFinalize(op));
    g->ops.push_back(op);
}

// The causal mask: keep S[t,u] where t >= u (row index >= column index), -inf elsewhere.
static cudnnBackendDescriptor_t cudnn_causal_mask(CudnnGraph* g, cudnnBackendDescriptor_t s, Dims4 dims, Dims4 strides,
                                                  cudnnBackendDescriptor_t neg_inf) {
    cudnnBackendDescriptor_t row = cudnn_tensor(g, -1, dims, strides, CUDNN_DATA_INT32);
    cudnnBackendDescriptor_t col = cudnn_tensor(g, -1, dims, strides, CUDNN_DATA_INT32);
    cudnnBackendDescriptor_t keep = cudnn_tensor(g, -1, dims, strides, CUDNN_DATA_BOOLEAN);
    cudnnBackendDescriptor_t masked = cudnn_tensor(g, -1, dims, strides, CUDNN_DATA_FLOAT);
    cudnn_pointwise(g, CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
    cudnn_pointwise(g, CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
    cudnn_pointwise(g, CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
    cudnn_pointwise(g, CUDNN_POINTWISE_BINARY_SELECT, s, neg_inf, keep, masked);
    return masked;
}

// The value the causal mask writes where u > t: what cuDNN's frontend passes, -inf from cuDNN 9.10
// on and the lowest finite float before ("older cuDNN prefers lowest for the softmax mask"), decided
// by the library actually loaded, not by the headers we were compiled with.
inline float cudnn_mask_value() {
    return cudnnGetVersion() < 91000 ? -3.402823466e38f : -INFINITY;
}

// Known-bad cuDNN versions for this graph, as cuDNN's frontend refuses them: "" if `version` (as
// cudnnGetVersion() returns it, 91900 = 9.19.0) can run attention over T positions, else why not.
inline std::string cudnn_attention_version_problem(size_t version, int T) {
    if (version < 90000) return strprintf("cuDNN %zu is older than 9.0, the first with this fused attention", version);
    if (version == 91000 || version == 91001) return "cuDNN 9.10.0 and 9.10.1 have known bugs in the attention backward";
    // up to 9.15 the backward was wrong for sequence lengths that are not a multiple of 128 unless a
    // padding mask was given (the frontend adds one as a workaround; we ask for T instead)
    if (version <= 91500 && T % 128 != 0)
        return strprintf("cuDNN %zu's attention backward needs T to be a multiple of 128 (T=%d); cuDNN 9.16 or later does not", version, T);
    return "";
}

// A finalised plan and what running it needs.
struct CudnnPlan {
    cudnnBackendDescriptor_t plan = nullptr;
    std::vector<cudnnBackendDescriptor_t> graph;  // the descriptors the plan was built from, kept alive with it
    int64_t workspace_bytes = 0;
    int B = 0, T = 0;
    bool backward = false;
};

// Heuristics -> the first deterministic engine configuration that finalises. Returns nullptr plan
// (and a reason) if none does.
static CudnnPlan cudnn_make_plan(cudnnHandle_t handle, CudnnGraph* g, std::string* why) {
    cudnnBackendDescriptor_t graph = g->create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set_attr(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, (int64_t)g->ops.size(), g->ops.data());
    set_attr(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    CUDNN_CHECK(cudnnBackendFinalize(graph));

    cudnnBackendDescriptor_t heur = g->create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    set_attr(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
    set_attr(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    CUDNN_CHECK(cudnnBackendFinalize(heur));
    int64_t count = 0;
    CUDNN_CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr));
    std::vector<cudnnBackendDescriptor_t> configs((size_t)count);
    for (auto& c : configs) c = g->create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    int64_t returned = 0;
    if (count > 0) {
        CUDNN_CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                             &returned, configs.data()));
    }
    *why = strprintf("cuDNN's heuristics offered %lld engine configuration%s", (long long)returned, returned == 1 ? "" : "s");
    int skipped_nondeterministic = 0;
    for (int64_t i = 0; i < returned; i++) {
        cudnnBackendDescriptor_t engine = g->create(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
        int64_t got = 0;
        CUDNN_CHECK(cudnnBackendGetAttribute(configs[i], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got, &engine));
        cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
        int64_t note_count = 0;
        CUDNN_CHECK(cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                             CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &note_count, notes));
        bool deterministic = true;
        for (int64_t n = 0; n < note_count; n++) deterministic &= notes[n] != CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
        if (!deterministic) {
            skipped_nondeterministic++;
            continue;
        }
        cudnnBackendDescriptor_t plan;
        CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan));
        set_attr(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
        set_attr(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &configs[i]);
        if (cudnnBackendFinalize(plan) != CUDNN_STATUS_SUCCESS) {  // this engine does not take the graph: next
            cudnnBackendDestroyDescriptor(plan);
            continue;
        }
        CudnnPlan result;
        result.plan = plan;
        CUDNN_CHECK(cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got,
                                             &result.workspace_bytes));
        return result;
    }
    *why += strprintf(", %d skipped as non-deterministic, none of the others accepted the graph", skipped_nondeterministic);
    return CudnnPlan{};
}

// The layouts: Q, K, V inside qkv (B, T, 3, NH, hs); O and dO in (B, T, NH, hs); stats (B, NH, T, 1).
struct SdpaLayout {
    Dims4 qkv_dims, qkv_strides;   // (B, NH, T, hs) inside qkv
    Dims4 kt_dims, kt_strides;     // K (or V) transposed: (B, NH, hs, T)
    Dims4 o_dims, o_strides;       // (B, NH, T, hs) inside (B, T, C)
    Dims4 s_dims, s_strides;       // the (B, NH, T, T) scores (virtual)
    Dims4 st_dims, st_strides;     // the same, transposed (virtual)
    Dims4 row_dims, row_strides;   // (B, NH, T, 1)
    Dims4 hd_dims, hd_strides;     // dO * O, (B, NH, T, hs) (virtual)
};

static SdpaLayout sdpa_layout(int B, int T, int C, int NH) {
    int64_t hs = C / NH, b = B, t = T, h = NH, c = C;
    SdpaLayout l;
    l.qkv_dims = {{b, h, t, hs}};
    l.qkv_strides = {{t * 3 * c, hs, 3 * c, 1}};
    l.kt_dims = {{b, h, hs, t}};
    l.kt_strides = {{t * 3 * c, hs, 1, 3 * c}};
    l.o_dims = {{b, h, t, hs}};
    l.o_strides = {{t * c, hs, c, 1}};
    l.s_dims = {{b, h, t, t}};
    l.s_strides = {{h * t * t, t * t, t, 1}};
    l.st_dims = {{b, h, t, t}};
    l.st_strides = {{h * t * t, t * t, 1, t}};
    l.row_dims = {{b, h, t, 1}};
    l.row_strides = {{h * t, t, 1, 1}};
    // A virtual tensor's strides address no memory, but they are part of the graph the engines'
    // pattern matcher reads. The frontend (the graph cuDNN is tested with) gives dO * O these:
    // the (B, T, NH, hs) interleaving of the tensors it comes from. We copy them, to be that graph.
    l.hd_dims = {{b, h, t, hs}};
    l.hd_strides = {{h * t * hs, t * hs, h * hs, 1}};
    return l;
}

static CudnnPlan cudnn_build_forward(cudnnHandle_t handle, int B, int T, int C, int NH, std::string* why) {
    CudnnGraph g;
    SdpaLayout l = sdpa_layout(B, T, C, NH);
    auto q = cudnn_tensor(&g, UID_Q, l.qkv_dims, l.qkv_strides, CUDNN_FLOATX);
    auto kt = cudnn_tensor(&g, UID_K, l.kt_dims, l.kt_strides, CUDNN_FLOATX);
    auto v = cudnn_tensor(&g, UID_V, l.qkv_dims, l.qkv_strides, CUDNN_FLOATX);
    auto o = cudnn_tensor(&g, UID_O, l.o_dims, l.o_strides, CUDNN_FLOATX);
    auto stats = cudnn_tensor(&g, UID_STATS, l.row_dims, l.row_strides, CUDNN_DATA_FLOAT);
    auto scale = cudnn_scalar(&g, UID_SCALE);
    auto neg_inf = cudnn_scalar(&g, UID_NEG_INF);
    auto virt = [&](Dims4 d, Dims4 s, cudnnDataType_t type = CUDNN_DATA_FLOAT) { return cudnn_tensor(&g, -1, d, s, type); };

    auto s = virt(l.s_dims, l.s_strides);
    cudnn_matmul(&g, q, kt, s);                                                         // S = Q K^T
    auto s_scaled = virt(l.s_dims, l.s_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_MUL, s, scale, nullptr, s_scaled);              // * 1/sqrt(hs)
    auto s_masked = cudnn_causal_mask(&g, s_scaled, l.s_dims, l.s_strides, neg_inf);    // causal
    auto row_max = virt(l.row_dims, l.row_strides);
    cudnn_reduction(&g, CUDNN_REDUCE_TENSOR_MAX, s_masked, row_max);                    // softmax:
    auto shifted = virt(l.s_dims, l.s_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_SUB, s_masked, row_max, nullptr, shifted);      //   S - max
    auto e = virt(l.s_dims, l.s_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_EXP, shifted, nullptr, nullptr, e);             //   exp
    auto row_sum = virt(l.row_dims, l.row_strides);
    cudnn_reduction(&g, CUDNN_REDUCE_TENSOR_ADD, e, row_sum);                           //   sum
    auto log_sum = virt(l.row_dims, l.row_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_LOG, row_sum, nullptr, nullptr, log_sum);
    cudnn_pointwise(&g, CUDNN_POINTWISE_ADD, row_max, log_sum, nullptr, stats);         //   stats = logsumexp
    auto p = virt(l.s_dims, l.s_strides, CUDNN_FLOATX);
    cudnn_pointwise(&g, CUDNN_POINTWISE_DIV, e, row_sum, nullptr, p);                   //   P
    cudnn_matmul(&g, p, v, o);                                                          // O = P V

    CudnnPlan plan = cudnn_make_plan(handle, &g, why);
    plan.B = B, plan.T = T, plan.backward = false;
    plan.graph.swap(g.owned);  // the plan may refer to its engine config and graph: destroy them with it
    return plan;
}

static CudnnPlan cudnn_build_backward(cudnnHandle_t handle, int B, int T, int C, int NH, std::string* why) {
    CudnnGraph g;
    SdpaLayout l = sdpa_layout(B, T, C, NH);
    auto q = cudnn_tensor(&g, UID_Q, l.qkv_dims, l.qkv_strides, CUDNN_FLOATX);
    auto kt = cudnn_tensor(&g, UID_K, l.kt_dims, l.kt_strides, CUDNN_FLOATX);
    auto vt = cudnn_tensor(&g, UID_V, l.kt_dims, l.kt_strides, CUDNN_FLOATX);
    auto o = cudnn_tensor(&g, UID_O, l.o_dims, l.o_strides, CUDNN_FLOATX);
    auto d_o = cudnn_tensor(&g, UID_DO, l.o_dims, l.o_strides, CUDNN_FLOATX);
    auto stats = cudnn_tensor(&g, UID_STATS, l.row_dims, l.row_strides, CUDNN_DATA_FLOAT);
    auto dq = cudnn_tensor(&g, UID_DQ, l.qkv_dims, l.qkv_strides, CUDNN_FLOATX);
    auto dk = cudnn_tensor(&g, UID_DK, l.qkv_dims, l.qkv_strides, CUDNN_FLOATX);
    auto dv = cudnn_tensor(&g, UID_DV, l.qkv_dims, l.qkv_strides, CUDNN_FLOATX);
    auto softmax_sum = cudnn_tensor(&g, UID_SOFTMAX_SUM, l.row_dims, l.row_strides, CUDNN_DATA_FLOAT);
    auto scale = cudnn_scalar(&g, UID_SCALE);
    auto neg_inf = cudnn_scalar(&g, UID_NEG_INF);
    auto one = cudnn_scalar(&g, UID_ONE);
    auto virt = [&](Dims4 d, Dims4 s, cudnnDataType_t type = CUDNN_DATA_FLOAT) { return cudnn_tensor(&g, -1, d, s, type); };

    // D = rowsum(dO * O), kept in memory (softmax_sum) for the fused kernel
    auto do_o = virt(l.hd_dims, l.hd_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_MUL, d_o, o, nullptr, do_o);
    auto d_row = virt(l.row_dims, l.row_strides);
    cudnn_reduction(&g, CUDNN_REDUCE_TENSOR_ADD, do_o, d_row);
    cudnn_pointwise(&g, CUDNN_POINTWISE_MUL, d_row, one, nullptr, softmax_sum);
    // P = exp(scale * Q K^T - stats), causal
    auto s = virt(l.s_dims, l.s_strides);
    cudnn_matmul(&g, q, kt, s);
    auto s_scaled = virt(l.s_dims, l.s_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_MUL, s, scale, nullptr, s_scaled);
    auto s_shifted = virt(l.s_dims, l.s_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_SUB, s_scaled, stats, nullptr, s_shifted);
    auto s_masked = cudnn_causal_mask(&g, s_shifted, l.s_dims, l.s_strides, neg_inf);
    auto p = virt(l.s_dims, l.s_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_EXP, s_masked, nullptr, nullptr, p);
    // dV = P^T dO
    auto pt = virt(l.st_dims, l.st_strides, CUDNN_FLOATX);
    cudnn_reshape(&g, p, pt);
    cudnn_matmul(&g, pt, d_o, dv);
    // dS = P * (dO V^T - D) * scale
    auto dp = virt(l.s_dims, l.s_strides);
    cudnn_matmul(&g, d_o, vt, dp);
    auto dp_shifted = virt(l.s_dims, l.s_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_SUB, dp, softmax_sum, nullptr, dp_shifted);
    auto ds_unscaled = virt(l.s_dims, l.s_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_MUL, dp_shifted, p, nullptr, ds_unscaled);
    auto ds = virt(l.s_dims, l.s_strides);
    cudnn_pointwise(&g, CUDNN_POINTWISE_MUL, ds_unscaled, scale, nullptr, ds);
    // dK = dS^T Q
    auto dst = virt(l.st_dims, l.st_strides, CUDNN_FLOATX);
    cudnn_reshape(&g, ds, dst);
    cudnn_matmul(&g, dst, q, dk);
    // dQ = dS K, written directly (the deterministic form: no fp32 dQ accumulator)
    Dims4 k_dims = {{l.kt_dims.d[0], l.kt_dims.d[1], l.kt_dims.d[3], l.kt_dims.d[2]}};
    Dims4 k_strides = {{l.kt_strides.d[0], l.kt_strides.d[1], l.kt_strides.d[3], l.kt_strides.d[2]}};
    auto k = virt(k_dims, k_strides, CUDNN_FLOATX);
    cudnn_reshape(&g, kt, k);
    cudnn_matmul(&g, ds, k, dq);

    CudnnPlan plan = cudnn_make_plan(handle, &g, why);
    plan.B = B, plan.T = T, plan.backward = true;
    plan.graph.swap(g.owned);  // the plan may refer to its engine config and graph: destroy them with it
    return plan;
}

// The cuDNN attention state: the handle, the plans (one forward and one backward per shape), and the
// buffers from the trainer's table.
struct CudnnAttention {
    cudnnHandle_t handle = nullptr;
    std::vector<CudnnPlan> plans;
    void* workspace = nullptr;
    size_t workspace_bytes = 0;
    float* softmax_sum = nullptr;  // (B, NH, T) floats
};

inline void cudnn_attention_destroy(CudnnAttention* a) {
    for (CudnnPlan& p : a->plans) {
        cudnnBackendDestroyDescriptor(p.plan);
        for (auto it = p.graph.rbegin(); it != p.graph.rend(); ++it) cudnnBackendDestroyDescriptor(*it);
    }
    a->plans.clear();
    if (a->handle) cudnnDestroy(a->handle);
    a->handle = nullptr;
}

// Builds (once) the plan for this shape; nullptr, with the reason, if cuDNN cannot run it.
inline const CudnnPlan* cudnn_attention_try_plan(CudnnAttention* a, bool backward, int B, int T, int C, int NH,
                                                 std::string* why) {
    for (const CudnnPlan& p : a->plans)
        if (p.backward == backward && p.B == B && p.T == T) return &p;
    *why = cudnn_attention_version_problem(cudnnGetVersion(), T);
    if (!why->empty()) return nullptr;
    CudnnPlan plan;
    try {
        plan = backward ? cudnn_build_backward(a->handle, B, T, C, NH, why) : cudnn_build_forward(a->handle, B, T, C, NH, why);
    } catch (const CudnnRefusal& r) {
        *why = r.why;
    }
    if (!plan.plan) {
        *why = strprintf("no engine for the attention %s at B=%d T=%d C=%d heads=%d (head size %d): %s. It needs a bf16 "
                         "build, head size a multiple of 8 (at most 128) and a recent GPU (sm_80+)",
                         backward ? "backward" : "forward", B, T, C, NH, C / NH, why->c_str());
        return nullptr;
    }
    a->plans.push_back(plan);
    return &a->plans.back();
}

inline const CudnnPlan& cudnn_attention_plan(CudnnAttention* a, bool backward, int B, int T, int C, int NH) {
    std::string why;
    const CudnnPlan* plan = cudnn_attention_try_plan(a, backward, B, T, C, NH, &why);
    if (!plan) fail("cuDNN attention: %s; try --attention simple", why.c_str());
    return *plan;
}

// Start-up: the handle and both plans for (B, T), and the workspace they need (the trainer asks
// before it allocates, see gpu_buffers.h). False, with the reason and nothing left behind, if cuDNN
// is missing or refuses: the trainer then uses the simple attention.
inline bool cudnn_attention_setup(CudnnAttention* a, int B, int T, int C, int NH, size_t* workspace_bytes,
                                  std::string* why) {
    cudnnStatus_t status = cudnnCreate(&a->handle);
    if (status != CUDNN_STATUS_SUCCESS) {
        *why = strprintf("cudnnCreate: %s", cudnnGetErrorString(status));
        a->handle = nullptr;
        return false;
    }
    const CudnnPlan* fwd = cudnn_attention_try_plan(a, false, B, T, C, NH, why);
    const CudnnPlan* bwd = fwd ? cudnn_attention_try_plan(a, true, B, T, C, NH, why) : nullptr;
    if (!bwd) {
        cudnn_attention_destroy(a);
        return false;
    }
    *workspace_bytes = (size_t)std::max(a->plans[0].workspace_bytes, a->plans[1].workspace_bytes);
    return true;
}

static void cudnn_execute(CudnnAttention* a, const CudnnPlan& plan, int n, const int64_t* uids, void* const* pointers,
                          cudaStream_t stream) {
    if ((size_t)plan.workspace_bytes > a->workspace_bytes) {
        fail("cuDNN's attention plan needs %lld bytes of workspace, %zu were allocated; try --attention simple",
             (long long)plan.workspace_bytes, a->workspace_bytes);
    }
    try {
        CUDNN_CHECK(cudnnSetStream(a->handle, stream));
        cudnnBackendDescriptor_t pack;
        CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack));
        set_attr(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
        set_attr(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, pointers);
        set_attr(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &a->workspace);
        CUDNN_CHECK(cudnnBackendFinalize(pack));
        CUDNN_CHECK(cudnnBackendExecute(a->handle, plan.plan, pack));
        CUDNN_CHECK(cudnnBackendDestroyDescriptor(pack));
    } catch (const CudnnRefusal& r) {
        fail("cuDNN attention failed: %s; try --attention simple", r.why.c_str());
    }
}

// out (B, T, C) and stats (B, NH, T) from qkv (B, T, 3C)
inline void cudnn_attention_forward(CudnnAttention* a, floatX* out, float* stats, const floatX* qkv, int B, int T, int C,
                                    int NH, cudaStream_t stream) {
    const CudnnPlan& plan = cudnn_attention_plan(a, false, B, T, C, NH);
    float scale = 1.0f / sqrtf((float)(C / NH)), neg_inf = cudnn_mask_value();
    int64_t uids[] = {UID_Q, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE, UID_NEG_INF};
    void* ptrs[] = {(void*)qkv, (void*)(qkv + C), (void*)(qkv + 2 * C), out, stats, &scale, &neg_inf};
    cudnn_execute(a, plan, 7, uids, ptrs, stream);
}

// dqkv (B, T, 3C), overwritten, from dout (B, T, C) and the forward's qkv, out and stats
inline void cudnn_attention_backward(CudnnAttention* a, floatX* dqkv, const floatX* dout, const floatX* qkv,
                                     const floatX* out, const float* stats, int B, int T, int C, int NH,
                                     cudaStream_t stream) {
    const CudnnPlan& plan = cudnn_attention_plan(a, true, B, T, C, NH);
    float scale = 1.0f / sqrtf((float)(C / NH)), neg_inf = cudnn_mask_value(), one = 1.0f;
    int64_t uids[] = {UID_Q, UID_K, UID_V, UID_O, UID_DO, UID_STATS, UID_DQ, UID_DK, UID_DV, UID_SOFTMAX_SUM,
                      UID_SCALE, UID_NEG_INF, UID_ONE};
    void* ptrs[] = {(void*)qkv, (void*)(qkv + C), (void*)(qkv + 2 * C), (void*)out, (void*)dout, (void*)stats,
                    dqkv, dqkv + C, dqkv + 2 * C, a->softmax_sum, &scale, &neg_inf, &one};
    cudnn_execute(a, plan, 13, uids, ptrs, stream);
}
