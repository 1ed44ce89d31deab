// The CPU kernels (backward and forward) compiled for the avx2 path (flags set per file by setup.py and BUILD).
#define FBN_ISA_NS avx2
#include "kernels.inc"
