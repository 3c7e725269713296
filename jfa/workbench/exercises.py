"""The fork exercises of notebooks 03-08: a hook to change, its starter code, a worked solution.

Each `Exercise` gives a notebook what its marked cell needs: `task` (what to change and why),
`starter` (the code the cell shows: it runs as it is, and builds `my_fork`, a fork that does not
yet do what the task asks), `params(heads, device)` (the runtime arguments its hooks read),
`options` (the call's flags: causal, window), `shows` (what the check must show once the task is
done), and `solution`, a `Variant` made from the `@triton.jit` hooks of this module. One call runs
an exercise's fork through the lab: `exercise.try_fork(my_fork)` (the solution when none is given).

| notebook | exercise | hooks |
|---|---|---|
| 03 jagged attention | a learned relative-position bias, clipped at a radius | score_mod, score_grad |
| 04 backward | a rational soft-cap and its derivative | score_mod, score_grad |
| 05 block-sparse | attention sinks and a sliding window, with a block mask that skips the rest | mask_mod, block_mask |
| 06 FP8 | P rounded to E4M3 before P·V, in the 16-bit kernel | pv |
| 07 block attention | causal attention inside each 64-token block, as a mask | mask_mod, block_mask |
| 08 write-up | history and candidates: a recommendation model's target-aware mask, per-head temperature | all four |

The solutions are tested: tests/test_exercises.py compiles each and runs its CPU checks;
tests/gpu/test_exercises.py runs each forward and backward against its reference on the GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa.kernels.hooks import DEFAULT_FORK
from jfa.variants import Variant, variant

__all__ = ["Exercise", "EXERCISES", "exercise"]


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One notebook's fork exercise (module docstring)."""

    notebook: str  # "03": the notebook it belongs to
    title: str
    task: str  # what the learner changes, and why it matters
    starter: str  # the code of the marked cell: runs as given, builds `my_fork`
    solution: Variant  # the worked solution
    make_params: Callable[[int, object], tuple]  # (query heads, device) -> the hooks' params
    shows: str  # what the check must show with the task done
    options: dict = dataclasses.field(default_factory=dict)  # the call's flags (causal, window)

    @property
    def name(self) -> str:
        """The solution's name as the GPU tests' ids spell it."""
        return self.solution.name.replace(" ", "_")

    def params(self, heads: int = 4, device=None) -> tuple:
        """The hooks' runtime arguments for `heads` query heads (4: the lab's shapes), on `device`."""
        return self.make_params(heads, device)

    def try_fork(self, fork: Variant | None = None, **kwargs):
        """`jfa.workbench.lab.try_fork` of `fork` (the worked solution by default) with this
        exercise's params and options; `kwargs` go to try_fork."""
        from jfa.workbench import lab

        return lab.try_fork(self.solution if fork is None else fork, self.params(), **{**self.options, **kwargs})

    def check(self, fork: Variant | None = None, **kwargs):
        """`jfa.workbench.lab.check` of `fork` (the worked solution by default) with this exercise's
        params and options."""
        from jfa.workbench import lab

        return lab.check(self.solution if fork is None else fork, params=self.params(), **{**self.options, **kwargs})

    def start(self) -> None:
        """Put the starter code into a new cell below (JupyterLab), or print it elsewhere."""
        try:
            from IPython import get_ipython
            shell = get_ipython()
        except ImportError:
            shell = None
        if shell is None:
            print(self.starter)
        else:
            shell.set_next_input(self.starter, replace=False)

    def _repr_markdown_(self) -> str:
        return f"**Exercise {self.notebook}: {self.title}.** {self.task}\n\n*Done when:* {self.shows}"

    def __repr__(self) -> str:
        return f"Exercise {self.notebook}: {self.title}\n{self.task}\nDone when: {self.shows}"


# ==== 03: a relative-position bias =========================================================================
@triton.jit
def relative_bias(score, seq, head, q_idx, k_idx, params):
    """score + table[head, clip(k - q, -radius, radius) + radius]: a learned bias per head and distance."""
    table, radius = params
    distance = tl.minimum(tl.maximum(k_idx - q_idx, -radius), radius)
    return score + tl.load(table + head * (2 * radius + 1) + distance + radius)


@triton.jit
def unit_grad(grad, score, seq, head, q_idx, k_idx, params):
    """The derivative of an additive bias: 1, so the gradient passes through."""
    return grad


RELATIVE_RADIUS = 64


