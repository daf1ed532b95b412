// The JavaScript half of scripts/bench_tokenizer.sh: times the two npm tokenizers on FILE, checks
// they give exactly the token ids in IDS_FILE (ours), and prints one "bench" line per tokenizer.
//   tiktoken     OpenAI's Rust tokenizer compiled to WebAssembly (encode_ordinary)
//   js-tiktoken  the same algorithm in plain JavaScript (encode with no special tokens)
// Each time is the best of REPEAT runs on a string already in memory, like ours.
const fs = require("fs");
const path = require("path");
const modules = path.join(__dirname, "..", "test", "node_modules");
const { getEncoding } = require(path.join(modules, "js-tiktoken"));
const tiktoken = require(path.join(modules, "tiktoken"));

const [file, idsFile, repeatArg] = process.argv.slice(2);
const repeat = Number(repeatArg || 3);
const bytes = fs.readFileSync(file);
const text = new TextDecoder("utf-8", { ignoreBOM: true }).decode(bytes);
const ours = fs.readFileSync(idsFile, "utf8").trim().split(/\s+/).map(Number);

function bench(name, encode) {
    let best = Infinity, ids = null;
    for (let r = 0; r < repeat; r++) {
        const start = process.hrtime.bigint();
        ids = encode(text);
        best = Math.min(best, Number(process.hrtime.bigint() - start) / 1e9);
    }
    const same = ids.length === ours.length && ours.every((id, i) => ids[i] === id);
    console.log(`bench name=${name} threads=1 bytes=${bytes.length} tokens=${ids.length} seconds=${best.toFixed(4)} ` +
                `mb_per_s=${(bytes.length / 1e6 / best).toFixed(2)} same_ids_as_ours=${same}`);
}

const wasm = tiktoken.get_encoding("gpt2");
bench("tiktoken-wasm", (t) => wasm.encode_ordinary(t));
wasm.free();
const js = getEncoding("gpt2");
bench("js-tiktoken", (t) => js.encode(t, [], []));
