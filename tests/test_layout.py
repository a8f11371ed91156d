"""The package layout follows the data flow: a stage imports only the stages before it (lazy imports
inside functions count too), no modules import each other in a circle, and the jobs that only read
headers or speak HTTP never import torch. ruff's checks (pyproject.toml) pass on the whole tree."""
import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top: a module may import modules of its own layer and of the layers below it.
LAYERS = [
    ("core", {"moeshrink.core"}),
    ("formats", {"moeshrink.formats"}),
    ("kernels", {"moeshrink_kernels"}),
    ("upstream", {"moeshrink.organism", "moeshrink.upstream"}),
    ("compress", {"moeshrink.compress"}),
    ("serve", {"moeshrink.serve"}),
    ("evals", {"moeshrink.evals"}),
    ("compare", {"moeshrink.compare"}),
    ("report", {"moeshrink.report"}),
    ("entry points", {"moeshrink", "moeshrink.stages", "moeshrink.smk", "moeshrink.cli", "moeshrink.__main__"}),
]
# What the serve_prediction, serve_memory, eval, compare and report jobs and `moeshrink plan` import
# (the evals speak HTTP; lm-eval is imported only by the two evals that run it).
TORCH_FREE = ["moeshrink.smk", "moeshrink.stages", "moeshrink.cli", "moeshrink.serve.planner",
              "moeshrink.serve.served_memory", "moeshrink.serve.supervisor", "moeshrink.serve.server_lease",
              "moeshrink.evals.run", "moeshrink.compare.paired", "moeshrink.report.render", "moeshrink.core.stats"]


def modules() -> dict[str, Path]:
    found = {}
    for base, package in [(ROOT, "moeshrink"), (ROOT / "kernels", "moeshrink_kernels")]:
        for path in (base / package).rglob("*.py"):
            name = ".".join(path.relative_to(base).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports, anywhere in its body."""
    known = modules()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in known.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {resolve(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {resolve(f"{node.module}.{alias.name}") for alias in node.names}
        graph[name] = targets - {None, name}
    return graph


def layer_of(module: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (module.startswith(prefix + ".") and prefix != "moeshrink"):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: place it in tests/test_layout.py's LAYERS")
    return best[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_stage_imports_only_the_stages_before_it():
    graph = import_graph()
    upward = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
              for module, targets in sorted(graph.items()) for target in sorted(targets)
              if layer_of(target) > layer_of(module)]
    assert upward == []


def test_a_later_stage_imported_from_an_earlier_one_is_caught():
    assert layer_of("moeshrink.core.config") < layer_of("moeshrink.serve.planner")
    with pytest.raises(AssertionError, match="belongs to no layer"):
        layer_of("moeshrink_other.x")


def test_header_and_http_jobs_never_import_torch():  # nor vLLM, transformers or lm-eval
    code = ("import importlib, sys\n"
            f"for name in {TORCH_FREE!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'lm_eval') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


def test_ruff_passes():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (the test extra installs it)")
    result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_type_checker_passes_on_the_core_packages():  # the packages pyproject's [tool.mypy] names
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (the test extra installs it)")
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", "/dev/null"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "moeshrink/core" in (ROOT / "pyproject.toml").read_text()


def test_every_name_the_entry_points_import_from_the_project_exists():
    """scripts/, bench/ and the tests are not imported by the suite's fast part: a renamed or moved
    name they import from moeshrink or moeshrink_kernels is caught here, not on a GPU node."""
    code = ("import ast, importlib, pathlib, sys\n"
            "missing = []\n"
            "for path in sorted([*pathlib.Path('scripts').glob('*.py'), *pathlib.Path('bench').glob('*.py'),\n"
            "                    *pathlib.Path('tests').glob('*.py')]):\n"
            "    for node in ast.walk(ast.parse(path.read_text())):\n"
            "        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \\\n"
            "                node.module.split('.')[0] in ('moeshrink', 'moeshrink_kernels'):\n"
            "            module = importlib.import_module(node.module)\n"
            "            for alias in node.names:\n"
            "                if not hasattr(module, alias.name) and \\\n"
            "                        importlib.util.find_spec(f'{node.module}.{alias.name}') is None:\n"
            "                    missing.append(f'{path}: {node.module}.{alias.name}')\n"
            "print(missing)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", result.stdout
