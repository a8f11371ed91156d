"""The fault matrix: each stage that reads a checkpoint, given one fault at a time, as a user runs it
(the CLI). Faults in the bytes of a checkpoint with a manifest (truncated shard, changed bytes) are
refused against the manifest (tests/test_bad_input.py); here the checkpoint was published with the fault
inside, so its manifest agrees with the bad bytes and the fault itself must be found. Each: exit code 2,
one line naming the file and the tensor, no traceback, nothing under the output's name (nor a temporary
folder), and once the fault is removed, a rerun writes the bytes a clean run writes."""
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
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


@pytest.mark.parametrize("stage", list(COMMANDS))
def test_a_full_disk_at_a_shard_write_is_named_nothing_is_left_and_a_rerun_writes_the_clean_bytes(
        published, clean, workspace, capsys, monkeypatch, stage):
    """Simulated at the write call, on the second shard a stage writes."""
    import errno

    from moeshrink.core import shardio

    real_write, shards_begun = shardio._Sink.write, []

    def full(sink, data):
        if sink not in shards_begun:
            shards_begun.append(sink)
        if len(shards_begun) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(sink, data)

    source = fresh_upstream(published, workspace)
    out = workspace / "out"
    monkeypatch.setattr(shardio._Sink, "write", full)
    code, err = run(stage, source, out, capsys)
    assert code == 2, err
    assert ".safetensors: not written (No space left on device)" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in workspace.iterdir()) == ["upstream"], "an output or a temporary folder was left"

    monkeypatch.undo()
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


# ---- the stages after the servers: evals' inputs, compare, summary, report ----------------------------------

def test_a_non_finite_figure_is_refused_where_it_is_written_naming_file_line_and_key(tmp_path):
    from moeshrink.core.ioutil import NonFiniteNumber, atomic_write_json, atomic_write_jsonl

    target = tmp_path / "mmlu.json"
    with pytest.raises(NonFiniteNumber, match=r"mmlu.json: metrics.accuracy.ci95\[1\] is nan, not a finite"):
        atomic_write_json(target, {"metrics": {"accuracy": {"value": 0.5, "ci95": [0.4, float("nan")]}}})
    records = tmp_path / "mmlu.jsonl"
    with pytest.raises(NonFiniteNumber, match=r"mmlu.jsonl, line 2: loglikelihoods\[0\] is -inf, not a finite"):
        atomic_write_jsonl(records, [{"id": "q1", "loglikelihoods": [-1.0]}, {"id": "q2", "loglikelihoods": [-math.inf]}])
    assert list(tmp_path.iterdir()) == [], "a file or a temporary name was left"


def test_a_non_finite_figure_is_refused_where_it_is_read_naming_file_line_and_key(tmp_path):
    from moeshrink.core.ioutil import NonFiniteNumber, read_json, read_jsonl

    (tmp_path / "memory.json").write_text('{"weights_gib": NaN, "kv_cache_gib": 1.0}\n')
    with pytest.raises(NonFiniteNumber, match=r"memory.json: weights_gib is NaN, not a finite number"):
        read_json(tmp_path / "memory.json")
    (tmp_path / "gsm8k.jsonl").write_text('{"id": "a", "x": [1.0]}\n\n{"id": "b", "x": [2.0, Infinity]}\n')
    with pytest.raises(NonFiniteNumber, match=r"gsm8k.jsonl, line 3: x\[1\] is Infinity, not a finite number"):
        read_jsonl(tmp_path / "gsm8k.jsonl")


def fake_reference(path: Path) -> None:
    from moeshrink.evals import agreement

    top_lp = np.log(np.full((5, 3), 1 / 3))
    top_lp[1, 2] = -np.inf  # a token the reply did not list: stored, not a fault
    agreement.save_reference(path, ["p0", "p1"], [[1, 2, 3], [4, 5, 6, 7]], np.zeros((5, 3), dtype=np.int64), top_lp,
                             np.zeros((0, 8)), 3)


