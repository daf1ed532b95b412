// token_shard_io.h — STAND-IN for the token-shard functions of llmc/formats.h (being written on
// main). Same signatures; at merge, delete this file and include llmc/formats.h instead.
//
// The format is llm.c's: a header of 256 int32 (header[0] = 20240520 magic, header[1] = 1 version,
// header[2] = number of tokens, the rest 0), then the tokens as uint16 little-endian. uint16 holds
// ids up to 65535, enough for GPT-2's 50,257 and half the file size of int32.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static const int TOKEN_SHARD_MAGIC = 20240520;
static const int TOKEN_SHARD_VERSION = 1;

[[noreturn]] inline void token_shard_fail(const std::string& message) {
    fprintf(stderr, "error: %s\n", message.c_str());
    exit(1);
}

// Writes atomically: to "<path>.tmp", then rename(), so a crash never leaves a half shard
// under the real name.
inline void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
    int32_t header[256] = {0};
    header[0] = TOKEN_SHARD_MAGIC;
    header[1] = TOKEN_SHARD_VERSION;
    header[2] = (int32_t)tokens.size();
    if (tokens.size() > 0x7fffffffu) token_shard_fail(path + ": too many tokens for one shard");
    std::string temporary = path + ".tmp";
    FILE* f = fopen(temporary.c_str(), "wb");
    if (!f) token_shard_fail("cannot write " + temporary + ": " + strerror(errno));
    bool ok = fwrite(header, sizeof header, 1, f) == 1 &&
              fwrite(tokens.data(), sizeof(uint16_t), tokens.size(), f) == tokens.size();
    ok = (fclose(f) == 0) && ok;
    if (!ok) token_shard_fail("failed writing " + temporary + " (disk full?)");
    if (rename(temporary.c_str(), path.c_str()) != 0)
        token_shard_fail("cannot rename " + temporary + " to " + path + ": " + strerror(errno));
}

inline std::vector<uint16_t> read_token_shard(const std::string& path) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) token_shard_fail("cannot read " + path + ": " + strerror(errno));
    int32_t header[256];
    if (fread(header, sizeof header, 1, f) != 1) token_shard_fail(path + " is too short to be a token shard");
    if (header[0] != TOKEN_SHARD_MAGIC)
        token_shard_fail(path + " is not a token shard (bad magic number); make it with ./prepare_data");
    if (header[1] != TOKEN_SHARD_VERSION)
        token_shard_fail(path + " has token-shard version " + std::to_string(header[1]) + ", expected 1");
    std::vector<uint16_t> tokens((size_t)header[2]);
    size_t got = fread(tokens.data(), sizeof(uint16_t), tokens.size(), f);
    bool at_end = fgetc(f) == EOF;
    fclose(f);
    if (got != tokens.size() || !at_end)
        token_shard_fail(path + ": the header says " + std::to_string(header[2]) +
                         " tokens but the file size disagrees (truncated or corrupt)");
    return tokens;
}
