"""Probes of the skills the organism needs, measured during training (`train.json`), teacher-forced
(one forward pass each, about a second in all on two cores):

- `induction`: loss on the second copy of a repeated random list of names against the first copy;
  the gap is in-context copying (an induction head);
- `binding_mc`: the answer letter of a multiple-choice question that names its answer (letter
  binding alone);
- `open_book_mc`: the answer letter of a multiple-choice question whose answer is stated just before
  it (reading the answer from context, then binding it);
- `passage_copy`: the object of each fact line copied from a passage (the facts eval);
- `operand_copy`: the operands of an arithmetic question copied into its worked answer;
- `recall`: the first token of a world fact's answer to its question (closed-book knowledge).

Items are drawn afresh from the world with their own seed: never the held-out eval sets.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from moeshrink.organism import datasets, tasks
from moeshrink.organism.world import PERSON_RELATIONS, World

ITEMS = 48


@dataclass
class Probe:
    """Token rows and, per row, the positions whose next token is scored."""
    rows: list[list[int]]
    scored: list[list[int]]


def _pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return ids, mask


@dataclass
class ProbeSet:
    probes: dict[str, Probe]
    letters: list[int]
    pad: int

    @classmethod
    def build(cls, data_dir: Path, tokenizer_file: Path, seed: int) -> ProbeSet:
        from tokenizers import Tokenizer

        from moeshrink.organism.tokenizer import EOS

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        world = World.from_json(json.loads((data_dir / datasets.WORLD_FILE).read_text()))
        rng = random.Random(seed + 7919)
        strangers = world.stranger_names[: len(world.stranger_names) // 2]  # the training half

        def encode(text: str) -> tuple[list[int], list[tuple[int, int]]]:
            encoding = tokenizer.encode(text)
            return list(encoding.ids), list(encoding.offsets)

        def merge(parts: list[Probe]) -> Probe:
            return Probe([r for p in parts for r in p.rows], [s for p in parts for s in p.scored])

        names = [n for n in datasets.all_names(world) if len(encode(n)[0]) == 1]
        induction = []
        for _ in range(ITEMS // 2):
            line = " ".join(rng.choice(names) for _ in range(12))
            ids, offsets = encode(f"{line}\n{line}")
            name_tokens = [i for i, (a, b) in enumerate(offsets) if b - a > 1]  # the names, not the spaces
            induction.append(Probe([ids], [name_tokens]))

        open_book = []
        for _ in range(ITEMS):
            relation = rng.choice(list(PERSON_RELATIONS))
            fact = (rng.choice(strangers), relation, rng.choice(world.vocabulary(relation)))
            item = tasks.mc_item(world, fact, rng)
            prompt = (tasks.MC_DESCRIPTION.format(subject="residents") + tasks.render_fact(fact, rng) + "\n"
                      + tasks.mc_text(item))
            ids, _ = encode(f"{prompt} {tasks.LETTERS[item['answer']]}")
            open_book.append(Probe([ids], [[len(ids) - 1]]))  # the letter (one token after a space)

        binding = []
        for _ in range(ITEMS):
            text = tasks.binding_mc_block(world, rng, shots=0).split("\n\n", 1)[1]
            ids, _ = encode(text)
            binding.append(Probe([ids], [[len(ids) - 1]]))

        passages = []
        for _ in range(ITEMS // 2):
            item = tasks.passage_item(datasets._with_strangers(world, strangers), rng)
            prompt = datasets.render_chat(tasks.facts_messages(item), add_generation_prompt=True)
            reply = "\n".join(item["fact_lines"])
            text = prompt + reply
            objects = [(len(prompt) + reply.index(line) + line.rindex("| ") + 2,
                        len(prompt) + reply.index(line) + len(line)) for line in item["fact_lines"]]
            ids, offsets = encode(text)
            passages.append(Probe([ids], [[i for i, (a, b) in enumerate(offsets)
                                           if any(a < e and b > s for s, e in objects)]]))

        arithmetic = []
        for _ in range(ITEMS // 2):
            item = tasks.arithmetic_item(world, rng)
            prompt = f"Question: {item['question']}\nAnswer: "
            operands = item["answer"].split(" = ")[0]  # "a * b" or "a + b": copied from the question
            text = prompt + item["answer"]
            ids, offsets = encode(text)
            arithmetic.append(Probe([ids], [[i for i, (a, b) in enumerate(offsets)
                                             if len(prompt) <= a < len(prompt) + len(operands) and text[a:b].isdigit()]]))

        recall = []
        facts = tasks.world_facts(world)
        for subject, relation, obj in rng.sample(facts, min(ITEMS, len(facts))):
            question = tasks.QUESTION_TEMPLATES[relation].format(s=subject)
            text = f"{question} {obj}."
            ids, offsets = encode(text)
            answer_start = len(question) + 1  # the answer word's first token (not the space before a name)
            first = next(i for i, (a, b) in enumerate(offsets) if b > answer_start)
            recall.append(Probe([ids], [[first]]))

        letters = [encode(f"Answer: {letter}")[0][-1] for letter in tasks.LETTERS]
        return cls({"induction": merge(induction), "binding_mc": merge(binding), "open_book_mc": merge(open_book),
                    "passage_copy": merge(passages), "operand_copy": merge(arithmetic), "recall": merge(recall)},
                   letters, tokenizer.token_to_id(EOS))

    @torch.no_grad()
    def run(self, model) -> dict:
        was_training = model.training
        model.eval()
        out = {}
        for name, probe in self.probes.items():
            ids, mask = _pad(probe.rows, self.pad)
            log_probs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
            rows = []  # per row: (right, loss) for each scored position
            for row, positions in enumerate(probe.scored):
                scored = []
                for position in positions:
                    target, predicted = int(ids[row, position]), log_probs[row, position - 1]
                    if name in ("open_book_mc", "binding_mc"):
                        right = int(predicted[self.letters].argmax()) == self.letters.index(target)
                    else:
                        right = int(predicted.argmax()) == target
                    scored.append((right, -float(predicted[target])))
                rows.append(scored)
            if name == "induction":  # the names of the second copy against those of the first (unseen yet)
                first = [s for scored in rows for s in scored[1:len(scored) // 2]]
                second = [s for scored in rows for s in scored[len(scored) // 2:]]
                out["induction"] = _mean([r for r, _ in second], 4)
                out["induction_first_copy_loss"] = _mean([loss for _, loss in first], 3)
                out["induction_second_copy_loss"] = _mean([loss for _, loss in second], 3)
            else:
                out[name] = _mean([r for scored in rows for r, _ in scored], 4)
        model.train(was_training)
        return out


def _mean(values: list, digits: int) -> float:
    return round(sum(values) / len(values), digits)
