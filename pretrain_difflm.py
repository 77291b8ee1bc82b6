"""Pretrain a diffusion language model: ``torchrun --nproc_per_node=N pretrain_difflm.py --flags``.

Megatron-LM / MegaDLMs flags; see docs/training.md and docs/flags.md.
"""

import os
import sys

if __name__ == "__main__":
    # Run from a source checkout without installing: put python/ on the path.
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.isdir(os.path.join(here, "python", "megadlms")):
        sys.path.insert(0, os.path.join(here, "python"))
        sys.path.insert(0, here)
    from megadlms.pretrain import main

    sys.exit(main())
