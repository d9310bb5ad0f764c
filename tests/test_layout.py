"""docs/layout.md names every module of the package, and no module that is not there."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def has_code(path: Path) -> bool:
    """A package's __init__.py is a module of its own when it holds more than a docstring."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body)


def test_layout_doc_matches_the_tree():
    named = set(re.findall(r"`(src/wingspan/[\w/]+\.py)`", (ROOT / "docs" / "layout.md").read_text()))
    modules = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "src" / "wingspan").rglob("*.py")
        if path.name != "__init__.py" or path.parent.name == "wingspan" or has_code(path)
    }
    assert sorted(modules - named) == [], "modules docs/layout.md does not describe"
    assert sorted(named - modules) == [], "docs/layout.md names modules that do not exist"
