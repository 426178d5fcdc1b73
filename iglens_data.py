"""IG-Lens on many prompts: prompts and answers as token ids, batches, and datasets at scale.

The method lives in :mod:`iglens_core`; this module imports it and holds what feeding it needs:
:func:`encode` (a prompt and its answer, teacher-forced or the model's greedy one, as token ids),
:func:`token_span` (where a word sits in an answer), :func:`collect_batch` (the collector over many
sequences in batches), greedy answers in batches, :func:`ig_lens_batch` (one readout pass for a
whole batch), ``resume``, and the split of items over the ranks of ``torchrun`` / ``accelerate``.
:func:`attribute_dataset` is the entry point; the command line's ``--dataset`` calls it. With
``resolution=`` it also writes a long table of each item's top parts (heads, neurons or (head,
source token) pairs) and their sums, or of each answer token's attribution graph
(:mod:`iglens_graph`), or with ``corrupted_column`` each answer token's counterfactual graph
(:mod:`iglens_counterfactual`). Reading the input file and writing the shards is :mod:`iglens_tables`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence, Union

import numpy as np
import torch

from iglens_core import (ESTIMATORS, Attribution, Readout, Trace, check_foil, check_layers, check_quantity,
                         check_same_model, check_sequence, check_steps, collect_components, components, context_length,
                         get_adapter, ig_lens, logits_at_end, model_fingerprint, precision, resolve_baseline,
                         stream_hooks, RANK_ATOL, RANK_RTOL)
import iglens_tables as igt
from iglens_counterfactual import counterfactual_graph
from iglens_graph import attribution_graphs


# ---------------------------------------------------------------------------
# Inputs: prompts, answers and batches of traces
# ---------------------------------------------------------------------------

_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


def stop_token_ids(tokenizer) -> list[int]:
    """EOS plus the end-of-turn tokens of the common chat formats that this vocabulary has."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    ids.update(vocab[tok] for tok in _END_OF_TURN if tok in vocab)
    return sorted(ids)


def as_ids(encoded) -> list[int]:
    # transformers 5.x returns a mapping from apply_chat_template; 4.x a list
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if isinstance(encoded, torch.Tensor):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return list(encoded)


def encode(tokenizer, prompt: str, answer: Optional[str] = None, *, model=None,
           chat: bool = True, max_new_tokens: int = 32) -> tuple[torch.Tensor, int]:
    """Token ids of prompt + answer, and where the answer starts.

    Args:
        prompt: the user message (``chat=True``) or raw text.
        answer: teacher-forced answer text; ``None`` generates the model's greedy answer
            (KV cache, stops at EOS / end-of-turn, which is not included).
        model: needed when ``answer is None``.
        chat: use the tokenizer's chat template when it has one.

    Returns:
        ``input_ids`` (1, L) long and ``prompt_len``: answer tokens are ``input_ids[0, prompt_len:]``.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt must be a non-empty string, got {type(prompt).__name__} {prompt!r}")
    if answer is not None and (not isinstance(answer, str) or not answer.strip()):
        raise ValueError(f"answer must be a non-empty string or None (greedy), got {answer!r}")
    prompt_ids = prompt_token_ids(tokenizer, prompt, chat)
    if answer is not None:
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if not answer_ids:
            raise ValueError(f"answer {answer!r} tokenizes to no tokens")
    else:
        if model is None:
            raise ValueError("encode(answer=None) generates the greedy answer and needs model=")
        answer_ids = greedy_answer(model, tokenizer, prompt_ids, max_new_tokens)
        if not answer_ids:
            raise ValueError(f"the model's greedy answer to {prompt!r} is empty (it stopped at once)")
    input_ids = torch.tensor([prompt_ids + answer_ids], dtype=torch.long)
    return input_ids, len(prompt_ids)


def prompt_token_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of the prompt: the chat template's user turn and generation prompt, or raw
    text with the tokenizer's BOS (restored when the tokenizer forgets it)."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return as_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True))
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and prompt_ids[:1] != [bos]:
        prompt_ids = [bos] + prompt_ids
    return prompt_ids


@torch.no_grad()
def _tie_rule_processor():
    """A logits processor for ``model.generate``: the next token is the lowest id among those tied
    with the largest logit (:func:`iglens_core.tie_tolerance` of the row: ``RANK_ATOL + RANK_RTOL *
    (max - min)`` over the finite logits). Greedy decoding otherwise follows the float rounding of the
    arg-max, which moves with the batch a prompt is decoded in, the thread count and the BLAS kernels
    (4e-5 in the packaged model's logits between a prompt alone and in a batch at 2 threads); the
    tie tolerance (about 3e-3 for its logits) is far above that, so the answer does not move."""
    from transformers import LogitsProcessor

    class TieRule(LogitsProcessor):
        def __call__(self, input_ids, scores):
            finite = torch.isfinite(scores)
            top = scores.max(-1, keepdim=True).values
            low = torch.where(finite, scores, top).min(-1, keepdim=True).values
            tied = scores >= top - (RANK_ATOL + RANK_RTOL * (top - low))
            first = tied.to(torch.int8).argmax(-1, keepdim=True)  # the lowest tied id
            return torch.full_like(scores, float("-inf")).scatter_(-1, first, 0.0)

    return TieRule()


def _greedy(model, ids: torch.Tensor, max_new_tokens: int, stops: list[int], pad) -> torch.Tensor:
    """Greedy decoding of unpadded prompts of one length (rows of ``ids``), with the tie rule."""
    from transformers import LogitsProcessorList
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=stops or None, pad_token_id=pad, use_cache=True,
                          logits_processor=LogitsProcessorList([_tie_rule_processor()]))


def greedy_answer(model, tokenizer, prompt_ids: Sequence[int], max_new_tokens: int = 32) -> list[int]:
    """Greedy decoding with a KV cache; returns the new tokens without the stop token. Ties with the
    largest logit (``tie_tolerance``) go to the lowest token id, so the answer does not depend on
    float rounding (threads, BLAS, batch)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], device=device)
    stops = stop_token_ids(tokenizer)
    out = _greedy(model, ids, max_new_tokens, stops, stops[0] if stops else None)
    new = out[0, ids.shape[1]:].tolist()
    while new and new[-1] in stops:
        new.pop()
    return new


