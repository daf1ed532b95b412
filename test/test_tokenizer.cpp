// test_tokenizer.cpp — unit checks of llmc/io/json.h and llmc/io/tokenizer.h that need no node.
//
// Expected values come from outside the code under test: JSON and UTF-8 cases worked out from
// RFC 8259 and the WHATWG decoder, pre-tokenizer splits worked out by hand from the GPT-2 regex,
// well-known GPT-2 ids, and a deliberately naive BPE (GPT-2's original algorithm, O(n^2)) to check
// the heap-based one. test_tokenizer_reference.py compares whole texts with js-tiktoken.
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "llmc/io/json.h"
#include "llmc/io/tokenizer.h"
#include "test/checks.h"

static std::string show(const std::string& bytes) {
    std::string out;
    for (unsigned char c : bytes) {
        char buf[8];
        if (c >= 0x20 && c < 0x7f && c != '\\') out += (char)c;
        else { snprintf(buf, sizeof buf, "\\x%02X", c); out += buf; }
    }
    return out;
}

static std::string join(const std::vector<std::string>& parts) {
    std::string out = "[";
    for (size_t i = 0; i < parts.size(); i++) out += (i ? "|" : "") + show(parts[i]);
    return out + "]";
}

static std::string join_ids(const std::vector<int>& ids) {
    std::string out;
    for (size_t i = 0; i < ids.size() && i < 20; i++) out += (i ? " " : "") + std::to_string(ids[i]);
    return out + (ids.size() > 20 ? " ..." : "");
}

// ---------------------------------------------------------------------------------------------

static void test_json() {
    JsonValue v;
    std::string error;
    bool ok = json_parse(R"( {"a": [1, -2.5e3, true, false, null], "b": {"c": "d"}, "big": 9007199254740993} )", &v, &error);
    check(ok && v.is_object() && v.object.size() == 3, "json: object with array, nested object, literals", error);
    const JsonValue* a = v.find("a");
    check(a && a->is_array() && a->array.size() == 5 && a->array[0].is_integer && a->array[0].integer == 1 &&
              a->array[1].number == -2500.0 && !a->array[1].is_integer && a->array[2].boolean &&
              a->array[3].is_bool() && !a->array[3].boolean && a->array[4].is_null(),
          "json: array element values and types");
    const JsonValue* b = v.find("b");
    check(b && b->find("c") && b->find("c")->string == "d" && !v.find("missing"), "json: find() on nested objects");
    const JsonValue* big = v.find("big");
    check(big && big->is_integer && big->integer == 9007199254740993LL, "json: integers above 2^53 kept exactly");

    ok = json_parse(R"("q\" b\\ s\/ \b\f\n\r\t \u00e9 \u20AC \ud83d\ude00")", &v, &error);
    check(ok && v.string == "q\" b\\ s/ \b\f\n\r\t \xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80",
          "json: all escapes, \\u BMP and surrogate pair to UTF-8", ok ? show(v.string) : error);
    ok = json_parse(R"("\ud800x\udc00")", &v, &error);
    check(ok && v.string == "\xEF\xBF\xBDx\xEF\xBF\xBD", "json: lone surrogates become U+FFFD", show(v.string));
    ok = json_parse("\"caf\xC3\xA9 \xE4\xB8\xAD\"", &v, &error);
    check(ok && v.string == "caf\xC3\xA9 \xE4\xB8\xAD", "json: raw UTF-8 in strings passes through");
    ok = json_parse("[]", &v, &error) && v.is_array() && v.array.empty() && json_parse("{}", &v, &error) &&
         v.is_object() && json_parse("0", &v, &error) && v.integer == 0;
    check(ok, "json: empty array, empty object, zero");

    struct Bad { const char* text; const char* expect; };
    const Bad bad[] = {
        {"{\"a\": }", "line 1, column 7: unexpected character '}'"},
        {"{\"a\" 1}", "expected ':' after an object key"},
        {"[1, 2,]", "unexpected character ']'"},
        {"{\"a\": 1,\n \"b\": 2,\n}", "line 3, column 1: expected a string key"},
        {"\"abc", "unterminated string"},
        {"\"a\nb\"", "control character inside a string"},
        {"\"\\x\"", "unknown escape \\x"},
        {"\"\\u12G4\"", "bad \\u escape"},
        {"012", "unexpected text after the JSON value"},
        {"-", "bad number"},
        {"1.", "expected a digit after '.'"},
        {"tru", "expected a JSON value"},
        {"", "unexpected end of input"},
        {"[1] [2]", "unexpected text after the JSON value"},
    };
    for (const Bad& c : bad) {
        error.clear();
        ok = json_parse(c.text, &v, &error);
        check(!ok && error.find(c.expect) != std::string::npos, std::string("json error: ") + show(c.text),
              ok ? "parsed without error" : "message was: " + error);
    }
    std::string deep(600, '[');
    ok = json_parse(deep, &v, &error);
    check(!ok && error.find("nesting too deep") != std::string::npos, "json: deep nesting is refused, not a crash",
          error);
}

