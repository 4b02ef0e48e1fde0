"""Module 07, part 2 - FSDP's communication and buffer arithmetic, before running anything.

For blocks of P parameters of b bytes each, sharded over N ranks (padded to a multiple of N):

  payload per collective  = ceil(P / N) * b       one rank's shard, all-gathers and reduce-scatters alike
  per block and micro-step: an all-gather in the forward, another in the backward, a reduce-scatter
                            of its gradient: 3 collectives, 3 payloads
  buffers                 = 2 full blocks (N * ceil(P / N) * b each: one in use, one being gathered)
                          + 2 shard-sized communication buffers (ceil(P / N) * b each)

A block that is still in a buffer when it is needed again (same layer, weights unchanged since it
was gathered) is reused without a collective: `kept` such blocks at each turn between a forward
and a backward save `kept` all-gathers per turn. Our double buffer keeps the last two layers, so
kept = min(2, blocks); PyTorch's FSDP Notes (its worked example of buffer sizes) count with kept = 0.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class FSDPTraffic:
    payload_bytes: int       # one collective, one rank
    all_gathers: int         # per optimizer step
    reduce_scatters: int     # per optimizer step
    collectives: int         # all_gathers + reduce_scatters
    traffic_bytes: int       # collectives * payload_bytes, one rank, per optimizer step
    full_buffer_bytes: int   # the two unsharded block buffers
    comm_buffer_bytes: int   # the two shard-sized communication buffers
    buffer_bytes: int        # both together


def fsdp_traffic(block_params: int, dtype_bytes: int, world_size: int, blocks: int,
                 n_microbatches: int = 1, kept: int = 0) -> FSDPTraffic:
    """The collectives and buffers of one optimizer step of FSDP over `blocks` equal blocks.

    `n_microbatches` forward+backward passes per optimizer step (gradient accumulation); `kept` blocks
    reused from the buffers at each forward/backward turn (see the module docstring).
    """
    if not 0 <= kept <= min(2, blocks):
        raise ValueError(f"kept must be between 0 and min(2, blocks) = {min(2, blocks)}, got {kept}")
    # >>> TODO(m07): one optimizer step's payload, collective counts and buffer bytes
    # Return an FSDPTraffic with every field filled (see its comments): `blocks` blocks of block_params
    # parameters of dtype_bytes bytes each, sharded over world_size ranks, n_microbatches forward+backward
    # passes per optimizer step, and `kept` blocks reused at each turn between two passes (module docstring).
    # Maths: a payload is one rank's shard, padded like FlatLayout's; every pass gathers every block, except the
    # `kept` blocks still in the buffers at a turn; every block's gradient is reduce-scattered once per
    # microbatch; a full buffer holds world_size shards.
    # Pitfall: counting the turns: a step alternates forward, backward, forward, ..., backward, and the turns are
    # the boundaries between consecutive passes. The tests check PyTorch's FSDP Notes' worked example (kept 0)
    # and counts written out by hand for kept 1 and 2, several microbatches, and a payload that needs padding.
    # Hint 1: count the passes (two per microbatch) and the turns between them (one fewer than the passes); each
    #         turn saves `kept` all-gathers.
    # Hint 2: payload = ceil(block_params / world_size) * dtype_bytes (integer ceiling); turns = 2M - 1;
    #         all-gathers = 2 blocks M - kept turns; reduce-scatters = blocks M; full buffers 2 N payloads,
    #         communication buffers 2 payloads; traffic = collectives times payload.
    # Hint 3: shard_bytes = the padded shard's size in bytes;  turns, all-gathers, reduce-scatters as above
    #         collectives = their sum;  full, comm = the two buffer totals
    #         return FSDPTraffic's eight fields in its order: payload, the three counts, traffic, full, comm, total
    shard_bytes = -(-block_params // world_size) * dtype_bytes
    turns = 2 * n_microbatches - 1
    all_gathers = 2 * blocks * n_microbatches - kept * turns
    reduce_scatters = blocks * n_microbatches
    collectives = all_gathers + reduce_scatters
    full_buffers, comm_buffers = 2 * world_size * shard_bytes, 2 * shard_bytes  # a full buffer holds N shards
    return FSDPTraffic(shard_bytes, all_gathers, reduce_scatters, collectives, collectives * shard_bytes,
                       full_buffers, comm_buffers, full_buffers + comm_buffers)
    # <<<
