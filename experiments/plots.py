"""summary.md and the PNG plots of a sweep, written from its results rows."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from specjax import ledger  # noqa: E402

PLOTS = ("acceptance_vs_gamma.png", "tokens_per_call.png", "speedup_vs_gamma.png",
         "acceptance_by_position.png")


_PROCESSORS = {"repetition_penalty": ("rep", 1.0), "presence_penalty": ("pres", 0.0),
               "frequency_penalty": ("freq", 0.0), "no_repeat_ngram_size": ("no-repeat", 0)}


_METHODS = {"gamma_policy": ("γ policy", "fixed"), "verify_rule": ("rule", "exact")}


def processors_label(r) -> str:
  """'rep 1.2, no-repeat 3' for the processors a row had on, and its tree ('' if none)."""
  parts = [f"{name} {r[k]:g}" for k, (name, off) in _PROCESSORS.items()
           if r.get(k, off) != off]
  parts += [f"{name} {r[k]}" for k, (name, off) in _METHODS.items() if r.get(k, off) != off]
  if r.get("tree"):
    parts.append("tree " + str(tuple(tuple(x) if isinstance(x, list) else x
                                     for x in r["tree"])).replace(" ", ""))
  return ", ".join(parts)


def _series(rows, drafter, batch, top_p, procs=""):
  """{temperature: rows sorted by γ} for one drafter / batch size / top-p / processors."""
  out = defaultdict(list)
  for r in rows:
    if (r["drafter"] == drafter and r["batch_size"] == batch and r["top_p"] == top_p
        and processors_label(r) == procs):
      out[r["temperature"]].append(r)
  return {t: sorted(rs, key=lambda r: r["gamma"]) for t, rs in sorted(out.items())}


def _panels(rows):
  keys = sorted({(r["drafter"], r["batch_size"], r["top_p"], processors_label(r))
                 for r in rows})
  fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
  return keys, fig, axes[0]


def _title(key):
  drafter, batch, top_p, procs = key
  return (f"{drafter} drafter, batch {batch}" + (f", top-p {top_p}" if top_p < 1 else "")
          + (f", {procs}" if procs else ""))


def write_report(rows: list[dict], workdir) -> None:
  workdir = Path(workdir)
  if not rows:
    return
  (workdir / "summary.md").write_text(summary_table(rows))

  keys, fig, axes = _panels(rows)
  for ax, key in zip(axes, keys):
    for t, rs in _series(rows, *key).items():
      ax.plot([r["gamma"] for r in rs], [r["acceptance_rate"] for r in rs], "o-", label=f"T={t}")
    ax.set(title=_title(key), xlabel="γ", ylabel="accept rate", ylim=(0, 1.02))
    ax.legend()
  fig.tight_layout()
  fig.savefig(workdir / PLOTS[0], dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(5, 4.5))
  markers = dict(model="o", ngram="s", eagle="^", medusa="v")
  for drafter in sorted({r["drafter"] for r in rows}):
    marker = markers.get(drafter, "x")
    rs = [r for r in rows if r["drafter"] == drafter]
    if rs:
      ax.scatter([r["expected_tokens"] for r in rs], [r["tokens_per_target_call"] for r in rs],
                 marker=marker, label=f"{drafter} drafter")
  hi = max(max(r["expected_tokens"], r["tokens_per_target_call"]) for r in rows) * 1.05
  ax.plot([1, hi], [1, hi], "k--", lw=1, label="tokens/call = E(α̂, L)")
  ax.set(xlabel="E(α̂, L) (the ledger's)", ylabel="tokens/call (measured)",
         title="Tokens per target call")
  ax.legend()
  fig.tight_layout()
  fig.savefig(workdir / PLOTS[1], dpi=110)
  plt.close(fig)

  keys, fig, axes = _panels(rows)
  for ax, key in zip(axes, keys):
    for i, (t, rs) in enumerate(_series(rows, *key).items()):
      color = f"C{i}"
      g = [r["gamma"] for r in rs]
      mid = np.array([r["speedup"] for r in rs])
      spread = np.array([[m - r.get("speedup_min", m), r.get("speedup_max", m) - m]
                         for m, r in zip(mid, rs)]).T
      ax.errorbar(g, mid, yerr=spread, fmt="o-", color=color, capsize=3,
                  label=f"T={t} speedup (min–max)")
      ax.plot(g, [r["predicted_speedup"] for r in rs], "x--", color=color,
              label=f"T={t} predicted (ledger)")
      # The whole call's prediction and ceiling, where measured (call_costs) for every γ.
      for field, fmt, what in (("predicted_call_speedup", "+:", "predicted (call)"),
                               ("ceiling_call_speedup", "_", "ceiling (call): all accepted")):
        if all(r.get(field) is not None for r in rs):
          ax.plot(g, [r[field] for r in rs], fmt, color=color, ms=12, mew=2,
                  label=f"T={t} {what}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(title=_title(key), xlabel="γ", ylabel="speedup vs target-only")
    # Below the axes: eight entries would hide the points.
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
  fig.set_figheight(5.5)
  fig.tight_layout()
  fig.savefig(workdir / PLOTS[2], dpi=110)
  plt.close(fig)

  keys, fig, axes = _panels(rows)
  for ax, key in zip(axes, keys):
    for t, rs in _series(rows, *key).items():
      r = rs[-1]  # the largest γ shows the most positions
      rates = r["acceptance_by_position"]
      ax.plot(np.arange(1, len(rates) + 1), rates, "o-", label=f"T={t}, γ={r['gamma']}")
    ax.set(title=_title(key), xlabel="draft position i",
           ylabel="P(accept i | reached i)", ylim=(0, 1.02))
    ax.legend()
  fig.tight_layout()
  fig.savefig(workdir / PLOTS[3], dpi=110)
  plt.close(fig)


SUMMARY_COLUMNS = [
    ("drafter", "drafter", "s"), ("batch", "batch_size", "d"), ("T", "temperature", "g"),
    ("top-p", "top_p", "g"), ("processors", "processors", "s"), ("γ", "gamma", "d"), ("α̂", "alpha_hat", ".3f"),
    ("accept rate", "acceptance_rate", ".3f"), ("tokens/call", "tokens_per_target_call", ".2f"),
    ("E(α̂, L)", "expected_tokens", ".2f"), ("drafting", "drafting", ".2f"),
    ("c", "c", ".3f"), ("v(γ)", "v", ".2f"),
    ("tok/s", "tokens_per_s", ".0f"), ("target-only tok/s", "target_only_tokens_per_s", ".0f"),
    ("speedup (min–max)", "speedup", "x"), ("predicted (ledger)", "predicted_speedup", "x"),
    ("round ρ", "round_ratio", ".2f"), ("predicted (call)", "predicted_call_speedup", "x"),
    ("ceiling (call)", "ceiling_call_speedup", "x")]

# What each column means, printed under the table (the plots use the same names).
LEGEND = {
    "processors": "the history-dependent processors, γ policy, verify rule or token tree a "
                  "row ran with (none: a plain chain at the exact rule)",
    "α̂": "the mean of Σ min(p, q) over drafted positions: the chance a draft token is "
         "accepted, computed from the distributions (less noisy than the count)",
    "accept rate": "draft tokens accepted / drafted, as counted",
    "tokens/call": "tokens committed per target call, measured",
    "E(α̂, L)": "the tokens per target call the ledger expects, (1 − α̂^(L+1)) / (1 − α̂) "
               "averaged over the measured draft lengths L (L = γ when every round drafts)",
    "drafting": "the share of rounds that drafted (the n-gram drafter drafts nothing "
                "without a match)",
    "c": "a draft step's cost in target steps (median of per-round ratios)",
    "v(γ)": "a (γ+1)-token target pass's cost in 1-token passes",
    "tok/s": "new tokens per second, speculative and target-only, on the same prompts",
    "speedup (min–max)": "speculative against target-only, timed alternately: the median "
                         "per-pair ratio and its range",
    "predicted (ledger)": "E(α̂, L) / (steps·c + v(γ)): decoding rounds only, no prefill "
                          "or other fixed work of a call",
    "round ρ": "a speculative round's measured cost in target-only rounds (verification, "
               "sampling and commit included)",
    "predicted (call)": "the whole call's prediction: its rounds at the measured ρ plus each "
                        "side's measured fixed part (prefill, host work)",
    "ceiling (call)": "the whole call's speedup were every draft accepted (γ + 1 tokens a "
                      "round) at the same ρ and fixed parts: an upper bound on what better "
                      "acceptance alone could buy here",
}

# A prediction fits a point when the measured speedup is within FIT_TOLERANCE of it, and
# fits the sweep when it fits at least FIT_SHARE of the points; only a prediction that
# fits is used to recommend anything.
FIT_TOLERANCE = 0.10
FIT_SHARE = 0.8


def prediction_fit(rows: list[dict], key: str) -> tuple[int, int]:
  """(points within FIT_TOLERANCE of the prediction `key`, points that have one)."""
  have = [r for r in rows if np.isfinite(r.get(key) or np.nan) and r[key] > 0]
  return sum(abs(r["speedup"] / r[key] - 1) <= FIT_TOLERANCE for r in have), len(have)


def fits(within: int, points: int) -> bool:
  return points > 0 and within >= FIT_SHARE * points


def _plain(r) -> bool:
  """A chain at the plain settings: no tree, processor, γ policy or other rule."""
  return r["processors"] == "none"


def _point(r) -> str:
  return (f"the {r['drafter']} drafter at γ={r['gamma']}, T={r['temperature']:g}, batch "
          f"{r['batch_size']}" + (f", top-p {r['top_p']:g}" if r["top_p"] < 1 else "")
          + ("" if _plain(r) else f", {r['processors']}"))


def _speedup(r) -> str:
  text = f"{r['speedup']:.2f}x"
  if "speedup_min" in r and "speedup_max" in r:
    text += f" ({r['speedup_min']:.2f}–{r['speedup_max']:.2f})"
  return text


def summary_table(rows: list[dict]) -> str:
  rows = [dict(r, processors=processors_label(r) or "none") for r in rows]
  order = sorted(rows, key=lambda r: (r["drafter"], r["batch_size"], r["top_p"],
                                      r["processors"], r["temperature"], r["gamma"]))
  lines = [common.markdown_table(order, SUMMARY_COLUMNS), ""]
  lines += [f"- **{name}**: {text}" for name, text in LEGEND.items()]
  best = max(rows, key=lambda r: r["speedup"])
  lines += ["", f"Best measured: {_speedup(best)} with {_point(best)} "
            f"({best['tokens_per_s']:.0f} vs {best['target_only_tokens_per_s']:.0f} tokens/s)."]

  ledger_fit, call_fit = prediction_fit(rows, "predicted_speedup"), \
      prediction_fit(rows, "predicted_call_speedup")
  verdict = lambda fit: "it fits" if fits(*fit) else "it does not fit"
  text = (f"Measured within {FIT_TOLERANCE:.0%} of the prediction: {ledger_fit[0]} of "
          f"{ledger_fit[1]} points by the ledger's E/(γc+v) (decoding rounds only), "
          f"{verdict(ledger_fit)}")
  if call_fit[1]:
    text += (f"; {call_fit[0]} of {call_fit[1]} by the whole call's (round ρ, prefill and "
             f"host work measured), {verdict(call_fit)}.")
  else:
    text += ("; the whole call was not timed (call_costs off), so no prediction counts "
             "a call's prefill and fixed work.")
  lines.append(text)
  unfit = [name for name, fit in (("the ledger's", ledger_fit), ("the whole call's", call_fit))
           if fit[1] and not fits(*fit)]
  if unfit:
    lines.append(f"Nothing here is recommended from {' or '.join(unfit)} prediction: "
                 f"where a prediction misses the measurements, so would its optimum.")

  lines += ["", "## Recommendation", ""]
  if best["speedup"] <= 1.0:
    lines.append(f"Target-only decoding: no measured point ran faster than target-only "
                 f"here (the best, {_point(best)}, measured {_speedup(best)}).")
  else:
    point = _point(best)
    text = f"{point[0].upper()}{point[1:]}: the best measured point, {_speedup(best)}."
    if fits(*call_fit):
      ranked = sorted((r for r in rows if r.get("predicted_call_speedup")),
                      key=lambda r: -r["predicted_call_speedup"])
      top = ranked[0]
      if top is best:
        text += (f" The whole call's prediction, which fits, ranks it first as well "
                 f"({top['predicted_call_speedup']:.2f}x predicted).")
      else:
        mine = best.get("predicted_call_speedup")
        close = mine and top["predicted_call_speedup"] / mine - 1 <= FIT_TOLERANCE
        text += (f" The whole call's prediction, which fits, ranks {_point(top)} first "
                 f"({top['predicted_call_speedup']:.2f}x predicted, {_speedup(top)} measured)")
        if not mine:
          text += "; this point has no whole-call prediction to set beside it."
        elif close:
          text += (f" and this point at {mine:.2f}x: closer than the prediction's fit, so "
                   f"the two are not told apart.")
        else:
          text += (f" and this point at {mine:.2f}x: more than the prediction's fit apart; "
                   f"time both again (more --config.timing_pairs) before choosing.")
    if best.get("speedup_min", best["speedup"]) < 1.0:
      text += (f" Its slowest timed pair ran at {best['speedup_min']:.2f}x: the machine's "
               f"speed moved while it was timed; time it again (more --config.timing_pairs) "
               f"before relying on it.")
    same = [r for r in rows if r["drafter"] == best["drafter"] and _plain(r) == _plain(best)]
    if best["gamma"] == max(r["gamma"] for r in same) and not best.get("tree"):
      text += (f" γ={best['gamma']} is the largest γ measured for the {best['drafter']} "
               f"drafter: longer drafts were not measured (add them with --config.gamma).")
    lines.append(text)

  plain = [r for r in order if _plain(r)]
  groups = defaultdict(list)
  for r in plain:
    groups[(r["drafter"], r["batch_size"], r["top_p"], r["temperature"])].append(r)
  if groups:
    per = [max(rs, key=lambda r: r["speedup"]) for rs in groups.values()]
    columns = [c for c in SUMMARY_COLUMNS if c[1] in (
        "drafter", "batch_size", "temperature", "top_p", "gamma", "alpha_hat", "speedup",
        "predicted_call_speedup", "ceiling_call_speedup")]
    lines += ["", "The best measured γ of each drafter at each setting (plain chains):", "",
              common.markdown_table(per, columns)]

  if fits(*ledger_fit):
    for drafter in sorted({r["drafter"] for r in plain}):
      # A tree's v (a wider pass) is not the chain's v(γ): chains at T = 0 only.
      greedy = [r for r in plain if r["drafter"] == drafter and r["temperature"] == 0.0
                and r["batch_size"] == min(x["batch_size"] for x in rows)]
      if not greedy:
        continue
      alpha = float(np.mean([r["alpha_hat"] for r in greedy]))
      c = float(np.mean([r["c"] for r in greedy]))
      v = ledger.fit_verify_cost([r["gamma"] for r in greedy], [r["v"] for r in greedy])
      top = max(r["gamma"] for r in greedy)  # no optimum beyond what was measured
      g, s = ledger.optimal_gamma(alpha, c, v, max_gamma=top)
      lines.append(f"\nThe ledger, which fits here, puts the {drafter} drafter's best γ at "
                   f"T=0 (batch {greedy[0]['batch_size']}, mean α̂={alpha:.3f}, mean "
                   f"c={c:.3f}, γ up to the measured {top}) at γ={g}, predicted {s:.2f}x.")
  return "\n".join(lines) + "\n"
