"""IG-Lens performance benchmark (issue 5), run by ``make bench``.

Prints one table (measure, ours, reference, ratio, target, met?) and writes the scaling plot
``figures/bench_scaling.png``. Every ratio compares two things timed in the *same* run, in
interleaved rounds, each the best (minimum) wall time over its repeats, because a shared machine
is noisy: absolute times drift between runs, ratios much less.

Items, in the order of the issue:

1. the exact map (prediction-aware, every layer, no profile) against a straightforward
   all-points version (every grid point, full log-softmax, 4096-row chunks), and against one
   logit-lens pass over the same nodes;
2. the profile (``profile=True``): the FLOP/s that reading out every point would need, over a
   plain matmul of the same shapes; the core gets the points from one head product per path node
   (``Readout.along_segments``), and the per-point readout is timed beside it;
3. captum's ``IntegratedGradients`` per segment (autograd): speed-up and completeness residuals;
4. the backward-free gradient estimators against an autograd implementation at equal ``m``
   (and against forward-mode jvp at every point);
5. the greedy answer with a KV cache against re-running the whole sequence per new token;
6. peak extra memory of a Llama-3.2-1B-sized readout against the configured memory budget;
7. model load: cached reload against GGUF conversion;
8. scaling of the profile with tokens, segments and ``m`` (the plot);
10. dataset attribution (``igd.attribute_dataset``) of ``--facts`` facts of ``data/facts.csv``,
    teacher-forced, against the plain per-item loop (encode + collect + ig_lens), against its
    floor (block FLOPs over every position + the head over the T(n+1) path nodes at the plain
    matmul rate), its peak memory at two dataset sizes, and 2 processes (torchrun) against 1;
11. components (issue 15): every head and every neuron of every block at m = 16 against reading
    out the same grid, and against captum ``LayerIntegratedGradients`` over the same head and
    neuron activations; every (block, head, source position) share against the heads alone, and
    the log-probability and logit-difference readouts against p(y) (issue 21);
12. activation patching of every node of one fact against a loop of spliced full forward passes;
13. causal tracing: the position x node grid of one fact (``causal_trace``) against one spliced
    full forward pass per cell;
14. Dual Path Attribution's ablation protocol for one fact (10 fractions x 2 modes, batched) against
    one forward pass per fraction, and IG-Lens's component scores, its graph's scores, mask IG's and
    (where the method is there) DPA's against AtP's on the same items (issues 23, 34);
15. the whole attribution graph of one answer token (``iglens_graph.attribution_graph``, with and
    without edges) against AtP's forward and backward pass on the same item, short and long prompt,
    with a cProfile split of one call (recording pass, readout, linearised blocks, sweep) (issue 31);
16. the counterfactual graph of one fact (``iglens_counterfactual.counterfactual_graph``: states only, and
    with heads, neurons and edges) against EAP-IG's m forward and backward passes at the same m (its
    cost floor: the interpolated inputs in one batch, every block output's gradient kept) and AtP
    per state (issue 43), the float64 chain and the float32 one (issue 45), with the float32 map's distance
    from the float64 one;

and the levers measured for the readout (node products, chunk rows, log-softmax vs logsumexp,
the tangent's product, inference mode).

Usage::

    python benchmarks/bench.py                 # CI size, a few minutes on one CPU core
    python benchmarks/bench.py --full          # item 6 at 64 tokens, longer scaling sweeps
    python benchmarks/bench.py --device cuda --dtype bfloat16 --tf32
    python benchmarks/bench.py --only 1,2      # some items only
    python benchmarks/bench.py --only 10       # dataset attribution alone
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import iglens_core as ig  # noqa: E402
import iglens_data as igd  # noqa: E402
import iglens_plot as igp  # noqa: E402
import iglens_baselines as igb  # noqa: E402
import iglens_causal as igc  # noqa: E402
import iglens_dpa as igdpa  # noqa: E402
import iglens_graph as iggraph  # noqa: E402
import iglens_counterfactual as igcf  # noqa: E402

PROMPT = "What is the capital of Vietnam?"
ANSWER = "The capital of Vietnam is Hanoi."
STORY = "Write a long story about a dragon who learns to cook."  # a greedy answer >= 64 tokens
PASSAGE = ("France is a country in Western Europe. Its territory reaches from the Mediterranean Sea to the "
           "English Channel and the North Sea, and from the Rhine to the Atlantic Ocean. It shares borders with "
           "Belgium, Luxembourg, Germany, Switzerland, Italy, Monaco, Andorra and Spain. The country is divided "
           "into regions and departments, and its largest cities include Marseille, Lyon, Toulouse, Nice and "
           "Nantes. Its rivers include the Loire, the Rhone and the Garonne, and its highest mountain is Mont "
           "Blanc in the Alps.")  # a context before the fact prompt, for item 14's long case
NAIVE_CHUNK = 4096  # rows per chunk of the straightforward reference
MASK_STEPS = 32  # points of mask IG's gate path in item 14 (notebook 10's default)
GiB, MiB = 2**30, 2**20


# ---------------------------------------------------------------------------
# timing, memory, table
# ---------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def best_of(fns: dict[str, Callable], repeats: int, device: torch.device,
            warmup: bool = True) -> dict[str, float]:
    """Minimum wall time (s) of each function over ``repeats`` interleaved rounds.

    Interleaving (a, b, a, b, ...) exposes every function to the same load on a shared machine.
    """
    if warmup:
        for fn in fns.values():
            fn()
    best = {name: math.inf for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def timed(fn: Callable, device: torch.device):
    """(result, wall seconds) of one call."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def _proc_status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakMemory:
    """Peak *extra* memory of the enclosed block, in bytes (``.peak``).

    CUDA: ``torch.cuda.max_memory_allocated`` minus what was allocated at the start (tensors
    only). CPU (Linux): the process's peak resident set size during the block minus its resident
    size at the start: the peak is reset by writing 5 to ``/proc/self/clear_refs`` and read from
    ``VmHWM``; freed heap memory is handed back first (``malloc_trim``) so that memory freed
    earlier cannot hide new allocations. This counts every byte the block touched (tensors,
    temporaries, library buffers), not only torch's tensors. The CPU measurements run in a child
    process (:func:`in_child`) whose glibc hands every buffer of 1 MiB or more straight back to
    the system when it is freed; otherwise the heap keeps freed chunks of up to 32 MiB resident
    and the peak says more about the allocator than about the code.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            Path("/proc/self/clear_refs").write_text("5")
            self.start = _proc_status_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.peak = _proc_status_bytes("VmHWM") - self.start
        return False


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def in_child(ctx, item: int, measure: Callable[[], object]):
    """Run ``measure()`` (JSON-able result) for a memory item.

    On a CPU it runs in a fresh child process (``--memory-child``) whose glibc returns freed
    buffers >= 1 MiB to the system at once, so that peak RSS follows live memory; on CUDA, and
    in the child itself, it runs here.
    """
    args = ctx.args
    if ctx.device.type != "cpu" or args.memory_child:
        result = measure()
        if args.memory_child:
            print("RESULT " + json.dumps(result), flush=True)
        return result
    command = [sys.executable, str(Path(__file__).resolve()), "--only", str(item), "--memory-child",
               "--device", args.device, "--dtype", args.dtype, "--model", args.model,
               "--grad-steps", str(args.grad_steps), "--memory-tokens", str(args.memory_tokens),
               "--facts", str(args.facts)]
    command += ["--full"] if args.full else []
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


@dataclass
class Row:
    measure: str
    ours: str
    reference: str
    ratio: str
    target: str
    met: Optional[bool]  # None: no target, reported only


ROWS: list[Row] = []


def add(measure, ours, reference, ratio, target="", met=None):
    ROWS.append(Row(measure, ours, reference, ratio, target, met))
    print(f"  [{measure}] ours {ours} | ref {reference} | {ratio} | {target} "
          f"{'' if met is None else ('met' if met else 'NOT met')}", file=sys.stderr, flush=True)


def print_table(header: str) -> None:
    cols = ("measure", "ours", "reference", "ratio", "target", "met?")
    cells = [tuple(c.replace("|", "\\|") for c in (r.measure, r.ours, r.reference, r.ratio, r.target))
             + ("-" if r.met is None else ("yes" if r.met else "**no**"),) for r in ROWS]  # markdown
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"
    print(header)
    print()
    print(line(cols))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print(line(row))


# ---------------------------------------------------------------------------
# references written here, independently of the core
# ---------------------------------------------------------------------------

def head_logits(adapter: ig.Adapter, rows: torch.Tensor) -> torch.Tensor:
    """(rows, d) -> (rows, V) float32 logits: final norm, head, logit scale, soft-cap."""
    logits = adapter.head(adapter.norm(rows)).float()
    if adapter.logit_scale != 1.0:
        logits = logits * adapter.logit_scale
    if adapter.softcap:
        logits = torch.tanh(logits / adapter.softcap) * adapter.softcap
    return logits


def naive_all_points(adapter: ig.Adapter, nodes: torch.Tensor, targets: torch.Tensor, m: int,
                     chunk: int = NAIVE_CHUNK) -> torch.Tensor:
    """The straightforward prediction-aware map: evaluate f at every grid point and difference.

    Every segment's own grid ``alpha = 0, 1/m, ..., 1`` (``K*(m+1)`` points per token, the shared
    endpoints evaluated twice), stacked, read out in ``chunk``-row chunks with a full
    log-softmax over the vocabulary; segment value = sum of the step differences.

    Args:
        nodes: (K+1, T, d) the path nodes, baseline first.
        targets: (T,) token ids.

    Returns:
        (T, K) probability per segment.
    """
    K, T, d = nodes.shape[0] - 1, nodes.shape[1], nodes.shape[2]
    alphas = torch.linspace(0, 1, m + 1, dtype=nodes.dtype, device=nodes.device)
    starts, deltas = nodes[:-1], nodes[1:] - nodes[:-1]  # (K, T, d)
    points = starts[:, :, None] + alphas[None, None, :, None] * deltas[:, :, None]  # (K, T, m+1, d)
    rows = points.reshape(-1, d)
    ids = targets[None, :, None].expand(K, T, m + 1).reshape(-1)
    probs = torch.empty(rows.shape[0], device=rows.device)
    for start in range(0, rows.shape[0], chunk):
        logp = torch.log_softmax(head_logits(adapter, rows[start:start + chunk]), -1)
        probs[start:start + chunk] = logp.gather(-1, ids[start:start + chunk, None])[:, 0].exp()
    grid = probs.reshape(K, T, m + 1)
    return (grid[..., 1:] - grid[..., :-1]).sum(-1).T


def target_prob(adapter: ig.Adapter, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Differentiable f: (rows, d), (rows,) -> (rows,) target probability."""
    return torch.log_softmax(head_logits(adapter, rows), -1).gather(-1, ids[:, None])[:, 0].exp()


