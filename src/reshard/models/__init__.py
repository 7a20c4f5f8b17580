"""Reference models for reshard: a Megatron-style decoder that is exactly the Hugging Face Llama, Mixtral,
Qwen2-MoE and Qwen3-MoE architectures, under TP, PP (with virtual stages), DP, CP, EP, ETP and ZeRO-1, on CPU
with gloo.

This package is not part of the checkpointing library: the core never imports it. It exists so that the
library can be shown, tested and benchmarked on a real training state, loaded from and exported to real
Hugging Face and PEFT checkpoints. Its modules:

- :mod:`reshard.models.config`: :class:`ModelConfig`, :class:`LoraConfig` and the Hugging Face configs.
- :mod:`reshard.models.gpt`: :class:`GPTStage`, the part of the model one rank holds, with its layouts.
- :mod:`reshard.models.parallel`, :mod:`reshard.models.collectives`: process groups and the autograd
  collectives of tensor, sequence and expert parallelism.
- :mod:`reshard.models.hf`, :mod:`reshard.models.hf_export`, :mod:`reshard.models.peft`: Hugging Face
  names, ``export_hf`` and ``export_peft``.
"""

from reshard.models.config import LoraConfig, ModelConfig
from reshard.models.gpt import GPTStage, ParamLayout
from reshard.models.hf import hf_key_map
from reshard.models.hf_config import hf_config_of
from reshard.models.hf_export import export_hf
from reshard.models.parallel import ParallelConfig, ParallelGroups
from reshard.models.peft import export_peft

__all__ = [
    "GPTStage",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "ParallelGroups",
    "ParamLayout",
    "export_hf",
    "export_peft",
    "hf_config_of",
    "hf_key_map",
]
