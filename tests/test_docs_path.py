"""The teaching path of docs/README.md fits the time it states.

Its table lists the path's pages (and the scripts each walks) with their minutes; this test
recomputes them from the pages as README.md says: prose at 120 words a minute, code lines at
25 and printed output lines at 50 (the scripts named in a row counted as code), plus the
minutes of running the row states, each page rounded to a whole minute. The prose of the path
must stay within 7,500 words and the whole within 90 minutes.

Words are whitespace-separated tokens outside fenced blocks (HTML comments and tables
included); a fence is a line that starts with ``` (after indentation).
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PROSE_WPM, CODE_LPM, OUTPUT_LPM = 120, 25, 50
MAX_PROSE, MAX_MINUTES = 7500, 90
OUTPUT_KINDS = ("output", "text", "console")


def split(text):
    """(prose lines, code lines, output lines) of a markdown page."""
    prose, code, output, kind = [], [], [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            kind = None if kind is not None else (line.strip()[3:].strip() or "plain")
            continue
        (prose if kind is None else output if kind in OUTPUT_KINDS else code).append(line)
    return prose, code, output


def prose_words(text):
    return len(" ".join(split(text)[0]).split())


def minutes(page, scripts, running):
    """The reading minutes of a page (and the scripts it walks), unrounded, plus its running."""
    prose, code, output = split(page.read_text())
    lines = len(code) + sum(len(s.read_text().splitlines()) for s in scripts)
    return len(" ".join(prose).split()) / PROSE_WPM + lines / CODE_LPM + len(output) / OUTPUT_LPM + running


def path_table():
    """[(page, [scripts], stated reading, running, stated minutes)] and the total row's
    (reading, running, minutes) of README.md's teaching-path table."""
    text = (DOCS / "README.md").read_text()
    block = text[text.index("## The teaching path"):]
    block = block[:block.index("\n## ")]
    rows, total = [], None
    for line in block.splitlines():
        if not line.startswith("| ") or line.startswith(("| page", "|---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        num = [int(c) if c else 0 for c in cells[2:5]]
        if cells[0] == "total":
            total = tuple(num)
            continue
        links = re.findall(r"\]\(([\w.]+)\)", cells[0])
        rows.append((DOCS / links[0], [DOCS / s for s in links[1:] if s.endswith(".py")], *num))
    return rows, total


def half_up(x):
    return int(x + 0.5)


def test_the_table_states_what_the_pages_take():
    rows, total = path_table()
    assert len(rows) >= 8 and total is not None
    want = [(p.name, half_up(minutes(p, s, 0)), run, half_up(minutes(p, s, 0)) + run) for p, s, _, run, _ in rows]
    got = [(p.name, read, run, mins) for p, _, read, run, mins in rows]
    assert got == want, "docs/README.md's path table should read (page, reading, running, minutes):\n" + \
        "\n".join(map(str, want))
    sums = tuple(sum(w[i] for w in want) for i in (1, 2, 3))
    assert total == sums, f"the total row should read {sums}"
    heading = re.search(r"## The teaching path: (\d+) minutes", (DOCS / "README.md").read_text())
    assert heading and int(heading.group(1)) == sums[2]
    assert sums[2] <= MAX_MINUTES, f"the path takes {sums[2]} minutes"


def test_the_path_prose_stays_within_its_budget():
    rows, _ = path_table()
    words = {p.name: prose_words(p.read_text()) for p, *_ in rows}
    assert sum(words.values()) <= MAX_PROSE, (sum(words.values()), words)


def test_every_path_page_exists_and_names_its_exercises_answers():
    rows, _ = path_table()
    answers = (DOCS / "answers.md").read_text()
    for page, scripts, *_ in rows:
        assert page.exists() and all(s.exists() for s in scripts), page
        text = page.read_text()
        if "## Exercises" in text:
            anchor = page.stem
            assert f"answers.md#{anchor}" in text, f"{page.name}: its exercises should link answers.md#{anchor}"
            assert f'<a id="{anchor}"></a>' in answers, f"answers.md has no section for {page.name}"
            asked = len(re.findall(r"^\d+\. ", text[text.index("## Exercises"):], re.M))
            section = answers[answers.index(f'<a id="{anchor}"></a>'):]
            nxt = section.find('<a id="', 1)
            given = len(re.findall(r"^\d+\. ", section[:nxt if nxt > 0 else None], re.M))
            assert asked == given, f"{page.name}: {asked} exercises, {given} answers"


def test_the_line_counts_stated_for_scripts_are_right():
    """`[x.py](x.py) (N lines` on a path page: x.py has N lines."""
    rows, _ = path_table()
    stated = [(p.name, m.group(1), int(m.group(2))) for p, *_ in rows
              for m in re.finditer(r"\[(\w+\.py)\]\(\1\) \((\d+) lines", p.read_text())]
    assert len(stated) >= 2
    wrong = [(page, script, n, len((DOCS / script).read_text().splitlines())) for page, script, n in stated
             if len((DOCS / script).read_text().splitlines()) != n]
    assert not wrong, wrong


def test_the_counter():
    text = "a b\n```python\nx = 1\n```\n```output\n1\n```\n  ```\nindented fence\n  ```\nc"
    prose, code, output = split(text)
    assert len(" ".join(prose).split()) == 3 and code == ["x = 1", "indented fence"] and output == ["1"]
