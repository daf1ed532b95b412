# Builds everything: the CPU reference trainer, the GPU trainer (when nvcc is present),
# the data tools and the tests. `make test` runs every test and prints 'N passed, N failed'.
#
#   make            build all
#   make test       build and run the tests (see test/run_tests.py)
#   make run        the main job: prepare the default corpus and train a small GPT on it
#   make gpu-check  on a GPU machine: build for the local GPU and run every GPU check
#   make -C dev/cuda run   on a GPU machine: the kernel lab, every kernel from naive to fast, one table
#   make emu        the GPU code built for the CPU emulation of CUDA (build/emu/), which the tests run
#
# CPU code is built with -march=native: the binaries are meant for the machine that builds them.

CXX      ?= g++
CXXFLAGS ?= -O3 -march=native -ffp-contract=fast -fno-math-errno -std=c++17 -Wall -Wextra -Wno-unused-parameter -fopenmp
CXXFLAGS += -I.
LDLIBS   += -lm

NVCC     ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
# Build for the local GPU when there is one, otherwise for Ampere (sm_80) and Hopper (sm_90).
GPU_CC   := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '.')
ifeq ($(GPU_CC),)
CUDA_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
else
CUDA_ARCH ?= -gencode arch=compute_$(GPU_CC),code=sm_$(GPU_CC)
endif
NVCCFLAGS ?= -O3 -std=c++17 --use_fast_math $(CUDA_ARCH) -Xcompiler -fopenmp -I.
NVCCFLAGS += -Xcompiler -Wall,-Wextra,-Wno-unused-parameter
GPU_LDLIBS := -lcublasLt -lcublas -lcudnn
GPU_HEADERS := $(wildcard llmc/*/*.cuh)
# The GPU trainer talks to other GPUs with NCCL (llmc/parallel/comm_nccl.cuh), which ships with CUDA's devel
# images (Debian: libnccl-dev). Without it there is no GPU trainer, and make says so.
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
NCCL_H    := $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h)
ifneq ($(NVCC),)
ifeq ($(NCCL_H),)
$(warning NCCL not found (no nccl.h in $(CUDA_HOME)/include or /usr/include): not building train_gpt; install libnccl-dev)
endif
endif
# CI has nvcc: it compiles every CUDA file, so the GPU code cannot rot on machines without a GPU.
GPU_TARGETS := $(if $(NVCC),$(if $(NCCL_H),train_gpt train_gpt_fp16 train_gpt_fp32 comm_bench_gpu))
# ... and the kernel lab: every program in dev/cuda/, into build/dev/ (for sm_90 alone without a GPU)
DEV_TARGETS := $(if $(NVCC),dev)

# The tokenizer's Unicode class table is generated from Debian's unicode-data package
# (data/gen_unicode_classes.cpp); every host header may include it, so it is built first.
UNICODE_DATA ?= /usr/share/unicode
UNICODE_TABLES := build/unicode_classes.h
HOST_HEADERS := $(wildcard llmc/*.h llmc/*/*.h) $(UNICODE_TABLES)

# Both trainers run on several ranks over MPI (mpirun -np N) when MPI is installed; without it the
# CPU trainer is a single-rank program, and the GPU trainer still runs many ranks under srun (NCCL
# finds its peers through LLMC_RENDEZVOUS, see llmc/parallel/rendezvous.h). `make USE_MPI=0` forces the MPI-less
# build. nvcc compiles the GPU trainer's host code with mpicxx, which adds MPI's headers and libraries.
MPICXX  ?= $(shell command -v mpicxx 2>/dev/null)
USE_MPI ?= $(if $(MPICXX),1,0)
ifeq ($(USE_MPI),1)
CPU_TRAINER_CXX   := $(MPICXX)
CPU_TRAINER_FLAGS := -DUSE_MPI
GPU_TRAINER_FLAGS := -ccbin $(MPICXX) -DUSE_MPI
else
CPU_TRAINER_CXX   := $(CXX)
CPU_TRAINER_FLAGS :=
GPU_TRAINER_FLAGS :=
endif

CPU_TESTS := $(patsubst test/%.cpp,build/%,$(wildcard test/test_*.cpp))
# tests written in CUDA (built when nvcc is present; each prints SKIP for what needs a GPU it lacks)
CUDA_TESTS := $(if $(NVCC),$(patsubst test/%.cu,build/%,$(wildcard test/test_*.cu)))

# The GPU code compiled for a CPU emulation of CUDA (test/emu/), so its tests run without a GPU.
include test/emu/emu.mk

.PHONY: all test clean gpu-check dev
all: train_gpt_cpu prepare_data tokenize_text hf_convert comm_bench matmul_bench $(CPU_TESTS) $(GPU_TARGETS) $(CUDA_TESTS) $(DEV_TARGETS) $(EMU_TARGETS)

train_gpt_cpu: train_gpt_cpu.cpp $(HOST_HEADERS)
	$(CPU_TRAINER_CXX) $(CXXFLAGS) $(CPU_TRAINER_FLAGS) $< -o $@ $(LDLIBS)

# the GPU trainer (bf16), the same code in fp32 for debugging against the CPU reference, and in fp16
train_gpt: train_gpt.cu $(HOST_HEADERS) $(GPU_HEADERS)
	$(NVCC) $(NVCCFLAGS) $(GPU_TRAINER_FLAGS) $< -o $@ $(GPU_LDLIBS) -lnccl

train_gpt_fp32: train_gpt.cu $(HOST_HEADERS) $(GPU_HEADERS)
	$(NVCC) $(NVCCFLAGS) $(GPU_TRAINER_FLAGS) -DLLMC_FP32 $< -o $@ $(GPU_LDLIBS) -lnccl

