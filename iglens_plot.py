"""IG-Lens figures: the static heatmap, the one helper every figure is saved through, and the
interactive view (a standalone HTML file).

Figures go to the folder named by the environment variable ``IGLENS_FIGURES``; without it, in a
checkout, to ``build/figures``. Only ``make reproduce`` (the main job) writes the committed
``figures/``, so a notebook run with other parameters (papermill ``-p``/``-f``, JupyterLab) never
overwrites them.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import torch

from iglens_core import QUANTITIES, Attribution, Components

ROOT = Path(__file__).resolve().parent
# a checkout's figures/ folder; once installed as a package, figures/ under the working directory
# Where figures go: the folder named by IGLENS_FIGURES; else, in a checkout, build/figures (the
# committed figures/ are written only by `make reproduce`, which points IGLENS_FIGURES at them, so
# a notebook run with other parameters never overwrites them); once installed, ./figures.
FIGURES = ROOT / "build" / "figures" if (ROOT / "pyproject.toml").exists() else Path.cwd() / "figures"


def save_figure(fig, name: str, *, pdf: bool = False, folder: Optional[Path] = None) -> Path:
    """Save ``fig`` as ``figures/<name>.png`` (and ``.pdf``); the one place figures are written."""
    folder = Path(os.environ.get("IGLENS_FIGURES", folder or FIGURES))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=150, bbox_inches="tight", metadata={"Software": None})
    if pdf:
        fig.savefig(folder / f"{name}.pdf", bbox_inches="tight", metadata={"Creator": None,
                                                                           "Producer": None,
                                                                           "CreationDate": None})
    return path


def _tick_indices(count: int, max_ticks: int = 16) -> list[int]:
    """About ``max_ticks`` evenly spaced indices of ``count`` columns, the last one always among them."""
    step = max(1, math.ceil(count / max_ticks))
    ticks = list(range(0, count, step))
    if ticks[-1] != count - 1:  # the last column replaces the tick less than a step before it,
        ticks[-1] = count - 1     # whose label would overlap it
    return ticks


def _units(attribution: Attribution, quantity: Optional[str] = None, foil: Optional[bool] = None):
    """``(f, delta, bounded)``: what f is, as axis text (``"probability"``), the short name of its
    change (``"Δp"``), and whether it lies in [0, 1].

    Args:
        quantity: ``"prob"`` or ``"logprob"``; None: ``attribution.quantity`` (an attribution
            rebuilt by :func:`iglens_tables.attribution_from_frame` carries the table's).
        foil: f is a difference with a foil; None: whether ``attribution.foils`` is set.
    """
    quantity = attribution.quantity if quantity is None else quantity
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {QUANTITIES}, got {quantity!r}")
    foil = attribution.foils is not None if foil is None else bool(foil)
    if foil:
        return ({"prob": "p(y) − p(foil)", "logprob": "logit difference z_y − z_foil"}[quantity],
                "Δf", False)
    return {"prob": ("probability", "Δp", True), "logprob": ("log-probability (nats)", "Δ log p", False)}[quantity]


def plot_heatmap(attribution: Attribution, tokens: Sequence[str], *, title: str = "",
                 figsize: tuple[float, float] = (13, 4.5), quantity: Optional[str] = None,
                 foil: Optional[bool] = None):
    """Token x layer heatmap of the attributions beside the logit-lens probability per layer.

    Left: signed attributions (probability), diverging colours centred at zero, each row's sum
    and Δp on the right of its row, the colour bar beside the panel. Right: the logit lens
    ``f(h_L)`` per token, so the reader sees the mass sit where the lens jumps. The last segment
    (layer n) is always labelled. Labels name f (probability, log-probability, a difference with
    a foil): ``quantity`` and ``foil`` as in :func:`to_html`.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    values = attribution.values.numpy()
    lens = attribution.lens.numpy()
    T, K = values.shape
    if len(tokens) != T:
        raise ValueError(f"tokens must hold one label per target token ({T}), got {len(tokens)}")
    f, delta, bounded = _units(attribution, quantity, foil)
    bound = max(float(np.abs(values).max()), 1e-9)
    fig, (ax, ax_lens) = plt.subplots(1, 2, figsize=figsize, width_ratios=[3, 2],
                                      constrained_layout=True)
    image = ax.imshow(values, aspect="auto", cmap="RdBu_r",
                      norm=TwoSlopeNorm(vcenter=0.0, vmin=-bound, vmax=bound))
    ticks = _tick_indices(K)
    ax.set_xticks(ticks, [attribution.labels[j] for j in ticks],
                  rotation=90 if attribution.labels[0].count(".") else 0)
    ax.set_yticks(range(T), [repr(tok)[1:-1] for tok in tokens])
    ax.set_xlabel("segment end layer")
    ax.set_ylabel("target token")
    # row sums as right-hand tick labels: part of the axes' decorations, so the colour bar that
    # constrained_layout places on the right sits beside them, not on top of them
    sums = ax.secondary_yaxis("right")
    sums.set_yticks(range(T), [f"Σ={values[t].sum():+.3f}  {delta}={attribution.delta_p[t]:+.3f}"
                               for t in range(T)], fontsize=8)
    sums.tick_params(length=0)
    # a colour bar's length is ``aspect`` times its width: scale it with the height so that it
    # spans the panel however many tokens there are
    aspect = 20 * max(1.0, figsize[1] / 4.5)
    fig.colorbar(image, ax=ax, label=f"attribution (Δ {f})", pad=0.01, aspect=aspect)
    ax.set_title(f"IG-Lens ({attribution.estimator}, m={attribution.steps})")
    if title:  # above both panels, wrapped: a long answer must not run into the lens panel
        fig.suptitle(textwrap.fill(title, width=int(figsize[0] * 11)), fontsize=10)
    lens_image = ax_lens.imshow(lens, aspect="auto", cmap="viridis",
                                **(dict(vmin=0, vmax=1) if bounded else {}))
    ax_lens.set_yticks([])
    ax_lens.set_xticks(_tick_indices(K + 1, 10))
    ax_lens.set_xlabel("path node (0 = baseline)")
    ax_lens.set_title("logit lens f(h_L)")
    fig.colorbar(lens_image, ax=ax_lens, label=f"target {f}", pad=0.01, aspect=aspect)
    return fig


def plot_trajectories(ax, attribution: Attribution, tokens: Sequence[str], *, onset_frac: float = 0.5,
                      title: str = "", max_legend: int = 10):
    """The logit lens ``f(h_L)`` of every target token against the layer, a dot at its onset.

    Up to ``max_legend`` tokens get a legend entry each; beyond that the curves are coloured by
    token index (a colour bar instead of a legend that would cover them).

    Args:
        ax: the matplotlib axes to draw on.
        attribution: from :func:`iglens_core.ig_lens`.
        tokens: (T,) labels of the target tokens.
        onset_frac: the onset is the first layer where this share of Δp is built.
        title: shortened to one line.
    """
    import matplotlib.pyplot as plt
    T = len(tokens)
    if T != len(attribution.values):
        raise ValueError(f"tokens must hold one label per target token ({len(attribution.values)}), got {T}")
    nodes = [0] + list(attribution.layers)
    many = T > max_legend
    colours = plt.cm.viridis(np.linspace(0, 0.9, T)) if many else plt.cm.tab10(np.arange(T) % 10)
    onset = attribution.onset(onset_frac).tolist()
    for t, token in enumerate(tokens):
        ax.plot(nodes, attribution.lens[t].numpy(), color=colours[t], lw=1.4, label=repr(token))
        ax.plot(onset[t], float(attribution.lens[t, nodes.index(onset[t])]), "o", color=colours[t], ms=4)
    ax.axhline(0.5, color="grey", ls=":", lw=1)
    ax.set_xlabel("layer (0 = baseline)")
    ax.set_title(textwrap.shorten(title, width=70, placeholder=" …"), fontsize=10)
    if many:
        from matplotlib.colors import ListedColormap
        scale = plt.cm.ScalarMappable(cmap=ListedColormap(colours), norm=plt.Normalize(-0.5, T - 0.5))
        ax.figure.colorbar(scale, ax=ax, label="target token index", pad=0.01)
    else:
        ax.legend(fontsize=7, ncol=2, loc="upper left")


def check_html_path(path) -> Path:
    """``path`` as a Path when it names an ``.html`` file in an existing folder; else ValueError."""
    out = Path(path).expanduser()
    if out.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"path must name an .html file, got {str(path)!r}")
    if not out.parent.is_dir():
        raise ValueError(f"the folder {str(out.parent)!r} of path {str(path)!r} does not exist")
    return out


