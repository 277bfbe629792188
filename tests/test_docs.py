"""Every example in docs/ and the README marked runnable is run, and its printed output checked.

Markup (docs/README.md explains it to writers):

    <!-- runnable -->
    ```console
    $ lowmem plan --depth 20 --batch 8 --no-schedule --rows 3
    ...expected output...
    ```

or a ```python block followed by an ```output block with what it prints. In expected
output a line that is only `...` (any indentation) matches any number of lines, so long
listings can be elided; trailing spaces are ignored. Commands run from the repository root
with this interpreter's bin directory first on PATH (`lowmem`, `python`).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)\s*$")


def examples(path):
    """[(line number, kind, code, expected output)] of the runnable blocks of one page."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].rstrip() == "<!-- runnable -->":      # at the margin (indented: an example of it)
            kind, body, i = _block(lines, i + 1)
            start = i
            if kind == "console":
                cmds = [ln[2:] for ln in body if ln.startswith("$ ")]
                out = [ln for ln in body if not ln.startswith("$ ")]
                found.append((start, "console", cmds, out))
            elif kind == "python":
                out = []
                if i < len(lines) and FENCE.match(lines[i]) and FENCE.match(lines[i]).group(1) == "output":
                    _, out, i = _block(lines, i)
                found.append((start, "python", body, out))
            else:
                raise AssertionError(f"{path.name}:{start}: a runnable block must be console or python")
        else:
            i += 1
    return found


def _block(lines, i):
    while i < len(lines) and not lines[i].strip():
        i += 1
    m = FENCE.match(lines[i]) if i < len(lines) else None
    assert m, f"line {i + 1}: '<!-- runnable -->' must be followed by a fenced block"
    j = i + 1
    while not lines[j].startswith("```"):
        j += 1
    return m.group(1), lines[i + 1:j], j + 1


def matches(expected, got):
    """Does `got` (list of lines) match `expected`, where a '...' line matches any lines?"""
    exp = [e.rstrip() for e in expected]
    got = [g.rstrip() for g in got]
    while got and not got[-1]:
        got.pop()
    while exp and not exp[-1]:
        exp.pop()

    def walk(a, b):
        if a == len(exp):
            return b == len(got)
        if exp[a].strip() == "...":
            return any(walk(a + 1, k) for k in range(b, len(got) + 1))
        return b < len(got) and exp[a] == got[b] and walk(a + 1, b + 1)
    return walk(0, 0)


CASES = [pytest.param(page, ex, id=f"{page.name}:{ex[0]}") for page in PAGES for ex in examples(page)]


@pytest.mark.parametrize("page,example", CASES)
def test_runnable_example(page, example):
    line, kind, code, expected = example
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
               OPENBLAS_NUM_THREADS="1", COLUMNS="200",
               LOWMEM_THREADS="2")     # printed plans state per-thread bounds: the same on every machine
    if kind == "console":
        got = []
        for cmd in code:
            r = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
            assert r.returncode == 0, f"{page.name}:{line}: `{cmd}` exited {r.returncode}:\n{r.stderr[-2000:]}"
            got += r.stdout.splitlines()
    else:
        r = subprocess.run([sys.executable, "-c", "\n".join(code)], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=300)
        assert r.returncode == 0, f"{page.name}:{line}: exited {r.returncode}:\n{r.stderr[-2000:]}"
        got = r.stdout.splitlines()
    assert matches(expected, got), (f"{page.name}:{line}: output changed; now:\n" + "\n".join(got))


LABEL = re.compile(r"^<!-- printed: .+, commit [0-9a-f]{7,40}\b.*-->$")


def unchecked_outputs(path):
    """[(line, kind)] of console/text blocks that are neither runnable nor labelled with the
    command and commit that printed them (docs/README.md, "Examples that are checked")."""
    lines, bad, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        before = lines[j].strip() if j >= 0 else ""
        if m.group(1) in ("console", "text") and before != "<!-- runnable -->" and not LABEL.match(before):
            bad.append((i + 1, m.group(1)))
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        i += 1
    return bad


def test_every_printed_output_is_runnable_or_labelled():
    bad = [f"{p.relative_to(ROOT)}:{line} ({kind})" for p in PAGES for line, kind in unchecked_outputs(p)]
    assert not bad, "printed output neither runnable nor labelled <!-- printed: CMD, commit SHA -->: " + ", ".join(bad)


def test_no_references_to_the_development_process():
    """The project speaks of itself, not of how its work was organised: no tracker item in a page, a
    Python file or a recorded result (the words are spelt apart below, so this file passes its own check)."""
    words = re.compile(r"\b(is{2}ue|this (?:r)ound|this (?:s)ession)\b", re.IGNORECASE)
    results = sorted(p for p in (ROOT / "benchmarks" / "results").rglob("*")
                     if p.is_file() and p.suffix in (".json", ".txt", ".md", ".log", ".tsv"))
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in text_files() + results
           for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if words.search(line)]
    assert not bad, "development-process references: " + ", ".join(bad)


def test_the_matcher():
    assert matches(["a", "...", "d"], ["a", "b", "c", "d"]) and matches(["a", "  ...", "b"], ["a", "b"])
    assert not matches(["a", "d"], ["a", "b", "d"]) and not matches(["a"], ["b"])


# ---- the code the docs name exists (lowmem/... paths and dotted names: tests/test_docs_numbers.py)

