"""What reaches each rule's params: only keys that change its output, in an order-free form."""
import copy
from pathlib import Path

import yaml

from moeshrink.core.config import read_layers
from moeshrink.core.rule_params import (
    build_params,
    eval_params,
    operational,
    organism_card_params,
    organism_train_params,
    report_params,
    serve_params,
)

ROOT = Path(__file__).resolve().parent.parent


def _config() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def _reversed(value):
    if isinstance(value, dict):
        return {key: _reversed(value[key]) for key in reversed(list(value))}
    return value


def test_key_order_changes_no_params_repr():
    config, turned = _config(), _reversed(_config())
    turned["builds"] = {b: turned["builds"][b] for b in config["builds"]}
    for params in (serve_params, report_params, lambda c: build_params(c, "twx2_5"),
                   lambda c: eval_params(c, "toolcalls")):
        assert repr(params(config)) == repr(params(turned))


def test_operational_and_display_keys_stay_out():
    config = _config()
    assert "startup_timeout_s" not in serve_params(config) and "stop_timeout_s" not in serve_params(config)
    assert "label" not in build_params(config, "twx3")
    assert "builds" not in eval_params(config, "gsm8k")
    report = report_params(config)
    assert "cluster" not in report and "client" not in report["evals"]
    assert "startup_timeout_s" not in report["serve"]
    assert report["builds"]["twx3"]["label"] == config["builds"]["twx3"]["label"]  # the page shows labels
    lease_keys = ("startup_timeout_s", "stop_timeout_s", "idle_grace_s", "servers_per_machine")
    assert not set(lease_keys) & set(serve_params(config))
    assert operational(config) == {"serve": {key: config["serve"][key] for key in lease_keys},
                                   "client": config["evals"]["client"]}


def test_what_changes_an_output_still_changes_its_params():
    config = _config()
    changed = copy.deepcopy(config)
    changed["serve"]["max_model_len"] = 1024
    changed["builds"]["twx2_5"]["quantize"]["max_bits_per_weight"] = 2.6
    changed["evals"]["toolcalls"]["temperature"] = 0.0
    assert serve_params(changed) != serve_params(config)
    assert build_params(changed, "twx2_5") != build_params(config, "twx2_5")
    assert eval_params(changed, "toolcalls") != eval_params(config, "toolcalls")


def test_the_report_keeps_the_configured_order_of_builds():
    config = _config()
    assert list(report_params(config)["builds"]) == list(config["builds"])
    config["builds"] = dict(reversed(list(config["builds"].items())))
    assert list(report_params(config)["builds"]) == list(config["builds"])


def test_threads_reach_neither_the_organism_rules_nor_the_report():
    config = _config()
    fewer = copy.deepcopy(config)
    fewer["upstream"]["organism"]["train"]["threads"] = 1
    fewer["upstream"]["organism"]["card"]["threads"] = 1
    for params in (report_params, organism_train_params, organism_card_params):
        assert params(fewer) == params(config)
    assert "from" not in organism_train_params(config) and "steps" in organism_train_params(config)


def test_every_preset_has_report_params():
    for preset in sorted((ROOT / "presets").glob("*.yaml")):
        config = read_layers(ROOT / "config.yaml", preset)
        assert report_params(config)["builds"].keys() == config["builds"].keys(), preset.name


def test_what_calibration_decides_is_the_same_params_however_it_is_written():
    """A build's quantize.output_aware in another order, or left to the format, is the same build."""
    calibration = {"file": None, "sequences": 4, "seq_len": 64}

    def params(**quantize):
        return build_params({"builds": {"b": {"label": "b", "quantize": {"format": "twx2.5-v2", **quantize}}}}, "b")

    default = params(calibration=calibration)
    assert default["quantize"]["output_aware"] == ["allocation", "encoder"]
    assert repr(params(calibration=calibration, output_aware=["encoder", "allocation"])) == repr(default)
    assert params(calibration=calibration, output_aware=["encoder"]) != default
    assert "output_aware" not in params()["quantize"]
