// Bazel (TF source tree) compiles GPU sources named *.cu.cc; setup.py uses the .cu directly.
#include "forward.cu"