def _relative_bias_params(heads: int, device) -> tuple:
    """A fixed table in [-1, 1]: each head leans a different way over the distances."""
    distance = torch.arange(-RELATIVE_RADIUS, RELATIVE_RADIUS + 1, dtype=torch.float32) / RELATIVE_RADIUS
    slope = torch.linspace(-1.0, 1.0, heads)[:, None]
    table = torch.tanh(2 * slope * distance[None, :]) - 0.5 * distance.abs()[None, :]
    return (table.contiguous().to(device), RELATIVE_RADIUS)


_STARTER_03 = '''import jfa
import triton
import triton.language as tl


@triton.jit
def relative_bias(score, seq, head, q_idx, k_idx, params):
    table, radius = params  # table: fp32 [heads, 2 * radius + 1], one bias per head and distance
    # TODO: clip the distance k_idx - q_idx to [-radius, radius] (tl.minimum, tl.maximum) and add
    # table[head, distance + radius] to the score: tl.load(table + head * (2 * radius + 1) + ...)
    return score


@triton.jit
def relative_bias_grad(grad, score, seq, head, q_idx, k_idx, params):
    return grad  # a bias added to the score has derivative 1


my_fork = jfa.variant("my relative bias", score_mod=relative_bias, score_grad=relative_bias_grad)
'''

RELATIVE_BIAS = Exercise(
    notebook="03", title="a learned relative-position bias",
    task=("Sequence models of user histories often add a learned bias per head and per distance between a query "
          "and a key, clipped at a radius. Write the score_mod that adds table[head, clip(k - q) + radius] to the "
          "score; the table comes in params."),
    starter=_STARTER_03,
    solution=variant("relative bias", score_mod=relative_bias, score_grad=unit_grad),
    make_params=_relative_bias_params,
    shows=("the reference differs from plain attention; the compile report shows what the table's gathers cost "
           "the forward (registers, spills); on a GPU out, LSE, dQ, dK, dV within tolerance of the reference"))


# ==== 04: a score modification and its derivative ============================================================
@triton.jit
def rational_softcap(score, seq, head, q_idx, k_idx, params):
    """score / (1 + |score| / cap): a soft-cap without tanh, bounded by cap."""
    return score / (1 + tl.abs(score) / params[0])


@triton.jit
def rational_softcap_grad(grad, score, seq, head, q_idx, k_idx, params):
    """grad times d/ds [s / (1 + |s| / cap)] = 1 / (1 + |s| / cap)^2."""
    shrink = 1 + tl.abs(score) / params[0]
    return grad / (shrink * shrink)


SOFTCAP_AT = 5.0  # below the spread of unit-variance logits at D=128 times a few: the cap bends many


_STARTER_04 = '''import jfa
import triton
import triton.language as tl


@triton.jit
def rational_softcap(score, seq, head, q_idx, k_idx, params):
    return score / (1 + tl.abs(score) / params[0])  # bounded by the cap, params[0]


@triton.jit
def rational_softcap_grad(grad, score, seq, head, q_idx, k_idx, params):
    # TODO: the backward needs grad * d rational_softcap / d score; this passes grad through unchanged,
    # which is right only for an additive bias. my_fork.check_score_grad(params=...) says by how much it is off.
    return grad


my_fork = jfa.variant("my rational softcap", score_mod=rational_softcap, score_grad=rational_softcap_grad)
'''

RATIONAL_SOFTCAP = Exercise(
    notebook="04", title="a soft-cap and its derivative",
    task=("The backward needs the derivative of every score modification: the dQ and dK/dV kernels multiply dS "
          "by it. The starter's score_grad passes the gradient through unchanged; write the derivative of "
          "s / (1 + |s| / cap)."),
    starter=_STARTER_04,
    solution=variant("rational softcap", score_mod=rational_softcap, score_grad=rational_softcap_grad),
    make_params=lambda heads, device: (SOFTCAP_AT,),
    shows=("check_score_grad passes (the starter fails it); on a GPU dQ and dK within tolerance of the "
           "reference's autograd gradients"))


# ==== 05: a mask that skips whole key tiles ==================================================================
@triton.jit
def sinks_and_window(seq, head, q_idx, k_idx, params):
    """The first params[0] keys (attention sinks) and the params[1] keys before each query."""
    return (k_idx < params[0]) | (q_idx - k_idx < params[1])


@triton.jit
def sinks_and_window_blocks(seq, head, q_lo, q_hi, k_lo, k_hi, params):
    """A block may hold a visible pair if it holds a sink or a key within the window of a row."""
    return (k_lo < params[0]) | (k_hi > q_lo - params[1])


