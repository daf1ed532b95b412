// test_comm.cpp — the parts of llmc/parallel/comm.h that need no MPI: how a process learns its rank from
// the launcher's environment, and the file and TCP rendezvous (llmc/parallel/rendezvous.h) that hand NCCL's unique id from
// rank 0 to every rank when there is no MPI. Ranks are simulated with fork(): each child is one
// rank, reports what it received through its exit code, and the parent checks.
#include <sys/wait.h>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/parallel/rendezvous.h"
#include "test/checks.h"

static const char* LAUNCHER_VARS[] = {
    "LLMC_RANK", "LLMC_WORLD_SIZE", "LLMC_LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID"};

static void clear_launcher_env() {
    for (const char* v : LAUNCHER_VARS) unsetenv(v);
}

static Comm from_env(const std::vector<std::pair<const char*, const char*>>& vars) {
    clear_launcher_env();
    for (const auto& kv : vars) setenv(kv.first, kv.second, 1);
    Comm c;
    comm_from_environment(&c);
    return c;
}

// Runs `body(rank)` in `world` child processes; returns their exit codes (-1 if killed) and how
// long the slowest took.
template <typename F>
static std::vector<int> run_ranks(int world, double* seconds, F body) {
    auto start = std::chrono::steady_clock::now();
    std::vector<pid_t> pids;
    for (int r = 0; r < world; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            fclose(stdout);  // a child's messages must not look like the test's PASS/FAIL lines
            _exit(body(r));
        }
        pids.push_back(pid);
    }
    std::vector<int> codes;
    for (pid_t pid : pids) {
        int status = 0;
        waitpid(pid, &status, 0);
        codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    }
    *seconds = comm_seconds_since(start);
    return codes;
}

// Each rank starts with its own bytes; rank 0's must arrive everywhere. Exit code 0 = it did.
static int share_and_verify(int rank, int world, const std::string& spec, double timeout) {
    unsigned char payload[128];
    for (int i = 0; i < 128; i++) payload[i] = (unsigned char)(rank == 0 ? (i * 7 + 3) : 0xEE);
    if (rank == 2) usleep(300000);  // a late rank
    rendezvous_share(payload, sizeof(payload), rank, world, spec.c_str(), timeout);
    for (int i = 0; i < 128; i++)
        if (payload[i] != (unsigned char)(i * 7 + 3)) return 10;
    return 0;
}

// A port nobody listens on right now: bind to port 0, ask the kernel which one it gave, let it go.
static int free_port() {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (bind(fd, (sockaddr*)&addr, sizeof(addr)) != 0 || getsockname(fd, (sockaddr*)&addr, &len) != 0) fail("no free port");
    close(fd);
    return ntohs(addr.sin_port);
}

static std::string codes_text(const std::vector<int>& codes) {
    std::string s;
    for (int c : codes) s += std::to_string(c) + " ";
    return s;
}

