// tokenizer.h — GPT-2's byte-level BPE tokenizer: text <-> token ids, exactly as OpenAI's.
//
// What it teaches: how GPT-2 turns arbitrary bytes into ids from a 50,257-entry vocabulary.
//   1. Pre-tokenization. A regex cuts the text into pieces, and BPE never merges across pieces:
//          's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      i.e. an English contraction; or an optional space and then a run of letters, or of numbers,
//      or of other symbols; or whitespace, where a run of whitespace before a word gives its last
//      space to that word (" world" is one piece, so "hello   world" -> "hello", "  ", " world").
//      pretoken_end() below is that regex written out by hand, branch by branch.
//   2. Byte-level BPE. Each piece starts as its UTF-8 bytes, one token per byte (so any input can be
//      encoded: no <unk>). vocab.bpe lists 50,000 merges, best first; repeatedly the adjacent pair
//      with the best (lowest) merge rank is replaced by the merged token, until no pair can merge.
//   3. The vocabulary file encoder.json names tokens by printable strings: GPT-2 maps every byte
//      to a visible Unicode character (bytes_to_unicode) so merges never involve spaces or control
//      characters. We undo that map when loading, so internally a token is just its bytes.
//
// Speed: text is Zipfian, so the same pieces (" the", " of", ".") come back constantly. A per-thread
// cache from piece bytes to token ids makes most pieces a hash lookup; BPE proper runs only on
// misses: a simple scan for short pieces, a heap for long ones (a 100 KB run of '=' is one piece)
// so that they cost O(n log n), not O(n^2).
// Long texts are split at places where the regex is guaranteed to start a fresh piece, and the
// parts are encoded on several threads; the result is identical to one thread (see next_safe_split).
//
// Invalid UTF-8: the regex works on characters, so bytes that are not valid UTF-8 are first
// replaced by U+FFFD exactly as the WHATWG TextDecoder does it: one U+FFFD per maximal invalid
// subsequence (a leading byte-order mark is kept as text, as with TextDecoder's ignoreBOM).
// decode(encode(x)) == x for every valid UTF-8 x.
//
// Unicode classes (\p{L}, \p{N}, \s) come from build/unicode_classes.h, which the Makefile generates
// from Debian's Unicode database (data/gen_unicode_classes.cpp): no ICU, no extra link flags.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "build/unicode_classes.h"
#include "llmc/io/json.h"

// ----------------------------------------------------------------------------------------------
// UTF-8

// Finds the first byte where `text` stops being valid UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF). Returns text.size() when all of it is valid.
inline size_t utf8_first_invalid(std::string_view text) {
    const unsigned char* s = (const unsigned char*)text.data();
    size_t n = text.size(), i = 0;
    while (i < n) {
        // Fast path: 8 ASCII bytes at a time (no byte has its top bit set).
        if (i + 8 <= n) {
            uint64_t word;
            memcpy(&word, s + i, 8);
            if ((word & 0x8080808080808080ull) == 0) { i += 8; continue; }
        }
        unsigned char c = s[i];
        if (c < 0x80) { i++; continue; }
        int need;
        unsigned char lower = 0x80, upper = 0xBF;   // allowed range of the first continuation byte
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) { need = 2; lower = 0xA0; }   // no overlong 3-byte forms
        else if (c == 0xED) { need = 2; upper = 0x9F; }   // no surrogates D800-DFFF
        else if (c >= 0xE1 && c <= 0xEF) need = 2;
        else if (c == 0xF0) { need = 3; lower = 0x90; }   // no overlong 4-byte forms
        else if (c == 0xF4) { need = 3; upper = 0x8F; }   // nothing above U+10FFFF
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else return i;
        if (i + need >= n) return i;   // truncated at the end of the text
        if (s[i + 1] < lower || s[i + 1] > upper) return i;
        for (int k = 2; k <= need; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF) return i;
        i += need + 1;
    }
    return n;
}

