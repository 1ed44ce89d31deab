"""Build of fbn_grad_tf: the TensorFlow op library and the framework-free pybind11 core.

Environment variables:
  FBN_GRAD_TF_BUILD  all (default): TF op library + pybind11 core module;
                     core: only the pybind11 core module (no TensorFlow needed, e.g. on a
                     GPU machine without TF); core-cuda: same, CUDA forced on.
  FBN_GRAD_TF_CUDA   auto (default: CUDA when nvcc is found), 1 (require), 0 (CPU only).
  FBN_GRAD_TF_SANITIZE  comma-separated sanitizers, of address and undefined (e.g.
                     address,undefined: AddressSanitizer + UndefinedBehaviorSanitizer, halting
                     on the first report; see docs/HARDENING.md, "Sanitizers").
  FBN_GRAD_TF_ASAN   1: build with AddressSanitizer (the same as adding address to
                     FBN_GRAD_TF_SANITIZE; kept for existing scripts).
  CUDA_HOME          CUDA toolkit root (default /usr/local/cuda).

The CPU kernels are compiled three times (baseline x86-64, AVX2, AVX-512) and picked at
run time; nothing is tuned to the build machine's own CPU.

Build facts (TF version, CUDA, ...) are compiled into the core module (`_core.build_info`),
so they reach every kind of install (wheel, sdist, editable) with the binaries they describe.

Objects are cached in build/fbn-obj/<configuration hash>/ and an object is recompiled only
when its source or a header under csrc/ is newer: a no-change rebuild only links, and nvcc
does not run again for an unchanged .cu file. TensorFlow and pybind11 are needed only by
build_ext, not by sdist.
"""
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CORE_SOURCES = [
    "csrc/core/common.cc",
    "csrc/core/backward.cc",
    "csrc/core/forward.cc",
    "csrc/core/cpu/kernels_baseline.cc",
    "csrc/core/cpu/kernels_avx2.cc",
    "csrc/core/cpu/kernels_avx512.cc",
    "csrc/core/cpu/kernels_avx512bf16.cc",
]
CUDA_SOURCES = ["csrc/core/cuda/common.cu", "csrc/core/cuda/backward.cu",
                "csrc/core/cuda/forward.cu"]
CORE_MODULE_SOURCE = "csrc/py/core_module.cc"
TF_OP_SOURCES = ["csrc/tf/fbn_grad_op.cc", "csrc/tf/fbn_forward_op.cc"]
# Every header-like file under csrc/ is a rebuild trigger of every object (coarse, safe).
HEADER_PATTERNS = ("*.h", "*.inc", "*.cuh")
# Same arch list in BUILD. nvcc 13 has no sm_70; PTX of sm_90 for newer GPUs.
CUDA_GENCODE = [
    "-gencode=arch=compute_75,code=sm_75",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]
CUDA_ARCHS = ["sm_75", "sm_80", "sm_90", "compute_90"]
# Per-file instruction-set flags; everything else is portable x86-64.
ISA_FLAGS = {
    "_avx2.cc": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.cc": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
                   "-mf16c", "-mprefer-vector-width=512"],
}
ISA_FLAGS["_avx512bf16.cc"] = ISA_FLAGS["_avx512.cc"] + ["-mavx512bf16"]
# -ffp-contract=off: no FMA contraction, so every ISA path rounds identically.
COMMON_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fvisibility=hidden",
                "-Wall", "-Wno-sign-compare", "-Wno-deprecated-declarations"]

BUILD = os.environ.get("FBN_GRAD_TF_BUILD", "all")
if BUILD not in ("all", "core", "core-cuda"):
    sys.exit("FBN_GRAD_TF_BUILD must be all, core or core-cuda, got %r" % BUILD)
SANITIZERS = sorted({n.strip() for n in os.environ.get("FBN_GRAD_TF_SANITIZE", "").split(",")
                     if n.strip()} | ({"address"} if os.environ.get("FBN_GRAD_TF_ASAN", "0") == "1"
                                      else set()))
