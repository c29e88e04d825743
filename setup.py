"""Which packages the wheel holds (everything else is in pyproject.toml).

Discovered, not listed by hand (a hand list once left ``longpatch.parallel`` out of the wheel):
every package under longpatch/, plus the top-level kernels/ and configs/ folders (the design card's
layout), which install as ``longpatch.kernels`` and ``longpatch.configs``."""
from setuptools import find_packages, setup

TOP_LEVEL = ("kernels", "configs")  # folders beside longpatch/ that install inside it

setup(
    packages=find_packages(include=["longpatch", "longpatch.*"])
    + [f"longpatch.{p}" for p in find_packages(include=[f"{t}{s}" for t in TOP_LEVEL for s in ("", ".*")])],
    package_dir={"longpatch": "longpatch", **{f"longpatch.{t}": t for t in TOP_LEVEL}},
)
