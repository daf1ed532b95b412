// gpu_comm_check.cu — on a GPU machine: do llmc/parallel/comm_nccl.cuh's collectives give the exact sums?
//
// Not a test_* program: it needs GPUs and mpirun, so `make test` only compiles it
// (test/test_comm_builds.sh); `make gpu-check` runs it with 1 and 2 ranks. On a GPU machine:
//     make build/gpu_comm_check
//     mpirun -np 2 build/gpu_comm_check       # one GPU: 2 ranks share it, so this is the host-staged path
//     mpirun -np 8 build/gpu_comm_check       # 8 GPUs: NCCL
// The inputs are small multiples of 1/4, so every sum is exact in fp32 and bf16 and the results
// must equal the closed forms bit for bit, whatever order NCCL or MPI adds in.
#include <cstdio>
#include <vector>
#include "llmc/parallel/comm_nccl.cuh"

static int failures = 0;

static void report(const Comm& c, bool ok_here, const char* name) {
    // a check passes only if it passed on every rank
    double bad = comm_sum((Comm*)&c, ok_here ? 0.0 : 1.0, "collecting the results");
    if (c.rank != 0) return;
    if (bad == 0) printf("PASS: %s\n", name);
    else printf("FAIL: %s: wrong on %.0f rank(s)\n", name, bad);
    if (bad != 0) failures++;
}

static float value(size_t i, int rank) { return (float)(i % 97) * 0.25f + (float)rank; }

