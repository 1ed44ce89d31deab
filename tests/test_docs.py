"""The documentation is checked like code: its examples run, its links resolve, and the
project's files carry no issue numbers or work-log wording.

Code blocks (README.md and docs/*.md)
    Every ```python fence runs in a fresh ``python`` subprocess (this interpreter, so the
    installed fbn_grad_tf), with a temporary directory as working directory. A block stands
    alone unless a marker line, the last non-blank line before its fence, says otherwise:

    ``<!-- docs-test: skip (REASON) -->``
        the block is not run; REASON (in parentheses, required) says why, e.g. "needs a
        GPU", "needs two workers", "trains for minutes". Keep these few.
    ``<!-- docs-test: continue -->``
        the block runs after the previous run block of the same file, in the same
        subprocess (a chain: one script made of the blocks in order), so it may use the
        names that block defined.

    Fences of other languages (bash, text, none) are not run. Chains run two at a time.

Links (README.md, CHANGELOG.md, docs/*.md)
    Every relative link or image (``[text](path)``, ``[text](path#anchor)``,
    ``[text](#anchor)``, ``[label]: path``) must name a file or folder that exists, and an
    anchor must be one of the target Markdown file's headings, slugged as GitHub does
    (lowercase; characters other than letters, digits, spaces, ``-`` and ``_`` dropped;
    spaces to ``-``; a repeated heading gets ``-1``, ``-2``, ...) or an explicit
    ``<a id="...">`` / ``<a name="...">``. Links inside code are not links.

Wording (every tracked text file)
    The docs say what is true now; history lives in git and CHANGELOG.md. So no file
    refers to the project's issue tracker by number ("issue N", "issues N and M", "#N"; an
    upstream reference written as ``owner/repo#N`` or as a URL is fine), and none carries
    work-log wording: "session" as in a work session (TF's ``tf.compat.v1.Session`` and
    lines that use it are fine), "stop N", "not shipped yet", "What moved", and Markdown
    headings dated like a diary (a date in a heading; CHANGELOG.md's release headings are
    exempt). ``WORDING_RULES`` below holds the exact patterns.

The self-tests at the end plant a broken link, a failing block and an issue number in
temporary files and check that each is caught.
"""
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_TIMEOUT_S = 300
PARALLEL = 2


def _md_files(*names):
    files = [os.path.join(ROOT, n) for n in names]
    docs = os.path.join(ROOT, "docs")
    if os.path.isdir(docs):
        files += [os.path.join(docs, f) for f in sorted(os.listdir(docs)) if f.endswith(".md")]
    return [f for f in files if os.path.isfile(f)]


def _rel(path):
    return os.path.relpath(path, ROOT)


# ---- Markdown scanning ------------------------------------------------------------------------

_FENCE_RE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")
_MARKER_RE = re.compile(r"^\s*<!--\s*docs-test:\s*(\w+)\s*(?:\((.*)\))?\s*-->\s*$")


def scan_markdown(text):
    """Splits Markdown into prose lines and fenced blocks.

    Returns (prose, blocks): prose is a list of (line number, line) outside fences; blocks is a
    list of dicts with keys lang, start (line number of the opening fence, 1-based), code
    (dedented by the fence's indentation) and marker ((kind, reason) from the marker line
    before the fence, or None).
    """
    lines = text.splitlines()
    prose, blocks = [], []
    i = 0
    while i < len(lines):
        m = _FENCE_RE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                break
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        marker = None
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0:
            mm = _MARKER_RE.match(lines[j])
            if mm:
                marker = (mm.group(1), (mm.group(2) or "").strip())
        blocks.append({"lang": lang, "start": start + 1, "code": "\n".join(body) + "\n",
                       "marker": marker})
    return prose, blocks


