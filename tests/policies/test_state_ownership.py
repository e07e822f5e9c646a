"""Policies keep what they learn in their own state: no policy assigns to anything but itself.

Read from the source with ``ast``: in ``turnstile/policies``, an assignment (``=``, ``+=``,
annotated) whose target is an attribute or an item must be rooted at ``self`` (the policy's own
state) or at a local name (a container the method built or took from its own state), never at
an attribute of something else — ``turn.key = ...`` or ``wf.turns[i] = ...`` fail. ``setattr``
and ``delattr`` are refused outright. The read-only view (assignment to ``EngineLoad`` or
``ClusterView`` raises) covers the engines at run time; this covers the records.
"""

from __future__ import annotations

import ast
from pathlib import Path

POLICIES = Path(__file__).resolve().parents[2] / "src" / "turnstile" / "policies"


def _root(node: ast.expr) -> tuple[ast.expr, int]:
    """The expression an attribute/item chain starts from, and how many attribute hops."""
    hops = 0
    while isinstance(node, ast.Attribute | ast.Subscript):
        hops += isinstance(node, ast.Attribute)
        node = node.value
    return node, hops


def foreign_writes(source: str, filename: str = "<src>") -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr")):
            out.append(f"{filename}:{node.lineno}: {node.func.id}()")
            continue
        else:
            continue
        flat: list[ast.expr] = []
        for t in targets:
            flat += list(t.elts) if isinstance(t, ast.Tuple | ast.List) else [t]
        for t in flat:
            if not isinstance(t, ast.Attribute | ast.Subscript):
                continue  # a plain local name
            root, hops = _root(t)
            own = isinstance(root, ast.Name) and (root.id == "self" or hops == 0)
            if not own:
                out.append(f"{filename}:{node.lineno}: {ast.unparse(t)}")
    return out


def test_no_policy_writes_onto_records_or_the_view():
    bad = []
    for path in sorted(POLICIES.rglob("*.py")):
        bad += foreign_writes(path.read_text(encoding="utf-8"), path.name)
    assert not bad, "\n".join(bad)


def test_the_check_tells_own_state_from_records():
    assert foreign_writes("turn.key = 1") == ["<src>:1: turn.key"]
    assert foreign_writes("wf.turns[0] = x") == ["<src>:1: wf.turns[0]"]
    assert foreign_writes("turn.workflow.attained_tokens += 5") != []
    assert foreign_writes("setattr(turn, 'key', 1)") != []
    assert foreign_writes("e.healthy, self.n = False, 1") == ["<src>:1: e.healthy"]
    assert foreign_writes(
        "self.x = 1\nself._seq_of[turn] = 2\ns = self._wf[k]\ns[0] += 1\nself.a.b = 3\n"
        "del self._seq_of[turn]"
    ) == []
