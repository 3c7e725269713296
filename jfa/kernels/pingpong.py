"""Ping-pong: consumer warpgroups take turns issuing their wgmmas, round robin.

Two (or three) consumer warpgroups of one program share the SM's tensor cores. Left alone they
issue their matrix multiplies at the same moments and then all run their softmax at the same
moments, so the tensor cores idle during the exponentials. Taking turns staggers them: while one
warpgroup's wgmmas run, the other computes its softmax (FlashAttention-3's "ping-pong" schedule;
with three warpgroups, its head-dim-64 one).

A turn is a pair of named barriers: consumer c waits on barrier FIRST + c before it issues and
arrives on the next consumer's barrier right after issuing (not after completion), so its wgmmas
queue on the tensor cores ahead of the next consumer's.

    pingpong_start(cid, CONSUMERS)          # once, before the first turn
    pingpong_enter(cid)
    ... tlx.async_dot(...) ...              # the turn: issue only
    pingpong_exit(cid, CONSUMERS)
"""
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

# Named barriers 0..15 exist per CTA; Triton itself uses low ids, the TLX tutorials use 9 and 10
# for the ping-pong handshake and so do we.
PINGPONG_BARRIER_FIRST: tl.constexpr = tl.constexpr(9)  # consumer c's turn barrier is FIRST + c
PINGPONG_THREADS: tl.constexpr = tl.constexpr(256)  # the waiting warpgroup's and the handing one's threads


@triton.jit
def pingpong_start(cid: tl.constexpr, CONSUMERS: tl.constexpr = 2):
    """Called once by each consumer before its first turn: the last consumer lets consumer 0 go first."""
    if cid == CONSUMERS - 1:
        tlx.named_barrier_arrive(PINGPONG_BARRIER_FIRST, PINGPONG_THREADS)


@triton.jit
def pingpong_enter(cid: tl.constexpr):
    """Wait for our turn to issue (the consumer before us, round robin, has issued its own)."""
    tlx.named_barrier_wait(PINGPONG_BARRIER_FIRST + cid, PINGPONG_THREADS)


@triton.jit
def pingpong_exit(cid: tl.constexpr, CONSUMERS: tl.constexpr = 2):
    """Hand the turn to the next consumer right after issuing."""
    tlx.named_barrier_arrive(PINGPONG_BARRIER_FIRST + (cid + 1) % CONSUMERS, PINGPONG_THREADS)