def code_chains(path):
    """The runnable python blocks of one Markdown file, grouped into chains.

    Returns (chains, problems): chains is a list of (first line, code) with code the blocks of
    the chain joined in order; problems lists marker misuse (unknown kind, skip without a
    reason, continue with nothing before it) as strings.
    """
    with open(path, encoding="utf-8") as f:
        _, blocks = scan_markdown(f.read())
    chains, problems = [], []
    where = _rel(path)
    for b in blocks:
        kind, reason = b["marker"] if b["marker"] else (None, "")
        if kind not in (None, "skip", "continue"):
            problems.append("%s:%d: unknown marker docs-test: %s" % (where, b["start"], kind))
            continue
        if b["lang"] not in ("python", "py", "python3"):
            if kind is not None:
                problems.append("%s:%d: docs-test marker on a %r block (only python blocks run)"
                                % (where, b["start"], b["lang"] or "plain"))
            continue
        if kind == "skip":
            if not reason:
                problems.append("%s:%d: docs-test: skip needs a reason in parentheses"
                                % (where, b["start"]))
            continue
        header = "# --- %s:%d ---\n" % (where, b["start"])
        if kind == "continue":
            if not chains:
                problems.append("%s:%d: docs-test: continue with no run block before it"
                                % (where, b["start"]))
                continue
            first, code = chains[-1]
            chains[-1] = (first, code + header + b["code"])
        else:
            chains.append((b["start"], header + b["code"]))
    return chains, problems


def run_code(code, timeout=BLOCK_TIMEOUT_S):
    """Runs `code` in a fresh interpreter in a temporary directory: (returncode, output)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    with tempfile.TemporaryDirectory(prefix="fbn_docs_") as tmp:
        script = os.path.join(tmp, "block.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        try:
            p = subprocess.run([sys.executable, script], cwd=tmp, env=env, timeout=timeout,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            if isinstance(out, bytes):
                out = out.decode(errors="replace")
            return -1, out + "\n[timed out after %d s]" % timeout
    return p.returncode, p.stdout


# ---- links ------------------------------------------------------------------------------------

_INLINE_CODE_RE = re.compile(r"(`+)(.+?)\1")
_LINK_RE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF_RE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_LINK_RE = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"", re.I)
_ANCHOR_TAG_RE = re.compile(r"<a\s[^>]*?(?:id|name)=\"([^\"]+)\"", re.I)
_HEADING_RE = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def github_slug(heading):
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # links: their text
    text = re.sub(r"<[^>]+>", "", text)                          # HTML tags
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)                         # \w: letters, digits, _
    return text.replace(" ", "-")


def anchors(text):
    """The set of anchors of a Markdown text: its headings' slugs, de-duplicated as GitHub
    does, plus explicit <a id/name> anchors."""
    prose, _ = scan_markdown(text)
    seen = {}
    found = set()
    for _, line in prose:
        m = _HEADING_RE.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else "%s-%d" % (slug, n))
        for a in _ANCHOR_TAG_RE.findall(line):
            found.add(a)
    return found


def links(text):
    """(line number, target) of every link outside code in a Markdown text."""
    prose, _ = scan_markdown(text)
    out = []
    for n, line in prose:
        bare = _INLINE_CODE_RE.sub("", line)
        for m in _LINK_RE.finditer(bare):
            out.append((n, m.group(1)))
        m = _REF_DEF_RE.match(bare)
        if m:
            out.append((n, m.group(1)))
        for target in _HTML_LINK_RE.findall(bare):
            out.append((n, target))
    return out


def broken_links(path, root=ROOT):
    """Problems with the relative links of one Markdown file, as strings."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    problems = []
    anchor_cache = {}
    for n, target in links(text):
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        if file_part.startswith("/"):
            dest = os.path.join(root, file_part.lstrip("/"))
        elif file_part:
            dest = os.path.join(os.path.dirname(path), file_part)
        else:
            dest = path
        dest = os.path.normpath(dest)
        where = "%s:%d: %s" % (os.path.relpath(path, root), n, target)
        if not os.path.exists(dest):
            problems.append("%s: no such file" % where)
            continue
        if anchor:
            if not dest.endswith(".md") or not os.path.isfile(dest):
                problems.append("%s: anchor on a file that is not Markdown" % where)
                continue
            if dest not in anchor_cache:
                with open(dest, encoding="utf-8") as f:
                    anchor_cache[dest] = anchors(f.read())
            if anchor not in anchor_cache[dest]:
                problems.append("%s: no heading with that anchor in %s"
                                % (where, os.path.relpath(dest, root)))
    return problems


# ---- wording ----------------------------------------------------------------------------------

def _everywhere(path):
    return True


def _docs_but_changelog(path):
    return path.endswith(".md") and os.path.basename(path) != "CHANGELOG.md"


