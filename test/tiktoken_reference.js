// The reference side of test/test_tokenizer_reference.py: what js-tiktoken (OpenAI's tiktoken
// ported to JavaScript, encoding "gpt2") and node's own regex engine say, for us to compare with.
//
//   node test/tiktoken_reference.js encode FILE...   one line of token ids per file
//   node test/tiktoken_reference.js char-classes     "first last class unassigned" ranges (hex)
//
// A file's bytes are decoded with the WHATWG TextDecoder, which replaces invalid UTF-8 with U+FFFD
// (ignoreBOM: a leading byte-order mark is kept as a character, as our tokenizer keeps it);
// our tokenizer defines invalid input the same way. encode(text, [], []) treats "<|endoftext|>" in
// the text as ordinary characters, like our encode().
const fs = require("fs");
const path = require("path");

const mode = process.argv[2];
if (mode === "encode") {
    const { getEncoding } = require(path.join(__dirname, "node_modules", "js-tiktoken"));
    const encoding = getEncoding("gpt2");
    const decoder = new TextDecoder("utf-8", { ignoreBOM: true });   // keep a leading U+FEFF as text
    const lines = [];
    for (const file of process.argv.slice(3)) {
        const text = decoder.decode(fs.readFileSync(file));
        lines.push(encoding.encode(text, [], []).join(" "));
    }
    process.stdout.write(lines.join("\n") + "\n");
} else if (mode === "char-classes") {
    // The classes the GPT-2 regex asks about, from the regex engine itself: 1 \p{L}, 2 \p{N},
    // 3 \s, 0 anything else; and whether this node's Unicode version has the code point unassigned.
    const letter = /^\p{L}$/u, number = /^\p{N}$/u, space = /^\s$/u, unassigned = /^\p{Cn}$/u;
    const out = [];
    let runStart = 0, runKey = null;
    for (let cp = 0; cp <= 0x110000; cp++) {
        let key = null;
        if (cp < 0x110000) {
            const c = String.fromCodePoint(cp);
            const cls = letter.test(c) ? 1 : number.test(c) ? 2 : space.test(c) ? 3 : 0;
            key = cls + " " + (unassigned.test(c) ? 1 : 0);
        }
        if (key !== runKey) {
            if (runKey !== null) out.push(runStart.toString(16).toUpperCase() + " " + (cp - 1).toString(16).toUpperCase() + " " + runKey);
            runStart = cp;
            runKey = key;
        }
    }
    process.stdout.write(out.join("\n") + "\n");
} else {
    console.error("usage: node test/tiktoken_reference.js encode FILE... | char-classes");
    process.exit(1);
}
