"""`python -m moeshrink` runs the stages by hand and reports bad input clearly."""
import subprocess
import sys
from pathlib import Path

import yaml

from moeshrink.core.config import read_layers

ROOT = Path(__file__).resolve().parent.parent


def moeshrink(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeshrink", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_validate_config_accepts_the_default_and_presets():
    presets = sorted((ROOT / "presets").glob("*.yaml"))
    result = moeshrink("validate-config", "config.yaml", *map(str, presets))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": valid") == 1 + len(presets)


def test_validate_config_names_the_bad_key(tmp_path):
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["serve"]["tensor_parallel_size"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    result = moeshrink("validate-config", str(bad))
    assert result.returncode == 2
    assert "serve.tensor_parallel_size: 0 is less than the minimum of 1" in result.stderr


def test_upstream_from_a_local_folder_and_the_twin(tmp_path, tiny_trained):
    config = read_layers(ROOT / "config.yaml", ROOT / "presets/gpt-oss-20b.yaml")
    config["upstream"] = {"source": "path", "path": {"dir": str(tiny_trained), "mode": "copy"},
                          "organism": config["upstream"]["organism"]}  # the eval sets' fictional world
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = moeshrink("upstream", "--config", str(path), "--results", str(tmp_path / "results"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "results/upstream/manifest.json").exists()
    result = moeshrink("twin", "--input", str(tmp_path / "results/upstream"), "--output", str(tmp_path / "twin"))
    assert result.returncode == 2 and "quant_method is None" in result.stderr