@pytest.mark.parametrize("fault, said", [
    ("cut short", "not a whole agreement reference (BadZipFile"),
    ("NaN", "top_lp holds 1 NaN or +inf values, the first at passage p1"),
    ("lengths that do not fit", "7 token ids and 5 positions do not fit the 3 passages' lengths"),
])
def test_a_damaged_agreement_reference_is_named_before_a_build_is_served(tmp_path, fault, said):
    """Every other build's agreement eval reads the reference's stored log-probabilities before it leases its
    server: a damaged file is named, with the passage, instead of a zip error or a NaN KL."""
    from moeshrink.evals import EvalError, agreement

    path = tmp_path / "agreement_reference.npz"
    fake_reference(path)
    assert agreement.load_reference(path)["passage_ids"] == ["p0", "p1"]
    if fault == "cut short":
        path.write_bytes(path.read_bytes()[:200])
    else:
        arrays = dict(np.load(path))
        if fault == "NaN":
            arrays["top_lp"][3, 0] = np.nan
        else:
            arrays["lengths"] = np.array([3, 2, 2])
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    with pytest.raises(EvalError, match=re.escape(said)):
        agreement.load_reference(path)


def cut_mid_line(line: int):
    """Keep the lines before `line` and half of it: a writer killed mid-line without the atomic rename."""
    def change(path: Path) -> None:
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(lines[:line - 1]) + lines[line - 1][: len(lines[line - 1]) // 2])
    return change


def cut_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def with_value(text: str, keys: tuple, value: float, indent: int | None) -> str:
    """`text`'s JSON with `value` (NaN, inf) at `keys`, as a writer without the finite check would write it."""
    record = json.loads(text)
    inner = record
    for key in keys[:-1]:
        inner = inner[key]
    inner[keys[-1]] = value
    return json.dumps(record, indent=indent)


def set_json(keys: tuple, value: float):
    def change(path: Path) -> None:
        path.write_text(with_value(path.read_text(), keys, value, indent=2))
    return change


def set_record(line: int, keys: tuple, value: float):
    def change(path: Path) -> None:
        lines = path.read_text().splitlines()
        lines[line - 1] = with_value(lines[line - 1], keys, value, indent=None)
        path.write_text("\n".join(lines) + "\n")
    return change


def drop_line(line: int):
    def change(path: Path) -> None:
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(lines[:line - 1] + lines[line:]))
    return change


def nan_in_reference(path: Path) -> None:
    arrays = dict(np.load(path))
    arrays["top_lp"][100, 0] = np.nan
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


BUILD = "twx3"
# (stage, fault) -> (the file it is put in, under results/<run>/, how, what the error must say). The stage
# reads its inputs as its rule's job does (the same functions, the same input lists).
STAGE_FAULTS = {
    ("compare", "eval record file cut mid-line"): (
        f"evals/{BUILD}/mmlu.jsonl", cut_mid_line(4), "mmlu.jsonl, line 4: not JSON"),
    ("compare", "NaN in an eval's figure"): (
        f"evals/{BUILD}/facts.json", set_json(("metrics", "made_up", "value"), math.nan),
        "facts.json: metrics.made_up.value is NaN, not a finite number"),
    ("compare", "-Infinity in an item's record"): (
        f"evals/{BUILD}/mmlu.jsonl", set_record(2, ("loglikelihoods", 1), -math.inf),
        "mmlu.jsonl, line 2: loglikelihoods[1] is -Infinity"),
    ("compare", "an item missing from one side"): (
        f"evals/{BUILD}/gsm8k.jsonl", drop_line(1),
        f"gsm8k: original and {BUILD} did not read the same items (only original: ['arith-0']"),
    ("compare_summary", "NaN in a measured memory figure"): (
        f"serve/{BUILD}/memory.json", set_json(("weights_gib",), math.nan), "memory.json: weights_gib is NaN"),
    ("compare_summary", "a comparison cut short"): (f"compare/{BUILD}.json", cut_half, f"{BUILD}.json: not JSON"),
    ("report", "Infinity in the summary"): (
        "compare/summary.json", set_json(("builds", BUILD, "mean_kl"), math.inf),
        f"summary.json: builds.{BUILD}.mean_kl is Infinity"),
    ("report", "an eval result cut short"): ("evals/original/toolcalls.json", cut_half, "toolcalls.json: not JSON"),
    ("eval agreement", "the reference's log-probabilities cut short"): (
        "evals/original/agreement_reference.npz", cut_half, "not a whole agreement reference"),
    ("eval agreement", "NaN in the reference's log-probabilities"): (
        "evals/original/agreement_reference.npz", nan_in_reference,
        "top_lp holds 1 NaN or +inf values, the first at passage"),
    ("eval facts", "eval set cut mid-line"): (
        "organism/data/passages_test.jsonl", cut_mid_line(3), "passages_test.jsonl, line 3: not JSON"),
    ("eval toolcalls", "tools file cut short"): ("organism/data/tools.json", cut_half, "tools.json: not JSON"),
}


