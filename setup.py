"""Build of fbn_grad_tf: the TensorFlow op library and the framework-free pybind11 core.

Environment variables:
  FBN_GRAD_TF_BUILD  all (default): TF op library + pybind11 core module;
                     core: only the pybind11 core module (no TensorFlow needed, e.g. on a
                     GPU machine without TF); core-cuda: same, CUDA forced on.
  FBN_GRAD_TF_CUDA   auto (default: CUDA when nvcc is found), 1 (require), 0 (CPU only).
  FBN_GRAD_TF_ASAN   1: build with AddressSanitizer (see README, "Hardening").
  CUDA_HOME          CUDA toolkit root (default /usr/local/cuda).

The CPU kernels are compiled three times (baseline x86-64, AVX2, AVX-512) and picked at
run time; nothing is tuned to the build machine's own CPU.
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CORE_SOURCES = [
    "csrc/core/bn_grad_common.cc",
    "csrc/core/cpu/bn_grad_cpu_baseline.cc",
    "csrc/core/cpu/bn_grad_cpu_avx2.cc",
    "csrc/core/cpu/bn_grad_cpu_avx512.cc",
]
CUDA_SOURCES = ["csrc/core/bn_grad_cuda.cu"]
# Rebuild triggers beyond the sources themselves.
DEPENDS = ["csrc/core/bn_grad.h", "csrc/core/bn_grad_cuda.h",
           "csrc/core/cpu/bn_grad_cpu_kernels.inc", "csrc/core/cpu/bn_grad_cpu_kernels.h"]
# Same arch list in BUILD. nvcc 13 has no sm_70; PTX of sm_90 for newer GPUs.
CUDA_GENCODE = [
    "-gencode=arch=compute_75,code=sm_75",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]
# Per-file instruction-set flags; everything else is portable x86-64.
ISA_FLAGS = {
    "_avx2.cc": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.cc": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
                   "-mf16c", "-mprefer-vector-width=512"],
}
# -ffp-contract=off: no FMA contraction, so every ISA path rounds identically.
COMMON_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fvisibility=hidden",
                "-Wall", "-Wno-sign-compare", "-Wno-deprecated-declarations"]

BUILD = os.environ.get("FBN_GRAD_TF_BUILD", "all")
if BUILD not in ("all", "core", "core-cuda"):
    sys.exit("FBN_GRAD_TF_BUILD must be all, core or core-cuda, got %r" % BUILD)
ASAN = os.environ.get("FBN_GRAD_TF_ASAN", "0") == "1"


def find_nvcc():
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = os.path.join(cuda_home, "bin", "nvcc")
    if os.path.exists(cand):
        return cand
    return shutil.which("nvcc")


def want_cuda():
    mode = "1" if BUILD == "core-cuda" else os.environ.get("FBN_GRAD_TF_CUDA", "auto")
    nvcc = find_nvcc()
    if mode == "0":
        return None
    if mode == "1" and nvcc is None:
        sys.exit("FBN_GRAD_TF_CUDA=1 but nvcc was not found (set CUDA_HOME)")
    if mode not in ("0", "1", "auto"):
        sys.exit("FBN_GRAD_TF_CUDA must be auto, 0 or 1, got %r" % mode)
    return nvcc


def tf_flags():
    try:
        import tensorflow as tf
    except ImportError:
        sys.exit("Building the TensorFlow op needs TensorFlow in the build environment: "
                 "pip install tensorflow-cpu==2.21.0, then pip install --no-build-isolation . "
                 "(or FBN_GRAD_TF_BUILD=core for the TF-free core only)")
    return tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


NVCC = want_cuda()
CUDA_HOME = os.path.dirname(os.path.dirname(NVCC)) if NVCC else None
TF_VERSION = None
TF_CFLAGS, TF_LFLAGS = [], []
if BUILD == "all":
    TF_VERSION, TF_CFLAGS, TF_LFLAGS = tf_flags()

SAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer", "-O1"] if ASAN else []
cuda_defs = [("FBN_WITH_CUDA", "1")] if NVCC else []
# Static cudart: the library loads on machines without a CUDA runtime (tensorflow-cpu) and
# only touches the driver when a GPU kernel actually runs.
cuda_link = (["-L" + os.path.join(CUDA_HOME, "lib64"), "-l:libcudart_static.a", "-ldl", "-lrt",
              "-lpthread"] if NVCC else [])
cuda_inc = [os.path.join(CUDA_HOME, "include")] if NVCC else []


def pybind_include():
    import pybind11
    return pybind11.get_include()


class BuildExt(build_ext):
    """Per-file ISA flags for the CPU kernels, nvcc for .cu files."""

    def build_extension(self, ext):
        # Both extensions compile the core sources (with different flags): give each its own
        # object directory, and build extensions one at a time (see run()).
        base_temp = self.build_temp
        self.build_temp = os.path.join(base_temp, ext.name)
        try:
            self._build_extension(ext)
        finally:
            self.build_temp = base_temp

    def _build_extension(self, ext):
        compiler = self.compiler
        if ".cu" not in compiler.src_extensions:
            compiler.src_extensions.append(".cu")
        original_compile = compiler._compile

        def compile_one(obj, src, ext_, cc_args, extra_postargs, pp_opts):
            if src.endswith(".cu"):
                cmd = [NVCC, "-c", src, "-o", obj, "-std=c++17", "-O3",
                       "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
                       "-I" + os.path.join(ROOT, "csrc")] + CUDA_GENCODE
                print(" ".join(cmd), flush=True)
                subprocess.check_call(cmd)
                return
            flags = list(extra_postargs)
            for suffix, isa in ISA_FLAGS.items():
                if src.endswith(suffix):
                    flags += isa
            original_compile(obj, src, ext_, cc_args, flags, pp_opts)

        compiler._compile = compile_one
        try:
            super().build_extension(ext)
        finally:
            compiler._compile = original_compile

    def run(self):
        self.parallel = None  # per-extension build_temp is not thread-safe
        # setuptools only compares timestamps: force a full rebuild when the configuration
        # (CUDA on/off, ASan, TF version) differs from the one the objects were built with.
        config = repr((BUILD, NVCC, ASAN, TF_VERSION, CUDA_GENCODE))
        stamp = os.path.join(self.build_temp, "fbn_build_config.txt")
        if not os.path.exists(stamp) or open(stamp).read() != config:
            self.force = True
        write_build_info()
        super().run()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(config)


def write_build_info():
    path = os.path.join(ROOT, "python", "fbn_grad_tf", "_build_info.py")
    with open(path, "w") as f:
        f.write("# Written by setup.py at build time.\n")
        f.write("TF_VERSION = %r\n" % TF_VERSION)
        f.write("WITH_CUDA = %r\n" % bool(NVCC))
        f.write("CUDA_MODE = %r\n" % os.environ.get("FBN_GRAD_TF_CUDA", "auto"))
        f.write("CUDA_ARCHS = %r\n" % (["sm_75", "sm_80", "sm_90", "compute_90"] if NVCC else []))
        f.write("WITH_ASAN = %r\n" % ASAN)
        f.write("BUILD = %r\n" % BUILD)


core_sources = CORE_SOURCES + (CUDA_SOURCES if NVCC else [])
extensions = [
    Extension(
        "fbn_grad_tf._core",
        sources=["csrc/py/core_module.cc"] + core_sources,
        include_dirs=[pybind_include(), os.path.join(ROOT, "csrc")] + cuda_inc,
        depends=DEPENDS,
        define_macros=cuda_defs,
        extra_compile_args=COMMON_FLAGS + SAN_FLAGS,
        extra_link_args=cuda_link + SAN_FLAGS,
        language="c++",
    )
]
if BUILD == "all":
    extensions.append(
        Extension(
            "fbn_grad_tf._fbn_grad_ops",
            sources=["csrc/tf/fbn_grad_op.cc"] + core_sources,
            include_dirs=[os.path.join(ROOT, "csrc")] + cuda_inc,
            depends=DEPENDS,
            define_macros=cuda_defs,
            extra_compile_args=COMMON_FLAGS + TF_CFLAGS + SAN_FLAGS,
            extra_link_args=TF_LFLAGS + cuda_link + SAN_FLAGS,
            language="c++",
        )
    )

setup(
    ext_modules=extensions,
    cmdclass={"build_ext": BuildExt},
    package_dir={"": "python"},
    packages=["fbn_grad_tf"],
)
