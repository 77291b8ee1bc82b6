"""Standard evaluation: the lm-evaluation-harness adapter (``lm_eval_adapter``)."""