// Returns `text` with each maximal invalid UTF-8 subsequence replaced by U+FFFD (EF BF BD):
// the WHATWG "decode" algorithm, so our tokens for invalid input match what JavaScript sees.
inline std::string utf8_replace_invalid(std::string_view text) {
    const unsigned char* s = (const unsigned char*)text.data();
    size_t n = text.size(), i = 0;
    std::string out;
    out.reserve(n + 16);
    const char* REPLACEMENT = "\xEF\xBF\xBD";
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) { out += (char)c; i++; continue; }
        int need;
        unsigned char lower = 0x80, upper = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) { need = 2; lower = 0xA0; }
        else if (c == 0xED) { need = 2; upper = 0x9F; }
        else if (c >= 0xE1 && c <= 0xEF) need = 2;
        else if (c == 0xF0) { need = 3; lower = 0x90; }
        else if (c == 0xF4) { need = 3; upper = 0x8F; }
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else { out += REPLACEMENT; i++; continue; }   // a byte that can never start a character
        // Take continuation bytes while they fit; the first misfit ends the invalid subsequence
        // and is looked at again as the start of the next character.
        size_t j = i + 1;
        int got = 0;
        while (got < need && j < n && s[j] >= lower && s[j] <= upper) {
            j++;
            got++;
            lower = 0x80;
            upper = 0xBF;
        }
        if (got == need) out.append((const char*)s + i, j - i);
        else out += REPLACEMENT;
        i = j;
    }
    return out;
}

// Decodes the code point at s[i] of valid UTF-8, storing its length in bytes in *len.
inline uint32_t utf8_decode_valid(const unsigned char* s, size_t i, int* len) {
    unsigned char c = s[i];
    if (c < 0x80) { *len = 1; return c; }
    if (c < 0xE0) { *len = 2; return ((uint32_t)(c & 0x1F) << 6) | (s[i + 1] & 0x3F); }
    if (c < 0xF0) {
        *len = 3;
        return ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
    }
    *len = 4;
    return ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[i + 1] & 0x3F) << 12) |
           ((uint32_t)(s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F);
}

// ----------------------------------------------------------------------------------------------
// Pre-tokenization

enum CharClass { CHAR_OTHER = 0, CHAR_LETTER = 1, CHAR_NUMBER = 2, CHAR_SPACE = 3 };

inline int char_class(uint32_t cp) {
    return unicode_class_stage2[unicode_class_stage1[cp >> 8] * 256 + (cp & 255)];
}

// Class of the character at s[i] of valid UTF-8; its length goes to *len.
inline int char_class_at(const unsigned char* s, size_t i, int* len) {
    if (s[i] < 0x80) { *len = 1; return unicode_class_stage2[s[i]]; }   // block 0 holds ASCII
    return char_class(utf8_decode_valid(s, i, len));
}

// Where the pre-tokenization piece starting at byte `start` of valid UTF-8 `text` ends.
// Each branch is one alternative of the regex, tried in the regex's order (first match wins).
inline size_t pretoken_end(std::string_view text, size_t start) {
    const unsigned char* s = (const unsigned char*)text.data();
    size_t n = text.size();
    unsigned char c = s[start];

    // 's|'t|'re|'ve|'m|'ll|'d — case-sensitive, ASCII apostrophe only.
    if (c == '\'' && start + 1 < n) {
        unsigned char c1 = s[start + 1];
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return start + 2;
        if (start + 2 < n) {
            unsigned char c2 = s[start + 2];
            if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
                return start + 3;
        }
    }

    //  ?\p{L}+ |  ?\p{N}+ |  ?[^\s\p{L}\p{N}]+ — an optional space (U+0020 only), then a run
    // of one class. A space followed by whitespace or by nothing is left to the whitespace rules.
    int len;
    int run_class = char_class_at(s, start, &len);
    size_t pos = start;
    if (c == ' ' && start + 1 < n) {
        int next_len;
        int next_class = char_class_at(s, start + 1, &next_len);
        if (next_class != CHAR_SPACE) {
            run_class = next_class;
            pos = start + 1;
        }
    }
    if (run_class != CHAR_SPACE) {
        while (pos < n && char_class_at(s, pos, &len) == run_class) pos += len;
        return pos;
    }

    // \s+(?!\S) | \s+ — take the whole whitespace run, but when something non-space follows and
    // the run is longer than one character, give its last character back: the look-ahead (?!\S)
    // fails right before the non-space, so the regex backtracks by one. That last character then
    // starts the next piece (a space joins the following word; anything else stands alone).
    size_t end = start, last_char_start = start;
    while (end < n && char_class_at(s, end, &len) == CHAR_SPACE) {
        last_char_start = end;
        end += len;
    }
    if (end < n && last_char_start > start) return last_char_start;
    return end;
}

