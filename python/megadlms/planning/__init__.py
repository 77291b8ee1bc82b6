"""megadlms.planning: will a layout fit, how fast should it run -- without a GPU.

    from megadlms.planning import plan
    report = plan(config, device="H100")      # config: the trainer's RunConfig (parse_config)

Per-rank bytes of weights, gradients and optimizer state (:mod:`.memory`, equal to what the
wrappers allocate), activations (:mod:`.activations`), the step's FLOPs (the trainer's own
``models.num_floating_point_operations``), communication bytes per collective kind and a
predicted step time / MFU (:mod:`.throughput`, from the device table in :mod:`.devices`).
``megadlms-plan`` (:mod:`.cli`) prints it for the trainer's own flags; ``--sweep`` lists the
layouts that fit.
"""

from .memory import StateBytes, state_bytes

__all__ = ["StateBytes", "state_bytes"]
