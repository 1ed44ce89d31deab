// The CPU kernels (backward and forward) compiled for the avx512 path (flags set per file by setup.py and BUILD).
#define FBN_ISA_NS avx512
#include "kernels.inc"
