"""docs/ARCHITECTURE.md's source layout table names the source files that are there, and every
one that is; and the Python package has no import cycle.

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
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Source layout", 1)[1].split("\n## ", 1)[0]
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
        assert folder in folders, "ARCHITECTURE.md's layout table has no row for %s" % folder
    for path, names in rows.items():
        if path.startswith("csrc/") and not path.endswith("/"):
            assert os.path.isfile(os.path.join(ROOT, path)), "ARCHITECTURE.md names %s, not in the tree" % path
    for folder, names in folders.items():
        present = sorted(f for f in os.listdir(os.path.join(ROOT, folder))
                         if os.path.isfile(os.path.join(ROOT, folder, f)))
        for name in names:
            assert fnmatch.filter(present, name), "ARCHITECTURE.md names %s%s, not in the tree" % (folder, name)
        unnamed = [f for f in present if not any(fnmatch.fnmatch(f, n) for n in names)]
        assert not unnamed, "ARCHITECTURE.md's layout table does not name %s" % [folder + f for f in unnamed]


def _package_imports():
    """{module: modules of fbn_grad_tf it imports}, every import statement counted (also the
    ones inside functions), read from the sources."""
    import ast
    root = os.path.join(ROOT, "python")
    modules = {}
    for folder, _, files in os.walk(os.path.join(root, "fbn_grad_tf")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                mod = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                modules[mod[:-len(".__init__")] if mod.endswith(".__init__") else mod] = path
    graph = {}
    for mod, path in modules.items():
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        deps = set()
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = base + "." + node.module if node.module else base
                for a in node.names:
                    sub = base + "." + a.name
                    # `from . import x`: x is a module (or an extension such as _core)
                    deps.add(sub if sub in modules or node.module is None else base)
        graph[mod] = {d for d in deps if d in modules and d != mod}
    return graph


def find_cycle(graph):
    """An import cycle of `graph` ({module: imported modules}) as a path, or None."""
    state = {}

    def visit(mod, path):
        state[mod] = "open"
        for dep in sorted(graph[mod]):
            if state.get(dep) == "open":
                return path + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[mod] = "done"
        return None

    for mod in sorted(graph):
        if mod not in state:
            found = visit(mod, [mod])
            if found:
                return found
    return None


def test_no_import_cycle_in_the_package():
    graph = _package_imports()
    assert graph["fbn_grad_tf.keras"] >= {"fbn_grad_tf._convert", "fbn_grad_tf._keras_layer"}
    assert "fbn_grad_tf._keras_layer" in graph["fbn_grad_tf._convert"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
