"""Benchmark providers: one builder per attention implementation, all fed the same `Problem`.

A builder takes one input set (a `Problem`, which `jfa.workbench.bench` builds) and returns a
`ProviderRun`: a `forward` closure that launches the provider's kernel on tensors prepared outside the
timed region, a `to_packed` function that turns its raw output into the packed `[T_out, H, D]` layout
of the reference, and the leaf tensors whose gradients the backward fills. A builder that cannot serve the problem raises
`ProviderUnavailable` with the reason ("no FP8 in FA2", "flash_attn_interface not importable"), which
the benchmark records as a failed row instead of a number.

Layout conversions a peer needs (Q expanded B times for broadcast-Q, [B, H, N, D] for SDPA) are done
once here, never inside `forward`, so the timed region holds the peer's kernel only; the `note`
says what was done so the report can show it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from jfa import specs

# Kinds a peer's varlen API covers directly. Block attention rides on it too: every 64-token block
# is handed over as its own sequence (the problem carries the block offsets).
VARLEN_KINDS = ("jagged", "pma", "dense", "block")
EXPANDED_Q_NOTE = "Q expanded B times outside the timed region (peer has no broadcast-Q); dQ is not summed"
BLOCKS_AS_SEQUENCES_NOTE = "each 64-token block passed as its own sequence"
FP8_NO_BACKWARD = "unavailable: the FP8 kernels are forward-only"


# ---- what every builder is fed: the tensors of one input set of one case -------------------------
@dataclass
class Problem:
    """One input set of one benchmark case: the packed tensors, their offsets and lengths. It lives
    here, with its consumers, so that the bench (which builds it) imports the providers and never
    the reverse."""

    kind: str
    batch: int
    heads: int
    head_dim: int
    q: torch.Tensor  # [Tq, H, D]; [q_len, H, D] for pma
    k: torch.Tensor
    v: torch.Tensor
    q_offsets: torch.Tensor  # int32 [B+1]; [0, q_len] for pma
    kv_offsets: torch.Tensor
    q_lens: list[int]  # per batch (pma: q_len repeated B times)
    kv_lens: list[int]
    max_q: int
    max_kv: int
    block_offsets: torch.Tensor | None = None  # block kind: offsets of every 64-token block
    kv_block_idx: torch.Tensor | None = None  # block_sparse: [B, H, n_q_blocks, max_sel], -1 padded
    kv_block_dense: torch.Tensor | None = None  # block_sparse: the same selection as [B, H, nqb, nkb] bool

    @property
    def out_rows(self) -> int:
        return sum(self.q_lens)


class ProviderUnavailable(RuntimeError):
    """The provider cannot run this problem here; the message says why (it starts with 'unavailable:')."""

    def __init__(self, why: str):
        super().__init__(f"unavailable: {why}")


@dataclass
class ProviderRun:
    forward: Callable[[], torch.Tensor]
    to_packed: Callable[[torch.Tensor], torch.Tensor]
    grad_inputs: list[torch.Tensor]
    no_backward: str | None = None  # why this provider has no backward here; None: it has one
    notes: list[str] = field(default_factory=list)


def _import(module: str, provider: str):
    try:
        return importlib.import_module(module)
    except Exception as exc:  # any import failure (missing package, ABI, CUDA) means "not here"
        raise ProviderUnavailable(f"{provider}: `import {module}` failed ({type(exc).__name__}: {exc})") from None


def _require_kind(problem: Problem, provider: str, kinds) -> None:
    if problem.kind not in kinds:
        raise ProviderUnavailable(f"{provider} has no API for the {problem.kind!r} kind")


@dataclass
class _Varlen:
    """The arguments every varlen API shares, with broadcast-Q expanded and blocks as sequences."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    max_q: int
    max_kv: int
    notes: list[str]


def _varlen_args(problem: Problem, provider: str) -> _Varlen:
    _require_kind(problem, provider, VARLEN_KINDS)
    q, k, v = problem.q, problem.k, problem.v
    cu_q, cu_kv, max_q, max_kv, notes = problem.q_offsets, problem.kv_offsets, problem.max_q, problem.max_kv, []
    if problem.kind == "pma":
        batch = problem.batch
        q = problem.q.detach().repeat(batch, 1, 1).requires_grad_(problem.q.requires_grad)
        cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * problem.q.shape[0]
        notes.append(EXPANDED_Q_NOTE)
    if problem.kind == "block":
        cu_q = cu_kv = problem.block_offsets
        max_q = max_kv = specs.BLOCK_ATTENTION_BLOCK
        notes.append(BLOCKS_AS_SEQUENCES_NOTE)
    return _Varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, notes)