// ---------------------------------------------------------------------------------------------

static void test_utf8() {
    const std::string R = "\xEF\xBF\xBD";   // U+FFFD
    // Replacement per the WHATWG decoder: one U+FFFD per maximal subpart of an ill-formed sequence.
    struct Case { std::string in, out; };
    const Case cases[] = {
        {"plain ascii", "plain ascii"},
        {"caf\xC3\xA9", "caf\xC3\xA9"},
        {"\x80", R},
        {"\xC0\x80", R + R},                     // C0 can never start a character
        {"\xE0\x80\x80", R + R + R},             // overlong: E0 needs A0..BF next
        {"\xED\xA0\x80", R + R + R},             // a surrogate: ED needs 80..9F next
        {"\xE2\x82", R},                         // truncated 3-byte form: one U+FFFD
        {"\xE2\x82" "A", R + "A"},
        {"\xF0\x9F\x98", R},                     // truncated 4-byte form
        {"\xF0\x9F\x98\x80\xF0", "\xF0\x9F\x98\x80" + R},
        {"\xF4\x90\x80\x80", R + R + R + R},     // above U+10FFFF
        {"\xF5\x80", R + R},
        {"\xFF\xFE", R + R},
        {"a\xE2\x28\xA1", "a" + R + "(" + R},
    };
    bool all = true;
    std::string why;
    for (const Case& c : cases) {
        std::string got = utf8_replace_invalid(c.in);
        if (got != c.out) { all = false; why += show(c.in) + " -> " + show(got) + "; "; }
    }
    check(all, "utf8: invalid sequences replaced as the WHATWG decoder does", why);
    check(utf8_first_invalid("abc") == 3 && utf8_first_invalid("ab\xC3\xA9\xFF") == 4 &&
              utf8_first_invalid("0123456789\xE2\x82") == 10 && utf8_first_invalid("\xED\x9F\xBF") == 3 &&
              utf8_first_invalid("\xED\xA0\x80") == 0 && utf8_first_invalid("\xF4\x8F\xBF\xBF") == 4,
          "utf8: first invalid byte offset");
}

// ---------------------------------------------------------------------------------------------

static std::vector<std::string> pieces(std::string_view text) {
    std::vector<std::string> out;
    for (size_t start = 0; start < text.size();) {
        size_t end = pretoken_end(text, start);
        out.emplace_back(text.substr(start, end - start));
        start = end;
    }
    return out;
}

