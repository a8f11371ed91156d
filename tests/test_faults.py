"""The fault matrix: each stage that reads a checkpoint, given one fault at a time, as a user runs it
(the CLI). Faults in the bytes of a checkpoint with a manifest (truncated shard, changed bytes) are
refused against the manifest (tests/test_bad_input.py); here the checkpoint was published with the fault
inside, so its manifest agrees with the bad bytes and the fault itself must be found. Each: exit code 2,
one line naming the file and the tensor, no traceback, nothing under the output's name (nor a temporary
folder), and once the fault is removed, a rerun writes the bytes a clean run writes."""
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeshrink import cli
from moeshrink.core.checkpoint import SCALE_COMPANION, build_manifest, index_of, write_manifest
from moeshrink.core.ioutil import sha256_file

EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
ATTENTION = "model.layers.0.self_attn.o_proj.weight"
ROUTER = "model.layers.2.mlp.gate.weight"
COMMANDS = {"twin": ["twin"], "prune": ["prune", "--keep-fraction", "0.5"], "quantize": ["quantize", "--format", "twx3"]}


def shard_of(folder: Path, tensor: str) -> str:
    return index_of(folder)["weight_map"][tensor]


def edit_shard(folder: Path, tensor: str, change: Callable[[dict[str, torch.Tensor]], None]) -> str:
    """Rewrite the shard holding `tensor` with `change` applied to its tensors; the shard's name."""
    shard = shard_of(folder, tensor)
    tensors = load_file(folder / shard)
    change(tensors)
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    return shard


def drop(name: str):
    return lambda tensors: tensors.pop(name)


def as_int8(name: str):
    def change(tensors):
        tensors[name] = tensors[name].view(torch.int8)
    return change


def one_row_short(name: str):
    def change(tensors):
        for key in (name, name + SCALE_COMPANION):
            tensors[key] = tensors[key][:-1].contiguous()
    return change


def nan_scale(name: str):
    def change(tensors):
        tensors[name + SCALE_COMPANION][0, 0] = 255  # E8M0's NaN
    return change


def nan_value(name: str):
    def change(tensors):
        tensors[name][0, 0] = float("nan")
    return change


# fault -> (tensor it is put in, how, what the message must say)
FAULTS = {
    "missing tensor": (ATTENTION, drop(ATTENTION),
                       f"tensor {ATTENTION}, which the index places in this shard, is not in it"),
    "expert of the wrong dtype": (EXPERT, as_int8(EXPERT), f"{EXPERT} is stored as I8"),
    "expert of the wrong shape": (EXPERT, one_row_short(EXPERT), f"{EXPERT} has shape [31, 32]; config.json"),
    "NaN in an expert (MXFP4 scale)": (EXPERT, nan_scale(EXPERT), f"{EXPERT}: scale byte 255 (NaN) found"),
    "NaN in a router weight": (ROUTER, nan_value(ROUTER), f"{ROUTER}: 1 of 1024 values are NaN or infinite"),
}
# which stage reads what the fault is in (router_sum reads routers, not experts; the twin and TWX read experts)
MATRIX = [(stage, fault) for stage in COMMANDS for fault in FAULTS
          if not (fault == "NaN in a router weight" and stage != "prune")
          and not (fault == "NaN in an expert (MXFP4 scale)" and stage == "prune")]


def republish(folder: Path) -> None:
    """A manifest over the folder as it is now: the checkpoint as its publisher shipped it, fault and all."""
    manifest = json.loads((folder / "manifest.json").read_text())
    write_manifest(folder, {**manifest, **build_manifest(folder, manifest["source"])})


def run(stage: str, source: Path, out: Path, capsys) -> tuple[int, str]:
    code = cli.main([COMMANDS[stage][0], "--input", str(source), "--output", str(out), *COMMANDS[stage][1:]])
    return code, capsys.readouterr().err