// The first position q >= from where the text can be cut in two and the halves encoded separately
// with exactly the tokens of the whole; text.size() if there is none. Rule: text[q-1] is one of
// TAB LF VT FF CR, standing alone (the character before it is not whitespace), and text[q] is not
// whitespace. Why this is safe:
//   - text[q-1] ends a piece in the whole text: no branch of the regex can hold it together with
//     a following non-space (only a U+0020 space may prefix a word);
//   - the left half ends with a one-character whitespace run, which is one piece whether the text
//     ends there (\s+(?!\S) takes it) or a word follows (\s+ takes it). A longer run would differ:
//     before a word the regex gives the run's last character back, at the end of text it does not;
//   - the regex has no look-behind, so the pieces from q on depend only on text[q..].
inline size_t next_safe_split(std::string_view text, size_t from) {
    const unsigned char* s = (const unsigned char*)text.data();
    size_t n = text.size();
    for (size_t q = std::max<size_t>(from, 2); q < n; q++) {
        unsigned char prev = s[q - 1];
        if (prev < 0x09 || prev > 0x0D) continue;
        int len;
        if (char_class_at(s, q, &len) == CHAR_SPACE) continue;
        size_t before = q - 2;   // back up to the first byte of the character before text[q-1]
        while (before > 0 && (s[before] & 0xC0) == 0x80) before--;
        if (char_class_at(s, before, &len) != CHAR_SPACE) return q;
    }
    return n;
}

// ----------------------------------------------------------------------------------------------
// The tokenizer

inline std::atomic<uint64_t> tokenizer_next_instance_id{1};

// GPT-2's bytes_to_unicode: bytes that are printable Latin-1 characters ('!'..'~', '¡'..'¬',
// '®'..'ÿ') stand for themselves; the other 68 bytes (controls, space, soft hyphen...) are given
// the code points 256, 257, ... in byte order. Returns the code point standing for each byte.
inline std::vector<uint32_t> gpt2_byte_to_unicode() {
    std::vector<uint32_t> map(256);
    uint32_t next_extra = 256;
    for (uint32_t b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        map[b] = printable ? b : next_extra++;
    }
    return map;
}

struct Tokenizer {
    std::vector<std::string> token_bytes;   // id -> the bytes it stands for ("" for unused ids)
    int byte_token[256];                    // byte -> the id of the one-byte token
    int eot_token = 50256;                  // <|endoftext|>: separates documents
    int vocab_size = 0;                     // largest id + 1 (50257 for GPT-2)
    int num_merges = 0;

    // The merge table: (left id, right id) -> (rank, merged id), in an open-addressing hash table
    // (linear probing, power-of-two size, at most half full), because BPE asks it in its inner loop.
    struct Merge {
        uint64_t pair = EMPTY;
        int rank = 0;
        int merged = 0;
    };
    static constexpr uint64_t EMPTY = ~0ull;
    std::vector<Merge> merge_table;
    uint64_t merge_mask = 0;
    uint64_t instance_id = 0;   // names this vocabulary to the per-thread piece caches

    static uint64_t pair_key(int left, int right) { return ((uint64_t)(uint32_t)left << 32) | (uint32_t)right; }
    static uint64_t mix64(uint64_t x) {
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 33;
        return x;
    }

    const Merge* find_merge(int left, int right) const {
        uint64_t key = pair_key(left, right);
        for (uint64_t slot = mix64(key) & merge_mask;; slot = (slot + 1) & merge_mask) {
            const Merge& m = merge_table[slot];
            if (m.pair == key) return &m;
            if (m.pair == EMPTY) return nullptr;
        }
    }

    // Loads GPT-2's encoder.json (token string -> id) and vocab.bpe (the merges, best first).
    // On a missing or corrupt file: when `error` is null, prints "error: ..." and exits 1; otherwise
    // fills *error and returns false (a trainer can then print token ids instead of text).
    bool load(const std::string& encoder_json_path, const std::string& vocab_bpe_path, std::string* error = nullptr) {
        std::string problem = load_or_explain(encoder_json_path, vocab_bpe_path);
        if (problem.empty()) return true;
        if (error) { *error = problem; return false; }
        fprintf(stderr, "error: %s\n", problem.c_str());
        exit(1);
    }

    // ---- encode

    // Token ids of `text`, treated as ordinary text: "<|endoftext|>" inside it is encoded as the
    // characters it is made of, not as the special token (like tiktoken's encode_ordinary).
    std::vector<int> encode(std::string_view text) const {
        std::vector<int> tokens;
        if (utf8_first_invalid(text) == text.size()) {
            encode_valid_utf8(text, tokens);
        } else {
            std::string replaced = utf8_replace_invalid(text);
            encode_valid_utf8(replaced, tokens);
        }
        return tokens;
    }

