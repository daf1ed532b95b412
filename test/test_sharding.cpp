// test_sharding.cpp — the ZeRO sharding arithmetic of llmc/parallel/sharding.h, checked exhaustively on
// small cases and on real GPT-2 layouts: every parameter is owned by exactly one rank, shards are
// equal and aligned, the per-tensor pieces reassemble each tensor, and the overlaps used to reshard
// a checkpoint from one world size to another cover every parameter exactly once.
#include <cstdio>
#include <string>
#include <vector>
#include "llmc/parallel/sharding.h"
#include "test/checks.h"

// Returns "" if the layout is right, else what is wrong.
static std::string layout_problem(size_t total, int world, size_t granule) {
    ShardLayout s = shard_layout(total, world, granule);
    std::string where = strprintf("P=%zu N=%d g=%zu: ", total, world, granule);
    if (s.padded_total < total) return where + "padded total smaller than the total";
    if (s.padded_total % ((size_t)world * granule) != 0) return where + "padded total not a multiple of N*granule";
    if (s.padded_total - total >= (size_t)world * granule && total > 0) return where + "more padding than needed";
    if (s.shard_size * world != s.padded_total) return where + "shards do not add up to the padded total";
    size_t next = 0, owned = 0;
    for (int r = 0; r < world; r++) {
        ShardRange sr = shard_range(s, r), own = owned_range(s, r);
        if (sr.begin != next) return where + strprintf("shard %d starts at %zu, expected %zu (gap or overlap)", r, sr.begin, next);
        if (sr.size() != s.shard_size) return where + strprintf("shard %d has %zu elements, not %zu", r, sr.size(), s.shard_size);
        if (sr.begin % granule != 0) return where + strprintf("shard %d starts at %zu, not a multiple of the granule", r, sr.begin);
        if (own.size() > 0 && (own.begin < sr.begin || own.end > sr.end || own.end > total)) return where + strprintf("owned range of %d escapes its shard", r);
        if (own.size() > 0 && own.begin != owned) return where + strprintf("owned range of %d does not continue at %zu", r, owned);
        owned += own.size();
        next = sr.end;
    }
    if (next != s.padded_total) return where + "shards do not reach the padded total";
    if (owned != total) return where + strprintf("owned ranges cover %zu elements, not %zu", owned, total);
    return "";
}

// The pieces of every rank's shard, concatenated in rank order, must be the tensors in order,
// each exactly once, and every piece must lie inside its tensor and its shard.
static std::string pieces_problem(const ParamLayout& layout, int world) {
    ShardLayout s = shard_layout(layout.total, world);
    std::vector<size_t> covered(NUM_PARAM_TENSORS, 0);
    size_t next = 0;
    for (int r = 0; r < world; r++) {
        ShardRange sr = shard_range(s, r);
        for (const TensorPiece& p : shard_pieces(layout, sr)) {
            if (p.begin != next) return strprintf("N=%d rank %d: piece of %s starts at %zu, expected %zu", world, r, param_tensor_name(p.tensor), p.begin, next);
            if (p.begin < layout.offset[p.tensor] || p.end > layout.offset[p.tensor] + layout.count[p.tensor])
                return strprintf("N=%d: piece of %s outside the tensor", world, param_tensor_name(p.tensor));
            if (p.begin < sr.begin || p.end > sr.end) return strprintf("N=%d: piece outside shard %d", world, r);
            if (p.end <= p.begin) return strprintf("N=%d: empty piece of %s", world, param_tensor_name(p.tensor));
            covered[p.tensor] += p.end - p.begin;
            next = p.end;
        }
    }
    for (int t = 0; t < NUM_PARAM_TENSORS; t++)
        if (covered[t] != layout.count[t]) return strprintf("N=%d: %s covered %zu of %zu elements", world, param_tensor_name(t), covered[t], layout.count[t]);
    if (next != layout.total) return strprintf("N=%d: pieces end at %zu, not %zu", world, next, layout.total);
    return "";
}

// Resharding: a checkpoint written by `old_world` ranks is read by `new_world` ranks; each new rank
// takes the overlap of its owned range with every old owned range. Every element of every new
// owned range must come from exactly one old file.
static std::string reshard_problem(size_t total, int old_world, int new_world) {
    ShardLayout old_s = shard_layout(total, old_world), new_s = shard_layout(total, new_world);
    for (int r = 0; r < new_world; r++) {
        ShardRange mine = owned_range(new_s, r);
        size_t next = mine.begin;
        for (int q = 0; q < old_world; q++) {
            ShardRange part = range_overlap(mine, owned_range(old_s, q));
            if (part.size() == 0) continue;
            if (part.begin != next) return strprintf("P=%zu %d->%d: rank %d gets [%zu,...) from old rank %d, expected %zu", total, old_world, new_world, r, part.begin, q, next);
            next = part.end;
        }
        if (next != mine.end) return strprintf("P=%zu %d->%d: rank %d covered up to %zu of [%zu,%zu)", total, old_world, new_world, r, next, mine.begin, mine.end);
    }
    return "";
}

