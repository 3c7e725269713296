"""The workbench: the tools that measure, inspect and show the kernels, above the runtime they use.

| module | what |
|---|---|
| `cli` | `python -m jfa COMMAND`: check, bench, head-to-head, report, inspect |
| `bench` | benchmark suites: check every provider against the reference, time it, append JSON rows |
| `providers` | one builder per attention implementation (jfa and its peers), fed the same `Problem` |
| `flex_worker` | runs FlexAttention's cases in a process of their own, with the Triton torch ships |
| `head_to_head` | jfa against its peers, interleaved in one process |
| `report` | results JSON files -> one HTML page |
| `plots`, `widgets` | the notebooks' figures, tables and panels |
| `inspect` | compile a kernel without a GPU: warp roles, registers, shared memory, spills, MMA loops |
| `envinfo` | the environment block of every recording |

Imports run one way: the workbench imports the runtime (`jfa`, `jfa.ops`, `jfa.jagged`, ...) and the
kernels, never the reverse (`tests/test_layers.py`). Importing this package imports none of its
modules, so `python -m jfa check` stays fast and plotly stays optional.
"""
