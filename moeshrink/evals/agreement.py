"""agreement: every build reads the same passages (token ids fixed once, by the reference's run);
per prompt position, whether its most likely next token is the reference's (top-1 agreement) and
KL(reference || build) from prompt log-probabilities.

Servers return each position's top-K log-probabilities (plus the actual next token). KL is computed
over the reference's top-K tokens that the build also returned, each on its own, plus one bucket
holding the rest of the mass on both sides: the KL of the two distributions coarse-grained to those
outcomes, which never exceeds the true KL. On a small vocabulary the estimate is checked against
the exact whole-vocabulary KL on the first `exact_check_passages` passages.
"""
from __future__ import annotations

import zipfile
from functools import partial
from pathlib import Path

import numpy as np

from moeshrink.core.ioutil import atomic_path
from moeshrink.core.stats import bootstrap_ratio_ci, percentiles
from moeshrink.evals import EvalError
from moeshrink.evals.client import RequestPool
from moeshrink.evals.next_token import compare
from moeshrink_kernels.vllm import logprobs_wire as wire

METHOD = ("KL(reference || build) over the reference's top-K next tokens that the build also returned, "
          "plus one bucket for the remaining probability mass of each side (a lower bound of the exact KL); "
          "top-1 agreement: the build's most likely next token equals the reference's (where several tokens tie "
          "for most likely, on either side, any token both sides rank first); where the reference decides: the "
          "same, over the positions whose most likely token leads the runner-up by at least the decided margin")
PAD_ID = -1
REST_FLOOR = 1e-12
EXACT_TOLERANCE = 0.05


def pick_passages(texts: list[dict], count: int, where: str) -> list[dict]:
    """`count` texts spread evenly over the source, so that every kind of document is read."""
    if count > len(texts):
        raise EvalError(f"evals.agreement.passages is {count}, but {where} holds only {len(texts)} texts")
    stride = len(texts) / count
    return [{"id": f"passage-{int(i * stride)}", "text": texts[int(i * stride)]["text"]} for i in range(count)]