    // The same tokens as encode(text), computed on up to `threads` threads.
    std::vector<int> encode_parallel(std::string_view text, int threads) const {
        std::string replaced;
        if (utf8_first_invalid(text) != text.size()) {
            replaced = utf8_replace_invalid(text);
            text = replaced;
        }
        std::vector<size_t> bounds = split_points(text, threads);
        std::vector<std::vector<int>> parts(bounds.size() - 1);
        #pragma omp parallel for schedule(dynamic, 1) num_threads(threads > 0 ? threads : 1)
        for (long i = 0; i < (long)parts.size(); i++)
            encode_valid_utf8(text.substr(bounds[i], bounds[i + 1] - bounds[i]), parts[i]);
        std::vector<int> tokens;
        size_t total = 0;
        for (auto& part : parts) total += part.size();
        tokens.reserve(total);
        for (auto& part : parts) tokens.insert(tokens.end(), part.begin(), part.end());
        return tokens;
    }

    // Cut points 0 = b0 < b1 < ... < bk = text.size() for encoding the parts independently:
    // about 8 parts per thread (so a slow part does not hold the others up), of 64 KB to 1 MB
    // (small enough for a progress display to move, large enough that a part costs no overhead).
    static std::vector<size_t> split_points(std::string_view text, int threads) {
        std::vector<size_t> bounds = {0};
        size_t target = std::clamp<size_t>(text.size() / (size_t)(std::max(threads, 1) * 8), 64 * 1024, 1024 * 1024);
        while (threads > 1 && bounds.back() + target < text.size()) {
            size_t cut = next_safe_split(text, bounds.back() + target);
            if (cut >= text.size()) break;
            bounds.push_back(cut);
        }
        bounds.push_back(text.size());
        return bounds;
    }

    // Appends the tokens of `text`, which must be valid UTF-8, to `out`. Thread-safe.
    void encode_valid_utf8(std::string_view text, std::vector<int>& out) const {
        PieceCache& cache = thread_cache();
        for (size_t start = 0; start < text.size();) {
            size_t end = pretoken_end(text, start);
            encode_piece(text.substr(start, end - start), cache, out);
            start = end;
        }
    }

    // Forgets the cached pieces (used by benchmarks, to time a cold start).
    void reset_cache() { instance_id = tokenizer_next_instance_id++; }

    // ---- decode

    // The bytes of one token, for printing samples as they are generated. Note a character may be
    // split across tokens, so one token's bytes need not be valid UTF-8 on their own.
    std::string decode_token(int id) const {
        if (id < 0 || id >= vocab_size || token_bytes[id].empty())
            return "<|invalid token " + std::to_string(id) + "|>";
        return token_bytes[id];
    }

    std::string decode(const int* tokens, size_t count) const {
        std::string text;
        for (size_t i = 0; i < count; i++) text += decode_token(tokens[i]);
        return text;
    }
    std::string decode(const std::vector<int>& tokens) const { return decode(tokens.data(), tokens.size()); }

    // ---- internals

    // A per-thread cache from piece bytes to token ids, in an open-addressing hash table. A lookup is
    // limited by memory latency, not arithmetic, so an entry is laid out to answer the common case
    // from the one cache line the probe already loaded: most pieces are at most 8 bytes and most
    // encode to one token, so the key's first 8 bytes and a single token id sit in the entry itself;
    // only longer keys and multi-token answers reach into the `keys` and `tokens` arenas.
    // It grows by doubling up to MAX_ENTRIES, then starts over empty (a crude but bounded
    // eviction: under 80 MB per thread).
    struct PieceCache {
        struct Entry {
            uint64_t prefix = 0;         // the key's first 8 bytes, zero-padded
            uint32_t key_length = 0;     // 0 marks an empty slot
            uint32_t key_offset = 0;     // the whole key in `keys` (read only when longer than 8)
            uint32_t token_count = 0;
            uint32_t tokens = 0;         // the token itself if token_count == 1, else an offset in `tokens`
        };
        static constexpr size_t MAX_ENTRIES = 1 << 20;
        uint64_t owner = 0;   // instance_id of the tokenizer whose tokens these are
        std::vector<Entry> slots;
        size_t used = 0;
        std::string keys;
        std::vector<int> tokens;
        // Scratch space for BPE, kept to avoid allocating per piece.
        struct Symbol { int id, prev, next; };
        struct Candidate { int rank, left, right, left_id, right_id, merged; };
        std::vector<Symbol> symbols;
        std::vector<Candidate> heap;

