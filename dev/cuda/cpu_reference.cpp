// cpu_reference.cpp — compiles the CPU trainer's functions into namespace cpu (declared in
// cpu_reference.h), once for all the lab's programs: the reference is the trainer's code itself,
// not a copy of it.
//
// How: every header train_gpt_cpu.cpp includes is included first, at global scope; its own
// #includes inside the namespace then find their include guards set and add nothing, so only its
// definitions land in namespace cpu, and they still see the llmc/ types and helpers at global scope.
#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/cli.h"
#include "llmc/comm.h"
#include "llmc/dataloader.h"
#include "llmc/formats.h"
#include "llmc/model.h"
#include "llmc/sampler.h"
#include "llmc/sharding.h"
#include "llmc/training.h"
#include "llmc/utils.h"
#include "dev/cuda/cpu_reference.h"

#define LLMC_CPU_NO_MAIN
namespace cpu {
#include "train_gpt_cpu.cpp"
}  // namespace cpu
