"""Config validation names the key at fault; the default and the presets validate and dry-run."""
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moeshrink.core.config import ConfigError, load, read_layers, validate

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "presets").glob("*.yaml"))


@pytest.fixture(scope="module")
def default_config() -> dict:
    return load(ROOT / "config.yaml")


def problems_of(config: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(config)
    return info.value.problems


@pytest.mark.parametrize("path", [ROOT / "config.yaml", *PRESETS], ids=lambda p: p.name)
def test_default_and_presets_validate(path):
    load(path, base=ROOT / "config.yaml")


def test_a_preset_is_laid_over_the_default_and_names_only_what_differs():
    """config.yaml is the one default: a preset's own keys are a minority of the study's, and none of
    them restates the value config.yaml already has."""
    def leaves(node, path=()):
        for key, value in node.items():
            yield from leaves(value, (*path, key)) if isinstance(value, dict) and value else [((*path, key), value)]

    default = dict(leaves(yaml.safe_load((ROOT / "config.yaml").read_text())))
    for preset in PRESETS:
        own = dict(leaves(yaml.safe_load(preset.read_text())))
        study = dict(leaves(read_layers(ROOT / "config.yaml", preset)))
        assert len(own) < len(study) / 2, preset.name
        assert [key for key, value in own.items() if default.get(key, object()) == value] == [], preset.name
        named = [b for b, spec in load(preset, base=ROOT / "config.yaml")["builds"].items() if "sweep" not in spec]
        assert named == list(default_builds())  # a preset adds builds through sweeps only


def test_the_embedded_study_scores_knowledge_in_cloze_form_and_the_presets_by_letter():
    """The organism answers in the form it was taught (cloze); real models keep R-013's protocol."""
    assert load()["evals"]["mmlu"]["form"] == "cloze"
    for preset in PRESETS:
        config = load(preset, base=ROOT / "config.yaml")
        mmlu = config["evals"]["mmlu"]
        if config["upstream"]["source"] == "organism":  # the organism's own presets (a sweep) ask it as taught
            assert (mmlu["form"], mmlu["shots"]) == ("cloze", 0), preset.name
        else:
            assert (mmlu["form"], mmlu["shots"]) == ("letter", 5), preset.name


def default_builds():
    return yaml.safe_load((ROOT / "config.yaml").read_text())["builds"].keys()


def test_wrong_type_names_the_key_path(default_config):
    config = copy.deepcopy(default_config)
    config["upstream"]["organism"]["train"]["steps"] = "many"
    assert problems_of(config) == ["upstream.organism.train.steps: 'many' is not of type 'integer'"]


def test_unknown_key_names_the_key_and_what_is_allowed(default_config):
    config = copy.deepcopy(default_config)
    config["builds"]["twx3"]["quantise"] = {"format": "twx3"}
    [problem] = problems_of(config)
    assert problem.startswith("builds.twx3.quantise: unknown key (allowed: evals, label, prune, quantize, sweep)")


def test_missing_field_names_the_key(default_config):
    config = copy.deepcopy(default_config)
    del config["builds"]["pruned75"]["prune"]["keep_fraction"]
    assert problems_of(config) == ["builds.pruned75.prune.keep_fraction: missing (required)"]


def test_a_build_named_like_the_summary_is_refused(default_config):
    config = copy.deepcopy(default_config)
    config["builds"]["summary"] = config["builds"].pop("twx3")
    config["compare"]["pairs"] = []
    assert problems_of(config) == ["builds.summary: the name is taken by results/<run>/compare/summary.json; "
                                   "rename the build"]


def test_out_of_range_and_bad_enum(default_config):
    config = copy.deepcopy(default_config)
    config["builds"]["pruned75"]["prune"]["keep_fraction"] = 1.5
    problems = problems_of(config)
    assert any(p.startswith("builds.pruned75.prune.keep_fraction: 1.5 is greater than the maximum") for p in problems)


@pytest.mark.parametrize("quantize,problem", [
    ({"format": "twx2"}, "builds.twx2_5.quantize.format: 'twx2' is unknown; known: twx3, twx2.5, twx3-v2, twx2.5-v2"),
    ({"format": "twx3", "max_bits_per_weight": 3.0},
     "builds.twx2_5.quantize.max_bits_per_weight: twx3 stores at least 3.25 bits per weight, more than 3"),
    ({"format": "twx2.5", "max_bits_per_weight": 4.0},
     "builds.twx2_5.quantize.max_bits_per_weight: twx2.5 stores at most 3.25 bits per weight"),
    ({"format": "twx3", "calibration": {"file": None, "sequences": 4, "seq_len": 64}},
     "builds.twx2_5.quantize.calibration: twx3 has one code width and an encoder that weighs no error"),
    ({"format": "twx3-v2", "calibration": {"file": None, "sequences": 4, "seq_len": 64}, "output_aware": ["allocation"]},
     "builds.twx2_5.quantize.output_aware: twx3-v2 cannot take 'allocation' from calibration text (it can: encoder)"),
    ({"format": "twx2.5", "calibration": {"file": None, "sequences": 4, "seq_len": 64}, "output_aware": ["encoder"]},
     "builds.twx2_5.quantize.output_aware: twx2.5 cannot take 'encoder' from calibration text (it can: allocation)"),
    ({"format": "twx2.5-v2", "output_aware": ["encoder"]},
     "builds.twx2_5.quantize.output_aware: needs builds.twx2_5.quantize.calibration"),
    ({"format": "twx2.5-v2", "calibration": {"file": None, "sequences": 4, "seq_len": 64}, "output_aware": ["weights"]},
     "builds.twx2_5.quantize.output_aware.0: 'weights' is not one of"),
    ({"format": "twx2.5", "calibration": {"file": None, "sequences": 0, "seq_len": 64}},
     "builds.twx2_5.quantize.calibration.sequences: 0 is less than the minimum of 1"),
])
def test_an_expert_format_and_budget_the_registry_cannot_keep(default_config, quantize, problem):
    config = copy.deepcopy(default_config)
    config["builds"]["twx2_5"]["quantize"] = quantize
    assert any(p.startswith(problem) for p in problems_of(config)), problems_of(config)


def test_build_ids_must_be_plain_identifiers(default_config):
    config = copy.deepcopy(default_config)
    config["builds"]["TWX-3"] = {"label": "x"}
    assert any("'TWX-3' is not a plain identifier" in p for p in problems_of(config))


@pytest.mark.parametrize("name", ["../organism", "a/b", "", ".hidden"])
def test_a_run_name_is_one_plain_folder_name(default_config, name):
    config = copy.deepcopy(default_config)
    config["run"] = name
    assert [p for p in problems_of(config) if p.startswith("run: ")], problems_of(config)


def test_studies_have_folders_of_their_own(default_config):
    from moeshrink.core.layout import benchmarks_dir, report_file, results_dir
    from moeshrink.report.report_inputs import input_files

    presets = {path.name: load(path) for path in PRESETS}
    runs = {default_config["run"], *(config["run"] for config in presets.values())}
    assert default_config["run"] == "organism" and len(runs) == 1 + len(presets)
    for config in [default_config, *presets.values()]:
        folders = {results_dir(config), benchmarks_dir(config), report_file(config).parent}
        assert all(folder.parts[1] == config["run"] for folder in folders)
        assert all(Path(path).parts[:2] == ("results", config["run"]) for path in input_files(config).values())


def test_cross_field_rules(default_config):
    config = copy.deepcopy(default_config)
    config["reference_build"] = "nope"
    config["evals"]["gsm8k"]["builds"] = ["original", "ghost"]
    config["upstream"]["organism"]["model"]["n_group"] = 7
    config["compare"]["pairs"] = [["twx3", "twx4"], ["twx3", "twx3"]]
    problems = problems_of(config)
    assert any(p.startswith("compare.pairs[0]: 'twx4' is not a build") for p in problems)
    assert any(p.startswith("compare.pairs[1]: a build compared with itself") for p in problems)
    config = copy.deepcopy(default_config)
    config["compare"]["pass_on"] = "median"
    assert problems_of(config)[0].startswith("compare.pass_on: 'median' is not one of")
    assert any(p.startswith("reference_build: 'nope' is not a build") for p in problems)
    assert any(p.startswith("evals.gsm8k.builds: 'ghost' is not a build") for p in problems)
    assert any(p.startswith("upstream.organism.model.n_group: 7 does not divide") for p in problems)
    config = copy.deepcopy(default_config)
    config["upstream"]["organism"]["train"]["polish"] = {"steps": 10, "lr": 1e-4}
    config["upstream"]["organism"]["data"]["polish_corpus"] = {"score": "replies"}
    assert problems_of(config) == ["upstream.organism.data.polish_corpus: names no documents, but "
                                   "upstream.organism.train.polish trains on them"]


def test_hf_source_needs_a_pinned_commit():
    config = read_layers(ROOT / "config.yaml", ROOT / "presets/kimi-k3.1-pro.yaml")
    config["upstream"]["hf"]["revision"] = "main"
    assert problems_of(config) == ["upstream.hf.revision: must pin a 40-hex-digit commit hash, got 'main'"]
    del config["upstream"]["hf"]
    assert problems_of(config) == ["upstream.hf: missing (required when upstream.source is hf)"]


def test_eval_sets_need_the_fictional_world_and_logprob_limits_are_named(default_config):
    config = read_layers(ROOT / "config.yaml", ROOT / "presets/kimi-k3.1-pro.yaml")
    del config["upstream"]["organism"]
    assert problems_of(config) == ["upstream.organism.data: the facts, toolcalls, agreement eval sets come from the "
                                   "organism's world generator; give its data section (or an agreement file)"]
    config = copy.deepcopy(default_config)
    del config["upstream"]["organism"]["train"]
    assert problems_of(config) == ["upstream.organism.train: required when upstream.source is organism"]
    config = copy.deepcopy(default_config)
    config["evals"]["toolcalls"]["efforts"] = ["enormous"]
    config["evals"]["client"]["concurrency"] = 0
    problems = problems_of(config)
    assert any(p.startswith("evals.toolcalls.efforts.0: 'enormous' is not one of") for p in problems)
    assert any(p.startswith("evals.client.concurrency: 0 is less than the minimum of 1") for p in problems)
    config = copy.deepcopy(default_config)
    config["serve"]["max_logprobs"] = 5
    problems = problems_of(config)
    top_k = config["evals"]["agreement"]["top_k"]
    assert f"evals.agreement.top_k: {top_k} is more than the server returns (serve.max_logprobs 5)" in problems
    assert ("evals.agreement.exact_check_passages: needs whole-vocabulary log-probabilities (serve.max_logprobs -1, "
            "not 5)") in problems


def snakemake_dry_run(*args: str, cwd: Path = ROOT,
                      target: str = "report/organism/r013.html") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", target, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("preset", [None, *PRESETS], ids=lambda p: p.name if p else "config.yaml")
def test_dry_run_resolves(preset):
    """Every job of the study resolves, also in a checkout where the main command has already run."""
    result = snakemake_dry_run("--forceall", *(["--configfile", str(preset)] if preset else []),
                               target="report/r013.html")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "upstream" in result.stdout and "report" in result.stdout


def test_snakemake_refuses_a_bad_config_before_any_job(tmp_path):
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["builds"]["twx3"]["label"] = 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    result = snakemake_dry_run("--configfile", str(bad))
    assert result.returncode != 0
    assert "builds.twx3.label: 3 is not of type 'string'" in result.stdout + result.stderr


def test_validation_fills_the_schema_defaults_and_nothing_else(default_config):
    config = copy.deepcopy(default_config)
    for key in ("startup_timeout_s", "stop_timeout_s", "max_logprobs", "block_size", "chat_template"):
        config["serve"].pop(key, None)
    config["evals"].pop("agreement")  # it needs more log-probabilities than the default 20
    config["upstream"]["organism"]["train"].pop("shipped")
    filled = validate(config)
    assert filled is config
    assert {k: config["serve"][k] for k in ("startup_timeout_s", "stop_timeout_s", "max_logprobs", "block_size",
                                             "chat_template")} == {"startup_timeout_s": 1800, "stop_timeout_s": 30,
                                                                   "max_logprobs": 20, "block_size": None,
                                                                   "chat_template": None}
    assert config["upstream"]["organism"]["train"]["shipped"] == "organism/shipped"
    raw = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert validate(copy.deepcopy(raw)) == raw  # the embedded default says every key: nothing added


def schema_defaults(node, found=None) -> set[str]:
    found = set() if found is None else found
    if isinstance(node, dict):
        for name, sub in node.get("properties", {}).items():
            if isinstance(sub, dict) and "default" in sub:
                found.add(name)
        for value in node.values():
            schema_defaults(value, found)
    elif isinstance(node, list):
        for value in node:
            schema_defaults(value, found)
    return found


def test_no_module_or_rule_keeps_a_second_default_for_a_schema_key():
    root = Path(__file__).resolve().parent.parent
    names = schema_defaults(yaml.safe_load((root / "moeshrink/core/config.schema.yaml").read_text()))
    assert {"startup_timeout_s", "stop_timeout_s", "max_logprobs"} <= names
    sources = [*root.glob("moeshrink/**/*.py"), *root.glob("rules/*.smk"), *root.glob("scripts/*.py"), root / "Snakefile"]
    offenders = [f"{path.relative_to(root)}: .get({name!r}, ...)" for path in sources for name in names
                 if re.search(rf"""\.get\(["']{name}["'],""", path.read_text())]
    assert not offenders, offenders


def test_a_v2_build_reads_the_encoder_tables_its_run_writes_once():
    """TWX v2's encoder table: one job per code width for the whole run, an input of every plan and shard
    job of a v2 build at the widths its format uses, and of no v1 build's."""
    result = snakemake_dry_run("--forceall", "--configfile", str(ROOT / "bench" / "twx_v2_builds.yaml"),
                               target="report/r013.html")
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(re.findall(r"rule encoder_table:", result.stdout)) == 2
    tables = {"twx3_v2": {"twx_vq-3bit"}, "twx2_5_v2": {"twx_vq-2bit", "twx_vq-3bit"}, "twx3": set(), "twx2_5": set()}
    seen = set()
    for job in re.split(r"\n\s*\[[^\]]+\]\n", result.stdout):
        rule = re.search(r"rule (build_plan|build_shard):", job)
        output = re.search(r"output: results/organism/builds/(\w+)/", job)
        if rule and output and output[1] in tables:
            inputs = re.search(r"input: (.*)", job)[1]
            assert set(re.findall(r"formats/(twx_vq-\dbit)\.safetensors", inputs)) == tables[output[1]], job
            seen.add(output[1])
    assert seen == set(tables)


def test_a_build_whose_encoder_weighs_activations_has_them_measured_for_its_shards():
    """quantize.output_aware: encoder: the build's shard jobs read its activation importance, which one
    expert_importance job measures on its calibration text; another build's shard jobs read none. (A
    shard's name is known once the upstream exists, so the dry run names one.)"""
    shard = "model-00001-of-00004.safetensors"
    builds = ("twx3_v2_aw", "twx2_5_v2_aw", "twx3_v2", "twx2_5")
    result = snakemake_dry_run(*[f"results/organism/builds/{build}/{shard}" for build in builds[1:]], "--forceall",
                               "--configfile", str(ROOT / "bench" / "twx_v2_builds.yaml"),
                               str(ROOT / "bench" / "twx_v2_weighted_builds.yaml"),
                               target=f"results/organism/builds/{builds[0]}/{shard}")
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = re.split(r"\n\s*\[[^\]]+\]\n", result.stdout)
    measured = {re.search(r"output: (\S+)", job)[1]: re.search(r"input: (.*)", job)[1]
                for job in jobs if re.search(r"rule expert_importance:", job)}
    assert sorted(measured) == ["results/organism/importance/twx2_5_v2_aw.safetensors",
                                "results/organism/importance/twx3_v2_aw.safetensors"]
    assert all("organism/data/corpus.jsonl" in inputs for inputs in measured.values())
    read = {}
    for job in jobs:
        output = re.search(r"output: results/organism/builds/(\w+)/", job)
        if re.search(r"rule build_shard:", job) and output:
            read[output[1]] = re.findall(r"importance/(\w+)\.safetensors", re.search(r"input: (.*)", job)[1])
    assert read == {build: [build] if build.endswith("_aw") else [] for build in builds}


# ------------------------------------------------------------------------------------------- sweeps
def with_sweeps(default_config: dict, sweeps: dict) -> dict:
    config = copy.deepcopy(default_config)
    config["sweeps"] = sweeps
    return config


def test_a_sweep_adds_one_ordinary_build_per_grid_point_after_the_named_builds(default_config):
    config = validate(with_sweeps(default_config, {
        "v2": {"label": "TWX2.5 v2", "base": {"quantize": {"format": "twx2.5-v2"}},
               "grid": {"quantize.max_bits_per_weight": [2.25, 3.0]}},
        "cut": {"base": "pruned75", "grid": {"prune.method": ["router_sum"], "prune.keep_fraction": [0.75, 0.5]},
                "evals": ["mmlu"]}}))
    named = list(default_builds())
    assert list(config["builds"]) == [*named, "v2_2_25", "v2_3", "cut_router_sum_0_75", "cut_router_sum_0_5"]
    assert config["builds"]["v2_2_25"] == {"label": "TWX2.5 v2 (2.25 bits)", "evals": ["agreement", "mmlu"],
                                           "quantize": {"format": "twx2.5-v2", "max_bits_per_weight": 2.25},
                                           "sweep": "v2"}
    assert config["builds"]["cut_router_sum_0_5"]["label"] == "router_sum (method router_sum, keeps 50%)"
    assert config["builds"]["cut_router_sum_0_5"]["prune"] == {"method": "router_sum", "keep_fraction": 0.5}
    assert validate(copy.deepcopy(config)) == config  # expanding an expanded config adds nothing

    from moeshrink.core.rule_params import build_params
    from moeshrink.evals import eval_builds

    assert eval_builds(config, "gsm8k") == named and eval_builds(config, "facts") == named
    assert eval_builds(config, "mmlu") == list(config["builds"])
    assert "v2_3" in eval_builds(config, "agreement") and "cut_router_sum_0_5" not in eval_builds(config, "agreement")
    # what makes the checkpoint, not the sweep it came from: the same params as a named build of that spec
    twin = with_sweeps(default_config, {})
    twin["builds"]["named"] = {"label": "Named", "quantize": {"format": "twx2.5-v2", "max_bits_per_weight": 3.0}}
    assert build_params(config, "v2_3") == build_params(validate(twin), "named")


@pytest.mark.parametrize("sweep, problem", [
    ({"base": {"quantize": {"format": "twx2.5-v2"}}, "grid": {"quantize.max_bits_per_weight": [2.0]}},
     "sweeps.s.grid[s_2].quantize.max_bits_per_weight: twx2.5-v2 stores at least 2.25 bits per weight, more than 2"),
    ({"base": {"quantize": {"format": "twx2.5"}}, "grid": {"quantize.max_bits_per_weight": ["high"]}},
     "sweeps.s.grid[s_high].quantize.max_bits_per_weight: 'high' is not of type 'number'"),
    ({"base": "pruned75", "grid": {"prune.keep_fraction": [0.03]}},
     "sweeps.s.grid[s_0_03].prune.keep_fraction: 0.03 keeps 2 of 64 experts, but a layer needs at least top-k = 4"),
    ({"base": "pruned75", "grid": {"prune.keep_fraction": [0.0]}},
     "sweeps.s.grid[s_0].prune.keep_fraction: 0.0 is less than or equal to the minimum of 0"),
    ({"base": "ghost", "grid": {"prune.keep_fraction": [0.5]}},
     "sweeps.s.base: 'ghost' is not a build of builds (builds: original, pruned75, twx3, twx2_5)"),
    ({"base": "twx3", "grid": {"label.text": ["x"]}}, "sweeps.s.grid.label.text: not a key a build is made by"),
    ({"base": "twx3", "grid": {"bits": [3]}},
     "sweeps.s.grid: key 'bits' is not a build key as a dotted path (e.g. quantize.max_bits_per_weight, "
     "prune.keep_fraction)"),
    ({"base": "twx3", "grid": {"quantize.format.name": ["twx3"]}},
     "sweeps.s.grid.quantize.format.name: the base build's quantize.format is not a mapping"),
    ({"base": "twx3", "grid": {"quantize.format": ["twx3"]}, "evals": ["mmlu", "hellaswag"]},
     "sweeps.s.evals: 'hellaswag' not configured under evals (configured: mmlu, gsm8k, facts, toolcalls, agreement)"),
])
def test_a_grid_point_that_cannot_be_built_is_refused_naming_the_sweep_and_key(default_config, sweep, problem):
    problems = problems_of(with_sweeps(default_config, {"s": sweep}))
    assert any(p.startswith(problem) for p in problems), problems


def test_a_grid_point_named_like_a_build_is_refused(default_config):
    config = with_sweeps(default_config, {"twx2": {"base": {"quantize": {"format": "twx2.5"}},
                                                   "grid": {"quantize.max_bits_per_weight": [5]}}})
    assert problems_of(config) == ["sweeps.twx2.grid: the point 'twx2_5' collides with builds.twx2_5; rename the sweep"]
    config = with_sweeps(default_config, {
        "a": {"base": "twx3", "grid": {"quantize.format": ["x_y"]}},
        "a_x": {"base": "twx3", "grid": {"quantize.format": ["y"]}}})
    assert "sweeps.a_x.grid: the point 'a_x_y' collides with sweeps.a; rename the sweep" in problems_of(config)


def test_a_build_says_it_belongs_to_a_sweep_only_by_the_expansion(default_config):
    config = copy.deepcopy(default_config)
    config["builds"]["twx3"]["sweep"] = "mine"
    assert "builds.twx3.sweep: set by the expansion of sweeps, not by hand ('mine' is not a sweep)" in \
        problems_of(config)


def test_the_reference_runs_every_eval(default_config):
    config = copy.deepcopy(default_config)
    config["builds"]["original"]["evals"] = ["mmlu"]
    assert problems_of(config) == ["builds.original.evals: the reference runs every eval (every build is compared "
                                   "with it)"]


KIMI_SWEEP = [ROOT / "presets/kimi-k3.1-pro.yaml", ROOT / "presets/layers/kimi-k3.1-pro-sweep.yaml"]


def test_the_kimi_sweep_is_a_layer_over_its_preset_and_dry_runs():
    config = load(*KIMI_SWEEP)
    points = [b for b, spec in config["builds"].items() if "sweep" in spec]
    assert len(points) == 7 and config["run"] == "kimi-k3.1-pro-sweep"
    assert config["serve"]["tensor_parallel_size"] == 8 and config["evals"]["mmlu"]["form"] == "letter"
    result = snakemake_dry_run("--forceall", "--configfile", *map(str, KIMI_SWEEP),
                               target="report/kimi-k3.1-pro-sweep/r013.html")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "upstream" in result.stdout and "report" in result.stdout
