#!/usr/bin/env python3
"""test_emu_cublas.py — the CPU emulator's stand-in for cuBLASLt and cuBLAS (test/emu/cublas_standin.cpp),
on its own, against float64 NumPy and fp32 PyTorch matmuls.

The stand-in is built as a shared library and driven through ctypes: "device" buffers are NumPy
arrays, as device memory is host memory under the emulator. Every enum value comes from CUDA's own
headers (a small program compiled here prints them), not from this file.

  symbols       every cuBLAS / cuBLASLt function the repository calls (train_gpt.cu, llmc/, dev/cuda/,
                test/*.cu) is defined by the stand-in's object file: it links in place of the libraries
  fp32          cublasLtMatmul, COMPUTE_32F_PEDANTIC, every transpose pair, odd m, n, k, leading
                dimensions larger than the row count: within the fp32 summation bound of the float64
                product; padding between columns untouched; beta = 0 does not read C (NaN there)
  bf16          bf16 in and out, fp32 accumulation, beta = 1 accumulating in place: bit-equal to the
                float64 product rounded to bf16 wherever the fp32 summation bound cannot straddle a bf16
                rounding boundary, within 1 ulp elsewhere; and within 1 ulp of PyTorch's fp32 matmul
                rounded to bf16 (the exact-match count is printed); exact ties round to even
  epilogues     BIAS, GELU_BIAS (dev/cuda/matmul.cu), GELU_AUX_BIAS, DGELU, DGELU_BGRAD in bf16 and fp32,
                BGRADA, BGRADB, against float64 formulas (GELU's tanh approximation, as torch's)
  batched       cuBLASLt strided batch (layout attributes), cublasGemmEx (dev/cuda/common.h's call),
                cublasGemmStridedBatchedEx with the attention's transposes and batch strides
  refusals      an unimplemented epilogue, data type, compute type, order, a misaligned pointer, an
                aux ld that is not a multiple of 8, disagreeing layouts, a bias pointer less aligned than
                the one the heuristic saw: refused, stderr names it
  deterministic the same call twice gives the same bits
  controls      a deliberately wrong transpose fails the fp32 check; one bf16 output nudged by 1 ulp
                fails the exact check: the checkers can fail
"""
import ctypes, os, re, subprocess, sys, tempfile, time
from checks import report, exit_code

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_INC = os.environ.get("CUDA_INCLUDE", "/usr/local/cuda/include")
SRC = os.path.join(ROOT, "test", "emu", "cublas_standin.cpp")
BUILD = os.path.join(ROOT, "build", "emu")
CXX = ["g++", "-std=c++17", "-O2", "-ffp-contract=off", "-I" + CUDA_INC]
U32 = 2.0 ** -24  # fp32 unit roundoff


# ---------------------------------------------------------------------------------------------- build

CONSTANTS = """CUDA_R_32F CUDA_R_16BF CUDA_R_16F CUDA_R_64F CUBLAS_COMPUTE_32F CUBLAS_COMPUTE_32F_PEDANTIC
CUBLAS_COMPUTE_32F_FAST_TF32 CUBLAS_OP_N CUBLAS_OP_T CUBLAS_GEMM_DEFAULT CUBLAS_STATUS_SUCCESS
CUBLAS_STATUS_NOT_SUPPORTED CUBLAS_STATUS_INVALID_VALUE CUBLASLT_MATMUL_DESC_TRANSA CUBLASLT_MATMUL_DESC_TRANSB
CUBLASLT_MATMUL_DESC_EPILOGUE CUBLASLT_MATMUL_DESC_BIAS_POINTER CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE
CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD CUBLASLT_MATMUL_DESC_FAST_ACCUM
CUBLASLT_EPILOGUE_DEFAULT CUBLASLT_EPILOGUE_BIAS CUBLASLT_EPILOGUE_GELU_BIAS CUBLASLT_EPILOGUE_GELU_AUX_BIAS
CUBLASLT_EPILOGUE_DGELU CUBLASLT_EPILOGUE_DGELU_BGRAD CUBLASLT_EPILOGUE_BGRADA CUBLASLT_EPILOGUE_BGRADB
CUBLASLT_EPILOGUE_DRELU CUBLASLT_MATRIX_LAYOUT_ORDER CUBLASLT_ORDER_ROW CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT
CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES""".split()


def build():
    """(the stand-in as a shared library, {constant: value}, the object file's defined symbols)"""
    os.makedirs(BUILD, exist_ok=True)
    so, obj = os.path.join(BUILD, "libcublas_standin_test.so"), os.path.join(BUILD, "cublas_standin_test.o")
    consts_exe = os.path.join(BUILD, "cublas_constants")
    subprocess.run(CXX + ["-fPIC", "-shared", SRC, "-o", so], check=True)
    subprocess.run(CXX + ["-c", SRC, "-o", obj], check=True)
    prog = "#include <cublasLt.h>\n#include <cublas_v2.h>\n#include <cstdio>\n#include <cstddef>\nint main() {\n"
    prog += "".join(f'  printf("{c} %lld\\n", (long long){c});\n' for c in CONSTANTS)
    prog += '  printf("HEURISTIC_SIZE %zu\\n", sizeof(cublasLtMatmulHeuristicResult_t));\n'
    prog += '  printf("HEURISTIC_WS %zu\\n", offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize));\n}\n'
    # linked against the stand-in instead of -lcublasLt -lcublas (it calls nothing from them, but
    # links the object to show it stands alone: no undefined symbol of its own)
    subprocess.run(CXX + ["-x", "c++", "-", "-x", "none", obj, "-o", consts_exe], input=prog, text=True, check=True)
    out = subprocess.run([consts_exe], capture_output=True, text=True, check=True).stdout
    consts = {k: int(v) for k, v in (line.split() for line in out.splitlines())}
    nm = subprocess.run(["nm", "--defined-only", obj], capture_output=True, text=True, check=True).stdout
    defined = {line.split()[-1] for line in nm.splitlines() if " T " in line}
    return ctypes.CDLL(so), consts, defined


