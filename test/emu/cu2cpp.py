#!/usr/bin/env python3
"""cu2cpp.py — turns CUDA source into C++ that g++ compiles against the emulator (cuda_emu.h).

Four rewrites, nothing else; line numbers are kept (a `#line` at the top, and every rewrite
keeps its newlines), so compiler errors and __FILE__/__LINE__ point into the original file:

    K<<<grid, block, smem, stream>>>(args);
        -> emu::launch(emu::kernel_address(K), "K", __FILE__, __LINE__, emu::bind_args(K, args), grid, block, smem, stream);
       The arguments are evaluated and converted to the kernel's parameter types at the launch,
       and kept by value (as the real runtime does: a CUDA graph replays a kernel with the values
       its arguments had when it was captured). Each CUDA thread calls the kernel on its own
       fiber with its own copy of them, as on a GPU. The kernel's address keys
       cudaFuncSetAttribute's opt-ins.
    __shared__ T a[N], b[M];
        -> static T a[N], b[M]; emu::shared_first_touch(a, ...); emu::shared_first_touch(b, ...);
       One copy, reused by the blocks one after another; each block's first touch fills it with NaN.
    extern __shared__ T name[];
        -> T* name = (T*)emu::dynamic_shared_memory();
    __global__ void __launch_bounds__(N) k(params) {
        -> __global__ void k(params) { emu::check_launch_bounds(N, ...);

    python3 test/emu/cu2cpp.py SRC_ROOT OUT_ROOT FILE...   (FILE relative to SRC_ROOT)
"""
import os, re, sys


def code_mask(text):
    """A list of booleans: True where text[i] is code (not inside a comment, string or char)."""
    mask = [True] * len(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c == '"' or c == "'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j += 1
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            mask[k] = False
        i = j
    return mask


def match_forward(text, i, open_ch, close_ch):
    """Index just past the bracket that closes the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j + 1
    raise SyntaxError(f"unbalanced {open_ch} at offset {i}")


def callee_start(text, end):
    """Start of the kernel expression that ends at text[end] (exclusive): name, scopes, template args."""
    i = end
    while i > 0 and text[i - 1] in " \t":
        i -= 1
    if text[i - 1] == ">":  # template arguments: walk back to the matching '<'
        depth = 0
        j = i - 1
        while j >= 0:
            if text[j] == ">":
                depth += 1
            elif text[j] == "<":
                depth -= 1
                if depth == 0:
                    break
            j -= 1
        i = j
    while i > 0 and (text[i - 1].isalnum() or text[i - 1] in "_:"):
        i -= 1
    return i


def rewrite_launches(text):
    out, pos = [], 0
    mask = code_mask(text)
    i = text.find("<<<")
    while i >= 0:
        if not mask[i]:
            i = text.find("<<<", i + 3)
            continue
        start = callee_start(text, i)
        callee = text[start:i].strip()
        close = text.find(">>>", i)
        config = text[i + 3:close]
        paren = close + 3
        while text[paren] in " \t\n":
            paren += 1
        if text[paren] != "(":
            raise SyntaxError(f"expected '(' after >>> at offset {paren}")
        args_end = match_forward(text, paren, "(", ")")
        args = text[paren + 1:args_end - 1]
        name = re.sub(r"\s+", " ", callee)
        out.append(text[pos:start])
        bound = f"{callee}, {args}" if args.strip() else callee
        out.append(f'emu::launch(emu::kernel_address({callee}), "{name}", __FILE__, __LINE__, '
                   f'emu::bind_args({bound}), {config})')
        pos = args_end
        i = text.find("<<<", args_end)
    out.append(text[pos:])
    return "".join(out)


DYNAMIC = re.compile(r"extern\s+__shared__\s+((?:__align__\s*\(\s*\d+\s*\)\s*)?)([\w:<>, ]+?)\s*(\w+)\s*\[\s*\]\s*;")
STATIC = re.compile(r"__shared__\s+([^;]*);")


def declarator_names(decl):
    """The names declared by 'T a[N], b[M][K]' (the first declarator carries the type)."""
    names, depth, part = [], 0, ""
    for c in decl + ",":
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        if c == "," and depth == 0:
            head = part.split("[")[0].strip()
            names.append(re.findall(r"\w+", head)[-1])
            part = ""
        else:
            part += c
    return names


def rewrite_shared(text):
    text = DYNAMIC.sub(lambda m: f"{m.group(2)}* {m.group(3)} = ({m.group(2)}*)emu::dynamic_shared_memory();", text)

    def static(m):
        decl = m.group(1)
        touches = " ".join(f"emu::shared_first_touch({n}, sizeof({n}), __FILE__, __LINE__);"
                           for n in declarator_names(decl))
        return f"static {decl}; {touches}"

    mask = code_mask(text)
    out, pos = [], 0
    for m in STATIC.finditer(text):
        if not mask[m.start()] or text[max(0, m.start() - 7):m.start()].strip().endswith("extern"):
            continue
        out.append(text[pos:m.start()])
        out.append(static(m))
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


BOUNDS = re.compile(r"__launch_bounds__\s*\(")


def rewrite_launch_bounds(text):
    """__global__ void __launch_bounds__(N) k(params) {  ->  __global__ void k(params) { check(N);"""
    mask = code_mask(text)
    out, pos = [], 0
    for m in BOUNDS.finditer(text):
        if not mask[m.start()]:
            continue
        args_end = match_forward(text, m.end() - 1, "(", ")")
        bound = text[m.end():args_end - 1].split(",")[0].strip()
        params = text.find("(", args_end)
        body = text.find("{", match_forward(text, params, "(", ")"))
        out.append(text[pos:m.start()])
        out.append(text[args_end:body + 1])
        out.append(f" emu::check_launch_bounds({bound}, __FILE__, __LINE__);")
        pos = body + 1
    out.append(text[pos:])
    return "".join(out)


def convert(src_root, out_root, rel):
    with open(os.path.join(src_root, rel)) as f:
        text = f.read()
    text = rewrite_launch_bounds(rewrite_shared(rewrite_launches(text)))
    dst = os.path.join(out_root, rel)
    os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
    original = os.path.relpath(os.path.join(src_root, rel))
    body = f'#line 1 "{original}"\n' + text
    # write only when changed, so make's timestamps stay meaningful
    if os.path.exists(dst) and open(dst).read() == body:
        return
    with open(dst + ".tmp", "w") as f:
        f.write(body)
    os.replace(dst + ".tmp", dst)


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    src_root, out_root = sys.argv[1], sys.argv[2]
    for rel in sys.argv[3:]:
        convert(src_root, out_root, rel)


if __name__ == "__main__":
    main()