static void test_pretokenizer() {
    struct Case { std::string text; std::vector<std::string> expect; };
    // Each split worked out by hand from 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    const Case cases[] = {
        {"Hello world", {"Hello", " world"}},
        {"hello   world", {"hello", "  ", " world"}},                    // the last space goes to the word
        {"a\n\nb", {"a", "\n", "\n", "b"}},                                 // a run gives back its last char
        {"a \nb", {"a", " ", "\n", "b"}},
        {"a\n b", {"a", "\n", " b"}},
        {"x  ", {"x", "  "}},                                               // at the end: the whole run
        {"it's I'LL we'll 've'x", {"it", "'s", " I", "'", "LL", " we", "'ll", " '", "ve", "'", "x"}},  // " '" is a symbol run
        {"''s", {"''", "s"}},                                               // symbols run greedily first
        {"123abc 45", {"123", "abc", " 45"}},
        {" !!?", {" !!?"}},
        {"e\xCC\x81t\xC3\xA9", {"e", "\xCC\x81", "t\xC3\xA9"}},            // a combining mark is not \p{L}
        {"\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C", {"\xE4\xBD\xA0\xE5\xA5\xBD", "\xEF\xBC\x8C"}},  // 你好，
        {"a\xC2\xA0" "b", {"a", "\xC2\xA0", "b"}},                           // NBSP is \s but not ' '
        {"a \xC2\xA0" "b", {"a", " ", "\xC2\xA0", "b"}},
        {"\xC2\xBD\xE2\x85\xAB" "x", {"\xC2\xBD\xE2\x85\xAB", "x"}},        // ½Ⅻ are \p{N}
        {"a\xE2\x80\x8B" "b", {"a", "\xE2\x80\x8B", "b"}},                  // ZWSP is not \s in JS
        {"\t\t", {"\t\t"}},
        {" ", {" "}},
    };
    for (const Case& c : cases) {
        std::vector<std::string> got = pieces(c.text);
        check(got == c.expect, "pretokenize " + show(c.text), join(got) + " expected " + join(c.expect));
    }

    // next_safe_split: for random texts, cutting at each safe point must not change the pieces.
    const char* alphabet[] = {" ", " ", "\n", "\n", "\t", "\r", "\xC2\xA0", "a", "b", "'", "s", "1", ".", "\xE4\xB8\xAD"};
    std::mt19937 rng(7);
    int cuts = 0, bad = 0;
    std::string example;
    for (int trial = 0; trial < 2000; trial++) {
        std::string text;
        int length = 1 + rng() % 40;
        for (int i = 0; i < length; i++) text += alphabet[rng() % (sizeof alphabet / sizeof alphabet[0])];
        std::vector<std::string> whole = pieces(text);
        for (size_t q = next_safe_split(text, 0); q < text.size(); q = next_safe_split(text, q + 1)) {
            cuts++;
            std::vector<std::string> left = pieces(std::string_view(text).substr(0, q));
            std::vector<std::string> right = pieces(std::string_view(text).substr(q));
            left.insert(left.end(), right.begin(), right.end());
            if (left != whole) { bad++; if (example.empty()) example = show(text) + " cut at " + std::to_string(q); }
        }
    }
    check(bad == 0 && cuts > 1000, "next_safe_split: " + std::to_string(cuts) + " cuts in random texts keep the pieces",
          std::to_string(bad) + " cuts changed them, e.g. " + example);
}

// ---------------------------------------------------------------------------------------------

// GPT-2's original bpe(): find the best-ranked pair, merge every occurrence left to right, repeat.
static std::vector<int> naive_bpe(const Tokenizer& t, const std::string& piece) {
    std::vector<int> ids;
    for (unsigned char c : piece) ids.push_back(t.byte_token[c]);
    while (ids.size() > 1) {
        int best_rank = -1, left = -1, right = -1, merged = -1;
        for (size_t i = 0; i + 1 < ids.size(); i++) {
            const Tokenizer::Merge* m = t.find_merge(ids[i], ids[i + 1]);
            if (m && (best_rank < 0 || m->rank < best_rank)) {
                best_rank = m->rank; left = ids[i]; right = ids[i + 1]; merged = m->merged;
            }
        }
        if (best_rank < 0) break;
        std::vector<int> next;
        for (size_t i = 0; i < ids.size(); i++) {
            if (i + 1 < ids.size() && ids[i] == left && ids[i + 1] == right) { next.push_back(merged); i++; }
            else next.push_back(ids[i]);
        }
        ids.swap(next);
    }
    return ids;
}