def _html_views(attribution: Attribution, sublayer: Optional[Attribution],
                views: Optional[Mapping[str, object]]) -> list[tuple]:
    """The views of :func:`to_html`: ``(name, values (T, K), labels (K,), lens (T, K+1) or None)``."""
    T = attribution.values.shape[0]
    extra = {"sublayer": sublayer} if sublayer is not None else {}
    extra.update(views or {})
    first = "sublayer" if any(".attn" in label for label in attribution.labels) else "layer"
    out = [(first, attribution.values.numpy(), list(attribution.labels), attribution.lens.numpy())]
    for name, view in extra.items():
        if isinstance(view, Attribution):
            if not torch.equal(view.targets, attribution.targets):
                raise ValueError(f"view {name!r} attributes targets {view.targets.tolist()}, not "
                                 f"those of the attribution {attribution.targets.tolist()}")
            out.append((name, view.values.numpy(), list(view.labels), view.lens.numpy()))
            continue
        values, labels = view
        values, labels = np.asarray(values, dtype=np.float64), [str(label) for label in labels]
        if values.ndim != 2 or values.shape[0] != T or values.shape[1] != len(labels):
            raise ValueError(f"view {name!r} must be (values (T, K), labels (K,)) with T = {T}, got "
                             f"values {values.shape} and {len(labels)} labels")
        out.append((name, values, labels, None))
    return out


