"""`KernelSpec`: one kernel configuration as `triton.compile` takes it, without launching it.

Every kernel module and tutorial describes its configurations with it (`inspect_spec()`); the
workbench's `jfa.workbench.inspect` compiles them for a named target on any machine. It lives beside
the kernels so that they never import the workbench.
"""
from __future__ import annotations

import dataclasses

import torch

TRITON_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv"}  # signature names
TRITON_DEFAULT_NUM_STAGES = 3  # triton.backends.nvidia.compiler.CUDAOptions.num_stages


@dataclasses.dataclass
class KernelSpec:
    """Everything `triton.compile` needs to build one kernel configuration without launching it.

    `signature` maps each runtime argument to its Triton type ("*fp16", "i32", "fp32",
    "tensordesc<fp16[64,64]>"); constexpr arguments are listed only in `constexprs` (their
    signature entry is filled in). `role_names` labels the warp-specialized roles in order:
    the default task first, then each `tlx.async_task` region (a `replicate=R` task counts R times).
    `target` is the architecture the kernel is written for, used when `inspect` is given none.
    `num_stages` must be what the kernel is launched with (it decides which of Triton's pipeliner
    passes run); the default is Triton's own, for kernels launched without one.
    """

    fn: object
    signature: dict
    constexprs: dict = dataclasses.field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = TRITON_DEFAULT_NUM_STAGES
    name: str | None = None
    role_names: tuple = ()
    target: str = "sm_90"
    # Integer arguments that are multiples of 16 in real launches (row strides of packed tensors).
    # Triton's launcher specializes such values, and every pointer torch allocates, as divisible by
    # 16; the compile here does the same, or the code it shows would not be the code that runs
    # (unaligned stores take other layouts and more registers).
    aligned: tuple = ()

    def __post_init__(self):
        if self.name is None:
            self.name = self.fn.__name__