def autograd_estimator(adapter: ig.Adapter, nodes: torch.Tensor, targets: torch.Tensor,
                       estimator: str, m: int, chunk: int) -> torch.Tensor:
    """A gradient estimator the usual way: f forward, ``autograd.grad`` backward, dot with the step.

    Returns:
        (T, K) ``sum_s w_s <h_Lj - h_L(j-1), grad f(point_s)>``.
    """
    alphas, weights = ig.quadrature(estimator, m)
    alphas, weights = alphas.to(nodes), weights.to(nodes)
    starts, deltas = nodes[:-1], nodes[1:] - nodes[:-1]  # (K, T, d)
    points = starts[:, :, None] + alphas[None, None, :, None] * deltas[:, :, None]  # (K, T, m', d)
    K, T, mm, d = points.shape
    rows = points.reshape(-1, d)
    dirs = deltas[:, :, None].expand_as(points).reshape(-1, d)
    ids = targets[None, :, None].expand(K, T, mm).reshape(-1)
    slopes = torch.empty(rows.shape[0], device=rows.device)
    with torch.enable_grad():
        for start in range(0, rows.shape[0], chunk):
            x = rows[start:start + chunk].detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(target_prob(adapter, x, ids[start:start + chunk]).sum(), x)
            slopes[start:start + chunk] = (grad * dirs[start:start + chunk]).sum(-1)
    return (slopes.reshape(K, T, mm) * weights).sum(-1).T


def per_point(model, memory_budget: int = ig.DEFAULT_MEMORY_BUDGET) -> ig.Readout:
    """A Readout that reads out every grid point on its own (the paper's single batched pass).

    Without the norm's form the core falls back to stacking every point through norm and head.
    """
    readout = ig.Readout(model, memory_budget=memory_budget)
    readout.norm_kind = None
    return readout


class BareReadoutModel(nn.Module):
    """Only the last step of a Llama-style model (RMSNorm + untied head), random weights, no blocks.

    Enough for ``ig.Readout`` and ``ig.ig_lens`` on a synthetic trace of any size.
    """

    def __init__(self, hidden_size: int, vocab_size: int, seed: int = 0):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        torch.manual_seed(seed)
        self.layers = nn.ModuleList()
        self.norm = LlamaRMSNorm(hidden_size, eps=1e-5)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.config = SimpleNamespace()
        with torch.no_grad():
            self.norm.weight.copy_(1.0 + 0.5 * torch.randn(hidden_size))
            self.lm_head.weight.normal_(0.0, 2.0 / math.sqrt(hidden_size))

    def get_output_embeddings(self):
        return self.lm_head


def synthetic_trace(readout: ig.Readout, n_layers: int, tokens: int, seed: int = 0) -> ig.Trace:
    """A random-walk residual stream (n+1, T, d) whose last node predicts its target well."""
    gen = torch.Generator().manual_seed(seed)
    d = readout.hidden_size
    steps = torch.randn(n_layers + 1, tokens, d, generator=gen)
    hidden = steps.cumsum(0) / math.sqrt(n_layers + 1)
    with torch.no_grad():
        logits = readout.logits(hidden[-1])
    targets = logits.argmax(-1).cpu()
    return ig.Trace(torch.zeros(1, tokens + 1, dtype=torch.long), 1, targets, torch.arange(tokens),
                    hidden.to(readout.dtype), readout(hidden[-1], targets).cpu())


# ---------------------------------------------------------------------------
# the items
# ---------------------------------------------------------------------------

def item1_exact_map(ctx) -> None:
    model, trace, readout, args = ctx.model, ctx.trace, ctx.readout, ctx.args
    m, n = 16, trace.n_layers
    nodes = trace.hidden.to(ctx.device)  # (n+1, T, d): embedding baseline and every block
    targets = trace.targets.to(ctx.device)
    ours = ig.ig_lens(model, trace, steps=m, readout=readout)
    naive, first = timed(lambda: naive_all_points(readout.adapter, nodes, targets, m), ctx.device)
    gap = float((ours.values - naive.cpu()).abs().max())
    fast = best_of({"ours": lambda: ig.ig_lens(model, trace, steps=m, readout=readout),
                    "lens": lambda: ig.logit_lens(model, trace, readout)},
                   args.repeats + 2, ctx.device)
    slow = best_of({"naive": lambda: naive_all_points(readout.adapter, nodes, targets, m)},
                   max(1, args.repeats - 2), ctx.device, warmup=False)
    slow["naive"] = min(slow["naive"], first)
    T = len(targets)
    add(f"1. exact map vs all-points reference (T={T}, K={n}, m={m}; {T * n * (m + 1)} points)",
        fmt_time(fast["ours"]), fmt_time(slow["naive"]), f"{slow['naive'] / fast['ours']:.1f}x faster",
        ">= 10x", slow["naive"] / fast["ours"] >= 10)
    add("1. exact map values, max abs difference from the reference", f"{gap:.1e}", "", "",
        "<= 1e-5", gap <= 1e-5)
    add(f"1. exact map vs one logit-lens pass ({T}x{n + 1} nodes)", fmt_time(fast["ours"]),
        fmt_time(fast["lens"]), f"{fast['ours'] / fast['lens']:.2f}x the time", "<= 1.2x",
        fast["ours"] / fast["lens"] <= 1.2)
    ctx.exact_time = fast["ours"]
    ctx.exact = ours


def matmul_reference(readout: ig.Readout, rows: int, device) -> Callable:
    """A plain (rows, d) @ (d, V) product into a preallocated output: the GEMM limit."""
    weight = readout.adapter.head.weight
    x = torch.randn(rows, readout.hidden_size, device=device, dtype=weight.dtype)
    out = torch.empty(rows, readout.vocab_size, device=device, dtype=weight.dtype)
    return lambda: torch.mm(x, weight.t(), out=out)