def to_html(attribution: Attribution, tokens: Sequence[str], path, *,
            sublayer: Optional[Attribution] = None, views: Optional[Mapping[str, object]] = None,
            title: str = "", plotlyjs: Union[bool, str] = True, quantity: Optional[str] = None,
            foil: Optional[bool] = None, sources=None, source_tokens: Optional[Sequence[str]] = None) -> Path:
    """Write one self-contained interactive HTML view of an attribution (opens offline).

    Plotly, with its JavaScript embedded in the file (about 5 MB): nothing loads from a network.
    Left: token x segment heatmap, diverging colours centred at zero, the last segment always
    labelled. Right: the logit lens ``f`` at every path node. Hovering a cell gives the token,
    the segment, its value, the lens at both ends of the segment, the row sum and Δp (all in
    the unit of f: probability by default). Buttons switch between the views: the attribution,
    ``sublayer`` and ``views``.

    With ``sources``, a second panel below: for the answer token picked in its menu, the source
    token x block map of what attention moved into the predicting position (f credited to all
    heads of block L for what they read at position s), the per-source-token totals above it as
    bars, and in the title the rest (MLPs, biases) and Δ; hovering gives block, source token and
    value. Its numbers are also embedded as JSON in ``<script type="application/json"
    id="iglens-sources-data">``: ``tokens``, ``source_tokens``, ``blocks``, ``maps`` (T, B, S)
    and ``by_source`` (T, S + 1), the rest last.

    Args:
        attribution: the first view (layer resolution, usually), T target tokens.
        tokens: (T,) the target tokens as text, e.g. ``trace.tokens(tokenizer)``.
        path: the ``.html`` file to write; its folder must exist.
        sublayer: the same trace's ``ig_lens(..., resolution="sublayer")``.
        views: further views by name, each an :class:`Attribution` of the same targets or
            ``(values (T, K'), labels (K',))``, e.g. components of every block flattened to
            columns; an array view has no lens of its own and shows the first view's lens.
        title: the figure's title.
        plotlyjs: ``True`` embeds plotly.js (one self-contained file); ``"directory"`` writes it
            once as ``plotly.min.js`` beside the file and loads it from there (many views in one
            folder, still offline).
        quantity, foil: what f is, for titles and colour ranges (see :func:`_units`); default:
            the attribution's own.
        sources: a :class:`Components` with ``sources`` (the same targets; blocks 1..n), or one
            item's rows of the dataset parts table (:func:`iglens_data.attribute_dataset` with
            ``resolution="source"``: its ``source_total`` and ``source_rest`` rows, a single
            "all blocks" row since the table keeps no per-block split).
        source_tokens: (S,) the text of every position of the sequence, with a
            :class:`Components` (e.g. ``[tokenizer.decode([i]) for i in input_ids[0]]``).

    Returns:
        The path written.

    Raises:
        ValueError: a path that is not ``.html`` or whose folder is missing, ``tokens`` of the
            wrong length, a view of other targets or shape, sources without sources, of other
            targets, or ``source_tokens`` of the wrong length.
    """
    import html
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    out = check_html_path(path)
    if plotlyjs not in (True, "directory"):
        raise ValueError(f"plotlyjs must be True or 'directory', got {plotlyjs!r}")
    tokens = list(tokens)
    T = attribution.values.shape[0]
    if len(tokens) != T:
        raise ValueError(f"tokens has {len(tokens)} entries, the attribution T = {T} target tokens")
    panels = _html_views(attribution, sublayer, views)
    f, delta, bounded = _units(attribution, quantity, foil)
    panel = _source_panel(attribution, sources, source_tokens) if sources is not None else None
    delta_p = attribution.delta_p.tolist()
    shown = [html.escape(repr(token)) for token in tokens]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], shared_yaxes=True,
                        horizontal_spacing=0.11,
                        subplot_titles=(f"attribution (Δ {f})", f"logit lens f ({f})"))
    heat_end, lens_end = fig.layout.xaxis.domain[1], fig.layout.xaxis2.domain[1]
    traces, buttons = [], []
    for name, values, labels, lens in panels:
        K = len(labels)
        sums = values.sum(-1)
        ends = lens if lens is not None else np.full((T, K + 1), np.nan)
        cells = [[[shown[t], labels[j], float(ends[t, j]), float(ends[t, j + 1]), float(sums[t]),
                   delta_p[t]] for j in range(K)] for t in range(T)]
        hover = ("token %{customdata[0]}<br>segment %{customdata[1]}<br>value %{z:+.4f}<br>"
                 + ("lens %{customdata[2]:.4f} → %{customdata[3]:.4f}<br>" if lens is not None else "")
                 + "row sum %{customdata[4]:+.4f}<br>" + delta + " %{customdata[5]:+.4f}<extra>" + name
                 + "</extra>")
        bound = max(float(np.abs(values).max()), 1e-9)
        traces.append((name, "heat", go.Heatmap(
            z=values.tolist(), x=list(range(K)), y=list(range(T)), customdata=cells,
            hovertemplate=hover, colorscale="RdBu", reversescale=True, zmid=0.0, zmin=-bound,
            zmax=bound, name=name,
            colorbar=dict(x=heat_end + 0.005, xanchor="left", thickness=14, tickformat=".2~g",
                          title=dict(text=f"Δ {f}", side="right")))))
        if lens is not None:
            nodes = ["baseline"] + labels
            traces.append((name, "lens", go.Heatmap(
                z=lens.tolist(), x=list(range(K + 1)), y=list(range(T)), colorscale="Viridis", name=name,
                **(dict(zmin=0.0, zmax=1.0) if bounded else {}),
                customdata=[[[shown[t], nodes[j]] for j in range(K + 1)] for t in range(T)],
                hovertemplate="token %{customdata[0]}<br>node %{customdata[1]}<br>"
                              "f %{z:.4f}<extra>" + name + "</extra>",
                colorbar=dict(x=lens_end + 0.005, xanchor="left", thickness=14,
                              title=dict(text=f"target {f}", side="right")))))
    for index, (name, values, labels, lens) in enumerate(panels):
        lens_of = name if lens is not None else panels[0][0]
        visible = [(view == name and kind == "heat") or (view == lens_of and kind == "lens")
                   for view, kind, _ in traces]
        heat_ticks = _tick_indices(len(labels))
        lens_labels = ["base"] + (labels if lens is not None else panels[0][2])
        lens_ticks = _tick_indices(len(lens_labels), 10)
        axes = {"xaxis.tickvals": heat_ticks, "xaxis.ticktext": [labels[j] for j in heat_ticks],
                "xaxis2.tickvals": lens_ticks, "xaxis2.ticktext": [lens_labels[j] for j in lens_ticks]}
        buttons.append(dict(label=name, method="update", args=[{"visible": visible}, axes]))
        if index == 0:
            first_visible, first_axes = visible, axes
    for (name, kind, trace), visible in zip(traces, first_visible):
        trace.visible = visible
        fig.add_trace(trace, row=1, col=1 if kind == "heat" else 2)
    fig.update_layout(
        title=dict(text=title or (f"IG-Lens ({attribution.estimator}, m={attribution.steps}, "
                                  f"baseline {attribution.baseline}, f = {f}): max |row sum - {delta}| = "
                                  f"{attribution.residual:.1e}"), y=0.99, yanchor="top"),
        width=1300, height=240 + 28 * T, margin=dict(t=130),
        updatemenus=[dict(type="buttons", direction="right", buttons=buttons, showactive=True,
                          x=0.0, xanchor="left", y=1.0, yanchor="bottom", pad=dict(b=30))])
    fig.update_layout({key.replace(".", "_"): value for key, value in first_axes.items()})
    fig.update_xaxes(tickmode="array", title_text="segment", row=1, col=1)
    fig.update_xaxes(tickmode="array", title_text="path node", row=1, col=2)
    fig.update_yaxes(tickmode="array", tickvals=list(range(T)),
                     ticktext=[html.escape(repr(token)[1:-1]) for token in tokens],
                     autorange="reversed", row=1, col=1)
    fig.write_html(out, include_plotlyjs=plotlyjs, full_html=True, div_id="iglens",
                   config={"displaylogo": False})
    if panel is not None:  # the second figure and its numbers, after the first (plotly.js is loaded)
        page = out.read_text(encoding="utf-8")
        at = page.rindex("</body>")
        out.write_text(page[:at] + _source_figure(panel, tokens, f, delta) + page[at:], encoding="utf-8")
    return out