def repo_cublas_calls():
    """The cuBLAS functions the repository calls, with cublas_v2.h's macros applied (cublasCreate ->
    cublasCreate_v2), found by the preprocessor rather than by a list kept here."""
    names = set()
    llmc = [os.path.relpath(d, ROOT) for d, _, _ in os.walk(os.path.join(ROOT, "llmc"))]
    dirs = [("", ".cu")] + [(d, ext) for d in llmc for ext in (".cuh", ".h")] + \
        [("dev/cuda", ".cu"), ("dev/cuda", ".h"), ("test", ".cu")]
    for d, ext in dirs:
        for f in sorted(os.listdir(os.path.join(ROOT, d))):
            if f.endswith(ext):
                text = open(os.path.join(ROOT, d, f), errors="replace").read()
                names |= set(re.findall(r"\b(cublas[A-Z]\w*)\s*\(", text))
    prog = "#include <cublasLt.h>\n#include <cublas_v2.h>\n" + "".join(f"SYMBOL {n}\n" for n in sorted(names))
    out = subprocess.run(["g++", "-E", "-P", "-I" + CUDA_INC, "-x", "c++", "-"], input=prog, text=True,
                         capture_output=True, check=True).stdout
    declared = set(re.findall(r"\b(cublas\w+)\s*\(", out))  # drops words in comments ("cublasLt(...)")
    return sorted(set(re.findall(r"^SYMBOL (\w+)$", out, re.M)) & declared)


# ---------------------------------------------------------------------------------------------- helpers

def aligned(n, dtype, align=256, offset=0):
    """n elements at an address `offset` bytes past a multiple of `align` (cudaMalloc gives 256)"""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(n * itemsize + align + offset, np.uint8)
    start = (-raw.ctypes.data) % align + offset
    return raw[start:start + n * itemsize].view(dtype)


def ptr(a):
    return ctypes.c_void_p(a.ctypes.data) if a is not None else ctypes.c_void_p(None)