        void clear(size_t capacity) {
            slots.assign(capacity, Entry());
            used = 0;
            keys.clear();
            tokens.clear();
        }
    };

    PieceCache& thread_cache() const {
        static thread_local PieceCache cache;
        if (cache.owner != instance_id) {
            cache.owner = instance_id;
            cache.clear(4096);
        }
        return cache;
    }

    // The first (up to) 8 bytes of a piece as one integer, so short keys compare in one instruction.
    static uint64_t key_prefix(std::string_view piece) {
        uint64_t prefix = 0;
        size_t n = std::min<size_t>(piece.size(), 8);
        for (size_t i = 0; i < n; i++) prefix |= (uint64_t)(unsigned char)piece[i] << (8 * i);
        return prefix;
    }

    static uint64_t hash_piece(uint64_t prefix, std::string_view piece) {
        uint64_t h = mix64(prefix ^ (piece.size() * 0x9E3779B97F4A7C15ull));
        for (size_t i = 8; i < piece.size(); i += 8) {
            uint64_t word = 0;
            memcpy(&word, piece.data() + i, std::min<size_t>(8, piece.size() - i));
            h = mix64(h ^ word) * 0x9E3779B97F4A7C15ull;
        }
        return mix64(h);
    }

    void encode_piece(std::string_view piece, PieceCache& cache, std::vector<int>& out) const {
        if (piece.size() == 1) {   // a single byte is always its own token
            out.push_back(byte_token[(unsigned char)piece[0]]);
            return;
        }
        uint64_t prefix = key_prefix(piece);
        size_t mask = cache.slots.size() - 1;
        size_t slot = hash_piece(prefix, piece) & mask;
        for (;; slot = (slot + 1) & mask) {
            const PieceCache::Entry& e = cache.slots[slot];
            if (e.key_length == 0) break;
            if (e.prefix == prefix && e.key_length == piece.size() &&
                (piece.size() <= 8 || memcmp(cache.keys.data() + e.key_offset + 8, piece.data() + 8, piece.size() - 8) == 0)) {
                if (e.token_count == 1) out.push_back((int)e.tokens);
                else out.insert(out.end(), cache.tokens.begin() + e.tokens, cache.tokens.begin() + e.tokens + e.token_count);
                return;
            }
        }
        // A miss: run BPE, then remember the answer.
        size_t first = out.size();
        bpe(piece, cache, out);
        if (piece.size() > 256) return;   // rare long pieces would only bloat the cache
        if ((cache.used + 1) * 2 > cache.slots.size()) {
            grow_cache(cache);
            mask = cache.slots.size() - 1;
            for (slot = hash_piece(prefix, piece) & mask; cache.slots[slot].key_length != 0; slot = (slot + 1) & mask) {}
        }
        PieceCache::Entry& e = cache.slots[slot];
        e.prefix = prefix;
        e.key_length = (uint32_t)piece.size();
        e.key_offset = (uint32_t)cache.keys.size();
        e.token_count = (uint32_t)(out.size() - first);
        if (e.token_count == 1) {
            e.tokens = (uint32_t)out[first];
        } else {
            e.tokens = (uint32_t)cache.tokens.size();
            cache.tokens.insert(cache.tokens.end(), out.begin() + first, out.end());
        }
        cache.keys.append(piece);
        cache.used++;
    }

    static void grow_cache(PieceCache& cache) {
        if (cache.slots.size() * 2 > 2 * PieceCache::MAX_ENTRIES) {   // full: start over
            cache.clear(cache.slots.size());
            return;
        }
        std::vector<PieceCache::Entry> old;
        old.swap(cache.slots);
        cache.slots.assign(old.size() * 2, PieceCache::Entry());
        size_t mask = cache.slots.size() - 1;
        for (const auto& e : old) {
            if (e.key_length == 0) continue;
            std::string_view key(cache.keys.data() + e.key_offset, e.key_length);
            size_t slot = hash_piece(e.prefix, key) & mask;
            while (cache.slots[slot].key_length != 0) slot = (slot + 1) & mask;
            cache.slots[slot] = e;
        }
    }

