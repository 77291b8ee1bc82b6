"""megadlms.experiments: end-to-end experiments built on the public CLI and library.

``crossover``: the DLM-vs-AR comparison under a fixed budget of unique tokens (Ni et al.,
"Diffusion Language Models are Super Data Learners", 2025), run with
``bash examples/crossover.sh [--quick] OUTDIR`` or ``python -m megadlms.experiments.crossover``.
"""
