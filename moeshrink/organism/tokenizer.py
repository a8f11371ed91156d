"""A byte-level BPE tokenizer trained on the organism corpus, saved in Hugging Face layout.

A capitalised word keeps one tokenization everywhere: the space before it is split off, and every
name of the world is a token of its own, so a name is the same single token in prose (" Zevein"
would otherwise differ from "Zevein"), at the start of a line (a fact line, "Zevein | keeps |
goat") and inside JSON ('"Zevein"'), and copying it from a passage is copying one token. Single
capitals (" A" to " D", the answer letters) keep their space.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from moeshrink.core.errors import MoeshrinkError
from moeshrink.organism.datasets import chat_template

EOS = "<|endoftext|>"
TURN_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", TURN_END]
# Plain (non-special) added tokens: they must survive detokenisation so tool parsers see them.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
SPACE_BEFORE_CAPITALISED_WORD = r" (?=[A-Z][a-z])"


class TokenizerError(MoeshrinkError, ValueError):
    pass


def check_names(tokenizer: Tokenizer, names: Iterable[str]) -> None:
    """Every name of the world is one token, the same at the start of a text, after a space, after a
    newline and in JSON."""
    problems = []
    for name in names:
        forms = {context: tokenizer.encode(context.format(name)).ids for context in ("{}", "x {}", "x\n{}", '"{}"')}
        name_ids = forms["{}"]
        if len(name_ids) != 1 or any(name_ids[0] not in ids for ids in forms.values()):
            problems.append(f"{name}: {[tokenizer.encode(c.format(name)).tokens for c in forms]}")
    if problems:
        raise TokenizerError(f"{len(problems)} name(s) do not have one token everywhere: {problems[:5]}")


def train_tokenizer(texts: Iterable[str], vocab_size: int, names: Iterable[str] = ()) -> Tokenizer:
    """Byte-level BPE on `texts`, then the markup tokens and every one of `names` as a whole-word
    token of its own (matched before pre-tokenization, so a name is one token wherever it stands,
    however rare). The vocabulary holds at most `vocab_size` tokens: fewer when BPE had already
    learnt a name."""
    names = sorted(set(names))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPACE_BEFORE_CAPITALISED_WORD), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    learnt = vocab_size - len(MARKUP_TOKENS) - len(names)
    trainer = trainers.BpeTrainer(
        vocab_size=learnt,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.get_vocab_size() != learnt:
        raise TokenizerError(f"BPE learnt {tokenizer.get_vocab_size()} tokens of the {learnt} asked: the corpus is too "
                         "small for organism.tokenizer.vocab_size")
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tokenizer.add_tokens([AddedToken(name, single_word=True, special=False, normalized=False) for name in names])
    return tokenizer


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and chat_template.jinja."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=None,
        model_max_length=model_max_length,
        chat_template=chat_template(),
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
