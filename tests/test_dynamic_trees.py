"""Dynamic token trees (trees.DynamicTree, drafters.trees.DynamicTreeModelDrafter): the
exact float64 law of the node walk over every tree the per-depth rerank can grow, and the
reranks that read the target or a child's own token are not lossless; then the engine:
the law of 3-token continuations at T > 0 with top-p, greedy equality, bad input."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import specjax
from specjax import trees
from specjax.drafters import trees as tree_drafters
from specjax.verify import tree as tree_verify
from conftest import LAW_ROWS, greedy_oracle, target_and_draft, tiny_model, within_law
from test_block import filtered_law
from test_traversal import _models, law_over, node_rule_outcomes, target_law, traversal_outcomes
from test_trees import distinct_draws


def alpha_rank_values(ranked, k, alpha):
  """P(rank r accepted) by the drafter's model for sampled children with `alpha` (written
  out again here): a = α₀ + (1 − α₀)·max², rank r ≥ 1: (1 − a) Π_{1≤s<r}(1 − α_s) α_r."""
  a = [alpha[min(r, len(alpha) - 1)] for r in range(k)]
  first = a[0] + (1 - a[0]) * ranked[0] ** 2
  out, reach = [first], 1 - first
  for r in range(1, k):
    out.append(reach * a[r])
    reach *= 1 - a[r]
  return out


def grown_trees(dtree, q, raw, mode, fallback, score="rank", p=None):
  """Every (Tree, node tokens, probability) the dynamic drafter can grow, float64.

  Depth d keeps its level size of (frontier node, child rank) pairs, best first by the
  path's score, ties to the lower (node, rank); a child of rank r adds log of the r-th
  largest raw probability at its parent ('rank', the drafter's), the drafter's alpha
  model of sampled children ('alpha', with dtree.alpha), or the log of its own token's
  draft probability ('own') or target probability ('target', with p): the planted
  reranks."""
  out = []

  def prefix(parents, tokens, i):
    s = []
    while i >= 0:
      s.append(tokens[i])
      i = parents[i]
    return tuple(reversed(s))

  def grow(level, parents, tokens, scores, frontier, prob):
    if level == dtree.depth:
      out.append((trees.Tree(tuple(parents)), list(tokens), prob))
      return
    count = dtree.level_sizes[level]
    k = min(dtree.topk, count)
    pre = [() if f < 0 else prefix(parents, tokens, f) for f in frontier]
    options = []
    for s in pre:
      if mode == "topk":
        options.append([(list(np.argsort(-q[s], kind="stable")[:k]), 1.0)])
      else:
        options.append(distinct_draws(q[s], k, fallback))
    for combo in itertools.product(*options):
      cands = []  # (score, index, parent, token)
      for j, (f, s, (seq, _)) in enumerate(zip(frontier, pre, combo)):
        base = 0.0 if f < 0 else scores[f]
        ranked = np.sort(raw[s])[::-1]
        priced = alpha_rank_values(ranked, k, dtree.alpha) if score == "alpha" else None
        for r, x in enumerate(seq):
          if score == "rank":
            add = ranked[r]
          elif score == "alpha":
            add = priced[r]
          elif score == "own":
            add = q[s][x]
          else:
            add = p[s][x]
          with np.errstate(divide="ignore"):
            cands.append((base + np.log(add), j * k + r, f, x))
      kept = sorted(sorted(cands, key=lambda c: (-c[0], c[1]))[:count], key=lambda c: c[1])
      w = prob * np.prod([wt for _, wt in combo])
      first = len(parents)
      grow(level + 1, parents + [c[2] for c in kept], tokens + [int(c[3]) for c in kept],
           scores + [c[0] for c in kept], list(range(first, first + count)), w)

  grow(0, [], [], [], [-1], 1.0)
  return out


def dynamic_law(dtree, p, q, grown, mode, outcomes=node_rule_outcomes):
  """The law of the first depth+1 emitted tokens (completed by the target) and the
  expected accepted tokens, over every grown tree and the walk's randomness (the node
  walk's, or traversal's)."""
  return law_over(grown, p, q, mode, outcomes, dtree.depth)


DYNAMIC = [(4, 2, 2), (5, 3, 2), (6, 3, 2)]  # (nodes, depth, topk)


class ExactLawTest(parameterized.TestCase):

  @parameterized.parameters(*itertools.product(DYNAMIC, ("sampled", "topk"), ("rank",)),
                            *itertools.product(DYNAMIC, ("sampled",), ("alpha",)))
  def test_law_is_p_and_the_keep_set_varies(self, shape, mode, score):
    """Summed over every grown tree: the law is p (float64), for the raw rank scores and
    for the alpha model of sampled children. Sampled children: the trees really differ in
    shape, and reranking on the target's probability is not lossless. (Top-k children:
    one tree per context, and the point-mass rule is exact for any distinct tokens fixed
    before the walk.)"""
    dtree = trees.DynamicTree(*shape, alpha=(0.6, 0.3) if score == "alpha" else None)
    rng = np.random.default_rng(sum(shape) * 11 + (mode == "topk"))
    vocab = 3
    p, q = _models(rng, vocab, dtree.depth, vocab)
    raw, _ = _models(rng, vocab, dtree.depth, vocab)  # the draft's raw probabilities
    fallback = [2, 0, 1]
    grown = grown_trees(dtree, q, raw, mode, fallback, score)
    self.assertAlmostEqual(sum(w for *_, w in grown), 1.0, places=12)
    want = target_law(p, vocab, dtree.depth)
    law, _ = dynamic_law(dtree, p, q, grown, mode)
    np.testing.assert_allclose(law, want, atol=1e-12)
    if mode == "topk":
      return
    self.assertGreater(len({t.parents for t, *_ in grown}), 1)  # the shape is data
    bad, _ = dynamic_law(dtree, p, q, grown_trees(dtree, q, raw, mode, fallback, "target", p),
                         mode)
    self.assertGreater(np.abs(bad - want).sum(), 1e-3)

  @parameterized.parameters(*itertools.product(DYNAMIC, ("sampled", "topk")))
  def test_traversal_law_is_p_and_accepts_no_less(self, shape, mode):
    """Traversal verification of every grown tree: the law is p (float64), the expected
    accepted length is at least the node walk's, and traversal that leaves the parent
    alone after a rejection is not lossless on them."""
    dtree = trees.DynamicTree(*shape)
    rng = np.random.default_rng(sum(shape) * 13 + (mode == "topk"))
    p, q = _models(rng, 3, dtree.depth, 3)
    raw, _ = _models(rng, 3, dtree.depth, 3)
    grown = grown_trees(dtree, q, raw, mode, [2, 0, 1])
    want = target_law(p, 3, dtree.depth)
    law, mean = dynamic_law(dtree, p, q, grown, mode, traversal_outcomes)
    np.testing.assert_allclose(law, want, atol=1e-12)
    _, node_mean = dynamic_law(dtree, p, q, grown, mode)
    self.assertGreaterEqual(mean, node_mean - 1e-12)
    wrong = lambda *a: traversal_outcomes(*a, update_parent=False)
    bad, _ = dynamic_law(dtree, p, q, grown, mode, wrong)
    self.assertGreater(np.abs(bad - want).sum(), 1e-3)

  def test_scoring_children_by_their_own_draws_is_not_lossless(self):
    """EAGLE-2's score (each sampled child's own q) lets a child's token decide whether
    its later siblings are tried: the law moves. The drafter's rank scores do not."""
    dtree = trees.DynamicTree(5, 3, 2)
    rng = np.random.default_rng(7)
    p, q = _models(rng, 3, dtree.depth, 3)
    grown = grown_trees(dtree, q, q, "sampled", [2, 0, 1], "own")
    law, _ = dynamic_law(dtree, p, q, grown, "sampled")
    self.assertGreater(np.abs(law - target_law(p, 3, dtree.depth)).sum(), 1e-3)