#: Lines that use TensorFlow's Session API (tf.compat.v1.Session, `sess`) speak of TF's
#: sessions, not of work sessions.
TF_SESSION_LINE = re.compile(r"Session\b|\bsess\b")

#: (name, pattern, files it applies to, lines exempt from it): a match is a finding.
WORDING_RULES = [
    ("issue number",  # 'issue 19', 'issues 19 and 20'; not 'issues 8-byte loads'
     re.compile(r"\b(?:issues?|tickets?|PRs?|pull requests?)\s+#?\d+(?![\w-])", re.I),
     _everywhere, None),
    ("issue number",  # '#19'; not 'owner/repo#19', '&#19;', '"#123456"', '(#0-heading)',
                      # nor TF's error messages' 'input #1'
     re.compile(r"(?<![\w/&#'\"])(?<!input )(?<!output )(?<!argument )#\d{1,5}\b(?![\w-])"),
     _everywhere, None),
    ("work-log wording",  # 'this session', 'the fourth session's runs'; not identifiers
     re.compile(r"(?<![\w.])sessions?(?![\w(])"),
     _everywhere, TF_SESSION_LINE),
    ("work-log wording",
     re.compile(r"\b(?:stop|session|day)\s+#?\d+|\b(?:this|that|last|next|previous|each|every)"
                r"\s+stop\b", re.I),
     _everywhere, None),
    ("work-log wording",
     re.compile(r"\bnot (?:yet )?shipped(?: yet)?\b|\bwhat moved\b|\bwork[- ]?log\b", re.I),
     _everywhere, None),
    ("dated heading",  # a diary entry's heading; release headings in CHANGELOG.md are fine
     re.compile(r"^\s{0,3}#{1,6}\s.*\b(?:19|20)\d\d-\d\d-\d\d\b"),
     _docs_but_changelog, None),
]

_TEXT_SUFFIXES = (".md", ".py", ".sh", ".cc", ".h", ".cu", ".cuh", ".inc", ".txt", ".toml",
                  ".cfg", ".in", ".ini", ".yml", ".yaml")
_TEXT_NAMES = ("BUILD", "run", "Makefile", ".gitignore")
#: Stored results (data, not prose) are not checked, nor this file (it spells the rules out).
_SKIPPED_DIRS = ("docs/results/",)
_SKIPPED_FILES = ("tests/test_docs.py",)


def tracked_text_files(root=ROOT):
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    names = [n for n in out.decode().split("\0") if n]
    return [n for n in names
            if (n.endswith(_TEXT_SUFFIXES) or os.path.basename(n) in _TEXT_NAMES)
            and not n.startswith(_SKIPPED_DIRS) and n not in _SKIPPED_FILES
            and os.path.isfile(os.path.join(root, n))]


def wording_findings(path, shown_as=None):
    """Work-log and issue-number wording in one file, as 'file:line: rule: text' strings."""
    shown_as = shown_as or path
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError:
        return []
    findings = []
    rules = [(name, pat, exempt) for name, pat, applies, exempt in WORDING_RULES
             if applies(shown_as)]
    for n, line in enumerate(lines, 1):
        for name, pat, exempt in rules:
            m = pat.search(line)
            if not m or (exempt is not None and exempt.search(line)):
                continue
            findings.append("%s:%d: %s: %r" % (shown_as, n, name, m.group(0)))
    return findings


# ---- the tests --------------------------------------------------------------------------------

def _doc_chains():
    chains, problems = {}, []
    for path in _md_files("README.md"):
        found, probs = code_chains(path)
        problems += probs
        for first, code in found:
            chains["%s:%d" % (_rel(path), first)] = code
    return chains, problems


#: "file:line of the chain's first block" -> the chain's code.
_CHAINS, _MARKER_PROBLEMS = _doc_chains()


