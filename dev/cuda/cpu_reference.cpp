// cpu_reference.cpp — the CPU trainer's functions (declared in cpu_reference.h), compiled once for
// all the lab's programs: the reference is the trainer's code itself, not a copy of it.
#define LLMC_CPU_NO_MAIN
#include "train_gpt_cpu.cpp"
