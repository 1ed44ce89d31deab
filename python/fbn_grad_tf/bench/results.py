"""Stored runs: where a run's JSON is kept in the repository (docs/results/<machine kind
slug>/<name>.json, written by --store) and reading them back for the report command
(results_report.py). A later run of the same name on the same kind of machine replaces the
file: the stored runs are the current results, their history is git's."""
import json
import os

#: Where --store writes, relative to the current directory (the repository root).
RESULTS_DIR = os.path.join("docs", "results")


def result_name(args):
    """The stored name of a run of the command line `args`: 'ops' (the default grid),
    'quick', 'layer', 'layer-quick', 'models-<policy>'."""
    if getattr(args, "model", None):
        return "models-%s" % (args.policy or "float32")
    name = "layer" if getattr(args, "layer", False) else "ops"
    if getattr(args, "quick", False):
        name = "quick" if name == "ops" else name + "-quick"
    return name


def stored_path(meta, name, results_dir=RESULTS_DIR):
    """docs/results/<meta's machine slug>/<name>.json."""
    return os.path.join(results_dir, meta["machine_slug"], name + ".json")


def write_results(args, data):
    """Writes `data` (with its "meta") to --json FILE and, with --store, to its stored path;
    returns the paths written. Sets meta's "command" (the command line as typed) and
    "result_name" first."""
    meta = data["meta"]
    meta["command"] = getattr(args, "command_line", None)
    meta["result_name"] = result_name(args)
    paths = []
    if getattr(args, "json", None):
        paths.append(args.json)
    if getattr(args, "store", None):
        paths.append(stored_path(meta, meta["result_name"], args.store))
    for path in paths:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    return paths


def load_runs(paths=(RESULTS_DIR,)):
    """The stored runs under `paths` (JSON files, or directories searched recursively for
    *.json), each a dict with its "meta" and its "path", sorted by path; JSON files that are
    not bench output (no "meta", no results) are left out. ValueError for a path that does
    not exist or a file that is not JSON."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            for dirpath, _, names in os.walk(p):
                files += [os.path.join(dirpath, n) for n in names if n.endswith(".json")]
        elif os.path.exists(p):
            files.append(p)
        else:
            raise ValueError("%s: no such file or directory" % p)
    runs = []
    for path in sorted(files):
        with open(path) as f:
            try:
                data = json.load(f)
            except ValueError as e:
                raise ValueError("%s is not JSON (%s)" % (path, e)) from None
        if (isinstance(data, dict) and isinstance(data.get("meta"), dict)
                and any(k in data for k in ("results", "models", "summary"))):
            data["path"] = path
            runs.append(data)
    return runs