static void test_with_vocabulary() {
    Tokenizer t;
    std::string error;
    if (!t.load("data/gpt2/encoder.json", "data/gpt2/vocab.bpe", &error)) {
        printf("SKIP: tokenizer checks with the GPT-2 vocabulary (%s)\n", error.c_str());
        return;
    }
    check(t.vocab_size == 50257 && t.eot_token == 50256 && t.num_merges == 50000,
          "load: 50257 tokens, <|endoftext|> = 50256, 50000 merges");
    // Ids anyone can check with tiktoken: "Hello world" -> 15496 995, " the" -> 262, "\n\n" -> 628.
    struct Known { std::string text; std::vector<int> ids; };
    const Known known[] = {
        {"Hello world", {15496, 995}},
        {" the", {262}},
        {"\n\n", {628}},
        {"<|endoftext|>", {27, 91, 437, 1659, 5239, 91, 29}},   // ordinary text, not the special token
        {"", {}},
    };
    for (const Known& k : known) {
        std::vector<int> got = t.encode(k.text);
        check(got == k.ids, "encode " + show(k.text), join_ids(got));
    }
    check(t.decode_token(50256) == "<|endoftext|>" && t.decode_token(15496) == "Hello" &&
              t.decode_token(50257) == "<|invalid token 50257|>" && t.decode_token(-1) == "<|invalid token -1|>",
          "decode_token: text, special token, out-of-range ids");

    // Every token's own bytes must encode back to that single token (tiktoken relies on this).
    int unreachable = 0;
    for (int id = 0; id < t.vocab_size; id++) {
        if (id == t.eot_token) continue;
        std::vector<int> got;
        t.bpe(t.token_bytes[id], t.thread_cache(), got);
        unreachable += !(got.size() == 1 && got[0] == id);
    }
    check(unreachable == 0, "bpe: each of the 50256 tokens' bytes encode to that token",
          std::to_string(unreachable) + " do not");

    // The heap BPE against the naive one, on random pieces that have many merge choices.
    const char* alphabet[] = {"a", "b", "e", "r", "t", "h", "in", "er", " ", "=", "-", "\xC3\xA9", "\xE4\xB8\xAD", "0", "1"};
    std::mt19937 rng(11);
    int mismatches = 0, short_pieces = 0;
    std::string example;
    for (int trial = 0; trial < 3000; trial++) {
        std::string piece;
        int length = 2 + rng() % 30;
        for (int i = 0; i < length; i++) piece += alphabet[rng() % (sizeof alphabet / sizeof alphabet[0])];
        std::vector<int> heap, scan, naive = naive_bpe(t, piece);
        t.bpe_heap(piece, t.thread_cache(), heap);
        if (piece.size() <= Tokenizer::SHORT_PIECE) {
            t.bpe_short(piece, scan);
            short_pieces++;
        } else {
            scan = naive;
        }
        if (heap != naive || scan != naive) { mismatches++; if (example.empty()) example = show(piece); }
    }
    check(mismatches == 0 && short_pieces > 500,
          "bpe: heap and short-piece versions equal GPT-2's naive version on 3000 random pieces",
          std::to_string(mismatches) + " differ, e.g. " + example);

    // A pathological piece: one 200,000-byte run is one pre-token; O(n^2) BPE would take minutes.
    std::string run(200000, '=');
    auto start = std::chrono::steady_clock::now();
    std::vector<int> ids = t.encode(run);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    check(t.decode(ids) == run && seconds < 2.0, "bpe: a 200 KB single piece encodes in under 2 s",
          std::to_string(seconds) + " s, round trip " + (t.decode(ids) == run ? "ok" : "broken"));

    // Round trips and parallel == serial on generated text with many kinds of boundaries.
    std::mt19937 text_rng(5);
    const char* words[] = {"the", " whale", "Ahab", "'s", " 42", "\n", "\n\n", "  ", "\t", "\xE2\x80\x94", "\xC3\xA9t\xC3\xA9",
                           "\xF0\x9F\x98\x80", " \xE4\xB8\xAD\xE6\x96\x87", ".", ",", "\r\n", "\xC2\xA0", "don't", " \xD0\xBC\xD0\xB8\xD1\x80"};
    std::string text;
    while (text.size() < 3000000) text += words[text_rng() % (sizeof words / sizeof words[0])];
    std::vector<int> serial = t.encode(text);
    check(t.decode(serial) == text, "decode(encode(x)) == x on 3 MB of generated text");
    bool same = true;
    for (int threads : {2, 3, 8, 32}) same = same && t.encode_parallel(text, threads) == serial;
    check(same, "encode_parallel on 2, 3, 8, 32 threads == encode");
    check(Tokenizer::split_points(text, 8).size() > 8, "split_points: a 3 MB text is cut into many parts");
    t.reset_cache();
    check(t.encode(text) == serial, "encode with a cold cache == with a warm cache");

    // More distinct pieces than the cache holds (PieceCache::MAX_ENTRIES): it must grow, start over
    // when full, and still give the tokens of GPT-2's naive algorithm, piece by piece.
    std::mt19937 word_rng(3);
    std::string many_words;
    std::vector<int> expected;
    size_t num_words = Tokenizer::PieceCache::MAX_ENTRIES + 200000;
    for (size_t w = 0; w < num_words; w++) {
        std::string word = " ";
        for (int k = 0; k < 7; k++) word += (char)('a' + word_rng() % 26);
        many_words += word;
        std::vector<int> ids = naive_bpe(t, word);
        expected.insert(expected.end(), ids.begin(), ids.end());
    }
    t.reset_cache();
    check(t.encode(many_words) == expected && t.encode(many_words) == expected,
          "cache: " + std::to_string(num_words) + " random words (more than the cache holds) encode as naive BPE");

    std::string invalid = "ok \xFF\xFE caf\xE9 \xF0\x9F\x98 end";
    check(t.encode(invalid) == t.encode(utf8_replace_invalid(invalid)) &&
              t.encode_parallel(invalid, 4) == t.encode(invalid),
          "invalid UTF-8 encodes as its U+FFFD-replaced text");
}