static ParamLayout fake_layout(const std::vector<size_t>& counts) {
    ParamLayout l;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        l.count[t] = t < (int)counts.size() ? counts[t] : 0;
        l.offset[t] = l.total;
        l.total += l.count[t];
    }
    return l;
}

int main() {
    // 1. layouts: all small sizes, world sizes 1..9, several granules, plus large and odd ones
    std::string problem;
    int cases = 0;
    for (size_t total = 0; total <= 300 && problem.empty(); total++)
        for (int world = 1; world <= 9 && problem.empty(); world++)
            for (size_t granule : {1, 3, 16, 64}) {
                problem = layout_problem(total, world, granule);
                cases++;
                if (!problem.empty()) break;
            }
    for (size_t total : {(size_t)124475904, (size_t)1557686400, (size_t)1000003})
        for (int world : {1, 2, 3, 7, 8, 64, 1024})
            if (problem.empty()) problem = layout_problem(total, world, SHARD_GRANULE), cases++;
    check(problem.empty(), strprintf("shards cover [0, padded) equal, aligned, without overlap (%d layouts)", cases), problem);

    // 2. concrete numbers, so that a wrong formula cannot pass by being consistently wrong
    ShardLayout d12 = shard_layout(124475904, 8);
    check(d12.padded_total == 124475904 && d12.shard_size == 15559488, "GPT-2 124M on 8 ranks: no padding needed, shard 15,559,488",
          strprintf("padded %zu shard %zu", d12.padded_total, d12.shard_size));
    ShardLayout odd = shard_layout(1000, 3, 64);  // 1000 -> 1152 = 3 * 384
    check(odd.padded_total == 1152 && odd.shard_size == 384 && owned_range(odd, 2).begin == 768 && owned_range(odd, 2).end == 1000,
          "1000 params on 3 ranks, granule 64: padded 1152, rank 2 owns [768, 1000)",
          strprintf("padded %zu shard %zu rank 2 [%zu, %zu)", odd.padded_total, odd.shard_size, owned_range(odd, 2).begin, owned_range(odd, 2).end));

    // 3. more ranks than parameters: the first rank owns them all, the others only padding
    ShardLayout tiny = shard_layout(10, 8, 64);
    bool ok = tiny.shard_size == 64 && owned_range(tiny, 0).size() == 10;
    for (int r = 1; r < 8; r++) ok = ok && owned_range(tiny, r).size() == 0 && shard_range(tiny, r).size() == 64;
    check(ok, "world larger than the parameter count: rank 0 owns all 10, ranks 1-7 own none", strprintf("shard %zu", tiny.shard_size));
    ShardLayout none = shard_layout(0, 4, 64);
    check(none.padded_total == 256 && owned_range(none, 3).size() == 0, "zero parameters: one granule of padding per rank, nothing owned",
          strprintf("padded %zu", none.padded_total));

    // 4. tensor pieces on real GPT-2 layouts and on layouts with empty and tiny tensors
    problem.clear();
    const char* descriptors[] = {"L=2,C=64,H=4,T=32,V=512", "L=1,C=8,H=2,T=4,V=3", "d12"};
    for (const char* d : descriptors) {
        GPT2Config cfg;
        parse_model_descriptor(d, &cfg);
        for (int world : {1, 2, 3, 4, 5, 8, 13, 64})
            if (problem.empty()) problem = pieces_problem(param_layout(cfg), world);
    }
    std::vector<std::vector<size_t>> fakes = {{0, 5, 0, 1, 0, 0, 7}, {1}, {}, {100, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3}};
    for (const auto& counts : fakes)
        for (int world = 1; world <= 6; world++)
            if (problem.empty()) problem = pieces_problem(fake_layout(counts), world);
    check(problem.empty(), "tensor pieces of all shards reassemble every tensor once, in order", problem);

    // a shard that starts inside one tensor and ends inside another is cut at the boundary
    ParamLayout l3 = fake_layout({10, 10, 10});
    std::vector<TensorPiece> p = shard_pieces(l3, {5, 25});
    check(p.size() == 3 && p[0].tensor == 0 && p[0].begin == 5 && p[0].end == 10 && p[1].tensor == 1 && p[1].begin == 10 &&
              p[1].end == 20 && p[2].tensor == 2 && p[2].begin == 20 && p[2].end == 25,
          "range [5, 25) over tensors of 10: pieces [5,10) [10,20) [20,25)", strprintf("%zu pieces", p.size()));
    check(shard_pieces(l3, {30, 64}).empty(), "a range of padding only has no pieces", "pieces found past the last tensor");

    // 5. range overlap
    ShardRange a = range_overlap({0, 10}, {5, 20}), b = range_overlap({0, 10}, {10, 20}), c = range_overlap({15, 20}, {0, 10});
    check(a.begin == 5 && a.end == 10 && b.size() == 0 && c.size() == 0, "range_overlap: [0,10)&[5,20)=[5,10), touching and disjoint ranges are empty",
          strprintf("[%zu,%zu) %zu %zu", a.begin, a.end, b.size(), c.size()));

    // 6. resharding between every pair of world sizes 1..8 covers each new shard exactly once
    problem.clear();
    for (size_t total : {(size_t)1, (size_t)37, (size_t)1000, (size_t)134912})
        for (int w1 = 1; w1 <= 8; w1++)
            for (int w2 = 1; w2 <= 8; w2++)
                if (problem.empty()) problem = reshard_problem(total, w1, w2);
    check(problem.empty(), "resharding N -> M (1..8): every new shard is assembled from the old ones exactly once", problem);

    // 7. reduce to owners: any range, cut at shard boundaries, tiles the range in order, each piece
    // inside its owner's shard (every range of [0, padded) for small layouts)
    problem.clear();
    for (size_t total : {(size_t)1, (size_t)100, (size_t)1000})
        for (int world = 1; world <= 6 && problem.empty(); world++) {
            ShardLayout s = shard_layout(total, world, 16);
            for (size_t b = 0; b <= s.padded_total && problem.empty(); b++)
                for (size_t e = b; e <= s.padded_total && problem.empty(); e += 7) {
                    size_t next = b;
                    int last_rank = -1;
                    for (const OwnedPiece& q : shard_owners(s, {b, e})) {
                        ShardRange mine = shard_range(s, q.rank);
                        if (q.begin != next || q.end <= q.begin || q.begin < mine.begin || q.end > mine.end || q.rank <= last_rank)
                            problem = strprintf("P=%zu N=%d [%zu,%zu): bad piece [%zu,%zu) of rank %d", total, world, b, e, q.begin, q.end, q.rank);
                        next = q.end;
                        last_rank = q.rank;
                    }
                    if (problem.empty() && next != e) problem = strprintf("P=%zu N=%d [%zu,%zu): pieces end at %zu", total, world, b, e, next);
                }
        }
    check(problem.empty(), "shard_owners cuts any range at shard boundaries into pieces that tile it, each in its owner's shard", problem);
    ShardLayout three = shard_layout(1000, 3, 64);  // shards of 384
    std::vector<OwnedPiece> owners = shard_owners(three, {300, 800});
    check(owners.size() == 3 && owners[0].rank == 0 && owners[0].end == 384 && owners[1].rank == 1 && owners[1].begin == 384 &&
              owners[1].end == 768 && owners[2].rank == 2 && owners[2].begin == 768 && owners[2].end == 800,
          "[300, 800) over shards of 384: rank 0 [300,384), rank 1 [384,768), rank 2 [768,800)", strprintf("%zu pieces", owners.size()));

    // 8. gradient buckets: every parameter in exactly one bucket; bucket 0 is the last layer, the last
    // bucket the embeddings and the final LayerNorm
    problem.clear();
    for (const char* d : descriptors) {
        GPT2Config cfg;
        parse_model_descriptor(d, &cfg);
        ParamLayout layout = param_layout(cfg);
        int L = cfg.num_layers;
        std::vector<int> seen(layout.total, 0);
        for (int b = 0; b < gradient_bucket_count(L); b++)
            for (ShardRange r : gradient_bucket(layout, L, b))
                for (size_t i = r.begin; i < r.end; i++) seen[i]++;
        for (size_t i = 0; i < layout.total && problem.empty(); i++)
            if (seen[i] != 1) problem = strprintf("%s: parameter %zu is in %d buckets", d, i, seen[i]);
    }
    check(problem.empty(), "gradient buckets cover every parameter exactly once (3 model shapes)", problem);
    GPT2Config c12;
    parse_model_descriptor("d12", &c12);
    ParamLayout l12 = param_layout(c12);
    std::vector<ShardRange> first = gradient_bucket(l12, 12, 0), rest = gradient_bucket(l12, 12, 12);
    size_t last_bytes = 0;
    for (ShardRange r : rest) last_bytes += r.size();
    check(first.size() == 12 && first[2].begin == l12.offset[QKVW] + 11 * 3 * 768 * 768 && first[2].size() == 3 * 768 * 768 &&
              rest.size() == 4 && last_bytes == 50304 * 768 + 1024 * 768 + 2 * 768,
          "d12: bucket 0 is layer 11 (its qkvw slice starts 11 x 3C^2 into qkvw), bucket 12 is wte + wpe + lnf",
          strprintf("%zu ranges, qkvw at %zu, last bucket %zu elements", first.size(), first.size() > 2 ? first[2].begin : 0, last_bytes));

    return check_exit_code();
}
