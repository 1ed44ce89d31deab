// The CPU kernels compiled for the baseline path (flags set per file by setup.py and BUILD).
#define FBN_ISA_NS baseline
#include "bn_grad_cpu_kernels.inc"