FOLDERS = "system|ops|data|units|core|bits|train|tools"
IN_FOLDER = re.compile(rf"(?<![\w./-])(?:{FOLDERS})/[\w/]*\w\.py\b")        # units/fused.py, ops/winograd.py


def test_every_module_path_named_inside_a_folder_exists():
    """A page that names a module by its folder (`units/fused.py`) names one lowmem has."""
    mentions = [(page, n, m.group(0)) for page in PAGES for n, line in enumerate(page.read_text().splitlines(), 1)
                for m in IN_FOLDER.finditer(line)]
    assert len(mentions) >= 10                                                   # the check sees them
    missing = [f"{p.relative_to(ROOT)}:{n}: {m}" for p, n, m in mentions if not (ROOT / "lowmem" / m).exists()]
    assert not missing, "the docs name modules that do not exist: " + ", ".join(missing)
    assert IN_FOLDER.findall("(`units/fused.py` over x/ops/y.py, lowmem/ops/conv.py)") == ["units/fused.py"]


def readme_layout():
    """{folder: module file names (and sub-folders, "commands/")} as README.md's Layout section
    lists them: a line `lowmem/<folder>/` opens a folder, its indented lines name its modules."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    listed, folder = {}, None
    for line in block.splitlines():
        if line.startswith("lowmem/"):
            head = line.split()[0]
            folder = head if head.endswith("/") else None
            if folder:
                listed[folder] = set()
            else:
                listed.setdefault("lowmem/", set()).add(head[len("lowmem/"):])
        elif folder and line.startswith("  "):                  # its modules, named anywhere on the line
            listed[folder] |= set(re.findall(r"(?<![\w/.])\w+\.py\b|(?<![\w/.])\w+/(?=\s)", line))
    return listed


def test_the_readme_layout_lists_every_module():
    listed = readme_layout()
    for folder, names in listed.items():
        where = ROOT / folder
        actual = {p.name for p in where.glob("*.py") if p.name != "__init__.py" or folder == "lowmem/"}
        actual |= {p.name + "/" for p in where.iterdir() if p.is_dir() and (p / "__init__.py").exists()
                   and folder != "lowmem/"}
        assert names == actual, (folder, sorted(names ^ actual))
    assert set(listed) == {"lowmem/"} | {f"lowmem/{p.name}/" for p in (ROOT / "lowmem").iterdir()
                                        if (p / "__init__.py").exists()}


# ---- every path a doc, a docstring or a comment names exists -------------------------------------

NAMED = re.compile(r"(?<![\w./:-])((?:lowmem|tests|benchmarks|docs|demos)/[\w./-]*\w)")
OUTPUT_OPTION = re.compile(r"--[\w-]+[ =]$")           # `--json benchmarks/results/x.json`: what a run writes


def text_files():
    """The pages and every Python file of the project (its docstrings and comments name paths too)."""
    return PAGES + sorted(p for where in ("lowmem", "tests", "benchmarks", "docs", "demos")
                          for p in (ROOT / where).rglob("*.py") if "__pycache__" not in p.parts)


def _braces(pattern):
    """`a{1,2}b*` -> ["a1b*", "a2b*"]."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _braces(pattern[:m.start()] + alt + pattern[m.end():])]


def named_path_exists(path, after):
    """Whether `path` (as written, followed by the text `after`) names something in the tree: a
    file or folder, or a glob (`results/memory_depth*.txt`, `run{1,2}.json`) that matches one."""
    if re.match(r"\.?[*{]", after):
        pattern = path + re.match(r"(?:[\w.*/-]|\{[\w,]*\})*", after).group(0)
        return any(next(ROOT.glob(p), None) is not None for p in _braces(pattern))
    return (ROOT / path).exists()


def missing_paths(text):
    """[(line, path)] of the paths `text` names that do not exist (placeholders such as
    tests/<folder>/ and the outputs of example command lines are no names)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in NAMED.finditer(line):
            before, after = line[:m.start()], line[m.end():]
            if after.startswith("<") or OUTPUT_OPTION.search(before):
                continue
            if not named_path_exists(m.group(1), after):
                out.append((n, m.group(1)))
    return out


def test_every_path_a_doc_or_docstring_names_exists():
    """lowmem/..., tests/..., benchmarks/..., docs/... and demos/... as the pages, docstrings and
    comments name them: a file moved or renamed leaves no stale name behind."""
    files = text_files()
    assert len(files) > 100
    bad = [f"{p.relative_to(ROOT)}:{n}: {path}" for p in files for n, path in missing_paths(p.read_text())]
    assert not bad, "paths named that do not exist: " + ", ".join(bad)


def test_the_path_finder():
    text = ("see {0}/units/window.py and {1}/<folder>/test_<module>.py, {2}/results/memory_depth*.txt,\n"
            "`{2}/results/step_alternated_r164_run{{1,2}}.json`, {2}/results/first_release_resnet164_b128.*,\n"
            "--json {2}/results/new.json, {0}/units/quant.py, https://github.com/x/y/blob/main/{3}/gone.md, {3}/gone.md")
    text = text.format("lowmem", "tests", "benchmarks", "docs")        # spelt apart: this file is scanned too
    assert missing_paths(text) == [(3, "{}/units/quant.py".format("lowmem")), (3, "{}/gone.md".format("docs"))]
