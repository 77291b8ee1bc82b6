"""megadlms: a training runtime for diffusion language models.

Layers (each imports only from the ones below): training -> distributed, optimizer
-> models, diffusion, data -> megadlm_ext. The manual: README.md and docs/.
"""

__version__ = "0.1.0"
