"""The torch Inductor fix the vLLM plugin applies in every server process (kernels/moeshrink_kernels/
inductor_fix.py): a node recomputed during the CPU backend's fusion keeps depending on the op that
wrote its input in place, so the compiled graph never reads a buffer before it is written.

The graph below is the shape of a DeepSeek-V3 router on vLLM's CPU build without AMX: the gate is an
out-parameter op writing into a fresh `torch.empty` (vLLM's `_C::onednn_mm`), a second such op reads
the same input (the shared expert), and the logits go through sigmoid and top-k. Without the fix,
torch 2.13 compiled it (on an AVX-512 machine) to run the sigmoid before the gate had written.
"""
import pytest
import torch
import torch._inductor.config as inductor_config

from moeshrink_kernels import inductor_fix

_LIBRARY = torch.library.Library("moeshrink_test", "DEF")
_LIBRARY.define("linear_out(Tensor(a!) out, Tensor x, Tensor weight) -> ()")


def _linear_out(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    out.copy_(x @ weight.t())


_LIBRARY.impl("linear_out", _linear_out, "CPU")
torch.library.register_fake("moeshrink_test::linear_out", lambda out, x, weight: None)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    torch.ops.moeshrink_test.linear_out(out, x, weight)
    return out


def test_the_fix_is_applied_once_and_leaves_the_scheduler_keeping_mutation_renames():
    from torch._inductor.scheduler import SchedulerNode

    first = inductor_fix.apply()
    assert inductor_fix.apply() in ("already applied", first)
    assert not inductor_fix._drops_mutation_renames(SchedulerNode.recompute_size_and_body)
    if first.startswith("applied"):
        assert inductor_fix.CACHE_KEY_TAG in torch.compiler.config.cache_key_tag.split(";")


@pytest.mark.parametrize("experts", [16, 64])
def test_a_router_behind_an_out_parameter_gate_compiles_to_what_eager_computes(experts):
    inductor_fix.apply()
    torch.manual_seed(0)
    gate = torch.randn(experts, 128).to(torch.bfloat16)
    shared = torch.randn(128, 128).to(torch.bfloat16)
    bias = torch.rand(experts)

    def router(x: torch.Tensor):
        logits = _linear(x, gate)
        shared_out = _linear(x, shared)
        scores = logits.float().sigmoid()
        chosen = (scores + bias).topk(4, dim=-1)[1]
        return scores.gather(1, chosen), chosen, shared_out

    x = torch.randn(46, 128).to(torch.bfloat16)
    expected = router(x)
    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=True):
        compiled = torch.compile(router, dynamic=True)(x)
    for got, want in zip(compiled, expected):
        assert torch.equal(got, want)
