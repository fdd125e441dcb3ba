"""The packages, beside pyproject.toml: the top-level configs/ (the project's source of truth) installs as
jaxscale/configs, where :func:`jaxscale.config.read.config_dir` finds it without a source checkout."""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["jaxscale", "jaxscale.*"], exclude=["*.__pycache__"]),
              "jaxscale.configs"],
    package_dir={"jaxscale.configs": "configs"},
    package_data={"jaxscale.configs": ["*/*.yaml"], "jaxscale.data.corpus": ["*.txt.gz"]},
)