def bf16_bits(x):
    """float tensor/array -> bf16 bit patterns (uint16), rounded by PyTorch (nearest even)"""
    t = torch.as_tensor(np.asarray(x, np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def ordered(bits):
    """bf16 bit patterns as integers in the order of their values (sign-magnitude unfolded)"""
    x = bits.astype(np.int64)
    return np.where(x & 0x8000, -(x & 0x7FFF), x & 0x7FFF)


def ulp_distance(a, b):
    """|a - b| in bf16 ulps, for bit patterns"""
    return np.abs(ordered(a) - ordered(b))


class Mat:
    """A column-major "device" matrix (or strided batch): `data` holds the elements (float32 or bf16
    bits), `logical` the float64 values as the stand-in must read them, shape (batch, rows, cols)."""

    def __init__(self, rows, cols, kind, rng, ld=None, batch=1, stride=None, scale=1.0, offset=0):
        self.rows, self.cols, self.kind, self.batch = rows, cols, kind, batch
        self.ld = ld or rows
        self.stride = stride if stride is not None else self.ld * cols
        n = self.stride * (batch - 1) + self.ld * cols
        self.data = aligned(n, np.float32 if kind == "f32" else np.uint16, offset=offset)
        pad = np.float32(1234.5)  # what sits between columns: must survive every call
        self.data[:] = pad if kind == "f32" else bf16_bits(np.full(n, pad))
        vals = rng.standard_normal((batch, rows, cols)).astype(np.float32) * np.float32(scale)
        self.set(vals)

    def view(self, b):
        s = self.data[b * self.stride: b * self.stride + self.ld * self.cols]
        return s.reshape(self.cols, self.ld).T[: self.rows, :]

    def set(self, vals):
        for b in range(self.batch):
            self.view(b)[:] = vals[b] if self.kind == "f32" else bf16_bits(vals[b])
        self.logical = self.read()

    def read(self):
        """(batch, rows, cols) float64 of what is stored"""
        out = np.empty((self.batch, self.rows, self.cols))
        for b in range(self.batch):
            v = self.view(b)
            out[b] = v if self.kind == "f32" else bf16_value(np.ascontiguousarray(v))
        return out

    def bits(self):
        return np.stack([np.ascontiguousarray(self.view(b)) for b in range(self.batch)])

    def padding(self):
        mask = np.ones(self.data.shape, bool)
        for b in range(self.batch):
            idx = b * self.stride + np.arange(self.rows)[:, None] + np.arange(self.cols)[None, :] * self.ld
            mask[idx.ravel()] = False
        return self.data[mask].copy()


def op(x, trans):
    return np.swapaxes(x, 1, 2) if trans else x


def check_values(got_mat, ref, tol):
    """got_mat: the stand-in's output; ref, tol: float64 value and absolute error bound per element.
    fp32 output: |got - ref| <= tol. bf16 output: exact where [ref - tol, ref + tol] rounds to one bf16
    value (then the fp32 result, inside it, must round there too), within 1 ulp elsewhere.
    Returns (ok, why, undecided count)."""
    got = got_mat.read()
    if got_mat.kind == "f32":
        err = np.abs(got - ref)
        bad = ~(err <= tol)
        if bad.any():
            i = np.argwhere(bad)[0]
            return False, f"{bad.sum()} of {bad.size} outside the fp32 bound, e.g. at {tuple(i)}: {got[tuple(i)]} vs {ref[tuple(i)]} (bound {tol[tuple(i)]:.3g})", 0
        return True, "", 0
    bits = got_mat.bits()
    lo, hi, mid = bf16_bits(ref - tol), bf16_bits(ref + tol), bf16_bits(ref)
    decided = lo == hi
    wrong = decided & (bits != mid)
    # undecided: between the roundings of the bound's ends (1 ulp apart unless the value is near 0)
    outside = ~decided & ((ordered(bits) < ordered(lo)) | (ordered(bits) > ordered(hi)))
    if wrong.any() or outside.any():
        i = tuple(np.argwhere(wrong | outside)[0])
        return False, (f"{wrong.sum()} decidable elements not bit-equal, {outside.sum()} others outside the bound, of "
                       f"{bits.size}; e.g. at {i}: {bf16_value(np.array([bits[i]]))[0]} vs {ref[i]:.8g}"), int((~decided).sum())
    return True, "", int((~decided).sum())


# ---------------------------------------------------------------------------------------------- API

class Api:
    def __init__(self, lib, c):
        self.lib, self.c = lib, c
        vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        sig = {
            "cublasLtCreate": [vp], "cublasLtDestroy": [vp],
            "cublasLtMatrixLayoutCreate": [vp, i32, u64, u64, i64], "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatrixLayoutSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulDescCreate": [vp, i32, i32], "cublasLtMatmulDescDestroy": [vp],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulPreferenceCreate": [vp], "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, vp, vp],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
            "cublasCreate_v2": [vp], "cublasDestroy_v2": [vp], "cublasSetStream_v2": [vp, vp],
            "cublasSetWorkspace_v2": [vp, vp, sz],
            "cublasGemmEx": [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp, i32, i32, i32, i32],
            "cublasGemmStridedBatchedEx": [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, ctypes.c_longlong, vp, i32,
                                           i32, ctypes.c_longlong, vp, vp, i32, i32, ctypes.c_longlong, i32, i32, i32],
        }
        for name, args in sig.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
        lib.cublasGetStatusString.argtypes = [ctypes.c_int]
        lib.cublasGetStatusString.restype = ctypes.c_char_p
        h = ctypes.c_void_p()
        self.ok(lib.cublasLtCreate(ctypes.byref(h)))
        self.lt = h
        h2 = ctypes.c_void_p()
        self.ok(lib.cublasCreate_v2(ctypes.byref(h2)))
        self.blas = h2

    def ok(self, status):
        if status != self.c["CUBLAS_STATUS_SUCCESS"]:
            raise RuntimeError(self.lib.cublasGetStatusString(status).decode())

    def dtype(self, kind):
        return self.c["CUDA_R_32F"] if kind == "f32" else self.c["CUDA_R_16BF"]

    def layout(self, m, dtype=None):
        lay = ctypes.c_void_p()
        self.ok(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype if dtype is not None else self.dtype(m.kind),
                                                    m.rows, m.cols, m.ld))
        if m.batch > 1:
            self.set(self.lib.cublasLtMatrixLayoutSetAttribute, lay, "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT", ctypes.c_int32(m.batch))
            self.set(self.lib.cublasLtMatrixLayoutSetAttribute, lay, "CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET",
                     ctypes.c_int64(m.stride))
        return lay

    def set(self, fn, obj, attr, value):
        return self.ok(fn(obj, self.c[attr], ctypes.byref(value), ctypes.sizeof(value)))

    def lt_matmul(self, a, b, c, d, ta, tb, alpha=1.0, beta=0.0, compute="CUBLAS_COMPUTE_32F", epilogue=None,
                  bias=None, aux=None, aux_ld=None, align=None, extra=None, heuristic_bias=None):
        """Runs one cublasLtMatmul as the trainer does (descriptor, layouts, heuristic, matmul).
        Returns the status of the first call that is refused. `extra(api, desc, layouts)` may set more.
        `heuristic_bias`: the bias pointer (an int) the descriptor holds while the heuristic is asked;
        `bias` goes in after it (llmc/kernels/matmul.cuh's way)."""
        L, c_ = self.lib, self.c
        desc = ctypes.c_void_p()
        made = []
        try:
            s = L.cublasLtMatmulDescCreate(ctypes.byref(desc), c_[compute], c_["CUDA_R_32F"])
            if s:
                return s
            def sd(attr, value):
                return L.cublasLtMatmulDescSetAttribute(desc, c_[attr], ctypes.byref(value), ctypes.sizeof(value))
            for attr, v in (("CUBLASLT_MATMUL_DESC_TRANSA", ta), ("CUBLASLT_MATMUL_DESC_TRANSB", tb)):
                s = sd(attr, ctypes.c_int32(c_["CUBLAS_OP_T"] if v else c_["CUBLAS_OP_N"]))
                if s:
                    return s
            if epilogue:
                s = sd("CUBLASLT_MATMUL_DESC_EPILOGUE", ctypes.c_uint32(c_[epilogue]))
                if s:
                    return s
            if bias is not None:
                first = ctypes.c_void_p(heuristic_bias) if heuristic_bias is not None else ptr(bias.data)
                for attr, v in (("CUBLASLT_MATMUL_DESC_BIAS_POINTER", first),
                                ("CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE", ctypes.c_int32(self.dtype(bias.kind)))):
                    s = sd(attr, v)
                    if s:
                        return s
            if aux is not None:
                for attr, v in (("CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER", ptr(aux.data)),
                                ("CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD", ctypes.c_int64(aux_ld or aux.ld))):
                    s = sd(attr, v)
                    if s:
                        return s
            layouts = [self.layout(x) for x in (a, b, c, d)]
            made = layouts
            if extra:
                s = extra(self, desc, layouts)
                if s:
                    return s
            pref = ctypes.c_void_p()
            self.ok(L.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
            ws = ctypes.c_uint64(32 << 20)
            self.set(L.cublasLtMatmulPreferenceSetAttribute, pref, "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES", ws)
            if align:
                for x in range(4):
                    v = ctypes.c_uint32(align)
                    self.ok(L.cublasLtMatmulPreferenceSetAttribute(
                        pref, c_["CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES"] + x, ctypes.byref(v), 4))
            result = (ctypes.c_uint8 * c_["HEURISTIC_SIZE"])()
            found = ctypes.c_int(0)
            s = L.cublasLtMatmulAlgoGetHeuristic(self.lt, desc, *layouts, pref, 1, result, ctypes.byref(found))
            L.cublasLtMatmulPreferenceDestroy(pref)
            if s:
                return s
            wsize = ctypes.c_size_t.from_buffer(result, c_["HEURISTIC_WS"]).value
            if found.value != 1 or wsize != 0:
                raise RuntimeError(f"heuristic returned {found.value} algorithms, workspace {wsize}")
            if heuristic_bias is not None:
                s = sd("CUBLASLT_MATMUL_DESC_BIAS_POINTER", ptr(bias.data))
                if s:
                    return s
            al, be = ctypes.c_float(alpha), ctypes.c_float(beta)
            return L.cublasLtMatmul(self.lt, desc, ctypes.byref(al), ptr(a.data), layouts[0], ptr(b.data), layouts[1],
                                    ctypes.byref(be), ptr(c.data), layouts[2], ptr(d.data), layouts[3], result, None,
                                    0, None)
        finally:
            for lay in made:
                L.cublasLtMatrixLayoutDestroy(lay)
            if desc:
                L.cublasLtMatmulDescDestroy(desc)

    def gemm(self, a, b, c, ta, tb, alpha, beta, batched, compute="CUBLAS_COMPUTE_32F"):
        L, c_ = self.lib, self.c
        m, n = c.rows, c.cols
        k = a.rows if ta else a.cols
        opn = lambda t: c_["CUBLAS_OP_T"] if t else c_["CUBLAS_OP_N"]
        al, be = ctypes.c_float(alpha), ctypes.c_float(beta)
        self.ok(L.cublasSetStream_v2(self.blas, None))
        if not batched:
            return L.cublasGemmEx(self.blas, opn(ta), opn(tb), m, n, k, ctypes.byref(al), ptr(a.data), self.dtype(a.kind),
                                  a.ld, ptr(b.data), self.dtype(b.kind), b.ld, ctypes.byref(be), ptr(c.data),
                                  self.dtype(c.kind), c.ld, c_[compute], c_["CUBLAS_GEMM_DEFAULT"])
        return L.cublasGemmStridedBatchedEx(self.blas, opn(ta), opn(tb), m, n, k, ctypes.byref(al), ptr(a.data),
                                            self.dtype(a.kind), a.ld, a.stride, ptr(b.data), self.dtype(b.kind), b.ld,
                                            b.stride, ctypes.byref(be), ptr(c.data), self.dtype(c.kind), c.ld, c.stride,
                                            c.batch, c_[compute], c_["CUBLAS_GEMM_DEFAULT"])


class Stderr:
    """Captures what the stand-in writes to file descriptor 2."""

    def __enter__(self):
        sys.stderr.flush()
        self.tmp = tempfile.TemporaryFile(mode="w+")
        self.saved = os.dup(2)
        os.dup2(self.tmp.fileno(), 2)
        return self

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.tmp.seek(0)
        self.text = self.tmp.read()
        self.tmp.close()


# ---------------------------------------------------------------------------------------------- references

def product(a, b, ta, tb):
    """float64 op(A) op(B) and the bound on any fp32 summation of it: (k + 1) u sum |a||b|"""
    A, B = op(a.logical, ta), op(b.logical, tb)
    k = A.shape[2]
    return A @ B, (k + 1) * U32 * (np.abs(A) @ np.abs(B))


def linear(a, b, c_logical, ta, tb, alpha, beta):
    """float64 alpha op(A) op(B) + beta C and its fp32 error bound"""
    p, tp = product(a, b, ta, tb)
    v = alpha * p
    tol = abs(alpha) * tp + U32 * np.abs(v)
    if beta != 0:
        v = v + beta * c_logical
        tol += 2 * U32 * np.abs(v) + U32 * abs(beta) * np.abs(c_logical)
    return v, tol * 1.01 + 1e-30


GELU_SCALE = np.sqrt(2.0 / np.pi)


def gelu(x):
    """0.5 x (1 + tanh z), z = sqrt(2/pi) (x + 0.044715 x^3); 1 + tanh z written as 2 sigmoid(2z), which
    does not cancel for large negative x"""
    z = GELU_SCALE * (x + 0.044715 * x ** 3)
    return x / (1.0 + np.exp(-2.0 * z))


def gelu_grad(x):
    z = GELU_SCALE * (x + 0.044715 * x ** 3)
    s = 1.0 / (1.0 + np.exp(-2.0 * z))  # (1 + tanh z) / 2; 1 - tanh^2 z = 4 s (1 - s)
    return s + 2.0 * x * s * (1.0 - s) * GELU_SCALE * (1.0 + 3 * 0.044715 * x * x)


# ---------------------------------------------------------------------------------------------- checks

def main():
    if not os.path.exists(os.path.join(CUDA_INC, "cublasLt.h")):
        print(f"SKIP: emu cublas stand-in ({CUDA_INC}/cublasLt.h is missing: the stand-in is compiled against "
              "CUDA's own headers; install the CUDA toolkit or set CUDA_INCLUDE)")
        return 0
    t0 = time.time()
    try:
        lib, consts, defined = build()
    except subprocess.CalledProcessError as e:
        report(False, "emu cublas build", f"{' '.join(e.cmd[:6])}... exited {e.returncode}")
        return 1
    print(f"built the stand-in in {time.time() - t0:.1f} s", flush=True)
    api = Api(lib, consts)
    c = consts
    rng = np.random.default_rng(20240614)

    # ---- symbols: the repository's calls, all defined (the object links in place of the libraries)
    symbols = repo_cublas_calls()
    missing = [s for s in symbols if s not in defined]
    report(len(symbols) >= 15 and not missing, f"emu cublas symbols: the {len(symbols)} functions the repo calls are defined",
           f"missing {missing}" if missing else f"found only {symbols}")

    # ---- fp32, PEDANTIC, all transposes, odd shapes, ld > rows, beta = 0 with NaN in C (= D)
    m, n, k = 37, 23, 19
    for ta in (False, True):
        for tb in (False, True):
            a = Mat(k if ta else m, m if ta else k, "f32", rng, ld=(k if ta else m) + 3)
            b = Mat(n if tb else k, k if tb else n, "f32", rng, ld=(n if tb else k) + 5)
            d = Mat(m, n, "f32", rng, ld=m + 2)
            d.set(np.full((1, m, n), np.nan, np.float32))  # beta = 0: C (here D itself) must not be read
            pad = d.padding()
            s = api.lt_matmul(a, b, d, d, ta, tb, alpha=0.75, beta=0.0, compute="CUBLAS_COMPUTE_32F_PEDANTIC")
            name = f"emu cublas fp32 transa={'NT'[ta]} transb={'NT'[tb]} m={m} n={n} k={k}, ld > rows, beta=0"
            if s:
                report(False, name, f"status {s}")
                continue
            ref, tol = linear(a, b, None, ta, tb, 0.75, 0.0)
            ok, why, _ = check_values(d, ref, tol)
            pad_ok = np.array_equal(d.padding(), pad)
            report(ok and pad_ok, name, why or "the padding between columns changed")

    # ---- bf16 in/out, fp32 accumulation, beta = 1 in place; also against torch's fp32 matmul
    m, n, k = 45, 29, 131
    undecided_total, exact_torch, total = 0, 0, 0
    for ta in (False, True):
        for tb in (False, True):
            a = Mat(k if ta else m, m if ta else k, "bf16", rng, ld=(k if ta else m) + 1)
            b = Mat(n if tb else k, k if tb else n, "bf16", rng, ld=(n if tb else k) + 7)
            d = Mat(m, n, "bf16", rng, ld=m + 3)
            c0, pad = d.logical.copy(), d.padding()
            s = api.lt_matmul(a, b, d, d, ta, tb, alpha=1.0, beta=1.0)
            name = f"emu cublas bf16 transa={'NT'[ta]} transb={'NT'[tb]} m={m} n={n} k={k}, beta=1 accumulates in place"
            if s:
                report(False, name, f"status {s}")
                continue
            ref, tol = linear(a, b, c0, ta, tb, 1.0, 1.0)
            ok, why, undecided = check_values(d, ref, tol)
            undecided_total += undecided
            # PyTorch: bf16 inputs upcast, fp32 matmul, + C, rounded to bf16
            At = torch.from_numpy(op(a.logical, ta)[0]).float()
            Bt = torch.from_numpy(op(b.logical, tb)[0]).float()
            tref = (At @ Bt + torch.from_numpy(c0[0]).float()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            dist = ulp_distance(d.bits()[0], tref)
            exact_torch += int((dist == 0).sum())
            total += dist.size
            pad_ok = np.array_equal(d.padding(), pad)
            report(ok and dist.max() <= 1 and pad_ok, name,
                   why or (f"{int((dist > 1).sum())} elements over 1 ulp from torch" if pad_ok else "the padding changed"))
    print(f"  bf16: {exact_torch} of {total} outputs bit-equal to torch's fp32 matmul rounded to bf16, the rest 1 ulp; "
          f"{undecided_total} within the fp32 bound of a bf16 rounding boundary (allowed 1 ulp)", flush=True)

    # ---- exact ties: D[i] = +-(1 + i 2^-7) + +-2^-8 is exact in fp32 and halfway between two bf16
    # values; nearest-even rounds half of them down, half up (random data almost never ties)
    m, n = 64, 3
    a, b, d = Mat(m, 2, "bf16", rng), Mat(2, n, "bf16", rng), Mat(m, n, "bf16", rng)
    sign = np.where(np.arange(m) % 4 < 2, 1.0, -1.0)
    a.set(np.stack([sign * (1 + np.arange(m) * 2.0 ** -7), sign * 2.0 ** -8], axis=1)[None].astype(np.float32))
    b.set(np.ones((1, 2, n), np.float32))
    api.ok(api.lt_matmul(a, b, d, d, False, False))
    ref = a.logical @ b.logical
    ok, why, _ = check_values(d, ref, np.zeros_like(ref))  # bound 0: every element decided
    report(ok, "emu cublas bf16 output: exact ties round to nearest even", why)

    # ---- the trainer's forward: transa=T, transb=N, BIAS epilogue, bf16 and fp32
    for kind, compute in (("bf16", "CUBLAS_COMPUTE_32F"), ("f32", "CUBLAS_COMPUTE_32F_PEDANTIC")):
        OC, N, IC = 53, 40, 67
        w = Mat(IC, OC, kind, rng)  # W (OC x IC row-major) is IC x OC column-major
        x = Mat(IC, N, kind, rng)
        bias = Mat(OC, 1, kind, rng)
        out = Mat(OC, N, kind, rng)
        s = api.lt_matmul(w, x, out, out, True, False, compute=compute, epilogue="CUBLASLT_EPILOGUE_BIAS", bias=bias)
        name = f"emu cublas BIAS epilogue {kind} (out = W^T x + b per row)"
        if s:
            report(False, name, f"status {s}")
            continue
        ref, tol = linear(w, x, None, True, False, 1.0, 0.0)
        ref = ref + bias.logical
        tol = tol + 2 * U32 * np.abs(ref)
        ok, why, _ = check_values(out, ref, tol)
        report(ok, name, why)

    # ---- GELU_BIAS (as dev/cuda/matmul.cu asks it) and GELU_AUX_BIAS (aux = the GELU input, ld > rows),
    # then DGELU / DGELU_BGRAD reading that aux; bf16, and fp32 where erf-GELU vs tanh-GELU would show
    for kind in ("bf16", "f32"):
        compute = "CUBLAS_COMPUTE_32F" if kind == "bf16" else "CUBLAS_COMPUTE_32F_PEDANTIC"
        OC, N, IC = 40, 27, 50
        for epi in ("CUBLASLT_EPILOGUE_GELU_BIAS", "CUBLASLT_EPILOGUE_GELU_AUX_BIAS"):
            w, x, bias = Mat(IC, OC, kind, rng, scale=0.5), Mat(IC, N, kind, rng), Mat(OC, 1, kind, rng)
            out = Mat(OC, N, kind, rng)
            aux = Mat(OC, N, kind, rng, ld=48) if "AUX" in epi else None
            s = api.lt_matmul(w, x, out, out, True, False, compute=compute, epilogue=epi, bias=bias, aux=aux)
            v, tv = linear(w, x, None, True, False, 1.0, 0.0)
            v = v + bias.logical
            tv = tv + 2 * U32 * np.abs(v)
            g = gelu(v)
            ok, why, _ = check_values(out, g, 1.2 * tv + 2 * U32 * np.abs(g)) if not s else (False, f"status {s}", 0)
            if aux is not None and ok:
                ok, why, _ = check_values(aux, v, tv)
            torch_g = torch.nn.functional.gelu(torch.from_numpy(v), approximate="tanh").numpy()
            ok = ok and np.allclose(torch_g, g, rtol=1e-12, atol=1e-12)
            report(ok, f"emu cublas {epi[len('CUBLASLT_EPILOGUE_'):]} epilogue {kind} (tanh GELU as torch's"
                   f"{'; aux = GELU input, aux ld 48 > 40 rows' if aux is not None else ''})", why)

        for epi in ("CUBLASLT_EPILOGUE_DGELU", "CUBLASLT_EPILOGUE_DGELU_BGRAD"):
            # the backward of a GELU'd layer: D = op(A) op(B) * gelu'(aux), aux from GELU_AUX_BIAS above
            K_ = 31
            a, b, d = Mat(K_, OC, kind, rng), Mat(K_, N, kind, rng), Mat(OC, N, kind, rng)
            bgrad = Mat(OC, 1, kind, rng) if epi.endswith("BGRAD") else None
            s = api.lt_matmul(a, b, d, d, True, False, compute=compute, epilogue=epi, aux=aux, bias=bgrad)
            p, tp = product(a, b, True, False)
            ref = p * gelu_grad(aux.read())
            tol = 1.2 * tp + 3 * U32 * np.abs(ref) + 1e-30
            ok, why, _ = check_values(d, ref, tol) if not s else (False, f"status {s}", 0)
            if bgrad is not None and ok:
                bref = ref.sum(axis=2, keepdims=True)
                btol = tol.sum(axis=2, keepdims=True) + (N + 1) * U32 * np.abs(ref).sum(axis=2, keepdims=True)
                ok, why, _ = check_values(bgrad, bref, btol)
            report(ok, f"emu cublas {epi[len('CUBLASLT_EPILOGUE_'):]} epilogue {kind} (D = AB * gelu'(aux)"
                   f"{', bias = row sums of D' if bgrad is not None else ''})", why)

    for epi, trans in (("CUBLASLT_EPILOGUE_BGRADA", (True, False)), ("CUBLASLT_EPILOGUE_BGRADB", (False, True))):
        m, n, k = 21, 26, 35
        ta, tb = trans
        a = Mat(k if ta else m, m if ta else k, "f32", rng)
        b = Mat(n if tb else k, k if tb else n, "f32", rng)
        d = Mat(m, n, "f32", rng)
        g_len = m if epi.endswith("A") else n
        bg = Mat(g_len, 1, "f32", rng)
        s = api.lt_matmul(a, b, d, d, ta, tb, compute="CUBLAS_COMPUTE_32F_PEDANTIC", epilogue=epi, bias=bg)
        ref, tol = linear(a, b, None, ta, tb, 1.0, 0.0)
        ok, why, _ = check_values(d, ref, tol) if not s else (False, f"status {s}", 0)
        src = op(a.logical, ta) if epi.endswith("A") else np.swapaxes(op(b.logical, tb), 1, 2)  # (1, len, k)
        gref = src.sum(axis=2, keepdims=True)
        gtol = (k + 1) * U32 * np.abs(src).sum(axis=2, keepdims=True) + 1e-30
        ok2, why2, _ = check_values(bg, gref, gtol) if ok else (False, "", 0)
        report(ok and ok2, f"emu cublas {epi[len('CUBLASLT_EPILOGUE_'):]} epilogue fp32 (bias gradient = sums of op("
               f"{epi[-1]})'s {'rows' if epi.endswith('A') else 'columns'} over k)", why or why2)

    # ---- strided batches: cuBLASLt layouts, cublasGemmEx, cublasGemmStridedBatchedEx (attention's calls)
    m, n, k, nb = 19, 17, 24, 3
    a = Mat(k, m, "bf16", rng, ld=k + 2, batch=nb, stride=(k + 2) * m + 11)
    b = Mat(k, n, "bf16", rng, batch=nb, stride=k * n + 5)
    d = Mat(m, n, "bf16", rng, batch=nb, stride=m * n + 3)
    s = api.lt_matmul(a, b, d, d, True, False, alpha=0.5, align=2)
    ref, tol = linear(a, b, None, True, False, 0.5, 0.0)
    ok, why, _ = check_values(d, ref, tol) if not s else (False, f"status {s}", 0)
    report(ok, f"emu cublas cuBLASLt strided batch of {nb} (BATCH_COUNT, STRIDED_BATCH_OFFSET, odd strides)", why)

    n_ = 40  # dev/cuda/common.h's GEMM ceiling call: square, N N, bf16, COMPUTE_32F
    a, b, d = Mat(n_, n_, "bf16", rng), Mat(n_, n_, "bf16", rng), Mat(n_, n_, "bf16", rng)
    s = api.gemm(a, b, d, False, False, 1.0, 0.0, batched=False)
    ref, tol = linear(a, b, None, False, False, 1.0, 0.0)
    ok, why, _ = check_values(d, ref, tol) if not s else (False, f"status {s}", 0)
    report(ok, "emu cublas cublasGemmEx bf16 N N", why)

    # attention: scores (T x T) = scale K^T Q per head; dV^T = dO^T P (N T), batch strides = head sizes
    T, hs, heads = 13, 8, 4
    for kind, compute in (("bf16", "CUBLAS_COMPUTE_32F"), ("f32", "CUBLAS_COMPUTE_32F_PEDANTIC")):
        for ta, tb, (mm, nn, kk) in ((True, False, (T, T, hs)), (False, True, (hs, T, T)), (False, False, (hs, T, T))):
            a = Mat(kk if ta else mm, mm if ta else kk, kind, rng, batch=heads)
            b = Mat(nn if tb else kk, kk if tb else nn, kind, rng, batch=heads)
            d = Mat(mm, nn, kind, rng, batch=heads)
            d.data[:] = np.nan if kind == "f32" else 0x7FC0  # beta = 0: C must not be read
            s = api.gemm(a, b, d, ta, tb, 0.35, 0.0, batched=True, compute=compute)
            ref, tol = linear(a, b, None, ta, tb, 0.35, 0.0)
            ok, why, _ = check_values(d, ref, tol) if not s else (False, f"status {s}", 0)
            report(ok, f"emu cublas cublasGemmStridedBatchedEx {kind} transa={'NT'[ta]} transb={'NT'[tb]} "
                   f"m={mm} n={nn} k={kk} x {heads} heads", why)

    # ---- refusals: each one named on stderr
    def refused(name, want_status, want_text, call):
        with Stderr() as err:
            s = call()
        ok = s == c[want_status] and want_text in err.text
        report(ok, f"emu cublas refuses {name}", f"status {s}, stderr {err.text.strip()!r}")

    def small(kind="bf16", **kw):
        return Mat(8, 8, kind, rng, **kw)
    refused("epilogue DRELU", "CUBLAS_STATUS_NOT_SUPPORTED", "CUBLASLT_EPILOGUE_DRELU",
            lambda: api.lt_matmul(small(), small(), small(), small(), False, False, epilogue="CUBLASLT_EPILOGUE_DRELU"))
    refused("compute type FAST_TF32", "CUBLAS_STATUS_NOT_SUPPORTED", "CUBLAS_COMPUTE_32F_FAST_TF32",
            lambda: api.lt_matmul(small("f32"), small("f32"), small("f32"), small("f32"), False, False,
                                  compute="CUBLAS_COMPUTE_32F_FAST_TF32"))

    def fp64_layout(api_, desc, layouts):  # (fp16 is implemented, for train_gpt_fp16; fp64 is not)
        lay = ctypes.c_void_p()
        api_.ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), c["CUDA_R_64F"], 8, 8, 8))
        layouts[0], old = lay, layouts[0]
        lib.cublasLtMatrixLayoutDestroy(old)
        return 0
    refused("data type CUDA_R_64F", "CUBLAS_STATUS_NOT_SUPPORTED", "CUDA_R_64F",
            lambda: api.lt_matmul(small(), small(), small(), small(), False, False, extra=fp64_layout))
    refused("row-major order", "CUBLAS_STATUS_NOT_SUPPORTED", "order",
            lambda: api.lt_matmul(small(), small(), small(), small(), False, False, extra=lambda a_, d_, ls: lib.cublasLtMatrixLayoutSetAttribute(
                ls[0], c["CUBLASLT_MATRIX_LAYOUT_ORDER"], ctypes.byref(ctypes.c_int32(c["CUBLASLT_ORDER_ROW"])), 4)))
    refused("descriptor attribute FAST_ACCUM", "CUBLAS_STATUS_NOT_SUPPORTED", f"attribute {c['CUBLASLT_MATMUL_DESC_FAST_ACCUM']}",
            lambda: api.lt_matmul(small(), small(), small(), small(), False, False, extra=lambda a_, d_, ls: lib.cublasLtMatmulDescSetAttribute(
                d_, c["CUBLASLT_MATMUL_DESC_FAST_ACCUM"], ctypes.byref(ctypes.c_int8(1)), 1)))
    refused("a pointer 2 bytes off the default 256-byte alignment", "CUBLAS_STATUS_INVALID_VALUE", "256-byte aligned",
            lambda: api.lt_matmul(small(offset=2), small(), small(), small(), False, False))
    refused("an aux ld that is not a multiple of 8", "CUBLAS_STATUS_INVALID_VALUE", "multiple of 8",
            lambda: api.lt_matmul(Mat(12, 8, "bf16", rng), small(), Mat(12, 8, "bf16", rng), Mat(12, 8, "bf16", rng), False, False,
                                  epilogue="CUBLASLT_EPILOGUE_GELU_AUX_BIAS", bias=Mat(12, 1, "bf16", rng),
                                  aux=Mat(12, 8, "bf16", rng), aux_ld=12))
    # the heuristic reads the bias pointer's value for its alignment (cublasLt.h): a 256-byte-aligned one
    # there, a 16-byte-aligned one at the matmul is refused; asked with a 16-byte stand-in address
    # (as llmc/kernels/matmul.cuh asks), the same matmul runs
    def bias_call(heuristic_bias):
        return lambda: api.lt_matmul(small(), small(), small(), small(), False, False, epilogue="CUBLASLT_EPILOGUE_BIAS",
                                     bias=Mat(8, 1, "bf16", rng, offset=16), heuristic_bias=heuristic_bias)
    refused("a bias pointer less aligned than the one the heuristic saw", "CUBLAS_STATUS_INVALID_VALUE",
            "CUBLASLT_MATMUL_DESC_BIAS_POINTER", bias_call(1 << 20))
    report(bias_call(16)() == c["CUBLAS_STATUS_SUCCESS"],
           "emu cublas: heuristic asked with a 16-byte-aligned stand-in bias address, a 16-byte-aligned bias runs")
    refused("layouts that disagree with the transposes", "CUBLAS_STATUS_INVALID_VALUE", "layouts disagree",
            lambda: api.lt_matmul(Mat(8, 5, "bf16", rng), small(), small(), small(), False, False))
    refused("a bf16 bias with an fp32 output", "CUBLAS_STATUS_NOT_SUPPORTED", "bias data type CUDA_R_16BF",
            lambda: api.lt_matmul(small("f32"), small("f32"), small("f32"), small("f32"), False, False,
                                  compute="CUBLAS_COMPUTE_32F_PEDANTIC", epilogue="CUBLASLT_EPILOGUE_BIAS",
                                  bias=Mat(8, 1, "bf16", rng)))

    # ---- deterministic: the same call twice, the same bits
    m, n, k = 64, 48, 257
    a, b = Mat(k, m, "bf16", rng), Mat(k, n, "bf16", rng)
    d1, d2 = Mat(m, n, "f32", rng), Mat(m, n, "f32", rng)
    api.ok(api.lt_matmul(a, b, d1, d1, True, False))
    api.ok(api.lt_matmul(a, b, d2, d2, True, False))
    report(np.array_equal(d1.data.view(np.uint32), d2.data.view(np.uint32)), "emu cublas deterministic: two runs, same bits")

    # ---- controls: the checkers can fail
    m = n = k = 24  # square, so the wrong transpose still passes the layout checks
    a, b, d = Mat(k, m, "f32", rng), Mat(k, n, "f32", rng), Mat(m, n, "f32", rng)
    api.ok(api.lt_matmul(a, b, d, d, False, False, compute="CUBLAS_COMPUTE_32F_PEDANTIC"))  # should be transa=T
    ref, tol = linear(a, b, None, True, False, 1.0, 0.0)
    ok, why, _ = check_values(d, ref, tol)
    report(not ok, "emu cublas control: a wrong transpose (N for T) fails the fp32 check", "it passed")
    a, b, d = Mat(k, m, "bf16", rng), Mat(k, n, "bf16", rng), Mat(m, n, "bf16", rng)
    api.ok(api.lt_matmul(a, b, d, d, True, False))
    ref, tol = linear(a, b, None, True, False, 1.0, 0.0)
    ok_before, _, _ = check_values(d, ref, tol)
    decided = bf16_bits(ref - tol) == bf16_bits(ref + tol)
    i = tuple(np.argwhere(decided)[0])
    d.view(i[0])[i[1], i[2]] ^= 1  # one output one ulp off (the low mantissa bit flipped)
    ok_after, _, _ = check_values(d, ref, tol)
    report(ok_before and not ok_after, "emu cublas control: one bf16 output 1 ulp off fails the exact check",
           f"before {ok_before}, after {ok_after}")

    # ---- speed, for the record (not asserted): the forward of a C=768 MLP layer on 64 tokens
    N, IC, OC = 64, 768, 3072
    w, x, out = Mat(IC, OC, "bf16", rng), Mat(IC, N, "bf16", rng), Mat(OC, N, "bf16", rng)
    t = time.time()
    api.ok(api.lt_matmul(w, x, out, out, True, False))
    dt = time.time() - t
    print(f"  speed: bf16 {OC} x {N} x {IC} in {dt * 1e3:.0f} ms, {2.0 * N * IC * OC / dt / 1e9:.2f} GFLOP/s (one core)")
    print(f"  total {time.time() - t0:.1f} s", flush=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