def run_stage(stage: str, work: Path, config: dict, out: Path) -> Path | None:
    """Run `stage` on the finished workflow in `work` as its job does, writing under `out`; its output file."""
    from moeshrink.compare import inputs as compare_inputs
    from moeshrink.compare import paired, summary
    from moeshrink.core.layout import results_dir
    from moeshrink.core.rule_params import report_params
    from moeshrink.evals import agreement, sets
    from moeshrink.organism import datasets
    from moeshrink.report import render
    from moeshrink.report.report_inputs import input_files

    results = work / results_dir(config)
    reference, others = config["reference_build"], [b for b in config["builds"] if b != config["reference_build"]]
    if stage == "compare":
        inputs = {key: work / path for key, path in compare_inputs.against_reference(config, BUILD).items()}
        judging = {key: config["compare"][key] for key in ("pass_mark_points", "pass_on")}
        paired.run(inputs, reference, BUILD, judging, out / "compare.json", against_reference=True)
        return out / "compare.json"
    if stage == "compare_summary":
        summary.run({b: results / f"compare/{b}.json" for b in others},
                    {b: results / f"serve/{b}/memory.json" for b in config["builds"]}, reference,
                    out / "summary.json", config["compare"]["size_limits_gib"])
        return out / "summary.json"
    if stage == "report":
        render.render({key: work / path for key, path in input_files(config).items()}, report_params(config),
                      out / "r013.html", benchmark_dir=work / "benchmarks" / config["run"])
        return out / "r013.html"
    if stage == "eval agreement":  # what an agreement job reads before it leases its build's server
        agreement.load_reference(results / "evals/original/agreement_reference.npz")
    elif stage == "eval facts":
        sets.read_set(results / "organism/data" / datasets.PASSAGES_TEST, "facts")
    elif stage == "eval toolcalls":
        sets.read_tools(results / "organism/data" / datasets.TOOLS_FILE)
    return None


def without_provenance(path: Path) -> object:
    if path.suffix == ".json":
        return {k: v for k, v in json.loads(path.read_text()).items() if k != "provenance"}
    return re.sub(r"\d{4}-\d\d-\d\dT[\d:.+-]+", "<when>", path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("stage, fault", list(STAGE_FAULTS), ids=[f"{s}: {f}" for s, f in STAGE_FAULTS])
def test_a_fault_after_the_servers_is_named_nothing_is_left_and_a_rerun_without_it_matches(
        workdir, tmp_path, stage, fault):
    from moeshrink.core.config import load
    from moeshrink.core.errors import MoeshrinkError
    from moeshrink.core.layout import results_dir

    config = load(workdir / "config.yaml")
    work = tmp_path / "work"
    shutil.copytree(workdir / results_dir(config), work / results_dir(config), symlinks=True,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.pt", "leases", "*.log"))
    if (workdir / "benchmarks").exists():
        shutil.copytree(workdir / "benchmarks", work / "benchmarks")
    relative, damage, said = STAGE_FAULTS[(stage, fault)]
    target = work / results_dir(config) / relative
    pristine = target.read_bytes()

    clean_out = tmp_path / "clean"
    clean = run_stage(stage, work, config, clean_out)
    damage(target)
    out = tmp_path / "out"
    with pytest.raises(MoeshrinkError) as raised:
        run_stage(stage, work, config, out)
    print(f"\n{stage} | {fault} | {raised.value}")
    assert said in str(raised.value) and relative.split("/")[-1] in str(raised.value)
    assert not out.exists() or list(out.iterdir()) == [], "an output or a temporary name was left"

    target.write_bytes(pristine)
    rerun = run_stage(stage, work, config, out)
    if clean:
        assert rerun and without_provenance(rerun) == without_provenance(clean)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["compare", "compare_summary", "report"])
def test_a_full_disk_at_a_stages_write_names_its_output_and_leaves_nothing(workdir, tmp_path, monkeypatch, stage):
    """Simulated at the write call: the job's error names its output file, and neither the file nor a
    temporary name stays."""
    import errno

    from moeshrink.core.config import load
    from moeshrink.core.ioutil import UnwritableFile

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    config = load(workdir / "config.yaml")
    monkeypatch.setattr(Path, "write_text", full)
    out = tmp_path / "out"
    with pytest.raises(UnwritableFile, match=r"(compare|summary).json: not written|r013.html: not written"):
        run_stage(stage, workdir, config, out)
    assert not out.exists() or list(out.iterdir()) == []
