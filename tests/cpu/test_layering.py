"""The dependency direction of DESIGN.md holds: imports point one way."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "epserve"

# layer -> layers it must never import
FORBIDDEN = {
    "head": {"worker", "kernels", "cluster", "deploy"},
    "models": {"head", "worker", "cluster", "deploy"},
    "kernels": {"head", "worker", "cluster", "deploy", "models"},
    "worker": {"head", "cluster", "deploy"},
    "cluster": {"deploy"},
}
NO_RAY = {"models", "kernels"}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_imports_point_one_way():
    bad = []
    for layer, forbidden in FORBIDDEN.items():
        for f in (PKG / layer).rglob("*.py"):
            for name in _imports(f):
                parts = name.split(".")
                if parts[0] == "epserve" and len(parts) > 1 and parts[1] in forbidden:
                    bad.append(f"{f.relative_to(PKG)} imports {name}")
                if layer in NO_RAY and parts[0] == "ray":
                    bad.append(f"{f.relative_to(PKG)} imports ray")
                if layer == "head" and (name.startswith("torch.cuda") or parts[0] == "torch"):
                    bad.append(f"{f.relative_to(PKG)} imports {name}")
    assert not bad, "\n".join(bad)


def test_nothing_is_pickled_on_project_paths():
    for f in PKG.rglob("*.py"):
        for name in _imports(f):
            assert name.split(".")[0] not in {"pickle", "cloudpickle", "dill"}, f
