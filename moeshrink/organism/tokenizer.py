"""A byte-level BPE tokenizer trained on the organism corpus, saved in Hugging Face layout."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from moeshrink.organism.datasets import chat_template

EOS = "<|endoftext|>"
TURN_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", TURN_END]
# Plain (non-special) added tokens: they must survive detokenisation so tool parsers see them.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}: "
                         "the corpus is too small for organism.tokenizer.vocab_size")
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
