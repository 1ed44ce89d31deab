// The CPU kernels compiled for the avx2 path (flags set per file by setup.py and BUILD).
#define FBN_ISA_NS avx2
#include "bn_grad_cpu_kernels.inc"