class StructureTest(parameterized.TestCase):

  def test_best_candidates_keeps_rank_prefixes_and_breaks_ties_low(self):
    score = jnp.array([[0.0, -1.0, -0.5, -jnp.inf, -jnp.inf, -jnp.inf]])
    np.testing.assert_array_equal(tree_drafters.best_candidates(score, 4), [[0, 1, 2, 3]])
    np.testing.assert_array_equal(tree_drafters.best_candidates(score, 2), [[0, 2]])

  def test_children_and_ancestors_match_the_static_tree(self):
    """For the parents of a static tree the dynamic helpers give its children and mask."""
    dtree = trees.DynamicTree(6, 3, 2, level_sizes=(2, 2, 2))
    parents = (-1, -1, 0, 0, 3, 3)
    static = trees.Tree(parents)
    got = np.asarray(tree_verify.children_of(dtree, jnp.array([parents])))[0]
    np.testing.assert_array_equal(got, static.children)
    anc = np.asarray(tree_verify.ancestors_of(dtree, jnp.array([parents])))[0]
    np.testing.assert_array_equal(anc, static.ancestors)
    self.assertEqual(dtree.depths, static.depths)

  @parameterized.parameters(False, True)
  def test_traversal_of_data_parents_is_the_static_walk(self, unroll):
    """The traversal walk of a tree given as data (its Euler tour, paths and ranks found
    on the device) gives the static tree's walk bit for bit: rows with different parents
    in one batch, sampled and top-k children, the loops rolled and unrolled."""
    from specjax.verify import traversal
    dtree = trees.DynamicTree(7, 3, 2, level_sizes=(2, 2, 3))
    rows = [(-1, -1, 0, 0, 2, 2, 3), (-1, -1, 1, 1, 2, 3, 3), (-1, -1, 0, 1, 2, 3, 3)]
    rng = np.random.default_rng(0)
    b, n, v = len(rows), dtree.nodes, 6
    ps = jnp.asarray(rng.dirichlet(np.ones(v) * 0.4, size=(b, n + 1)), jnp.float32)
    q = jnp.asarray(rng.dirichlet(np.ones(v) * 0.4, size=(b, n)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, size=(b, n)), jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(1), b)
    children = tree_verify.children_of(dtree, jnp.asarray(rows))
    for deterministic in (False, True):
      got = traversal.walk_batch(keys, tokens, q, ps, dtree, deterministic, unroll,
                                 children=children)
      for i, parents in enumerate(rows):
        static = trees.Tree(parents)
        want = traversal.walk(keys[i], tokens[i], q[i], ps[i], static, deterministic, unroll)
        events, _ = traversal.schedule(static)
        got_events = traversal.traced_schedule(dtree, children[i])[0]
        np.testing.assert_array_equal(np.asarray(got_events), events)
        for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
          k = np.asarray(a)[i]
          w = np.asarray(w)
          if k.shape != w.shape:  # by_rank: the static tree may be narrower
            np.testing.assert_array_equal(k[w.shape[0]:], 0)  # ranks it has none of
            k = k[:w.shape[0]]
          np.testing.assert_array_equal(k, w)

  def test_ngram_tree_keeps_the_most_shared_paths(self):
    """Prompt lookup's dynamic tree: after '9 1 2' the context went on 3 5 (three times),
    3 6 and, most recently, 4 7. The root's children are ordered by how many matches
    continue with them (3 before 4) and the one node of depth 2 goes to the path most
    matches share (3 5), where the static (2, 1) tree would put it under the first child
    whatever the counts below."""
    dtree = trees.DynamicTree(3, 2, 2, level_sizes=(2, 1))
    drafter = tree_drafters.DynamicNgramTreeDrafter(vocab_size=16, gamma=2, min_n=1, max_n=3,
                                                    tree=dtree)
    ctx = [9, 1, 2, 3, 5] * 3 + [9, 1, 2, 3, 6, 9, 1, 2, 4, 7, 9, 1, 2]
    tokens = jnp.array([ctx + [0] * 4, [9, 1, 2, 4, 7, 9, 1, 2, 3, 5, 9, 1, 2] + [0] * 19])
    n = jnp.array([len(ctx), 13])
    y, q, state = drafter.propose(None, drafter.init(2, 32), tokens, n, None, None)
    np.testing.assert_array_equal(y, [[3, 4, 5], [3, 4, 5]])
    np.testing.assert_array_equal(state.parents, [[-1, -1, 0], [-1, -1, 0]])
    np.testing.assert_array_equal(q, jax.nn.one_hot(y, 16))
    # One match each: the more recent first; its path keeps the depth-2 node.
    tokens = jnp.array([[9, 1, 2, 3, 5, 9, 1, 2, 4, 7, 9, 1, 2] + [0] * 19])
    y, _, state = drafter.propose(None, drafter.init(1, 32), tokens, jnp.array([13]), None,
                                  None)
    np.testing.assert_array_equal(y, [[4, 3, 7]])
    np.testing.assert_array_equal(state.parents, [[-1, -1, 0]])

  def test_level_sizes(self):
    self.assertEqual(trees.DynamicTree(14, 4, 4).level_sizes, (4, 4, 3, 3))
    self.assertEqual(trees.DynamicTree(14, 4, 2).level_sizes, (2, 4, 4, 4))
    for kw, msg in [(dict(nodes=2, depth=3), "nodes >= depth"),
                    (dict(nodes=4, depth=2, topk=0), "topk must be an int"),
                    (dict(nodes=6, depth=2, topk=2, level_sizes=(3, 3)), "at most topk"),
                    (dict(nodes=7, depth=2, topk=2, level_sizes=(2, 5)), "at most topk"),
                    (dict(nodes=6, depth=2, topk=4, level_sizes=(2, 2)), "summing"),
                    (dict(nodes=4, depth=2, alpha=(0.5, float("nan"))), "alpha must be"),
                    (dict(nodes=4, depth=2, alpha=(1.2,)), "alpha must be"),
                    (dict(nodes=4, depth=2, alpha=()), "alpha must be")]:
      with self.assertRaisesRegex(ValueError, msg):
        trees.DynamicTree(**kw)

  def test_like_takes_a_static_trees_shape(self):
    static = trees.Tree((-1, -1, -1, 0, 0, 1, 3, 3, 4, 5, 6, 6, 7, 9))
    dtree = trees.DynamicTree.like(static, alpha=[0.7, 0.4])
    self.assertEqual((dtree.nodes, dtree.depth, dtree.topk), (14, 4, 3))
    self.assertEqual(dtree.level_sizes, (3, 3, 4, 4))
    self.assertEqual(dtree.alpha, (0.7, 0.4))


