r"""What streaming costs: `specjax.stream` against `generate`, whole calls, interleaved.

  python -m experiments.bench_stream --out=docs/results/stream.json

For each chunk size (rounds per chunk) and each held-out prompt (batch 1), one
`generate` call and one fully read stream with the same arguments and seed are timed
alternately, the order flipping from prompt to prompt. Reported per chunk size: the
median and quartiles of stream time / generate time (what the chunks' calls and reads
add), the time to the first chunk as a share of the whole `generate` call, and the
chunks a call took. Every stream's tokens are checked against its `generate` call.

  python -m experiments.bench_stream --text --batch=8 --max_new_tokens=448 --temperature=1

times a stream's text instead (one stream of --batch rows, one round a chunk): its
chunks replayed through `stream`'s windowed text and through decoding the whole row
every chunk (the baseline: what the text cost before, and what a streamer that
re-decodes its row costs), alternately, the texts checked equal; then whole streams
with each, alternately; 2 * --repeats + 1 pairs of each.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app
from absl import flags

import specjax
from experiments import common
from specjax import costs

_DRAFTER = flags.DEFINE_enum("drafter", "model", ["model", "ngram"], "Drafter.")
_GAMMA = flags.DEFINE_integer("gamma", 2, "Draft length γ.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature.")
_CHUNKS = flags.DEFINE_list("rounds_per_chunk", ["1", "4", "16"], "Chunk sizes.")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "Held-out prompts (one per call).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Passes over the prompts.")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "New tokens per call.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")
_TEXT = flags.DEFINE_bool("text", False, "Time the chunks' text (windowed vs whole row).")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows in one stream, for --text.")


def _quartiles(xs):
  q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
  return {"median": statistics.median(xs), "q1": q[0], "q3": q[2]}


class WholeRow:
  """The baseline text: decode the row so far every chunk, hand out what is new."""

  def __init__(self, tokenizer):
    self._decode, self._ids, self._sent = tokenizer.decode, [], ""

  def add(self, ids, done):
    self._ids += ids
    text = self._decode(self._ids)
    if not done:
      text = text.rstrip("\ufffd")
    delta = text[len(self._sent):]
    self._sent += delta
    return delta


def text_main(target, prompts, kw):
  """Windowed text against `WholeRow`, on one stream's chunks, then in whole streams."""
  from specjax import generation
  windowed = generation._TextStream
  chunks = list(specjax.stream(target, prompts, rounds_per_chunk=1, **kw))
  batch = len(prompts)
  print(f"batch {batch}: {len(chunks)} chunks, "
        f"{sum(len(t) for c in chunks for t in c.tokens)} tokens", flush=True)

  def replay(cls):
    rows = [cls(target.tokenizer) for _ in range(batch)]
    start = time.perf_counter()
    out = [[r.add(c.tokens[i], c.done[i]) for i, r in enumerate(rows)] for c in chunks]
    return time.perf_counter() - start, ["".join(o[i] for o in out) for i in range(batch)]

  def whole(cls):
    generation._TextStream = cls
    try:
      start = time.perf_counter()
      list(specjax.stream(target, prompts, rounds_per_chunk=1, **kw))
      return time.perf_counter() - start
    finally:
      generation._TextStream = windowed

  times = {"whole_row": [], "windowed": []}
  ratios, stream_ratios = [], []
  for r in range(_REPEATS.value * 2 + 1):
    pair = (WholeRow, windowed) if r % 2 else (windowed, WholeRow)
    (ta, xa), (tb, xb) = replay(pair[0]), replay(pair[1])
    if xa != xb:
      raise AssertionError("the windowed text differs from the whole row's")
    old, new = (ta, tb) if pair[0] is WholeRow else (tb, ta)
    times["whole_row"].append(old)
    times["windowed"].append(new)
    ratios.append(old / new)
  whole(windowed), whole(WholeRow)  # warm
  for r in range(_REPEATS.value * 2 + 1):
    pair = (WholeRow, windowed) if r % 2 else (windowed, WholeRow)
    ta, tb = whole(pair[0]), whole(pair[1])
    stream_ratios.append(ta / tb if pair[0] is WholeRow else tb / ta)
  row = dict(batch=batch, chunks=len(chunks),
             text_s={k: _quartiles(v) for k, v in times.items()},
             text_whole_row_over_windowed=_quartiles(ratios),
             stream_whole_row_over_windowed=_quartiles(stream_ratios),
             max_new_tokens=_NEW.value, temperature=_TEMPERATURE.value,
             machine=costs.machine_info())
  t, q, w = row["text_s"], row["text_whole_row_over_windowed"], row[
      "stream_whole_row_over_windowed"]
  print(f"text of a stream: whole row {1e3 * t['whole_row']['median']:.1f} ms, windowed "
        f"{1e3 * t['windowed']['median']:.1f} ms, ratio {q['median']:.1f} "
        f"({q['q1']:.1f}-{q['q3']:.1f}); whole streams {w['median']:.3f} "
        f"({w['q1']:.3f}-{w['q3']:.3f})", flush=True)
  return [row]


