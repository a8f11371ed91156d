"""Next-token agreement between two served builds: greedy (top-1) match and KL divergence per
prompt position, from whole-vocabulary prompt log-probabilities (servers started with
`--max-logprobs -1`; practical for small vocabularies such as the organism's)."""
from __future__ import annotations

import numpy as np

from moeshrink.core.errors import MoeshrinkError
from moeshrink.serve.vllm_server import ServerClient


class AgreementError(MoeshrinkError, RuntimeError):
    pass


def prompt_logprobs(server: ServerClient, model: str, prompt_ids: list[int], vocab_size: int) -> np.ndarray:
    """[len(prompt) - 1, vocab] log-probabilities of the next token at every prompt position."""
    status, reply = server.post("/v1/completions", {"model": model, "prompt": prompt_ids, "max_tokens": 1,
                                                    "temperature": 0, "prompt_logprobs": -1})
    if status != 200:
        raise AgreementError(f"{server.base_url}: prompt_logprobs request failed ({status}): {str(reply)[:300]}")
    return logprob_table(reply["choices"][0]["prompt_logprobs"][1:], vocab_size)


def logprob_table(positions: list[dict], vocab_size: int) -> np.ndarray:
    """vLLM's prompt_logprobs entries (token id -> {logprob, rank}) as a [positions, vocab] float64 table."""
    table = np.full((len(positions), vocab_size), -np.inf, dtype=np.float64)
    for row, entries in enumerate(positions):
        for token, entry in entries.items():
            table[row, int(token)] = entry["logprob"]
    return table


def compare(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """Greedy agreement and mean KL(reference || candidate) over positions (tokens either side gives no
    probability are left out)."""
    if reference.shape != candidate.shape:
        raise AgreementError(f"log-probability tables differ in shape: {tuple(reference.shape)} vs "
                             f"{tuple(candidate.shape)}")
    both = np.isfinite(reference) & np.isfinite(candidate)
    terms = np.exp(reference, where=both, out=np.zeros_like(reference)) * \
        np.subtract(reference, candidate, where=both, out=np.zeros_like(reference))
    kl = terms.sum(-1)
    return {"positions": int(reference.shape[0]),
            "greedy_agreement": float((reference.argmax(-1) == candidate.argmax(-1)).mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}
