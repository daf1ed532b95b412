// json.h — a small JSON parser: recursive descent over the grammar of RFC 8259.
//
// What it teaches: a recursive-descent parser is the grammar written as functions, one per rule
// (value, object, array, string, number), each consuming text from a cursor and calling the others.
// JSON is small enough that the whole grammar fits on a screen:
//
//     value  = object | array | string | number | true | false | null
//     object = '{' [ string ':' value { ',' string ':' value } ] '}'
//     array  = '[' [ value { ',' value } ] ']'
//
// Strings are the only subtle part: '\uXXXX' escapes name UTF-16 code units, so a character outside
// the Basic Multilingual Plane arrives as two escapes (a surrogate pair, D800-DBFF then DC00-DFFF)
// that must be combined into one code point before it is written out as UTF-8.
//
// Trade-off: the parser builds a full tree (JsonValue) in memory. That costs a few times the size
// of the text, which is fine for what the project reads (vocabularies, configs, safetensors headers,
// one JSONL line at a time) and keeps every consumer simple: parse, then look things up.
//
// Errors never throw or exit: json_parse returns false and says what went wrong and where
// ("line 3, column 14: expected ':' after an object key"), so each caller can name its file.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct JsonValue {
    enum Type { NUL, BOOL, NUMBER, STRING, ARRAY, OBJECT };
    Type type = NUL;
    bool boolean = false;
    double number = 0.0;
    // Integer literals (no fraction, no exponent) that fit int64 are also kept exactly: a double
    // holds integers exactly only up to 2^53, and safetensors offsets must not be rounded.
    bool is_integer = false;
    int64_t integer = 0;
    std::string string;                                      // STRING: UTF-8
    std::vector<JsonValue> array;                            // ARRAY
    std::vector<std::pair<std::string, JsonValue>> object;   // OBJECT, members in file order

    bool is_null() const { return type == NUL; }
    bool is_bool() const { return type == BOOL; }
    bool is_number() const { return type == NUMBER; }
    bool is_string() const { return type == STRING; }
    bool is_array() const { return type == ARRAY; }
    bool is_object() const { return type == OBJECT; }

    // The member named `key` of an object, or nullptr when absent or when this is not an object.
    // A linear scan: objects the project looks up by key are small, and the big ones
    // (encoder.json) are walked in order instead.
    const JsonValue* find(std::string_view key) const {
        if (type != OBJECT) return nullptr;
        for (const auto& member : object)
            if (member.first == key) return &member.second;
        return nullptr;
    }
};

inline const char* json_type_name(JsonValue::Type type) {
    switch (type) {
        case JsonValue::NUL: return "null";
        case JsonValue::BOOL: return "a boolean";
        case JsonValue::NUMBER: return "a number";
        case JsonValue::STRING: return "a string";
        case JsonValue::ARRAY: return "an array";
        case JsonValue::OBJECT: return "an object";
    }
    return "?";
}

// Appends code point `cp` (at most 0x10FFFF) to `out` as UTF-8.
inline void json_append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
        out += (char)cp;
    } else if (cp < 0x800) {
        out += (char)(0xC0 | (cp >> 6));
        out += (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += (char)(0xE0 | (cp >> 12));
        out += (char)(0x80 | ((cp >> 6) & 0x3F));
        out += (char)(0x80 | (cp & 0x3F));
    } else {
        out += (char)(0xF0 | (cp >> 18));
        out += (char)(0x80 | ((cp >> 12) & 0x3F));
        out += (char)(0x80 | ((cp >> 6) & 0x3F));
        out += (char)(0x80 | (cp & 0x3F));
    }
}

// The parser's state: the text, a cursor into it, and the first error met.
struct JsonParser {
    std::string_view text;
    size_t pos = 0;
    int depth = 0;
    std::string error;   // empty while all is well

    // Nesting deeper than this is refused rather than recursed into: each level costs stack,
    // and no file the project reads comes anywhere near it.
    static constexpr int MAX_DEPTH = 512;

