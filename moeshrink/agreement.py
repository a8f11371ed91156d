"""Next-token agreement between two served builds: greedy (top-1) match and KL divergence per
prompt position, from whole-vocabulary prompt log-probabilities (servers started with
`--max-logprobs -1`; practical for small vocabularies such as the organism's)."""
from __future__ import annotations

import math

import torch

from moeshrink.errors import MoeshrinkError
from moeshrink.vllm_server import ServerClient


class AgreementError(MoeshrinkError, RuntimeError):
    pass


def prompt_logprobs(server: ServerClient, model: str, prompt_ids: list[int], vocab_size: int) -> torch.Tensor:
    """[len(prompt) - 1, vocab] log-probabilities of the next token at every prompt position."""
    status, reply = server.post("/v1/completions", {"model": model, "prompt": prompt_ids, "max_tokens": 1,
                                                    "temperature": 0, "prompt_logprobs": -1})
    if status != 200:
        raise AgreementError(f"{server.base_url}: prompt_logprobs request failed ({status}): {str(reply)[:300]}")
    return logprob_table(reply["choices"][0]["prompt_logprobs"][1:], vocab_size)


def logprob_table(positions: list[dict], vocab_size: int) -> torch.Tensor:
    """vLLM's prompt_logprobs entries (token id -> {logprob, rank}) as a [positions, vocab] table."""
    table = torch.full((len(positions), vocab_size), -math.inf, dtype=torch.float64)
    for row, entries in enumerate(positions):
        for token, entry in entries.items():
            table[row, int(token)] = entry["logprob"]
    return table


def compare(reference: torch.Tensor, candidate: torch.Tensor) -> dict:
    """Greedy agreement and mean KL(reference || candidate) over positions."""
    if reference.shape != candidate.shape:
        raise AgreementError(f"log-probability tables differ in shape: {tuple(reference.shape)} vs "
                             f"{tuple(candidate.shape)}")
    p = reference.exp()
    both = torch.isfinite(reference) & torch.isfinite(candidate)
    kl = torch.where(both, p * (reference - candidate), torch.zeros_like(p)).sum(-1)
    return {"positions": int(reference.shape[0]),
            "greedy_agreement": float((reference.argmax(-1) == candidate.argmax(-1)).double().mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}
