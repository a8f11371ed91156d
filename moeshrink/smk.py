"""The glue every `scripts/*.py` entry point uses: log to the rule's log file, run the stage, and on
failure leave the traceback in the log (Snakemake then removes the rule's declared outputs)."""
from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from moeshrink.core.rule_params import operational


def serve_config(snakemake) -> dict:
    """The rule's serve params with the operational serve keys (timeouts) the config holds beside them."""
    return {**snakemake.params.serve, **operational(snakemake.config)["serve"]}


def server_lease(snakemake):
    """The job's lease on its build's server (started by the first job that needs it)."""
    from moeshrink.serve.server_lease import ServerLease, ServerSpec, queue_order

    build = snakemake.wildcards.build
    spec = ServerSpec(build=build, model_dir=Path(snakemake.input.manifest).parent, serve=dict(snakemake.params.serve),
                      operational=operational(snakemake.config)["serve"], prediction=Path(snakemake.input.prediction),
                      queue_order=queue_order(snakemake.config, build))
    wildcards = ", ".join(f"{name}={value}" for name, value in snakemake.wildcards.items())
    return ServerLease(spec, holder=f"{snakemake.rule} ({wildcards})")


def client_config(snakemake) -> dict:
    return operational(snakemake.config)["client"]


def run(snakemake, stage: Callable[[], object]) -> None:
    log_path = Path(snakemake.log[0]) if snakemake.log else None
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    log_file = None
    if log_path:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "w")
        handlers.append(logging.StreamHandler(log_file))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=handlers, force=True)
    redirect = contextlib.redirect_stdout(log_file) if log_file else contextlib.nullcontext()
    try:
        with redirect:
            stage()
    except Exception:
        logging.getLogger("moeshrink").exception("rule %s failed", snakemake.rule)
        raise
    finally:
        if log_file:
            log_file.flush()