def _path(parents, i):
  out = []
  while i >= 0:
    out.insert(0, i)
    i = parents[i]
  return out


class PassesTest(parameterized.TestCase):
  """What each node is scored with: the target pass and the draft's q, against uncached
  forwards of the node's own root-to-node path in its row's tree."""

  def test_target_pass_every_node_sees_its_path_in_its_rows_tree(self):
    from specjax.models import kv_cache
    from specjax.models import model as model_lib
    target = tiny_model(vocab=16, n_layers=2, seed=3, llama=True, n_heads=4, n_kv_heads=2)
    dtree = trees.DynamicTree(6, 3, 2, level_sizes=(2, 2, 2))
    parents = np.array([[-1, -1, 0, 0, 3, 3], [-1, -1, 1, 1, 2, 3]], np.int32)
    prompt = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], np.int32)
    nodes = np.array([[11, 12, 13, 14, 15, 1], [2, 3, 4, 5, 6, 7]], np.int32)
    kv = kv_cache.init_kv(target.config, 2, 32)
    _, kv = model_lib.forward_cached(target.graphdef, target.params, jnp.asarray(prompt[:, :4]),
                                     kv)
    chunk = jnp.concatenate([jnp.asarray(prompt[:, 4:]), jnp.asarray(nodes)], axis=1)
    anc = tree_verify.ancestors_of(dtree, jnp.asarray(parents))
    logits, _ = model_lib.forward_cached(
        target.graphdef, target.params, chunk, kv,
        **tree_verify.dynamic_layout(dtree, jnp.asarray([5, 5]), anc))
    for b in range(2):
      for i in range(dtree.num_nodes):
        seq = list(prompt[b]) + [int(nodes[b, j]) for j in _path(parents[b], i)]
        pad = [0] * (prompt.shape[1] + dtree.depth - len(seq))  # one compiled forward
        full = target.logits(jnp.asarray([seq + pad]))[0, len(seq) - 1]
        np.testing.assert_allclose(logits[b, i + 1], full, atol=1e-4, err_msg=f"{b} {i}")

  @parameterized.parameters(("static", 1.0), ("dynamic", 1.0), ("dynamic", 0.7),
                            ("static", 1.0, True), ("dynamic", 1.0, True))
  def test_model_drafters_q_is_the_draft_on_its_path(self, kind, temperature,
                                                     processed=False):
    """Node i's q is the draft's processed distribution after its parent's path, the
    path's tokens fed at their depths' positions (an uncached reference), in each row's
    own tree; siblings never repeat a token. `processed`: with penalties and an n-gram
    ban, applied in float64 to the committed tokens and the node's own path (a depth-3
    node's history is its depth-2 parent's, taken from the right frontier column)."""
    from specjax import arguments
    from specjax.processors import history as hist
    from specjax.processors.sampling import Sampling, process_logits
    from test_processors import EOS, PENALTIES, reference_logits
    target, draft = target_and_draft()
    tree = (trees.Tree.from_branching((2, 2, 1)) if kind == "static"
            else trees.DynamicTree(6, 3, 2, alpha=(0.6, 0.3)))
    drafter = arguments.make_drafter(target, draft, "model", None, "probabilistic", 1, 4, tree)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 8, (2, 32)).astype(np.int32)
    n = np.array([5, 7], np.int32)
    prompt_len = np.array([3, 4], np.int32)  # the committed tokens past it are generated
    kw = dict(PENALTIES, no_repeat_ngram_size=2) if processed else {}
    sampling = Sampling.create(2, temperature=temperature)
    if processed:
      pcfg, procs = hist.settings_from_args(2, 8, 8, np.zeros((1, 1), np.int32),
                                            np.zeros(1, np.int32), [EOS], **kw)
      sampling = Sampling.create(2, temperature=temperature, procs=procs, pcfg=pcfg)
      sampling = sampling.replace(history=hist.init_history(
          pcfg, sampling.procs, jnp.asarray(tokens), jnp.asarray(n), jnp.asarray(prompt_len), 8))
    state = jax.jit(drafter.prefill)(draft.params, drafter.init(2, 32), jnp.asarray(tokens),
                                     jnp.asarray(n))
    ys, qs, new = jax.jit(drafter.propose)(draft.params, state, jnp.asarray(tokens),
                                           jnp.asarray(n), jax.random.PRNGKey(5), sampling)
    ys, qs = np.asarray(ys), np.asarray(qs)
    parents = (np.broadcast_to(tree.parents, (2, tree.num_nodes)) if kind == "static"
               else np.asarray(new.parents))
    shapes = set()
    for b in range(2):
      shapes.add(tuple(parents[b]))
      for i in range(tree.num_nodes):
        above = [int(ys[b, j]) for j in _path(parents[b], i)[:-1]]
        seq = list(tokens[b, :n[b]]) + above
        pad = [0] * (int(n.max()) + tree.depth - len(seq))
        logits = draft.logits(jnp.asarray([seq + pad]))[0, len(seq) - 1]
        if processed:
          ref = reference_logits(logits, [int(t) for t in seq], int(prompt_len[b]), kw)
          q_ref = np.exp((ref - ref.max()) / temperature)
          q_ref /= q_ref.sum()
        else:
          q_ref = process_logits(logits, temperature, 0, 1.0)
        np.testing.assert_allclose(qs[b, i], q_ref, atol=2e-5, err_msg=f"{b} {i}")
      for par in set(parents[b].tolist()):
        sibs = [int(ys[b, j]) for j in range(tree.num_nodes) if parents[b, j] == par]
        self.assertEqual(len(sibs), len(set(sibs)))
    if kind == "dynamic":
      self.assertGreater(len(shapes), 1)  # the rows grew different trees

  def test_rank_scores_with_alpha_are_the_written_out_model(self):
    """Sampled rows score rank r by `alpha_rank_values`; the others by the raw log
    probability at the candidate; neither reads q."""
    logits = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 8)) * 2.0
    cands = jax.lax.top_k(logits, 4)[1]
    alpha = (0.6, 0.3, 0.2)
    got = np.asarray(tree_drafters.rank_scores(logits, cands, None, jnp.array([True, False]),
                                               alpha))
    probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
    for f in range(3):
      ranked = np.sort(probs[0, f])[::-1]
      np.testing.assert_allclose(np.exp(got[0, f]), alpha_rank_values(ranked, 4, alpha),
                                 rtol=1e-5)
      np.testing.assert_allclose(np.exp(got[1, f]), probs[1, f][np.asarray(cands[1, f])],
                                 rtol=1e-5)