    // Byte-pair encoding of one piece, appended to `out`.
    void bpe(std::string_view piece, PieceCache& cache, std::vector<int>& out) const {
        if (piece.size() <= SHORT_PIECE) bpe_short(piece, out);
        else bpe_heap(piece, cache, out);
    }

    // Byte-pair encoding of a short piece (most are under 10 bytes): the symbols and the rank of each
    // adjacent pair sit in small arrays; each step scans for the best rank, merges, and looks up only
    // the two pairs the merge changed. O(n^2), but for n this small a scan beats a heap.
    static constexpr int SHORT_PIECE = 32;
    void bpe_short(std::string_view piece, std::vector<int>& out) const {
        const int NONE = 0x7fffffff;
        int n = (int)piece.size();
        int ids[SHORT_PIECE], ranks[SHORT_PIECE], merged[SHORT_PIECE];   // ranks[i]: pair (i, i+1)
        for (int i = 0; i < n; i++) ids[i] = byte_token[(unsigned char)piece[i]];
        auto look_up = [&](int i) {
            const Merge* m = find_merge(ids[i], ids[i + 1]);
            ranks[i] = m ? m->rank : NONE;
            merged[i] = m ? m->merged : -1;
        };
        for (int i = 0; i + 1 < n; i++) look_up(i);
        while (n > 1) {
            int best = 0;
            for (int i = 1; i + 1 < n; i++)
                if (ranks[i] < ranks[best]) best = i;   // strict <: the leftmost of equal ranks wins
            if (ranks[best] == NONE) break;
            ids[best] = merged[best];
            for (int i = best + 1; i + 1 < n; i++) {   // close the gap left by symbol best+1
                ids[i] = ids[i + 1];
                ranks[i] = ranks[i + 1];
                merged[i] = merged[i + 1];
            }
            n--;
            if (best > 0) look_up(best - 1);
            if (best + 1 < n) look_up(best);
        }
        out.insert(out.end(), ids, ids + n);
    }

