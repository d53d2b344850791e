"""Megatron-Core: `parallel_state.initialize_model_parallel` builds the data, tensor and pipeline groups.

Data-parallel peers hold the same parameters (`replicate`; the distributed optimizer shards only the
optimizer state), tensor-parallel peers hold slices of each layer (`tensor`), pipeline peers different
layers (`pipeline`). Read through parallel_state's own getters once the call returned.
"""

from __future__ import annotations


def wrap_initialize(module, declare, on_error) -> None:
    from trainscout.integrations import after

    real = module.initialize_model_parallel

    def learn(_result, _args, _kwargs) -> None:
        for getter, role in (
            ("get_data_parallel_group", "replicate"),
            ("get_tensor_model_parallel_group", "tensor"),
            ("get_pipeline_model_parallel_group", "pipeline"),
            ("get_context_parallel_group", "context"),
        ):
            try:
                group = getattr(module, getter)()
            except Exception:
                continue  # not built in this configuration
            if group is not None:
                declare(group, role, "Megatron-Core")

    module.initialize_model_parallel = after(real, learn, on_error, "Megatron-Core")
