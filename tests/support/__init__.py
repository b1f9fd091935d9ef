"""Helpers that the tests and the benchmarks share, tied to this checkout (they are not part of the installed
package): generated corpora (``corpora``), the tiny config and training entry (``tiny_config``,
``train_entry``), a trained yesno model (``trained_model``), step-level batches (``step_batches``),
exact-resume comparisons (``exact_resume``), faults on demand (``faults``), MLflow stores and servers
(``mlflow_store``, ``servers``), child processes (``processes``) and the exit status of each torchrun rank
(``exit_observer``), the repository and its tools (``repo``, ``pipeline_tools``), the local Slurm cluster
(``slurm_cluster``, ``slurm_pipeline``). No module imports pytest at its top. The spoken-corpus generator is a
user's tool and ships with the package: :mod:`asrflow.generate.spoken_corpus`.
"""
