"""README's layout table names the source files that are there, and every one that is.

Each row of the table whose path is a folder under csrc/ lists that folder's files in
backticks; `*.cu.cc` stands for the Bazel wrappers of the .cu files. A file added, moved or
renamed without the table following fails here, and so does a name left in the table after
its file has gone.
"""
import fnmatch
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layout_rows():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = re.findall(r"`([^`]+)`", m.group(2))
    return rows


def source_names(names):
    """The backticked words that name files (a dot and no spaces): not `CudaErrorString`."""
    return [n for n in names if "." in n and " " not in n and not n.startswith("fbn_grad_tf.")]


def test_layout_table_matches_csrc():
    rows = layout_rows()
    folders = {p: source_names(n) for p, n in rows.items() if p.startswith("csrc/") and p.endswith("/")}
    for folder in ("csrc/core/", "csrc/core/cpu/", "csrc/core/cuda/", "csrc/tf/"):
        assert folder in folders, "README's layout table has no row for %s" % folder
    for path, names in rows.items():
        if path.startswith("csrc/") and not path.endswith("/"):
            assert os.path.isfile(os.path.join(ROOT, path)), "README names %s, not in the tree" % path
    for folder, names in folders.items():
        present = sorted(f for f in os.listdir(os.path.join(ROOT, folder))
                         if os.path.isfile(os.path.join(ROOT, folder, f)))
        for name in names:
            assert fnmatch.filter(present, name), "README names %s%s, not in the tree" % (folder, name)
        unnamed = [f for f in present if not any(fnmatch.fnmatch(f, n) for n in names)]
        assert not unnamed, "README's layout table does not name %s" % [folder + f for f in unnamed]
