"""generate's settings as four frozen groups or as flat keywords: one list, one meaning."""

import dataclasses

import pytest

import specjax
from specjax import params as params_lib
from conftest import tiny_model


def test_every_field_belongs_to_exactly_one_group():
  names = [f.name for cls in params_lib.GROUPS.values() for f in dataclasses.fields(cls)]
  assert len(names) == len(set(names)) == len(params_lib.FIELDS)


def test_flat_keywords_land_in_their_groups():
  got = params_lib.resolve({"temperature": 0.5, "gamma": 3, "n": 2, "eos_id": None})
  assert got.sampling.temperature == 0.5 and got.speculation.gamma == 3
  assert got.output.n == 2 and got.stopping.eos_id is None
  assert got.sampling.top_p == 1.0  # the rest keep their defaults


def test_refused_by_name():
  with pytest.raises(TypeError, match=r"generate\(\) got unexpected keyword.*'temprature'"):
    params_lib.resolve({"temprature": 1.0}, "generate")
  with pytest.raises(ValueError, match=r"\['temperature'\] given both"):
    params_lib.resolve({"temperature": 1.0},
                       sampling=specjax.SamplingParams(temperature=0.5))
  with pytest.raises(ValueError, match="sampling= must be a specjax.SamplingParams"):
    params_lib.resolve({}, sampling={"temperature": 1.0})


def test_groups_and_flat_keywords_generate_the_same():
  model = tiny_model(vocab=16, n_layers=1, seed=2)
  flat = specjax.generate(model, [[1, 2, 3]], max_new_tokens=6, temperature=1.0, top_k=4,
                          drafter="ngram", gamma=2, logprobs=True, seed=3)
  grouped = specjax.generate(
      model, [[1, 2, 3]], seed=3,
      sampling=specjax.SamplingParams(temperature=1.0, top_k=4),
      stopping=specjax.StoppingParams(max_new_tokens=6),
      speculation=specjax.SpeculationParams(drafter="ngram", gamma=2),
      output=specjax.OutputParams(logprobs=True))
  assert grouped == flat
  with pytest.raises(TypeError, match=r"stream\(\) got unexpected"):
    specjax.stream(model, [[1, 2]], temprature=1.0)
