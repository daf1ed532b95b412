# Builds everything: the CPU reference trainer, the GPU trainer (when nvcc is present),
# the data tools and the tests. `make test` runs every test and prints 'N passed, N failed'.
#
#   make            build all
#   make test       build and run the tests (see test/run_tests.py)
#   make run        the main job: prepare the default corpus and train a small GPT on it
#   make gpu-check  on a GPU machine: build for the local GPU and run every GPU check
#
# CPU code is built with -march=native: the binaries are meant for the machine that builds them.

CXX      ?= g++
CXXFLAGS ?= -O3 -march=native -std=c++17 -Wall -Wextra -Wno-unused-parameter -fopenmp
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

# The tokenizer's Unicode class table is generated from Debian's unicode-data package
# (data/gen_unicode_classes.cpp); every host header may include it, so it is built first.
UNICODE_DATA ?= /usr/share/unicode
UNICODE_TABLES := build/unicode_classes.h
HOST_HEADERS := $(wildcard llmc/*.h) $(UNICODE_TABLES)

CPU_TESTS := $(patsubst test/%.cpp,build/%,$(wildcard test/test_*.cpp))

.PHONY: all test clean
all: train_gpt_cpu prepare_data tokenize_text $(CPU_TESTS)

train_gpt_cpu: train_gpt_cpu.cpp $(HOST_HEADERS)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDLIBS)

prepare_data: data/prepare_data.cpp data/token_shard_io.h $(HOST_HEADERS)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDLIBS)

tokenize_text: data/tokenize_text.cpp $(HOST_HEADERS)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDLIBS)

$(UNICODE_TABLES): data/gen_unicode_classes.cpp
	@mkdir -p build
	@test -f $(UNICODE_DATA)/UnicodeData.txt || { echo "error: $(UNICODE_DATA)/UnicodeData.txt is missing; the tokenizer's Unicode tables are built from it: apt-get install unicode-data" >&2; exit 1; }
	$(CXX) -O2 -std=c++17 $< -o build/gen_unicode_classes
	build/gen_unicode_classes $(UNICODE_DATA)/UnicodeData.txt $(UNICODE_DATA)/DerivedAge.txt > $@.tmp
	mv $@.tmp $@

build/test_%: test/test_%.cpp $(HOST_HEADERS)
	@mkdir -p build
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDLIBS)

test: all
	/usr/bin/python3 test/run_tests.py

clean:
	rm -rf build train_gpt_cpu train_gpt prepare_data tokenize_text
