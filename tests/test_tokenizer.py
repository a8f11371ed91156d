"""The organism tokenizer and chat template: tools rendered in the hermes convention, effort switch."""
import json
import random

import pytest

from moeshrink.organism import datasets, tasks
from moeshrink.organism.tokenizer import MARKUP_TOKENS, SPECIAL_TOKENS
from moeshrink.organism.world import generate_world


@pytest.fixture(scope="module")
def tokenizer(small_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(small_tokenizer_dir))


def test_layout_and_vocabulary(small_tokenizer_dir, tokenizer):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (small_tokenizer_dir / name).exists()
    assert 400 < len(tokenizer) <= 512
    for token in SPECIAL_TOKENS + MARKUP_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    assert tokenizer.eos_token == "<|endoftext|>"
    digits = tokenizer.encode("1234", add_special_tokens=False)
    assert len(digits) == 4  # numbers are split into digits


def test_a_name_is_one_token_wherever_it_stands(small_data, small_tokenizer_dir):
    """In prose, at the start of a fact line, in JSON: the same single token (the tokenization mismatch
    that made copying a name from a passage into a fact line impossible)."""
    from tokenizers import Tokenizer

    from moeshrink.organism.tokenizer import TokenizerError, check_names, train_tokenizer
    from moeshrink.organism.world import World

    world = World.from_json(json.loads((small_data / datasets.WORLD_FILE).read_text()))
    tokenizer = Tokenizer.from_file(str(small_tokenizer_dir / "tokenizer.json"))
    check_names(tokenizer, datasets.all_names(world))
    name = world.stranger_names[-1]
    prose = tokenizer.encode(f"The home of {name} is Soure.").tokens
    line = tokenizer.encode(f"{name} | lives in | Soure").tokens
    json_form = tokenizer.encode(json.dumps({"name": name})).tokens
    assert name in prose and line[0] == name and name in json_form
    without_names = train_tokenizer(["the cat sat on the mat"] * 50, 266)
    with pytest.raises(TokenizerError, match="do not have one token everywhere"):
        check_names(without_names, ["Zekroth"])


def test_markup_survives_decoding(tokenizer):
    text = '<think>x</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_template_renders_tools_and_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "What is the weather in Oslo today?"}]
    rendered = tokenizer.apply_chat_template(messages, tools=tasks.TOOLS, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou may call these tools:\n<tools>\n")
    for tool in tasks.TOOLS:
        assert json.dumps(tool) in rendered
    assert "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>" in rendered
    assert rendered.endswith("<|im_start|>user\nWhat is the weather in Oslo today?<|im_end|>\n<|im_start|>assistant\n")
    # same text as the renderer the corpus uses
    assert rendered == datasets.render_chat(messages, tools=tasks.TOOLS, add_generation_prompt=True)


def test_effort_switch(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for effort in ("low", "high"):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 reasoning_effort=effort)
        assert rendered.startswith(f"<|im_start|>system\nReasoning effort: {effort}<|im_end|>\n")


def test_assistant_tool_calls_render_in_hermes_form_and_parse_back(tokenizer):
    from moeshrink.evals.organism_card import parse_tool_calls

    call = {"name": "set_timer", "arguments": {"minutes": 5, "label": "tea"}}
    messages = [{"role": "user", "content": "Set a timer for 5 minutes for the tea."},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": call}]}]
    rendered = tokenizer.apply_chat_template(messages, tools=tasks.TOOLS, tokenize=False)
    reply = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert reply == '<tool_call>\n{"name": "set_timer", "arguments": {"minutes": 5, "label": "tea"}}\n</tool_call>'
    assert parse_tool_calls(reply, tokenizer) == [call]
    # and the reference replies the corpus teaches parse to the expected calls
    world = generate_world(1, people=8, cities=4, regions=4, rivers=4, strangers=8)
    item = tasks.toolcall_item(world, "two_cities", random.Random(0))
    assert parse_tool_calls(tasks.assistant_turn(item, "high"), tokenizer) == item["expected_calls"]
    assert parse_tool_calls("no call here", tokenizer) == []
    assert parse_tool_calls("<tool_call>{broken</tool_call>", tokenizer) is None
