"""Prompt log-probabilities as arrays: `POST /inference/v1/moeshrink/prompt_logprobs`, added to vLLM's API
server with `--middleware moeshrink_kernels.vllm.prompt_logprobs.PromptLogprobsEndpoint`.

The request is that of vLLM's token-in/token-out endpoint (`/inference/v1/generate`): `model`, `token_ids`
and `sampling_params.prompt_logprobs` (K, or -1 for the whole vocabulary); the reply is `logprobs_wire`'s.
vLLM's JSON endpoints build a Python object per listed token and encode it; at the top 400 of 300 passages
that was most of the API server's time (bench/README.md, "Where a served build's time goes"). Here the
engine keeps them flat (`SamplingParams.flat_logprobs`) and they leave as bytes.

A reply that would hold NaN or +inf is refused (HTTP 400, NONFINITE_MESSAGE), as vLLM's JSON endpoints
refuse to encode one. The endpoint sits behind vLLM's own API-key check. Imported by vLLM's API server only.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np

from moeshrink_kernels.vllm.logprobs_wire import JSON_NEG_INF, NONFINITE_MESSAGE, PATH, encode


class PromptLogprobsEndpoint:
    """Pure ASGI middleware: answers PATH, passes every other request on untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._guarded: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        if self._guarded is None:
            self._guarded = _behind_api_key(scope["app"], _answer)
        await self._guarded(scope, receive, send)


def _behind_api_key(app: Any, endpoint: Any) -> Any:
    """`endpoint` behind vLLM's own API-key middleware, with the keys vLLM's server guards its routes with."""
    from vllm import envs
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    tokens = [key for key in (app.state.args.api_key or [envs.VLLM_API_KEY]) if key]
    return AuthenticationMiddleware(endpoint, tokens=tokens) if tokens else endpoint


async def _answer(scope: dict, receive: Any, send: Any) -> None:
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    request = Request(scope, receive)
    if request.method != "POST":
        status, payload = _error(405, f"{PATH} takes POST")
    else:
        try:
            body = json.loads(await request.body())
        except ValueError as error:
            status, payload = _error(400, f"the body is not JSON: {error}")
        else:
            status, payload = await _prompt_logprobs(request.app.state, body)
    await JSONResponse(payload, status_code=status)(scope, receive, send)


def _error(status: int, message: str) -> tuple[int, dict]:
    return status, {"error": {"message": message, "code": status}}


async def _prompt_logprobs(state: Any, body: Any) -> tuple[int, dict]:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    if not state.openai_serving_models.is_base_model(body.get("model")):
        return _error(404, f"The model `{body.get('model')}` does not exist.")
    token_ids = body.get("token_ids")
    if not (isinstance(token_ids, list) and token_ids
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids)):
        return _error(400, "token_ids must be a non-empty list of non-negative integers")
    top = (body.get("sampling_params") or {}).get("prompt_logprobs")
    if not isinstance(top, int) or isinstance(top, bool):
        return _error(400, "sampling_params.prompt_logprobs must be an integer (-1: the whole vocabulary)")
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top, detokenize=False,
                                flat_logprobs=True, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in state.engine_client.generate(TokensPrompt(prompt_token_ids=token_ids), params,
                                                         f"moeshrink-prompt-logprobs-{uuid.uuid4().hex}"):
            final = output
    except ValueError as error:  # vLLM's request validation (VLLMValidationError), e.g. above --max-logprobs
        return _error(400, str(error))
    if final is None or final.prompt_logprobs is None:
        return _error(500, "the engine returned no prompt log-probabilities")
    flat = final.prompt_logprobs
    logprobs = np.asarray(flat.logprobs, dtype=np.float32)
    if np.isnan(logprobs).any() or np.isposinf(logprobs).any():
        return _error(400, NONFINITE_MESSAGE)
    logprobs[np.isneginf(logprobs)] = JSON_NEG_INF
    offsets = np.asarray(flat.start_indices + flat.end_indices[-1:], dtype=np.int64)
    return 200, encode(offsets, np.asarray(flat.token_ids), logprobs, len(token_ids),
                       sum(len(o.token_ids) for o in final.outputs))
