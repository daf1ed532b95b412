// grad_compression_probe.h — test machinery for llmc/parallel/grad_compression.h; readers skip it.
// Three switches, each read from the environment and a no-op without it:
//   LLMC_TEST_POWERSGD_EVERY_MATRIX=1   compress every matrix, even where r (n + m) > n m / 2: the
//                                       test of r = min(n, m) (PowerSGD must then equal the exact sum)
//   LLMC_TEST_NAN_GRAD=<rank>:<step>    that rank's gradient gets a NaN before the step's sum (a
//                                       step the trainer must skip without poisoning e and Q)
//   LLMC_TEST_COMPRESSION_DUMP=<dir>    every rank writes, every step, its gradient before the sum
//                                       and the sum, as raw fp32: <dir>/step<s>_rank<r>_{local,sum}.f32
//                                       (test/test_grad_compression.py replays them in fp64)
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/utils.h"

inline bool grad_compression_test_every_matrix() {
    const char* v = getenv("LLMC_TEST_POWERSGD_EVERY_MATRIX");
    return v && std::string(v) == "1";
}

inline void grad_compression_test_poison(const Comm* world, int step, std::vector<float>* grads) {
    static const char* spec = getenv("LLMC_TEST_NAN_GRAD");
    if (!spec || !*spec) return;
    int rank = -1, at = -1;
    if (sscanf(spec, "%d:%d", &rank, &at) != 2) fail("LLMC_TEST_NAN_GRAD='%s' should be <rank>:<step>", spec);
    if (rank == world->rank && at == step) (*grads)[0] = NAN;  // wte's first element: inside a compressed matrix
}

inline bool grad_compression_test_dumps() {
    const char* dir = getenv("LLMC_TEST_COMPRESSION_DUMP");
    return dir && *dir;
}

inline void grad_compression_test_dump(const Comm* world, int step, const char* what, const std::vector<float>& grads) {
    static const char* dir = getenv("LLMC_TEST_COMPRESSION_DUMP");
    if (!dir || !*dir) return;
    AtomicFile out(std::string(dir) + strprintf("/step%d_rank%d_%s.f32", step, world->rank, what), "compression dump");
    out.write(grads.data(), grads.size() * sizeof(float));
    out.commit();
}