def main(argv):
  del argv
  draft_name = "stdlib-draft" if _DRAFTER.value == "model" else None
  target, draft = common.load_pair("stdlib-target", draft_name)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib",
                                   _BATCH.value if _TEXT.value else _PROMPTS.value, 64)
  kw = dict(max_new_tokens=_NEW.value, temperature=_TEMPERATURE.value, gamma=_GAMMA.value,
            seed=0, eos_id=None, **(dict(draft=draft) if draft else dict(drafter="ngram")))
  if _TEXT.value:
    rows = text_main(target, prompts, kw)
    if _OUT.value:
      with open(_OUT.value, "w") as f:
        json.dump(rows, f, indent=1)
    return
  rows = []
  for k in map(int, _CHUNKS.value):
    ratios, first, chunks = [], [], []
    for p in prompts:  # compile and warm both sides on every prompt's shapes
      specjax.generate(target, [p], **kw)
      list(specjax.stream(target, [p], rounds_per_chunk=k, **kw))
    for r in range(_REPEATS.value):
      for i, p in enumerate(prompts):
        times = {}

        def gen():
          start = time.perf_counter()
          times["tokens"] = specjax.generate(target, [p], **kw).tokens
          times["generate"] = time.perf_counter() - start

        def stream():
          start = time.perf_counter()
          s = specjax.stream(target, [p], rounds_per_chunk=k, **kw)
          got = []
          for chunk in s:
            times.setdefault("first", time.perf_counter() - start)
            got.append(chunk)
          times["stream"] = time.perf_counter() - start
          times["chunks"] = len(got)
          times["streamed"] = [sum((c.tokens[0] for c in got), [])]

        for fn in ((gen, stream) if (r + i) % 2 == 0 else (stream, gen)):
          fn()
        if times["streamed"] != times["tokens"]:
          raise AssertionError(f"prompt {i}: the stream's tokens differ from generate's")
        ratios.append(times["stream"] / times["generate"])
        first.append(times["first"] / times["generate"])
        chunks.append(times["chunks"])
    row = dict(rounds_per_chunk=k, stream_over_generate=_quartiles(ratios),
               first_chunk_share=_quartiles(first), chunks=statistics.median(chunks),
               drafter=_DRAFTER.value, gamma=_GAMMA.value, temperature=_TEMPERATURE.value,
               calls=len(ratios), machine=costs.machine_info())
    rows.append(row)
    s, f = row["stream_over_generate"], row["first_chunk_share"]
    print(f"{k:3d} rounds a chunk: {row['chunks']:.0f} chunks, stream / generate "
          f"{s['median']:.3f} ({s['q1']:.3f}-{s['q3']:.3f}), first chunk at "
          f"{f['median']:.3f} ({f['q1']:.3f}-{f['q3']:.3f}) of generate's time", flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