def token_span(tokenizer, ids: Sequence[int], text: str, *, ignore_case: bool = True) -> Optional[tuple[int, int]]:
    """Token indices ``(start, stop)`` of the first occurrence of ``text`` in ``decode(ids)``.

    ``ids[start]`` is the token holding the first character of ``text`` (with a leading space
    token such as ``" Paris"`` this is that token) and ``ids[stop - 1]`` the one holding its last.

    Args:
        ids: token ids, e.g. an answer ``input_ids[0, prompt_len:]``.
        text: the substring to find, e.g. a fact's object.
        ignore_case: match case-insensitively ("Hydrogen" for "hydrogen").

    Returns:
        ``(start, stop)`` or None when ``text`` does not occur.
    """
    if not text:
        raise ValueError("text must be a non-empty string")
    ids = [int(i) for i in ids]
    decoded = tokenizer.decode(ids)
    at = (decoded.lower().find(text.lower()) if ignore_case else decoded.find(text))
    if at < 0:
        return None
    ends = [len(tokenizer.decode(ids[:k + 1])) for k in range(len(ids))]  # decoded prefix lengths
    start = next(k for k, end in enumerate(ends) if end > at)
    stop = next(k for k, end in enumerate(ends) if end >= at + len(text)) + 1
    return start, stop


