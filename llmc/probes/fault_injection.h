// fault_injection.h — test machinery: a rank made to fail on purpose, so that the tests can check
// what llmc/parallel/comm.h promises ("failing together": --comm-timeout, MPI_Abort), that every other
// rank then stops, with a message, instead of waiting forever. Each trainer calls comm_inject_fault at
// the start of every step; without LLMC_TEST_FAULT in the environment it does nothing.
#pragma once

#include <unistd.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include "llmc/parallel/comm.h"
#include "llmc/utils.h"

// Testing failure handling: LLMC_TEST_FAULT=<rank>:<step>:<hang|exit|error> makes that rank, at
// the start of that step, sleep forever, exit at once (as a crash would), or fail with an error
// message, so the tests can check that every rank then stops, with a message, instead of waiting.
inline void comm_inject_fault(const Comm* c, int step) {
    static const char* spec = getenv("LLMC_TEST_FAULT");
    if (!spec || !*spec) return;
    int rank = -1, at_step = -1;
    char kind[16] = {0};
    if (sscanf(spec, "%d:%d:%15s", &rank, &at_step, kind) != 3 || (strcmp(kind, "hang") && strcmp(kind, "exit") && strcmp(kind, "error"))) {
        fail("LLMC_TEST_FAULT='%s' should be <rank>:<step>:<hang|exit|error>", spec);
    }
    if (rank != c->rank || at_step != step) return;
    if (!strcmp(kind, "error")) fail("LLMC_TEST_FAULT: an error on rank %d at step %d", rank, step);
    fprintf(stderr, "rank %d: LLMC_TEST_FAULT: %s at step %d\n", c->rank, kind, step);
    fflush(stderr);
    if (!strcmp(kind, "exit")) _exit(3);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// Testing the overflow skip (llmc/optim/loss_scaler.h): LLMC_TEST_GRAD_INF=<rank>:<step> makes that
// rank's first gradient inf after the backward pass of that step, as an fp16 overflow would, so the
// test can check that every rank, not only this one, skips the update.
inline void inject_grad_inf(const Comm* c, int step, float* grads) {
    static const char* spec = getenv("LLMC_TEST_GRAD_INF");
    if (!spec || !*spec) return;
    int rank = -1, at_step = -1;
    if (sscanf(spec, "%d:%d", &rank, &at_step) != 2) fail("LLMC_TEST_GRAD_INF='%s' should be <rank>:<step>", spec);
    if (rank == c->rank && at_step == step) grads[0] = INFINITY;
}

// Testing --offload-dir (llmc/optim/disk_offload.h) without a small or failing disk:
// LLMC_TEST_OFFLOAD_FREE_BYTES=<bytes> makes its directory report that much free space (-1: unset);
// LLMC_TEST_OFFLOAD_REMOVE=<rank>:<step> makes that rank remove its m file at the start of that step,
// as a user deleting the directory would.
inline int64_t offload_test_free_bytes() {
    const char* spec = getenv("LLMC_TEST_OFFLOAD_FREE_BYTES");
    return spec && *spec ? (int64_t)strtoll(spec, nullptr, 10) : -1;
}
inline void inject_offload_removal(const Comm* c, int step, const std::string& path) {
    static const char* spec = getenv("LLMC_TEST_OFFLOAD_REMOVE");
    if (!spec || !*spec || path.empty()) return;
    int rank = -1, at_step = -1;
    if (sscanf(spec, "%d:%d", &rank, &at_step) != 2) fail("LLMC_TEST_OFFLOAD_REMOVE='%s' should be <rank>:<step>", spec);
    if (rank == c->rank && at_step == step) unlink(path.c_str());
}
