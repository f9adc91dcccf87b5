"""The import graph of `specjax`: no cycles, and imports only point down the layers.

Every import counts, at module level or inside a function: a function-level import that
closes a cycle is the same design bug, hidden (docs/ARCHITECTURE.md, "Layers").
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "specjax"

# Lowest first. A module may import its own layer or any lower one, never a higher one.
LAYERS = (
    ("specjax.checks", "specjax.rng", "specjax.params", "specjax.ledger", "specjax.trees"),
    ("specjax.backends",),
    ("specjax.models", "specjax.hf"),
    ("specjax.processors", "specjax.verify", "specjax.drafters"),
    ("specjax.policies", "specjax.timing", "specjax.training", "specjax.distribute",
     "specjax.state"),
    ("specjax.decode",),
    ("specjax.arguments", "specjax.prepare", "specjax.results"),
    ("specjax.generation", "specjax.costs", "specjax.compile_guard"),
    ("specjax",),
)


def _modules():
  out = {}
  for path in ROOT.rglob("*.py"):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = path
  return out


def imports(modules):
  """{module: {modules of specjax it imports anywhere in its source}}."""
  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(up + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                   for a in node.names]
      for t in targets:
        while t and t not in modules:  # `import specjax.models.model as m`: the module
          t = t.rpartition(".")[0]
        if t and t != name:
          found.add(t)
    graph[name] = found
  return graph


def find_cycle(graph):
  """One import cycle as a list of modules (first == last), or None."""
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for n in sorted(graph.get(m, ())):
      if state.get(n) == "open":
        return stack[stack.index(n):] + [n]
      if n not in state:
        found = visit(n)
        if found:
          return found
    stack.pop()
    state[m] = "done"
    return None

  for m in sorted(graph):
    if m not in state:
      found = visit(m)
      if found:
        return found
  return None


def layer(name):
  best = None
  for rank, prefixes in enumerate(LAYERS):
    for p in prefixes:
      if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[1]):
        best = (rank, len(p))
  return None if best is None else best[0]


def test_finder_sees_a_cycle_and_a_function_level_import(tmp_path):
  pkg = tmp_path / "specjax"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from specjax import b\n")
  (pkg / "b.py").write_text("def f():\n  from specjax.a import thing\n")
  mods = {"specjax": pkg / "__init__.py", "specjax.a": pkg / "a.py", "specjax.b": pkg / "b.py"}
  assert find_cycle(imports(mods)) in (["specjax.a", "specjax.b", "specjax.a"],
                                       ["specjax.b", "specjax.a", "specjax.b"])
  (pkg / "b.py").write_text("x = 1\n")
  assert find_cycle(imports(mods)) is None


def test_no_import_cycles():
  graph = imports(_modules())
  # The package's __init__ re-exports the API: it imports everything, nothing imports it.
  importers = sorted(m for m, deps in graph.items() if "specjax" in deps)
  assert not importers, f"modules importing the top-level package: {importers}"
  cycle = find_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer():
  missing = sorted(m for m in _modules() if layer(m) is None)
  assert not missing, f"modules with no layer in LAYERS: {missing}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_imports_point_down(name):
  graph = imports(_modules())
  mine = layer(name)
  up = sorted(d for d in graph[name] if layer(d) is not None and layer(d) > mine)
  # A package's __init__ re-exporting its own modules is not an upward import.
  up = [d for d in up if not d.startswith(name + ".")]
  assert not up, f"{name} (layer {mine}) imports higher layers: {up}"