def _source_panel(attribution: Attribution, sources, source_tokens) -> dict:
    """The numbers of :func:`to_html`'s source panel: ``source_tokens`` (S,), ``blocks`` (B,) labels,
    ``maps`` (T, B, S) f moved by all heads of each block from each position, ``by_source`` (T, S + 1)
    (the rest last), each row adding up to Δ."""
    T = attribution.values.shape[0]
    if isinstance(sources, Components):
        if sources.sources is None:
            raise ValueError("sources must hold sources: components(..., resolution='source' or 'all') "
                             "of a trace from collect_components(..., sources=True)")
        if not torch.equal(sources.targets, attribution.targets):
            raise ValueError(f"sources attribute targets {sources.targets.tolist()}, not those of the "
                             f"attribution {attribution.targets.tolist()}")
        maps = sources.sources.double().sum(2).numpy()  # (T, n, S)
        by_source = sources.by_source().double().numpy()
        blocks = [f"L{layer}" for layer in range(1, maps.shape[1] + 1)]
    else:  # one item's rows of the dataset parts table
        rows = sources[sources["kind"].isin(["source_total", "source_rest"])]
        if rows.empty or ("id" in rows.columns and rows["id"].nunique() > 1):
            raise ValueError("sources must be a Components or one item's rows of the parts table with "
                             "source_total and source_rest rows (attribute_dataset(resolution='source'))")
        totals = rows[rows["kind"] == "source_total"]
        S = int(totals["source_position"].max()) + 1
        by_source = np.zeros((T, S + 1))
        for t, s, share in zip(totals["token_index"], totals["source_position"], totals["share"]):
            by_source[int(t), int(s)] = share
        rest = rows[rows["kind"] == "source_rest"]
        by_source[rest["token_index"].to_numpy(int), -1] = rest["share"].to_numpy()
        maps, blocks = by_source[:, None, :-1], ["all blocks"]
        if source_tokens is None:
            source_tokens = totals.drop_duplicates("source_position").sort_values("source_position")["source_token"]
    if maps.shape[0] != T:
        raise ValueError(f"sources have {maps.shape[0]} answer tokens, the attribution T = {T}")
    if source_tokens is None or len(source_tokens) != maps.shape[-1]:
        raise ValueError(f"source_tokens must give the text of each of the S = {maps.shape[-1]} positions, "
                         f"got {None if source_tokens is None else len(source_tokens)}")
    return dict(source_tokens=[str(token) for token in source_tokens], blocks=blocks, maps=maps,
                by_source=by_source)


def _source_figure(panel: dict, tokens: Sequence[str], f: str, delta: str) -> str:
    """The source panel of :func:`to_html` as an HTML fragment: its JSON numbers and a plotly figure
    (div ``iglens-sources``): per answer token, bars of the per-source totals over a block x source
    heatmap, a menu to pick the token."""
    import html
    import json
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    maps, by_source, blocks = panel["maps"], panel["by_source"], panel["blocks"]
    T, B, S = maps.shape
    shown = [html.escape(repr(token)[1:-1]) for token in panel["source_tokens"]]
    fig = make_subplots(rows=2, cols=1, row_heights=[0.25, 0.75], shared_xaxes=True, vertical_spacing=0.03)
    buttons = []
    for t in range(T):
        bound = max(float(np.abs(maps[t]).max()), 1e-9)
        cells = [[[blocks[b], shown[s], float(by_source[t, s])] for s in range(S)] for b in range(B)]
        fig.add_trace(go.Bar(x=list(range(S)), y=by_source[t, :S].tolist(), visible=t == 0,
                             marker_color="grey", name=f"token {t}", customdata=shown,
                             hovertemplate="source %{x} '%{customdata}'<br>all blocks %{y:+.4f}<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Heatmap(z=maps[t].tolist(), x=list(range(S)), y=list(range(B)), customdata=cells,
                                 visible=t == 0, colorscale="RdBu", reversescale=True, zmid=0.0, zmin=-bound,
                                 zmax=bound, name=f"token {t}",
                                 hovertemplate="block %{customdata[0]}<br>source %{x} '%{customdata[1]}'<br>"
                                               "value %{z:+.4f}<br>all blocks %{customdata[2]:+.4f}<extra></extra>",
                                 colorbar=dict(thickness=14, tickformat=".2~g", len=0.75, y=0.0, yanchor="bottom",
                                               title=dict(text=f"Δ {f}", side="right"))),
                      row=2, col=1)
        moved = float(by_source[t, :S].sum())
        heading = (f"where answer token {html.escape(repr(tokens[t]))} comes from: moved by attention "
                   f"{moved:+.4f}, rest (MLPs, biases) {by_source[t, -1]:+.4f}, {delta} {moved + by_source[t, -1]:+.4f}")
        buttons.append(dict(label=html.escape(f"{t}: {tokens[t]!r}"), method="update",
                            args=[{"visible": [u == t for u in range(T) for _ in range(2)]},
                                  {"title.text": heading}]))
        if t == 0:
            first = heading
    fig.update_layout(title=dict(text=first, y=0.99, yanchor="top"), width=1300, height=320 + 22 * B,
                      margin=dict(t=110), showlegend=False,
                      updatemenus=[dict(type="dropdown", buttons=buttons, x=0.0, xanchor="left", y=1.0,
                                        yanchor="bottom", pad=dict(b=30))])
    ticks = list(range(S)) if S <= 80 else _tick_indices(S, 80)
    fig.update_xaxes(tickmode="array", tickvals=ticks, ticktext=[shown[s] for s in ticks], tickangle=-60,
                     title_text="source token (position in the sequence)", row=2, col=1)
    fig.update_yaxes(title_text=delta, row=1, col=1)
    fig.update_yaxes(tickmode="array", tickvals=list(range(B)), ticktext=blocks, title_text="block",
                     autorange="reversed", row=2, col=1)
    data = dict(tokens=[str(token) for token in tokens], source_tokens=panel["source_tokens"], blocks=blocks,
                maps=maps.tolist(), by_source=by_source.tolist())
    embedded = json.dumps(data).replace("</", "<\\/")  # no "</script>" inside the script
    return (f'<script type="application/json" id="iglens-sources-data">{embedded}</script>\n'
            + fig.to_html(full_html=False, include_plotlyjs=False, div_id="iglens-sources",
                          config={"displaylogo": False}))


