// cpu_buffers.h — every buffer the CPU trainer allocates, as a function of the run's shape.
//
// Host-only, the twin of gpu_buffers.h: train_gpt_cpu.cpp allocates FROM this table, each buffer
// exactly as large as its row says, and `--estimate` prints the same table. So the estimate is what
// the trainer holds, to the byte: `--print-allocations` makes every rank report the capacity of each
// vector it really holds, and test/test_estimate.py compares the two.
//
// Everything is fp32 (4 bytes per value). Per rank:
//   params, grads       the flat arrays (llmc/model.h), padded to the shard layout (llmc/sharding.h) so
//                       the collectives move equal pieces: round_up(N, ranks * 64) values each
//   grad_shard          the reduce-scatter's output, the summed gradient of this rank's shard
//                       (one full copy of the gradient with one rank: the price of one code path)
//   adam_m, adam_v      AdamW's moments for the parameters this rank updates: all N (ZeRO-0) or its
//                       shard (ZeRO-1, about N / ranks). No master copy: fp32 weights are their own master
//   activations         what the backward pass reads, stacked over the L layers; the attention
//                       probabilities are materialised, (L, B, NH, T, T)
//   workspace           one layer's backward scratch, reused by every layer, and the matmul's packed panels
//
// Not in the table: the data loader's tokens (the current shard, 2 bytes per token) and per-call
// scratch that lives for one function call (a row of attention scores, the gradient-norm partials),
// and the copies made while writing a checkpoint. None of it grows with the model or the batch for
// the duration of a step.
#pragma once

#include <cstddef>
#include <vector>
#include "llmc/buffers.h"
#include "llmc/model.h"
#include "llmc/sharding.h"
#include "llmc/utils.h"

// The CPU matmul's blocking (train_gpt_cpu.cpp explains it): an MR x NR register tile, K taken KC
// at a time, N at most NC at a time. They decide the size of its packed panels, so they live here.
constexpr int MATMUL_MR = 8, MATMUL_NR = 32, MATMUL_KC = 256, MATMUL_NC = 4096;

// Floats in the packed panels of A for a matmul with M rows: ceil(M / MR) panels of MR x KC.
inline size_t matmul_pack_a_floats(size_t M) { return (M + MATMUL_MR - 1) / MATMUL_MR * MATMUL_MR * MATMUL_KC; }
// ... and of B, whatever the shapes: NC / NR panels of NR x KC.
constexpr size_t MATMUL_PACK_B_FLOATS = (size_t)MATMUL_NC * MATMUL_KC;

// What decides the sizes.
struct CPURunShape {
    GPT2Config cfg;
    int B = 0, T = 0;                  // micro-batch
    int world_size = 1, rank = 0;      // data-parallel ranks, and which one this is
    int zero_stage = 0;                // 0: every rank keeps all of m and v; 1: its shard only
};

// One buffer per row; the trainer finds each row's vector by this enum.
enum CPUBuffer {
    // the model, its gradient and its optimizer
    CB_PARAMS, CB_GRADS, CB_GRAD_SHARD, CB_ADAM_M, CB_ADAM_V,
    // activations kept from the forward for the backward
    CB_ENCODED, CB_LN1, CB_LN1_MEAN, CB_LN1_RSTD, CB_QKV, CB_ATT, CB_ATTY, CB_RESIDUAL2,
    CB_LN2, CB_LN2_MEAN, CB_LN2_RSTD, CB_FCH, CB_FCH_GELU, CB_RESIDUAL3,
    CB_LNF, CB_LNF_MEAN, CB_LNF_RSTD, CB_LOGITS, CB_LOSSES, CB_LOGSUMEXP,
    // scratch: one layer's worth, reused by every layer; the matmul's packed panels
    CB_DRESIDUAL, CB_DBUF_C, CB_DBUF_3C, CB_DBUF_4C, CB_MATMUL_PACK_A, CB_MATMUL_PACK_B,
    CB_COUNT
};

// The parameters whose AdamW state this rank keeps: all of them, or (ZeRO-1) those of its shard.
inline ShardRange cpu_updated_range(const CPURunShape& s) {
    ShardLayout shards = shard_layout(param_layout(s.cfg).total, s.world_size);
    return s.zero_stage == 1 ? owned_range(shards, s.rank) : ShardRange{0, shards.total};
}

