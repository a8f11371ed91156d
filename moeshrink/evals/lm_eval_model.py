"""lm-eval's `local-completions` model with the non-finite check (`finite`), registered in lm-eval's
model registry under the name the harness gives it (`register`).

Log-likelihood requests already ask for log-probabilities (echo); generation requests now ask for
those of their generated tokens too, so a NaN cannot pass silently into a GSM8K answer. A reply the
server cannot encode is located (which prompt position or generated token) and raised as
`NonFiniteError` naming the item by the end of its prompt; lm-eval re-raises it after its retries.
"""
from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request

from lm_eval.api.registry import register_model
from lm_eval.models.openai_completions import LocalCompletionsAPI

from moeshrink.evals import finite
from moeshrink.evals.usage import Usage

ITEM_TAIL_TOKENS = 40


def _post(url: str, headers: dict, body: dict, timeout: float) -> tuple[int, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={**headers, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def _bad_request(error: Exception) -> bool:
    """HTTP 400 as aiohttp (concurrent requests) or requests (one at a time) raises it."""
    status = getattr(error, "status", None) or getattr(getattr(error, "response", None), "status_code", None)
    return status == 400


USAGE = [Usage()]  # what the running evaluation's replies used (harness.evaluate gives each its own)


class CheckedCompletions(LocalCompletionsAPI):
    def parse_generations(self, outputs, **kwargs):
        for output in outputs if isinstance(outputs, list) else [outputs]:
            USAGE[0].add(output)
        return super().parse_generations(outputs=outputs, **kwargs)

    def parse_logprobs(self, outputs=None, tokens=None, ctxlens=None, **kwargs):
        for output in outputs if isinstance(outputs, list) else [outputs]:
            USAGE[0].add(output)
        return super().parse_logprobs(outputs=outputs, tokens=tokens, ctxlens=ctxlens, **kwargs)

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kwargs) -> dict:
        payload = super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos,
                                          **kwargs)
        if generate:
            payload.setdefault("logprobs", 1)
        return payload

    def _raise_if_nonfinite(self, messages, generate: bool, gen_kwargs: dict | None) -> None:
        """Ask again for the failed request; if the server could not encode a non-finite value, raise
        `NonFiniteError` naming the item and the position."""
        payload = self._create_payload(self.create_message(messages), generate=generate,
                                       gen_kwargs=copy.deepcopy(gen_kwargs), seed=self._seed, eos=self.eos_string)

        def send(body: dict) -> tuple[int, object]:
            return _post(self.base_url, self.header, body, self.timeout)

        if not finite.is_nonfinite_reply(*send(payload)):
            return
        prompts = payload["prompt"] if isinstance(payload["prompt"], list) and payload["prompt"] and \
            isinstance(payload["prompt"][0], list) else [payload["prompt"]]
        for prompt in prompts:
            single = {**payload, "prompt": prompt}
            if finite.is_nonfinite_reply(*send(single)):
                tail = self.tokenizer.decode(prompt[-ITEM_TAIL_TOKENS:]) if isinstance(prompt, list) else prompt[-200:]
                raise finite.NonFiniteError(f"the item whose prompt ends {tail!r} got non-finite log-probabilities "
                                            f"from the server at {finite.locate(send, single)}")

    def model_call(self, messages, *, generate=True, gen_kwargs=None, **kwargs):
        try:
            return super().model_call(messages, generate=generate, gen_kwargs=gen_kwargs, **kwargs)
        except Exception as error:
            if _bad_request(error):
                self._raise_if_nonfinite(messages, generate, gen_kwargs)
            raise

    async def amodel_call(self, session, sem, messages, *, generate=True, cache_keys=None, ctxlens=None,
                          gen_kwargs=None, **kwargs):
        try:
            return await super().amodel_call(session, sem, messages, generate=generate, cache_keys=cache_keys,
                                             ctxlens=ctxlens, gen_kwargs=gen_kwargs, **kwargs)
        except Exception as error:
            if _bad_request(error):
                self._raise_if_nonfinite(messages, generate, gen_kwargs)
            raise


def register(name: str) -> None:
    """Make CheckedCompletions lm-eval's model `name` (registering it again is harmless)."""
    register_model(name)(CheckedCompletions)