int main() {
    // 1. who am I, from the launcher's environment
    Comm c = from_env({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
    check(c.rank == 3 && c.world_size == 8 && c.local_rank == 1, "mpirun's OMPI_COMM_WORLD_* give rank 3 of 8, local 1",
          strprintf("rank %d of %d local %d", c.rank, c.world_size, c.local_rank));
    c = from_env({{"SLURM_PROCID", "5"}, {"SLURM_STEP_NUM_TASKS", "16"}, {"SLURM_LOCALID", "1"}});
    check(c.rank == 5 && c.world_size == 16 && c.local_rank == 1 && c.launcher == "srun (Slurm)",
          "srun's SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID give rank 5 of 16, local 1",
          strprintf("rank %d of %d local %d (%s)", c.rank, c.world_size, c.local_rank, c.launcher.c_str()));
    c = from_env({{"SLURM_NTASKS", "16"}, {"SLURM_JOB_ID", "77"}});
    check(c.rank == 0 && c.world_size == 1, "a Slurm batch script (SLURM_NTASKS but no srun step) is one process",
          strprintf("rank %d of %d", c.rank, c.world_size));
    c = from_env({{"LLMC_RANK", "1"}, {"LLMC_WORLD_SIZE", "2"}, {"SLURM_PROCID", "5"}, {"SLURM_STEP_NUM_TASKS", "16"}});
    check(c.rank == 1 && c.world_size == 2 && c.local_rank == 1, "explicit LLMC_RANK / LLMC_WORLD_SIZE win over Slurm's",
          strprintf("rank %d of %d", c.rank, c.world_size));
    c = from_env({});
    check(c.rank == 0 && c.world_size == 1 && c.launcher == "single process", "no launcher: rank 0 of 1",
          strprintf("rank %d of %d", c.rank, c.world_size));
    double seconds = 0;
    std::vector<int> codes = run_ranks(1, &seconds, [](int) {
        from_env({{"LLMC_RANK", "4"}, {"LLMC_WORLD_SIZE", "4"}});
        return 0;
    });
    check(codes[0] == EXIT_BAD_INPUT, "rank 4 of 4 is refused with an error", "exit " + codes_text(codes));
    clear_launcher_env();

    // 2. rendezvous through a shared file: 4 ranks, one of them late
    char dir_template[] = "/tmp/llmc_comm_XXXXXX";
    std::string dir = mkdtemp(dir_template);
    std::string spec = "file:" + dir + "/nccl_id";
    codes = run_ranks(4, &seconds, [&](int r) { return share_and_verify(r, 4, spec, 20); });
    check(codes == std::vector<int>(4, 0), strprintf("file rendezvous: rank 0's 128 bytes reach 4 ranks (%.2f s)", seconds),
          "exit codes " + codes_text(codes) + "(10 = wrong bytes)");

    // a file from another Slurm job must be ignored: readers wait for their own job's
    setenv("SLURM_JOB_ID", "1001", 1);
    codes = run_ranks(1, &seconds, [&](int) { return share_and_verify(0, 2, spec, 5); });  // job 1001 publishes
    setenv("SLURM_JOB_ID", "1002", 1);
    codes = run_ranks(1, &seconds, [&](int) { return share_and_verify(1, 2, spec, 1); });  // job 1002 must not take it
    check(codes[0] == EXIT_BAD_INPUT && seconds < 10, strprintf("file rendezvous ignores another job's file and times out (%.1f s)", seconds),
          "exit " + codes_text(codes));
    unsetenv("SLURM_JOB_ID");

    // 3. rendezvous over TCP: rank 0 listens, 4 others connect (one of them before it listens)
    int port = free_port();
    std::string tcp = strprintf("tcp:127.0.0.1:%d", port);
    codes = run_ranks(5, &seconds, [&](int r) {
        if (r == 0) usleep(200000);  // the others try to connect before rank 0 listens: they must retry
        return share_and_verify(r, 5, tcp, 20);
    });
    check(codes == std::vector<int>(5, 0), strprintf("TCP rendezvous: rank 0's 128 bytes reach 5 ranks (%.2f s)", seconds),
          "exit codes " + codes_text(codes) + "(10 = wrong bytes)");

    // 4. a rank whose rank 0 never comes fails within its timeout instead of waiting forever
    codes = run_ranks(1, &seconds, [&](int) { return share_and_verify(1, 2, strprintf("tcp:127.0.0.1:%d", free_port()), 1.0); });
    check(codes[0] == EXIT_BAD_INPUT && seconds < 10, strprintf("TCP rendezvous without rank 0 fails after its 1 s timeout (%.1f s)", seconds),
          "exit " + codes_text(codes));
    codes = run_ranks(1, &seconds, [&](int) { return share_and_verify(1, 2, "carrier-pigeon:home", 1.0); });
    check(codes[0] == EXIT_BAD_INPUT, "an unknown LLMC_RENDEZVOUS form is refused", "exit " + codes_text(codes));

    if (system(("rm -rf '" + dir + "'").c_str()) != 0) fprintf(stderr, "could not remove %s\n", dir.c_str());
    return check_exit_code();
}