@pytest.fixture(scope="module")
def chain_results():
    """Starts every chain at once (PARALLEL at a time); each test waits for its own."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL)
    futures = {where: pool.submit(run_code, code) for where, code in _CHAINS.items()}
    yield futures
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("where", list(_CHAINS))
def test_doc_code_block_runs(where, chain_results):
    rc, out = chain_results[where].result()
    assert rc == 0, "the example at %s failed (exit %d):\n%s\n--- output (tail) ---\n%s" % (
        where, rc, _CHAINS[where], out[-4000:])


def test_doc_markers_are_well_formed():
    assert not _MARKER_PROBLEMS, "\n".join(_MARKER_PROBLEMS)


def test_readme_has_runnable_examples():
    assert any(where.startswith("README.md:") for where in _CHAINS), "README.md runs no example"


def test_relative_links_resolve():
    problems = []
    for path in _md_files("README.md", "CHANGELOG.md"):
        problems += broken_links(path)
    assert not problems, "\n".join(problems)


def test_no_issue_numbers_or_work_log_wording():
    findings = []
    for name in tracked_text_files():
        findings += wording_findings(os.path.join(ROOT, name), shown_as=name)
    assert not findings, "\n".join(findings)


# ---- self-tests: the checkers catch what they are for -----------------------------------------

def _write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(textwrap.dedent(text))


def test_selftest_broken_link_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    _write(tmp_path / "docs" / "B.md", """\
        # Title
        ## Same
        ## Same
        ## XLA (`jit_compile=True`)
        """)
    _write(tmp_path / "A.md", """\
        # A heading, with punctuation!
        [ok](docs/B.md) [ok](docs/B.md#same-1) [ok](docs/B.md#xla-jit_compiletrue)
        [ok](#a-heading-with-punctuation) [ok](https://example.com/x.md) `[code](nowhere.md)`
        [bad](docs/Missing.md) [bad](docs/B.md#same-2) [bad](#nope)
        ```python
        x = "[not a link](missing.md)"
        ```
        """)
    problems = broken_links(str(tmp_path / "A.md"), root=str(tmp_path))
    assert len(problems) == 3, problems
    assert "docs/Missing.md: no such file" in problems[0]
    assert "docs/B.md#same-2" in problems[1] and "#nope" in problems[2]


def test_selftest_failing_block_is_caught(tmp_path):
    _write(tmp_path / "A.md", """\
        ```python
        value = 41
        ```

        <!-- docs-test: continue -->
        ```python
        assert value + 1 == 42
        ```

        <!-- docs-test: skip (needs a GPU) -->
        ```python
        raise SystemExit("a skipped block must not run")
        ```

        ```python
        assert value == 41, "a block without a marker starts afresh"
        ```

        ```bash
        exit 1
        ```
        """)
    chains, problems = code_chains(str(tmp_path / "A.md"))
    assert not problems
    assert [first for first, _ in chains] == [1, 15]
    results = [run_code(code, timeout=60) for _, code in chains]
    assert results[0][0] == 0, results[0][1]
    assert results[1][0] != 0 and "NameError" in results[1][1], results[1][1]

    _write(tmp_path / "B.md", """\
        <!-- docs-test: skip -->
        ```python
        pass
        ```
        """)
    _, problems = code_chains(str(tmp_path / "B.md"))
    assert problems and "needs a reason" in problems[0]


def test_selftest_issue_number_and_work_log_are_caught(tmp_path):
    bad = ["As " + "issue 19 asks, ...", "(" + "issues 19 and 20)", "see " + "#19 for why",
           "the fourth " + "session's runs", "this " + "stop's figures", "Stop " + "36:",
           "not " + "shipped yet", "What " + "moved in the last run",
           "Session " + "6: the pool", "## Runs (2026-12-04, " + "evening)"]
    good = ["with tf.compat.v1.Session(graph=g) as sess:", "a tf.compat.v1 Graph + Session",
            "upstream tensorflow/tensorflow#58999",
            "[bug](https://github.com/tensorflow/tensorflow/issues/58999)",
            "report bugs on the GitHub issues page", 'color="#123456"',
            "raw_graph_session mode", "UBSan stops the process", "tf.summary.session_log",
            "a 5-day run"]
    _write(tmp_path / "notes.md", "\n".join(bad + good) + "\n")
    findings = wording_findings(str(tmp_path / "notes.md"), shown_as="docs/notes.md")
    flagged = sorted({int(f.split(":")[1]) for f in findings})
    assert flagged == list(range(1, len(bad) + 1)), findings
    # A release's dated heading is fine in CHANGELOG.md.
    _write(tmp_path / "CHANGELOG.md", "## 0.2.0 (2026-12-04)\n")
    assert not wording_findings(str(tmp_path / "CHANGELOG.md"), shown_as="CHANGELOG.md")