def format_table(attribution: Attribution, tokens: Sequence[str], max_columns: int = 30) -> str:
    """Text table: one row per token with its per-segment values, sum, Δp and onset."""
    K = len(attribution.layers)
    shown = list(range(K)) if K <= max_columns else list(range(0, K, math.ceil(K / max_columns)))
    width = max(8, max(len(repr(t)) for t in tokens) + 1)
    head = f"{'token':<{width}}" + "".join(f"{attribution.labels[j]:>7}" for j in shown)
    head += f"{'sum':>9}{'Δp':>9}{'p_base':>8}{'p_final':>8}{'onset':>6}"
    lines = [head]
    onset = attribution.onset().tolist()
    for t, token in enumerate(tokens):
        row = f"{repr(token):<{width}}" + "".join(f"{attribution.values[t, j]:>+7.3f}" for j in shown)
        row += (f"{attribution.values[t].sum():>+9.4f}{attribution.delta_p[t]:>+9.4f}"
                f"{attribution.p_base[t]:>8.4f}{attribution.p_final[t]:>8.4f}{onset[t]:>6}")
        lines.append(row)
        lines.append(f"{'  lens':<{width}}" + "".join(f"{attribution.lens[t, j + 1]:>7.3f}" for j in shown))
    lines.append(f"telescoping residual max|sum - Δp| = {attribution.residual:.2e}")
    return "\n".join(lines)


def plot_ablation_test(per_item, ablated: Sequence[dict], methods: Sequence[str], *, key_method: str,
                       title: str, n_boot: int = 2000, seed: int = 0):
    """Notebook 05's ablation figure: per method, the onset test's rate and Spearman(score, effect)
    by ablation mode (bars with bootstrap intervals), and where the mean IG-Lens term and the mean
    ablation effect sit over the blocks.

    Args:
        per_item: one row per (item, method, mode) with ``beats_median`` and ``spearman``.
        ablated: the items' records, each with ``effects`` {mode: (n,)} and ``scores`` {method: (n,)}.
        methods: the methods in display order; key_method: the IG-Lens method drawn as bars.
    """
    import matplotlib.pyplot as plt
    import seaborn as sns
    modes = list(ablated[0]["effects"])
    long = per_item.melt(id_vars=["method", "mode"], value_vars=["beats_median", "spearman"],
                         var_name="metric", value_name="value")
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2), constrained_layout=True, width_ratios=[1, 1, 1.1])
    palette = dict(zip(modes, ["tab:red", "tab:purple", "tab:orange"]))
    for ax, metric, label in [(axes[0], "beats_median", "onset beats median lower-scored block (rate)"),
                              (axes[1], "spearman", "Spearman(score, ablation effect)")]:
        sns.barplot(data=long[long.metric == metric], y="method", x="value", hue="mode", order=list(methods),
                    palette=palette, errorbar=("ci", 95), n_boot=n_boot, seed=seed, ax=ax)
        ax.set_xlabel(label)
        ax.set_ylabel("")
        ax.axvline(0.5 if metric == "beats_median" else 0.0, color="grey", ls="--", lw=0.8)
    axes[0].legend_.remove()  # one figure legend below: the colours are shared
    axes[1].legend_.remove()
    axes[1].set_yticks([])
    blocks = np.arange(1, len(ablated[0]["scores"][key_method]) + 1)
    for mode in modes:
        mean_effect = np.mean([r["effects"][mode] for r in ablated], 0)
        axes[2].plot(blocks, mean_effect / np.abs(mean_effect).max(), color=palette[mode],
                     label=f"ablation effect ({mode})")
    mean_iglens = np.mean([r["scores"][key_method] for r in ablated], 0)
    axes[2].bar(blocks, mean_iglens / np.abs(mean_iglens).max(), color="tab:blue", alpha=0.5,
                label="IG-Lens term (prediction-aware)")
    axes[2].axhline(0, color="black", lw=0.6)
    axes[2].set_xlabel("block")
    axes[2].set_ylabel("mean over items, scaled to its largest |value|")
    fig.legend(*axes[2].get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=9)
    axes[2].set_title("where each kind of evidence sits", fontsize=10)
    fig.suptitle(title)
    return fig


