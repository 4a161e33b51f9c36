"""The shipped tiny policies (data folders beside this file) and the scripts that build them.

Owns: `build_tiny.py` (the arithmetic policy, `tiny_policy/`) and `build_tiny_tool.py` (the
tool-calling policy, `tiny_tool_policy/`), each run as `python -m composer_lightning.assets.
build_tiny`. Runtime code reads the built folders through `models/tiny.py`, never these
builders.
May import: any room below it (they train on the tasks and environments).
"""