ENGINE = {  # name: (DynamicTree's arguments, draft_sample, T, top-p)
    "sampled_T1": ((6, 3, 2), "probabilistic", 1.0, 1.0),
    "sampled_alpha_T08_topp": ((5, 2, 3, None, (0.6, 0.3)), "probabilistic", 0.8, 0.9),
    "topk_T08_topp": ((6, 3, 2), "greedy", 0.8, 0.9),
}


class EngineLawTest(parameterized.TestCase):
  """The empirical law of LAW_ROWS 3-token continuations with a dynamic tree, walked
  root first or (`_traversal`) leaves first."""

  @parameterized.named_parameters(*[(name, name) for name in ENGINE],
                                  ("sampled_T1_traversal", "sampled_T1", "traversal"),
                                  ("topk_T08_topp_traversal", "topk_T08_topp", "traversal"))
  def test_three_token_law(self, name, rule="exact"):
    shape, mode, temperature, top_p = ENGINE[name]
    target, draft = target_and_draft()
    prompt = [3, 1, 3]
    res = specjax.generate(target, [prompt] * LAW_ROWS, max_new_tokens=3, draft=draft,
                           tree=specjax.DynamicTree(*shape), draft_sample=mode,
                           temperature=temperature, top_p=top_p, seed=4, verify_rule=rule)
    ok, worst = within_law(res.tokens, filtered_law(target, prompt, 3, temperature, 0, top_p))
    self.assertTrue(ok, f"worst z={worst}")
    self.assertTrue(res.stats["lossless"])
    self.assertLess(res.stats["acceptance_rate"], 0.95)  # the draft really disagreed
    self.assertGreater(res.stats["rounds"], LAW_ROWS)  # and rounds were rolled back
    self.assertEqual(sum(res.stats["sibling_accepted"]), res.stats["accepted"])


