"""The code's own house rules, checked: no function over 80 lines in the package."""

import ast
from pathlib import Path

from conftest import ROOT


def test_no_function_in_the_package_is_over_80_lines():
    long = []
    for path in sorted((ROOT / "onn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long.append(
                    f"{Path(path).relative_to(ROOT)}:{node.lineno} {node.name} "
                    f"({node.end_lineno - node.lineno + 1} lines)"
                )
    assert not long, "split these into named steps:\n" + "\n".join(long)
