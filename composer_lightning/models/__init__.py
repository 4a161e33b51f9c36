"""Models: loading a policy (a local directory or a hub id), LoRA, FSDP2 sharding, its weights
under their HF names (what engines are pushed), and export of a checkpoint.

May import: `functional`, `runtime`.
"""
