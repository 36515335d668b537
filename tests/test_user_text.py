"""What users read (command output, help, findings, HTTP answers, the dashboard) says the thing
itself, never which design note or issue it came from ("seed 001: tell bad from slow")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import elastic_ep

ROOT = Path(elastic_ep.__file__).parent
USER_FACING = ["commands", "doctor", "serve", "cli.py", "demo_view.py"]
CITATION = re.compile(r"\b(seed \d{3}|seeds?'s?\b|issue \d+|section \d+)", re.IGNORECASE)


def user_strings(path: Path) -> list[str]:
    """String literals of a module, docstrings left out (those are for its readers)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_user_facing_text_cites_its_sources():
    files = [p for name in USER_FACING for p in ((ROOT / name).rglob("*.py") if (ROOT / name).is_dir()
                                                  else [ROOT / name])]
    cited = {f"{p.relative_to(ROOT)}: {m.group(0)!r} in {text[:80]!r}"
             for p in files for text in user_strings(p) for m in [CITATION.search(text)] if m}
    html = (ROOT / "serve" / "static" / "dashboard.html").read_text()
    cited |= {f"dashboard.html: {m.group(0)!r}" for m in CITATION.finditer(html)}
    assert not cited, sorted(cited)