int main() {
    Comm comm;
    comm_init(&comm, 60);
    GpuComm g;
    gpu_comm_init(&g, &comm);
    int world = comm.world_size, rank = comm.rank;
    if (rank == 0) printf("%d rank%s, %s\n", world, world == 1 ? "" : "s", g.host_staged ? "host-staged (ranks share a GPU)" : "NCCL");

    const size_t shard = 1000, n = shard * world;
    std::vector<float> host(n), out(n);
    for (size_t i = 0; i < n; i++) host[i] = value(i, rank);
    float *d_full, *d_shard;
    cudaMalloc(&d_full, n * 4);
    cudaMalloc(&d_shard, shard * 4);

    // reduce-scatter fp32: shard j of rank r = sum over ranks q of value(r*shard + j, q)
    cudaMemcpy(d_full, host.data(), n * 4, cudaMemcpyHostToDevice);
    gpu_reduce_scatter_sum(&g, d_full, d_shard, shard, ncclFloat32, "reduce-scatter check");
    gpu_comm_wait(&g, "reduce-scatter check");
    cudaMemcpy(out.data(), d_shard, shard * 4, cudaMemcpyDeviceToHost);
    bool ok = true;
    for (size_t j = 0; j < shard; j++) {
        float expect = world * ((float)((rank * shard + j) % 97) * 0.25f) + (float)(world * (world - 1) / 2);
        ok = ok && out[j] == expect;
    }
    report(comm, ok, "reduce-scatter (fp32) gives each rank the exact sum of its shard");

    // all-gather fp32, in place: afterwards element i == value(i, owner of i)
    for (size_t i = 0; i < n; i++) host[i] = (i / shard == (size_t)rank) ? value(i, rank) : -1.0f;
    cudaMemcpy(d_full, host.data(), n * 4, cudaMemcpyHostToDevice);
    gpu_all_gather(&g, d_full, shard, ncclFloat32, "all-gather check");
    gpu_comm_wait(&g, "all-gather check");
    cudaMemcpy(out.data(), d_full, n * 4, cudaMemcpyDeviceToHost);
    ok = true;
    for (size_t i = 0; i < n; i++) ok = ok && out[i] == value(i, (int)(i / shard));
    report(comm, ok, "all-gather (fp32, in place) gives every rank every shard");

    // all-reduce bf16: the values are exact in bf16 (8 bits of mantissa) and so are their sums
    std::vector<uint16_t> half(n), half_out(n);
    for (size_t i = 0; i < n; i++) half[i] = float_to_bf16_round_nearest((float)(i % 8) * 0.25f + (float)rank);
    uint16_t* d_half;
    cudaMalloc(&d_half, n * 2);
    cudaMemcpy(d_half, half.data(), n * 2, cudaMemcpyHostToDevice);
    gpu_all_reduce_sum(&g, d_half, n, ncclBfloat16, "all-reduce check");
    gpu_comm_wait(&g, "all-reduce check");
    cudaMemcpy(half_out.data(), d_half, n * 2, cudaMemcpyDeviceToHost);
    ok = true;
    for (size_t i = 0; i < n; i++)
        ok = ok && bf16_to_float(half_out[i]) == world * ((float)(i % 8) * 0.25f) + (float)(world * (world - 1) / 2);
    report(comm, ok, "all-reduce (bf16) gives every rank the exact sum");

    // reduce to owners (bf16, the trainer's gradient exchange): ranges that cut across shards
    // unevenly; inside its own shard a rank must find the exact sums, elsewhere its own values
    ShardLayout layout = shard_layout(n - 5, world, 8);  // padding: the last 5 + elements
    std::vector<ShardRange> ranges = {{3, 11}, {40, n / 2 + 7}, {n - 64, n - 5}};
    std::vector<bool> in_range(n, false);
    for (ShardRange r : ranges)
        for (size_t i = r.begin; i < r.end; i++) in_range[i] = true;
    cudaMemcpy(d_half, half.data(), n * 2, cudaMemcpyHostToDevice);
    gpu_reduce_to_owners(&g, d_half, ncclBfloat16, layout, ranges, "reduce-to-owners check");
    gpu_comm_wait(&g, "reduce-to-owners check");
    cudaMemcpy(half_out.data(), d_half, n * 2, cudaMemcpyDeviceToHost);
    ok = true;
    ShardRange mine = shard_range(layout, rank);
    for (size_t i = 0; i < n; i++) {
        float own = (float)(i % 8) * 0.25f + (float)rank;
        float sum = world * ((float)(i % 8) * 0.25f) + (float)(world * (world - 1) / 2);
        bool summed = in_range[i] && i >= mine.begin && i < mine.end;
        ok = ok && bf16_to_float(half_out[i]) == (summed ? sum : own);
    }
    report(comm, ok, "reduce to owners (bf16): exact sums inside each rank's shard, its own values elsewhere");

    // the process grid's operations: the identical all-reduce (bf16), the all-reduce of maxima (fp32),
    // point-to-point around a ring (a send grouped with the receive that follows it), and a group
    // split off the world (the even and the odd ranks)
    cudaMemcpy(d_half, half.data(), n * 2, cudaMemcpyHostToDevice);
    gpu_all_reduce_identical(&g, d_half, n, ncclBfloat16, "identical all-reduce check");
    gpu_comm_wait(&g, "identical all-reduce check");
    cudaMemcpy(half_out.data(), d_half, n * 2, cudaMemcpyDeviceToHost);
    ok = true;
    for (size_t i = 0; i < n; i++)
        ok = ok && bf16_to_float(half_out[i]) == world * ((float)(i % 8) * 0.25f) + (float)(world * (world - 1) / 2);
    report(comm, ok, "identical all-reduce (bf16: reduce-scatter + all-gather) gives every rank the exact sum");

    for (size_t i = 0; i < n; i++) host[i] = value(i, (int)((i + (size_t)rank) % (size_t)world));
    cudaMemcpy(d_full, host.data(), n * 4, cudaMemcpyHostToDevice);
    gpu_all_reduce_max(&g, d_full, n, "maximum check");
    gpu_comm_wait(&g, "maximum check");
    cudaMemcpy(out.data(), d_full, n * 4, cudaMemcpyDeviceToHost);
    ok = true;
    for (size_t i = 0; i < n; i++) ok = ok && out[i] == value(i, world - 1);
    report(comm, ok, "all-reduce of maxima (fp32)");

    {
        std::vector<GpuStagedSend> staged;
        int next = (rank + 1) % world, prev = (rank + world - 1) % world;
        for (size_t i = 0; i < shard; i++) host[i] = value(i, rank);
        cudaMemcpy(d_shard, host.data(), shard * 4, cudaMemcpyHostToDevice);
        if (world > 1) {
            gpu_group_begin(&g, "point-to-point check");
            gpu_send(&g, d_shard, shard * 4, next, 7, &staged, "point-to-point check");
            gpu_recv(&g, d_full, shard * 4, prev, 7, "point-to-point check");
            gpu_group_end(&g, "point-to-point check");
            gpu_comm_wait(&g, "point-to-point check");
            gpu_wait_sends(&g, &staged);
            cudaMemcpy(out.data(), d_full, shard * 4, cudaMemcpyDeviceToHost);
        }
        ok = true;
        for (size_t i = 0; world > 1 && i < shard; i++) ok = ok && out[i] == value(i, prev);
        report(comm, ok, "send and receive around a ring (grouped): each rank gets its predecessor's array");
    }

    {
        Comm half_world;
        comm_split(&comm, rank % 2, rank / 2, &half_world, "the group check's split");
        GpuComm group;
        gpu_comm_init_group(&group, &g, &half_world, rank % 2, rank / 2, "the group check's communicator");
        std::vector<float> one(8, (float)rank);
        float* d_one;
        cudaMalloc(&d_one, 8 * 4);
        cudaMemcpy(d_one, one.data(), 8 * 4, cudaMemcpyHostToDevice);
        gpu_all_reduce_identical(&group, d_one, 8, ncclFloat32, "group check");
        gpu_comm_wait(&group, "group check");
        cudaMemcpy(one.data(), d_one, 8 * 4, cudaMemcpyDeviceToHost);
        float expect = 0;
        for (int r = rank % 2; r < world; r += 2) expect += (float)r;
        ok = half_world.world_size == (world - rank % 2 + 1) / 2;
        for (float x : one) ok = ok && x == expect;
        cudaFree(d_one);
        gpu_comm_finalize(&group);
        report(comm, ok, "a group split off the world (even and odd ranks) sums within itself");
    }

    // numbers: every rank's value in rank order, and their sum, identical everywhere
    std::vector<double> all = gpu_comm_gather(&g, 1.5 * rank, "gather check");
    ok = (int)all.size() == world;
    for (int r = 0; r < world && ok; r++) ok = all[r] == 1.5 * r;
    ok = ok && gpu_comm_sum(&g, rank + 0.25, "sum check") == world * (world - 1) / 2.0 + 0.25 * world;
    gpu_comm_barrier(&g, "barrier check");
    report(comm, ok, "gpu_comm_gather / gpu_comm_sum / gpu_comm_barrier (numbers over the tensors' transport)");

    cudaFree(d_full);
    cudaFree(d_shard);
    cudaFree(d_half);
    gpu_comm_finalize(&g);
    comm_finalize(&comm);
    return failures ? 1 : 0;
}
