from setuptools import Extension, find_packages, setup

# spdl: the suite's "spdl" contender (iterate_in_subprocess with its zero-copy shared-memory
# pool); pure Python over numpy, and optional at run time (n/a without it).
# ray[data]: the Ray comparison (benchmarks/ray_compare.py) runs a simulated two-node cluster
# and Ray Data as a contender; optional at run time as well (n/a without it).
# pillow: the loader comparison (benchmarks/loader_compare.py) decodes JPEGs with it.
BENCH = ["numpy>=1.24", "matplotlib>=3.7", "tqdm>=4.60", "spdl>=0.8", "ray[data]>=2.60", "pillow>=9.0"]
# MkDocs: the docs are Markdown, the format of the README and of the pages' examples that
# the tests run; mkdocstrings renders the API reference from the docstrings. Pygments
# colours the code when the site is built (through pymdown-extensions' highlight), so the
# pages need no script from a CDN to show it.
DOCS = ["mkdocs>=1.6", "mkdocstrings[python]>=1.0", "pyyaml>=6.0", "pymdown-extensions>=10.0", "pygments>=2.19"]
# Plan.render() and `explain --format svg|png` draw with Graphviz's dot through this package.
RENDER = ["graphviz>=0.20"]
# The Ray backend (RayBackend): worker segments as Ray actors on a cluster's nodes. 2.9 is
# the oldest release whose APIs it uses behave as described (owner death, ray.wait with a
# timeout, the runtime context's node id); 2.60 is the one measured.
RAY = ["ray>=2.9"]
# Hugging Face Accelerate, and so Transformers' Trainer, on the engine
# (mprs_plus.integrations.accelerate): it replaces internals of Accelerate's loader wrapper,
# so only the releases it was tested with (its SUPPORTED, which enable() checks).
ACCELERATE = ["accelerate>=1.0,<1.17"]

setup(
    name="mprs_plus",
    version="0.1.0",
    description=(
        "A multiprocessing reading service for torchdata's DataLoader2 that splits the DataPipe "
        "graph at explicit markers and never silently runs it in one process"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mprs_plus", "mprs_plus.*"]),
    # Workers write large batches with streaming stores through this (transport/streaming.py).
    # Optional: without a C compiler the install goes on, and copies take the ordinary path.
    ext_modules=[Extension("mprs_plus.transport._streaming", ["mprs_plus/transport/_streaming.c"], optional=True)],
    python_requires=">=3.11",  # exceptions carry notes (add_note) from 3.11
    install_requires=[
        "torch>=2.1",
        # 0.10 removed DataLoader2 and the DataPipes this service runs.
        "torchdata>=0.7,<0.10",
        "psutil>=5.9",
        # torch imports numpy when present and warns "Failed to initialize NumPy" on import
        # without it; items that hold arrays also travel through it.
        "numpy>=1.24",
    ],
    extras_require={
        # The suite also builds the docs and checks the explain command's rendering
        # messages, so it needs the docs tools and the graphviz package (not Graphviz's
        # dot program: the tests that draw images skip without it).
        # It also runs the benchmark suite once (--quick), plot included.
        # dill: the suite checks that lambdas cross into spawned children as with torchdata,
        # which uses dill when it is installed (the service needs it only for that).
        "test": [
            "pytest>=7.4",
            "pytest-timeout>=2.2",
            # pytest.ini runs the suite on two workers (why: there).
            "pytest-xdist>=3.5",
            "dill>=0.3.6",
            # The suite re-creates the loader as Lightning does (DDP's sampler).
            "lightning>=2.0",
            *BENCH,
            *DOCS,
            *RENDER,
            *RAY,
            # The integration's tests, Trainer's included (a model defined in the test: no
            # download). Wheels only, and torch stays at the pinned release.
            *ACCELERATE,
            "transformers>=5.0",
        ],
        "docs": DOCS,
        "render": RENDER,
        "ray": RAY,
        "accelerate": ACCELERATE,
        "bench": BENCH,
    },
    entry_points={"console_scripts": ["mprs-plus=mprs_plus.__main__:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