static void test_load_errors() {
    FILE* f = fopen("build/test_tokenizer_bad.json", "w");
    fputs("{\"a\": 1,", f);
    fclose(f);
    f = fopen("build/test_tokenizer_bad.bpe", "w");
    fputs("#version: 0.2\nnot_a_token other\n", f);
    fclose(f);
    Tokenizer t;
    std::string error;
    bool ok = t.load("build/no_such_encoder.json", "data/gpt2/vocab.bpe", &error);
    check(!ok && error.find("cannot read build/no_such_encoder.json") != std::string::npos &&
              error.find("get_vocab.sh") != std::string::npos,
          "load: a missing file is named, with the fix", error);
    ok = t.load("build/test_tokenizer_bad.json", "build/test_tokenizer_bad.bpe", &error);
    check(!ok && error.find("is not valid JSON: line 1, column 9") != std::string::npos, "load: corrupt encoder.json",
          error);
    if (FILE* vocabulary = fopen("data/gpt2/encoder.json", "r")) {
        fclose(vocabulary);
        ok = t.load("data/gpt2/encoder.json", "build/test_tokenizer_bad.bpe", &error);
        check(!ok && error.find("test_tokenizer_bad.bpe:2: merge \"not_a_token other\" uses a token") != std::string::npos,
              "load: a merge naming unknown tokens", error);
    }
}

int main() {
    test_json();
    test_utf8();
    test_pretokenizer();
    test_load_errors();
    test_with_vocabulary();
    return check_exit_code();
}