    // Byte-pair encoding of a long piece. The symbols form a doubly linked list (merging two is O(1));
    // candidate merges sit in a min-heap ordered by (rank, position). A candidate popped from the
    // heap may be stale (one of its two symbols was merged since); it is checked and skipped.
    // Equal ranks pop leftmost first, which is how GPT-2 resolves "aaa": (aa)(a), not (a)(aa).
    // O(n log n), so a 200 KB run of '=' (one piece) takes a fraction of a second, not minutes.
    void bpe_heap(std::string_view piece, PieceCache& cache, std::vector<int>& out) const {
        int n = (int)piece.size();
        auto& symbols = cache.symbols;
        auto& heap = cache.heap;
        symbols.resize(n);
        heap.clear();
        for (int i = 0; i < n; i++) symbols[i] = {byte_token[(unsigned char)piece[i]], i - 1, i + 1 < n ? i + 1 : -1};
        auto later = [](const PieceCache::Candidate& a, const PieceCache::Candidate& b) {
            return a.rank != b.rank ? a.rank > b.rank : a.left > b.left;
        };
        auto push_candidate = [&](int left, int right) {
            if (left < 0 || right < 0) return;
            const Merge* m = find_merge(symbols[left].id, symbols[right].id);
            if (!m) return;
            heap.push_back({m->rank, left, right, symbols[left].id, symbols[right].id, m->merged});
            std::push_heap(heap.begin(), heap.end(), later);
        };
        for (int i = 0; i + 1 < n; i++) push_candidate(i, i + 1);
        while (!heap.empty()) {
            std::pop_heap(heap.begin(), heap.end(), later);
            PieceCache::Candidate c = heap.back();
            heap.pop_back();
            PieceCache::Symbol& left = symbols[c.left];
            if (left.id != c.left_id || left.next != c.right || symbols[c.right].id != c.right_id) continue;
            // Merge: the left symbol becomes the merged token and swallows the right one.
            left.id = c.merged;
            int after = symbols[c.right].next;
            symbols[c.right].id = -1;
            left.next = after;
            if (after >= 0) symbols[after].prev = c.left;
            push_candidate(left.prev, c.left);
            push_candidate(c.left, after);
        }
        for (int i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
    }

    // ---- load: both files into the tables above; "" or what is wrong with them

    std::string load_or_explain(const std::string& encoder_json_path, const std::string& vocab_bpe_path) {
        const std::string fetch_hint = " (scripts/get_vocab.sh downloads GPT-2's encoder.json and vocab.bpe)";
        std::string json_text, merges_text;
        if (!read_whole_file(encoder_json_path, json_text))
            return "cannot read " + encoder_json_path + ": " + strerror(errno) + fetch_hint;
        if (!read_whole_file(vocab_bpe_path, merges_text))
            return "cannot read " + vocab_bpe_path + ": " + strerror(errno) + fetch_hint;
        std::vector<int> cp_to_byte = gpt2_unicode_to_byte();
        std::string problem = load_encoder(encoder_json_path, json_text, cp_to_byte, fetch_hint);
        if (!problem.empty()) return problem;
        // Look tokens up by their bytes while building the merges.
        std::unordered_map<std::string_view, int> by_bytes;
        problem = index_tokens_by_bytes(encoder_json_path, &by_bytes);
        if (!problem.empty()) return problem;
        std::vector<Merge> merges;
        problem = parse_merges(vocab_bpe_path, encoder_json_path, merges_text, cp_to_byte, by_bytes, &merges);
        if (!problem.empty()) return problem;
        if (merges.empty()) return vocab_bpe_path + " has no merges";
        num_merges = (int)merges.size();
        fill_merge_table(merges);
        instance_id = tokenizer_next_instance_id++;
        return "";
    }

    // The inverse of gpt2_byte_to_unicode: code point -> byte, -1 for a code point that stands for none.
    static std::vector<int> gpt2_unicode_to_byte() {
        std::vector<uint32_t> byte_to_cp = gpt2_byte_to_unicode();
        std::vector<int> cp_to_byte(512, -1);
        for (int b = 0; b < 256; b++) cp_to_byte[byte_to_cp[b]] = b;
        return cp_to_byte;
    }

    // Undo bytes_to_unicode: each character of `text` stands for one byte, appended to *bytes.
    enum class Unmapped { Ok, InvalidUtf8, OutsideAlphabet };
    static Unmapped unmap_gpt2_bytes(std::string_view text, const std::vector<int>& cp_to_byte, std::string* bytes) {
        if (utf8_first_invalid(text) != text.size()) return Unmapped::InvalidUtf8;
        const unsigned char* s = (const unsigned char*)text.data();
        for (size_t i = 0; i < text.size();) {
            int len;
            uint32_t cp = utf8_decode_valid(s, i, &len);
            if (cp >= 512 || cp_to_byte[cp] < 0) return Unmapped::OutsideAlphabet;
            *bytes += (char)cp_to_byte[cp];
            i += len;
        }
        return Unmapped::Ok;
    }

    // encoder.json: {"!": 0, "\"": 1, ..., "<|endoftext|>": 50256} -> token_bytes, vocab_size, eot_token.
    std::string load_encoder(const std::string& path, const std::string& json_text, const std::vector<int>& cp_to_byte,
                             const std::string& fetch_hint) {
        JsonValue root;
        std::string json_error;
        if (!json_parse(json_text, &root, &json_error))
            return path + " is not valid JSON: " + json_error + "; delete it and download again" + fetch_hint;
        if (!root.is_object() || root.object.empty())
            return path + " should be a JSON object mapping token strings to ids";
        token_bytes.clear();
        vocab_size = 0;
        int eot = -1;
        for (const auto& member : root.object) {
            const JsonValue& id = member.second;
            if (!id.is_number() || !id.is_integer || id.integer < 0 || id.integer >= (1 << 30))
                return path + ": the id of token \"" + member.first + "\" is not a non-negative integer";
            std::string bytes;
            Unmapped unmapped = unmap_gpt2_bytes(member.first, cp_to_byte, &bytes);
            if (unmapped == Unmapped::InvalidUtf8) return path + ": a token is not valid UTF-8";
            if (unmapped == Unmapped::OutsideAlphabet)
                return path + ": token \"" + member.first +
                       "\" has a character outside GPT-2's byte alphabet; this is not a byte-level BPE vocabulary";
            int index = (int)id.integer;
            if (index >= (int)token_bytes.size()) token_bytes.resize(index + 1);
            if (!token_bytes[index].empty())
                return path + ": id " + std::to_string(index) + " is given to two tokens";
            token_bytes[index] = bytes;
            if (member.first == "<|endoftext|>") eot = index;
        }
        vocab_size = (int)token_bytes.size();
        if (eot < 0) return path + " has no <|endoftext|> token";
        eot_token = eot;
        return "";
    }

    static int id_of_bytes(const std::unordered_map<std::string_view, int>& by_bytes, const std::string& bytes) {
        auto it = by_bytes.find(bytes);
        return it != by_bytes.end() ? it->second : -1;
    }

    // bytes -> id of every token but <|endoftext|> (no two the same), and byte_token[] (all 256 needed).
    std::string index_tokens_by_bytes(const std::string& path, std::unordered_map<std::string_view, int>* by_bytes) {
        by_bytes->reserve(token_bytes.size());
        for (int i = 0; i < vocab_size; i++) {
            if (token_bytes[i].empty() || i == eot_token) continue;
            auto inserted = by_bytes->emplace(token_bytes[i], i);
            if (!inserted.second)
                return path + ": two ids (" + std::to_string(inserted.first->second) + ", " +
                       std::to_string(i) + ") stand for the same bytes";
        }
        for (int b = 0; b < 256; b++) {
            byte_token[b] = id_of_bytes(*by_bytes, std::string(1, (char)b));
            if (byte_token[b] < 0)
                return path + " lacks the one-byte token for byte " + std::to_string(b) +
                       "; a byte-level BPE vocabulary needs all 256";
        }
        return "";
    }

    // vocab.bpe: "#version: 0.2" then one merge per line, "Ġ t", best (rank 0) first.
    std::string parse_merges(const std::string& path, const std::string& encoder_json_path, const std::string& merges_text,
                             const std::vector<int>& cp_to_byte, const std::unordered_map<std::string_view, int>& by_bytes,
                             std::vector<Merge>* merges) {
        size_t line_start = 0;
        int line_number = 0;
        while (line_start < merges_text.size()) {
            size_t line_end = merges_text.find('\n', line_start);
            if (line_end == std::string::npos) line_end = merges_text.size();
            std::string_view line(merges_text.data() + line_start, line_end - line_start);
            line_start = line_end + 1;
            line_number++;
            while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.remove_suffix(1);
            if (line.empty() || (line_number == 1 && line[0] == '#')) continue;
            size_t space = line.find(' ');
            if (space == std::string_view::npos || space == 0 || line.find(' ', space + 1) != std::string_view::npos)
                return path + ":" + std::to_string(line_number) + ": expected two tokens separated by one space";
            std::string parts[2];
            std::string_view halves[2] = {line.substr(0, space), line.substr(space + 1)};
            for (int h = 0; h < 2; h++) {
                Unmapped unmapped = unmap_gpt2_bytes(halves[h], cp_to_byte, &parts[h]);
                if (unmapped == Unmapped::InvalidUtf8) return path + ":" + std::to_string(line_number) + ": not valid UTF-8";
                if (unmapped == Unmapped::OutsideAlphabet)
                    return path + ":" + std::to_string(line_number) + ": a character outside GPT-2's byte alphabet";
            }
            Merge m;
            int left = id_of_bytes(by_bytes, parts[0]), right = id_of_bytes(by_bytes, parts[1]);
            int merged = id_of_bytes(by_bytes, parts[0] + parts[1]);
            if (left < 0 || right < 0 || merged < 0)
                return path + ":" + std::to_string(line_number) + ": merge \"" + std::string(line) +
                       "\" uses a token that " + encoder_json_path + " does not have (are the two files from the same model?)";
            m.pair = pair_key(left, right);
            m.rank = (int)merges->size();
            m.merged = merged;
            merges->push_back(m);
        }
        return "";
    }

    // The hash table find_merge probes: at most half full.
    void fill_merge_table(const std::vector<Merge>& merges) {
        size_t capacity = 1;
        while (capacity < merges.size() * 2) capacity *= 2;
        merge_table.assign(capacity, Merge());
        merge_mask = capacity - 1;
        for (const Merge& m : merges) {
            uint64_t slot = mix64(m.pair) & merge_mask;
            while (merge_table[slot].pair != EMPTY && merge_table[slot].pair != m.pair) slot = (slot + 1) & merge_mask;
            if (merge_table[slot].pair == EMPTY) merge_table[slot] = m;   // a repeated merge keeps its best rank
        }
    }

    static bool read_whole_file(const std::string& path, std::string& out) {
        FILE* f = fopen(path.c_str(), "rb");
        if (!f) return false;
        out.clear();
        char buffer[1 << 16];
        size_t got;
        while ((got = fread(buffer, 1, sizeof buffer, f)) > 0) out.append(buffer, got);
        bool ok = !ferror(f);
        fclose(f);
        return ok;
    }
};
