// size_table.h — a size table: one row per buffer a trainer allocates, and what each row is for.
//
// Both trainers allocate every long-lived buffer FROM a table (llmc/memory/cpu_buffers.h, llmc/memory/gpu_buffers.h)
// that is a plain function of the run's shape. The same tables feed --estimate (llmc/memory/estimate.h), so
// the memory a run needs is known before anything is allocated, and the estimate cannot drift from
// the code. This file holds what the two tables share: the row, the kinds of memory the accounting
// adds up, the search for the largest micro-batch that fits, and byte formatting.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>
#include "llmc/utils.h"

// What a buffer holds, in the accounting of docs/memory.md. The first four are the "model states"
// of the ZeRO paper (they grow with the parameter count N); activations grow with the tokens of a
// micro-batch; workspaces are scratch that one layer at a time reuses, and library work areas.
enum MemoryKind {
    MEM_PARAMS,       // the weights the forward pass reads (bf16 or fp32)
    MEM_GRADS,        // their gradients
    MEM_MASTER,       // an fp32 copy of the weights that AdamW updates (mixed precision only)
    MEM_OPTIMIZER,    // AdamW's first and second moments, m and v (fp32)
    MEM_ACTIVATIONS,  // forward results kept for the backward pass
    MEM_WORKSPACE,    // scratch and library work areas
    MEM_KINDS
};

inline const char* memory_kind_name(int k) {
    static const char* names[MEM_KINDS] = {"params", "grads", "master", "optimizer", "activations", "workspace"};
    return names[k];
}

struct BufferSpec {
    const char* name = "";
    MemoryKind kind = MEM_WORKSPACE;
    std::string shape;      // for the printed table
    size_t elements = 0;
    size_t element_bytes = 0;
    size_t bytes() const { return elements * element_bytes; }
};

// The bytes a row takes once the allocator has rounded it up to its granule (the CUDA allocator hands
// out multiples of 256 bytes; 1 means "as asked"). Empty rows are never allocated.
inline size_t allocated_bytes(const BufferSpec& b, size_t granule) {
    return (b.bytes() + granule - 1) / granule * granule;
}

// The largest micro-batch B in [1, limit] for which fits(B) holds, or 0 if not even B = 1 fits.
// `fits` must be monotone (true up to some B, false beyond), which every size table is: each row grows
// with B or stays put. So doubling finds a B that does not fit, and bisection the boundary, with
// O(log B) table evaluations.
template <class Fits>
inline int largest_fitting_batch(Fits fits, int limit) {
    if (limit < 1 || !fits(1)) return 0;
    long lo = 1, hi = 2;  // fits(lo) holds; fits(hi) is not known yet
    while (hi <= limit && fits((int)hi)) lo = hi, hi *= 2;
    if (hi > limit) {
        if (fits(limit)) return limit;
        hi = limit;
    }
    while (hi - lo > 1) {  // fits(lo) and !fits(hi)
        long mid = lo + (hi - lo) / 2;
        if (fits((int)mid)) lo = mid;
        else hi = mid;
    }
    return (int)lo;
}

inline std::string format_bytes(double bytes) {
    if (bytes >= (1ull << 30)) return strprintf("%.2f GiB", bytes / (1ull << 30));
    if (bytes >= (1ull << 20)) return strprintf("%.1f MiB", bytes / (1ull << 20));
    if (bytes >= (1ull << 10)) return strprintf("%.1f KiB", bytes / (1ull << 10));
    return strprintf("%.0f B", bytes);
}

// The printed table: every buffer that is allocated (empty rows are left out), its exact bytes (as
// the allocator rounds them) and a readable size, then the total.
inline void print_buffer_table(const std::vector<BufferSpec>& table, size_t granule) {
    printf("  %-20s %-12s %-32s %14s\n", "buffer", "kind", "shape", "bytes");
    size_t total = 0;
    for (const BufferSpec& b : table) {
        if (b.bytes() == 0) continue;
        size_t bytes = allocated_bytes(b, granule);
        total += bytes;
        printf("  %-20s %-12s %-32s %14zu  %s\n", b.name, memory_kind_name(b.kind), b.shape.c_str(), bytes,
               format_bytes((double)bytes).c_str());
    }
    printf("  %-20s %-12s %-32s %14zu  %s\n", "total", "", "", total, format_bytes((double)total).c_str());
}
