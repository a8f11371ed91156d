"""The wire format of moeshrink's prompt log-probabilities endpoint (`prompt_logprobs.py`, in vLLM's API
server), shared by the server and the agreement eval's client: per prompt position the entries vLLM lists
there in its own order (the prompt's next token, then the top K by rank), as base64 arrays: `offsets` (int32,
positions + 1; the first position has none), `token_ids` (int32) and `logprobs` (float32, vLLM's own values;
-inf as vLLM's JSON endpoints write it, -9999.0). Imports neither vLLM nor torch.
"""
from __future__ import annotations

import base64
from typing import Any

import numpy as np

from moeshrink.core.errors import MoeshrinkError

PATH = "/inference/v1/moeshrink/prompt_logprobs"
NONFINITE_MESSAGE = "prompt log-probabilities hold a NaN or +inf value"
JSON_NEG_INF = -9999.0  # what vLLM's JSON endpoints write for a log-probability of -inf


class WireError(MoeshrinkError, ValueError):
    pass


def _b64(array: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode("ascii")


def encode(offsets: np.ndarray, token_ids: np.ndarray, logprobs: np.ndarray, prompt_tokens: int,
           completion_tokens: int) -> dict[str, Any]:
    return {"offsets": _b64(offsets, "<i4"), "token_ids": _b64(token_ids, "<i4"), "logprobs": _b64(logprobs, "<f4"),
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}


def decode(reply: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A reply's offsets, token ids and log-probabilities (float64), checked for shape."""
    try:
        offsets, token_ids = (np.frombuffer(base64.b64decode(reply[k]), dtype="<i4").astype(np.int64)
                              for k in ("offsets", "token_ids"))
        logprobs = np.frombuffer(base64.b64decode(reply["logprobs"]), dtype="<f4").astype(np.float64)
    except (KeyError, TypeError, ValueError) as error:
        raise WireError(f"not a prompt_logprobs reply ({type(error).__name__}: {error})") from None
    if (len(token_ids) != len(logprobs) or not len(offsets) or offsets[0] != 0 or offsets[-1] != len(token_ids)
            or (np.diff(offsets) < 0).any()):
        raise WireError(f"a prompt_logprobs reply's offsets ({len(offsets)}) do not fit its {len(token_ids)} "
                        f"token ids and {len(logprobs)} log-probabilities")
    return offsets, token_ids, logprobs
