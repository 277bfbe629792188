"""Figures quoted on more than one page agree with the one table that holds them (docs/numbers.tsv),
and every dotted `lowmem.` name the docs give resolves (the paths they name: tests/test_docs.py)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TABLE = ROOT / "docs" / "numbers.tsv"


def rows():
    """[(name, value, compiled pattern)] of docs/numbers.tsv."""
    out = []
    for n, line in enumerate(TABLE.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.split("\t")
        assert len(cells) == 3, f"numbers.tsv:{n}: expected NAME<tab>VALUE<tab>PATTERN"
        out.append((cells[0], cells[1], re.compile(cells[2])))
    return out


def flat(path):
    """A page's text as one line: line breaks and runs of spaces are one space, bold marks gone."""
    return " ".join(path.read_text().replace("**", "").split())


def same(a, b):
    return a.replace("−", "-") == b.replace("−", "-")


def quotes(pattern, text):
    """The numbers `pattern` captures in `text` (for each match, its first group that matched)."""
    return [next(g for g in m.groups() if g is not None) for m in pattern.finditer(text)]


def test_the_table_is_well_formed():
    names = [name for name, _, _ in rows()]
    assert len(names) == len(set(names)), "a figure is named twice in numbers.tsv"
    assert all(p.groups >= 1 for _, _, p in rows())


def test_every_quoted_figure_agrees_with_the_table():
    texts = {p.relative_to(ROOT): flat(p) for p in PAGES}
    bad, unused = [], []
    for name, value, pattern in rows():
        found = [(page, got) for page, text in texts.items() for got in quotes(pattern, text)]
        if not found:
            unused.append(name)
        bad += [f"{page}: {name} is {got}, numbers.tsv says {value}" for page, got in found if not same(got, value)]
    assert not bad, "\n".join(bad)
    assert not unused, "numbers.tsv rows no page quotes (pattern or page changed?): " + ", ".join(unused)


def test_the_overviews_headline_is_in_the_table():
    """Every decimal figure of overview.md's "Three numbers" lies inside a match of a numbers.tsv
    row, so when a study is rerun and results.md's headline (and its row) changes, the overview
    fails the test above until it says the same."""
    text = flat(ROOT / "docs" / "overview.md")
    head = text[text.index("# Three numbers"):text.index("# Exercises")]
    spans = [m.span() for _, _, p in rows() for m in p.finditer(head)]
    figures = [m for m in re.finditer(r"\d+\.\d+", head)]
    assert len(figures) >= 15                        # the section holds the headline
    loose = [m.group() for m in figures if not any(a <= m.start() and m.end() <= b for a, b in spans)]
    assert not loose, "overview.md's headline figures no numbers.tsv row covers: " + ", ".join(loose)


def test_the_matcher():
    p = re.compile(r"(\d+\.\d+)x for A|B is (\d+\.\d+)")
    assert quotes(p, "2.5x for A, and B is 3.0") == ["2.5", "3.0"]
    assert same("−0.23", "-0.23") and not same("0.23", "-0.23")


DOTTED = re.compile(r"\blowmem(?:\.[A-Za-z_]\w*)+")


def _resolves(name):
    """Does `lowmem.a.b.c` name a module, or an attribute reached from the longest importable one?"""
    import importlib
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_lowmem_name_in_the_docs_resolves():
    names = {(p.relative_to(ROOT), m) for p in PAGES for m in DOTTED.findall(p.read_text())
             if not m.endswith((".py", ".md"))}
    bad = sorted(f"{page}: {m}" for page, m in names if not _resolves(m))
    assert not bad, "names the docs give that lowmem does not have: " + ", ".join(bad)
