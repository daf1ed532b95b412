// dataloader.h — which tokens each rank trains on, in what order, and how to resume.
//
// The data is a sorted list of token shards, read as one long stream. A micro-batch is B*T+1
// consecutive tokens: inputs are the first B*T, targets the same tokens shifted by one (the model
// predicts every next token). With `world` data-parallel ranks, the stream is cut into blocks of
// world*B*T tokens and rank r takes the r-th B*T of each block:
//
//     shard:  | r0 | r1 | r2 | r3 | r0 | r1 | r2 | r3 | ...      (world = 4)
//             <----- one step's micro-batch ----->
//
// so the ranks never see the same token in the same pass, and the union of their batches is what a
// single rank with `world` accumulation steps would read: data parallelism changes who computes,
// not what is computed. When fewer than world*B*T+1 tokens remain in a shard, the loader moves to
// the next shard (after the last one it wraps around and counts an epoch). The position (shard,
// offset, epoch) is all the state there is: saving it in a checkpoint makes resume exact.
//
// Shards are checked when opened: header, size, and every token id < vocab size (a shard made with
// another tokenizer would otherwise index outside the embedding table).
//
// Validation reads its split another way, so that its loss does not depend on B. Each shard is cut
// into windows of T+1 tokens at offsets 0, T, 2T, ... (a window's last token is the next one's
// first, as between the rows of a training micro-batch), the shards in order, and a validation
// scores the first N of these windows, whatever B is: B only decides how many windows a forward
// pass takes (llmc/run/run.h's evaluate_loss). Cutting the stream into micro-batches instead, as
// training does, made the scored share of the split depend on B: the same model scored 5.727 at
// B=4, 5.811 at B=8 and 5.916 on 40 batches of the main job (issue 40).
#pragma once

#include <algorithm>
#include <string>
#include <vector>
#include "llmc/io/formats.h"
#include "llmc/utils.h"

struct DataLoader {
    std::vector<std::string> files;
    int B = 0, T = 0;
    int rank = 0, world_size = 1;
    int vocab_size = 0;
    std::string role;            // "training data" or "validation data", for messages
    LoaderPosition pos;
    int64_t loaded_shard = -1;   // which shard `tokens` holds
    std::vector<uint16_t> tokens;
    std::vector<int> inputs, targets;  // B*T each: the current micro-batch
    int64_t tokens_per_epoch = 0;
    std::vector<int64_t> shard_tokens;  // each shard's token count, from its header
};

inline void dataloader_load_shard(DataLoader* dl, int64_t index) {
    if (dl->loaded_shard == index) return;
    const std::string& path = dl->files[(size_t)index];
    dl->tokens = read_token_shard(path);
    for (size_t i = 0; i < dl->tokens.size(); i++) {
        if (dl->tokens[i] >= dl->vocab_size) {
            fail("token %u at position %zu of %s '%s' is outside the model's vocabulary of %d: the data was "
                 "tokenized with a different vocabulary than this model uses",
                 dl->tokens[i], i, dl->role.c_str(), path.c_str(), dl->vocab_size);
        }
    }
    dl->loaded_shard = index;
}

inline void dataloader_init(DataLoader* dl, const std::string& pattern, int B, int T, int rank, int world_size,
                            int vocab_size, const char* role, const char* flag) {
    dl->files = expand_glob(pattern);
    if (dl->files.empty()) {
        fail("no files match %s '%s' (%s). Prepare the default corpus with scripts/get_corpus.sh moby-dick, "
             "or point %s at your own shards", flag, pattern.c_str(), role, flag);
    }
    dl->B = B;
    dl->T = T;
    dl->rank = rank;
    dl->world_size = world_size;
    dl->vocab_size = vocab_size;
    dl->role = role;
    // Check every shard's header and size up front: a bad shard should stop the run now, not in a day.
    int64_t needed = (int64_t)world_size * B * T + 1;
    dl->tokens_per_epoch = 0;
    dl->shard_tokens.clear();
    for (const std::string& path : dl->files) {
        FILE* f = open_for_reading(path, "token shard");
        int64_t count = read_token_shard_header(f, path);
        fclose(f);
        if (count < needed) {
            fail("%s shard '%s' has %lld tokens, fewer than one step needs (%d ranks x B=%d x T=%d + 1 = %lld). "
                 "Use a smaller --batch-size or --seq-len, or larger shards",
                 role, path.c_str(), (long long)count, world_size, B, T, (long long)needed);
        }
        dl->tokens_per_epoch += count;
        dl->shard_tokens.push_back(count);
    }
    dl->inputs.assign((size_t)B * T, 0);
    dl->targets.assign((size_t)B * T, 0);
    dl->pos = LoaderPosition{};
    dl->loaded_shard = -1;
    dataloader_load_shard(dl, 0);
}