def tokenize(tokenizer_dir: Path, passages: list[dict], max_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    token_ids = [tokenizer(p["text"])["input_ids"][:max_tokens] for p in passages]
    short = [p["id"] for p, ids in zip(passages, token_ids) if len(ids) < 2]
    if short:
        raise EvalError(f"agreement passages with fewer than 2 tokens: {short[:5]}")
    return token_ids


# moeshrink's endpoint in vLLM's API server (`--middleware`, moeshrink_kernels/vllm/prompt_logprobs.py): the
# request of vLLM's token-in/token-out endpoint, the log-probabilities back as arrays. Through vLLM's JSON
# endpoints most of the API server's time went to one Python object and one JSON object per listed token
# (bench/README.md, "Where a served build's time goes").
ENDPOINT = wire.PATH


def request(model: str, token_ids: list[int], top_k: int) -> dict:
    return {"model": model, "token_ids": token_ids, "sampling_params": {
        "max_tokens": 1, "temperature": 0, "prompt_logprobs": top_k, "detokenize": False}}


def _positions(reply: dict) -> tuple[np.ndarray, np.ndarray]:
    """[positions, entries] token ids and log-probabilities of the positions after the first, each row in
    the server's order; every position lists as many entries (the prompt's next token, then the top K)."""
    try:
        offsets, token_ids, logprobs = wire.decode(reply)
    except wire.WireError as error:
        raise EvalError(f"{ENDPOINT}: {error}") from None
    widths = np.diff(offsets)[1:]
    if len(widths) and (widths != widths[0]).any():
        raise EvalError(f"{ENDPOINT}: positions list {widths.min()} to {widths.max()} tokens; expected as many each")
    width = int(widths[0]) if len(widths) else 0
    start = int(offsets[1]) if len(offsets) > 1 else 0
    return token_ids[start:].reshape(len(widths), width), logprobs[start:].reshape(len(widths), width)


def reply_top(reply: dict, width: int) -> tuple[np.ndarray, np.ndarray]:
    """One reply's [positions, width] token ids (PAD_ID where absent) and log-probabilities, each position's
    tokens once, most likely first (ties in the server's order)."""
    listed_ids, listed_lp = _positions(reply)
    rows, entries = listed_ids.shape
    # the prompt's next token comes first and again among the top K when it is one of them
    repeated = np.zeros((rows, entries), dtype=bool)
    repeated[:, 1:] = listed_ids[:, 1:] == listed_ids[:, :1]
    order = np.lexsort((-listed_lp, repeated), axis=1)[:, :width]
    ids = np.full((rows, width), PAD_ID, dtype=np.int64)
    logprobs = np.full((rows, width), -np.inf, dtype=np.float64)
    kept = ~np.take_along_axis(repeated, order, axis=1)
    columns = order.shape[1]
    ids[:, :columns] = np.where(kept, np.take_along_axis(listed_ids, order, axis=1), PAD_ID)
    logprobs[:, :columns] = np.where(kept, np.take_along_axis(listed_lp, order, axis=1), -np.inf)
    return ids, logprobs


def reply_table(reply: dict, vocab: int) -> np.ndarray:
    """One reply's whole-vocabulary [positions, vocab] log-probabilities (-inf where a token is not listed)."""
    listed_ids, listed_lp = _positions(reply)
    if len(listed_ids) and (listed_ids.max(initial=0) >= vocab or listed_ids.min(initial=0) < 0):
        raise EvalError(f"{ENDPOINT}: token ids outside the vocabulary of {vocab}")
    table = np.full((len(listed_ids), vocab), -np.inf, dtype=np.float64)
    np.put_along_axis(table, listed_ids, listed_lp, axis=1)
    return table


def stack_top(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([ids for ids, _ in parts]), np.concatenate([lp for _, lp in parts])


def read_top(pool: RequestPool, model: str, passages: list[tuple[str, list[int]]], top_k: int,
             width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each passage's top-`top_k` prompt log-probabilities (plus the actual next token), kept as
    arrays as each reply arrives."""
    return stack_top(pool.map(ENDPOINT, [(pid, request(model, ids, top_k)) for pid, ids in passages],
                              keep=partial(reply_top, width=width)))


def read_full(pool: RequestPool, model: str, passages: list[tuple[str, list[int]]], vocab: int) -> np.ndarray:
    """Each passage's whole-vocabulary prompt log-probabilities (needs `--max-logprobs -1`)."""
    tables = pool.map(ENDPOINT, [(pid, request(model, ids, -1)) for pid, ids in passages],
                      keep=partial(reply_table, vocab=vocab))
    return np.concatenate(tables) if tables else np.zeros((0, vocab))


def top1_agreement(ref_ids: np.ndarray, ref_lp: np.ndarray, ids: np.ndarray, lp: np.ndarray) -> np.ndarray:
    """Per position: whether a token ranked first by the reference is ranked first by the build. Tied
    first places count as one place: which of them a server lists first is arbitrary."""
    agree = ref_ids[:, 0] == ids[:, 0]
    tied = (ref_lp[:, 1] == ref_lp[:, 0]) | (lp[:, 1] == lp[:, 0])
    for row in np.flatnonzero(tied & ~agree):
        ref_first = set(ref_ids[row][ref_lp[row] == ref_lp[row, 0]].tolist())
        agree[row] = bool(ref_first & set(ids[row][lp[row] == lp[row, 0]].tolist()))
    return agree


def decided_positions(ref_lp: np.ndarray, margin: float) -> np.ndarray:
    """Per position: whether the reference's most likely token leads its runner-up by `margin` nats or
    more. Below it the reference hardly prefers one token, and any perturbation flips its top-1."""
    return ref_lp[:, 0] - ref_lp[:, 1] >= margin


def position_figures(ref_ids: np.ndarray, ref_lp: np.ndarray, ids: np.ndarray, lp: np.ndarray) -> tuple[np.ndarray,
                                                                                                        np.ndarray]:
    """Per position: top-1 agreement (bool) and the coarse-grained KL estimate."""
    agree = top1_agreement(ref_ids, ref_lp, ids, lp)
    build_lp = matching_logprobs(ref_ids, ids, lp)
    shared = np.isfinite(build_lp)
    p = np.where(shared, np.exp(ref_lp), 0.0)
    with np.errstate(invalid="ignore"):  # -inf - -inf where neither side lists the token
        total = np.where(shared, p * (ref_lp - build_lp), 0.0).sum(axis=1)
    p_rest = np.maximum(0.0, 1.0 - p.sum(axis=1))
    q_rest = np.maximum(REST_FLOOR, 1.0 - np.where(shared, np.exp(build_lp), 0.0).sum(axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0) where the listed tokens hold all the mass
        rest = np.where(p_rest > 0, p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)
    return agree, np.maximum(0.0, total + rest)


def matching_logprobs(ref_ids: np.ndarray, ids: np.ndarray, lp: np.ndarray) -> np.ndarray:
    """[positions, K]: the build's log-probability of each token the reference lists at that position,
    -inf where the build does not list it (or the reference's slot is empty)."""
    rows, width = ids.shape
    if not rows or not width:
        return np.full(ref_ids.shape, -np.inf)
    span = int(max(ref_ids.max(initial=0), ids.max(initial=0))) + 2  # ids from PAD_ID (-1) up
    offsets = (np.arange(rows, dtype=np.int64) * span)[:, None]
    order = np.argsort(ids, axis=1, kind="stable")
    build_keys = (np.take_along_axis(ids, order, axis=1) + 1 + offsets).ravel()  # ascending over all rows
    build_lp = np.take_along_axis(lp, order, axis=1).ravel()
    ref_keys = ref_ids + 1 + offsets
    found = np.minimum(np.searchsorted(build_keys, ref_keys), build_keys.size - 1)
    matched = (build_keys[found] == ref_keys) & (ref_ids != PAD_ID)
    return np.where(matched, build_lp[found], -np.inf)


def per_passage(passage_ids: list[str], lengths: list[int], agree: np.ndarray, kl: np.ndarray,
                decided: np.ndarray) -> list[dict]:
    records, start = [], 0
    for passage_id, length in zip(passage_ids, lengths):
        positions = length - 1
        a, k, d = (v[start:start + positions] for v in (agree, kl, decided))
        records.append({"id": passage_id, "positions": positions, "top1_agree": int(a.sum()),
                        "decided_positions": int(d.sum()), "decided_top1_agree": int((a & d).sum()),
                        "kl_sum": float(k.sum()), "kl_mean": float(k.mean()), "kl_max": float(k.max())})
        start += positions
    return records


def metrics(records: list[dict], kl: np.ndarray, top_k: int, decided_margin: float) -> dict:
    positions = [r["positions"] for r in records]
    agree = [r["top1_agree"] for r in records]
    decided = [r["decided_positions"] for r in records]
    decided_agree = [r["decided_top1_agree"] for r in records]
    kl_sums = [r["kl_sum"] for r in records]
    total = sum(positions)
    return {
        "positions": total, "passages": len(records), "top_k": top_k, "method": METHOD,
        "top1_agreement": {"value": sum(agree) / total, "ci95": list(bootstrap_ratio_ci(agree, positions)),
                           "ci_method": "percentile bootstrap over passages, 2,000 resamples"},
        "decided_top1_agreement": {
            "value": sum(decided_agree) / sum(decided) if sum(decided) else None,
            "ci95": list(bootstrap_ratio_ci(decided_agree, decided)) if sum(decided) else None,
            "ci_method": "percentile bootstrap over passages, 2,000 resamples",
            "positions": sum(decided), "margin_nats": decided_margin,
            "rule": f"positions where the reference's most likely token leads the runner-up by at least "
                    f"{decided_margin:g} nats"},
        "mean_kl": {"value": sum(kl_sums) / total, "ci95": list(bootstrap_ratio_ci(kl_sums, positions)),
                    "ci_method": "percentile bootstrap over passages, 2,000 resamples"},
        "kl_percentiles": percentiles(kl.tolist()),
    }


def checked_tokens(length: int, positions: int | None) -> int:
    """How many of a checked passage's tokens the exact check reads: enough for its first `positions`
    positions (all where None); a passage of n tokens has n - 1 positions."""
    return min(length, positions + 1) if positions else length


def exact_check_positions(lengths: list[int], passages: int, positions: int | None) -> np.ndarray:
    """Where the exact check's positions lie among all positions: those of exact_prompts' prompts, the first
    `passages` passages (lengths in tokens) each cut by checked_tokens."""
    starts = np.cumsum([0] + [n - 1 for n in lengths])
    return np.concatenate([np.arange(starts[i], starts[i] + checked_tokens(lengths[i], positions) - 1)
                           for i in range(min(passages, len(lengths)))] or [np.zeros(0, dtype=np.int64)])


def exact_prompts(passages: list[tuple[str, list[int]]], cfg: dict) -> list[tuple[str, list[int]]]:
    """The check's prompts: the first `exact_check_passages` passages, each cut to its checked positions."""
    return [(pid, ids[:checked_tokens(len(ids), cfg["exact_check_positions"])])
            for pid, ids in passages[:cfg["exact_check_passages"]]]


def exact_check(reference_full: np.ndarray, build_full: np.ndarray, estimate: np.ndarray) -> dict:
    """The estimate (at the checked positions) against the exact whole-vocabulary KL on the same positions."""
    exact = compare(reference_full, build_full)
    estimated = float(estimate.mean())
    relative = abs(estimated - exact["mean_kl"]) / exact["mean_kl"] if exact["mean_kl"] > 0 else 0.0
    return {"positions": len(build_full), "exact_mean_kl": exact["mean_kl"], "estimated_mean_kl": estimated,
            "relative_difference": relative, "tolerance": EXACT_TOLERANCE, "within_tolerance": relative <= EXACT_TOLERANCE,
            "exact_top1_agreement": exact["greedy_agreement"]}


def save_reference(path: Path, passage_ids: list[str], token_ids: list[list[int]], top_ids: np.ndarray,
                   top_lp: np.ndarray, full: np.ndarray, top_k: int) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, passage_ids=np.array(passage_ids), lengths=np.array([len(t) for t in token_ids]),
                                token_ids=np.concatenate([np.array(t, dtype=np.int64) for t in token_ids]),
                                top_ids=top_ids, top_lp=top_lp, full=full, top_k=np.array(top_k))


REFERENCE_ARRAYS = ("passage_ids", "lengths", "token_ids", "top_ids", "top_lp", "full", "top_k")


def load_reference(path: Path) -> dict:
    """The reference's stored passages and log-probabilities; a file that is not whole, or holds NaN or a
    positive infinity (a token absent from a reply is stored as -inf), is named with the passage."""
    try:
        with np.load(path) as data:
            arrays = {name: data[name] for name in REFERENCE_ARRAYS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise EvalError(f"{path}: not a whole agreement reference ({type(error).__name__}: {error}); rerun the "
                        "reference's agreement eval") from None
    lengths = arrays["lengths"].tolist()
    flat = arrays["token_ids"].tolist()
    offsets = np.cumsum([0] + lengths).tolist()
    passage_ids = arrays["passage_ids"].tolist()
    if offsets[-1] != len(flat) or len(arrays["top_lp"]) != offsets[-1] - len(lengths):
        raise EvalError(f"{path}: {len(flat)} token ids and {len(arrays['top_lp'])} positions do not fit the "
                        f"{len(lengths)} passages' lengths; rerun the reference's agreement eval")
    for name in ("top_lp", "full"):
        bad = np.isnan(arrays[name]) | (arrays[name] == np.inf)
        if bad.any():
            position = int(np.argwhere(bad)[0][0])
            passage = int(np.searchsorted(np.cumsum([n - 1 for n in lengths]), position, side="right"))
            where = f"passage {passage_ids[passage]}" if name == "top_lp" else f"exact-check row {position}"
            raise EvalError(f"{path}: {name} holds {int(bad.sum())} NaN or +inf values, the first at {where}; "
                            "rerun the reference's agreement eval")
    return {"passage_ids": passage_ids, "lengths": lengths,
            "token_ids": [flat[offsets[i]:offsets[i + 1]] for i in range(len(lengths))],
            "top_ids": arrays["top_ids"], "top_lp": arrays["top_lp"], "full": arrays["full"],
            "top_k": int(arrays["top_k"])}


def run(pool: RequestPool, model: str, reference: dict, cfg: dict, vocab: int) -> tuple[dict, list[dict]]:
    """Read the reference's passages, compare with the reference's stored top-K."""
    top_k = reference["top_k"]
    passages = list(zip(reference["passage_ids"], reference["token_ids"]))
    top_ids, top_lp = read_top(pool, model, passages, top_k, reference["top_ids"].shape[1])
    agree, kl = position_figures(reference["top_ids"], reference["top_lp"], top_ids, top_lp)
    decided = decided_positions(reference["top_lp"], cfg["decided_margin"])
    records = per_passage(reference["passage_ids"], reference["lengths"], agree, kl, decided)
    figures = metrics(records, kl, top_k, cfg["decided_margin"])
    if cfg["exact_check_passages"]:
        checked = exact_check_positions(reference["lengths"], cfg["exact_check_passages"],
                                        cfg["exact_check_positions"])
        figures["exact_check"] = exact_check(reference["full"], read_full(pool, model, exact_prompts(passages, cfg),
                                                                          vocab), kl[checked])
    return figures, records
