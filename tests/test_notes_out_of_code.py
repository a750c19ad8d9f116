"""Measurement history lives in bench/results/, not in the package's comments (issue 44).

Three checks over the package's text:

- prose share: over every .py file under fusedrnn/cpu/ (recursively), the non-blank lines
  that are comments or lie inside a triple-quoted string statement (tokenize's COMMENT
  tokens, and its STRING tokens that open with three quotes and stand alone as a statement,
  as docstrings do, counting every line such a token spans) are at most 25% of all
  non-blank lines. A triple-quoted value (bf16.py's _HELPER, LLVM IR) is code;
- no comment or docstring in fusedrnn/ (its .py files' comments and triple-quoted string
  statements, and the comments of fusedrnn/gpu/*.cuh) quotes a timing or a rate (a number
  followed by ns, us, µs, ms, s, GFLOP/s, TFLOP/s, GB/s), a before/after figure ("1.5x",
  "8.3 -> 6.6", "437-460 -> 367-390", "108 -> 79 ms"; an arrow between two plain integers
  with no unit, such as an exponent's rebias "15 -> 127", is not one), a date or a commit
  hash (a pointer's anchor, which may name a dated heading, is not checked);
- every pointer into bench/results/ that names a section ("bench/results/x.md#anchor")
  resolves: the file exists and has a heading with that GitHub-style anchor.
"""
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fusedrnn"
TRIPLE = re.compile(r"^[rRbBuUfF]{0,2}('''|\"\"\")")


def _tokens(path):
    with open(path, "rb") as f:
        return list(tokenize.tokenize(f.readline))


STATEMENT_START = {tokenize.ENCODING, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
SKIP = {tokenize.NL, tokenize.COMMENT}


def _prose_tokens(path):
    """A .py file's comments and triple-quoted string statements (docstrings among them)."""
    tokens = _tokens(path)
    code = [tok for tok in tokens if tok.type not in SKIP]
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            yield tok
    for before, tok, after in zip(code, code[1:], code[2:], strict=False):
        if (tok.type == tokenize.STRING and TRIPLE.match(tok.string)
                and before.type in STATEMENT_START and after.type == tokenize.NEWLINE):
            yield tok


def _prose(path):
    """(line number, text) of each comment and each string statement of a .py file."""
    for tok in _prose_tokens(path):
        yield tok.start[0], tok.string


def _prose_lines(path):
    lines = set()
    for tok in _prose_tokens(path):
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def _cuh_comments(path):
    """(line number, text) of each // and /* */ comment of a CUDA source."""
    text = path.read_text()
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S):
        yield text.count("\n", 0, m.start()) + 1, m.group()


def prose_share(folder):
    prose = total = 0
    for path in sorted(folder.rglob("*.py")):
        source = path.read_text().splitlines()
        blank = {i for i, line in enumerate(source, 1) if not line.strip()}
        prose += len(_prose_lines(path) - blank)
        total += len(source) - len(blank)
    return prose, total


def test_prose_is_at_most_a_quarter_of_the_cpu_kernels():
    prose, total = prose_share(PACKAGE / "cpu")
    assert prose / total <= 0.25, f"prose {prose} of {total} lines ({prose / total:.1%})"


POINTER = re.compile(r"bench/results/([\w.-]+\.md)#([\w-]+)")
NUMBER = r"(?<![\w.^])\d+(?:\.\d+)?"
TIMING = [
    # a time or a rate after a number: "3 us", "1.5ms", "481 GFLOP/s", "12 GB/s", "2 s"
    re.compile(NUMBER + r"\s?(?:ns|us|µs|ms|s|sec|seconds?)\b(?!['\w-])"),
    re.compile(NUMBER + r"\s?(?:[GTM]FLOPS?|[KMGT]i?B)/s\b"),
    # a ratio: "1.5x", "0.9x faster", "2 times slower", "3% faster"
    re.compile(NUMBER + r"x\b"),
    re.compile(NUMBER + r"\s?times (?:faster|slower)"),
    re.compile(NUMBER + r"\s?% (?:faster|slower|better|worse|gain|loss)"),
    # a date, a commit hash (7-12 lowercase hex digits, at least one a-f and one 0-9)
    re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b"),
    re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}\b"),
]
# before/after: an arrow between figures, where either is a decimal or a range, or a unit
# follows ("8.3 -> 6.6", "437-460 -> 367-390", "108 -> 79 ms"; not "15 -> 127")
FIGURE = r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?"
ARROW = re.compile(rf"(?<![\w.])({FIGURE})\s*(?:->|→)\s*~?({FIGURE})"
                   r"(\s?(?:[mµun]?s\b|x\b|%|[GT]FLOP/s|GB/s))?")


def _texts():
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _prose(path):
            yield path, line, text
    for path in sorted((PACKAGE / "gpu").glob("*.cuh")):
        for line, text in _cuh_comments(path):
            yield path, line, text


def _hits(text):
    # a pointer's anchor is a heading's name (some carry a date), not a figure
    text = POINTER.sub(lambda m: "#" * len(m.group()), text)
    for pattern in TIMING:
        for m in pattern.finditer(text):
            yield text.count("\n", 0, m.start()), m.group()
    for m in ARROW.finditer(text):
        if m.group(3) or any(c in m.group(1) + m.group(2) for c in ".-"):
            yield text.count("\n", 0, m.start()), m.group()


def test_no_comment_quotes_a_timing():
    found = []
    for path, line, text in _texts():
        for offset, quote in _hits(text):
            found.append(f"{path.relative_to(ROOT)}:{line + offset}: {quote!r}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("text", [
    "LSTM 8.3 -> 6.6 ms", "110-120 us", "481 GFLOP/s", "1.062x over", "0.9x",
    "(2026-11-26)", "3ms", "2 s a call", "12 GB/s", "3 µs", "437-460 -> 367-390",
    "GRU 108 -> 79 ms", "1.19 -> 0.91 ulp", "at 02d5294", "4-12x slower", "3% faster",
])
def test_the_timing_patterns_catch(text):
    assert list(_hits(text)), text


@pytest.mark.parametrize("text", [
    "T=300 N=20 I=H=800", "2^25 multiply-adds", "1 MB", "8 x 2 tile", "N x H", "0x1f",
    "16-byte loads", "2 ** 19", "float32 -> bfloat16", "4 steps", "ms.append(t)",
    "rebias the exponent (15 -> 127)", "0xC8000FFF", "2^-24", "6 x 1 zmm", "the 1 MB L2",
    "(T, N, D*G*H)", "a 1 x 2 tile",
])
def test_the_timing_patterns_pass(text):
    assert not list(_hits(text)), text


def _anchor(heading):
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(md):
    anchors, fenced = set(), False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            anchors.add(_anchor(m.group(1)))
    return anchors



def test_every_pointer_into_bench_results_resolves():
    missing = []
    for path, line, text in _texts():
        for m in POINTER.finditer(text.replace("\n", " ")):
            md = ROOT / "bench" / "results" / m.group(1)
            if not md.exists() or m.group(2) not in _anchors(md):
                missing.append(f"{path.relative_to(ROOT)}:{line}: {m.group()}")
    assert not missing, "\n".join(missing)
