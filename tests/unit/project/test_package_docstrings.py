"""Each package's docstring (its ``__init__.py``) names only modules that exist: a module
renamed or removed leaves its package's map of itself pointing at nothing (issue 37 found
``transport``'s naming ``peer``, ``service`` and ``server`` long after they were renamed).

The rule, on each literal of the docstring in double backticks (reST's inline code):

- a lowercase name (``peer_client``) is a module or subpackage of the package, or a command
  of ``pyproject.toml``'s ``[project.scripts]`` (``mtc``); in a sentence about imports
  (``Imports core only``), one of ``mtc_replicator``'s packages too (elsewhere a
  package beside this one is written ``mtc_replicator.client``: ``client`` in
  ``cluster``'s docstring was its coordinator client, renamed away);
- a dotted name whose first part is ``mtc_replicator`` or one of its packages
  (``core.contract``, ``mtc_replicator.csi.owner``, ``core.contract.JobConfig``) is
  resolved from ``mtc_replicator``: modules as far as they go, then a name the last one
  defines;
- a capitalized name (``CoordinatorLink``) is a class, function or constant defined in one
  of the package's modules;
- a path (``mtc_replicator/client/``, ``pyproject.toml``) exists in the repository, and a
  ``name.py`` (backticked or not) is a file of the package.

Anything else (a command such as ``mtc render``, a URL, an entry point group such as
``mtc.commands``) is not a module name and is left alone.
"""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

import mtc_replicator

PACKAGE = Path(mtc_replicator.__file__).parent
REPO = PACKAGE.parent
LITERAL = re.compile(r"``([^`]+)``")
LOWER = re.compile(r"[a-z_][a-z0-9_]*")
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
CAPITALIZED = re.compile(r"[A-Z]\w*")
FILE_NAME = re.compile(r"(?<![\w/.-])[\w-]+\.py\b")
PATH = re.compile(r"(mtc_replicator/[\w./-]*|[\w-]+\.(toml|md|py))")
SENTENCE = re.compile(r"(?<=\.)\s+")
COMMANDS = frozenset(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def packages() -> list[Path]:
    """``mtc_replicator`` and every package below it but the generated ``_pb`` ones."""
    found = [p.parent for p in PACKAGE.rglob("__init__.py")]
    return sorted(p for p in found if "_pb" not in p.relative_to(PACKAGE).parts)


def docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def module_names(package: Path) -> set[str]:
    """The modules and subpackages directly in ``package``."""
    return {p.stem for p in package.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in package.iterdir() if (p / "__init__.py").is_file()
    }


@cache
def defined(path: Path) -> frozenset[str]:
    """The classes, functions (methods too) and assigned names of ``path`` (a module), or of
    every module below it (a package)."""
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    names: set[str] = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
    return frozenset(names)


def resolves(dotted: str) -> bool:
    """``dotted``, from ``mtc_replicator``: modules as far as they go, then one name the
    last defines."""
    parts = dotted.split(".")
    if parts[0] == PACKAGE.name:
        parts = parts[1:]
    where = PACKAGE
    while parts and where.is_dir():
        if (where / parts[0] / "__init__.py").is_file():
            where = where / parts[0]
        elif (where / f"{parts[0]}.py").is_file():
            where = where / f"{parts[0]}.py"
        else:
            break
        parts = parts[1:]
    module = where / "__init__.py" if where.is_dir() else where
    return not parts or (len(parts) == 1 and parts[0] in defined(module))


def stale(package: Path, doc: str) -> list[str]:
    """The names in ``doc``, the docstring of ``package``, that the rule finds nothing for."""
    tops = module_names(PACKAGE) | {PACKAGE.name}
    found: list[str] = []
    for sentence in SENTENCE.split(doc):
        own = module_names(package) | COMMANDS
        named = own | tops if "import" in sentence.lower() else own
        for literal in LITERAL.findall(sentence):
            if _stale(package, literal, named, tops):
                found.append(literal)
    bare = FILE_NAME.findall(LITERAL.sub("", doc))
    return found + [name for name in bare if not (package / name).is_file()]


def _stale(package: Path, literal: str, named: set[str], tops: set[str]) -> bool:
    if PATH.fullmatch(literal):
        where = package if "/" not in literal and literal.endswith(".py") else REPO
        return not (where / literal).exists()
    if LOWER.fullmatch(literal):
        return literal not in named
    if DOTTED.fullmatch(literal):
        return literal.split(".", maxsplit=1)[0] in tops and not resolves(literal)
    return bool(CAPITALIZED.fullmatch(literal)) and literal not in defined(package)


@pytest.mark.parametrize("package", packages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_a_package_docstring_names_only_modules_that_exist(package: Path) -> None:
    assert docstring(package), f"{package / '__init__.py'} has no docstring to say what it holds"
    assert stale(package, docstring(package)) == []


def test_the_packages_are_found() -> None:
    names = {p.name for p in packages()}
    assert {"core", "local", "transport", "cluster", "node", "storage", "client"} <= names
    assert "_pb" not in names


@pytest.mark.parametrize(
    ("package", "doc", "found"),
    [
        ("transport", "The client (``peer``) and the server (``peer_servicer``).", ["peer"]),
        ("transport", "Imports ``local`` and ``core``; never ``storage``.", []),
        ("cluster", "Its calls (``coordinators``) over gRPC (``servicer``).", ["servicer"]),
        ("storage", "Its policy is ``core.prune``; ``core.pruning`` is not.", ["core.pruning"]),
        ("client", "``mtc_replicator.core.contract.JobConfig``", []),
        (
            "client",
            "``mtc_replicator.core.contract.NoSuchThing``",
            ["mtc_replicator.core.contract.NoSuchThing"],
        ),
        (
            "cluster",
            "One Protocol (``CoordinatorLink``), not ``CoordinatorLinks``.",
            ["CoordinatorLinks"],
        ),
        ("node", "The loop lives in daemon.py, the job in agents.py.", ["agents.py"]),
        (
            "node",
            "``mtc_replicator/node/`` and ``mtc_replicator/nodes/``",
            ["mtc_replicator/nodes/"],
        ),
        ("tools", "``mtc render`` and the ``mtc.commands`` entry point; ``file://``.", []),
        ("cluster", "The agent's client (``client``). Imports ``client``.", ["client"]),
    ],
    ids=[
        "renamed-module",
        "sibling-packages",
        "renamed-servicer",
        "dotted-module",
        "dotted-name",
        "dotted-name-gone",
        "class",
        "file-name",
        "path",
        "not-module-names",
        "sibling-outside-imports",
    ],
)
def test_the_rule_finds_a_stale_name(package: str, doc: str, found: list[str]) -> None:
    """The check is not vacuous: each kind of name it reads is caught when stale."""
    assert stale(PACKAGE / package, doc) == found
