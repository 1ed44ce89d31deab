// The CPU kernels (backward and forward) compiled for the avx512bf16 path: the avx512 path
// plus AVX512-BF16, whose VCVTNEPS2BF16 replaces the integer float->bfloat16 rounding
// (flags set per file by setup.py and BUILD).
#define FBN_ISA_NS avx512bf16
#include "kernels.inc"