def _first(out):
    """Some APIs return (out, lse) depending on version or flags; the benchmark needs out."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _identity(out: torch.Tensor) -> torch.Tensor:
    return out


# ---- jfa -------------------------------------------------------------------------------------
JFA_KERNEL_BACKEND = "tlx-sm90"  # what jfa.backend_for(q) answers when the TLX forward kernel runs
JFA_VALIDATED_NOTE = "inputs validated once outside the timed region; timed: jfa.ops.jagged_attention_validated"
SPARSE_VALIDATED_NOTE = ("inputs validated once outside the timed region; timed: the jfa::block_sparse_attention_fwd "
                         "op, which canonicalizes the selection on the GPU")


def _jfa_kernel_or_why(module: str, q: torch.Tensor) -> str | None:
    """None when jfa.kernels.<module> imports and accepts q, else why not (never time the reference)."""
    try:
        kernels = importlib.import_module(f"jfa.kernels.{module}")
    except Exception as exc:  # a missing or broken kernel module is a reason, not a crash
        return f"jfa.kernels.{module} did not import ({type(exc).__name__}: {exc})"
    return None if kernels.is_supported(q) else f"jfa.kernels.{module}.is_supported(q) is False here"


def _build_jfa_jagged(problem: Problem) -> ProviderRun:
    """`jfa.jagged_attention` with its check done once here: the public call re-reads the offsets
    on every call (a device-to-host sync) that the peers do not pay, which would be timed otherwise."""
    jfa = _import("jfa", "jfa")
    backend = jfa.backend_for(problem.q)
    if backend != JFA_KERNEL_BACKEND:
        raise ProviderUnavailable(f"jfa forward would run the {backend}")
    q, k, v = problem.q, problem.k, problem.v
    checked = jfa.jagged.validate_jagged_attention(q, k, v, problem.q_offsets, problem.kv_offsets, problem.max_q,
                                                   problem.max_kv, sm_scale=None, causal=False, window=None,
                                                   broadcast_q=problem.kind == "pma")
    args = (q, k, v, problem.q_offsets, problem.kv_offsets, checked)
    return ProviderRun(lambda: jfa.ops.jagged_attention_validated(*args)[0], _identity, [q, k, v],
                       no_backward=_jfa_kernel_or_why("bwd_dkdv", q), notes=[JFA_VALIDATED_NOTE])


def build_jfa(problem: Problem) -> ProviderRun:
    """Our TLX kernels; refuses (unavailable) wherever jfa would fall back to the reference."""
    if problem.kind in ("jagged", "pma", "dense"):
        return _build_jfa_jagged(problem)
    q, k, v = problem.q, problem.k, problem.v
    if problem.kind == "block":
        why = _jfa_kernel_or_why("block_attn", q)
        if why:
            raise ProviderUnavailable(why)
        block = _import("jfa.block", "jfa")
        return ProviderRun(lambda: block.block_attention(q, k, v, problem.q_offsets), _identity, [q, k, v])
    jfa = _import("jfa", "jfa")
    if problem.kind == "block_sparse":
        why = _jfa_kernel_or_why("fwd_sm90", q)
        if why:
            raise ProviderUnavailable(why)
        sparse = _import("jfa.sparse", "jfa")
        block = specs.BLOCK_SPARSE_BLOCK
        args = (q, k, v, problem.q_offsets, problem.kv_offsets, problem.kv_block_idx, block, block)
        checked = sparse.validate_block_sparse_attention(*args, problem.max_q, problem.max_kv)
        op_args = args + (checked.max_seq_len_q, checked.max_seq_len_kv, checked.sm_scale, False)
        return ProviderRun(lambda: sparse.block_sparse_attention_fwd(*op_args)[0], _identity, [q, k, v],
                           notes=[SPARSE_VALIDATED_NOTE])
    if problem.kind == "fp8":
        if not hasattr(jfa, "jagged_attention_fp8"):
            raise ProviderUnavailable("jfa.jagged_attention_fp8 is not defined yet")
        args = (q, k, v, problem.q_offsets, problem.kv_offsets, problem.max_q, problem.max_kv)
        return ProviderRun(lambda: _first(jfa.jagged_attention_fp8(*args)), _identity, [],
                           no_backward=FP8_NO_BACKWARD)
    raise ProviderUnavailable(f"jfa has no entry point for the {problem.kind!r} kind")


# ---- FlashAttention 2 (PyTorch's varlen_attn), 3 and 4 ------------------------------------------
FA2_MAX_SEQUENCES = 65535  # CUDA's limit on gridDim.y, which FA2's varlen kernels index by sequence

def build_fa2(problem: Problem) -> ProviderRun:
    """FlashAttention-2 as shipped in PyTorch: `torch.nn.attention.varlen.varlen_attn`."""
    a = _varlen_args(problem, "fa2")
    sequences = a.cu_q.numel() - 1
    if sequences > FA2_MAX_SEQUENCES:  # the launch fails with "invalid argument" past this
        raise ProviderUnavailable(f"fa2 launches one grid row per sequence and CUDA caps a grid's y dimension at "
                                  f"{FA2_MAX_SEQUENCES}; this case has {sequences} sequences")
    varlen = _import("torch.nn.attention.varlen", "fa2")
    # Positional: the first seven parameters are the same in torch 2.11 and 2.13 (keywords differ).
    return ProviderRun(lambda: varlen.varlen_attn(a.q, a.k, a.v, a.cu_q, a.cu_kv, a.max_q, a.max_kv),
                       _identity, [a.q, a.k, a.v], notes=a.notes)


def build_fa3(problem: Problem) -> ProviderRun:
    """FlashAttention-3 (`flash_attn_interface`), the Hopper kernels; also its FP8 forward."""
    if problem.kind == "fp8":  # inputs already E4M3 with unit scales: no descale factors to pass
        a = _Varlen(problem.q, problem.k, problem.v, problem.q_offsets, problem.kv_offsets, problem.max_q,
                    problem.max_kv, [])
        grads, no_backward = [], FP8_NO_BACKWARD
    else:
        a = _varlen_args(problem, "fa3")
        grads, no_backward = [a.q, a.k, a.v], None
    fa3 = _import("flash_attn_interface", "fa3")

    def forward() -> torch.Tensor:
        return _first(fa3.flash_attn_varlen_func(a.q, a.k, a.v, a.cu_q, a.cu_kv, a.max_q, a.max_kv))
    return ProviderRun(forward, _identity, grads, no_backward=no_backward, notes=a.notes)


def build_fa4(problem: Problem) -> ProviderRun:
    """FlashAttention-4 (CuTe DSL, `flash_attn.cute`); on Hopper it runs its sm90 path."""
    a = _varlen_args(problem, "fa4")
    cute = _import("flash_attn.cute", "fa4")
    def forward() -> torch.Tensor:
        return _first(cute.flash_attn_varlen_func(a.q, a.k, a.v, cu_seqlens_q=a.cu_q, cu_seqlens_k=a.cu_kv,
                                                  max_seqlen_q=a.max_q, max_seqlen_k=a.max_kv))
    return ProviderRun(forward, _identity, [a.q, a.k, a.v], notes=a.notes)


# ---- SDPA: dense layout, or nested (jagged) tensors -------------------------------------------
SDPA_KINDS = ("dense", "jagged", "pma")
# cuDNN's nested-tensor SDPA arrived forward-only and behind TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1
# (pytorch#141178; scripts/bench_gpu.sh sets it): its jagged rows time the forward only.
CUDNN_NESTED_NO_BACKWARD = "unavailable: cuDNN's nested-tensor SDPA is forward-only"


def _build_sdpa(problem: Problem, backend_name: str, provider: str) -> ProviderRun:
    _require_kind(problem, provider, SDPA_KINDS)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    if problem.kind == "dense":
        leaves, views, to_packed, notes = _sdpa_dense(problem)
        no_backward = None
    else:
        leaves, views, to_packed, notes = _sdpa_nested(problem, provider)
        no_backward = CUDNN_NESTED_NO_BACKWARD if backend_name == "CUDNN_ATTENTION" else None

    def forward() -> torch.Tensor:
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(*views)

    return ProviderRun(forward, to_packed, list(leaves), no_backward=no_backward, notes=notes)


def _sdpa_dense(problem: Problem):
    """Equal-length sequences as `[B, H, N, D]` tensors (the layout SDPA's backends are built for)."""
    batch, seq = problem.batch, problem.max_q

    def to_bhnd(t: torch.Tensor) -> torch.Tensor:
        dense = t.detach().reshape(batch, seq, t.shape[1], t.shape[2]).transpose(1, 2).contiguous()
        return dense.requires_grad_(t.requires_grad)

    def to_packed(out: torch.Tensor) -> torch.Tensor:
        return out.transpose(1, 2).reshape(batch * seq, out.shape[1], out.shape[3])

    leaves = tuple(to_bhnd(t) for t in (problem.q, problem.k, problem.v))
    return leaves, leaves, to_packed, ["[B, H, N, D] layout made outside the timed region"]


def _sdpa_nested(problem: Problem, provider: str):
    """Jagged sequences as nested tensors over the packed rows (no padding, no copy but the
    broadcast-Q expansion): leaves `[B, j, H, D]` and the `[B, H, j, D]` views SDPA takes, made once
    outside the timed region; SDPA reads their offsets."""
    args = _varlen_args(problem, provider)
    leaves = tuple(torch.nested.nested_tensor_from_jagged(t.detach(), offsets.to(torch.int64))
                   .requires_grad_(t.requires_grad)
                   for t, offsets in ((args.q, args.cu_q), (args.k, args.cu_kv), (args.v, args.cu_kv)))

    def to_packed(out: torch.Tensor) -> torch.Tensor:
        return out.transpose(1, 2).values()

    return (leaves, tuple(t.transpose(1, 2) for t in leaves), to_packed,
            args.notes + ["nested jagged tensors (torch.nested, layout=jagged)"])


def build_sdpa_cudnn(problem: Problem) -> ProviderRun:
    return _build_sdpa(problem, "CUDNN_ATTENTION", "sdpa_cudnn")


def build_sdpa_flash(problem: Problem) -> ProviderRun:
    return _build_sdpa(problem, "FLASH_ATTENTION", "sdpa_flash")


# ---- FlexAttention (stock Triton, own process) ---------------------------------------------------
def _row_labels(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Sequence index of every packed row (int32), built from offsets without any T x T tensor."""
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    labels = torch.arange(len(lengths), device=offsets.device, dtype=torch.int32)
    return torch.repeat_interleave(labels, lengths, output_size=rows)


def _flex_mask_mod(problem: Problem, q_offsets: torch.Tensor, kv_offsets: torch.Tensor, q_rows: int):
    """The document mask of the sequences `_flex_sequences` gives (the block pattern for block-sparse
    on top) as a flex mask_mod."""
    q_doc = _row_labels(q_offsets, q_rows)
    kv_doc = _row_labels(kv_offsets, problem.k.shape[0])
    if problem.kind != "block_sparse":
        return lambda b, h, q_idx, kv_idx: q_doc[q_idx] == kv_doc[kv_idx]
    picked = problem.kv_block_dense  # [B, H, n_q_blocks, n_kv_blocks] bool
    # Sequence-local block number of every row, computed here so the mask_mod only gathers.
    q_block = _local_block(q_offsets, q_doc)
    kv_block = _local_block(kv_offsets, kv_doc)

    def mask_mod(b, h, q_idx, kv_idx):
        same = q_doc[q_idx] == kv_doc[kv_idx]
        return same & picked[q_doc[q_idx], h, q_block[q_idx], kv_block[kv_idx]]
    return mask_mod


def _local_block(offsets: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(doc.shape[0], device=doc.device, dtype=torch.int64)
    return ((rows - offsets[:-1].long()[doc.long()]) // specs.BLOCK_SPARSE_BLOCK).to(torch.int32)


# FlexAttention's default tile; the masks create_block_mask built for this benchmark used it too, so
# the kernels timed are the same ones as before.
FLEX_SPARSE_BLOCK = 128


@dataclass
class _TileSpans:
    """Which documents the FLEX_SPARSE_BLOCK-row tiles of one side (queries or keys) touch.

    Documents are numbered among the *live* ones only (rows on both sides), because only those make
    visible pairs; the live documents touching a tile are then a contiguous range of that numbering.
    """
    live_lo: torch.Tensor  # [n_tiles] first live document with a row in the tile
    live_hi: torch.Tensor  # [n_tiles] last one; live_hi < live_lo when the tile has no live row
    sole_doc: torch.Tensor  # [n_tiles] the document owning every row of a whole tile, else -1


def _live_before(q_offsets: torch.Tensor, kv_offsets: torch.Tensor) -> torch.Tensor:
    """[B + 1] number of live documents before each document, the numbering `_TileSpans` uses."""
    live = (q_offsets[1:] > q_offsets[:-1]) & (kv_offsets[1:] > kv_offsets[:-1])
    return torch.cat((live.new_zeros(1, dtype=torch.int64), torch.cumsum(live, 0)))


def _tile_spans(offsets: torch.Tensor, rows: int, live_before: torch.Tensor) -> _TileSpans:
    """Tile spans from the offsets alone: a binary search per tile end, never a per-row pass."""
    bounds = offsets.to(torch.int64)
    first_row = torch.arange(0, rows, FLEX_SPARSE_BLOCK, device=bounds.device, dtype=torch.int64)
    last_row = (first_row + FLEX_SPARSE_BLOCK).clamp(max=rows) - 1
    # right=True skips the empty documents that start where a non-empty one does.
    first_doc = torch.searchsorted(bounds, first_row, right=True) - 1
    last_doc = torch.searchsorted(bounds, last_row, right=True) - 1
    # A tile cut short by the end of the rows is padding for flex, so never unmasked.
    whole = (first_doc == last_doc) & (last_row - first_row + 1 == FLEX_SPARSE_BLOCK)
    return _TileSpans(live_before[first_doc], live_before[last_doc + 1] - 1,
                      torch.where(whole, first_doc, -1))


def _ordered_tiles(rows: _TileSpans, cols: _TileSpans) -> tuple[torch.Tensor, ...]:
    """For every row tile, the column tiles sharing a live document with it, in BlockMask's ordered
    form: (partial_num, partial_idx, full_num, full_idx), shaped [1, 1, R] and [1, 1, R, W].

    Both span bounds are non-decreasing along the tiles, so the candidates of a row tile are one
    contiguous range of columns found by binary search; the width W is the longest range, not the
    number of column tiles, which keeps this O(tiles) instead of O(row tiles x column tiles).
    """
    n_cols = cols.live_lo.shape[0]
    first = torch.searchsorted(cols.live_hi, rows.live_lo)
    count = (torch.searchsorted(cols.live_lo, rows.live_hi, right=True) - first).clamp(min=0)
    width = max(int(count.max()), 1)  # a host sync (one per table side): it sizes the index tensors
    step = torch.arange(width, device=first.device)
    # Clamped so that the padding past each row's count is still a valid tile index.
    col = (first[:, None] + step).clamp(max=n_cols - 1)
    # Inside the range only tiles without a live row (gaps between documents) can miss.
    touched = (step < count[:, None]) & (torch.maximum(rows.live_lo[:, None], cols.live_lo[col])
                                         <= torch.minimum(rows.live_hi[:, None], cols.live_hi[col]))
    full = touched & (rows.sole_doc[:, None] == cols.sole_doc[col]) & (rows.sole_doc[:, None] >= 0)
    return (*_ordered(touched & ~full, col), *_ordered(full, col))


def _ordered(selected: torch.Tensor, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num [1, 1, R], indices [1, 1, R, W]) int32 with the selected columns first, ascending, as
    flex's own `_dense_to_ordered` lays them out."""
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True)
    num = selected.sum(-1, dtype=torch.int32)
    return num[None, None], col.gather(-1, order).to(torch.int32)[None, None].contiguous()


def document_block_mask(mask_mod, q_offsets: torch.Tensor, kv_offsets: torch.Tensor, q_rows: int,
                        kv_rows: int):
    """The FlexAttention BlockMask of a document mask (query row i sees key j iff both belong to the
    same sequence), built from the offsets in O(tiles) work.

    `create_block_mask` would evaluate `mask_mod` on all q_rows x kv_rows pairs, minutes per GEM input
    set. The q-side (transposed) tables for the backward are built the same way instead of by
    `BlockMask.from_kv_blocks`, which densifies a [row tiles, column tiles] table to transpose it.
    The index tables are only as wide as the most tiles any tile touches, so `BlockMask.to_dense()`
    (which takes that width as the number of tiles) does not apply; flex's kernels read the strides.
    """
    from torch.nn.attention.flex_attention import BlockMask

    live_before = _live_before(q_offsets.to(torch.int64), kv_offsets.to(torch.int64))
    q_spans = _tile_spans(q_offsets, q_rows, live_before)
    kv_spans = _tile_spans(kv_offsets, kv_rows, live_before)
    kv_num, kv_idx, full_kv_num, full_kv_idx = _ordered_tiles(q_spans, kv_spans)
    q_num, q_idx, full_q_num, full_q_idx = _ordered_tiles(kv_spans, q_spans)
    return BlockMask(seq_lengths=(q_rows, kv_rows), kv_num_blocks=kv_num, kv_indices=kv_idx,
                     full_kv_num_blocks=full_kv_num, full_kv_indices=full_kv_idx, q_num_blocks=q_num,
                     q_indices=q_idx, full_q_num_blocks=full_q_num, full_q_indices=full_q_idx,
                     BLOCK_SIZE=(FLEX_SPARSE_BLOCK, FLEX_SPARSE_BLOCK), mask_mod=mask_mod)


def _flex_block_mask(flex, problem: Problem, mask_mod, q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
                     q_rows: int):
    """The block mask: a document mask built from the offsets, except for block-sparse, which keeps
    `create_block_mask` (its selection differs per head, and its problems are small)."""
    kv_rows = problem.k.shape[0]
    if problem.kind == "block_sparse":
        return flex.create_block_mask(mask_mod, None, problem.heads, q_rows, kv_rows, device=problem.q.device,
                                      _compile=True)
    return document_block_mask(mask_mod, q_offsets, kv_offsets, q_rows, kv_rows)


def _flex_sequences(problem: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """(packed q, q offsets, kv offsets, notes) of the sequences flex masks to, as the varlen peers
    get them: broadcast-Q expanded per batch, and the block kind's 64-token blocks as sequences."""
    if problem.kind == "block_sparse":
        return problem.q, problem.q_offsets, problem.kv_offsets, []
    args = _varlen_args(problem, "flex")
    return args.q, args.cu_q, args.cu_kv, args.notes


def build_flex(problem: Problem) -> ProviderRun:
    """FlexAttention with a document mask; run only by `jfa.workbench.flex_worker` (stock Triton)."""
    _require_kind(problem, "flex", ("jagged", "pma", "dense", "block", "block_sparse"))
    flex = _import("torch.nn.attention.flex_attention", "flex")
    q_src, q_offsets, kv_offsets, notes = _flex_sequences(problem)

    def to_1htd(t: torch.Tensor) -> torch.Tensor:
        return t.detach().transpose(0, 1).contiguous().unsqueeze(0).requires_grad_(t.requires_grad)

    q, k, v = to_1htd(q_src), to_1htd(problem.k), to_1htd(problem.v)
    mask_mod = _flex_mask_mod(problem, q_offsets, kv_offsets, q.shape[2])
    block_mask = _flex_block_mask(flex, problem, mask_mod, q_offsets, kv_offsets, q.shape[2])
    compiled = torch.compile(flex.flex_attention, dynamic=False)
    if problem.kind == "block_sparse":
        notes.append("mask via create_block_mask(_compile=True); flex_attention under torch.compile")
    else:
        notes.append("block mask built from the offsets (no T x T evaluation); flex_attention under torch.compile")

    def to_packed(out: torch.Tensor) -> torch.Tensor:
        return out[0].transpose(0, 1)

    return ProviderRun(lambda: compiled(q, k, v, block_mask=block_mask), to_packed, [q, k, v], notes=notes)


PROVIDERS: dict[str, Callable[[Problem], ProviderRun]] = {
    "jfa": build_jfa,
    "fa2": build_fa2,
    "fa3": build_fa3,
    "fa4": build_fa4,
    "flex": build_flex,
    "sdpa_cudnn": build_sdpa_cudnn,
    "sdpa_flash": build_sdpa_flash,
}
# FlexAttention compiles with the Triton that torch ships; the TLX Triton on the bench process's
# path would shadow it, so these run in `jfa.workbench.flex_worker` with a cleaned environment.
ISOLATED_PROVIDERS = frozenset({"flex"})
assert tuple(PROVIDERS) == specs.BENCH_PROVIDERS, "specs.BENCH_PROVIDERS and the registry must agree"
