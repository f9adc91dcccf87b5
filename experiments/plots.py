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
    ax.set(title=_title(key), xlabel="γ", ylabel="acceptance rate", ylim=(0, 1.02))
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
  ax.plot([1, hi], [1, hi], "k--", lw=1, label="measured = E(α̂, γ)")
  ax.set(xlabel="E(α̂, γ) predicted", ylabel="tokens per target call (measured)",
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
                  label=f"T={t} measured (paired median, min–max)")
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
    ("speedup (min–max)", "speedup", "x"), ("predicted", "predicted_speedup", "x"),
    ("round ρ", "round_ratio", ".2f"), ("predicted (call)", "predicted_call_speedup", "x"),
    ("ceiling (call)", "ceiling_call_speedup", "x")]


def summary_table(rows: list[dict]) -> str:
  rows = [dict(r, processors=processors_label(r) or "none") for r in rows]
  order = sorted(rows, key=lambda r: (r["drafter"], r["batch_size"], r["top_p"],
                                      r["processors"], r["temperature"], r["gamma"]))
  lines = [common.markdown_table(order, SUMMARY_COLUMNS), "",
           "E(α̂, L): the ledger's tokens per round over the measured draft lengths L "
           "(Σ P(L) E(α̂, L)); drafting: the share of rounds that drafted (the n-gram "
           "drafter drafts nothing without a match); ceiling (call): the whole call's "
           "speedup were every draft accepted, at the measured round cost ρ and fixed "
           "parts (an upper bound: what better acceptance alone could buy here)."]
  best = max(rows, key=lambda r: r["speedup"])
  lines += ["", f"Best measured: {best['speedup']:.2f}x with the {best['drafter']} drafter, "
            f"γ={best['gamma']}, T={best['temperature']}, batch {best['batch_size']} "
            f"({best['tokens_per_s']:.0f} vs {best['target_only_tokens_per_s']:.0f} tokens/s)."]
  whole = [r for r in rows if np.isfinite(r.get("predicted_call_speedup") or np.nan)]
  if whole:
    near = lambda key: sum(abs(r["speedup"] / r[key] - 1) <= 0.1 for r in whole)
    lines.append(f"Measured within 10% of the prediction: {near('predicted_speedup')} of "
                 f"{len(whole)} points by the ledger's E/(γc+v) (over the measured "
                 f"draft lengths L), "
                 f"{near('predicted_call_speedup')} by the whole call's (round ρ, prefill "
                 f"and host work measured).")
  for drafter in sorted({r["drafter"] for r in rows}):
    # Chains at the plain settings only: a tree's v (a wider pass) is not the chain's v(γ).
    greedy = [r for r in rows if r["drafter"] == drafter and r["temperature"] == 0.0
              and r["batch_size"] == min(x["batch_size"] for x in rows) and not r.get("tree")
              and r.get("gamma_policy", "fixed") == "fixed"
              and r.get("verify_rule", "exact") == "exact" and r["processors"] == "none"]
    if greedy:
      alpha = float(np.mean([r["alpha_hat"] for r in greedy]))
      c = float(np.mean([r["c"] for r in greedy]))
      v = ledger.fit_verify_cost([r["gamma"] for r in greedy], [r["v"] for r in greedy])
      g, s = ledger.optimal_gamma(alpha, c, v)
      lines.append(f"Ledger optimum at T=0 for the {drafter} drafter (batch "
                   f"{greedy[0]['batch_size']}, mean α̂={alpha:.3f}, mean c={c:.3f}): γ={g}, "
                   f"predicted {s:.2f}x.")
  return "\n".join(lines) + "\n"
