"""The ``iglens`` command: one prompt (a table, optionally the interactive view) or ``--dataset``.

    iglens "What is the capital of Vietnam?" --html vietnam.html
    iglens --dataset facts.csv --out facts.parquet --resume
    iglens --dataset pairs.csv --out cf.parquet --resolution graph --corrupted-column corrupted
    iglens graph "What is the capital of Vietnam?" --word Hanoi --html graph.html --json graph.json
    iglens graph "What is the capital of France?" --word Paris --corrupted "What is the capital of Japan?" --json cf.json
    python -m iglens_cli --help

Every failure is one line, ``iglens: error: ...``, exit status 2 (1 for an unexpected exception, whose
traceback ``--debug`` or ``IGLENS_DEBUG=1`` shows; 130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from iglens_core import (BASELINES, DEFAULT_MODEL, ESTIMATORS, QUANTITIES, collect, collect_components,
                         components, ig_lens, load_model)
from iglens_data import DATASET_RESOLUTIONS, attribute_dataset, encode, token_span
from iglens_tables import attribution_from_frame, parts_path
from iglens_plot import check_html_path, format_table, to_html
from iglens_view import to_contrast_html, write_graph
from iglens_counterfactual import counterfactual_graph


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in its message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _layer_list(text: str) -> list[int]:
    """argparse type of ``--layers``: comma-separated integers, e.g. ``5,10,20``. Their range
    (1..n, strictly increasing) is checked by :func:`iglens_core.check_layers` once the model's
    n is known."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers in 1..n (segment end layers, n = the model's "
            f"number of blocks), e.g. 5,10,20, got {text!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["graph"]:
        return _graph_command(argv[1:])
    parser = argparse.ArgumentParser(
        description="IG-Lens: exact additive attribution of the answer probability to layers.",
        epilog="iglens graph PROMPT ...: the attribution graph of answer tokens, as an offline page and "
               "circuit-tracer's graph JSON (iglens graph --help)")
    parser.add_argument("prompt", nargs="?", help="the question or text (or use --dataset)")
    parser.add_argument("--answer", default=None, help="teacher-forced answer (default: greedy)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="packaged name, local dir or HF id")
    parser.add_argument("--layers", default=None, type=_layer_list,
                        help="comma-separated segment end layers in 1..n, strictly increasing, "
                             "e.g. 5,10,20 (default: all)")
    parser.add_argument("--steps", type=_positive_int, default=16)
    parser.add_argument("--estimator", default="prediction_aware", choices=ESTIMATORS)
    parser.add_argument("--baseline", default="embedding", choices=BASELINES)
    parser.add_argument("--quantity", default="prob", choices=QUANTITIES,
                        help="what is split: the answer token's probability or its log-probability (nats)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=32,
                        help="length limit of greedy answers (>= 1)")
    parser.add_argument("--dataset", default=None, metavar="FILE",
                        help="attribute every row of a .csv, .tsv, .json (list of records), .jsonl or "
                             ".parquet file (UTF-8) with a prompt column and optional answer and id "
                             "columns; an empty answer: the greedy one. The answer is tokenised as "
                             "given: with --no-chat a continuation word needs its leading space "
                             "(' Paris', not 'Paris')")
    parser.add_argument("--prompt-column", default="prompt", help="with --dataset: the prompt column")
    parser.add_argument("--answer-column", default=None,
                        help="with --dataset: the answer column (default: 'answer' if present)")
    parser.add_argument("--id-column", default=None,
                        help="with --dataset: the id column (default: 'id' if present, else the row number)")
    parser.add_argument("--foil-column", default=None,
                        help="with --dataset: a column of one-token foils (e.g. ' Lyon'; empty: none); "
                             "an item with one splits f(answer) - f(foil) (default: 'foil' if present)")
    parser.add_argument("--corrupted-column", default=None, metavar="COL",
                        help="with --dataset and --resolution graph: a column of corrupted prompts of the same "
                             "token length (e.g. another subject); each answer token gets the counterfactual "
                             "graph of f(prompt) - f(corrupted) instead, read with the row's answer")
    parser.add_argument("--out", default=None, metavar="OUT.parquet",
                        help="with --dataset (required there): the results file; the errors go to "
                             "OUT.errors.parquet and the shards to OUT.parquet.parts/")
    parser.add_argument("--batch-size", type=_positive_int, default=16,
                        help="with --dataset: items per batch")
    parser.add_argument("--resume", action="store_true", help="with --dataset: skip ids in OUT.parts/")
    parser.add_argument("--resolution", default=None, choices=DATASET_RESOLUTIONS,
                        help="with --dataset: also split every answer token over heads, neurons or "
                             "(head, source token) pairs and write the top parts, the per-head and "
                             "per-source-token sums to OUT.components.parquet (baseline embedding); "
                             "graph: each answer token's attribution graph, its top nodes (heads and "
                             "neurons at every position, token embeddings, constants) and the carried "
                             "map (node x position); source with --html: the views gain the "
                             "source-token panel (with a prompt: source and --html only)")
    parser.add_argument("--top-k", default=None, type=_positive_int, metavar="K",
                        help="with --resolution: parts written per answer token, an integer >= 1 "
                             "(default 20)")
    parser.add_argument("--html", default=None, metavar="OUT.html",
                        help="also write the interactive view (layer and sublayer) to this file; "
                             "with --dataset a folder: one view per item, ID.html")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also: IGLENS_DEBUG=1); without it every "
                             "error is one line")
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.dataset is None):
        parser.error("give exactly one of a prompt or --dataset FILE")
    if args.dataset is not None and args.out is None:
        parser.error("--dataset needs --out OUT.parquet (where the results are written)")
    if args.top_k is not None and args.resolution is None:
        parser.error(f"--top-k needs --resolution {'|'.join(DATASET_RESOLUTIONS)} (the parts it counts)")
    if args.corrupted_column is not None and (args.dataset is None or args.resolution != "graph"):
        parser.error("--corrupted-column needs --dataset FILE and --resolution graph (it gives each answer token "
                     f"the counterfactual graph), got {'no --dataset' if args.dataset is None else f'--resolution {args.resolution}'}")
    if args.prompt is not None and args.resolution is not None and (args.resolution != "source" or not args.html):
        parser.error("with a prompt, --resolution takes only source, with --html (the source-token panel); "
                     "head and neuron tables: --dataset")
    torch.set_grad_enabled(False)
    return _guarded(lambda: _main_dataset(args) if args.dataset is not None else _main_prompt(args),
                    debug=args.debug or os.environ.get("IGLENS_DEBUG", "") not in ("", "0"))


