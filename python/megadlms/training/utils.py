"""Megatron's ``megatron.training.utils`` names that scripts import: the wrapper classes
and ``unwrap_model`` (the one implementation lives in ``megadlms.distributed.wrappers``)."""

from megadlms.distributed import ALL_MODULE_WRAPPER_CLASSNAMES, unwrap_model

__all__ = ["ALL_MODULE_WRAPPER_CLASSNAMES", "unwrap_model"]