def written(out: Path) -> dict[str, str]:
    """What a run wrote, by name and sha256; its JSON records without their provenance (when, where, by whom),
    and the manifest without the digests of those records."""
    records = {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}
    stamped = {name for name, record in records.items() if isinstance(record, dict) and "provenance" in record}

    def digest(path: Path) -> str:
        if path.name not in stamped:
            return sha256_file(path)
        record = {k: v for k, v in records[path.name].items() if k != "provenance"}
        if "files" in record:
            record["files"] = [f for f in record["files"] if f["file"] not in stamped]
        return json.dumps(record, sort_keys=True)
    return {p.name: digest(p) for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """One folder for the module: every run reads `upstream` and writes `out` here, so that what a run records
    of its input (the upstream's path) is the same for a clean run and a rerun."""
    return tmp_path_factory.mktemp("faults")


def fresh_upstream(published, workspace: Path) -> Path:
    source = workspace / "upstream"
    if source.exists():
        shutil.rmtree(source)
    shutil.copytree(published[0], source)
    return source


@pytest.fixture(scope="module")
def clean(published, workspace) -> dict[str, dict[str, str]]:
    """Each stage's output from the published organism as it is."""
    outputs = {}
    for stage in COMMANDS:
        source = fresh_upstream(published, workspace)
        out = workspace / "out"
        assert cli.main([COMMANDS[stage][0], "--input", str(source), "--output", str(out), *COMMANDS[stage][1:]]) == 0
        outputs[stage] = written(out)
        shutil.rmtree(out)
    return outputs


@pytest.mark.parametrize("stage, fault", MATRIX, ids=[f"{s}: {f}" for s, f in MATRIX])
def test_a_fault_is_named_nothing_is_left_and_a_rerun_without_it_writes_the_clean_bytes(
        published, clean, workspace, capsys, stage, fault):
    source = fresh_upstream(published, workspace)
    tensor, change, said = FAULTS[fault]
    shard = edit_shard(source, tensor, change)
    republish(source)
    out = workspace / "out"
    code, err = run(stage, source, out, capsys)
    assert code == 2, err
    assert said in err and shard in err.split(said)[0] + said, err  # the tensor, and the shard it is in
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in workspace.iterdir()) == ["upstream"], "an output or a temporary folder was left"

    source = fresh_upstream(published, workspace)  # the fault removed
    code, err = run(stage, source, out, capsys)
    assert code == 0, err
    assert written(out) == clean[stage]
    shutil.rmtree(out)


def test_an_upstream_folder_missing_a_tensor_the_index_names_is_refused_before_it_is_placed(published, tmp_path):
    """A path (or hub) source is checked against its own index before anything is linked or hashed."""
    from moeshrink.core.checkpoint import CheckpointError
    from moeshrink.stages import upstream

    folder, _ = published
    source = tmp_path / "source"
    shutil.copytree(folder, source)
    (source / "manifest.json").unlink()
    shard = edit_shard(source, ATTENTION, drop(ATTENTION))
    with pytest.raises(CheckpointError, match=f"{shard}: tensor {ATTENTION}, which the index places in this shard"):
        upstream({"source": "path", "path": {"dir": str(source), "mode": "link"}}, tmp_path / "up")
    assert not (tmp_path / "up/manifest.json").exists()


def test_the_upstream_command_leaves_an_earlier_upstream_whole_when_its_source_is_broken(published, tmp_path, capsys):
    """`moeshrink upstream` writes beside its target and renames on success: a failure names the shard and
    the tensor, and the upstream an earlier run placed is still there, byte for byte."""
    folder, _ = published
    source = tmp_path / "source"
    shutil.copytree(folder, source)
    (source / "manifest.json").unlink()
    config = tmp_path / "path.yaml"
    config.write_text(f"upstream:\n  source: path\n  path: {{dir: {source}, mode: copy}}\n"
                      "evals:\n  mmlu: {dataset: lm_eval}\n  gsm8k: {dataset: lm_eval}\n")
    results = tmp_path / "results"
    assert cli.main(["upstream", "--config", str(config), "--results", str(results)]) == 0, capsys.readouterr().err
    before = written(results / "upstream")
    shard = edit_shard(source, ATTENTION, drop(ATTENTION))
    assert cli.main(["upstream", "--config", str(config), "--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert f"{shard}: tensor {ATTENTION}, which the index places in this shard" in err and "Traceback" not in err
    assert written(results / "upstream") == before
    assert sorted(p.name for p in results.iterdir()) == ["upstream"]