def plot_patching(patched: Sequence[dict], per_patch, methods: Sequence[str], *, title: str,
                  n_boot: int = 2000, seed: int = 0):
    """Notebook 05's patching figure: median restoration curve r(L) against the IG-Lens cumulative
    rise, the onset minus the restoration half layer, and each method's "within 2 layers" rate.

    Args:
        patched: the items' records, each with ``patch`` (``restoration`` (n+1,), ``half``), ``lens``
            (n+1,), ``delta_p`` and ``onset``.
        per_patch: one row per (item, method) with ``within2``; methods: display order.
    """
    import matplotlib.pyplot as plt
    import seaborn as sns
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.0), constrained_layout=True, width_ratios=[1.1, 1, 1])
    nodes = np.arange(len(patched[0]["lens"]))
    restored = np.array([r["patch"]["restoration"] for r in patched])
    rise = np.array([(r["lens"] - r["lens"][0]) / r["delta_p"] if r["delta_p"] else np.full(len(nodes), np.nan)
                     for r in patched])
    for values, color, label in [(restored, "tab:green", "restoration r(L) (patching)"),
                                 (rise, "tab:blue", "logit-lens rise (f(h_L) - f(h_0)) / Δp (IG-Lens cumulative)")]:
        axes[0].plot(nodes, np.nanmedian(values, 0), color=color, label=label)
        axes[0].fill_between(nodes, *np.nanquantile(values, [0.25, 0.75], 0), color=color, alpha=0.15)
    axes[0].axhline(0.5, color="grey", ls="--", lw=0.8)
    axes[0].set_xlabel("node L (0 = embedding)")
    axes[0].set_ylabel("median over items (band: quartiles)")
    axes[0].legend(fontsize=8)
    axes[0].set_title("what comes back vs what the head reads", fontsize=10)
    diff = np.array([r["onset"] - r["patch"]["half"] for r in patched])
    axes[1].hist(diff, bins=np.arange(diff.min() - 0.5, diff.max() + 1.5), color="tab:blue", alpha=0.7)
    axes[1].axvline(0, color="black", lw=0.8)
    axes[1].set_xlabel("IG-Lens onset − restoration half layer")
    axes[1].set_ylabel("items")
    sns.barplot(data=per_patch, y="method", x="within2", order=list(methods), color="tab:green",
                errorbar=("ci", 95), n_boot=n_boot, seed=seed, ax=axes[2])
    axes[2].set_xlabel("named layer within 2 of the restoration half layer (rate)")
    axes[2].set_ylabel("")
    fig.suptitle(title)
    return fig


def plot_additivity_gap(gaps: Mapping[str, np.ndarray], *, title: str, floor: float = 1e-10, seed: int = 0):
    """Notebook 04's figure: per method, every answer token's |Σ over blocks - Δp| (log scale, jittered
    rows, the median as a black bar; IG-Lens methods in red).

    Args:
        gaps: method name -> (tokens,) gaps; floor: smallest value drawn (exact zeros sit there).
    """
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.6), constrained_layout=True)
    rng = np.random.default_rng(seed)
    names = list(gaps)
    for row, name in enumerate(names):
        values = np.clip(gaps[name], floor, None)
        ax.scatter(values, row + rng.uniform(-0.25, 0.25, len(values)), s=10, alpha=0.6,
                   color="C3" if name.startswith("IG-Lens") else "C0")
        ax.plot([np.median(values)] * 2, [row - 0.35, row + 0.35], color="k", lw=2)
    ax.set_xscale("log")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.axvline(1e-6, color="grey", ls=":", lw=1)
    ax.set_xlabel(f"|Σ over blocks - Δp| per answer token (probability; DLA in logits; floor {floor:g})")
    ax.set_title(title)
    return fig


def plot_decisive_blocks(onset: np.ndarray, decisive: Mapping[str, np.ndarray], n_blocks: int, *, title: str,
                         columns: int = 3):
    """Notebook 04's figure: one panel per method, its decisive block (largest |term|) against the
    IG-Lens onset, one point per token.

    Args:
        onset: (tokens,) IG-Lens onset blocks; decisive: method -> (tokens,) blocks 1..n.
    """
    import matplotlib.pyplot as plt
    names = list(decisive)
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(10, 3.2 * rows), sharex=True, sharey=True,
                             constrained_layout=True, squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        ax.plot([1, n_blocks], [1, n_blocks], color="grey", lw=0.8, ls=":")
        ax.scatter(onset, decisive[name], s=12, alpha=0.6)
        ax.set_title(name, fontsize=9)
    for column in axes.T:  # the x label under the lowest panel of each column, where its ticks are
        lowest = [ax for ax in column if ax.get_visible()][-1]
        lowest.set_xlabel("IG-Lens onset (block)")
        lowest.xaxis.set_tick_params(labelbottom=True)
    for ax in axes[:, 0]:
        ax.set_ylabel("largest |term| (block)")
    fig.suptitle(title)
    return fig


def token_labels(tokens: Sequence[str]) -> list[str]:
    """Tokens as tick labels: newlines and tabs escaped, a lone space shown as ``␣``."""
    return [repr(tok)[1:-1] if tok.strip() else repr(tok)[1:-1].replace(" ", "␣") for tok in tokens]


def _position_map(ax, values: np.ndarray, tokens: Sequence[str], *, cmap: str = "RdBu_r", centred: bool = True,
                  highlight: Sequence[int] = (), first: int = 1):
    """Draw (rows, S) ``values`` on ``ax``: source tokens across, rows (blocks or nodes, numbered from
    ``first``) down, diverging colours centred at 0 (``centred``) or a sequential map; tokens in
    ``highlight`` get red tick labels. Returns the image for a colour bar."""
    from matplotlib.colors import Normalize, TwoSlopeNorm
    rows, count = values.shape
    if len(tokens) != count:
        raise ValueError(f"tokens must hold one label per source position ({count}), got {len(tokens)}")
    bound = max(float(np.nanmax(np.abs(values))), 1e-9)
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-bound, vmax=bound) if centred else Normalize(0.0, bound)
    image = ax.imshow(values, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest",
                      extent=(-0.5, count - 0.5, first + rows - 0.5, first - 0.5))
    ax.set_xticks(range(count), token_labels(tokens), rotation=90, fontsize=7)
    labels = ax.get_xticklabels()  # empty on the upper axes of a shared x axis
    for position in highlight if labels else ():
        labels[position].set_color("tab:red")
    ax.set_yticks([first + i for i in _tick_indices(rows, 10)])
    return image


