from setuptools import find_packages, setup

setup(
    name="specjax",
    version="0.1.0",
    description="Lossless speculative decoding in JAX/Flax",
    # The one place the repository's URL is written: the notebooks' install cells clone it.
    url="https://github.com/specjax/specjax",
    python_requires=">=3.11",
    packages=find_packages(include=["specjax", "specjax.*"]),
    package_data={"specjax": ["py.typed"], "specjax.backends.cpu": ["fewrow.cc"]},
    install_requires=[
        "jax>=0.4.35",
        "flax>=0.12.0",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11.0",
        "numpy>=1.26",
        "absl-py>=2.1",
        "chex>=0.1.88",
        "ml-collections>=0.1.1",
        "tokenizers>=0.20",
        "interegular>=0.3.3",
        "matplotlib>=3.8",
        "tqdm>=4.66",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.6", "nbformat>=5.9", "nbclient>=0.10", "ipykernel>=6.29"],
        "hf": ["torch==2.13.0", "transformers>=5.0", "safetensors>=0.8",
               "huggingface-hub>=0.26"],
    },
)