if not set(SANITIZERS) <= {"address", "undefined"}:
    sys.exit("FBN_GRAD_TF_SANITIZE must list address and/or undefined, got %r"
             % os.environ.get("FBN_GRAD_TF_SANITIZE"))
ASAN = "address" in SANITIZERS
CUDA_MODE = "1" if BUILD == "core-cuda" else os.environ.get("FBN_GRAD_TF_CUDA", "auto")
if CUDA_MODE not in ("0", "1", "auto"):
    sys.exit("FBN_GRAD_TF_CUDA must be auto, 0 or 1, got %r" % CUDA_MODE)
# -O1 (after COMMON_FLAGS' -O3): readable reports at a tolerable speed.
# -fno-sanitize-recover=all: UBSan stops the process at its first report (as ASan does).
# -fno-wrapv: Python's own CFLAGS (which setuptools passes to every extension) hold -fwrapv,
# under which signed overflow is defined and UBSan does not check it at all; the sanitizer
# build checks standard C++ instead (an int index that overflows is reported).
SAN_FLAGS = (["-fsanitize=" + ",".join(SANITIZERS), "-fno-omit-frame-pointer", "-O1"]
             + (["-fno-sanitize-recover=all", "-fno-wrapv"] if "undefined" in SANITIZERS
                else [])
             if SANITIZERS else [])


def find_nvcc():
    if CUDA_MODE == "0":
        return None
    cand = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    nvcc = cand if os.path.exists(cand) else shutil.which("nvcc")
    if CUDA_MODE == "1" and nvcc is None:
        sys.exit("FBN_GRAD_TF_CUDA=1 but nvcc was not found (set CUDA_HOME)")
    return nvcc


def tf_flags():
    try:
        import tensorflow as tf
    except ImportError:
        sys.exit("Building the TensorFlow op needs TensorFlow in the build environment: "
                 "pip install tensorflow-cpu==2.21.0, then pip install --no-build-isolation . "
                 "(or FBN_GRAD_TF_BUILD=core for the TF-free core only)")
    return tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def headers():
    found = []
    for pattern in HEADER_PATTERNS:
        found += glob.glob(os.path.join(ROOT, "csrc", "**", pattern), recursive=True)
    return sorted(found)