class NgramLawTest(parameterized.TestCase):

  @parameterized.parameters("exact", "traversal")
  def test_three_token_law(self, rule):
    """Prompt lookup's dynamic tree (fixed-token children, the point-mass walk) at T = 1:
    the law of 3-token continuations, walked either way."""
    target, _ = target_and_draft()
    prompt = [3, 1, 3, 1, 2, 3, 1]
    res = specjax.generate(target, [prompt] * LAW_ROWS, max_new_tokens=3, drafter="ngram",
                           tree=specjax.DynamicTree(6, 3, 2), temperature=1.0, seed=4,
                           verify_rule=rule)
    ok, worst = within_law(res.tokens, filtered_law(target, prompt, 3, 1.0, 0, 1.0))
    self.assertTrue(ok, f"worst z={worst}")
    self.assertLess(res.stats["acceptance_rate"], 0.95)
    self.assertGreater(res.stats["rounds"], LAW_ROWS)
    self.assertGreater(res.stats["accepted"], 0)


class PenaltiesTest(parameterized.TestCase):

  @parameterized.parameters("model", "eagle")
  def test_law_with_penalties_and_bans(self, drafter):
    """Each node's q and p are processed with its own root-to-node history in its row's
    tree (`dynamic_tree_histories`): the law of 3-token continuations holds."""
    from test_heads import random_head
    from test_processors import EOS, PENALTIES, PROMPT, TEMPERATURE, exact_law, law_check
    target, draft = target_and_draft()
    if drafter == "eagle":
      draft = random_head(target, "eagle")
    law = exact_law(target, PROMPT, 3, TEMPERATURE, dict(PENALTIES, no_repeat_ngram_size=2))
    res = specjax.generate(target, [PROMPT] * LAW_ROWS, max_new_tokens=3,
                           temperature=TEMPERATURE, seed=5, eos_id=EOS, draft=draft,
                           tree=specjax.DynamicTree(5, 2, 3, alpha=(0.6, 0.3)),
                           no_repeat_ngram_size=2, **PENALTIES)
    ok, worst = law_check(law, res.tokens, 3)
    self.assertTrue(ok, f"worst z={worst}")
    self.assertGreater(res.stats["rounds"], LAW_ROWS)


