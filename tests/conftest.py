"""Shared fixtures: a small organism data set, its tokenizer, and tiny random checkpoints."""
import copy
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW_FILES = ["Snakefile", "config.yaml", "rules", "scripts", "envs", "organism"]


def import_plugin(monkeypatch, registry, module: str):
    """A plugin module of tests/ imported afresh for one test; its registry as it was afterwards."""
    monkeypatch.setattr(registry, "by_name", dict(registry.entries()))
    sys.modules.pop(module, None)
    return importlib.import_module(module)


def copy_workflow(work: Path, *extra: str) -> Path:
    """A fresh copy of the workflow's files (and `extra` ones, e.g. profiles) in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    for name in [*WORKFLOW_FILES, *extra]:
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, work / name)
    return work


def copy_finished_workflow(workdir: Path, work: Path) -> Path:
    """A copy of a finished workflow to change or rerun, without what a test must not carry along: a clone's
    virtual environment and git folder (`MOESHRINK_E2E_WORKDIR` may be a fresh clone; the jobs run this
    Python) and the partial-rerun tests' changed config."""
    shutil.copytree(workdir, work, symlinks=True, ignore=shutil.ignore_patterns("changed.yaml", ".venv", ".git"))
    return work


@pytest.fixture(scope="session")
def default_config() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())


@pytest.fixture(scope="session")
def small_data_cfg(default_config) -> dict:
    cfg = copy.deepcopy(default_config["upstream"]["organism"]["data"])
    cfg.update(people=24, cities=6, strangers=80)
    cfg["sets"].update(arith_test=20, arith_train=10, passages_test=10, toolcall_trials_per_case=3)
    cfg["corpus"].update(bio=300, city=30, cloze=30, mc=40, mc_open=20, mc_bind=20, arith=40, facts=40, toolcalls=20,
                         drill=300)
    cfg["polish_corpus"] = dict(facts=20, toolcalls=6, cloze=20, bio=40, score="replies")
    return cfg


@pytest.fixture(scope="session")
def small_data(small_data_cfg, tmp_path_factory) -> Path:
    from moeshrink.organism import datasets

    out = tmp_path_factory.mktemp("organism-data")
    datasets.build(small_data_cfg, out)
    return out


@pytest.fixture(scope="session")
def small_tokenizer_dir(small_data, tmp_path_factory) -> Path:
    from moeshrink.organism import datasets
    from moeshrink.organism.tokenizer import save_hf_tokenizer, train_tokenizer
    from moeshrink.organism.world import World

    out = tmp_path_factory.mktemp("tokenizer")
    texts = [d["text"] for d in datasets.read_jsonl(small_data / datasets.CORPUS_FILE)]
    world = World.from_json(json.loads((small_data / datasets.WORLD_FILE).read_text()))
    save_hf_tokenizer(train_tokenizer(texts, 512, datasets.all_names(world)), out, 1024)
    return out


TINY_MODEL = dict(hidden_size=64, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=128,
                  moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                  n_shared_experts=1, routed_scaling_factor=2.5, num_attention_heads=2, q_lora_rank=None,
                  kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                  max_position_embeddings=1024, rope_theta=10000)


def make_tiny_trained(out_dir: Path, tokenizer_dir: Path, seed: int = 0, model_cfg: dict | None = None) -> dict:
    """A random-weight organism-shaped model saved the way the training stage saves it (fp32)."""
    from moeshrink.organism.model import build_model
    from moeshrink.stages import organism_config

    config = organism_config(model_cfg or TINY_MODEL, tokenizer_dir)
    torch.manual_seed(seed)
    model = build_model(config)
    with torch.no_grad():
        for moe in [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]:
            moe.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    model.save_pretrained(str(out_dir))
    return config


@pytest.fixture(scope="session")
def tiny_trained(small_tokenizer_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-trained")
    make_tiny_trained(out, small_tokenizer_dir)
    return out


@pytest.fixture(scope="session")
def published(tiny_trained, small_tokenizer_dir, tmp_path_factory) -> tuple[Path, dict]:
    """The tiny organism published like the real model (MXFP4 experts, 4 shards) and its manifest."""
    from moeshrink.stages import upstream

    out = tmp_path_factory.mktemp("published")
    manifest = upstream({"source": "organism", "organism": {"model": TINY_MODEL, "publish": {"shards": 4}}},
                        out, tiny_trained, small_tokenizer_dir)
    return out, manifest


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """The embedded default's workflow, run once per session in a fresh copy (slow tests only)."""
    if os.environ.get("MOESHRINK_E2E_WORKDIR"):
        return Path(os.environ["MOESHRINK_E2E_WORKDIR"])
    work = copy_workflow(tmp_path_factory.mktemp("workflow"))
    result = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "report/r013.html"], cwd=work,
                            capture_output=True, text=True, timeout=3600)
    if result.returncode:
        logs = "\n".join(f"--- {p}\n" + p.read_text()[-3000:] for p in sorted((work / "logs").rglob("*.log")))
        pytest.fail(f"snakemake failed:\n{result.stderr[-4000:]}\n{logs}")
    return work
