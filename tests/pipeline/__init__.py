"""End-to-end runs of Snakemake and DVC in temporary copies of the repository.

A package on purpose: pytest imports a conftest.py outside a package as the module
``conftest``, which would shadow tests/conftest.py for the test modules that do
``from conftest import ...``. Inside a package this one is ``pipeline.conftest``.
"""
