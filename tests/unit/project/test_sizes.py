"""The house's size bounds (issue 24), held by a test rather than by review.

No file of the product over ``FILE_LINES`` lines; no function over ``FUNCTION_LINES`` lines
unless a ``# Long:`` comment right above its ``def`` (or its first decorator) says why; and
docs/architecture.md's rules of the house name the largest file and the largest function with
their sizes, near enough to be true (``SLACK``), so a newcomer knows where the big rooms are.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import mtc_replicator

PACKAGE = Path(mtc_replicator.__file__).parent
REPO = PACKAGE.parent
FILE_LINES = 650
"""The issue's "~600", with room for a docstring's growth."""
FUNCTION_LINES = 80
SLACK = 25
"""How far the named sizes may lag the code before the page must be updated."""
REASON = re.compile(r"^\s*# Long: \S")


@dataclass(frozen=True)
class Function:
    path: str
    name: str
    lines: int
    reason: str


def product_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_pb" not in p.relative_to(PACKAGE).parts)


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def functions(path: Path) -> list[Function]:
    """Every function and method of ``path``, by qualified name (``Class.method``)."""
    source = path.read_text()
    lines = source.splitlines()
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                above = lines[first - 2] if first >= 2 else ""
                reason = above if REASON.match(above) else ""
                size = (child.end_lineno or child.lineno) - child.lineno + 1
                found.append(Function(relative(path), prefix + child.name, size, reason))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_the_product_is_found() -> None:
    files = product_files()
    assert len(files) > 50
    assert any(p.name == "daemon.py" for p in files)


def test_no_product_file_over_the_bound() -> None:
    sizes = {relative(p): len(p.read_text().splitlines()) for p in product_files()}
    over = {path: n for path, n in sizes.items() if n > FILE_LINES}
    assert not over, f"files over {FILE_LINES} lines: {over}; split them by concern"


def test_no_function_over_the_bound_without_a_reason() -> None:
    over = [
        f"{f.path}:{f.name} ({f.lines} lines)"
        for p in product_files()
        for f in functions(p)
        if f.lines > FUNCTION_LINES and not f.reason
    ]
    assert not over, (
        f"functions over {FUNCTION_LINES} lines with no '# Long: why' above them: {over}"
    )


def test_a_reason_is_found_above_the_def_or_its_decorators(tmp_path: Path) -> None:
    body = "\n".join(f"    x = {i}" for i in range(FUNCTION_LINES))
    source = f"# Long: one table\n@staticmethod\ndef table():\n{body}\n\ndef plain():\n{body}\n"
    sample = tmp_path / "sample.py"
    sample.write_text(source)
    found = {f.name: f for f in functions(sample)}
    assert found["table"].reason
    assert found["table"].lines > FUNCTION_LINES
    assert not found["plain"].reason
    assert found["plain"].lines > FUNCTION_LINES


def test_the_architecture_page_names_the_largest_file_and_function() -> None:
    page = " ".join((REPO / "docs" / "architecture.md").read_text().split())
    named_file = re.search(r"largest file is `(?P<path>[^`]+)`, (?P<lines>\d+) lines", page)
    named_function = re.search(
        r"largest function is `(?P<name>[^`]+)` in `(?P<path>[^`]+)`, (?P<lines>\d+) lines", page
    )
    assert named_file, "docs/architecture.md names no largest file"
    assert named_function, "docs/architecture.md names no largest function"
    sizes = {relative(p): len(p.read_text().splitlines()) for p in product_files()}
    # Within SLACK of the largest (a tie, or one grown since), and its size told within SLACK.
    assert named_file["path"] in sizes, named_file["path"]
    assert sizes[named_file["path"]] >= max(sizes.values()) - SLACK, max(sizes.items(), key=by_size)
    assert abs(int(named_file["lines"]) - sizes[named_file["path"]]) <= SLACK
    every = {(f.name, f.path): f.lines for p in product_files() for f in functions(p)}
    named = (named_function["name"], named_function["path"])
    assert named in every, named
    assert every[named] >= max(every.values()) - SLACK, max(every.items(), key=by_size)
    assert abs(int(named_function["lines"]) - every[named]) <= SLACK


def by_size(item: tuple[object, int]) -> int:
    return item[1]