def plot_source_map(source_map, tokens: Sequence[str], *, title: str = "", highlight: Sequence[int] = (),
                    rest: Optional[float] = None, figsize: tuple[float, float] = (13, 7.5)):
    """Source-token x block map of one target token: what the heads of each block moved into the
    predicting position from each source token (IG-Lens sources summed over heads), with the
    per-token total over blocks above it.

    Args:
        source_map: (n, S) the target's f (probability) credited to block L's heads for what they
            read at position s, e.g. ``Components.sources[t].sum(1)`` cut to the positions up to
            the predicting one.
        tokens: (S,) the source tokens as text.
        highlight: positions whose labels are drawn in red (e.g. the subject's tokens).
        rest: the part no head moved (MLPs, biases), named in the bar panel's title.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt
    values = np.asarray(torch.as_tensor(source_map, dtype=torch.float64))
    if values.ndim != 2:
        raise ValueError(f"source_map must have shape (n, S), got {values.shape}")
    totals = values.sum(0)
    fig, (ax_sum, ax) = plt.subplots(2, 1, figsize=figsize, height_ratios=[1, 3.2], sharex=True,
                                     constrained_layout=True)
    ax_sum.bar(range(len(totals)), totals, color=np.where(totals >= 0, "tab:red", "tab:blue"), width=0.8)
    ax_sum.axhline(0, color="black", lw=0.6)
    ax_sum.set_ylabel("over all blocks\n(Δ probability)")
    ax_sum.set_title(f"moved from each token by all heads: {totals.sum():+.3f}"
                     + (f"; not moved by a head (MLPs, biases): {rest:+.3f}" if rest is not None else ""),
                     fontsize=9)
    image = _position_map(ax, values, tokens, highlight=highlight)
    ax.set_xlabel("source token s (what the head reads)")
    ax.set_ylabel("block L")
    fig.colorbar(image, ax=ax, label="moved by block L's heads from s (Δ probability)", pad=0.01)
    fig.suptitle(title, fontsize=11)
    return fig


def plot_source_vs_trace(source_map, restoration, tokens: Sequence[str], *, title: str = "",
                         highlight: Sequence[int] = (), figsize: tuple[float, float] = (13, 9)):
    """Notebook 09's example: one item's IG-Lens source-token x block map above its causal trace grid,
    the same tokens across both.

    Args:
        source_map: (n, S) probability moved by block L's heads from position s (IG-Lens sources).
        restoration: (S, n+1) ``CausalTrace.restoration``, drawn as nodes 0..n down.
        tokens: (S,) the positions' tokens; highlight: positions with red labels (the subject).
    """
    return _map_above_trace(source_map, restoration, tokens, first=1, ylabel="block L",
                            label="IG-Lens: probability moved by block L's heads from token s",
                            title=title, highlight=highlight, figsize=figsize)


def plot_carried_vs_trace(carried, restoration, tokens: Sequence[str], *, title: str = "",
                          highlight: Sequence[int] = (), figsize: tuple[float, float] = (13, 9),
                          label: str = "attribution graph: share of Δp carried by h_L(s) into later blocks"):
    """Notebook 11: the attribution graph's carried map (the share of Δp that the residual state at
    node L, position s carries into later blocks) above the causal trace grid of the same prompt,
    cell for cell: both are (node, position) maps.

    Args:
        carried: (n+1, S) share of f carried by ``h_L(s)``, nodes 0..n down.
        restoration: (S, n+1) ``CausalTrace.restoration``.
        tokens: (S,) the positions' tokens; highlight: positions with red labels (the subject).
        label: the upper map's title (e.g. the counterfactual graph's share of p_clean - p').
    """
    return _map_above_trace(carried, restoration, tokens, first=0, ylabel="node L (h_L)", label=label,
                            title=title, highlight=highlight, figsize=figsize)


def _map_above_trace(values, restoration, tokens: Sequence[str], *, first: int, ylabel: str, label: str,
                     title: str, highlight: Sequence[int], figsize: tuple[float, float]):
    """An IG-Lens (rows, S) map above a causal trace grid (S, n+1) drawn as nodes 0..n, shared tokens."""
    import matplotlib.pyplot as plt
    values = np.asarray(torch.as_tensor(values, dtype=torch.float64))
    grid = np.asarray(torch.as_tensor(restoration, dtype=torch.float64)).T  # (n+1, S)
    if grid.shape != (values.shape[0] + first, values.shape[1]):
        raise ValueError(f"restoration must be (S, n+1) = ({values.shape[1]}, {values.shape[0] + first}) "
                         f"for a map of shape {values.shape}, got {grid.T.shape}")
    fig, (ax_map, ax_trace) = plt.subplots(2, 1, figsize=figsize, sharex=True, constrained_layout=True)
    image = _position_map(ax_map, values, tokens, highlight=highlight, first=first)
    ax_map.set_ylabel(ylabel)
    ax_map.set_title(label, fontsize=10)
    fig.colorbar(image, ax=ax_map, label="Δ probability", pad=0.01)
    image = _position_map(ax_trace, grid, tokens, cmap="Purples", centred=False, highlight=highlight, first=0)
    ax_trace.set_ylabel("node L (restored h_L)")
    ax_trace.set_xlabel("position s")
    ax_trace.set_title("causal trace: share of the clean probability restored by h_L(s) alone", fontsize=10)
    fig.colorbar(image, ax=ax_trace, label="restoration r(s, L)", pad=0.01)
    fig.suptitle(title, fontsize=11)
    return fig


def plot_graph(nodes, links, tokens: Sequence[str], n_layers: int, *, title: str = "",
               figsize: tuple[float, float] = (13, 8)):
    """A pruned attribution graph drawn on the (position, block) plane.

    Args:
        nodes: items with ``kind`` (``"head"``, ``"neuron"``, ``"embedding"``), ``block`` (0..n),
            ``position`` and ``share`` (e.g. ``iglens_graph.Graph.pruned()``); marker by kind, area by
            |share|, colour by sign.
        links: ``(key_position, block, query_position, share)``: a head of ``block`` at the query
            reading the state ``h_(block-1)`` at the key; drawn from (key, block - 1) to (query,
            block), width by |share|, colour by sign.
        tokens: (S,) the positions' tokens; n_layers: n.
    """
    import matplotlib.pyplot as plt
    nodes, links = list(nodes), [tuple(link) for link in links]
    if not nodes:
        raise ValueError("nodes must hold at least one node (a pruned graph of a token with Δp = 0 is empty)")
    largest = max([abs(float(node.share)) for node in nodes] + [abs(float(link[3])) for link in links] + [1e-12])
    fig, ax = plt.subplots(figsize=figsize, constrained_layout=True)
    for key, block, query, share in links:
        ax.plot([key, query], [block - 1, block], color="tab:red" if share > 0 else "tab:blue",
                lw=0.5 + 6 * abs(share) / largest, alpha=0.5, zorder=1)
    markers = {"head": "o", "neuron": "s", "embedding": "^"}
    for kind, marker in markers.items():
        picked = [node for node in nodes if node.kind == kind]
        if not picked:
            continue
        shares = np.array([float(node.share) for node in picked])
        ax.scatter([node.position for node in picked], [node.block for node in picked], marker=marker,
                   s=20 + 600 * np.abs(shares) / largest, c=np.where(shares > 0, "tab:red", "tab:blue"),
                   edgecolors="black", linewidths=0.4, alpha=0.8, zorder=2, label=f"{kind}s ({len(picked)})")
    ax.set_xticks(range(len(tokens)), token_labels(tokens), rotation=90, fontsize=7)
    ax.set_ylim(-0.7, n_layers + 0.7)
    ax.set_ylabel("block (0: token embeddings)")
    ax.set_xlabel("position")
    ax.grid(alpha=0.2)
    ax.legend(loc="upper left", fontsize=8, title="red adds, blue removes; area and width by |share|",
              title_fontsize=8)
    ax.set_title(title, fontsize=11)
    return fig


def plot_paired_scores(per_item, *, metric: str, method: str, against: str, panel: str, title: str,
                       label: str = ""):
    """One point per item: ``against``'s score (x) and ``method``'s (y) on ``metric``, one panel per value of
    the ``panel`` column (e.g. the readout), the diagonal drawn: above it ``method`` agrees better.

    Args:
        per_item: a frame with columns ``id``, ``method``, ``panel`` and ``metric``, one row per
            (item, method, panel value).
    """
    import matplotlib.pyplot as plt
    panels = list(dict.fromkeys(per_item[panel]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 0.6, 3.9), sharex=True, sharey=True,
                             constrained_layout=True, squeeze=False)
    values = per_item[metric].to_numpy(dtype=float)
    low, high = np.nanmin(values, initial=0.0), np.nanmax(values, initial=1.0)
    for ax, name in zip(axes[0], panels):
        wide = per_item[per_item[panel] == name].pivot_table(index="id", columns="method", values=metric)
        x, y = wide[against].to_numpy(), wide[method].to_numpy()
        both = np.isfinite(x) & np.isfinite(y)  # a score is NaN where a map is all ties
        x, y = x[both], y[both]
        above = int(np.sum(y > x))
        ax.plot([low, high], [low, high], color="grey", lw=1, ls=":")
        ax.scatter(x, y, s=14, alpha=0.7, color="C3")
        ax.set_title(f"{name}: above the diagonal {above} of {len(x)}", fontsize=10)
        ax.set_xlabel(f"{against}")
    axes[0, 0].set_ylabel(f"{method}" + (f"\n{label}" if label else ""))
    fig.suptitle(title)
    return fig


def plot_faithfulness(curves: Mapping[str, Mapping[str, Sequence[float]]], percentages: Sequence[float], *,
                      title: str, panels: Mapping[str, str] = None):
    """Notebook 12's figure: MIB's faithfulness curves, one panel per kind of circuit, one line per method,
    x the percentage of edges kept (log scale), f = 1 (the model) and f = 0 (the counterfactual) dashed.

    Args:
        curves: kind -> method -> (K,) faithfulness at ``percentages`` (fractions of the edges, (K,)).
        panels: kind -> its panel title (default: the kind).
    """
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4.4), sharey=True, squeeze=False,
                             constrained_layout=True)
    for ax, (kind, methods) in zip(axes[0], curves.items()):
        for i, (method, f) in enumerate(methods.items()):
            ax.plot(100 * np.asarray(percentages), f, marker="o", ms=4, lw=1.2 if method == "random" else 2,
                    ls="--" if method == "random" else "-", color="grey" if method == "random" else f"C{i}",
                    label=method)
        for level in (0, 1):
            ax.axhline(level, color="k", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("edges in the circuit (% of all edges, top by score)")
        ax.set_title((panels or {}).get(kind, kind))
    axes[0, 0].set_ylabel("faithfulness f = (m(C) - m(empty)) / (m(full) - m(empty))")
    axes[0, -1].legend(loc="best", fontsize=9)
    fig.suptitle(title)
    return fig