inline void dataloader_reset(DataLoader* dl) {
    dl->pos = LoaderPosition{};
    dataloader_load_shard(dl, 0);
}

// Continues from a checkpoint's position. The position was valid for the run that wrote it; this run
// may read other shards, or take another B, T or rank count from the same token. A position outside
// the shard is refused: it cannot have come from a run over this data. A position inside the shard without room for one more step of THIS geometry moves to the
// next shard, as dataloader_next_batch would have: the run continues, never reading past the tokens,
// and (when `announce`: the rank that prints) says so.
inline void dataloader_seek(DataLoader* dl, const LoaderPosition& pos, bool announce) {
    if (pos.shard_index < 0 || pos.shard_index >= (int64_t)dl->files.size() || pos.epoch < 0) {
        fail("the checkpoint's data position (shard %lld, epoch %lld) does not exist in the %zu shard%s of %s; "
             "resume with the same data", (long long)pos.shard_index, (long long)pos.epoch, dl->files.size(),
             dl->files.size() == 1 ? "" : "s", dl->role.c_str());
    }
    dataloader_load_shard(dl, pos.shard_index);
    int64_t size = (int64_t)dl->tokens.size(), step_tokens = (int64_t)dl->world_size * dl->B * dl->T;
    if (pos.position < 0 || pos.position >= size) {
        fail("the checkpoint's data position (token %lld of shard %lld) is outside that shard of %s, '%s', which has %lld "
             "tokens: the data changed since the checkpoint; resume with the same data",
             (long long)pos.position, (long long)pos.shard_index, dl->role.c_str(),
             dl->files[(size_t)pos.shard_index].c_str(), (long long)size);
    }
    dl->pos = pos;
    if (pos.position + step_tokens + 1 <= size) return;
    dl->pos.position = 0;
    dl->pos.shard_index++;
    if (dl->pos.shard_index == (int64_t)dl->files.size()) dl->pos.shard_index = 0, dl->pos.epoch++;
    dataloader_load_shard(dl, dl->pos.shard_index);
    if (announce) printf("data: the checkpoint's position (token %lld of shard %lld) leaves no room for a step of %lld tokens "
                     "there; continuing at the start of shard %lld\n", (long long)pos.position, (long long)pos.shard_index,
                     (long long)step_tokens + 1, (long long)dl->pos.shard_index);
}

// Fills dl->inputs and dl->targets with this rank's next micro-batch and advances the position.
inline void dataloader_next_batch(DataLoader* dl) {
    size_t bt = (size_t)dl->B * dl->T;
    const uint16_t* src = dl->tokens.data() + dl->pos.position + (int64_t)dl->rank * (int64_t)bt;
    for (size_t i = 0; i < bt; i++) {
        dl->inputs[i] = src[i];
        dl->targets[i] = src[i + 1];
    }
    int64_t step_tokens = (int64_t)dl->world_size * (int64_t)bt;
    dl->pos.position += step_tokens;
    if (dl->pos.position + step_tokens + 1 > (int64_t)dl->tokens.size()) {
        dl->pos.position = 0;
        dl->pos.shard_index++;
        if (dl->pos.shard_index == (int64_t)dl->files.size()) {
            dl->pos.shard_index = 0;
            dl->pos.epoch++;
        }
        dataloader_load_shard(dl, dl->pos.shard_index);
    }
}

// Validation's windows (above): how many a validation of `max_tokens` scored tokens takes, the
// whole split when it has fewer (or when max_tokens is 0). Each window scores T tokens.
inline int64_t validation_windows(const DataLoader& dl, int64_t max_tokens) {
    int64_t all = 0;
    for (int64_t count : dl.shard_tokens) all += (count - 1) / dl.T;
    return max_tokens > 0 ? std::min(all, (max_tokens + dl.T - 1) / dl.T) : all;
}

// Where the next validation window starts.
struct WindowCursor {
    int64_t shard = 0, offset = 0;
};

// Copies the window at `c` into row `row` of dl->inputs and dl->targets, and moves `c` to the next one.
inline void validation_read_window(DataLoader* dl, WindowCursor* c, int row) {
    int T = dl->T;
    while (c->offset + T + 1 > dl->shard_tokens[(size_t)c->shard]) c->shard++, c->offset = 0;
    dataloader_load_shard(dl, c->shard);
    const uint16_t* src = dl->tokens.data() + c->offset;
    for (int t = 0; t < T; t++) {
        dl->inputs[(size_t)row * T + t] = src[t];
        dl->targets[(size_t)row * T + t] = src[t + 1];
    }
    c->offset += T;
}
