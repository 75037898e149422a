"""The shape of the code base: no import cycles inside jvarlen/ (kernels/ included), the planner free
of JAX, no module past ~500 lines without a comment at its top saying why."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"jvarlen": ROOT / "jvarlen", "jvarlen.kernels": ROOT / "kernels"}
MAX_LINES = 500


def modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for pkg, root in PACKAGES.items():
        for f in root.rglob("*.py"):
            parts = [p for p in f.relative_to(root).with_suffix("").parts if p != "__init__"]
            if pkg == "jvarlen" and parts[:1] == ["kernels"]:
                continue
            out[".".join([pkg, *parts])] = (f, f.name == "__init__.py")
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> modules it imports (any import statement, module level or inside a function;
    a package's ``__init__`` re-exports are not edges)."""
    mods = modules()

    def resolve(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, (f, is_init) in mods.items():
        if is_init:
            continue
        pkg = m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for t in targets:
                r = resolve(t)
                if r and r != m and not mods[r][1]:
                    edges[m].add(r)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_jvarlen():
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


def test_planner_and_profiler_entry_never_import_jax():
    code = (
        "import sys, jvarlen.plan, jvarlen.plan.service, jvarlen.plan.strategy, jvarlen.profile; "
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_modules_stay_small_or_say_why():
    long = []
    for f, _ in modules().values():
        lines = f.read_text().splitlines()
        if len(lines) > MAX_LINES and not any("longer than" in line for line in lines[:15]):
            long.append(f"{f.relative_to(ROOT)} ({len(lines)} lines)")
    assert not long, f"modules past {MAX_LINES} lines without a reason at the top: {long}"