@torch.no_grad()
def collect_batch(model, sequences: Sequence[tuple[torch.Tensor, int]], *, batch_size: int = 8,
                  sublayer: bool = False, pad_token_id: int = 0,
                  fingerprint: Optional[torch.Tensor] = None) -> list[Trace]:
    """:func:`collect` for many sequences, ``batch_size`` at a time; the same traces.

    Sequences of similar length are batched together (order restored on return), LEFT-padded
    with an attention mask, and given ``position_ids = cumsum(mask) - 1`` (clamped at 0 on the
    padding) explicitly: Hugging Face models count positions from the first column of the batch
    whatever the mask says, which shifts learned absolute positions (GPT-2) of padded rows.
    Padding is never attended to and never recorded.

    Args:
        sequences: ``(input_ids (1, L) or (L,), prompt_len)`` pairs, as :func:`encode` returns.
        batch_size: sequences per forward pass (>= 1).
        sublayer: also record the residual between attention and MLP of each block.
        pad_token_id: id placed on the padding (any valid id: it is masked out).
        fingerprint: ``model_fingerprint(model)`` when the caller has taken it already
            (:func:`attribute_dataset` takes it once per run); None: taken here.

    Returns:
        One :class:`Trace` per sequence, in input order, equal to ``collect(model, *sequence)``
        up to float rounding of the batched matrix products.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    checked = [(check_sequence(model, ids, prompt_len), int(prompt_len))
               for ids, prompt_len in sequences]
    adapter = get_adapter(model)
    n = adapter.n_layers
    device = next(model.parameters()).device
    fingerprint = model_fingerprint(model) if fingerprint is None else fingerprint
    order = sorted(range(len(checked)), key=lambda i: checked[i][0].shape[1])
    traces: list[Optional[Trace]] = [None] * len(checked)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(checked[i][0].shape[1] for i in chunk)
        input_ids = torch.full((len(chunk), width), int(pad_token_id), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids = checked[i][0][0]
            input_ids[row, width - len(ids):] = ids
            mask[row, width - len(ids):] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        # left padding: every row's positions lie in the last max(T) + 1 columns
        keep = max(checked[i][0].shape[1] - checked[i][1] for i in chunk) + 1
        stream: list[Optional[torch.Tensor]] = [None] * (n + 1)
        mids: list[Optional[torch.Tensor]] = [None] * n
        hooks = stream_hooks(adapter, lambda index, tensor: stream.__setitem__(index, tensor.detach()),
                              (lambda layer, tensor: mids.__setitem__(layer, tensor.detach()))
                              if sublayer else None)
        try:
            logits = logits_at_end(model, keep, input_ids=input_ids.to(device),
                                    attention_mask=mask.to(device), position_ids=position_ids.to(device))
        finally:
            for hook in hooks:
                hook.remove()
        for row, i in enumerate(chunk):
            ids, prompt_len = checked[i]
            length = ids.shape[1]
            positions = torch.arange(prompt_len - 1, length - 1)
            picked = positions + width - length  # the same positions in the padded row
            work = precision(stream[0].dtype)
            # with device_map="auto" the blocks (and the head) may sit on different devices
            hidden = torch.stack([s[row, picked.to(s.device)].cpu() for s in stream]).to(work)  # (n+1, T, d)
            if not torch.isfinite(hidden).all():
                raise ValueError("the hidden states contain NaN or inf; check the model's dtype "
                                 "and weights")
            targets = ids[0, prompt_len:].cpu()
            columns = (picked - (width - keep)).to(logits.device)
            probs = torch.softmax(logits[row, columns].to(precision(logits.dtype)), -1)
            model_probs = probs.gather(-1, targets[:, None].to(logits.device))[:, 0].cpu()
            mid = (torch.stack([s[row, picked.to(s.device)].cpu() for s in mids]).to(work)
                   if sublayer else None)
            traces[i] = Trace(ids.cpu(), prompt_len, targets, positions, hidden, model_probs, mid,
                              model_fingerprint=fingerprint)
    return traces


# ---------------------------------------------------------------------------
# Datasets: many prompts in one call, batched, resumable, on one process or many
# ---------------------------------------------------------------------------


def ig_lens_batch(model, traces: Sequence[Trace], *, layers: Optional[Sequence[int]] = None,
                  baseline: Union[str, torch.Tensor] = "embedding", steps: int = 16,
                  estimator: str = "prediction_aware", profile: bool = False,
                  readout: Optional[Readout] = None, quantity: str = "prob",
                  foils: Optional[Sequence] = None) -> list[Attribution]:
    """:func:`ig_lens` of many traces in one pass; the same attributions, one per trace.

    The traces' tokens are joined along ``T`` (the head-once readout treats every point on its
    own), so the path nodes of all of them go through the readout in one chunked pass, then the
    result is split back. Each part's ``residual`` is its own.

    Args:
        traces: from :func:`collect` / :func:`collect_batch`, same model.
        baseline: a name of :data:`BASELINES` (``"mean"`` is each trace's own mean) or a (d,) tensor.
        layers, steps, estimator, profile, readout, quantity: as in :func:`ig_lens` (layer resolution).
        foils: None, or one foil per trace (a token id or that trace's (T_i,) ids), as
            ``foil`` of :func:`ig_lens`.

    Returns:
        One :class:`Attribution` per trace, in order.
    """
    if not traces:
        return []
    readout = readout or Readout(model)
    if foils is not None:
        if len(foils) != len(traces) or any(foil is None for foil in foils):
            raise ValueError(f"foils must hold one foil per trace ({len(traces)}), none of them None")
        foils = torch.cat([check_foil(foil, trace.targets, readout.vocab_size)
                           for foil, trace in zip(foils, traces)])
    if isinstance(baseline, str) and baseline == "mean":  # per trace, then joined: (sum T, d)
        baseline_name = "mean"
        baseline = torch.cat([resolve_baseline("mean", trace)[0] for trace in traces])
    else:
        baseline_name = None
    sizes = [len(trace.targets) for trace in traces]
    joined = Trace(traces[0].input_ids, traces[0].prompt_len,
                   torch.cat([trace.targets for trace in traces]),
                   torch.cat([trace.positions for trace in traces]),
                   torch.cat([trace.hidden for trace in traces], 1),
                   torch.cat([trace.model_probs for trace in traces]),
                   model_fingerprint=traces[0].model_fingerprint)
    whole = ig_lens(model, joined, layers=layers, baseline=baseline, steps=steps,
                    estimator=estimator, profile=profile, readout=readout, quantity=quantity, foil=foils)
    parts, start = [], 0
    for size in sizes:
        cut = slice(start, start + size)
        values, p_base, p_final = whole.values[cut], whole.p_base[cut], whole.p_final[cut]
        residual = float((values.double().sum(-1) - (p_final.double() - p_base.double())).abs().max())
        parts.append(Attribution(values, whole.layers, whole.labels, p_base, p_final, whole.lens[cut],
                                 residual, whole.targets[cut], whole.positions[cut], whole.estimator,
                                 whole.steps, baseline_name or whole.baseline,
                                 whole.profile[cut] if whole.profile is not None else None,
                                 whole.quantity, whole.foils[cut] if whole.foils is not None else None))
        start += size
    return parts


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
                   batch_size: int = 16) -> list[list[int]]:
    """:func:`greedy_answer` for many prompts, up to ``batch_size`` prompts of the same length at a time.

    No padding: only prompts of one length share a batch, so every prompt is decoded as it would be
    alone (same positions, same attention, no mask). What is left of the batch, the float rounding
    of the matrix products shared by its rows (4e-5 in the packaged model's logits at 2 threads), is
    absorbed by the tie rule of :func:`greedy_answer` (ties with the largest logit go to the lowest
    id), so the answers do not depend on ``batch_size``, on the order of ``prompts`` or on which
    prompts share a batch. Each answer stops at its first stop token (not included).

    Args:
        prompts: token ids of each prompt.

    Returns:
        The new token ids of each prompt, in input order (possibly empty).
    """
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer)
    pad = stops[0] if stops else (tokenizer.pad_token_id or 0)
    context = context_length(model)
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    answers: list[list[int]] = [[] for _ in prompts]
    for width in sorted(by_length):
        same = by_length[width]
        new_tokens = max_new_tokens if context is None else min(max_new_tokens, context - width)
        for start in range(0, len(same), batch_size):
            chunk = same[start:start + batch_size]
            ids = torch.tensor([list(prompts[i]) for i in chunk], dtype=torch.long)
            out = _greedy(model, ids.to(device), new_tokens, stops, pad)
            for row, i in enumerate(chunk):
                new = out[row, width:].tolist()
                cut = next((k for k, tok in enumerate(new) if tok in stops), len(new))
                answers[i] = new[:cut]
    return answers


def distributed_rank() -> tuple[int, int]:
    """``(rank, world_size)`` from torch.distributed's environment (``RANK``, ``WORLD_SIZE``, set by
    ``torchrun`` and ``accelerate launch``); ``(0, 1)`` outside them.

    With ``WORLD_SIZE > 1`` and no process group yet, a gloo group is started (the ranks only
    wait for each other at a barrier; gloo runs on CPUs and GPUs alike, over TCP between nodes)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if not 0 <= rank < world:
        raise ValueError(f"RANK must lie in 0..{world - 1} (WORLD_SIZE={world}), got {rank}")
    if world > 1:
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    return rank, world


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


def _item_frame(attribution: Attribution, tokenizer, row: int, item_id: str, foil: Optional[str]):
    frame = attribution.to_frame(tokenizer)
    frame.insert(0, "id", item_id)
    frame.insert(0, "row", row)
    frame["delta_p"] = frame["p_final"] - frame["p_base"]
    frame["residual"] = attribution.residual
    frame["quantity"] = attribution.quantity
    frame["foil"] = foil
    return frame


DATASET_RESOLUTIONS = ("head", "neuron", "source", "graph")  # attribute_dataset(resolution=) and --resolution


@torch.no_grad()  # components() on a post-norm model (Gemma) would build a graph otherwise
def _item_parts(model, tokenizer, sequence, row: int, item_id: str, foil: Optional[str],
                foil_id: Optional[int], *, resolution: str, top_k: int, corrupted=None, **settings):
    """One item's parts table: :func:`collect_components` and :func:`components` of its
    ``(prompt ids, answer ids)``, then :func:`iglens_tables.parts_frame`; or (``"graph"``) the graph of every answer
    token, :func:`iglens_tables.graph_frame`; with ``corrupted`` (the corrupted prompt's ids, as long as the
    prompt's, the same answer after them) each answer token's counterfactual graph. ``settings``: steps,
    estimator, readout, quantity."""
    prompt, answer = sequence
    input_ids = torch.tensor([list(prompt) + list(answer)])
    if corrupted is not None:  # answer token j, predicted at t: clean ids[:t+1] against corrupted ids[:t+1]
        import pandas as pd
        bad, frames = torch.tensor([list(corrupted) + list(answer)]), []
        for j, t in enumerate(range(len(prompt) - 1, input_ids.shape[1] - 1)):
            graph = counterfactual_graph(model, input_ids[:, :t + 1], bad[:, :t + 1], int(input_ids[0, t + 1]),
                                         quantity=settings["quantity"], foil=foil_id, steps=settings["steps"])
            frames.append(igt.graph_frame(graph, tokenizer, top_k).assign(token_index=j))
        frame = pd.concat(frames, ignore_index=True).assign(row=row, id=item_id, foil=foil)
        return frame.reindex(columns=igt.PART_COLUMNS[:-1] + igt.CONTRAST_COLUMNS).astype({"token_index": "int64"})
    if resolution == "graph":
        graphs = attribution_graphs(model, input_ids, len(prompt), foil=foil_id, **settings)
        frame = igt.graph_frame(graphs, tokenizer, top_k).assign(row=row, id=item_id, foil=foil)
    else:
        trace = collect_components(model, input_ids, len(prompt), sources=resolution == "source")
        split = components(model, trace, resolution=resolution, foil=foil_id, **settings)
        frame = igt.parts_frame(split, tokenizer, input_ids, resolution, top_k, row, item_id, foil)
    return frame.reindex(columns=igt.PART_COLUMNS[:-1]).astype({"node": "Int64"})


def _check_dataset_baseline(baseline, d: int) -> None:
    """Fail before the run on a baseline no item can use: a name outside :data:`BASELINES`, or a
    tensor that is not one finite (d,) point (items differ in length, so no (T, d) form)."""
    if not isinstance(baseline, str) and tuple(torch.as_tensor(baseline).shape) != (d,):
        raise ValueError(f"a dataset's baseline tensor must have shape ({d},) (the model's hidden "
                         f"size; one point for every item), got {tuple(torch.as_tensor(baseline).shape)}")
    resolve_baseline(baseline, SimpleNamespace(hidden=torch.zeros(1, 1, d)))  # names, finiteness: as ig_lens


SETTINGS_FILE = "settings.json"  # in OUT.parts/: the settings the shards were made with


def run_settings(model, *, layers: Sequence[int], **settings) -> dict:
    """The settings that decide a dataset run's numbers, as JSON-ready values.

    Args:
        model: the model; recorded as its ``name_or_path`` and :func:`model_fingerprint`.
        layers: the resolved segment end layers.
        settings: the rest (``estimator``, ``baseline``, ``steps``, ...); a baseline tensor is
            recorded as the SHA-256 of its float64 bytes.
    """
    return _settings_record(model, model_fingerprint(model), layers=layers, **settings)


def _settings_record(model, fingerprint: Optional[torch.Tensor], *, layers: Sequence[int], **settings) -> dict:
    """:func:`run_settings` with the model's fingerprint already taken."""
    baseline = settings.get("baseline")
    if baseline is not None and not isinstance(baseline, str):
        digest = hashlib.sha256(torch.as_tensor(baseline).double().cpu().numpy().tobytes()).hexdigest()
        settings["baseline"] = f"tensor sha256:{digest[:16]}"
    return dict(model=str(getattr(model.config, "_name_or_path", "")), layers=[int(x) for x in layers],
                **settings, fingerprint=None if fingerprint is None else fingerprint.tolist())


def _check_settings(parts: Path, settings: dict) -> None:
    """``resume``: the shards in ``parts`` must have been made with ``settings`` (the model's
    fingerprint within 1e-2 relative, as :func:`check_same_model`; the rest exactly).

    Raises:
        ValueError: they differ (each difference listed), or shards exist without a record.
    """
    path = parts / SETTINGS_FILE
    if not path.exists():
        if any(parts.glob("*.parquet")):
            raise ValueError(f"{parts} holds shards but no {SETTINGS_FILE} (the settings they were made "
                             "with), so resuming could mix runs: run again without resume")
        return
    stored = json.loads(path.read_text(encoding="utf-8"))
    differ = [key for key in sorted(set(stored) | set(settings)) if key != "fingerprint"
              and stored.get(key) != settings.get(key)]
    old, new = stored.get("fingerprint"), settings.get("fingerprint")
    if old is not None and new is not None and (len(old) != len(new) or not torch.allclose(
            torch.tensor(old), torch.tensor(new), rtol=1e-2, atol=1e-8)):
        differ.append("fingerprint")
    if differ:
        listed = "; ".join(f"{key}: {stored.get(key)!r} in the shards, {settings.get(key)!r} now"
                           if key != "fingerprint" else "fingerprint: the model's weights differ"
                           for key in differ)
        raise ValueError(f"resume: the shards in {parts} were made with other settings ({listed}); "
                         "resume with the same settings, or use another out= (or no resume)")


def attribute_dataset(model, tokenizer, items, *, layers: Optional[Sequence[int]] = None,
                      steps: int = 16, estimator: str = "prediction_aware",
                      baseline: Union[str, torch.Tensor] = "embedding", chat: bool = True,
                      batch_size: int = 16, out: Optional[Union[str, Path]] = None,
                      resume: bool = False, max_new_tokens: int = 32, progress: bool = True,
                      readout: Optional[Readout] = None, prompt_column: str = "prompt",
                      answer_column: Optional[str] = None, id_column: Optional[str] = None,
                      quantity: str = "prob", foil_column: Optional[str] = None,
                      resolution: Optional[str] = None, top_k: int = 20, corrupted_column: Optional[str] = None):
    """IG-Lens over a whole dataset: batched, written as it goes, resumable, split over ranks.

    Items are tokenised (errors recorded per row), sorted by length and taken ``batch_size`` at
    a time: the greedy answers of the batch's items without an answer are generated together
    (:func:`greedy_answers`), the batch runs through one forward pass (:func:`collect_batch`,
    logits only at the answer positions) and the path nodes of all its tokens through one
    chunked readout pass (:func:`ig_lens_batch`). A bad row (empty prompt, longer than the
    context, ids outside the vocabulary, an answer that tokenises to nothing, an empty greedy
    answer) goes to the errors table with its message and never stops the run or leaves part
    of an item behind.

    With ``out``, every batch is written to the shard folder ``OUT.parts/`` as soon as it is
    made (parquet, atomically: a temporary file renamed), and rank 0 merges the shards into
    ``out`` and :func:`errors_path` ``(out)`` at the end; the shards stay, so a finished run
    resumes as a no-op. ``resume=True`` skips every id already in a shard (results or errors);
    without it, existing shards are deleted first. Under ``torchrun`` / ``accelerate launch``
    (``WORLD_SIZE > 1``, see :func:`distributed_rank`) rank r takes the items ``i % world == r``,
    writes its own shards, and rank 0 merges after a barrier. While the run goes, memory
    holds one batch (the readout chunks within ``readout.memory_budget``), whatever the
    dataset's size; the final merge holds the results table once.

    Args:
        model, tokenizer: from :func:`load_model`.
        items: a .csv, .tsv, .json, .jsonl or .parquet path, or a DataFrame, see :func:`read_items`
            (also for how an answer without a leading space is tokenised).
        layers, steps, estimator, baseline: as in :func:`ig_lens` (``baseline``: a name of
            :data:`BASELINES` or one (d,) tensor for every item, checked before the run).
        chat: apply the chat template to each prompt.
        batch_size: items per forward pass and per shard (>= 1).
        out: the final results file (must end in ``.parquet``), or None to write nothing.
        resume: skip the ids already in ``OUT.parts/``. The settings that decide the numbers
            (:func:`run_settings`: model name and fingerprint, layers, estimator, baseline,
            steps, chat, max_new_tokens, quantity, resolution, top_k) and the columns read (prompt,
            answer, id, foil and corrupted, as resolved) are kept in ``OUT.parts/settings.json``; resuming
            with other ones raises ValueError listing what differs, and so do shards without it.
        max_new_tokens: length limit of the greedy answers.
        progress: show a tqdm bar (off as well when ``TQDM_DISABLE`` is set).
        readout: a :class:`Readout` to reuse.
        prompt_column, answer_column, id_column, foil_column: the input's column names, see
            :func:`read_items`.
        quantity: ``"prob"`` or ``"logprob"``, as in :func:`ig_lens`. An item with a foil (one
            token's text) splits ``f(y) - f(foil)`` at each of its answer tokens; a foil that is
            not one token, or equals an answer token, makes that item an error row.
        resolution: None (the block table only), or ``"head"``, ``"neuron"`` or ``"source"``:
            also split each item with :func:`iglens_core.components` (its own forward pass,
            :func:`iglens_core.collect_components`; the same ``steps``, ``estimator``,
            ``quantity`` and foil; ``baseline="embedding"`` only, the path components split) and
            write the parts table below, to :func:`parts_path` ``(out)``; or ``"graph"``: the
            attribution graph of every answer token (:func:`iglens_graph.attribution_graphs`, the
            same settings) as :func:`iglens_tables.graph_frame`'s rows: its top-k nodes and rest, and
            the carried map (node x position) with the rows that make each node add up.
        top_k: with ``resolution``, the parts written per answer token (an integer >= 1), picked
            by :func:`iglens_stats.top_parts` (largest ``|share|``, ties within rounding by the lower index,
            never a part tied with 0).
        corrupted_column: with ``resolution="graph"``, a column of corrupted prompts (e.g. the subject
            swapped), each encoded as its prompt (``chat``) with the same answer tokens after it; answer
            token j (predicted at t) then gets the counterfactual graph of ``f(clean) - f(corrupted)``
            (:func:`iglens_counterfactual.counterfactual_graph` of ids[:t+1], corrupted ids[:t+1], target
            ids[t+1]; ``steps`` its first quadrature nodes, ``quantity`` and foil as above) as
            :func:`iglens_tables.graph_frame`'s rows with ``f_clean``, ``f_corrupted``, ``gap``. A row whose
            corrupted prompt is empty or of another token length is an error row naming the lengths.

    Returns:
        ``(results, errors)`` DataFrames. ``results``: one row per (item, answer token, segment)
        with ``row`` (input row), ``id``, ``token_index``, ``position``, ``token``, ``segment``
        (index j), ``layer`` (its end layer), ``label``, ``value`` (probability credited),
        ``lens_start``, ``lens_end`` (f at the segment's ends), ``p_base``, ``p_final``,
        ``delta_p``, ``onset`` (layer), ``residual`` (the item's max |sum - Δp|), ``quantity`` and
        ``foil`` (the foil's text or None); with ``"logprob"`` or a foil, ``value``, ``lens_*``,
        ``p_*`` and ``delta_p`` are that f (nats for log-probabilities), not probabilities.
        ``errors``: ``row``, ``id``, ``error``. With ``out`` and several ranks, rank 0 returns
        the merged tables, other ranks their own part. ``results.attrs`` holds ``items_run``
        (items attempted in this call, not skipped by ``resume``; on rank 0 with ``out``: by
        all ranks), ``seconds`` (wall time, shards merged) and ``items_per_s``.

        With ``resolution``, a third DataFrame, ``parts``, long format, one row per part written,
        per (item, answer token) in this order: ``kind`` = the resolution (``"source"``,
        ``"head"`` or ``"neuron"``), the top-k parts, ``rank`` 1..k; ``"rest"``, one row: Δp
        minus those k, so that they and it add up to ``delta_p`` exactly; and with ``"source"``
        also ``"head_total"`` (each head of each block: its sources added up; only the heads
        whose total is not tied with 0, as :func:`iglens_stats.top_parts` decides, about 40% of them on the
        packaged model) and
        ``"source_total"`` (every source position up to the predicting one: what all heads of all
        blocks moved from it) with ``"source_rest"`` (MLPs, attention biases, the estimator's
        residual: :meth:`iglens_core.Components.by_source`), adding up to ``delta_p`` exactly.
        With ``"graph"`` the kinds and columns are :func:`iglens_tables.graph_frame`'s (``node``: 0..n).
        Columns: ``row``, ``id``, ``token_index``, ``position``, ``token`` (as in ``results``),
        ``kind``, ``rank``, ``block`` (1..n), ``head`` (0..H-1), ``neuron`` (0..d_ff-1), ``node``,
        ``source_position`` (index in the item's sequence), ``source_token`` (its text), ``share``
        (f credited), ``delta_p``, ``parts_sum`` (the sum of the whole decomposition, written or
        not: every split part, the biases and the sublayers not split; equals ``delta_p`` up to
        the estimator's residual, float rounding with ``"prediction_aware"``), ``quantity``,
        ``foil``; not-applicable entries are null.
    """
    import time
    _check_run_arguments(batch_size, resume, out, resolution, corrupted_column)
    table = igt.read_items(items, prompt_column=prompt_column, answer_column=answer_column,
                           id_column=id_column, foil_column=foil_column, corrupted_column=corrupted_column)
    run = _checked_run(model, readout, layers=layers, steps=steps, estimator=estimator, baseline=baseline,
                       quantity=quantity, resolution=resolution, top_k=top_k)
    run.corrupted_column, run.corrupted = corrupted_column, {}  # row -> corrupted prompt ids (_tokenize)
    rank, world = distributed_rank()
    parts = _prepare_shards(run, out, resume, rank, world, chat=bool(chat), max_new_tokens=max_new_tokens,
                            **table.attrs.get("columns", {}))
    mine, done = _pending_items(table, parts, resume, rank, world)
    started = time.perf_counter()
    sink = _Sink(parts, rank)
    bar = _progress_bar(len(mine), progress)
    sequences, foil_ids = _tokenize(run, tokenizer, mine, chat, sink, bar)
    for rows in _length_batches(sequences, batch_size):
        _run_batch(run, tokenizer, table, rows, sequences, foil_ids, sink, batch_size=batch_size,
                   max_new_tokens=max_new_tokens)
        bar.update(len(rows))
    bar.close()
    results, errors, pieces, items_run = _final_tables(sink, table, mine, done, out, world,
                                                       split=resolution is not None)
    seconds = time.perf_counter() - started
    results.attrs.update(items_run=items_run, seconds=seconds,
                         items_per_s=items_run / seconds if seconds > 0 else float("nan"))
    return (results, errors) if resolution is None else (results, errors, pieces)


# The steps of attribute_dataset, in the order it takes them.

def _check_run_arguments(batch_size, resume: bool, out, resolution=None, corrupted_column=None) -> None:
    """The arguments that need neither the items nor the model, checked first."""
    if corrupted_column is not None and resolution != "graph":
        raise ValueError(f"corrupted_column= (--corrupted-column) reads each row's corrupted prompt for the "
                         f"counterfactual graph, which needs resolution='graph' (--resolution graph), got "
                         f"resolution={resolution!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if resume and out is None:
        raise ValueError("resume=True needs out= (the shards to resume from)")
    if out is not None and Path(out).suffix != ".parquet":
        raise ValueError(f"out must be a .parquet file (the results are written as parquet), got {str(out)!r}")


def _checked_run(model, readout: Optional[Readout], *, layers, steps, estimator, baseline, quantity,
                 resolution, top_k) -> SimpleNamespace:
    """The model and the settings, checked once before any item runs: the run's readout (built here,
    or the one given, which must come from ``model``), the model's fingerprint (taken once, for the
    traces and the settings record), the resolved layers, and what :func:`ig_lens` takes."""
    check_quantity(quantity)
    if readout is None:
        readout = Readout(model)
        fingerprint = readout.model_fingerprint  # model_fingerprint(model), taken by the readout
    else:
        check_same_model(model, readout=readout)
        fingerprint = model_fingerprint(model)
    layers = check_layers(layers, readout.adapter.n_layers)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    check_steps(readout, steps, estimator, False)
    _check_dataset_baseline(baseline, readout.hidden_size)
    if resolution is not None and resolution not in DATASET_RESOLUTIONS:
        raise ValueError(f"resolution must be None or one of {DATASET_RESOLUTIONS}, got {resolution!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1 (parts written per answer token), got {top_k!r}")
    if resolution is not None and not (isinstance(baseline, str) and baseline == "embedding"):
        raise ValueError(f"resolution={resolution!r} splits the path from the embedding output h_0, "
                         f"so it needs baseline='embedding', got {baseline if isinstance(baseline, str) else 'a tensor'!r}")
    return SimpleNamespace(model=model, readout=readout, fingerprint=fingerprint, layers=layers,
                           resolution=resolution, top_k=top_k,
                           method=dict(steps=steps, estimator=estimator, readout=readout, quantity=quantity),
                           baseline=baseline)


def _prepare_shards(run: SimpleNamespace, out, resume: bool, rank: int, world: int, **recorded) -> Optional[Path]:
    """``OUT.parts/`` ready for the run (None without ``out``): with ``resume`` the settings are
    compared with the stored ones (every rank, so all stop alike); rank 0 then deletes old shards
    (no ``resume``) and writes the settings. ``recorded``: chat, max_new_tokens and the column names."""
    if out is None:
        return None
    parts = Path(str(out) + ".parts")
    method = run.method
    settings = _settings_record(run.model, run.fingerprint, layers=run.layers, estimator=method["estimator"],
                                steps=method["steps"], baseline=run.baseline, chat=recorded.pop("chat"),
                                max_new_tokens=recorded.pop("max_new_tokens"), quantity=method["quantity"],
                                resolution=run.resolution,
                                top_k=int(run.top_k) if run.resolution is not None else None, **recorded)
    if resume and parts.is_dir():
        _check_settings(parts, settings)
    if rank == 0:
        parts.mkdir(parents=True, exist_ok=True)
        if not resume:
            for old in parts.glob("*.parquet"):
                old.unlink()
        tmp = parts / f".{SETTINGS_FILE}.tmp"
        tmp.write_text(json.dumps(settings, indent=1), encoding="utf-8")
        os.replace(tmp, parts / SETTINGS_FILE)
    _barrier(world)
    return parts


def _pending_items(table, parts: Optional[Path], resume: bool, rank: int, world: int):
    """This rank's items (``row % world == rank``) not already in a shard, and the ids in the shards."""
    done = set()
    if resume:
        for kind in ("results", "errors"):
            shards = igt.read_shards(parts, kind)
            done |= set(shards["id"]) if shards is not None else set()
    return table[(table["row"] % world == rank) & ~table["id"].isin(done)], done


class _Sink:
    """Where each batch's tables go: a shard in ``OUT.parts/`` per table, written at once, or
    (no ``out``) kept in memory until the end."""

    def __init__(self, parts: Optional[Path], rank: int):
        self.parts, self.rank, self.kept = parts, rank, ([], [], [])

    def add(self, results, errors, pieces=None) -> None:
        if self.parts is None:
            for kept, frame in zip(self.kept, (results, errors, pieces)):
                if frame is not None and len(frame):
                    kept.append(frame)
            return
        import time
        stem = f"rank{self.rank:04d}-{time.time_ns()}"
        if pieces is not None and len(pieces):  # before the results: those mark the items done
            igt.write_shard(pieces.assign(shard=stem), self.parts / f"{stem}.components.parquet")
        if len(errors):
            igt.write_shard(errors.assign(shard=stem), self.parts / f"{stem}.errors.parquet")
        if len(results):
            igt.write_shard(results.assign(shard=stem), self.parts / f"{stem}.results.parquet")


def _progress_bar(total: int, progress: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="IG-Lens dataset", leave=False,
                **({} if progress else dict(disable=True)))  # TQDM_DISABLE applies otherwise


def _error_frame(errors: list):
    import pandas as pd
    return pd.DataFrame(errors, columns=["row", "id", "error"])


def _tokenize(run: SimpleNamespace, tokenizer, mine, chat: bool, sink: _Sink, bar):
    """Each item's ``(prompt ids, answer ids or None: greedy)`` and foil id; a row that cannot run
    (empty prompt, too long, a foil of several tokens, ...) is an error row at once."""
    import pandas as pd
    sequences, foil_ids, errors = {}, {}, []
    for item in mine.itertuples():
        try:
            if item.foil is not None:
                foil = tokenizer(item.foil, add_special_tokens=False)["input_ids"]
                if len(foil) != 1:
                    raise ValueError(f"foil {item.foil!r} must be one token, it tokenises to {len(foil)}")
                foil_ids[item.row] = foil[0]
            if not item.prompt.strip():
                raise ValueError(f"prompt must be a non-empty string, got {item.prompt!r}")
            if item.answer is None:
                prompt = prompt_token_ids(tokenizer, item.prompt, chat)
                check_sequence(run.model, torch.tensor(prompt + prompt[-1:]), len(prompt))
                sequences[item.row] = (prompt, None)
            else:
                ids, prompt_len = encode(tokenizer, item.prompt, item.answer, chat=chat)
                check_sequence(run.model, ids, prompt_len)
                sequences[item.row] = (ids[0, :prompt_len].tolist(), ids[0, prompt_len:].tolist())
            if run.corrupted_column is not None:  # the counterfactual graph: a corrupted prompt of the same length
                pair = sequences.pop(item.row)  # back once the corrupted prompt fits
                bad = prompt_token_ids(tokenizer, item.corrupted, chat) if item.corrupted else []
                if not bad or len(bad) != len(pair[0]):
                    raise ValueError(
                        f"no corrupted prompt in column {run.corrupted_column!r}" if not bad else
                        f"the corrupted prompt {item.corrupted!r} (column {run.corrupted_column!r}) tokenises to "
                        f"{len(bad)} prompt tokens, the prompt {item.prompt!r} to {len(pair[0])}: positions must "
                        "align; give a corruption of the same token length (e.g. a subject of as many tokens)")
                sequences[item.row] = pair
                run.corrupted[item.row] = bad
        except ValueError as err:
            errors.append(dict(row=item.row, id=item.id, error=str(err)))
    sink.add(pd.DataFrame(columns=igt.RESULT_COLUMNS[:-1]), _error_frame(errors))
    bar.update(len(errors))
    return sequences, foil_ids


def _length_batches(sequences: dict, batch_size: int) -> list[list[int]]:
    """The rows in batches of ``batch_size``, shortest sequences (prompt and answer) first."""
    order = sorted(sequences, key=lambda r: len(sequences[r][0]) + len(sequences[r][1] or ()))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def _run_batch(run: SimpleNamespace, tokenizer, table, rows: list, sequences: dict, foil_ids: dict,
               sink: _Sink, *, batch_size: int, max_new_tokens: int) -> None:
    """One batch: the greedy answers it needs, one forward pass and one readout pass (an item that
    raises is run alone and, failing again, becomes an error row), the parts of each item
    (``resolution``), and its tables to the sink."""
    import pandas as pd
    ids_of, foils_of = dict(zip(table["row"], table["id"])), dict(zip(table["row"], table["foil"]))
    greedy = [r for r in rows if sequences[r][1] is None]
    answers = greedy_answers(run.model, tokenizer, [sequences[r][0] for r in greedy],
                             max_new_tokens=max_new_tokens, batch_size=batch_size)
    full = {r: sequences[r] for r in rows}
    full.update({r: (sequences[r][0], answer) for r, answer in zip(greedy, answers)})
    errors = [dict(row=r, id=ids_of[r], error="the model's greedy answer is empty (it stopped at once)")
              for r in greedy if not full[r][1]]
    runnable = [r for r in rows if full[r][1]]
    try:
        attributions = dict(zip(runnable, _attribute(run, runnable, full, foil_ids, batch_size)))
    except ValueError:  # e.g. NaN hidden states of one item: isolate it, run the others
        attributions = {}
        for r in runnable:
            try:
                attributions[r] = _attribute(run, [r], full, foil_ids, batch_size)[0]
            except ValueError as err:
                errors.append(dict(row=r, id=ids_of[r], error=str(err)))
    pieces = []
    if run.resolution is not None:  # one item at a time: its own pass with patterns and values
        for r in list(attributions):
            try:
                pieces.append(_item_parts(run.model, tokenizer, full[r], r, ids_of[r], foils_of[r],
                                          foil_ids.get(r), resolution=run.resolution, top_k=run.top_k,
                                          corrupted=run.corrupted.get(r), **run.method))
            except ValueError as err:
                errors.append(dict(row=r, id=ids_of[r], error=str(err)))
                del attributions[r]
    frames = [_item_frame(a, tokenizer, r, ids_of[r], foils_of[r]) for r, a in attributions.items()]
    sink.add(pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=igt.RESULT_COLUMNS[:-1]),
             _error_frame(errors), pd.concat(pieces, ignore_index=True) if pieces else None)


def _attribute(run: SimpleNamespace, rows: list, full: dict, foil_ids: dict, batch_size: int) -> list[Attribution]:
    """The attributions of ``rows`` (input order): one :func:`collect_batch`, then one
    :func:`ig_lens_batch` for the items without a foil and one for those with one."""
    sequences = [(torch.tensor(full[r][0] + full[r][1]), len(full[r][0])) for r in rows]
    traces = dict(zip(rows, collect_batch(run.model, sequences, batch_size=batch_size,
                                          fingerprint=run.fingerprint)))
    done = {}
    for group in ([r for r in rows if r not in foil_ids], [r for r in rows if r in foil_ids]):
        done.update(zip(group, ig_lens_batch(
            run.model, [traces[r] for r in group], layers=run.layers, baseline=run.baseline,
            foils=[foil_ids[r] for r in group] if group and group[0] in foil_ids else None, **run.method)))
    return [done[r] for r in rows]


def _final_tables(sink: _Sink, table, mine, done: set, out, world: int, *, split: bool):
    """``(results, errors, parts, items_run)``: with ``out``, rank 0 merges every rank's shards
    (after a barrier) and checks that every item has one; another rank reads its own shards;
    without ``out``, the tables kept in memory."""
    import pandas as pd
    parts, rank = sink.parts, sink.rank
    if parts is None:
        return (*igt.result_tables(*(pd.concat(kept, ignore_index=True) if kept else None
                                     for kept in sink.kept)), len(mine))
    _barrier(world)
    if rank != 0:  # this rank's own shards
        return (*igt.result_tables(*(igt.read_shards(parts, kind, f"rank{rank:04d}-")
                                     for kind in ("results", "errors", "components"))), len(mine))
    # after the barrier: the whole run's items over the whole run's time
    items_run = int((~table["id"].isin(done)).sum())
    results, errors, pieces = igt.merge_shards(parts, Path(out), split)
    missing = set(table["id"]) - set(results["id"]) - set(errors["id"])
    if missing:  # e.g. another node's shards written to a folder rank 0 cannot see
        raise FileNotFoundError(
            f"{len(missing)} items have no shard in {parts} after every rank finished "
            f"(e.g. {sorted(missing)[:3]}): with several nodes, out= must lie on a file "
            "system that every node shares")
    return results, errors, pieces, items_run