    bool failed(const std::string& what) {
        if (error.empty()) {
            size_t line = 1, column = 1;
            for (size_t i = 0; i < pos && i < text.size(); i++) {
                if (text[i] == '\n') { line++; column = 1; } else { column++; }
            }
            error = "line " + std::to_string(line) + ", column " + std::to_string(column) + ": " + what;
        }
        return false;
    }

    void skip_whitespace() {
        while (pos < text.size() &&
               (text[pos] == ' ' || text[pos] == '\t' || text[pos] == '\n' || text[pos] == '\r'))
            pos++;
    }

    bool parse_literal(const char* word, JsonValue& out, JsonValue::Type type, bool value) {
        size_t n = strlen(word);
        if (text.substr(pos, n) != word) return failed("unexpected character (expected a JSON value)");
        pos += n;
        out.type = type;
        out.boolean = value;
        return true;
    }

    bool parse_hex4(uint32_t& unit) {
        if (pos + 4 > text.size()) return failed("truncated \\u escape (needs 4 hex digits)");
        unit = 0;
        for (int i = 0; i < 4; i++) {
            char c = text[pos + i];
            unit <<= 4;
            if (c >= '0' && c <= '9') unit |= (uint32_t)(c - '0');
            else if (c >= 'a' && c <= 'f') unit |= (uint32_t)(c - 'a' + 10);
            else if (c >= 'A' && c <= 'F') unit |= (uint32_t)(c - 'A' + 10);
            else return failed("bad \\u escape (needs 4 hex digits)");
        }
        pos += 4;
        return true;
    }

