"""The organism's shipped checkpoint: trained once with the project's own recipe on the long budget,
committed with its training record, and published from instead of training on every run.

`upstream.organism.train.from: shipped` (the embedded default) places the checkpoint in
results/organism/trained/ after checking that it was made by this very recipe (data, tokenizer,
architecture, training settings), that the tokenizer built now is the one it was trained with,
and that its bytes are the recorded ones; `from: scratch` trains with the same recipe instead.
A shipped checkpoint is an input like any other upstream: the card still measures it every run.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.ioutil import atomic_path, atomic_write_json, read_json, sha256_file
from moeshrink.core.provenance import config_hash
from moeshrink.organism import TRAINER_REVISION

MODEL_FILE = "model.safetensors"
FILES = (MODEL_FILE, "config.json", "tokenizer.json", "train.json")
MAX_BYTES = 25 * 10**6
# train keys that change how a run is carried out, not what it learns from or how
OPERATIONAL_TRAIN_KEYS = ("from", "shipped", "threads", "log_every", "probe_every")


class ShippedError(MoeshrinkError, ValueError):
    pass


def recipe(organism_cfg: dict) -> dict:
    """What a trained organism is a function of: its world and corpus, tokenizer, architecture and
    training settings (not how many threads ran it or how often it logged), and the trainer's revision."""
    train = {k: v for k, v in organism_cfg["train"].items() if k not in OPERATIONAL_TRAIN_KEYS}
    return {"data": organism_cfg["data"], "tokenizer": organism_cfg["tokenizer"], "model": organism_cfg["model"],
            "train": train, "trainer": TRAINER_REVISION}


def first_phase_recipe(organism_cfg: dict) -> dict:
    """The recipe of the first training phase alone: what a checkpoint the polish starts from was made by."""
    whole = recipe(organism_cfg)
    data = {k: v for k, v in whole["data"].items() if k != "polish_corpus"}
    train = {k: v for k, v in whole["train"].items() if k != "polish"}
    return {**whole, "data": data, "train": train}


def _differences(ours: dict, theirs: dict, path: str = "upstream.organism") -> list[str]:
    keys = sorted(set(ours) | set(theirs))
    found = []
    for key in keys:
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _differences(a, b, f"{path}.{key}")
        elif a != b:
            found.append(f"{path}.{key} is {a!r} here, {b!r} in the shipped recipe")
    return found


def made_by(checkpoint_dir: Path, ours: dict) -> dict:
    """The checkpoint's training record, once its recipe is found to be `ours` (else a ShippedError naming
    the keys that differ)."""
    record = read_json(checkpoint_dir / "train.json")
    ours, theirs = dict(ours), dict(record["recipe"])
    trained_by = theirs.pop("trainer", 1)  # records from before the trainer had revisions: 1
    if trained_by != ours.pop("trainer"):
        raise ShippedError(f"{checkpoint_dir} was trained by revision {trained_by} of the trainer "
                           f"(moeshrink/organism/train.py), this is revision {TRAINER_REVISION}: set "
                           "upstream.organism.train.from: scratch to train with this one, or ship a checkpoint it made")
    differences = _differences(ours, theirs)
    if differences:
        raise ShippedError(f"{checkpoint_dir} was trained with another recipe: {'; '.join(differences[:5])}. Set "
                           "upstream.organism.train.from: scratch to train this one (about "
                           f"{record['train_seconds'] / 60:.0f} minutes on the machine that made the shipped one)")
    return record


def check_tokenizer(checkpoint_dir: Path, tokenizer_file: Path) -> None:
    if sha256_file(tokenizer_file) != sha256_file(checkpoint_dir / "tokenizer.json"):
        raise ShippedError(f"{tokenizer_file} differs from the tokenizer {checkpoint_dir} was trained with "
                           f"({checkpoint_dir / 'tokenizer.json'}): its token ids would not mean the same tokens")


def place(shipped_dir: Path, organism_cfg: dict, tokenizer_file: Path, out_dir: Path) -> dict:
    """Check the shipped checkpoint against this config and this run's tokenizer, then copy it where
    training would have written it. Returns its training record."""
    missing = [name for name in FILES if not (shipped_dir / name).exists()]
    if missing:
        raise ShippedError(f"{shipped_dir}: the shipped organism lacks {missing} (upstream.organism.train.shipped)")
    record = made_by(shipped_dir, recipe(organism_cfg))
    check_tokenizer(shipped_dir, tokenizer_file)
    if sha256_file(shipped_dir / MODEL_FILE) != record["model_sha256"]:
        raise ShippedError(f"{shipped_dir / MODEL_FILE}: sha256 differs from its training record's")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (MODEL_FILE, "config.json"):
        with atomic_path(out_dir / name) as tmp:
            shutil.copyfile(shipped_dir / name, tmp)
    return record


def ship(trained_dir: Path, tokenizer_file: Path, train_record: dict, organism_cfg: dict, shipped_dir: Path) -> dict:
    """Write the shipped folder from a finished training run (done once, by hand)."""
    import torch
    from safetensors.torch import load_file, save_file

    shipped_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(trained_dir / MODEL_FILE))  # as train.save_trained writes it: bf16, router bias fp32
    tensors = {name: t if name.endswith("e_score_correction_bias") or not t.is_floating_point() else t.to(torch.bfloat16)
               for name, t in tensors.items()}
    save_file(tensors, str(shipped_dir / MODEL_FILE), metadata={"format": "pt"})
    if (shipped_dir / MODEL_FILE).stat().st_size > MAX_BYTES:
        raise ShippedError(f"{shipped_dir / MODEL_FILE}: over the {MAX_BYTES:,} bytes a shipped organism may take")
    for source, name in ((trained_dir / "config.json", "config.json"), (tokenizer_file, "tokenizer.json")):
        shutil.copyfile(source, shipped_dir / name)
    record = {**train_record, "recipe": recipe(organism_cfg), "recipe_sha256_16": config_hash(recipe(organism_cfg)),
              "model_sha256": sha256_file(shipped_dir / MODEL_FILE),
              "tokenizer_sha256": sha256_file(shipped_dir / "tokenizer.json")}
    atomic_write_json(shipped_dir / "train.json", record)
    return record


def describe(record: dict) -> dict:
    """What the card says about a shipped organism's training."""
    return {"from": "shipped", "recipe_sha256_16": record.get("recipe_sha256_16"),
            "train_seconds": record["train_seconds"], "steps": record["steps"], "tokens_seen": record["tokens_seen"],
            "host": record.get("provenance", {}).get("host"), "trained": record.get("provenance", {}).get("finished")}