_STARTER_05 = '''import jfa
import triton
import triton.language as tl


@triton.jit
def sinks_and_window(seq, head, q_idx, k_idx, params):
    sinks, window = params  # the first `sinks` keys, and the `window` keys before each query (with causal=True)
    return (k_idx < sinks) | (q_idx - k_idx < window)


@triton.jit
def sinks_and_window_blocks(seq, head, q_lo, q_hi, k_lo, k_hi, params):
    sinks, window = params
    # TODO: rule out the key blocks k_lo..k_hi that hold no sink and no key within the window of any
    # row q_lo..q_hi. True keeps every block: correct, but the kernels skip nothing.
    return True


my_fork = jfa.variant("my sinks and window", mask_mod=sinks_and_window, block_mask=sinks_and_window_blocks)
'''

SINKS_AND_WINDOW = Exercise(
    notebook="05", title="attention sinks and a sliding window that skip key tiles",
    task=("Streaming models keep a few first tokens (sinks) and a window of recent keys. The mask alone makes the "
          "kernels compute every key tile and mask most of it; a block mask lets them skip the tiles that hold no "
          "visible pair. Write the block mask, and never rule out a tile that holds one."),
    starter=_STARTER_05,
    solution=variant("sinks and window", mask_mod=sinks_and_window, block_mask=sinks_and_window_blocks),
    make_params=lambda heads, device: (4, 256),
    shows=("check_block_mask passes, and the block mask skips most key tiles of a 2048-token sequence (the starter "
           "skips none); on a GPU the kernel matches the reference and runs faster than without the block mask"),
    options={"causal": True})


# ==== 06: another P quantization ============================================================================
@triton.jit
def pv_e4m3(p, values, acc):
    """acc += P·V with P rounded to float8 E4M3 first (as the FP8 fork does), V kept 16-bit."""
    return tlx.async_dot(p.to(tl.float8e4nv).to(values.dtype), values, acc)


_STARTER_06 = '''import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from jfa.kernels.hooks import DEFAULT_FORK
from jfa.variants import Variant


@triton.jit
def pv_rounded(p, values, acc):
    # TODO: round p (fp32 probabilities) to float8 E4M3 (tl.float8e4nv) before the multiply, then to V's
    # dtype; try E5M2 (tl.float8e5) too: more range, one mantissa bit less
    return tlx.async_dot(p.to(values.dtype), values, acc)


my_fork = Variant("my rounded P", DEFAULT_FORK._replace(pv=pv_rounded))
'''

E4M3_P = Exercise(
    notebook="06", title="P in E4M3 inside the 16-bit kernel",
    task=("The FP8 fork rounds P to E4M3 on the fly before its P·V. How much of its error comes from P alone? "
          "Replace the P·V hook of the 16-bit kernel (Fork.pv) by one that rounds P to E4M3 first, and compare its "
          "agreement with the reference to the plain kernel's and the FP8 kernel's."),
    starter=_STARTER_06,
    solution=Variant("e4m3 P", DEFAULT_FORK._replace(pv=pv_e4m3)),
    make_params=lambda heads, device: (),
    shows=("the fork compiles (the compile report shows the conversion's cost); on a GPU its output agrees with the "
           "reference by cosine and SQNR above jfa.specs' FP8 bars, with an SQNR well below the plain kernel's"))


