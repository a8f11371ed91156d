"""One error base: every exception class the project defines is a MoeshrinkError, and the CLI prints
those as one line while anything else keeps its traceback."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from moeshrink import cli
from moeshrink.core.errors import MoeshrinkError

ROOT = Path(__file__).resolve().parent.parent


def project_modules() -> list[str]:
    names = []
    for package in (ROOT / "moeshrink", ROOT / "kernels" / "moeshrink_kernels"):
        for path in sorted(package.rglob("*.py")):
            relative = path.relative_to(package.parent).with_suffix("")
            names.append(".".join(relative.parts).removesuffix(".__init__"))
    return [n for n in names if not n.endswith("__main__")]


def test_every_exception_class_the_project_defines_is_a_moeshrink_error():
    found = []
    for name in project_modules():
        try:
            module = importlib.import_module(name)
        except ImportError as error:  # an optional backend (triton) absent here
            assert "triton" in str(error), f"{name}: {error}"
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException):
                found.append(cls)
                assert issubclass(cls, MoeshrinkError), f"{name}.{cls.__name__} is not a MoeshrinkError"
    assert len(found) >= 20  # the modules were really read


def test_the_cli_prints_a_moeshrink_error_as_one_line_and_lets_a_bug_through(monkeypatch, capsys, tmp_path):
    bad = tmp_path / "config.yaml"
    bad.write_text("builds: 3\n")
    assert cli.main(["plan", "--config", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: config.yaml + {bad} is invalid")  # laid over config.yaml

    def bug(path):
        raise KeyError("a bug")

    monkeypatch.setattr(cli.config_mod, "load", bug)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["plan", "--config", str(bad)])
