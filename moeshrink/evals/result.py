"""What every eval writes: `results/evals/{build}/{eval}.json` (headline figures with their
uncertainty, the eval's config subtree, the server's flags, versions, times, how many items) and
beside it the per-item records (JSONL) that paired statistics are computed from. Records are
written first; the JSON appears only once both are complete."""
from __future__ import annotations

from pathlib import Path

from moeshrink.core.ioutil import atomic_write_json, atomic_write_jsonl
from moeshrink.core.provenance import Provenance
from moeshrink.evals import finite
from moeshrink.serve.endpoint import Endpoint


def server_flags(endpoint: Endpoint) -> dict:
    record = endpoint.record
    return {"command": record.get("command"), "args": record.get("args"), "served_model_name": endpoint.model,
            "platform": record.get("platform"), "dtype": record.get("dtype"), "cpu_kind": record.get("cpu_kind"),
            "model_dir": record.get("model_dir"),
            "ready_at": record.get("ready_at"), "started_by": record.get("started_by")}


def write(out_json: Path, records_path: Path, records: list[dict], *, build: str, eval_id: str,
          prov: Provenance, endpoint: Endpoint, items: int, metrics: dict, **extra) -> dict:
    atomic_write_jsonl(records_path, records)
    result = {
        "build": build, "eval": eval_id, "items": items, "metrics": metrics, **extra,
        "nonfinite": finite.record(),
        "records": str(records_path), "record_count": len(records),
        "server": server_flags(endpoint),
        "config": prov.config_subtree, "provenance": prov.record(),
    }
    atomic_write_json(out_json, result)
    return result