class GreedyTest(parameterized.TestCase):

  @parameterized.parameters(((8, 3, 3), "greedy", "exact"), ((14, 4, 4), "probabilistic", "exact"),
                            ((8, 3, 3), "greedy", "traversal"), ((8, 3, 3), "ngram", "exact"),
                            ((8, 3, 3), "ngram", "traversal"))
  def test_equals_target_greedy(self, shape, mode, rule):
    target = tiny_model(vocab=16, n_layers=2, seed=3, sharpness=1.5)
    if mode == "ngram":
      kw = dict(drafter="ngram")
    else:
      kw = dict(draft=tiny_model(vocab=16, d_model=16, seed=8, sharpness=1.5),
                draft_sample=mode)
    prompts = [[1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2], [4, 5, 6, 7, 0, 1, 2, 3, 4], [7]]
    tree = specjax.DynamicTree(*shape) if mode == "probabilistic" else ("dynamic", *shape)
    res = specjax.generate(target, prompts, max_new_tokens=12, tree=tree, verify_rule=rule,
                           **kw)  # ('dynamic', ...): the configs' spelling
    for prompt, out in zip(prompts, res.tokens):
      self.assertEqual(out, greedy_oracle(target, prompt, 12))
    self.assertGreater(res.stats["accepted"], 0)
    if rule == "traversal":  # at T = 0 both walks accept the path matching the argmax
      node = specjax.generate(target, prompts, max_new_tokens=12, tree=tree, **kw)
      for key in ("accepted", "rounds"):
        self.assertEqual(res.stats[key], node.stats[key], key)


