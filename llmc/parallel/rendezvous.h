// rendezvous.h — how the ranks of a run find each other without MPI, before any collective can run.
//
// NCCL builds its communicator from a 128-byte ncclUniqueId made by rank 0 and known to all
// (llmc/parallel/comm_nccl.cuh). MPI broadcasts it; without MPI (plain srun) LLMC_RENDEZVOUS says how:
//     file:PATH           rank 0 writes PATH on a shared filesystem, the others wait for it
//     tcp:HOST:PORT       rank 0 listens on PORT of HOST, the others connect and receive it
// How each rank learns its own rank and the world size (from the launcher's environment, Slurm's
// included) is llmc/parallel/comm.h's.
#pragma once

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/utils.h"

// ----------------------------------------------------------------------------------------------
// Rendezvous without MPI: rank 0's `bytes` bytes reach every rank. `spec` is file:PATH or
// tcp:HOST:PORT. Waits at most timeout_s (0 = forever) for the other side.

// A file left by an earlier job must not be taken for this job's: the file records the Slurm job
// and step, and the readers accept only their own. Outside Slurm, use a fresh path for each run.
inline std::string rendezvous_job_key() {
    const char* job = getenv("SLURM_JOB_ID");
    const char* step = getenv("SLURM_STEP_ID");
    return std::string(job ? job : "") + "." + (step ? step : "");
}

inline void rendezvous_deadline_check(std::chrono::steady_clock::time_point start, double timeout_s, const char* spec,
                                      int rank) {
    if (timeout_s > 0 && comm_seconds_since(start) > timeout_s) {
        fail("rank %d: rendezvous '%s' did not complete within %g s: %s", rank, spec, timeout_s,
             rank == 0 ? "not every rank connected (are they all running, with the same LLMC_RENDEZVOUS?)"
                       : "rank 0 did not publish (is it running? is the path on a filesystem all nodes share, "
                         "or the host reachable from this node?)");
    }
}

inline void rendezvous_file(void* data, size_t bytes, int rank, const std::string& path, double timeout_s, const char* spec) {
    std::string key = rendezvous_job_key();
    if (rank == 0) {
        AtomicFile out(path, "rendezvous file");  // written whole, then renamed: readers never see half
        uint64_t key_len = key.size();
        out.write(&key_len, 8);
        out.write(key.data(), key.size());
        out.write(data, bytes);
        out.commit();
        return;
    }
    auto start = std::chrono::steady_clock::now();
    for (;;) {
        if (file_exists(path)) {
            std::vector<char> all = read_whole_file(path, "rendezvous file");
            uint64_t key_len = 0;
            if (all.size() >= 8) memcpy(&key_len, all.data(), 8);
            if (all.size() == 8 + key_len + bytes && std::string(all.data() + 8, key_len) == key) {
                memcpy(data, all.data() + 8 + key_len, bytes);
                return;
            }
        }
        rendezvous_deadline_check(start, timeout_s, spec, rank);
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}

// Sends or receives exactly `bytes`, or fails naming the rendezvous.
inline void socket_transfer(int fd, void* data, size_t bytes, bool sending, const char* spec) {
    size_t done = 0;
    while (done < bytes) {
        ssize_t n = sending ? send(fd, (char*)data + done, bytes - done, MSG_NOSIGNAL) : recv(fd, (char*)data + done, bytes - done, 0);
        if (n <= 0) fail("rendezvous '%s': the connection broke after %zu of %zu bytes: %s", spec, done, bytes, n < 0 ? strerror(errno) : "closed");
        done += (size_t)n;
    }
}

inline void rendezvous_tcp(void* data, size_t bytes, int rank, int world, const std::string& host, const std::string& port,
                           double timeout_s, const char* spec) {
    auto start = std::chrono::steady_clock::now();
    uint64_t length = bytes;  // sent first, so that a stray program on the port is noticed
    if (rank == 0) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        int yes = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_ANY);
        addr.sin_port = htons((uint16_t)atoi(port.c_str()));
        if (fd < 0 || bind(fd, (sockaddr*)&addr, sizeof(addr)) != 0 || listen(fd, world) != 0) {
            fail("rendezvous '%s': rank 0 cannot listen on port %s: %s (pick a free port)", spec, port.c_str(), strerror(errno));
        }
        for (int served = 0; served < world - 1;) {
            pollfd p{fd, POLLIN, 0};
            if (poll(&p, 1, 100) > 0) {
                int peer = accept(fd, nullptr, nullptr);
                if (peer < 0) continue;
                socket_transfer(peer, &length, 8, true, spec);
                socket_transfer(peer, data, bytes, true, spec);
                close(peer);
                served++;
            }
            rendezvous_deadline_check(start, timeout_s, spec, rank);
        }
        close(fd);
        return;
    }
    for (;;) {
        addrinfo hints{}, *found = nullptr;
        hints.ai_family = AF_INET;
        hints.ai_socktype = SOCK_STREAM;
        if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) == 0) {
            int fd = socket(found->ai_family, found->ai_socktype, found->ai_protocol);
            bool connected = fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0;
            freeaddrinfo(found);
            if (connected) {
                uint64_t got = 0;
                socket_transfer(fd, &got, 8, false, spec);
                if (got != length) fail("rendezvous '%s': the peer sent %llu bytes, expected %zu: another program is on that port", spec, (unsigned long long)got, bytes);
                socket_transfer(fd, data, bytes, false, spec);
                close(fd);
                return;
            }
            if (fd >= 0) close(fd);
        }
        rendezvous_deadline_check(start, timeout_s, spec, rank);  // rank 0 may not be listening yet: retry
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
}

inline void rendezvous_share(void* data, size_t bytes, int rank, int world, const char* spec, double timeout_s) {
    if (world == 1) return;
    std::string s = spec ? spec : "";
    if (s.rfind("file:", 0) == 0 && s.size() > 5) return rendezvous_file(data, bytes, rank, s.substr(5), timeout_s, spec);
    size_t colon = s.rfind(':');
    if (s.rfind("tcp:", 0) == 0 && colon > 4 && colon + 1 < s.size()) {
        return rendezvous_tcp(data, bytes, rank, world, s.substr(4, colon - 4), s.substr(colon + 1), timeout_s, spec);
    }
    fail("LLMC_RENDEZVOUS='%s': expected file:PATH (a path on a filesystem every node shares) or tcp:HOST:PORT "
         "(rank 0's host name and a free port); without MPI, %d ranks need one of them to find each other", s.c_str(), world);
}