def _graph_command(argv: Sequence[str]) -> int:
    """``iglens graph PROMPT``: :func:`iglens_view.write_graph` on the prompt's answer."""
    parser = argparse.ArgumentParser(
        prog="iglens graph", description="The exact attribution graph of answer tokens (positions x blocks, "
        "heads, neurons, token embeddings), pruned, as one offline interactive page and/or circuit-tracer's "
        "graph JSON (the file Neuronpedia's and circuit-tracer's viewers load).")
    parser.add_argument("prompt", help="the question or text")
    parser.add_argument("--answer", default=None, help="teacher-forced answer (default: greedy)")
    parser.add_argument("--html", default=None, metavar="OUT.html", help="the interactive page")
    parser.add_argument("--json", default=None, metavar="OUT.json",
                        help="circuit-tracer's graph JSON (several tokens: OUT-<index>.json each)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tokens", default=None, type=_index_list, metavar="I,J",
                       help="answer token indices (0 = the first answer token), comma-separated; default 0")
    which.add_argument("--word", default=None, help="the first answer token of this word (e.g. Hanoi)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="packaged name, local dir or HF id")
    parser.add_argument("--steps", type=_positive_int, default=16)
    parser.add_argument("--estimator", default="prediction_aware", choices=ESTIMATORS)
    parser.add_argument("--quantity", default="prob", choices=QUANTITIES)
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="per block, the heads (neurons) carrying this share of their |share| are candidates, in (0, 1]")
    parser.add_argument("--min-share", type=float, default=0.05,
                        help="of those, keep the ones carrying at least this share of |Δp|, in [0, 1]")
    parser.add_argument("--min-link", type=float, default=0.01,
                        help="the page draws links carrying at least this share of |Δp| (and all into the logit)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=32, help="length limit of greedy answers")
    parser.add_argument("--corrupted", default=None, metavar="TEXT",
                        help="the counterfactual graph instead: split f(prompt) - f(TEXT), TEXT a prompt of the same "
                             "token length (e.g. another subject), read with the prompt's answer; --html draws its "
                             "carried map (node x position) and heads, --json writes its numbers")
    parser.add_argument("--foil", default=None, metavar="WORD",
                        help="with --corrupted: read f(answer) - f(foil), the foil's first token")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = parser.parse_args(argv)
    if args.foil is not None and args.corrupted is None:
        parser.error("--foil applies to the counterfactual graph: give --corrupted TEXT too")
    if args.html is None and args.json is None:
        parser.error("give --html OUT.html, --json OUT.json or both (where the graph is written)")
    torch.set_grad_enabled(False)
    return _guarded(lambda: _main_graph(args), debug=args.debug or os.environ.get("IGLENS_DEBUG", "") not in ("", "0"))


def _index_list(text: str) -> list[int]:
    """argparse type of ``--tokens``: comma-separated integers >= 0 (their upper bound, the answer's
    length, is checked once the answer is known)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = [-1]
    if min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated answer token indices >= 0, e.g. 0,3, got {text!r}")
    return values


def _main_graph(args) -> int:
    if args.html is not None:
        check_html_path(args.html)  # a bad path fails before the work
    model, tokenizer = load_model(args.model)
    input_ids, prompt_len = encode(tokenizer, args.prompt, args.answer, model=model, chat=not args.no_chat,
                                   max_new_tokens=args.max_new_tokens)
    answer = input_ids[0, prompt_len:]
    chosen = args.tokens or [0]
    if args.word is not None:
        span = token_span(tokenizer, answer, args.word)
        if span is None:
            raise ValueError(f"--word {args.word!r} does not occur in the answer {tokenizer.decode(answer)!r}")
        chosen = [span[0]]
    if max(chosen) >= len(answer):
        raise ValueError(f"--tokens must be answer token indices in 0..{len(answer) - 1} (the answer "
                         f"{tokenizer.decode(answer)!r} has {len(answer)} tokens), got {chosen}")
    tokens = [tokenizer.decode([i]) for i in input_ids[0].tolist()]
    if args.corrupted is not None:
        return _contrast(args, model, tokenizer, input_ids, prompt_len, chosen[0], tokens)
    views = write_graph(model, input_ids, prompt_len, tokens, answer_tokens=chosen, html_path=args.html,
                            json_path=args.json, fraction=args.fraction, min_share=args.min_share,
                            min_link=args.min_link, estimator=args.estimator, steps=args.steps,
                            quantity=args.quantity, scan=args.model,
                            title=f"{args.model}: {args.prompt!r} -> {tokenizer.decode(answer)!r}")
    print(f"model: {args.model}   answer: {tokenizer.decode(answer)!r}")
    for k, view in zip(chosen, views):
        sums = view.completeness()
        kept = sum(node.kind in ("head", "neuron") for node in view.nodes)
        print(f"answer token {k} {view.label!r} (predicted at position {view.graph.position}): Δ = {sums['delta']:+.4f}, "
              f"{kept} heads and neurons kept; links into the logit + constants add up to it within {sums['gap']:.1e}")
    if args.html is not None:
        print(f"interactive graph: {args.html}")
    if args.json is not None:
        print(f"circuit-tracer graph: {args.json if len(views) == 1 else ', '.join(f'{Path(args.json).stem}-{k}.json' for k in chosen)}")
    return 0


def _contrast(args, model, tokenizer, input_ids, prompt_len: int, token: int, tokens: list) -> int:
    """``iglens graph PROMPT --corrupted TEXT``: the counterfactual graph of one answer token, as JSON and/or a page."""
    import json
    answer = tokenizer.decode(input_ids[0, prompt_len:])
    corrupted_ids, corrupted_len = encode(tokenizer, args.corrupted, answer, chat=not args.no_chat)
    t = prompt_len - 1 + token  # the predicting position
    if corrupted_len != prompt_len or corrupted_ids.shape != input_ids.shape:
        raise ValueError(f"--corrupted must tokenize to the prompt's length ({prompt_len} prompt tokens) so that every "
                         f"position aligns; {args.corrupted!r} gives {corrupted_len}: pick a subject of the same token length")
    foil = None
    if args.foil is not None:
        ids = tokenizer(args.foil if args.foil.startswith(" ") or args.no_chat else args.foil, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"--foil {args.foil!r} tokenizes to no tokens")
        foil = ids[0]
    graph = counterfactual_graph(model, input_ids[:, :t + 1], corrupted_ids[:, :t + 1], int(input_ids[0, t + 1]),
                                 quantity=args.quantity, foil=foil, steps=args.steps)
    shares = graph.carried / graph.delta  # (n+1, S) share of delta
    heads = graph.heads.sum(-1)  # (n, H)
    top = [(int(i) // heads.shape[1] + 1, int(i) % heads.shape[1], float(heads.flatten()[i]))
           for i in heads.flatten().abs().argsort(descending=True)[:10]]
    out = dict(model=args.model, prompt=args.prompt, corrupted=args.corrupted, answer_token=tokens[t + 1],
               position=t, quantity=args.quantity, foil=args.foil, f_clean=graph.f_clean, f_corrupted=graph.f_corrupted,
               delta=graph.delta, gap=graph.gap, tokens=tokens[:t + 1], first_difference=graph.first,
               carried=graph.carried.tolist(), heads=graph.heads.tolist(),
               top_heads=[dict(block=b, head=h, share=v) for b, h, v in top])
    if args.json is not None:
        Path(args.json).write_text(json.dumps(out))
    if args.html is not None:
        to_contrast_html(graph, tokens, args.html, corrupted_tokens=[tokenizer.decode([i]) for i in corrupted_ids[0].tolist()],
                         title=f"{args.model}: {args.prompt!r} against {args.corrupted!r} -> {tokens[t + 1]!r}")
    peak = shares[:-1, :t].abs().max(0).values  # each earlier position's largest share at any node
    where = int(peak.argmax())
    print(f"model: {args.model}   answer token {tokens[t + 1]!r} at position {t}: f(clean) {graph.f_clean:.4f}, "
          f"f(corrupted) {graph.f_corrupted:.4f}, delta {graph.delta:+.4f}; every node adds up to it within "
          f"{abs(graph.gap):.1e}")
    print(f"the earlier position carrying the most: {where} {tokens[where]!r} ({float(peak[where]):.0%} of delta at its peak)")
    print(f"counterfactual graph: {', '.join(p for p in (args.json, args.html) if p is not None)}")
    return 0


def _guarded(command, *, debug: bool) -> int:
    """Run ``command``; every failure is one line on stderr, ``iglens: error: ...``, and exit status 2
    (a bad value, a file that is missing, a directory or unreadable: ValueError, OSError) or 1 (any
    other exception: a bug, the traceback shown with ``--debug`` or ``IGLENS_DEBUG=1``). Ctrl-C goes
    on up to :func:`command`."""
    try:
        return command()
    except (ValueError, OSError) as err:  # OSError: FileNotFoundError, IsADirectoryError, PermissionError
        if debug:
            raise
        print(f"iglens: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - one line unless --debug
        if debug:
            raise
        print(f"iglens: error: unexpected {type(err).__name__}: {_one_line(err)} (a bug: "
              "run again with --debug or IGLENS_DEBUG=1 for the traceback, and report it)", file=sys.stderr)
        return 1


def command(argv: Optional[Sequence[str]] = None) -> int:
    """The ``iglens`` executable: :func:`main`, and Ctrl-C one line and exit status 130 (:func:`main`
    itself lets KeyboardInterrupt go on up to its caller)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("iglens: interrupted (with --dataset, the shards written so far stay: --resume goes on "
              "from them)", file=sys.stderr)
        return 130


def _one_line(err: BaseException) -> str:
    return str(err).replace("\r\n", " ").replace("\n", " ")


def _main_prompt(args) -> int:
    """One prompt: the table, and with ``--html`` the interactive view."""
    html_path = check_html_path(args.html) if args.html else None  # a bad path fails before the work
    model, tokenizer = load_model(args.model)
    input_ids, prompt_len = encode(tokenizer, args.prompt, args.answer, model=model,
                                   chat=not args.no_chat, max_new_tokens=args.max_new_tokens)
    trace = collect(model, input_ids, prompt_len, sublayer=html_path is not None)
    attribution = ig_lens(model, trace, layers=args.layers, baseline=args.baseline,
                          steps=args.steps, estimator=args.estimator, quantity=args.quantity)
    sublayer = (ig_lens(model, trace, baseline=args.baseline, steps=args.steps,
                        estimator=args.estimator, resolution="sublayer", quantity=args.quantity)
                if html_path is not None else None)
    sources = None
    if args.resolution == "source":
        if args.baseline != "embedding":
            raise ValueError(f"--resolution source splits the path from the embedding output h_0, "
                             f"so it needs --baseline embedding, got {args.baseline!r}")
        sources = components(model, collect_components(model, input_ids, prompt_len, sources=True),
                             resolution="source", steps=args.steps, estimator=args.estimator,
                             quantity=args.quantity)
    tokens = trace.tokens(tokenizer)
    print(f"model: {args.model}   answer: {tokenizer.decode(trace.targets)!r}")
    print(format_table(attribution, tokens))
    if html_path is not None:
        source_tokens = [tokenizer.decode([i]) for i in input_ids[0].tolist()] if sources is not None else None
        print(f"interactive view: {to_html(attribution, tokens, html_path, sublayer=sublayer, sources=sources, source_tokens=source_tokens)}")
    return 0


def _main_dataset(args) -> int:
    """``--dataset``: :func:`attribute_dataset` and a one-line summary (rank 0 prints it)."""
    device = None
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # one GPU per process
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    if args.html and not Path(args.html).is_dir():
        raise ValueError(f"with --dataset, --html names an existing folder, got {args.html!r}")
    model, tokenizer = load_model(args.model, device=device)
    tables = attribute_dataset(
        model, tokenizer, args.dataset, layers=args.layers, steps=args.steps,
        estimator=args.estimator, baseline=args.baseline, chat=not args.no_chat,
        batch_size=args.batch_size, out=args.out, resume=args.resume,
        max_new_tokens=args.max_new_tokens, prompt_column=args.prompt_column,
        answer_column=args.answer_column, id_column=args.id_column, quantity=args.quantity,
        foil_column=args.foil_column, resolution=args.resolution,
        top_k=args.top_k if args.top_k is not None else 20, corrupted_column=args.corrupted_column)
    results, errors = tables[:2]
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        stats = results.attrs
        worst = float(results["residual"].max()) if len(results) else float("nan")
        print(f"{results['id'].nunique()} items done, {len(errors)} failed, worst residual "
              f"{worst:.1e}, {stats['items_per_s']:.2f} items/s ({stats['items_run']} run in "
              f"{stats['seconds']:.1f} s)" + (f"; results in {args.out}" if args.out else ""))
        if args.resolution is not None:
            what = "carried map, rest" if args.resolution == "graph" else "sums, rest"
            what += ", counterfactual graphs" if args.corrupted_column else ""
            print(f"{len(tables[2])} {args.resolution} rows (top {args.top_k or 20} per answer token, "
                  f"{what}) in {parts_path(args.out)}")
        if args.html:
            views = _dataset_views(results, args, tables[2] if args.resolution == "source" else None)
            print(f"interactive views: {len(views)} files in {args.html}")
    return 0


def _dataset_views(results, args, parts=None) -> list[Path]:
    """``--dataset --html DIR``: one view per item, ``DIR/<id>.html``, sharing one plotly.min.js;
    with ``parts`` (the parts table of ``--resolution source``) each gains the source-token panel."""
    import re
    written = []
    for item, rows in results.groupby("id", sort=False):
        attribution = attribution_from_frame(rows, estimator=args.estimator, steps=args.steps,
                                          baseline=args.baseline)
        tokens = rows.sort_values(["token_index", "segment"]).drop_duplicates("token_index")["token"]
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(item))
        if Path(args.html) / f"{name}.html" in written:  # two ids that differ only in odd characters
            name += f"-{len(written)}"
        quantity, foil = rows["quantity"].iloc[0], bool(rows["foil"].notna().any())
        written.append(to_html(attribution, tokens.tolist(), Path(args.html) / f"{name}.html",
                               title=f"{item} ({quantity}{', foil ' + repr(rows['foil'].iloc[0]) if foil else ''}): "
                                     f"max |row sum - Δ| = {attribution.residual:.1e}",
                               plotlyjs="directory", quantity=quantity, foil=foil,
                               sources=parts[parts["id"] == item] if parts is not None else None))
    return written


if __name__ == "__main__":
    sys.exit(command())
