// poison.h — test machinery: every buffer the CPU trainer allocates starts as NaN instead of zeros,
// so that a pass which reads a buffer before anything wrote it (a gradient nobody cleared, a moment
// nobody set) shows up in the losses and the weights, as on the emulated GPU (test/emu/: its
// cudaMalloc fills device memory with 0xff bytes). A std::vector<float>(n) is all zeros, and zeros
// are exactly what a forgotten clear would have written, so without this the CPU's own tests cannot
// see such a bug; the CUDA trainer's cudaMalloc gives garbage, and would.
//
// On with LLMC_POISON_BUFFERS=1 in the environment (test/run_tests.py sets it for every test, so CI
// always runs poisoned). Off, each call is one test of a cached flag, and the numbers are
// bit-identical. Filled: the size table's rows (llmc/memory/cpu_buffers.h, fp32 and
// bf16 ones), the MoE blocks' and the expert-parallel exchange's rows, ZeRO-2/3's units and buckets,
// the generation's KV cache. Not filled: integer rows (token ids, MoE choices: no NaN to give them),
// the matmul's packed panels (packed by the matmul itself right before each use; its file is on the
// reading path), and per-call scratch that lives inside one function.
//
// What it catches: a clear of the attention forward's masked half (cpu_layers.h), planted removed,
// passed test_vs_pytorch and test_parallelism without it (the allocator's zeros stood in); with it the
// first step's loss is NaN and both fail. It found four real reliances on those zeros (each now
// written where its meaning is, with a comment): AdamW's and the factored optimizers' state,
// PowerSGD's first error feedback, ZeRO-2/3's gradient buckets, the parameters' padding.
//
// The bytes are 0xff: NaN as fp32 (0xffffffff) and as bf16 (0xffff), and a NaN stays NaN through any
// sum or product, so one value read before its write reaches the loss.
#pragma once

#include <cstdlib>
#include <cstring>
#include <vector>

inline bool poison_buffers_on() {
    static const bool on = [] {
        const char* s = getenv("LLMC_POISON_BUFFERS");
        return s && *s && strcmp(s, "0") != 0;
    }();
    return on;
}

// Fills fresh buffers with NaN bytes when the switch is on; does nothing otherwise.
template <class T>
inline void poison_fresh(std::vector<T>* v) {
    if (poison_buffers_on() && !v->empty()) memset((void*)v->data(), 0xff, v->size() * sizeof(T));
}
template <class T, class... More>
inline void poison_fresh(std::vector<T>* v, More*... more) {
    poison_fresh(v);
    poison_fresh(more...);
}
