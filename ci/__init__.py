"""The commands behind `make` (run, cluster-up, job, plan) and the GPU measurements (`ci.gpu`).

Run from the project's root as modules: `python -m ci.run_notebooks`, `python -m ci.gpu.llama`.
"""
