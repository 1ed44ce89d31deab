// The CPU kernels (backward and forward) compiled for the baseline path (flags set per file by setup.py and BUILD).
#define FBN_ISA_NS baseline
#include "kernels.inc"
