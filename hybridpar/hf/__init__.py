"""Hugging Face causal LMs on hybridpar: `to_sequential`, name maps, checkpoints, meta init.

Needs the optional extra ``hybridpar[hf]`` (``transformers``, ``safetensors``) only when its
functions run; ``import hybridpar`` never imports it.
"""

from hybridpar.hf.blocks import DecoderBlock, TokenPositionEmbedding
from hybridpar.hf.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from hybridpar.hf.glue import GLUE, Glue, InputLayer, LogitsLayer
from hybridpar.hf.init import init_fn
from hybridpar.hf.keys import KeyMap, hf_state_dict, key_map, sequential_state_dict
from hybridpar.hf.plan import config_of, tp_plan
from hybridpar.hf.sequential import to_sequential
from hybridpar.hf.shard_load import ShardLoad, init_for_loading, load_hf_shards

__all__ = [
    "GLUE",
    "DecoderBlock",
    "Glue",
    "InputLayer",
    "KeyMap",
    "LogitsLayer",
    "ShardLoad",
    "TokenPositionEmbedding",
    "config_of",
    "hf_state_dict",
    "init_fn",
    "init_for_loading",
    "key_map",
    "load_hf_checkpoint",
    "load_hf_shards",
    "save_hf_checkpoint",
    "sequential_state_dict",
    "to_sequential",
    "tp_plan",
]