class BadInputTest(parameterized.TestCase):

  def test_refused_before_any_work(self):
    target, draft = target_and_draft()
    tree = specjax.DynamicTree(4, 2, 2)
    from test_heads import random_head
    for kw, msg in [(dict(draft=random_head(target, "medusa")), "needs drafter='model'"),
                    (dict(draft=draft, verify_rule="block"), "exact rule only or"),
                    (dict(draft=draft, gamma=3), "depth 2 but gamma=3")]:
      with self.assertRaisesRegex(ValueError, msg):
        specjax.generate(target, [[1, 2]], max_new_tokens=2, tree=tree, **kw)


class PlantedEngineTest(parameterized.TestCase):
  """Last in the file: it clears the compiled engines the tests above share."""

  def test_scoring_by_own_draws_is_caught(self):
    """The drafter scoring each sampled child by its own q (EAGLE-2's score) fails the
    engine law check the rank scores pass (the case sampled_T1)."""
    from unittest import mock
    from specjax import decode as decode_lib

    def own(logits, cands, q, *_):
      return jnp.log(jnp.take_along_axis(q, cands, axis=-1) + 1e-30)

    with mock.patch.object(tree_drafters, "rank_scores", own):
      decode_lib.decode.clear_cache()
      try:
        target, draft = target_and_draft()
        res = specjax.generate(target, [[3, 1, 3]] * LAW_ROWS, max_new_tokens=3, draft=draft,
                               tree=specjax.DynamicTree(6, 3, 2), temperature=1.0, seed=4)
      finally:
        decode_lib.decode.clear_cache()
    ok, worst = within_law(res.tokens, filtered_law(target, [3, 1, 3], 3, 1.0, 0, 1.0))
    self.assertFalse(ok, f"the own-draw score passed (worst z={worst})")