class BuildExt(build_ext):
    """Configures the extensions (TF, CUDA, pybind11 flags), caches objects per
    configuration, applies per-file ISA flags and compiles .cu files with nvcc."""

    def run(self):
        self.parallel = None  # one compile at a time per extension; cache dirs are per ext
        self.rebuild_all = self.force  # --force: recompile every object
        self.cuda_compiled = set()  # shared CUDA objects compiled in this run
        self._configure()
        super().run()

    def _configure(self):
        nvcc = find_nvcc()
        tf_version, tf_cflags, tf_lflags = tf_flags() if BUILD == "all" else (None, [], [])
        self.nvcc = nvcc
        info = {"TF_VERSION": tf_version, "WITH_CUDA": bool(nvcc), "CUDA_MODE": CUDA_MODE,
                "CUDA_ARCHS": CUDA_ARCHS if nvcc else [], "WITH_ASAN": ASAN, "BUILD": BUILD,
                "SANITIZE": SANITIZERS}
        cuda_home = os.path.dirname(os.path.dirname(nvcc)) if nvcc else None
        # Static cudart: the library loads on machines without a CUDA runtime
        # (tensorflow-cpu) and only touches the driver when a GPU kernel actually runs.
        cuda_link = (["-L" + os.path.join(cuda_home, "lib64"), "-l:libcudart_static.a", "-ldl",
                      "-lrt", "-lpthread"] if nvcc else [])
        cuda_inc = [os.path.join(cuda_home, "include")] if nvcc else []
        cuda_defs = [("FBN_WITH_CUDA", "1")] if nvcc else []
        import pybind11
        for ext in self.extensions:
            ext.sources += CUDA_SOURCES if nvcc else []
            ext.include_dirs += [os.path.join(ROOT, "csrc")] + cuda_inc
            ext.define_macros += cuda_defs
            ext.extra_compile_args = COMMON_FLAGS + SAN_FLAGS
            ext.extra_link_args = cuda_link + SAN_FLAGS
            if ext.name.endswith("_core"):
                ext.include_dirs.append(pybind11.get_include())
                # A C string literal of the JSON facts; json.dumps escapes nothing a C
                # string needs beyond the quotes and backslashes handled here.
                literal = json.dumps(json.dumps(info, sort_keys=True))
                ext.define_macros.append(("FBN_BUILD_INFO_JSON", literal))
            else:
                ext.extra_compile_args = COMMON_FLAGS + tf_cflags + SAN_FLAGS
                ext.extra_link_args = tf_lflags + cuda_link + SAN_FLAGS
        config = json.dumps([info, nvcc, CUDA_GENCODE, COMMON_FLAGS, ISA_FLAGS, tf_cflags,
                             tf_lflags, sys.version], sort_keys=True)
        digest = hashlib.sha256(config.encode()).hexdigest()[:16]
        self.object_cache = os.path.join(ROOT, "build", "fbn-obj", digest)
        self.header_mtime = max([os.path.getmtime(h) for h in headers()] + [0.0])
        print("[fbn build] %s; objects cached in %s"
              % (json.dumps(info, sort_keys=True), os.path.relpath(self.object_cache, ROOT)),
              flush=True)

    def build_extension(self, ext):
        base_temp = self.build_temp
        self.build_temp = os.path.join(self.object_cache, ext.name)
        try:
            self._build_extension(ext)
        finally:
            self.build_temp = base_temp

    def _up_to_date(self, obj, src):
        if self.rebuild_all or not os.path.exists(obj):
            return False
        return os.path.getmtime(obj) >= max(os.path.getmtime(src), self.header_mtime)

    def _build_extension(self, ext):
        compiler = self.compiler
        if ".cu" not in compiler.src_extensions:
            compiler.src_extensions.append(".cu")
        original_compile = compiler._compile

        def compile_one(obj, src, ext_, cc_args, extra_postargs, pp_opts):
            if self._up_to_date(obj, src):
                return
            if src.endswith(".cu"):
                # nvcc's command does not depend on the extension, so both extensions link
                # the same object: compiled once into the configuration's shared cuda/ folder
                # (the slowest step of the build: each .cu is ~4 GPU architectures).
                shared = os.path.join(self.object_cache, "cuda",
                                      os.path.relpath(src, ROOT) + ".o")
                if shared not in self.cuda_compiled and not self._up_to_date(shared, src):
                    os.makedirs(os.path.dirname(shared), exist_ok=True)
                    cmd = [self.nvcc, "-c", src, "-o", shared, "-std=c++17", "-O3",
                           "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
                           "-I" + os.path.join(ROOT, "csrc")] + CUDA_GENCODE
                    print(" ".join(cmd), flush=True)
                    subprocess.check_call(cmd)
                    self.cuda_compiled.add(shared)
                shutil.copy2(shared, obj)
                return
            flags = list(extra_postargs)
            for suffix, isa in ISA_FLAGS.items():
                if src.endswith(suffix):
                    flags += isa
            original_compile(obj, src, ext_, cc_args, flags, pp_opts)

        compiler._compile = compile_one
        try:
            # The extension itself is always relinked (cheap): build_ext's own whole-extension
            # timestamp check sees neither header nor configuration changes.
            self.force = True
            super().build_extension(ext)
        finally:
            self.force = self.rebuild_all
            compiler._compile = original_compile


extensions = [Extension("fbn_grad_tf._core", sources=[CORE_MODULE_SOURCE] + CORE_SOURCES,
                        language="c++")]
if BUILD == "all":
    extensions.append(Extension("fbn_grad_tf._fbn_grad_ops",
                                sources=TF_OP_SOURCES + CORE_SOURCES, language="c++"))

setup(
    ext_modules=extensions,
    cmdclass={"build_ext": BuildExt},
    package_dir={"": "python"},
    packages=["fbn_grad_tf", "fbn_grad_tf.bench"],
)
