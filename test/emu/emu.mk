# emu.mk — the emulated GPU builds, included by the top-level Makefile (see test/emu/README.md).
#
# Every .cu/.cuh/.h the GPU code includes is rewritten by cu2cpp.py into build/emu/src/ (same
# relative paths, `#line` back to the originals), compiled by g++ with the emulator's header forced
# in, and linked with its runtime and the library stand-ins instead of CUDA's libraries. It needs
# CUDA's headers (for the types and the libraries' declarations) and MPI (the NCCL stand-in), but
# no GPU, no driver and no nvcc. `make emu` builds it all; `make` does too where the headers are.
EMU_DIR      := build/emu
EMU_SRC      := $(EMU_DIR)/src
EMU_CUDA_INC := $(firstword $(wildcard /usr/local/cuda/include/cuda_runtime.h) $(wildcard $(CUDA_HOME)/include/cuda_runtime.h))
EMU_CUDA_INC := $(patsubst %/cuda_runtime.h,%,$(EMU_CUDA_INC))
EMU_CXX      := $(MPICXX)
# -O1: a third of -O2's build time, and the run time goes to the scheduling, not to the kernels' code.
EMU_FLAGS    := -std=c++17 -O1 -g0 -fno-strict-aliasing -Wno-attributes -I$(EMU_SRC) -I. -I$(EMU_CUDA_INC)
EMU_KERNEL   := -x c++ -include test/emu/cuda_emu.h -DUSE_MPI
EMU_SOURCES  := train_gpt.cu test/gpu_comm_check.cu test/fp8_check.cu test/emu/capture_check.cu test/emu/nccl_capture_check.cu dev/comm/comm_bench.cu dev/comm/comm_bench.h $(wildcard llmc/*/*.cuh llmc/*.h llmc/*/*.h dev/cuda/*.cu dev/cuda/*.h)
EMU_STAMP    := $(EMU_SRC)/.rewritten
EMU_LIBS     := $(EMU_DIR)/cuda_emu_runtime.o $(EMU_DIR)/cublas_standin.o $(EMU_DIR)/cudnn_standin.o \
                $(EMU_DIR)/nccl_standin.o
EMU_PROGRAMS := $(EMU_DIR)/train_gpt $(EMU_DIR)/train_gpt_fp32 $(EMU_DIR)/train_gpt_fp16 $(EMU_DIR)/gpu_comm_check $(EMU_DIR)/comm_bench_gpu \
                $(EMU_DIR)/capture_check $(EMU_DIR)/nccl_capture_check $(EMU_DIR)/fp8_check
# The kernel lab (dev/cuda/*.cu) in build/emu/dev/, each program with the CPU trainer's layers
# (llmc/model/cpu_layers.h) as its reference and no MPI, as on a GPU.
EMU_DEV_PROGRAMS := $(patsubst dev/cuda/%.cu,$(EMU_DIR)/dev/%,$(wildcard dev/cuda/*.cu))
EMU_DEV_LIBS := $(EMU_DIR)/cuda_emu_runtime.o $(EMU_DIR)/cublas_standin.o \
                $(EMU_DIR)/cudnn_standin.o
# Emulated builds need CUDA's headers and MPI; without either, the emulated tests say why and skip.
EMU_TARGETS  := $(if $(and $(EMU_CUDA_INC),$(MPICXX)),$(EMU_PROGRAMS) $(EMU_DEV_PROGRAMS))

.PHONY: emu
emu: $(EMU_PROGRAMS) $(EMU_DEV_PROGRAMS)

$(EMU_STAMP): $(EMU_SOURCES) test/emu/cu2cpp.py $(UNICODE_TABLES)
	@mkdir -p $(EMU_SRC)
	python3 test/emu/cu2cpp.py . $(EMU_SRC) $(EMU_SOURCES)
	@touch $@

$(EMU_DIR)/%.o: test/emu/%.cpp test/emu/cuda_emu.h test/emu/stream_capture.h
	@mkdir -p $(EMU_DIR)
	$(EMU_CXX) -std=c++17 -O2 -ffp-contract=off -I. -I$(EMU_CUDA_INC) -c $< -o $@

$(EMU_DIR)/train_gpt: $(EMU_STAMP) $(EMU_LIBS)
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_KERNEL) $(EMU_SRC)/train_gpt.cu -x none $(EMU_LIBS) -o $@

$(EMU_DIR)/train_gpt_fp32: $(EMU_STAMP) $(EMU_LIBS)
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_KERNEL) -DLLMC_FP32 $(EMU_SRC)/train_gpt.cu -x none $(EMU_LIBS) -o $@

$(EMU_DIR)/train_gpt_fp16: $(EMU_STAMP) $(EMU_LIBS)
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_KERNEL) -DLLMC_FP16 $(EMU_SRC)/train_gpt.cu -x none $(EMU_LIBS) -o $@

$(EMU_DIR)/gpu_comm_check: $(EMU_STAMP) $(EMU_LIBS)
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_KERNEL) $(EMU_SRC)/test/gpu_comm_check.cu -x none $(EMU_LIBS) -o $@

# the emulation's own stream capture and graph replay (test/test_cuda_graphs.py runs it)
$(EMU_DIR)/capture_check: $(EMU_STAMP) $(EMU_LIBS)
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_KERNEL) $(EMU_SRC)/test/emu/capture_check.cu -x none $(EMU_LIBS) -o $@

# NCCL operations captured into a CUDA graph and replayed (test/test_emu_nccl_graphs.py runs it)
$(EMU_DIR)/nccl_capture_check: $(EMU_STAMP) $(EMU_LIBS)
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_KERNEL) $(EMU_SRC)/test/emu/nccl_capture_check.cu -x none $(EMU_LIBS) -o $@

# fp8's quantizer, delayed scaling and the stand-in's fp8 matmuls (test/test_fp8.py runs it)
$(EMU_DIR)/fp8_check: $(EMU_STAMP) $(EMU_LIBS)
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_KERNEL) $(EMU_SRC)/test/fp8_check.cu -x none $(EMU_LIBS) -o $@

# the communication benchmark's GPU build (dev/comm/comm_bench.cu): correctness only, as emulated
$(EMU_DIR)/comm_bench_gpu: $(EMU_STAMP) $(EMU_LIBS)
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_KERNEL) $(EMU_SRC)/dev/comm/comm_bench.cu -x none $(EMU_LIBS) -o $@

EMU_DEV_LINK = $(EMU_CXX) $(EMU_FLAGS) -x c++ -include test/emu/cuda_emu.h $(1) -x none $(EMU_DEV_LIBS) -fopenmp -o $(2)
$(EMU_DIR)/dev/%: $(EMU_STAMP) $(EMU_DEV_LIBS)
	@mkdir -p $(@D)
	$(call EMU_DEV_LINK,$(EMU_SRC)/dev/cuda/$*.cu,$@)

# A mutated copy of a lab program, built as the real one is (test/test_emu_kernel_lab.py plants a
# bug and expects the lab's own check to catch it):
#   make emu-lab-variant VARIANT_ROOT=DIR VARIANT=dev/cuda/NAME.cu VARIANT_OUT=PROGRAM  (DIR/dev/cuda/NAME.cu)
.PHONY: emu-lab-variant
emu-lab-variant: $(EMU_STAMP) $(EMU_DEV_LIBS)
	python3 test/emu/cu2cpp.py $(VARIANT_ROOT) $(VARIANT_ROOT)/emu $(VARIANT)
	$(call EMU_DEV_LINK,$(VARIANT_ROOT)/emu/$(VARIANT),$(VARIANT_OUT))
