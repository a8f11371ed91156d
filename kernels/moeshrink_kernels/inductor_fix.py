"""A fix for a torch Inductor scheduling defect that makes vLLM's CPU build serve uninitialised memory.

The defect (seen in torch 2.13.0): `SchedulerNode.recompute_size_and_body` re-derives a node's reads
from its loop body, which names buffers by their *real* names, and re-applies the node's
`mutation_renames` only when the node also carries fake (weak/star) dependencies. Inductor's CPU
backend calls it while fusing nodes whose loop ranges differ. A fused node that reads a buffer
written in place by an out-parameter op (vLLM's `_C::onednn_mm(Tensor! c, ...)` into a fresh
`torch.empty`) then depends on the empty buffer instead of on the op's mutation, and the
peak-memory reorder is free to run it first: it reads uninitialised memory. In a DeepSeek-V3 MoE
layer the router's logits are such a buffer, so routing weights came out NaN or random,
intermittently, on CPUs where the CPU backend fuses the router's kernels that way (AVX-512
without AMX: the gate runs through oneDNN there).

`apply()` checks the installed function's behaviour on a stand-in node and, only where it drops
the renames, wraps it so that the renames always apply. It is idempotent and touches nothing when
torch is fixed. Graphs compiled before the fix stay in Inductor's cache under the same key, so the
fix also tags torch's compile-cache key (`torch.compiler.config.cache_key_tag`).
"""
from __future__ import annotations

import functools
from typing import Any

_FIX_MARK = "_moeshrink_keeps_mutation_renames"
# added to torch's compile-cache key once the fix is applied, so that no graph compiled without it
# (in Inductor's or vLLM's caches) is ever loaded; bump it when the fix changes
CACHE_KEY_TAG = "moeshrink-inductor-mutation-renames-1"


def _drops_mutation_renames(recompute: Any) -> bool:
    """Run `recompute` on a stand-in node that reads `buf0`, mutated into `buf2`, with no fake
    dependencies; True when the read comes back as `buf0` (the defect)."""
    import sympy
    from torch._inductor.dependencies import MemoryDep, ReadWrites
    from torch.utils._ordered_set import OrderedSet

    index = sympy.Symbol("d0", integer=True)
    read = MemoryDep("buf0", index, (index,), (sympy.Integer(4),))

    class StandIn:
        mutation_renames = {"buf0": "buf2"}
        read_writes = ReadWrites(OrderedSet([read]), OrderedSet(), OrderedSet())

        def _compute_attrs(self, **_: Any) -> None:
            self.read_writes = ReadWrites(OrderedSet([read]), OrderedSet(), OrderedSet())

        def set_read_writes(self, read_writes: ReadWrites) -> None:
            self.read_writes = read_writes

    node = StandIn()
    node.read_writes = node.read_writes.rename(node.mutation_renames)
    recompute(node)
    return {dep.name for dep in node.read_writes.reads} == {"buf0"}


def apply() -> str:
    """Fix the installed Inductor if it has the defect. Returns what was done, for the log."""
    try:
        from torch._inductor.scheduler import SchedulerNode
    except ImportError:
        return "torch Inductor not importable: nothing to fix"
    original = SchedulerNode.recompute_size_and_body
    if getattr(original, _FIX_MARK, False):
        return "already applied"
    try:
        defective = _drops_mutation_renames(original)
    except Exception as error:  # an Inductor whose internals moved on: leave it alone, say so
        return f"not checked ({type(error).__name__}: {error}); Inductor left as installed"
    if not defective:
        return "not needed: this torch keeps mutation renames when it recomputes a node"

    @functools.wraps(original)
    def recompute_size_and_body(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    setattr(recompute_size_and_body, _FIX_MARK, True)
    SchedulerNode.recompute_size_and_body = recompute_size_and_body
    _tag_compile_caches()
    return (f"applied: SchedulerNode.recompute_size_and_body now keeps mutation renames; compile-cache key "
            f"tag {CACHE_KEY_TAG!r}")


def _tag_compile_caches() -> None:
    import torch.compiler

    tags = [tag for tag in torch.compiler.config.cache_key_tag.split(";") if tag]
    if CACHE_KEY_TAG not in tags:
        torch.compiler.config.cache_key_tag = ";".join([*tags, CACHE_KEY_TAG])
