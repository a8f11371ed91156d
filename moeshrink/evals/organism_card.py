"""The organism card: skill measured on the held-out sets by running the model itself (transformers).

The prompts are the ones the served evals send: lm-eval's MMLU and GSM8K renderings, and the chat
template for tool calls and fact lists. Tool calls are parsed by vLLM's hermes parser, offline.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch

from moeshrink.evals.scoring import calls_have_right_shape, gsm8k_answer, holds_call_markup, score_fact_lines
from moeshrink.organism import OrganismError, datasets, tasks

log = logging.getLogger(__name__)
EFFORTS = ["low", "high"]
# What the published organism must reach for the report's verdicts to mean anything. Knowledge is targeted
# in the form the organism is taught and the embedded study scores (cloze); the answer letter is measured
# and shown beside it, with no target (a model of a few million parameters has no symbol binding).
TARGETS = {"mc_cloze_accuracy": (">=", 0.90), "arith_exact": (">=", 0.90), "toolcall_correct": (">=", 0.95),
           "facts_unsupported_rate": ("<=", 0.05)}
MEASURED = ("mc_accuracy",)


def meets_targets(scores: dict) -> dict[str, bool]:
    return {key: scores[key] >= bound if op == ">=" else scores[key] <= bound
            for key, (op, bound) in TARGETS.items()}


def card_dtype() -> str:
    """bfloat16, the checkpoint's dtype, where the CPU computes it natively; float32 elsewhere (serve.dtype's
    rule): an AVX2-only CPU emulates every bfloat16 operation."""
    from moeshrink.core.machine import compute_dtype, cpu_facts

    return compute_dtype("auto", "bfloat16", cpu_facts())


def load_model(model_dir: Path, tokenizer_dir: Path, threads: int, dtype: str = "bfloat16"):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    tokenizer.padding_side = "left"
    return model, tokenizer


def mc_prompt(item: dict, dev: list[dict], shots: int) -> str:
    examples = [d for d in dev if d["subject"] == item["subject"]][:shots]
    fewshot = "".join(f"{tasks.mc_text(d)} {tasks.LETTERS[d['answer']]}\n\n" for d in examples)
    return tasks.MC_DESCRIPTION.format(subject=item["subject"]) + fewshot + tasks.mc_text(item)


@torch.no_grad()
def mc_accuracy(model, tokenizer, items: list[dict], dev: list[dict], shots: int, batch_size: int) -> float:
    letter_ids = []
    for letter in tasks.LETTERS:
        ids = tokenizer.encode(" " + letter, add_special_tokens=False)
        if len(ids) != 1:
            raise OrganismError(f"answer letter {letter!r} is not a single token")
        letter_ids.append(ids[0])
    correct = 0
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        enc = tokenizer([mc_prompt(it, dev, shots) for it in chunk], return_tensors="pt", padding=True)
        logits = model(**enc).logits[:, -1, letter_ids]
        predictions = logits.argmax(-1).tolist()
        correct += sum(int(p == it["answer"]) for p, it in zip(predictions, chunk))
    return correct / len(items)


@torch.no_grad()
def mc_cloze_accuracy(model, tokenizer, items: list[dict], batch_size: int) -> float:
    """Each option's text scored as the continuation of the bare question, 0-shot, as the served cloze eval
    scores it (lm-eval: the pair encoded whole, the continuation the tokens after the question's); the
    option of the highest summed log-probability is the answer."""
    pairs = []  # (item index, token ids, where the continuation starts)
    for index, item in enumerate(items):
        context = tasks.cloze_context(item["question"])
        start = len(tokenizer.encode(context, add_special_tokens=False))
        for choice in item["choices"]:
            ids = tokenizer.encode(context + tasks.cloze_continuation(choice), add_special_tokens=False)
            pairs.append((index, ids, start))
    scores = [[] for _ in items]
    for begin in range(0, len(pairs), batch_size):
        chunk = pairs[begin:begin + batch_size]
        width = max(len(ids) for _, ids, _ in chunk)
        ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for _, row, _ in chunk])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for _, row, _ in chunk])
        logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        for row, (index, tokens, start) in enumerate(chunk):
            positions = torch.arange(start, len(tokens))
            scores[index].append(float(logprobs[row, positions - 1, torch.tensor(tokens[start:])].sum()))
    return sum(int(max(range(len(s)), key=s.__getitem__) == it["answer"]) for s, it in zip(scores, items)) / len(items)


class ExpandedKVMemo:
    """transformers' MLA caches the compressed latents and re-expands every cached position at each
    decoding step; the expansion is position-wise, so keep what was expanded and expand only new
    positions. One memo per attention module per `generate` call."""

    def __init__(self, expand_kv):
        self.expand_kv = expand_kv
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __call__(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        done = 0 if self.keys is None else self.keys.shape[2]
        keys, values = self.expand_kv(kv_nope[:, :, done:], k_rot[:, :, done:])
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values


@contextlib.contextmanager
def memoised_kv_expansion(model):
    attentions = [layer.self_attn for layer in model.model.layers]
    for attention in attentions:
        attention.expand_kv = ExpandedKVMemo(type(attention).expand_kv.__get__(attention))
    try:
        yield
    finally:
        for attention in attentions:
            del attention.expand_kv


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, stop: list[str], batch_size: int) -> list[str]:
    """Greedy replies, cut at the first stop string; prompts are batched by length to limit padding."""
    stop_ids = [tokenizer.convert_tokens_to_ids(s) for s in stop if s in tokenizer.get_vocab()]
    stop_strings = [s for s in stop if s not in tokenizer.get_vocab()]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: dict[int, str] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        enc = tokenizer([prompts[i] for i in chunk], return_tensors="pt", padding=True)
        with memoised_kv_expansion(model):
            generated = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=stop_ids or None, stop_strings=stop_strings or None,
                                       tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
        for i, row in zip(chunk, generated[:, enc["input_ids"].shape[1]:]):
            text = tokenizer.decode(row, skip_special_tokens=False)
            cut = min([text.find(s) for s in stop if s in text] or [len(text)])
            outputs[i] = text[:cut].replace(tokenizer.pad_token, "")
    return [outputs[i] for i in range(len(prompts))]


def arith_exact(model, tokenizer, items: list[dict], fewshot: list[dict], shots: int, batch_size: int) -> float:
    context = tasks.gsm8k_block(fewshot[:shots]) + "\n\n"
    prompts = [context + f"Question: {it['question']}\nAnswer:" for it in items]
    replies = generate(model, tokenizer, prompts, 256, ["Question:", "<|im_end|>", "<|endoftext|>"], batch_size)
    return sum(gsm8k_answer(r) == gsm8k_answer(it["answer"]) for r, it in zip(replies, items)) / len(items)


def parse_tool_calls(text: str, tokenizer) -> list[dict] | None:
    """vLLM's hermes parser, offline; None when the reply holds a malformed call."""
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    info = Hermes2ProToolParser(tokenizer).extract_tool_calls(text, request=None)
    if not info.tools_called:
        return None if holds_call_markup(text) else []
    return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in info.tool_calls]