    // Called with pos on the opening quote. Raw bytes >= 0x80 are copied as they are: checking
    // that they form valid UTF-8 is left to the caller, who can say which file and record.
    bool parse_string(std::string& out) {
        pos++;   // the opening quote
        out.clear();
        while (true) {
            // Copy the plain run up to the next quote, backslash or end in one go.
            size_t run_start = pos;
            while (pos < text.size() && text[pos] != '"' && text[pos] != '\\' && (unsigned char)text[pos] >= 0x20)
                pos++;
            out.append(text.data() + run_start, pos - run_start);
            if (pos >= text.size()) return failed("unterminated string (missing closing quote)");
            char c = text[pos];
            if (c == '"') { pos++; return true; }
            if (c != '\\') return failed("control character inside a string (must be escaped, e.g. \\n)");
            pos++;   // the backslash
            if (pos >= text.size()) return failed("unterminated escape at end of input");
            char e = text[pos++];
            switch (e) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    uint32_t unit = 0;
                    if (!parse_hex4(unit)) return false;
                    uint32_t cp = unit;
                    if (unit >= 0xD800 && unit <= 0xDBFF) {
                        // A high surrogate: a low one must follow to make one code point.
                        uint32_t low = 0;
                        size_t save = pos;
                        if (pos + 1 < text.size() && text[pos] == '\\' && text[pos + 1] == 'u') {
                            pos += 2;
                            if (!parse_hex4(low)) return false;
                        }
                        if (low >= 0xDC00 && low <= 0xDFFF) {
                            cp = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00);
                        } else {
                            pos = save;    // not a pair: the next escape is read on its own
                            cp = 0xFFFD;   // a lone surrogate has no UTF-8 form: replace it
                        }
                    } else if (unit >= 0xDC00 && unit <= 0xDFFF) {
                        cp = 0xFFFD;       // a low surrogate with no high one before it
                    }
                    json_append_utf8(out, cp);
                    break;
                }
                default:
                    pos--;
                    return failed(std::string("unknown escape \\") + e);
            }
        }
    }

    bool parse_number(JsonValue& out) {
        size_t start = pos;
        bool integral = true;
        if (pos < text.size() && text[pos] == '-') pos++;
        if (pos >= text.size() || !(text[pos] >= '0' && text[pos] <= '9'))
            return failed("bad number (expected a digit)");
        if (text[pos] == '0') {
            pos++;   // JSON forbids leading zeros such as 012
        } else {
            while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') pos++;
        }
        if (pos < text.size() && text[pos] == '.') {
            integral = false;
            pos++;
            if (pos >= text.size() || !(text[pos] >= '0' && text[pos] <= '9'))
                return failed("bad number (expected a digit after '.')");
            while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') pos++;
        }
        if (pos < text.size() && (text[pos] == 'e' || text[pos] == 'E')) {
            integral = false;
            pos++;
            if (pos < text.size() && (text[pos] == '+' || text[pos] == '-')) pos++;
            if (pos >= text.size() || !(text[pos] >= '0' && text[pos] <= '9'))
                return failed("bad number (expected a digit in the exponent)");
            while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') pos++;
        }
        // strtod/strtoll need a terminated string; numbers are short, so copy.
        std::string literal(text.substr(start, pos - start));
        out.type = JsonValue::NUMBER;
        out.number = strtod(literal.c_str(), nullptr);
        if (integral) {
            errno = 0;
            long long value = strtoll(literal.c_str(), nullptr, 10);
            if (errno == 0) { out.is_integer = true; out.integer = value; }
        }
        return true;
    }

    bool parse_value(JsonValue& out) {
        skip_whitespace();
        if (pos >= text.size()) return failed("unexpected end of input (expected a JSON value)");
        char c = text[pos];
        switch (c) {
            case '{': return parse_object(out);
            case '[': return parse_array(out);
            case '"': out.type = JsonValue::STRING; return parse_string(out.string);
            case 't': return parse_literal("true", out, JsonValue::BOOL, true);
            case 'f': return parse_literal("false", out, JsonValue::BOOL, false);
            case 'n': return parse_literal("null", out, JsonValue::NUL, false);
            default:
                if (c == '-' || (c >= '0' && c <= '9')) return parse_number(out);
                return failed(std::string("unexpected character '") + c + "' (expected a JSON value)");
        }
    }

    bool parse_object(JsonValue& out) {
        if (++depth > MAX_DEPTH) return failed("nesting too deep");
        pos++;   // '{'
        out.type = JsonValue::OBJECT;
        skip_whitespace();
        if (pos < text.size() && text[pos] == '}') { pos++; depth--; return true; }
        while (true) {
            skip_whitespace();
            if (pos >= text.size() || text[pos] != '"') return failed("expected a string key in object");
            out.object.emplace_back();
            if (!parse_string(out.object.back().first)) return false;
            skip_whitespace();
            if (pos >= text.size() || text[pos] != ':') return failed("expected ':' after an object key");
            pos++;
            if (!parse_value(out.object.back().second)) return false;
            skip_whitespace();
            if (pos < text.size() && text[pos] == ',') { pos++; continue; }
            if (pos < text.size() && text[pos] == '}') { pos++; depth--; return true; }
            return failed("expected ',' or '}' after an object member");
        }
    }

    bool parse_array(JsonValue& out) {
        if (++depth > MAX_DEPTH) return failed("nesting too deep");
        pos++;   // '['
        out.type = JsonValue::ARRAY;
        skip_whitespace();
        if (pos < text.size() && text[pos] == ']') { pos++; depth--; return true; }
        while (true) {
            out.array.emplace_back();
            if (!parse_value(out.array.back())) return false;
            skip_whitespace();
            if (pos < text.size() && text[pos] == ',') { pos++; continue; }
            if (pos < text.size() && text[pos] == ']') { pos++; depth--; return true; }
            return failed("expected ',' or ']' after an array element");
        }
    }
};

// Parses one JSON document (surrounding whitespace allowed, nothing else after it).
// On failure returns false, leaves `out` unspecified and puts "line L, column C: what" in *error.
inline bool json_parse(std::string_view text, JsonValue* out, std::string* error) {
    JsonParser parser;
    parser.text = text;
    *out = JsonValue();
    bool ok = parser.parse_value(*out);
    if (ok) {
        parser.skip_whitespace();
        if (parser.pos != text.size()) ok = parser.failed("unexpected text after the JSON value");
    }
    if (!ok && error) *error = parser.error;
    return ok;
}