# ==== 07: a mask inside the 64-token blocks ==================================================================
@triton.jit
def block_causal(seq, head, q_idx, k_idx, params):
    """Keys of the query's own params[0]-token block, up to the query: causal block attention."""
    return (q_idx // params[0] == k_idx // params[0]) & (k_idx <= q_idx)


@triton.jit
def block_causal_blocks(seq, head, q_lo, q_hi, k_lo, k_hi, params):
    """A tile may hold a pair of one block, key not after query."""
    return (k_lo // params[0] <= q_hi // params[0]) & (k_hi // params[0] >= q_lo // params[0]) & (k_lo <= q_hi)


BLOCK = 64


_STARTER_07 = '''import jfa
import triton
import triton.language as tl


@triton.jit
def block_mask_mod(seq, head, q_idx, k_idx, params):
    block = params[0]  # 64: jfa.block_attention's blocks
    # TODO: make it causal inside each block (a key never after its query)
    return q_idx // block == k_idx // block


@triton.jit
def block_tiles(seq, head, q_lo, q_hi, k_lo, k_hi, params):
    block = params[0]
    # key tiles that share a block with some row; TODO: and hold a key not after some row
    return (k_lo // block <= q_hi // block) & (k_hi // block >= q_lo // block)


my_fork = jfa.variant("my block causal", mask_mod=block_mask_mod, block_mask=block_tiles)
'''

BLOCK_CAUSAL = Exercise(
    notebook="07", title="causal attention inside the 64-token blocks, as a jagged variant",
    task=("jfa.block_attention is a kernel of its own: each 64-token block attends to itself. The same pattern is a "
          "mask on jagged attention, and so is a variant of it. Make the starter's block-diagonal mask causal "
          "inside each block, with the block mask to match."),
    starter=_STARTER_07,
    solution=variant("block causal", mask_mod=block_causal, block_mask=block_causal_blocks),
    make_params=lambda heads, device: (BLOCK,),
    shows=("check_block_mask passes and the block mask skips almost every key tile; on a GPU the kernel matches the "
           "reference (the starter's mask matches jfa.block_attention's output)"))


# ==== 08: your own variant, end to end ======================================================================
@triton.jit
def target_aware(seq, head, q_idx, k_idx, params):
    """The first params[0] tokens are a user's history (causal among themselves); every later token is a
    candidate item that sees the whole history and itself, never another candidate."""
    history = params[0]
    return ((k_idx < history) & ((q_idx >= history) | (k_idx <= q_idx))) | (k_idx == q_idx)


@triton.jit
def target_aware_blocks(seq, head, q_lo, q_hi, k_lo, k_hi, params):
    """A tile may hold a history key some row sees, or a row's own key (the diagonal)."""
    history = params[0]
    return ((k_lo < history) & ((q_hi >= history) | (k_lo <= q_hi))) | ((k_lo <= q_hi) & (k_hi >= q_lo))


@triton.jit
def head_temperature(score, seq, head, q_idx, k_idx, params):
    """score * t[head]: a temperature per head (params[1], fp32 [heads])."""
    return score * tl.load(params[1] + head)


@triton.jit
def head_temperature_grad(grad, score, seq, head, q_idx, k_idx, params):
    return grad * tl.load(params[1] + head)


HISTORY = 128


def _target_aware_params(heads: int, device) -> tuple:
    return (HISTORY, torch.linspace(0.5, 1.5, heads, dtype=torch.float32).to(device))


_STARTER_08 = '''import jfa
import torch
import triton
import triton.language as tl


@triton.jit
def my_mask(seq, head, q_idx, k_idx, params):
    return k_idx >= 0  # TODO: which keys each query sees (here: all of them)


@triton.jit
def my_block_mask(seq, head, q_lo, q_hi, k_lo, k_hi, params):
    return True  # TODO: False for the key tiles rows q_lo..q_hi never see, so the kernels skip them


@triton.jit
def my_score(score, seq, head, q_idx, k_idx, params):
    return score  # TODO: your score modification


@triton.jit
def my_score_grad(grad, score, seq, head, q_idx, k_idx, params):
    return grad  # TODO: grad * d my_score / d score


my_fork = jfa.variant("my variant", score_mod=my_score, score_grad=my_score_grad, mask_mod=my_mask,
                      block_mask=my_block_mask)
my_params = (128, torch.ones(4))  # TODO: what your hooks read (tensors sized for 4 query heads)
'''

TARGET_AWARE = Exercise(
    notebook="08", title="your own variant, end to end",
    task=("Define a variant of your own: its hooks, their params, its check, its benchmark against the unforked "
          "kernel and the peers, and a write-up (lab.write_up). The worked solution is a recommendation model's "
          "target-aware attention: a user's history, causal, followed by candidate items that each see the "
          "history and themselves, with a temperature per head."),
    starter=_STARTER_08,
    solution=variant("target aware", score_mod=head_temperature, score_grad=head_temperature_grad,
                     mask_mod=target_aware, block_mask=target_aware_blocks),
    make_params=_target_aware_params,
    shows=("check_score_grad and check_block_mask pass; on a GPU the kernel matches the reference forward and "
           "backward; the write-up holds the hooks' code, the check, the benchmark table and plots, and the "
           "environment"))


EXERCISES = {e.notebook: e for e in (RELATIVE_BIAS, RATIONAL_SOFTCAP, SINKS_AND_WINDOW, E4M3_P, BLOCK_CAUSAL,
                                     TARGET_AWARE)}


def exercise(notebook: str) -> Exercise:
    """The exercise of a notebook ("03", or a notebook's file name such as "05_block_sparse.ipynb")."""
    key = str(notebook)[:2]
    if key not in EXERCISES:
        raise KeyError(f"exercise: no exercise for notebook {notebook!r}; there are {sorted(EXERCISES)}")
    return EXERCISES[key]