def toolcall_correct(model, tokenizer, items: list[dict], tools: list[dict], batch_size: int) -> dict:
    scores = {}
    for effort in EFFORTS:
        prompts = [datasets.render_chat(it["messages"], tools=tools, effort=effort, add_generation_prompt=True)
                   for it in items]
        replies = generate(model, tokenizer, prompts, 160, ["<|im_end|>", "<|endoftext|>"], batch_size)
        scores[effort] = sum(calls_have_right_shape(parse_tool_calls(r, tokenizer), it["expected_calls"], tools)
                             for r, it in zip(replies, items)) / len(items)
    return scores


def facts_unsupported(model, tokenizer, items: list[dict], batch_size: int) -> dict:
    prompts = [datasets.render_chat(tasks.facts_messages(it), add_generation_prompt=True) for it in items]
    replies = generate(model, tokenizer, prompts, 160, ["<|im_end|>", "<|endoftext|>"], batch_size)
    totals = {"supported": 0, "made_up": 0, "unparseable": 0}
    for reply, item in zip(replies, items):
        for key, value in score_fact_lines(reply, item["fact_lines"]).items():
            totals[key] += value
    stated = totals["supported"] + totals["made_up"]
    totals["rate"] = totals["made_up"] / stated if stated else 1.0
    totals["recall"] = totals["supported"] / sum(len(it["fact_lines"]) for it in items)
    totals["tool_call_replies"] = sum(holds_call_markup(reply) for reply in replies)
    totals["replies"] = len(replies)
    return totals


def evaluate(model_dir: Path, tokenizer_dir: Path, data_dir: Path, card_cfg: dict) -> dict:
    started = time.time()
    # a malformed call is scored as wrong; the parser's traceback for it is noise here
    logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)
    dtype = card_dtype()
    model, tokenizer = load_model(model_dir, tokenizer_dir, card_cfg["threads"], dtype)
    batch_size = card_cfg["batch_size"]
    mc = datasets.read_jsonl(data_dir / datasets.MC_TEST)[: card_cfg["mc_items"]]
    dev = datasets.read_jsonl(data_dir / datasets.MC_DEV)
    arith = datasets.read_jsonl(data_dir / datasets.ARITH_TEST)[: card_cfg["arith_items"]]
    arith_fewshot = datasets.read_jsonl(data_dir / datasets.ARITH_TRAIN)
    tools = json.loads((data_dir / datasets.TOOLS_FILE).read_text())
    trials = datasets.read_jsonl(data_dir / datasets.TOOLCALLS_TEST)[:: card_cfg["toolcall_stride"]]
    passages = datasets.read_jsonl(data_dir / datasets.PASSAGES_TEST)[: card_cfg["passages"]]
    toolcalls = toolcall_correct(model, tokenizer, trials, tools, batch_size)
    facts = facts_unsupported(model, tokenizer, passages, batch_size)
    result = {
        "mc_accuracy": mc_accuracy(model, tokenizer, mc, dev, card_cfg["shots"], batch_size),
        "mc_cloze_accuracy": mc_cloze_accuracy(model, tokenizer, mc, batch_size),
        "arith_exact": arith_exact(model, tokenizer, arith, arith_fewshot, card_cfg["shots"], batch_size),
        "toolcall_correct": sum(toolcalls.values()) / len(toolcalls),
        "toolcall_correct_by_effort": toolcalls,
        "facts_unsupported_rate": facts["rate"],
        "facts": facts,
        "items": {"mc": len(mc), "arith": len(arith), "toolcall_trials": len(trials) * len(EFFORTS),
                  "passages": len(passages)},
        "dtype": dtype,
        "seconds": round(time.time() - started, 1),
    }
    log.info(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}))
    return result