# fp16 with dynamic loss scaling (Micikevicius et al. 2018; llmc/optim/loss_scaler.h)
train_gpt_fp16: train_gpt.cu $(HOST_HEADERS) $(GPU_HEADERS)
	$(NVCC) $(NVCCFLAGS) $(GPU_TRAINER_FLAGS) -DLLMC_FP16 $< -o $@ $(GPU_LDLIBS) -lnccl

# The communication benchmark (dev/comm/comm_bench.h): every collective timed and checked, over MPI
# on the host (comm.h, as the CPU trainer) and over NCCL on GPUs (comm_nccl.cuh, as the GPU trainer).
comm_bench: dev/comm/comm_bench.cpp dev/comm/comm_bench.h $(HOST_HEADERS)
	$(CPU_TRAINER_CXX) $(CXXFLAGS) $(CPU_TRAINER_FLAGS) $< -o $@ $(LDLIBS)

# The CPU matmul on every d12 shape as a share of the FMA peak, in CPU seconds (dev/cpu/matmul_bench.cpp).
matmul_bench: dev/cpu/matmul_bench.cpp llmc/model/cpu_matmul.h llmc/model/cpu_matmul_blocking.h
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDLIBS)

comm_bench_gpu: dev/comm/comm_bench.cu dev/comm/comm_bench.h $(HOST_HEADERS) $(GPU_HEADERS)
	$(NVCC) $(NVCCFLAGS) $(GPU_TRAINER_FLAGS) $< -o $@ -lnccl

# the communication layer's own check on GPUs (not a test_*: it needs mpirun; gpu-check runs it)
build/gpu_comm_check: test/gpu_comm_check.cu $(HOST_HEADERS) $(GPU_HEADERS)
	@mkdir -p build
	$(NVCC) $(NVCCFLAGS) $(GPU_TRAINER_FLAGS) $< -o $@ -lnccl

# fp8's quantizer and cuBLASLt's fp8 matmuls on a GPU (test/test_fp8.py runs it; the emulated twin is build/emu/fp8_check)
build/fp8_check: test/fp8_check.cu $(HOST_HEADERS) $(GPU_HEADERS)
	@mkdir -p build
	$(NVCC) $(NVCCFLAGS) $(GPU_TRAINER_FLAGS) $< -o $@ -lcublasLt -lcublas

dev: $(UNICODE_TABLES)
	$(MAKE) -C dev/cuda NVCC="$(NVCC)"

# on a GPU machine: build for the local GPU, run every GPU test and a short training run
gpu-check:
	bash scripts/gpu_check.sh

prepare_data: data/prepare_data.cpp $(HOST_HEADERS)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDLIBS)

tokenize_text: data/tokenize_text.cpp $(HOST_HEADERS)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDLIBS)

# GPT-2 weights between Hugging Face's layout (model.safetensors + config.json) and our model file
hf_convert: hf_convert.cpp $(HOST_HEADERS)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDLIBS)

$(UNICODE_TABLES): data/gen_unicode_classes.cpp
	@mkdir -p build
	@test -f $(UNICODE_DATA)/UnicodeData.txt || { echo "error: $(UNICODE_DATA)/UnicodeData.txt is missing; the tokenizer's Unicode tables are built from it: apt-get install unicode-data" >&2; exit 1; }
	$(CXX) -O2 -std=c++17 $< -o build/gen_unicode_classes
	build/gen_unicode_classes $(UNICODE_DATA)/UnicodeData.txt $(UNICODE_DATA)/DerivedAge.txt > $@.tmp
	mv $@.tmp $@

# (tests may include train_gpt_cpu.cpp to use its kernels as the reference)
build/test_%: test/test_%.cpp test/checks.h $(HOST_HEADERS) train_gpt_cpu.cpp
	@mkdir -p build
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDLIBS)

build/test_%: test/test_%.cu $(HOST_HEADERS) $(GPU_HEADERS)
	@mkdir -p build
	$(NVCC) $(NVCCFLAGS) $< -o $@ $(GPU_LDLIBS)

# Sanitizer and fuzzing builds, in build/sanitize/ (not build/test_*: they are not tests by themselves).
# test/test_sanitizers.sh builds and runs them; `all` does not, so a plain build stays lean.
SANITIZE := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
build/sanitize/train_gpt_cpu: train_gpt_cpu.cpp $(HOST_HEADERS)
	@mkdir -p build/sanitize
	$(CXX) $(SANITIZE) -std=c++17 -fopenmp -I. $< -o $@ $(LDLIBS)

build/sanitize/test_formats: test/test_formats.cpp $(HOST_HEADERS) train_gpt_cpu.cpp
	@mkdir -p build/sanitize
	$(CXX) $(SANITIZE) -std=c++17 -fopenmp -I. $< -o $@ $(LDLIBS)

# libFuzzer needs clang; FUZZ_PLANTED_BUG builds the negative control
build/sanitize/fuzz_readers: test/fuzz_readers.cpp $(HOST_HEADERS)
	@mkdir -p build/sanitize
	clang++ $(SANITIZE) -fsanitize=fuzzer -std=c++17 -I. $< -o $@

build/sanitize/fuzz_readers_planted: test/fuzz_readers.cpp $(HOST_HEADERS)
	@mkdir -p build/sanitize
	clang++ $(SANITIZE) -fsanitize=fuzzer -DFUZZ_PLANTED_BUG -std=c++17 -I. $< -o $@

test: all
	/usr/bin/python3 test/run_tests.py

clean:
	rm -rf build train_gpt_cpu train_gpt train_gpt_fp16 train_gpt_fp32 prepare_data tokenize_text hf_convert comm_bench comm_bench_gpu matmul_bench
