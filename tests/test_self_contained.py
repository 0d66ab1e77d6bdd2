"""The code explains itself: no pointer to files a user of the package does not have (the
developers' private spec notes) or to this project's own issue numbers. State the fact instead
(the official behaviour, the deviation and why, with the paper / official-code link).

Public references stay allowed: URLs, `owner/repo#N` of another repository, in-repo paths such as
`results/reports/...`, hex colours ('#1f77b4'), `# noqa`, ranks like "member #2"."""

import re
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
FOLDERS = ("methods", "harness", "kvcore", "tasks", "hydra_plugins", "benchmarks", "scripts", "conf",
           "tests", ".ci")
FILES = ("Makefile", "pyproject.toml")
SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".c", ".in"}

# The private notes by name (the .md files methods, methods-2, stack, peers, peers-2026,
# models-and-data, style) or by folder (the shared reference folder, reference/<note>.md).
NOTES = r"(?:methods(?:-2)?|stack|peers(?:-\d+)?|models-and-data|style)\.md"
PRIVATE_NOTE = rf"shared/(?:reference)|\breference/[\w-]+\.md\b|(?<![\w/]){NOTES}\b"
# The word and a number, also wrapped over two lines ("Issues N/M", "issue #N", "PR N"); not
# `issues/N` (a URL) nor `issueN_x` (a path).
ISSUE_WORD = r"(?<![\w/.#-])(?:issues?|PRs?)(?:\s+#?|\s*#)\d{1,4}\b"
# A bare number used as a pointer: "(#N)", "see #N", "cf. #N", "per #N".
ISSUE_HASH = r"(?:\(|\b(?:see|cf\.?|per)\s+)#\d{1,4}\b(?![\w-])"
POINTER = re.compile("|".join((PRIVATE_NOTE, ISSUE_WORD, ISSUE_HASH)), re.IGNORECASE)
# Every POINTER match contains one of these (lower case); scanning for them first is ~10x faster.
CANDIDATE = re.compile(r"ssue|prs?[\s#]|\.md|ferenc|#\d")


def pointers(text: str) -> list[tuple[int, str]]:
    """(line number, matched text) of every pointer outside the repository in `text`."""
    low = text.lower()
    if len(low) != len(text):  # a character whose lower case is longer: offsets would differ
        return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in POINTER.finditer(text)]
    hits = {}
    for candidate in CANDIDATE.finditer(low):
        start = text.rfind("\n", 0, candidate.start()) + 1  # its line and the next (wrapped)
        end = text.find("\n", text.find("\n", candidate.end()) + 1)
        for m in POINTER.finditer(text, start, len(text) if end < 0 else end):
            hits[m.start()] = m.group(0)
    return [(text.count("\n", 0, at) + 1, hit) for at, hit in sorted(hits.items())]


def scanned_files() -> list[Path]:
    paths = [PROJECT / name for name in FILES if (PROJECT / name).is_file()]
    for folder in FOLDERS:
        paths += [p for p in sorted((PROJECT / folder).rglob("*"))
                  if p.is_file() and (p.suffix in SUFFIXES or p.parent.name == ".ci")]
    return paths


def test_no_pointer_outside_the_repository():
    files = scanned_files()
    assert len(files) > 100 and PROJECT / "methods" / "base.py" in files  # the scan sees the code
    offences = [f"{path.relative_to(PROJECT)}:{number}: {hit!r}"
                for path in files
                for number, hit in pointers(path.read_text(encoding="utf-8", errors="replace"))]
    assert not offences, ("state the fact in the code instead of pointing at a private note or "
                          "an issue number:\n" + "\n".join(offences))


def test_planted_pointers_are_found_and_public_references_are_not():
    md, n = ".md", 26  # the planted pointers are built from parts: this file must pass its own scan
    planted = [f"see methods{md} §3", f"(spec: reference/methods-2{md} §8)", f"(stack{md} §4)",
               f"models-and-data{md} §1.1", "../shared/" "reference", f"(issue {n})",
               f"Issue {n} §4", f"issues {n}/13", f"issue #{n}", f"(#{n})", f"see #{n}",
               f"the issue\n    {n}: wrapped", f"PR {n}"]
    for line in planted:
        assert pointers(line), line
    public = ["FasterDecoding/SnapKV#16", "https://github.com/FasterDecoding/SnapKV/issues/16",
              "transformers#35168", "COLOURS = ('#1f77b4', '#ff7f0e', '#123456')",
              "import torch  # noqa: E402", "see results/reports/issue10_fairness.md",
              "--previous results/reports/issues12_13/tables.md", "member #2 is cancelled",
              "harness/report/style.py", "docs/methods/kivi.md", "reference/run.samples.jsonl"]
    for line in public:
        assert not pointers(line), line
