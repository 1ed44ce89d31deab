"""Facts of the build this package was installed from.

setup.py compiles them into the core module (``_core.build_info``), so they travel with the
binaries they describe into every kind of install (wheel, sdist, editable) and cannot go
stale beside them. Importing this module fails with ImportError when the package is not
built.
"""
import json

from . import _core

_facts = json.loads(_core.build_info)

TF_VERSION = _facts["TF_VERSION"]  # TensorFlow the op library was compiled against, or None
WITH_CUDA = _facts["WITH_CUDA"]    # CUDA kernels compiled in
CUDA_MODE = _facts["CUDA_MODE"]    # FBN_GRAD_TF_CUDA at build time: auto, 1 or 0
CUDA_ARCHS = _facts["CUDA_ARCHS"]  # GPU code compiled for
WITH_ASAN = _facts["WITH_ASAN"]    # AddressSanitizer build
BUILD = _facts["BUILD"]            # all, core or core-cuda (FBN_GRAD_TF_BUILD)
SANITIZE = _facts.get("SANITIZE", ["address"] if WITH_ASAN else [])  # sanitizers compiled in


def as_dict():
    return dict(_facts)
