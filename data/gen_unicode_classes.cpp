// gen_unicode_classes.cpp — builds the character-class table the GPT-2 pre-tokenizer needs,
// from the Unicode Character Database (Debian's `unicode-data` package), at build time.
//
// What it teaches: how to turn a property of 1.1 million code points into a fast lookup.
// GPT-2's pre-tokenization regex only asks four questions of a character: is it a letter (\p{L}),
// a number (\p{N}), whitespace (\s), or none of these? So each code point gets a 2-bit class:
//
//     LETTER  general category Lu Ll Lt Lm Lo
//     NUMBER  general category Nd Nl No
//     SPACE   what JavaScript's \s matches (the reference, js-tiktoken, runs in node):
//             TAB LF VT FF CR, every Zs (space separator), U+2028, U+2029, U+FEFF
//     OTHER   everything else, including unassigned code points
//
// A flat array of 0x110000 bytes would be 1.1 MB; but Unicode is very repetitive: most 256-code-point
// blocks are entirely one class (all unassigned, all CJK letters, ...). The two-stage table splits
// cp into (cp >> 8, cp & 255): stage1[cp >> 8] names a block, stage2[block * 256 + (cp & 255)] is
// the class, and identical blocks are stored once. Lookup costs two loads; with Unicode 15.0
// there are 127 distinct blocks, so the table is about 37 KB.
//
// Usage: gen_unicode_classes UnicodeData.txt DerivedAge.txt > build/unicode_classes.h
// (DerivedAge.txt is only read for its first line, which names the Unicode version.)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

enum { OTHER = 0, LETTER = 1, NUMBER = 2, SPACE = 3 };
static const unsigned NUM_CODE_POINTS = 0x110000;

static void fail(const std::string& message) {
    fprintf(stderr, "error: %s\n", message.c_str());
    exit(1);
}

static int class_of_category(const std::string& category) {
    if (category[0] == 'L') return LETTER;
    if (category[0] == 'N') return NUMBER;
    if (category == "Zs") return SPACE;
    return OTHER;
}

int main(int argc, char** argv) {
    if (argc != 3) fail("usage: gen_unicode_classes UnicodeData.txt DerivedAge.txt > unicode_classes.h");
    const char* data_path = argv[1];
    FILE* file = fopen(data_path, "r");
    if (!file)
        fail(std::string("cannot read ") + data_path +
             ": the Unicode tables are generated from Debian's unicode-data package; "
             "install it with `apt-get install unicode-data`");

    std::vector<unsigned char> classes(NUM_CODE_POINTS, OTHER);
    // Lines look like "0041;LATIN CAPITAL LETTER A;Lu;0;L;;;;;N;;;;0061;". Large uniform ranges
    // (CJK ideographs, Hangul syllables) are given as two lines, "<..., First>" and "<..., Last>".
    char line[1024];
    unsigned range_first = 0;
    bool in_range = false;
    int lines = 0;
    while (fgets(line, sizeof line, file)) {
        char* fields[4] = {line, nullptr, nullptr, nullptr};
        for (int i = 1; i < 4; i++) {
            char* semicolon = strchr(fields[i - 1], ';');
            if (!semicolon) fail(std::string("malformed line in ") + data_path + ": " + line);
            *semicolon = '\0';
            fields[i] = semicolon + 1;
        }
        unsigned cp = (unsigned)strtoul(fields[0], nullptr, 16);
        if (cp >= NUM_CODE_POINTS) fail(std::string("code point out of range in ") + data_path);
        int cls = class_of_category(fields[2]);
        if (strstr(fields[1], ", First>")) {
            range_first = cp;
            in_range = true;
        } else if (strstr(fields[1], ", Last>")) {
            if (!in_range) fail(std::string("range end without start in ") + data_path);
            for (unsigned c = range_first; c <= cp; c++) classes[c] = (unsigned char)cls;
            in_range = false;
        } else {
            classes[cp] = (unsigned char)cls;
        }
        lines++;
    }
    fclose(file);
    if (lines < 30000) fail(std::string(data_path) + " looks truncated (" + std::to_string(lines) + " lines)");

    // JavaScript's \s: WhiteSpace (TAB, VT, FF, ZWNBSP U+FEFF, any Zs) and LineTerminator (LF, CR,
    // U+2028, U+2029). Note U+0085 (NEL) is not in it, although Unicode's White_Space property,
    // which Rust's regex and so the tiktoken package use, has NEL and lacks U+FEFF.
    for (unsigned cp : {0x09u, 0x0Au, 0x0Bu, 0x0Cu, 0x0Du, 0x2028u, 0x2029u, 0xFEFFu}) classes[cp] = SPACE;

    std::string version = "unknown";
    if (FILE* age = fopen(argv[2], "r")) {
        char first[256] = {0};
        if (fgets(first, sizeof first, age)) {
            // "# DerivedAge-15.0.0.txt"
            const char* dash = strchr(first, '-');
            const char* dot_txt = strstr(first, ".txt");
            if (dash && dot_txt && dot_txt > dash) version.assign(dash + 1, dot_txt);
        }
        fclose(age);
    }

    // Deduplicate 256-code-point blocks.
    std::map<std::vector<unsigned char>, int> block_index;
    std::vector<std::vector<unsigned char>> blocks;
    std::vector<int> stage1;
    for (unsigned start = 0; start < NUM_CODE_POINTS; start += 256) {
        std::vector<unsigned char> block(classes.begin() + start, classes.begin() + start + 256);
        auto found = block_index.find(block);
        if (found == block_index.end()) {
            found = block_index.emplace(block, (int)blocks.size()).first;
            blocks.push_back(block);
        }
        stage1.push_back(found->second);
    }
    if (blocks.size() > 255) fail("too many distinct blocks for a uint8_t stage-1 table");

    printf("// Generated by data/gen_unicode_classes.cpp from %s (Unicode %s). Do not edit.\n", data_path,
           version.c_str());
    printf("// Character classes for the GPT-2 pre-tokenizer: 0 other, 1 letter, 2 number, 3 whitespace.\n");
    printf("// class(cp) = unicode_class_stage2[unicode_class_stage1[cp >> 8] * 256 + (cp & 255)]\n");
    printf("#pragma once\n#include <cstdint>\n\n");
    printf("inline constexpr const char* UNICODE_CLASSES_VERSION = \"%s\";\n\n", version.c_str());
    printf("inline constexpr uint8_t unicode_class_stage1[%u] = {", NUM_CODE_POINTS >> 8);
    for (size_t i = 0; i < stage1.size(); i++) printf("%s%d,", i % 32 == 0 ? "\n    " : "", stage1[i]);
    printf("\n};\n\n");
    printf("inline constexpr uint8_t unicode_class_stage2[%zu] = {", blocks.size() * 256);
    for (size_t b = 0; b < blocks.size(); b++) {
        printf("\n    // block %zu", b);
        for (int i = 0; i < 256; i++) printf("%s%d,", i % 64 == 0 ? "\n    " : "", blocks[b][i]);
    }
    printf("\n};\n");
    fprintf(stderr, "gen_unicode_classes: Unicode %s, %zu distinct blocks\n", version.c_str(), blocks.size());
    return 0;
}