inline std::vector<BufferSpec> cpu_buffer_table(const CPURunShape& s) {
    const GPT2Config& c = s.cfg;
    size_t L = c.num_layers, C = c.channels, NH = c.num_heads, Vp = c.padded_vocab_size;
    size_t B = s.B, T = s.T, BT = B * T, F = 4;
    ShardLayout shards = shard_layout(param_layout(c).total, s.world_size);
    size_t padded = shards.padded_total, updated = cpu_updated_range(s).size();
    // the largest matmul: M is B*T rows in the forward and the data gradient, the output width
    // (3C, C, 4C, Vp) in the weight gradient
    size_t max_rows = std::max({BT, Vp, 4 * C});
    auto sh = [](const char* fmt, auto... v) { return strprintf(fmt, v...); };

    std::vector<BufferSpec> t(CB_COUNT);
    t[CB_PARAMS] = {"params", MEM_PARAMS, sh("(%zu) padded", padded), padded, F};
    t[CB_GRADS] = {"grads", MEM_GRADS, sh("(%zu) padded", padded), padded, F};
    t[CB_GRAD_SHARD] = {"grad_shard", MEM_GRADS, sh("(%zu) this rank's shard", shards.shard_size), shards.shard_size, F};
    t[CB_ADAM_M] = {"adam_m", MEM_OPTIMIZER, sh("(%zu)", updated), updated, F};
    t[CB_ADAM_V] = {"adam_v", MEM_OPTIMIZER, sh("(%zu)", updated), updated, F};

    t[CB_ENCODED] = {"encoded", MEM_ACTIVATIONS, "(B, T, C)", BT * C, F};
    t[CB_LN1] = {"ln1", MEM_ACTIVATIONS, "(L, B, T, C)", L * BT * C, F};
    t[CB_LN1_MEAN] = {"ln1_mean", MEM_ACTIVATIONS, "(L, B, T)", L * BT, F};
    t[CB_LN1_RSTD] = {"ln1_rstd", MEM_ACTIVATIONS, "(L, B, T)", L * BT, F};
    t[CB_QKV] = {"qkv", MEM_ACTIVATIONS, "(L, B, T, 3C)", L * BT * 3 * C, F};
    t[CB_ATT] = {"att", MEM_ACTIVATIONS, "(L, B, NH, T, T)", L * B * NH * T * T, F};
    t[CB_ATTY] = {"atty", MEM_ACTIVATIONS, "(L, B, T, C)", L * BT * C, F};
    t[CB_RESIDUAL2] = {"residual2", MEM_ACTIVATIONS, "(L, B, T, C)", L * BT * C, F};
    t[CB_LN2] = {"ln2", MEM_ACTIVATIONS, "(L, B, T, C)", L * BT * C, F};
    t[CB_LN2_MEAN] = {"ln2_mean", MEM_ACTIVATIONS, "(L, B, T)", L * BT, F};
    t[CB_LN2_RSTD] = {"ln2_rstd", MEM_ACTIVATIONS, "(L, B, T)", L * BT, F};
    t[CB_FCH] = {"fch", MEM_ACTIVATIONS, "(L, B, T, 4C)", L * BT * 4 * C, F};
    t[CB_FCH_GELU] = {"fch_gelu", MEM_ACTIVATIONS, "(L, B, T, 4C)", L * BT * 4 * C, F};
    t[CB_RESIDUAL3] = {"residual3", MEM_ACTIVATIONS, "(L, B, T, C)", L * BT * C, F};
    t[CB_LNF] = {"lnf", MEM_ACTIVATIONS, "(B, T, C)", BT * C, F};
    t[CB_LNF_MEAN] = {"lnf_mean", MEM_ACTIVATIONS, "(B, T)", BT, F};
    t[CB_LNF_RSTD] = {"lnf_rstd", MEM_ACTIVATIONS, "(B, T)", BT, F};
    t[CB_LOGITS] = {"logits", MEM_ACTIVATIONS, "(B, T, Vp)", BT * Vp, F};
    t[CB_LOSSES] = {"losses", MEM_ACTIVATIONS, "(B, T)", BT, F};
    t[CB_LOGSUMEXP] = {"logsumexp", MEM_ACTIVATIONS, "(B, T)", BT, F};

    t[CB_DRESIDUAL] = {"dresidual", MEM_WORKSPACE, "(B, T, C)", BT * C, F};
    t[CB_DBUF_C] = {"dbuf_c", MEM_WORKSPACE, "(B, T, C)", BT * C, F};
    t[CB_DBUF_3C] = {"dbuf_3c", MEM_WORKSPACE, "(B, T, 3C)", BT * 3 * C, F};
    t[CB_DBUF_4C] = {"dbuf_4c", MEM_WORKSPACE, "(B, T, 4C)", BT * 4 * C, F};
    t[CB_MATMUL_PACK_A] = {"matmul_pack_a", MEM_WORKSPACE, sh("%zu rows x KC=%d", max_rows, MATMUL_KC),
                           matmul_pack_a_floats(max_rows), F};
    t[CB_MATMUL_PACK_B] = {"matmul_pack_b", MEM_WORKSPACE, sh("NC=%d x KC=%d", MATMUL_NC, MATMUL_KC), MATMUL_PACK_B_FLOATS, F};
    return t;
}

// The CPU allocator is asked for exactly each row's bytes (std::vector of that many floats).
constexpr size_t CPU_ALLOCATION_GRANULE = 1;
