"""Install memsaving (gradient checkpointing for TensorFlow 2) and treedecomp."""

from setuptools import Extension, find_packages, setup

# treedecomp's inner loops in C (min-fill, elimination tree): optional, the
# Python code is the reference and runs when no compiler is available.
COMPILED = Extension("treedecomp._compiled", ["treedecomp/_compiled.c"], optional=True)

setup(
    name="memsaving",
    version="0.1.0",
    description="Train TensorFlow 2 models that do not fit in memory: gradient checkpointing "
    "with automatic, budget-aware checkpoint selection.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["memsaving", "memsaving.*", "treedecomp", "treedecomp.*"]),
    # TensorFlow comes from an extra so users pick the CPU or the GPU build.
    install_requires=["networkx>=3.0", "numpy>=1.24"],
    extras_require={
        "cpu": ["tensorflow-cpu==2.21.0"],
        "gpu": ["tensorflow[and-cuda]==2.21.0"],
        "plot": ["matplotlib>=3.7"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "scipy>=1.10", "matplotlib>=3.7",
                 "nbclient>=0.9", "nbformat>=5.9", "ipykernel>=6.25"],
        # keras_hub backbones (GPT2, BERT) in experiments.bench_budget_promise.  keras-hub requires
        # tensorflow-text, which requires the full `tensorflow` distribution (same version as
        # tensorflow-cpu); keras_hub's backbones import and run without tensorflow-text.
        "bench": ["keras-hub==0.32.0"],
    },
    ext_modules=[COMPILED],
    entry_points={"console_scripts": ["memsaving=memsaving.tools.cli:main"]},
)