def item2_profile(ctx) -> None:
    model, trace, readout, args = ctx.model, ctx.trace, ctx.readout, ctx.args
    m, K, T = 16, trace.n_layers, len(trace.targets)
    points = T * (K * m + 1)
    flops = 2 * points * readout.hidden_size * readout.vocab_size  # reading out every point
    every_point = per_point(model, readout.memory_budget)
    budget_rows = max(1, readout.memory_budget // (readout.vocab_size * 4 * 4))
    budget_only = per_point(model, readout.memory_budget)
    budget_only.chunk_rows = lambda extra_copies=3: budget_rows  # the rule before issue 5
    fns = {"profile": lambda: ig.ig_lens(model, trace, steps=m, profile=True, readout=readout),
           "matmul": matmul_reference(readout, points, ctx.device),
           "per_point": lambda: ig.ig_lens(model, trace, steps=m, profile=True, readout=every_point),
           "budget_only": lambda: ig.ig_lens(model, trace, steps=m, profile=True, readout=budget_only)}
    best = best_of(fns, max(1, args.repeats - 1), ctx.device)
    ctx.matmul_rate = flops / best["matmul"]
    frac = best["matmul"] / best["profile"]
    shapes = f"{points} x {readout.hidden_size} @ {readout.hidden_size} x {readout.vocab_size}"
    add(f"2. profile m={m} (node products): FLOP/s of reading out every point vs a plain matmul "
        f"({shapes})", f"{flops / best['profile'] / 1e9:.1f} GFLOP/s ({fmt_time(best['profile'])})",
        f"{ctx.matmul_rate / 1e9:.1f} GFLOP/s ({fmt_time(best['matmul'])})",
        f"{frac:.2f} of the matmul rate", ">= 0.85", frac >= 0.85)
    frac_pp = best["matmul"] / best["per_point"]
    add(f"2. the same profile reading out every point on its own (norm + head per point, the "
        f"paper's single pass; cache-sized chunks)", f"{flops / best['per_point'] / 1e9:.1f} GFLOP/s "
        f"({fmt_time(best['per_point'])})", f"{ctx.matmul_rate / 1e9:.1f} GFLOP/s",
        f"{frac_pp:.2f} of the matmul rate", "report", None)
    gap = float((ig.ig_lens(model, trace, steps=m, profile=True, readout=readout).profile -
                 ig.ig_lens(model, trace, steps=m, profile=True, readout=every_point).profile).abs().max())
    add(f"lever: profile from one head product per path node vs every point read out "
        f"(max |Δf| {gap:.0e})", fmt_time(best["profile"]), fmt_time(best["per_point"]),
        f"{best['per_point'] / best['profile']:.1f}x faster", "keep if > 1", None)
    add(f"lever: chunk rows of the per-point readout, Readout's rule ({readout.chunk_rows()} rows) vs "
        f"the budget alone ({budget_rows} rows)", fmt_time(best["per_point"]), fmt_time(best["budget_only"]),
        f"{best['budget_only'] / best['per_point']:.2f}x faster", "keep if > 1", None)


def item3_captum(ctx) -> None:
    from captum.attr import IntegratedGradients
    model, trace, readout, args = ctx.model, ctx.trace, ctx.readout, ctx.args
    adapter = readout.adapter
    nodes = trace.hidden.to(ctx.device)
    targets = trace.targets.to(ctx.device)
    n_steps = 50
    ig_captum = IntegratedGradients(lambda h, ids: target_prob(adapter, h, ids))

    def run_captum():
        values, deltas = [], []
        with torch.enable_grad():
            for j in range(nodes.shape[0] - 1):  # one call per segment h_L(j-1) -> h_Lj
                attr, delta = ig_captum.attribute(nodes[j + 1], baselines=nodes[j],
                                                  additional_forward_args=(targets,),
                                                  n_steps=n_steps, return_convergence_delta=True)
                values.append(attr.sum(-1).detach())
                deltas.append(delta.detach().abs().max())
        return torch.stack(values, 1).cpu(), float(torch.stack(deltas).max())

    start = time.perf_counter()
    values, segment_residual = run_captum()
    captum_time = time.perf_counter() - start
    exact_time = getattr(ctx, "exact_time", None)
    if exact_time is None:
        exact_time = best_of({"ours": lambda: ig.ig_lens(model, trace, readout=readout)},
                             args.repeats, ctx.device)["ours"]
    ours = ig.ig_lens(model, trace, readout=readout)
    delta_p = ours.delta_p.double()
    captum_residual = float((values.double().sum(-1) - delta_p).abs().max())
    T, K = values.shape
    add(f"3. exact map vs captum IntegratedGradients per segment (n_steps={n_steps}, "
        f"gausslegendre; {K} calls, {T} tokens)", fmt_time(exact_time), fmt_time(captum_time),
        f"{captum_time / exact_time:.0f}x faster", ">= 100x", captum_time / exact_time >= 100)
    add("3. completeness residual max|sum_j - Δp| (captum: and per segment)",
        f"{ours.residual:.1e}", f"{captum_residual:.1e} (per segment {segment_residual:.1e})",
        "", "report", None)


def item4_gradient(ctx) -> None:
    model, trace, readout, args = ctx.model, ctx.trace, ctx.readout, ctx.args
    m = args.grad_steps
    nodes = trace.hidden.to(ctx.device)
    targets = trace.targets.to(ctx.device)
    chunk = max(1, readout.chunk_rows() // 2)  # the rows per chunk Readout.directional uses
    estimators = ("riemann_mid", "gauss_legendre")
    forward_mode = per_point(model, readout.memory_budget)  # Readout.directional at every point
    fns = {(estimator, name): fn for estimator in estimators for name, fn in (
        ("ours", lambda e=estimator: ig.ig_lens(model, trace, steps=m, estimator=e, readout=readout)),
        ("autograd", lambda e=estimator: autograd_estimator(readout.adapter, nodes, targets, e, m, chunk)))}
    fns[(estimators[0], "forward")] = lambda: ig.ig_lens(model, trace, steps=m, estimator=estimators[0],
                                                         readout=forward_mode)

    def measure():
        peaks = {}
        for (estimator, name), fn in fns.items():
            fn()  # warm-up
            with PeakMemory(ctx.device) as peak:
                fn()
            peaks[f"{estimator}/{name}"] = peak.peak
        return peaks

    all_peaks = in_child(ctx, 4, measure)
    if args.memory_child:
        return
    timings = best_of(fns, max(1, args.repeats - 1), ctx.device)
    for estimator in estimators:
        best = {name: timings[(estimator, name)] for name in ("ours", "autograd")}
        peaks = {name: all_peaks[f"{estimator}/{name}"] for name in ("ours", "autograd")}
        results = {name: fns[(estimator, name)]() for name in ("ours", "autograd")}
        ours, ref = results["ours"].values.double(), results["autograd"].cpu().double()
        gap = float((ours - ref).abs().max() / ref.abs().max())
        T, K = ours.shape
        ratio = best["ours"] / best["autograd"]
        add(f"4. {estimator} m={m} backward-free (node products, closed-form slope) vs autograd, time "
            f"(T={T}, K={K}; values agree to {gap:.0e} of the largest)",
            fmt_time(best["ours"]), fmt_time(best["autograd"]), f"{ratio:.2f}x the time",
            "<= 0.75x", ratio <= 0.75)
        mem = peaks["ours"] / max(peaks["autograd"], 1)
        add(f"4. {estimator} m={m} backward-free vs autograd, peak extra memory",
            fmt_bytes(peaks["ours"]), fmt_bytes(peaks["autograd"]), f"{mem:.2f}x", "< 1x", mem < 1)
    forward = timings[(estimators[0], "forward")]
    ours = timings[(estimators[0], "ours")]
    add(f"lever: {estimators[0]} slopes from node products vs forward-mode (jvp) at every point",
        fmt_time(ours), fmt_time(forward), f"{forward / ours:.1f}x faster", "keep if > 1", None)


def item5_generate(ctx) -> None:
    model, tokenizer, args = ctx.model, ctx.tokenizer, ctx.args
    n_new = 64
    ids, prompt_len = igd.encode(tokenizer, STORY, None, model=model, max_new_tokens=n_new)
    answer = ids[0, prompt_len:].tolist()
    prompt_ids = ids[0, :prompt_len].tolist()
    stops = set(igd.stop_token_ids(tokenizer))

    def recompute():
        seq = torch.tensor([prompt_ids], device=ctx.device)
        for _ in range(n_new):  # the whole sequence again for every new token
            next_id = model(seq, use_cache=False).logits[0, -1].argmax()
            if int(next_id) in stops:
                break
            seq = torch.cat([seq, next_id.view(1, 1)], 1)
        return seq[0, prompt_len:].tolist()

    tokens, first = timed(recompute, ctx.device)
    same = tokens == answer
    best = best_of({"cache": lambda: igd.encode(tokenizer, STORY, None, model=model, max_new_tokens=n_new),
                    "recompute": recompute}, max(1, args.repeats - 2), ctx.device, warmup=False)
    best["recompute"] = min(best["recompute"], first)
    if args.repeats > 2:
        best["cache"] = min(best["cache"], best_of({"cache": lambda: igd.encode(
            tokenizer, STORY, None, model=model, max_new_tokens=n_new)}, 1, ctx.device, warmup=False)["cache"])
    ratio = best["recompute"] / best["cache"]
    add(f"5. greedy answer, KV cache (igd.encode) vs re-running the sequence per token "
        f"({len(answer)} new tokens after {prompt_len}; same tokens: {same})",
        fmt_time(best["cache"]), fmt_time(best["recompute"]), f"{ratio:.1f}x faster", ">= 5x",
        ratio >= 5)


def item6_memory(ctx) -> None:
    args = ctx.args
    d, V, K, m = 2048, 128256, 16, 16
    if args.full:
        runs = [(64, ig.DEFAULT_MEMORY_BUDGET), (64, 256 * MiB), (64, 64 * MiB)]
    else:
        T = args.memory_tokens
        runs = [(T, ig.DEFAULT_MEMORY_BUDGET), (T, 256 * MiB), (T, 64 * MiB), (2 * T, 256 * MiB)]

    def measure():
        bare = BareReadoutModel(d, V).to(ctx.device, ctx.dtype).eval()
        traces, results = {}, []
        for T, budget in runs:
            if T not in traces:
                traces[T] = synthetic_trace(ig.Readout(bare, norm=bare.norm, head=bare.lm_head), K, T)
            readout = ig.Readout(bare, norm=bare.norm, head=bare.lm_head, memory_budget=budget)
            ig.ig_lens(bare, synthetic_trace(readout, K, 1), steps=1, profile=True, readout=readout)  # warm-up
            with PeakMemory(ctx.device) as peak:
                result, seconds = timed(lambda: ig.ig_lens(bare, traces[T], steps=m, profile=True,
                                                           readout=readout), ctx.device)
            results.append(dict(T=T, budget=budget, rows=readout.chunk_rows(), seconds=seconds,
                                residual=result.residual, peak=peak.peak))
        return results

    results = in_child(ctx, 6, measure)
    if args.memory_child:
        return
    for run in results:
        T, budget, peak = run["T"], run["budget"], run["peak"]
        points = T * (K * m + 1)
        grid_bytes = points * d * torch.finfo(ctx.dtype).bits // 8
        add(f"6. peak extra memory, 1B-sized readout d={d} V={V}, T={T} K={K} m={m} profile "
            f"({points} points, grid {fmt_bytes(grid_bytes)}; {run['rows']}-row chunks; "
            f"{fmt_time(run['seconds'])}; residual {run['residual']:.0e})",
            fmt_bytes(peak), f"budget {fmt_bytes(budget)}", f"{peak / budget:.2f} of the budget",
            "<= 1", peak <= budget)


def item7_load(ctx) -> None:
    args = ctx.args
    name = ig.DEFAULT_MODEL
    gguf = ig.PACKAGED_MODELS[name]()
    best = best_of({"reload": lambda: ig.load_model(name, device=str(ctx.device), dtype=ctx.dtype)},
                   max(1, args.repeats - 1), ctx.device)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ig.convert_gguf(gguf, Path(tmp) / name)
        convert = time.perf_counter() - start
    add(f"7. model load: cached reload vs GGUF conversion ({name}, {gguf.stat().st_size / MiB:.0f} MiB GGUF)",
        fmt_time(best["reload"]), fmt_time(convert), f"{convert / best['reload']:.0f}x faster", "report", None)


def item8_scaling(ctx) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    model, trace, readout, args = ctx.model, ctx.trace, ctx.readout, ctx.args
    n, T_all = trace.n_layers, len(trace.targets)

    def sub(tokens: int) -> ig.Trace:
        index = torch.arange(tokens) % T_all
        return ig.Trace(trace.input_ids, trace.prompt_len, trace.targets[index], trace.positions[index],
                        trace.hidden[:, index], trace.model_probs[index])

    def layers(K: int) -> list[int]:
        return sorted({max(1, round(n * (j + 1) / K)) for j in range(K)})

    scale = 2 if args.full else 1
    sweeps = {  # name -> list of (tokens, segments, m)
        "tokens": [(t, n, 4) for t in (2, 4, 8, 16, 32 * scale)],
        "segments": [(8, K, 4) for K in (4, 8, 16, n)],
        "m": [(8, n, s) for s in (1, 2, 4, 8, 16 * scale)],
    }
    results = {}
    for sweep, configs in sweeps.items():
        fns = {}
        for T, K, m in configs:
            sub_trace, sub_layers = sub(T), layers(K)
            fns[(T, len(sub_layers), m)] = (lambda tr=sub_trace, ly=sub_layers, s=m:
                                            ig.ig_lens(model, tr, layers=ly, steps=s, profile=True,
                                                       readout=readout))
        results[sweep] = best_of(fns, max(1, args.repeats - 1), ctx.device, warmup=False)
    # cost model of the core's profile: one head product per path node, elementwise work per
    # interior grid point, and a fixed part
    configs = [(T, K, m) for timing in results.values() for (T, K, m) in timing]
    seconds = np.array([t for timing in results.values() for t in timing.values()])
    design = np.array([[T * (K + 1), T * K * (m - 1), 1.0] for T, K, m in configs])
    coef = np.linalg.lstsq(design, seconds, rcond=None)[0]
    fit_error = float(np.max(np.abs(design @ coef - seconds) / seconds))
    fig, ax = plt.subplots(figsize=(7, 4.8))
    slopes = {}
    for (sweep, timing), marker, colour in zip(results.items(), "osD", ("C0", "C1", "C2")):
        x = np.array([T * (K * m + 1) for (T, K, m) in timing], dtype=float)
        y = np.array(list(timing.values()))
        slopes[sweep] = np.polyfit(np.log(x), np.log(y), 1)[0]
        ax.plot(x, y, marker=marker, linestyle="", color=colour,
                label=f"vary {sweep} (time ∝ points^{slopes[sweep]:.2f})")
        model_time = np.array([[T * (K + 1), T * K * (m - 1), 1.0] for T, K, m in timing]) @ coef
        ax.plot(x, model_time, ":", color=colour)
    pts = [T * (K * m + 1) for T, K, m in configs]
    if getattr(ctx, "matmul_rate", None):
        per_point = 2 * readout.hidden_size * readout.vocab_size / ctx.matmul_rate
        grid = np.array([min(pts), max(pts)], dtype=float)
        ax.plot(grid, grid * per_point, "--", color="grey",
                label="one matmul row per point, at the plain matmul rate (item 2)")
    ax.plot([], [], ":", color="black", label=f"cost model: {coef[0] * 1e6:.0f} µs per path node + "
            f"{coef[1] * 1e6:.0f} µs per interior point")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("grid points with f evaluated, T (K m + 1)")
    ax.set_ylabel("wall time of ig_lens(profile=True) (s)")
    ax.set_title(f"Profile cost vs points ({ctx.model_label}, {ctx.device.type}, "
                 f"{torch.get_num_threads()} thread(s))", fontsize=10)
    ax.legend(fontsize=8)
    path = igp.save_figure(fig, "bench_scaling")
    plt.close(fig)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for sweep in ("tokens", "segments", "m"):
        add(f"8. profile scaling with {sweep}: time ∝ points^b (plot {where})",
            f"b = {slopes[sweep]:.2f}", "b = 1 (linear)", "", "b <= 1.1 (at most linear)",
            slopes[sweep] <= 1.1)
    add(f"8. profile cost = a x path nodes + b x interior points (+ c), fitted over all "
        f"{len(configs)} runs (the node products are a fixed part when only m grows)",
        f"a = {coef[0] * 1e6:.0f} µs, b = {coef[1] * 1e6:.0f} µs", "", f"fit within {fit_error:.0%}",
        "report", None)


def levers(ctx) -> None:
    """The readout levers of issue 5, each timed against its alternative on the same points.

    (The chunk-rows lever is timed on the full profile in item 2.)
    """
    readout, args = ctx.readout, ctx.args
    rows = 512
    gen = torch.Generator().manual_seed(0)
    points = ctx.trace.hidden[-1][torch.randint(len(ctx.trace.targets), (rows,), generator=gen)]
    points = (points + 0.5 * torch.randn(points.shape, generator=gen)).to(ctx.device, ctx.dtype)
    directions = torch.randn(points.shape, generator=gen).to(points)
    ids = torch.randint(readout.vocab_size, (rows,), generator=gen).to(ctx.device)
    chosen = readout.chunk_rows()
    adapter = readout.adapter

    def reduce_with(kind: str):
        def run():
            out = torch.empty(rows, device=ctx.device)
            for start in range(0, rows, chosen):
                logits = head_logits(adapter, points[start:start + chosen])
                sl = slice(start, start + chosen)
                if kind == "logsumexp":
                    out[sl] = torch.exp(logits.gather(-1, ids[sl, None])[:, 0] - torch.logsumexp(logits, -1))
                else:
                    out[sl] = torch.log_softmax(logits, -1).gather(-1, ids[sl, None])[:, 0].exp()
            return out
        return run

    def tangents(kind: str):
        step = max(1, chosen // 2)  # as Readout.directional

        def run():
            for start in range(0, rows, step):
                sl = slice(start, start + step)
                if kind == "func.jvp":
                    torch.func.jvp(readout.logits, (points[sl],), (directions[sl],))
                else:
                    readout._logits_and_tangent(points[sl], directions[sl])
        return run

    def inference_mode():
        with torch.inference_mode():
            return readout(points, ids)

    best = best_of({"no_grad": lambda: readout(points, ids), "inference": inference_mode,
                    "lsm": reduce_with("log_softmax"), "lse": reduce_with("logsumexp"),
                    "one_product": tangents("one product"), "func_jvp": tangents("func.jvp")},
                   args.repeats, ctx.device)
    add(f"lever: log_softmax+gather vs gather-logsumexp ({chosen}-row chunks, {rows} points)",
        fmt_time(best["lsm"]), fmt_time(best["lse"]), f"{best['lse'] / best['lsm']:.2f}x faster",
        "keep if > 1", None)
    add(f"lever: logits+tangent, norm jvp + one product vs torch.func.jvp of the readout ({rows} points)",
        fmt_time(best["one_product"]), fmt_time(best["func_jvp"]),
        f"{best['func_jvp'] / best['one_product']:.2f}x faster", "keep if > 1", None)
    add(f"lever: torch.inference_mode vs no_grad (Readout, {rows} points)", fmt_time(best["inference"]),
        fmt_time(best["no_grad"]), f"{best['no_grad'] / best['inference']:.2f}x faster", "keep if > 1.02",
        None)


def _facts(count: int):
    import pandas as pd
    facts = pd.read_csv(ROOT / "data" / "facts.csv")[["id", "prompt", "answer"]]
    if not 1 <= count <= len(facts):
        raise ValueError(f"--facts must lie in 1..{len(facts)}, got {count}")
    return facts.iloc[:count]


def _dataset_floor_flops(model, tokenizer, facts) -> tuple[float, float, int]:
    """(block FLOPs over every position, head FLOPs over the T(n+1) path nodes, tokens).

    Blocks: 2 x (block parameters) per token, plus the attention scores and their product with
    the values (4 L^2 x attention width per block and sequence). Head: 2 d V per path node."""
    adapter = ig.get_adapter(model)
    params = sum(p.numel() for p in adapter.blocks.parameters() if p.dim() == 2)
    config = getattr(model.config, "text_config", None) or model.config
    width = config.num_attention_heads * (getattr(config, "head_dim", None)
                                          or config.hidden_size // config.num_attention_heads)
    n, blocks, head, tokens = adapter.n_layers, 0.0, 0.0, 0
    d, V = adapter.head.weight.shape[1], adapter.head.weight.shape[0]
    for item in facts.itertuples():
        ids, prompt_len = igd.encode(tokenizer, item.prompt, item.answer)
        L, T = ids.shape[1], ids.shape[1] - prompt_len
        blocks += 2 * params * L + 4 * L * L * width * n
        head += 2 * d * V * T * (n + 1)
        tokens += L
    return blocks, head, tokens


def item10_dataset(ctx) -> None:
    model, tokenizer, args = ctx.model, ctx.tokenizer, ctx.args
    facts = _facts(args.facts)
    count = len(facts)

    def plain_loop():  # what a new user writes
        for item in facts.itertuples():
            ids, prompt_len = igd.encode(tokenizer, item.prompt, item.answer)
            ig.ig_lens(model, ig.collect(model, ids, prompt_len))

    def dataset(items=facts):
        return igd.attribute_dataset(model, tokenizer, items, batch_size=args.batch_size, progress=False)

    def measure():  # peak extra memory at half and all of the facts (child process on a CPU)
        dataset(facts.iloc[:4])  # warm-up
        peaks = []
        for size in (count // 2, count):
            with PeakMemory(ctx.device) as peak:
                dataset(facts.iloc[:size])
            peaks.append(dict(size=size, peak=peak.peak))
        return peaks

    peaks = in_child(ctx, 10, measure)
    if args.memory_child:
        return
    readout = ig.Readout(model)
    matmul = matmul_reference(readout, 1024, ctx.device)
    rounds = max(1, args.repeats - 2)  # each function takes tens of seconds on a CPU
    dataset(facts.iloc[:4])  # warm-up on a few facts: a full warm-up round would double the time
    best = best_of({"dataset": dataset, "loop": plain_loop, "matmul": matmul}, rounds, ctx.device,
                   warmup=False)
    best["matmul"] = min(best["matmul"], best_of({"matmul": matmul}, 5, ctx.device)["matmul"])
    rate = 2 * 1024 * readout.hidden_size * readout.vocab_size / best["matmul"]
    blocks, head, tokens = _dataset_floor_flops(model, tokenizer, facts)
    floor = (blocks + head) / rate
    results, _ = dataset()
    worst = float(results["residual"].max())
    ratio = best["loop"] / best["dataset"]
    add(f"10. dataset attribution, {count} facts teacher-forced (batch {args.batch_size}; worst "
        f"residual {worst:.0e}) vs the plain per-item loop (encode + collect + ig_lens)",
        f"{count / best['dataset']:.2f} items/s", f"{count / best['loop']:.2f} items/s",
        f"{ratio:.2f}x faster", ">= 2x", ratio >= 2)
    add(f"10. dataset attribution vs its floor: {(blocks + head) / 1e12:.2f} TFLOP (blocks over "
        f"{tokens} positions {blocks / 1e12:.2f}, head over the path nodes {head / 1e12:.2f}) at the "
        f"plain matmul rate {rate / 1e9:.1f} GFLOP/s", fmt_time(best["dataset"]), fmt_time(floor),
        f"{best['dataset'] / floor:.2f}x the floor", "<= 1.3x", best["dataset"] / floor <= 1.3)
    for run in peaks:
        add(f"10. dataset attribution, peak extra memory at {run['size']} facts",
            fmt_bytes(run["peak"]), f"budget {fmt_bytes(readout.memory_budget)}",
            f"{run['peak'] / readout.memory_budget:.2f} of the budget", "<= 1",
            run["peak"] <= readout.memory_budget)
    _dataset_processes(ctx, facts)


def _dataset_processes(ctx, facts) -> None:
    """The CLI under torchrun with 2 processes (half the threads each) against 1 process."""
    args = ctx.args
    threads = max(2, torch.get_num_threads())  # total threads; 2 processes get half each
    with tempfile.TemporaryDirectory() as tmp:
        csv = Path(tmp) / "facts.csv"
        facts.to_csv(csv, index=False)
        cli = [str(ROOT / "iglens_cli.py"), "--dataset", str(csv), "--model", args.model,
               "--batch-size", str(args.batch_size)]
        torchrun = Path(sys.executable).with_name("torchrun")
        runs = {1: ([sys.executable] + cli, threads),
                2: ([str(torchrun), "--standalone", "--nproc_per_node", "2"] + cli, max(1, threads // 2)),
                "1 thin": ([sys.executable] + cli, max(1, threads // 2))}
        speed = {}
        for procs, (command, each) in runs.items():
            env = dict(os.environ, OMP_NUM_THREADS=str(each), TQDM_DISABLE="1")
            out = Path(tmp) / f"{str(procs).replace(' ', '_')}.parquet"
            done = subprocess.run(command + ["--out", str(out)], env=env,
                                  capture_output=True, text=True, check=True)
            summary = done.stdout.strip().splitlines()[-1]  # "... X items/s (...)"
            speed[procs] = float(summary.split(" items/s")[0].split()[-1])
    add(f"10. dataset attribution, 2 processes (torchrun, {max(1, threads // 2)} thread(s) each) vs 1 "
        f"process ({threads} thread(s)), items/s from the CLI summary; on {os.cpu_count()} cores "
        "both use the same cores, so about 1x is expected", f"{speed[2]:.2f} items/s",
        f"{speed[1]:.2f} items/s", f"{speed[2] / speed[1]:.2f}x", "report (~1x here)", None)
    add(f"10. dataset attribution, 2 processes vs 1 process, {max(1, threads // 2)} thread(s) each "
        "(twice the cores)", f"{speed[2]:.2f} items/s", f"{speed['1 thin']:.2f} items/s",
        f"{speed[2] / speed['1 thin']:.2f}x", "report (<= 2x)", None)


def item11_components(ctx) -> None:
    """Every head and every neuron of every block (ig.components) vs the same grid read out, vs captum."""
    from captum.attr import LayerIntegratedGradients
    model, tokenizer, readout, args = ctx.model, ctx.tokenizer, ctx.readout, ctx.args
    m = 16
    input_ids, prompt_len = igd.encode(tokenizer, PROMPT, ANSWER)
    trace = ig.collect_components(model, input_ids, prompt_len)
    with_sources = ig.collect_components(model, input_ids, prompt_len, sources=True)
    n, T = trace.n_layers, len(trace.targets)
    foil = int(tokenizer.encode(" Paris", add_special_tokens=False)[0])
    ends, _, _ = ig.path_nodes(trace, range(1, n + 1), "sublayer")
    nodes = torch.cat([trace.hidden[:1], ends]).to(ctx.device)  # (2n+1, T, d)
    alphas, weights = ig.quadrature("gauss_legendre", m)
    every_point = per_point(model, readout.memory_budget)
    fns = {"ours": lambda: ig.components(model, trace, steps=m, readout=readout),
           "per_point": lambda: every_point.along_segments(nodes, trace.targets, alphas),
           "grid": lambda: readout.along_segments(nodes, trace.targets, alphas),
           "observed": lambda: ig.components(model, trace, steps=m, readout=readout, estimator="prediction_aware"),
           "head": lambda: ig.components(model, with_sources, steps=m, readout=readout, resolution="head"),
           "source": lambda: ig.components(model, with_sources, steps=m, readout=readout, resolution="source"),
           "logprob": lambda: ig.components(model, trace, steps=m, readout=readout, quantity="logprob"),
           "logit_diff": lambda: ig.components(model, trace, steps=m, readout=readout, quantity="logprob",
                                               foil=foil)}
    best = best_of(fns, max(1, args.repeats - 1), ctx.device)
    ours = fns["ours"]()
    parts = n * (ours.heads.shape[-1] + ours.neurons.shape[-1])
    add(f"11. components: every head and neuron of every block ({parts} parts, T={T}, 2n={2 * n} "
        f"segments, m={m} Gauss-Legendre) vs the same grid read out point by point (f only)",
        fmt_time(best["ours"]), fmt_time(best["per_point"]), f"{best['ours'] / best['per_point']:.2f}x the time",
        "<= 1.5x", best["ours"] / best["per_point"] <= 1.5)
    add("11. components vs the same grid read out from node products (Readout.along_segments, f only)",
        fmt_time(best["ours"]), fmt_time(best["grid"]), f"{best['ours'] / best['grid']:.2f}x the time",
        "<= 2.5x", best["ours"] / best["grid"] <= 2.5)
    sources = fns["source"]()
    S = sources.sources.shape[-1]
    add(f"11. components with sources: every (block, head, source position) share ({n} x "
        f"{sources.sources.shape[2]} x {S} per token; they add up to the head shares within "
        f"{sources.residual_sources:.0e}) vs components(resolution='head') on the same trace",
        fmt_time(best["source"]), fmt_time(best["head"]), f"{best['source'] / best['head']:.2f}x the time",
        "<= 1.3x", best["source"] / best["head"] <= 1.3)
    for name, label in (("logprob", "log p(y)"), ("logit_diff", "log p(y) - log p(' Paris') (the logit difference)")):
        add(f"11. components of {label} vs of p(y)", fmt_time(best[name]), fmt_time(best["ours"]),
            f"{best[name] / best['ours']:.2f}x the time", "report", None)
    exact = fns["observed"]()
    add(f"11. components, prediction-aware split (complete at every m: residual "
        f"{max(exact.residual_heads, exact.residual_neurons):.0e}; Gauss-Legendre "
        f"{max(ours.residual_heads, ours.residual_neurons):.0e}) vs the same grid read out point by point",
        fmt_time(best["observed"]), fmt_time(best["per_point"]),
        f"{best['observed'] / best['per_point']:.2f}x the time", "report", None)

    adapter = readout.adapter
    targets = trace.targets.to(ctx.device)

    def f_of(hidden):  # the head-once readout, differentiable: (B, d) -> (B,)
        return target_prob(adapter, hidden, targets.repeat(hidden.shape[0] // T))

    def run_captum():
        heads, neurons = [], []
        with torch.enable_grad():
            for layer, block in enumerate(adapter.blocks):
                for sublayer, start, acts, out in (("attn", trace.hidden[layer], trace.heads[layer], heads),
                                                   ("mlp", trace.mid[layer], trace.neurons[layer], neurons)):
                    proj = ig.sublayer_projection(block, sublayer)[0]
                    base = start.to(ctx.device)

                    def forward(x, proj=proj, base=base):
                        return f_of(base.repeat(x.shape[0] // T, 1) + proj(x))

                    explainer = LayerIntegratedGradients(forward, proj, multiply_by_inputs=True)
                    x = acts.to(ctx.device)
                    attr = explainer.attribute(x, baselines=torch.zeros_like(x), n_steps=m,
                                               method="gausslegendre", attribute_to_layer_input=True,
                                               internal_batch_size=None)
                    out.append(attr.detach())
        H = ours.heads.shape[-1] - 1
        return torch.stack(heads, 1).reshape(T, n, H, -1).sum(-1), torch.stack(neurons, 1)

    with ig_frozen(model):
        (captum_heads, captum_neurons), captum_time = timed(run_captum, ctx.device)
    gap = max(float((captum_heads.cpu() - ours.heads[..., :-1]).abs().max()),
              float((captum_neurons.cpu() - ours.neurons[..., :-1]).abs().max()))
    add(f"11. components vs captum LayerIntegratedGradients on every block's o_proj / down_proj "
        f"input ({2 * n} calls, n_steps={m} gausslegendre; shares agree to {gap:.0e})",
        fmt_time(best["ours"]), fmt_time(captum_time), f"{captum_time / best['ours']:.1f}x faster",
        ">= 20x", captum_time / best["ours"] >= 20)


def ig_frozen(model):
    return igb.frozen_parameters(model)


def item12_patching(ctx) -> None:
    """Activation patching of every node of one fact vs a naive loop of spliced full forward passes."""
    model, tokenizer = ctx.model, ctx.tokenizer
    ids, prompt_len = igd.encode(tokenizer, "What is the capital of France?", "The capital of France is Paris.")
    focus = prompt_len + igd.token_span(tokenizer, ids[0, prompt_len:], "Paris")[0]
    trace = ig.collect(model, ids[:, :focus + 1], focus)
    corrupted, _ = igd.encode(tokenizer, "What is the capital of Greece?", "The capital of Greece is Paris.")
    corrupted = corrupted[:, :focus].to(ctx.device)  # same length: "Greece" and "France" are one token each
    adapter = ig.get_adapter(model)
    n = adapter.n_layers
    target = int(trace.targets[0])

    def naive():  # per node L: the whole corrupted sequence, h_L at the last position replaced by a hook
        out = []
        for layer in range(n + 1):
            module = adapter.blocks[layer] if layer < n else adapter.norm
            value = trace.hidden[layer, 0].to(ctx.device, ctx.dtype)

            def hook(mod, args, kwargs, value=value):
                hidden = (args[0] if args else kwargs["hidden_states"]).clone()
                hidden[:, -1] = value
                return ((hidden,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
            handle = module.register_forward_pre_hook(hook, with_kwargs=True)
            try:
                logits = model(corrupted, use_cache=False).logits[0, -1].float()
            finally:
                handle.remove()
            out.append(torch.softmax(logits, -1)[target])
        return torch.stack(out).cpu()

    ours = igc.activation_patching(model, trace, corrupted).probs
    gap = (ours.float() - naive()).abs().max().item()
    best = best_of({"ours": lambda: igc.activation_patching(model, trace, corrupted), "naive": naive},
                   ctx.args.repeats, ctx.device)
    ratio = best["naive"] / best["ours"]
    add(f"12. activation patching of all {n + 1} nodes of one fact ({corrupted.shape[1]} tokens; corrupted prefix KV-cached, "
        f"the n+1 copies in one decoding step) vs {n + 1} spliced full forward passes (probabilities agree to {gap:.0e})",
        fmt_time(best["ours"]), fmt_time(best["naive"]), f"{ratio:.1f}x faster", ">= 5x", ratio >= 5)


def item13_causal_trace(ctx) -> None:
    """The causal-trace grid (every position x every node) of one fact vs one spliced forward per cell."""
    model, tokenizer = ctx.model, ctx.tokenizer
    template = "As every atlas and every school book agrees, the capital city of the country of {} is the city of"
    clean, corrupted = (torch.tensor([igd.prompt_token_ids(tokenizer, template.format(c), False)], device=ctx.device)
                        for c in ("France", "Greece"))  # same length: one token each
    target = tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    adapter = ig.get_adapter(model)
    n, length = adapter.n_layers, clean.shape[1]
    clean_hidden = ig.collect(model, torch.cat([clean, clean[:, :1]], 1), 1).hidden  # (n+1, S, d): every position

    def naive():  # per cell: the whole corrupted sequence, h_L at position s replaced by a hook
        out = torch.empty(length, n + 1)
        for layer in range(n + 1):
            for s in range(length):
                value = clean_hidden[layer, s].to(ctx.device, ctx.dtype)

                def splice(mod, args, kwargs, value=value, s=s):
                    hidden = (args[0] if args else kwargs["hidden_states"]).clone()
                    hidden[:, s] = value
                    return ((hidden,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

                def replace(mod, args, output, value=value, s=s):
                    hidden = (output[0] if isinstance(output, tuple) else output).clone()
                    hidden[:, s] = value
                    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden
                handle = (adapter.blocks[0].register_forward_pre_hook(splice, with_kwargs=True) if layer == 0
                          else adapter.blocks[layer - 1].register_forward_hook(replace))
                try:
                    logits = model(corrupted, use_cache=False, logits_to_keep=1).logits[0, -1].float()
                finally:
                    handle.remove()
                out[s, layer] = torch.softmax(logits, -1)[target].cpu()
        return out

    def ours():
        return igc.causal_trace(model, clean, corrupted, target)

    reference, naive_time = timed(naive, ctx.device)  # ~n S forward passes: timed once
    result = ours()
    gap = (result.probs.float() - reference).abs().max().item()
    ours_time = best_of({"ours": ours}, ctx.args.repeats, ctx.device, warmup=False)["ours"]
    ratio = naive_time / ours_time
    add(f"13. causal trace, full grid of one fact ({length} tokens x {n + 1} nodes, p_clean {result.p_clean:.2f}, "
        f"p' {result.p_corrupted:.4f}; each restored copy branches off the corrupted run at its block and runs its "
        f"positions only, on the corrupted prefix's KV cache; positions whose clean and corrupted states are equal "
        f"not rerun) vs "
        f"{length * (n + 1)} spliced full forward passes (probabilities agree to {gap:.0e})",
        fmt_time(ours_time), fmt_time(naive_time), f"{ratio:.1f}x faster", ">= 5x", ratio >= 5)


def item14_dpa(ctx) -> None:
    """Dual Path Attribution's ablation protocol for one item (issue 23): batched vs one forward per
    fraction; IG-Lens's component scores vs AtP's (a forward and a backward pass)."""
    model, tokenizer = ctx.model, ctx.tokenizer
    # a plain prompt, as the original and notebook 10 feed them
    ids, prompt_len = igd.encode(tokenizer, "The capital of France is", " Paris.", chat=False)
    focus = prompt_len + igd.token_span(tokenizer, ids[0, prompt_len:], "Paris")[0]
    prompt, target = ids[:, :focus], int(ids[0, focus])
    scores = igdpa.dpa_scores(model, prompt, target, "atp")
    F = len(igdpa.DPA_FRACTIONS)

    def protocol(batch_size=None):
        return np.stack([igdpa.dpa_ablation(model, prompt, target, scores, mode=mode, batch_size=batch_size)
                         for mode in igdpa.DPA_MODES])

    gap = float(np.abs(protocol() - protocol(batch_size=1)).max())
    best = best_of({"ours": protocol, "naive": lambda: protocol(batch_size=1)}, ctx.args.repeats, ctx.device)
    ratio = best["naive"] / best["ours"]
    n, H, d_ff = igdpa.dpa_layout(model)
    S = prompt.shape[1]
    add(f"14. DPA ablation protocol, one item ({S} tokens, {n * H * S * S + n * S * d_ff} edges and neurons ranked "
        f"together; {F} fractions x 2 modes, each mode's {F + 1} rows in one batched forward) vs one forward per "
        f"fraction ({2 * (F + 1)} passes; drops agree to {gap:.0e} percentage points)",
        fmt_time(best["ours"]), fmt_time(best["naive"]), f"{ratio:.1f}x faster", "report", None)
    # IG-Lens reads out one position through every segment (a fixed number of head rows), AtP's
    # forward and backward grow with the prompt: the short fact prompt, then the same after a passage
    # (one Readout for every call, as over a dataset: a fresh one checks the norm's form once, ~0.1 s)
    long_ids = tokenizer(PASSAGE + " The capital of France is", return_tensors="pt").input_ids
    readout = ig.Readout(model)
    for ids in (prompt, long_ids):
        full = torch.cat([ids, torch.tensor([[target]])], 1)
        fns = {"ig_lens": lambda: igdpa.dpa_scores(model, ids, target, "ig_lens", readout=readout),
               "ig_lens_m4": lambda: igdpa.dpa_scores(model, ids, target, "ig_lens", steps=4, readout=readout),
               "ig_lens_gauss": lambda: igdpa.dpa_scores(model, ids, target, "ig_lens_gauss", readout=readout),
               "forward": lambda: ig.collect_components(model, full, ids.shape[1], sources=True),
               "atp": lambda: igdpa.dpa_scores(model, ids, target, "atp"),
               "graph": lambda: igdpa.dpa_scores(model, ids, target, "ig_lens_graph", readout=readout),
               "mask_ig": lambda: igdpa.dpa_scores(model, ids, target, "mask_ig", mask_steps=MASK_STEPS)}
        if "dpa" in igdpa.DPA_METHODS:  # DPA itself, where it is there (issue 34)
            fns["dpa"] = lambda: igdpa.dpa_scores(model, ids, target, "dpa")
        best = best_of(fns, ctx.args.repeats, ctx.device)
        gap = igdpa.mask_ig(model, ids, target, steps=MASK_STEPS)
        for name, what in (("graph", "IG-Lens graph scores (attribution_graph with edges: every edge and neuron "
                                     "at every position, prediction-aware m=16)"),
                           ("mask_ig", f"mask IG scores ({gap.rule} rule: m={MASK_STEPS} forward and backward "
                                       f"passes over the gate path, batched, after {gap.scan_rows} forward-only rows "
                                       f"placing its panels; completeness gap {gap.gap:.0e} of p(on) - p(off) = "
                                       f"{gap.f_on - gap.f_off:.3f})"),
                           ("dpa", "DPA scores")):
            if name in best:
                ratio = best[name] / best["atp"]
                add(f"14. {what}, one item ({ids.shape[1]} tokens) vs AtP (DPA's: forward + backward, every edge "
                    f"and neuron)", fmt_time(best[name]), fmt_time(best["atp"]), f"{ratio:.2f}x the time", "report", None)
            else:
                add(f"14. {what}, one item ({ids.shape[1]} tokens) vs AtP: not measured (method not in "
                    f"igdpa.DPA_METHODS yet)", "-", fmt_time(best["atp"]), "-", "report", None)
        ratio = best["forward"] / best["atp"]
        add(f"14. floor of IG-Lens's scores ({ids.shape[1]} tokens): its one forward pass alone (collect with "
            f"sources, eager attention; no readout) vs AtP", fmt_time(best["forward"]), fmt_time(best["atp"]),
            f"{ratio:.2f}x the time", "report", None)
        m16, m4 = fns["ig_lens"](), fns["ig_lens_m4"]()
        drift = max(float((m16[k] - m4[k]).abs().max() / m16[k].abs().max()) for k in ("edges", "neurons"))
        for name, estimator in (("ig_lens", "prediction-aware, m=16"),
                                ("ig_lens_m4", f"prediction-aware, m=4: scores within {drift:.0e} of m=16's largest"),
                                ("ig_lens_gauss", "Gauss-Legendre, m=16")):
            ratio = best[name] / best["atp"]
            add(f"14. IG-Lens component scores for one item ({ids.shape[1]} tokens; {estimator}; collect with "
                f"sources + components 'all', no backward) vs AtP (forward + backward, every edge and neuron)",
                fmt_time(best[name]), fmt_time(best["atp"]), f"{ratio:.2f}x the time", "<= 0.5x", ratio <= 0.5)


def _graph_split(fn: Callable) -> dict[str, float]:
    """Seconds of one call of ``fn`` (an attribution graph) by part, from cProfile's cumulative times:
    the recording forward pass, the readout along the segments, the linearised blocks, the rest (the
    backward sweep, with edges if asked)."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    total = max(v[3] for (file, _, name), v in stats.items() if name == "attribution_graph")

    def cumulative(file_end: str, name: str) -> float:
        return sum(v[3] for (file, _, fname), v in stats.items() if file.endswith(file_end) and fname == name)

    parts = {"record": cumulative("iglens_graph_blocks.py", "_record"),
             "readout": cumulative("iglens_core.py", "along_segments"),
             "blocks": cumulative("iglens_graph_blocks.py", "__init__")}
    parts["sweep"] = total - sum(parts.values())
    return {"total": total, **parts}


def item15_graph(ctx) -> None:
    """The whole attribution graph of one answer token (issue 31) vs AtP's forward and backward pass
    on the same item: a plain short prompt (with and without edges) and a long one (without)."""
    model, tokenizer = ctx.model, ctx.tokenizer
    ids, prompt_len = igd.encode(tokenizer, "The capital of France is", " Paris.", chat=False)
    focus = prompt_len + igd.token_span(tokenizer, ids[0, prompt_len:], "Paris")[0]
    short, target = ids[:, :focus], int(ids[0, focus])
    long_ids = tokenizer(PASSAGE + " The capital of France is", return_tensors="pt").input_ids
    readout = ig.Readout(model)  # one for every call, as over a dataset (item 14)
    for prompt, edge_modes in ((short, (True, False)), (long_ids, (False,))):
        full = torch.cat([prompt, torch.tensor([[target]])], 1)  # the answer token at prompt_len
        S = prompt.shape[1]

        def graph(edges):
            return lambda: iggraph.attribution_graph(model, full, S, token=0, edges=edges, readout=readout)
        fns = {f"graph_{e}": graph(e) for e in edge_modes}
        fns["atp"] = lambda: igdpa.dpa_scores(model, prompt, target, "atp")
        best = best_of(fns, ctx.args.repeats, ctx.device)
        target_ratio = 1.5  # every row (issue 45; 1.2x on the long prompt is its stretch)
        for edges in edge_modes:
            split = _graph_split(graph(edges))
            shares = ", ".join(f"{k} {split[k] / split['total']:.0%}" for k in ("record", "readout", "blocks", "sweep"))
            ratio = best[f"graph_{edges}"] / best["atp"]
            add(f"15. attribution graph of one answer token ({S} tokens, {'with' if edges else 'without'} edges; "
                f"one profiled call {fmt_time(split['total'])}: {shares}) vs AtP (forward + backward, every edge "
                f"and neuron)", fmt_time(best[f"graph_{edges}"]), fmt_time(best["atp"]), f"{ratio:.2f}x the time",
                f"<= {target_ratio:g}x", ratio <= target_ratio)


def _eap_ig_passes(model, clean: torch.Tensor, corrupted: torch.Tensor, target: int, steps: int) -> Callable:
    """EAP-IG (inputs) at ``steps``: the token embeddings interpolated from the corrupted to the clean run at
    k / m, k = 1..m, one batched forward and backward of p(target), every block output's gradient kept (what
    its edge scores are read from): its cost without the edge products."""
    adapter = ig.get_adapter(model)
    embed = model.get_input_embeddings()

    def run():
        with torch.enable_grad():
            start, end = embed(corrupted), embed(clean)  # (1, S, d)
            alphas = torch.arange(1, steps + 1, dtype=start.dtype)[:, None, None] / steps
            x = (start + alphas * (end - start)).detach().requires_grad_(True)  # (m, S, d)
            kept = []
            hooks = [block.register_forward_hook(lambda m, a, out: kept.append(ig.first_output(out)))
                     for block in adapter.blocks]
            try:
                logits = model(inputs_embeds=x, use_cache=False).logits[:, -1]
            finally:
                for hook in hooks:
                    hook.remove()
            p = torch.softmax(logits.float(), -1)[:, target].sum()
            return torch.autograd.grad(p, [x] + kept)
    return run


def item16_counterfactual(ctx) -> None:
    """The counterfactual graph of one fact vs EAP-IG's passes at the same m and AtP per state (issue 43), the
    float64 chain (exact to its quadrature gaps) and the float32 one (issue 45's treatment), at their default m."""
    model, tokenizer = ctx.model, ctx.tokenizer
    readout = ig.Readout(model)  # one for every call, as over a dataset
    for subject, other in (("France", "Japan"),):
        clean = tokenizer(f"The capital of {subject} is the city of", return_tensors="pt").input_ids
        corrupted = tokenizer(f"The capital of {other} is the city of", return_tensors="pt").input_ids
        target = tokenizer(" Paris", add_special_tokens=False).input_ids[0]
        S, steps = clean.shape[1], igcf.DEFAULT_STEPS

        def graph(dtype, **kwargs):
            return lambda: igcf.counterfactual_graph(model, clean, corrupted, target, dtype=dtype, readout=readout,
                                                     **kwargs)
        rows = {"states": (torch.float64, dict(parts=False)), "parts": (torch.float64, dict(edges=True)),
                "states32": (torch.float32, dict(parts=False)), "parts32": (torch.float32, dict(edges=True)),
                "states32_m16": (torch.float32, dict(parts=False, steps=steps))}
        fns = {name: graph(dtype, **kwargs) for name, (dtype, kwargs) in rows.items()}
        fns["eap_ig"] = _eap_ig_passes(model, clean, corrupted, target, steps)
        fns["atp"] = lambda: igc.atp_states(model, clean, corrupted, target)
        best = best_of(fns, ctx.args.repeats, ctx.device)
        for name, (dtype, kwargs) in rows.items():
            m = kwargs.get("steps", igcf.DEFAULT_STEPS if dtype == torch.float64 else igcf.FLOAT32_STEPS)
            what = "states only" if kwargs.get("parts") is False else "with heads, neurons and edges"
            ratio = best[name] / best["eap_ig"]
            add(f"16. counterfactual graph of one fact ({S} tokens, {what}, m = {m} per sublayer to start, "
                f"{str(dtype)[6:]}) vs EAP-IG's {steps} forward and backward passes (inputs, float32)",
                fmt_time(best[name]), fmt_time(best["eap_ig"]), f"{ratio:.2f}x the time", "<= 1x", ratio <= 1.0)
        exact, fast = graph(torch.float64, parts=False)(), graph(torch.float32, parts=False)()
        moved = float((fast.carried - exact.carried).abs().sum() / exact.carried.abs().sum())
        add(f"16. the float32 chain (m = {igcf.FLOAT32_STEPS}): whole gap relative to |delta|; its map against the "
            "float64 chain's (relative L1)", f"{abs(fast.gap / fast.delta):.1e}; {moved:.1e}", "", "",
            f"gap <= {igcf.FLOAT32_TOLERANCE:g} a sublayer")
        add(f"16. AtP per state ({S} tokens) vs EAP-IG's {steps} passes, for scale", fmt_time(best["atp"]),
            fmt_time(best["eap_ig"]), f"{best['atp'] / best['eap_ig']:.2f}x the time")


ITEMS = {1: item1_exact_map, 2: item2_profile, 3: item3_captum, 4: item4_gradient,
         5: item5_generate, 6: item6_memory, 7: item7_load, 8: item8_scaling, 9: levers,
         10: item10_dataset, 11: item11_components,
         12: item12_patching, 13: item13_causal_trace, 14: item14_dpa, 15: item15_graph,
         16: item16_counterfactual}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"),
                        help="parameter dtype of the model and readouts (logits stay float32)")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on a GPU")
    parser.add_argument("--model", default=ig.DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per timing (min kept)")
    parser.add_argument("--grad-steps", type=int, default=4, help="m of item 4")
    parser.add_argument("--memory-tokens", type=int, default=2,
                        help="tokens of item 6 (and 4x that at 256 MiB; --full: 64)")
    parser.add_argument("--full", action="store_true", help="item 6 at 64 tokens, longer sweeps")
    parser.add_argument("--facts", type=int, default=96, help="facts of item 10 (data/facts.csv)")
    parser.add_argument("--batch-size", type=int, default=16, help="items per batch of item 10")
    parser.add_argument("--only", default="", help="comma-separated item numbers (9 = levers, 10 = dataset, 11 = components, 12 = patching, 13 = causal trace, 14 = DPA ablation, 15 = attribution graph, 16 = counterfactual graph)")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    only = {int(x) for x in args.only.split(",") if x.strip()} or set(ITEMS)
    if not only <= set(ITEMS):
        parser.error(f"--only takes item numbers in 1..{len(ITEMS)}, got {args.only!r}")
    if args.memory_child:  # glibc: buffers >= 1 MiB are mmapped and returned when freed
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MiB)  # M_MMAP_THRESHOLD (also stops its dynamic growth)
        libc.mallopt(-1, MiB)  # M_TRIM_THRESHOLD
    ctx = SimpleNamespace(args=args, device=device, dtype=dtype, model_label=args.model)
    if only != {6}:  # every other item uses the embedded model and the Vietnam trace
        ctx.model, ctx.tokenizer = ig.load_model(args.model, device=str(device), dtype=dtype)
        input_ids, prompt_len = igd.encode(ctx.tokenizer, PROMPT, ANSWER)
        ctx.trace = ig.collect(ctx.model, input_ids, prompt_len)
        ctx.readout = ig.Readout(ctx.model)
    for number, item in ITEMS.items():
        if number in only:
            print(f"[bench] item {number}{' (memory child)' if args.memory_child else ''} ...",
                  file=sys.stderr, flush=True)
            item(ctx)
    if args.memory_child:
        return 0
    machine = (f"{cpu_name()}, {os.cpu_count()} cores, "
               f"{torch.get_num_threads()} torch thread(s)" if device.type == "cpu"
               else torch.cuda.get_device_name(device))
    print_table(f"IG-Lens benchmark: {args.model}, {device.type} ({machine}), {args.dtype}, "
                f"torch {torch.__version__}, best of {args.repeats} interleaved rounds; "
                f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
